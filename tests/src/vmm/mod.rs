//! A small built-in VMM for end-to-end tests of the guest agent on real KVM.
//!
//! It boots a PVH ELF (the same file QEMU `-kernel` takes) on one vCPU with kvm-ioctls,
//! emulates two polled 16550 UARTs and the isa-debug-exit port, and nothing else:
//!
//! - COM1 (0x3f8) is connected to an in-process [`SerialHost`]; every byte is stamped with the
//!   host TSC at the VM exit that moved it, which gives the probe engine host send/receive times
//!   without any scheduler or pipe latency in between.
//! - COM2 (0x2f8) is collected and decoded as the agent's defmt log against the booted ELF
//!   ([`Vm::log_lines`], [`Vm::log_text`]; [`defmt_log`]). An ELF without defmt data gets its
//!   COM2 bytes shown as text instead.
//! - A write of `v` to port 0xf4 ends the run with [`VmExit::DebugExit`]`(v)`.
//!
//! Every exit is stamped with the host TSC right after `KVM_RUN` returns, and each COM1 byte
//! also carries the stamp of the exit before it ([`SerialByte::prev_exit_host_tsc`]): a guest
//! TSC read between two exits lies between KVM's mapping of their stamps (the VM's debugfs
//! mapping, [`Vm::debugfs_id`] and [`crate::truth`]; docs/launching.md). CPUID is KVM's supported set with the vCPU's APIC
//! id and the TSC frequency (timing leaf 0x40000010) filled in, as QEMU does;
//! [`Vm::kvm_clock`] exposes `KVM_GET_CLOCK` as the host's view of kvmclock. [`client`] makes
//! COM1 a `StampedTransport` for vmtsync's `ProbeSession`; [`qemu`] builds the equivalent QEMU command line.
//!
//! A watchdog bounds every run: past [`VmConfig::timeout`] the vCPU thread is kicked out of
//! `KVM_RUN` with a signal and the run ends with [`VmExit::Timeout`], so a hung guest (a
//! livelocked `vmcall`, a spin without exits) never hangs a test.

mod agent_build;
mod boot;
pub mod client;
pub mod defmt_log;
pub mod qemu;
pub mod serial;
pub mod tsc;
pub mod vsock;

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};

pub use agent_build::agent_elf;
use defmt_log::{DefmtLog, LogLine};
use serial::{ExitStamp, TxSink, Uart16550, lock};
pub use serial::{SerialByte, SerialHost};

/// I/O base of COM1, the probe UART.
pub const COM1_BASE: u16 = 0x3f8;
/// I/O base of COM2, the log UART.
pub const COM2_BASE: u16 = 0x2f8;
/// Port of the isa-debug-exit device.
pub const DEBUG_EXIT_PORT: u16 = 0xf4;
/// Offset from `SIGRTMIN` of the signal that kicks the vCPU thread out of `KVM_RUN`.
const KICK_SIGNAL_OFFSET: i32 = 4;

