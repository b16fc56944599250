//! A tiny KVM VMM for tier-2 tests: VMs whose vCPUs halt in real mode and stay halted.
//!
//! Each VM gets 64 KiB of RAM, an in-kernel irqchip (so `hlt` blocks inside `KVM_RUN` instead
//! of exiting to user space: an idle VM costs no CPU) and vCPUs with caller-chosen ids (sparse
//! ids test that tools do not map vCPUs by sort order). Every vCPU runs on its own thread; the
//! child process (`idle-vmm`, see [`IdleVmmChild`]) prints each thread's TID so tests can
//! compare it with debugfs `vcpuN/pid`, and each vCPU's TSC as the VMM reads it
//! (`KVM_GET_MSRS` of IA32_TSC, bracketed by host TSC reads) so tests can check debugfs's
//! `tsc-offset` against a reading that does not go through debugfs.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit, VmFd};

use crate::ChildGuard;

/// Guest RAM per VM.
const MEM_SIZE: usize = 64 * 1024;
/// Where the halt loop is placed (and where the vCPUs start).
const CODE_ADDR: u64 = 0x1000;
/// `cli; hlt; jmp short -3` (back to the `hlt`): halts forever with interrupts off.
const HALT_LOOP: [u8; 4] = [0xfa, 0xf4, 0xeb, 0xfd];

/// `IA32_TSC` (Intel SDM vol. 4, MSR 0x10): the guest's TSC, as `KVM_GET_MSRS` reads it.
const MSR_IA32_TSC: u32 = 0x10;

/// A vCPU's guest TSC read by the VMM (`KVM_GET_MSRS` of IA32_TSC) between two host TSC
/// reads: KVM's mapping of that vCPU takes some host tick in `[host_before, host_after]` to
/// `guest`. Truth from the VMM, independent of debugfs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestTscReading {
    /// The vCPU id.
    pub vcpu: u32,
    /// Host TSC (`lfence; rdtsc`) just before the ioctl.
    pub host_before: u64,
    /// The guest TSC the ioctl returned.
    pub guest: u64,
    /// Host TSC just after it.
    pub host_after: u64,
}

/// Reads `vcpu`'s guest TSC between two host TSC reads.
fn read_guest_tsc(vcpu: &kvm_ioctls::VcpuFd, id: u32) -> Result<GuestTscReading> {
    let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MSR_IA32_TSC,
        ..Default::default()
    }])
    .map_err(|e| anyhow::anyhow!("building the MSR list: {e:?}"))?;
    let host_before = vmtsync_core::arch::x86_64::lfence_rdtsc();
    let n = vcpu.get_msrs(&mut msrs).context("KVM_GET_MSRS IA32_TSC")?;
    let host_after = vmtsync_core::arch::x86_64::lfence_rdtsc();
    if n != 1 {
        bail!("KVM_GET_MSRS read {n} of 1 MSRs");
    }
    Ok(GuestTscReading {
        vcpu: id,
        host_before,
        guest: msrs.as_slice()[0].data,
        host_after,
    })
}

/// One VM of this process: its fd (the `<fd>` of debugfs `<pid>-<fd>`) and vCPU threads.
#[derive(Debug)]
pub struct IdleVm {
    /// The VM fd (kept open for the life of the VM).
    pub vm: VmFd,
    /// `(vcpu id, thread id)` for each vCPU, in creation order.
    pub vcpus: Vec<(u32, u32)>,
    /// Each vCPU's TSC read by this VMM, in creation order.
    pub tsc: Vec<GuestTscReading>,
}

/// Creates a VM with the given vCPU ids, each halted on its own thread.
///
/// # Errors
/// Any KVM ioctl failure.
pub fn start_idle_vm(kvm: &Kvm, vcpu_ids: &[u32]) -> Result<IdleVm> {
    let vm = kvm.create_vm().context("KVM_CREATE_VM")?;
    // Intel needs a TSS address before real-mode guests run; harmless elsewhere.
    vm.set_tss_address(0xfffb_d000)
        .context("KVM_SET_TSS_ADDR")?;
    vm.create_irq_chip().context("KVM_CREATE_IRQCHIP")?;
    // SAFETY: an anonymous private mapping with no address hint; the result is checked below.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            MEM_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        bail!("mmap guest memory: {}", std::io::Error::last_os_error());
    }
    let code_at = usize::try_from(CODE_ADDR)?;
    // SAFETY: the mapping is MEM_SIZE bytes and CODE_ADDR + 4 is inside it; nothing else uses it yet.
    unsafe {
        std::ptr::copy_nonoverlapping(
            HALT_LOOP.as_ptr(),
            mem.cast::<u8>().add(code_at),
            HALT_LOOP.len(),
        );
    }
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: u64::try_from(MEM_SIZE)?,
        userspace_addr: mem as u64,
        flags: 0,
    };
    // SAFETY: the region is a valid mapping that is never unmapped (it lives as long as the
    // process, which outlives the VM).
    unsafe { vm.set_user_memory_region(region) }.context("KVM_SET_USER_MEMORY_REGION")?;

    let (tx, rx) = mpsc::channel();
    let mut tsc = Vec::with_capacity(vcpu_ids.len());
    for &id in vcpu_ids {
        let mut vcpu = vm
            .create_vcpu(u64::from(id))
            .with_context(|| format!("KVM_CREATE_VCPU {id}"))?;
        let mut sregs = vcpu.get_sregs()?;
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs)?;
        let mut regs = vcpu.get_regs()?;
        regs.rip = CODE_ADDR;
        regs.rflags = 2;
        vcpu.set_regs(&regs)?;
        tsc.push(read_guest_tsc(&vcpu, id)?);
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                let _ = tx.send((id, u32::try_from(tid).unwrap_or(0)));
                loop {
                    match vcpu.run() {
                        // With the in-kernel irqchip a halted vCPU stays in KVM_RUN; these
                        // exits only happen without one. Sleep so an idle VM stays idle.
                        Ok(VcpuExit::Hlt) => std::thread::sleep(Duration::from_millis(200)),
                        Ok(exit) => {
                            eprintln!("idle-vmm: vcpu{id}: unexpected exit {exit:?}");
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                        Err(e) => {
                            eprintln!("idle-vmm: vcpu{id}: KVM_RUN failed: {e}");
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                }
            })
            .context("spawn vCPU thread")?;
    }
    drop(tx);
    // Each thread sends once and keeps its sender: take exactly one message per vCPU.
    let mut vcpus = Vec::with_capacity(vcpu_ids.len());
    for _ in vcpu_ids {
        vcpus.push(
            rx.recv()
                .context("a vCPU thread died before reporting its TID")?,
        );
    }
    vcpus.sort_by_key(|&(id, _)| vcpu_ids.iter().position(|&x| x == id));
    Ok(IdleVm { vm, vcpus, tsc })
}