/// What to boot and for how long.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Guest RAM in bytes, mapped at guest-physical 0 (at least 2 MiB).
    pub mem_bytes: usize,
    /// The PVH command line (agent boot options).
    pub cmdline: String,
    /// Watchdog: the run ends with [`VmExit::Timeout`] after this long.
    pub timeout: Duration,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            mem_bytes: 64 << 20,
            cmdline: String::new(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmExit {
    /// The guest wrote this value to the isa-debug-exit port.
    DebugExit(u32),
    /// The guest executed `hlt` (there are no interrupts to wake it).
    Halted,
    /// `KVM_EXIT_SHUTDOWN`: a triple fault.
    Shutdown,
    /// `KVM_EXIT_FAIL_ENTRY` with the hardware entry-failure reason.
    FailEntry(u64),
    /// The watchdog ended the run.
    Timeout,
    /// [`Vm::stop`] or dropping the [`Vm`] ended the run.
    Stopped,
}

/// The result of a finished run.
#[derive(Debug, Clone)]
pub struct VmOutcome {
    /// How it ended.
    pub exit: VmExit,
    /// The COM2 log as text ([`Vm::log_text`] at the end of the run).
    pub log: String,
    /// The decoded COM2 log lines (empty when the ELF has no defmt data).
    pub log_lines: Vec<LogLine>,
    /// Port-I/O exits handled.
    pub io_exits: u64,
    /// Guest `rip` when the run ended (for diagnosing faults).
    pub rip: u64,
    /// Time from [`Vm::boot`] (which also starts the watchdog) to the end of the run.
    pub run_time: Duration,
}

/// Errors of the built-in VMM. Messages say what to check next.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// A KVM ioctl failed.
    #[error("{0} failed: {1} (is /dev/kvm accessible read-write?)")]
    Kvm(&'static str, kvm_ioctls::Error),
    /// Guest memory could not be set up or written.
    #[error("guest memory: {0}")]
    Memory(String),
    /// The ELF could not be loaded or has no PVH note.
    #[error("loading the guest ELF: {0} (build it with `cargo xtask build-agent`)")]
    Elf(String),
    /// The command line is too long or contains NUL.
    #[error("command line of {0} bytes is too long (max 4095) or contains NUL")]
    Cmdline(usize),
    /// The guest did something this VMM does not model.
    #[error("guest: {0}")]
    Guest(String),
    /// The vCPU thread could not be started, panicked, or did not stop.
    #[error("vCPU thread: {0}")]
    Thread(String),
    /// Building the agent failed.
    #[error("building the agent: {0}")]
    Build(String),
}

struct RunResult {
    exit: VmExit,
    io_exits: u64,
    rip: u64,
    run_time: Duration,
}

/// A running VM. Dropping it stops the vCPU.
#[derive(Debug)]
pub struct Vm {
    vm: Arc<VmFd>,
    com1: SerialHost,
    log: Arc<Mutex<Vec<u8>>>,
    /// The COM2 decoder for the booted ELF, or why there is none.
    log_decoder: Result<DefmtLog, String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<RunResult, VmmError>>>,
    deadline: Instant,
    /// TID of the thread that created the VM: the `<pid>` of its debugfs directory.
    creator_tid: u32,
}

impl std::fmt::Debug for RunResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} after {} I/O exits", self.exit, self.io_exits)
    }
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn kick_signal() -> Result<i32, VmmError> {
    static REGISTERED: OnceLock<Result<i32, String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let sig = SIGRTMIN() + KICK_SIGNAL_OFFSET;
            register_signal_handler(sig, kick_handler)
                .map(|()| sig)
                .map_err(|e| format!("registering the vCPU kick signal: {e}"))
        })
        .clone()
        .map_err(VmmError::Thread)
}