/// One VM as reported by the child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildVm {
    /// The VM fd in the child.
    pub fd: u32,
    /// `(vcpu id, thread id)`.
    pub vcpus: Vec<(u32, u32)>,
    /// Each vCPU's TSC as the child read it.
    pub tsc: Vec<GuestTscReading>,
}

/// The `idle-vmm` binary running as a child process (killed on drop).
#[derive(Debug)]
pub struct IdleVmmChild {
    /// The process guard.
    pub guard: ChildGuard,
    /// Its VMs.
    pub vms: Vec<ChildVm>,
    stdin: Option<ChildStdin>,
}

impl IdleVmmChild {
    /// Starts `bin --vms N --vcpu-ids a,b,…` and waits (up to 20 s) for it to report its VMs.
    ///
    /// # Errors
    /// If it cannot start, exits early or does not report in time.
    pub fn spawn(bin: &Path, vms: usize, vcpu_ids: &[u32]) -> Result<Self> {
        let ids: Vec<String> = vcpu_ids.iter().map(u32::to_string).collect();
        let child = Command::new(bin)
            .args(["--vms", &vms.to_string(), "--vcpu-ids", &ids.join(",")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let mut guard = ChildGuard::new(child);
        let stdout = guard.child().stdout.take().context("child stdout")?;
        let stdin = guard.child().stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut out: Vec<ChildVm> = Vec::new();
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .context("idle-vmm did not report ready within 20 s")?;
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["vm", fd] => out.push(ChildVm {
                    fd: fd.parse()?,
                    vcpus: Vec::new(),
                    tsc: Vec::new(),
                }),
                ["tsc", id, before, guest, after] => out
                    .last_mut()
                    .context("tsc line before vm line")?
                    .tsc
                    .push(GuestTscReading {
                        vcpu: id.parse()?,
                        host_before: before.parse()?,
                        guest: guest.parse()?,
                        host_after: after.parse()?,
                    }),
                ["vcpu", id, "tid", tid] => out
                    .last_mut()
                    .context("vcpu line before vm line")?
                    .vcpus
                    .push((id.parse()?, tid.parse()?)),
                ["ready"] => break,
                _ => bail!("unexpected idle-vmm output: {line}"),
            }
        }
        Ok(Self {
            guard,
            vms: out,
            stdin,
        })
    }

    /// The child's PID (the `<pid>` of its VMs' debugfs directories).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// Asks the child to exit cleanly (closing its VMs) and waits up to 10 s for it.
    ///
    /// # Errors
    /// If it does not exit in time or exits non-zero.
    pub fn shutdown(&mut self) -> Result<()> {
        if let Some(mut s) = self.stdin.take() {
            let _ = s.write_all(b"exit\n");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.guard.child().try_wait()? {
                if !st.success() {
                    bail!("idle-vmm exited with {st}");
                }
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("idle-vmm did not exit within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The `idle-vmm` program: `--vms N --vcpu-ids a,b,…`; prints `vm <fd>`, `vcpu <id> tid <tid>`
/// and `tsc <id> <host before> <guest TSC> <host after>` lines, then `ready`, and exits 0 on `exit` or end of stdin.
///
/// # Errors
/// Bad arguments or KVM failures.
pub fn idle_vmm_main(args: &[String]) -> Result<()> {
    let mut vms = 1usize;
    let mut ids = vec![0u32];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--vms" => vms = it.next().context("--vms N")?.parse()?,
            "--vcpu-ids" => {
                ids = it
                    .next()
                    .context("--vcpu-ids a,b,c")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?;
            }
            other => bail!("unknown argument {other}"),
        }
    }
    let kvm = Kvm::new().context("open /dev/kvm")?;
    let mut keep = Vec::new();
    let stdout = std::io::stdout();
    for _ in 0..vms {
        let vm = start_idle_vm(&kvm, &ids)?;
        let mut o = stdout.lock();
        writeln!(o, "vm {}", vm.vm.as_raw_fd())?;
        for (id, tid) in &vm.vcpus {
            writeln!(o, "vcpu {id} tid {tid}")?;
        }
        for t in &vm.tsc {
            writeln!(
                o,
                "tsc {} {} {} {}",
                t.vcpu, t.host_before, t.guest, t.host_after
            )?;
        }
        keep.push(vm);
    }
    writeln!(stdout.lock(), "ready")?;
    stdout.lock().flush()?;
    for line in std::io::stdin().lock().lines() {
        if line?.trim() == "exit" {
            break;
        }
    }
    // Exiting the process tears down the vCPU threads and VMs.
    Ok(())
}