impl Vm {
    /// Creates a VM, loads `elf` through PVH with `cfg.cmdline`, and starts its vCPU thread.
    ///
    /// # Errors
    /// Any KVM, memory or ELF setup failure.
    pub fn boot(elf: &Path, cfg: &VmConfig) -> Result<Self, VmmError> {
        // Register the watchdog's kick handler before any vCPU thread exists to be kicked.
        kick_signal()?;
        let kvm = Kvm::new().map_err(|e| VmmError::Kvm("open /dev/kvm", e))?;
        let vm = kvm
            .create_vm()
            .map_err(|e| VmmError::Kvm("KVM_CREATE_VM", e))?;
        // SAFETY: gettid has no preconditions and cannot fail.
        let creator_tid = u32::try_from(unsafe { libc::gettid() }).unwrap_or(0);
        let mem = boot::guest_memory(cfg.mem_bytes)?;
        map_memory(&vm, &mem)?;
        let mem_bytes =
            u64::try_from(cfg.mem_bytes).map_err(|e| VmmError::Memory(e.to_string()))?;
        let entry = boot::load_pvh(&mem, mem_bytes, elf, &cfg.cmdline)?;
        let log_decoder = DefmtLog::from_elf_path(elf).map_err(|e| e.to_string());
        let vcpu = vm
            .create_vcpu(0)
            .map_err(|e| VmmError::Kvm("KVM_CREATE_VCPU", e))?;
        boot::setup_vcpu(&kvm, &vcpu, entry)?;

        let to_guest = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, from_guest) = channel();
        let (dtx, delivered) = channel();
        let com1 = Uart16550::new(Some(to_guest.clone()), Some(dtx), TxSink::Channel(tx));
        let log = Arc::new(Mutex::new(Vec::new()));
        let com2 = Uart16550::new(None, None, TxSink::Log(log.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let deadline = started + cfg.timeout;

        let devices = Devices { com1, com2 };
        let thread_stop = stop.clone();
        let vm = Arc::new(vm);
        let thread_vm = vm.clone();
        let thread = std::thread::Builder::new()
            .name("vmtsync-vcpu0".into())
            .spawn(move || {
                // The VM fd and memory must outlive the vCPU's runs.
                let _keep = (thread_vm, mem);
                run_vcpu(vcpu, devices, &thread_stop, started, deadline)
            })
            .map_err(|e| VmmError::Thread(e.to_string()))?;
        Ok(Self {
            vm,
            com1: SerialHost {
                to_guest,
                from_guest,
                delivered,
            },
            log,
            log_decoder,
            stop,
            thread: Some(thread),
            deadline,
            creator_tid,
        })
    }

    /// `KVM_GET_CLOCK`: the VM's kvmclock in ns, with (when `flags` has `KVM_CLOCK_HOST_TSC`,
    /// 8) the host TSC it was taken at and (`KVM_CLOCK_REALTIME`, 4) host `CLOCK_REALTIME`.
    /// The truth to check the guest's pvclock against.
    ///
    /// # Errors
    /// The ioctl's error.
    pub fn kvm_clock(&self) -> Result<kvm_bindings::kvm_clock_data, VmmError> {
        self.vm
            .get_clock()
            .map_err(|e| VmmError::Kvm("KVM_GET_CLOCK", e))
    }

    /// The VM's directory name in KVM debugfs, `<pid>-<fd>`, to read its truth with
    /// [`crate::truth::truth_mapping_of`] (the vCPU is vcpu0). KVM names the directory after
    /// the *thread* that created the VM (`task_pid_nr(current)` in `kvm_create_vm_debugfs`),
    /// which for a test is its own thread, not the process: [`Vm::boot`] records that TID.
    #[must_use]
    pub fn debugfs_id(&self) -> crate::truth::VmId {
        crate::truth::VmId {
            pid: self.creator_tid,
            fd: u32::try_from(self.vm.as_raw_fd()).expect("an open fd is non-negative"),
        }
    }

    /// The host end of COM1.
    #[must_use]
    pub fn com1(&self) -> &SerialHost {
        &self.com1
    }

    /// The raw bytes the guest has written to COM2 so far.
    #[must_use]
    pub fn log_bytes(&self) -> Vec<u8> {
        lock(&self.log).clone()
    }

    /// The COM2 log lines decoded so far (empty when the ELF has no defmt data).
    #[must_use]
    pub fn log_lines(&self) -> Vec<LogLine> {
        match &self.log_decoder {
            Ok(d) => d.decode(&lock(&self.log)).lines,
            Err(_) => Vec::new(),
        }
    }

    /// The COM2 log so far as text: decoded lines (`<tsc> <level> <message>`), or, for an ELF
    /// without defmt data, why not followed by the raw bytes as lossy UTF-8.
    #[must_use]
    pub fn log_text(&self) -> String {
        let bytes = lock(&self.log);
        match &self.log_decoder {
            Ok(d) => d.decode(&bytes).text(),
            Err(e) => format!(
                "(COM2 not decoded: {e})\n{}",
                String::from_utf8_lossy(&bytes)
            ),
        }
    }

    /// Waits until a COM2 log line contains `needle`, at most `timeout`. Returns whether one
    /// did.
    #[must_use]
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            if self.log_text().contains(needle) {
                return true;
            }
            if Instant::now() >= end || self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
                return self.log_text().contains(needle);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// True once the run has ended (guest exit, fault, stop, or watchdog).
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Asks the vCPU to stop; [`Vm::wait`] then returns [`VmExit::Stopped`].
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Waits for the run to end (guest exit, fault, or the watchdog) and returns its outcome.
    ///
    /// # Errors
    /// A KVM failure inside the run, an unmodelled guest action, or a vCPU thread that could
    /// not be stopped.
    pub fn wait(mut self) -> Result<VmOutcome, VmmError> {
        let r = self.join(self.deadline)?;
        Ok(VmOutcome {
            exit: r.exit,
            log: self.log_text(),
            log_lines: self.log_lines(),
            io_exits: r.io_exits,
            rip: r.rip,
            run_time: r.run_time,
        })
    }

    fn join(&mut self, deadline: Instant) -> Result<RunResult, VmmError> {
        let Some(t) = self.thread.take() else {
            return Err(VmmError::Thread("already joined".into()));
        };
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        if !t.is_finished() {
            // The vCPU may sit in KVM_RUN without exits: flag it, then kick it out with a
            // signal, repeatedly, since a kick that lands just before KVM_RUN is lost.
            self.stop.store(true, Ordering::SeqCst);
            let sig = kick_signal()?;
            let give_up = Instant::now() + Duration::from_secs(5);
            while !t.is_finished() && Instant::now() < give_up {
                let _ = t.kill(sig);
                std::thread::sleep(Duration::from_millis(10));
            }
            if !t.is_finished() {
                // Detach: the thread holds only its own VM, which dies with the process.
                return Err(VmmError::Thread(
                    "vCPU did not leave KVM_RUN within 5 s of the watchdog".into(),
                ));
            }
        }
        t.join()
            .map_err(|_| VmmError::Thread("vCPU thread panicked".into()))?
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop.store(true, Ordering::SeqCst);
            let _ = self.join(Instant::now());
        }
    }
}

/// The VMM's devices.
struct Devices {
    com1: Uart16550,
    com2: Uart16550,
}

fn map_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), VmmError> {
    let size = mem.last_addr().0 + 1;
    let host = mem
        .get_host_address(GuestAddress(0))
        .map_err(|e| VmmError::Memory(e.to_string()))?;
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: size,
        userspace_addr: host as u64,
    };
    // SAFETY: `host` is the start of one anonymous mapping of `size` bytes owned by `mem`, which
    // the vCPU thread keeps alive for as long as the VM fd exists.
    unsafe { vm.set_user_memory_region(region) }
        .map_err(|e| VmmError::Kvm("KVM_SET_USER_MEMORY_REGION", e))
}

fn run_vcpu(
    mut vcpu: VcpuFd,
    mut dev: Devices,
    stop: &AtomicBool,
    start: Instant,
    deadline: Instant,
) -> Result<RunResult, VmmError> {
    let mut io_exits = 0u64;
    let mut last_exit_tsc = 0u64;
    let exit = loop {
        // The deadline first: the watchdog also raises `stop` to get here, and its run must
        // read as a timeout, not as a requested stop.
        if Instant::now() >= deadline {
            break VmExit::Timeout;
        }
        if stop.load(Ordering::SeqCst) {
            break VmExit::Stopped;
        }
        let r = vcpu.run();
        // Stamp every exit first thing, so device models see the same time for this exit and
        // the next exit can report it as its predecessor.
        let at = ExitStamp {
            now: tsc::host_tsc(),
            prev: last_exit_tsc,
        };
        last_exit_tsc = at.now;
        match r {
            Ok(VcpuExit::IoIn(port, data)) => {
                io_exits += 1;
                let v = match port {
                    p if (COM1_BASE..COM1_BASE + 8).contains(&p) => {
                        dev.com1.read(p - COM1_BASE, at)
                    }
                    p if (COM2_BASE..COM2_BASE + 8).contains(&p) => {
                        dev.com2.read(p - COM2_BASE, at)
                    }
                    _ => 0xff,
                };
                data.fill(0xff);
                if let Some(first) = data.first_mut() {
                    *first = v;
                }
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                io_exits += 1;
                let first = data.first().copied().unwrap_or(0);
                match port {
                    DEBUG_EXIT_PORT => {
                        let mut v = [0u8; 4];
                        let n = data.len().min(4);
                        v[..n].copy_from_slice(&data[..n]);
                        break VmExit::DebugExit(u32::from_le_bytes(v));
                    }
                    p if (COM1_BASE..COM1_BASE + 8).contains(&p) => {
                        dev.com1.write(p - COM1_BASE, first, at);
                    }
                    p if (COM2_BASE..COM2_BASE + 8).contains(&p) => {
                        dev.com2.write(p - COM2_BASE, first, at);
                    }
                    _ => {}
                }
            }
            Ok(VcpuExit::Hlt) => break VmExit::Halted,
            Ok(VcpuExit::Shutdown) => break VmExit::Shutdown,
            Ok(VcpuExit::FailEntry(reason, _)) => break VmExit::FailEntry(reason),
            Ok(VcpuExit::Intr) => {}
            Ok(other) => {
                return Err(VmmError::Guest(format!("unmodelled VM exit {other:?}")));
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
            Err(e) => return Err(VmmError::Kvm("KVM_RUN", e)),
        }
    };
    let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
    Ok(RunResult {
        exit,
        io_exits,
        rip,
        run_time: start.elapsed(),
    })
}
