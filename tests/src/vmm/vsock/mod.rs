//! The agent's virtio-vsock transport under QEMU (q35 + qboot with PCI, or microvm with
//! virtio-mmio), through `vhost-device-vsock`.
//!
//! There is no `/dev/vhost-vsock` on the project's machines and AF_VSOCK sockets are off limits
//! (see docs/vsock.md), so the device is QEMU's `vhost-user-vsock-pci` (q35) or
//! `vhost-user-vsock-device` (microvm) served by the rust-vmm `vhost-device-vsock` 0.3 backend,
//! which maps guest connections onto Unix sockets: a guest connection to host port P arrives as
//! a connection to `<uds-path>_P`, and the host reaches a listening guest through `<uds-path>`
//! with `CONNECT P`. vhost-user needs guest memory the backend can map, hence
//! `memory-backend-memfd,share=on` as the guest's memory.
//!
//! [`VsockRig`] starts both processes (each under a [`ChildGuard`], killed by PID on drop),
//! listens on `<uds-path>_P` before the guest boots, and cleans its temporary directory. Its
//! connections are vmtsync's own socket transport ([`StreamTransport`], stamped with `lfence;
//! rdtsc` around each system call), reached through vmtsync's own `CONNECT` handshake
//! ([`connect_vhost_uds`]), so the probe driver is [`vmtsync::probe::ProbeSession`] as in
//! `vmtsync probe --connect vsock-uds:`. Every wait has a deadline.

use std::io::ErrorKind;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vmtsync::link::vhost_uds::connect_vhost_uds;
use vmtsync::link::{ConnectOptions, StreamTransport};

use super::qemu::{self, Machine};
use crate::ChildGuard;

/// A connection to the agent: vmtsync's socket transport on the backend's Unix stream.
pub type VsockTransport = StreamTransport<UnixStream>;

pub use vmtsync_launch::vhost::{VHOST_DEVICE_VSOCK_VERSION, install_root};
/// The guest CID given to the backend.
pub const GUEST_CID: u32 = 3;
/// Guest RAM; the memfd backend must have the same size as `-m`.
const GUEST_MEM: &str = "64M";

/// Why the rig or the client failed.
#[derive(Debug, thiserror::Error)]
pub enum VsockRigError {
    /// `cargo install vhost-device-vsock` failed.
    #[error(
        "installing vhost-device-vsock {VHOST_DEVICE_VSOCK_VERSION} failed ({0}); try \
         `cargo install --locked vhost-device-vsock --version {VHOST_DEVICE_VSOCK_VERSION} \
         --root ~/.cache/vmtsync/vhost-device-vsock`"
    )]
    Install(String),
    /// A process could not be started.
    #[error("could not start {0}: {1}")]
    Spawn(&'static str, std::io::Error),
    /// A socket or file operation failed.
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
    /// Something did not happen before its deadline.
    #[error("timed out after {1:?} waiting for {0}")]
    Timeout(&'static str, Duration),
    /// A process ended early.
    #[error("{0} exited early with {1}")]
    Exited(&'static str, ExitStatus),
}

/// The installed backend binary, installing it first if missing (once per process, through
/// `vmtsync_launch::vhost`, which `cargo xtask setup` uses too).
///
/// # Errors
/// [`VsockRigError::Install`] when cargo fails.
pub fn ensure_vhost_device_vsock() -> Result<PathBuf, VsockRigError> {
    vmtsync_launch::vhost::ensure_vhost_device_vsock(vmtsync_launch::agent::BuildOutput::Captured)
        .map_err(|e| VsockRigError::Install(e.to_string()))
}

/// A QEMU q35 + qboot VM with `vhost-user-vsock-pci`, its backend, and a host listener.
#[derive(Debug)]
pub struct VsockRig {
    dir: PathBuf,
    /// The agent ELF, whose `.defmt` table decodes the COM2 log.
    elf: PathBuf,
    port: u32,
    listener: UnixListener,
    // Field order is drop order: QEMU goes before its backend.
    qemu: ChildGuard,
    backend: ChildGuard,
}

impl VsockRig {
    /// Starts the backend (`backend` is its binary), listens on `<uds-path>_<port>`, and boots
    /// `elf` on `machine` with `append` as its command line. COM1 goes to a file (`com1.out`),
    /// COM2 to `com2.log`, both in the rig's directory.
    ///
    /// q35 gets `vhost-user-vsock-pci` (the agent places its BARs); microvm gets
    /// `vhost-user-vsock-device` on virtio-mmio, with `acpi=off` so QEMU names the window on
    /// the command line (`virtio_mmio.device=512@0xfeb00e00:12`) instead of in ACPI tables.
    ///
    /// # Errors
    /// [`VsockRigError`] when a process does not start, or the backend's socket does not appear
    /// within `timeout`.
    pub fn start(
        machine: Machine,
        backend: &Path,
        elf: &Path,
        append: &str,
        port: u32,
        timeout: Duration,
    ) -> Result<Self, VsockRigError> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vmtsync-vsock-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| VsockRigError::Io("creating temp dir", e))?;
        // From here on a failure must still remove `dir`: `Cleanup` does until disarmed.
        let cleanup = Cleanup(Some(dir.clone()));
        let vhost_sock = dir.join("vhost.sock");
        let uds = dir.join("vm.vsock");
        let listener = UnixListener::bind(format!("{}_{port}", uds.display()))
            .map_err(|e| VsockRigError::Io("listening on <uds-path>_<port>", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| VsockRigError::Io("setting the listener non-blocking", e))?;

        let file = |name: &str| {
            std::fs::File::create(dir.join(name)).map_err(|e| VsockRigError::Io("log file", e))
        };
        let child = Command::new(backend)
            .arg("--vm")
            .arg(format!(
                "guest-cid={GUEST_CID},socket={},uds-path={}",
                vhost_sock.display(),
                uds.display()
            ))
            .stdin(Stdio::null())
            .stdout(file("backend.log")?)
            .stderr(file("backend.err")?)
            .spawn()
            .map_err(|e| VsockRigError::Spawn("vhost-device-vsock", e))?;
        let mut backend_guard = ChildGuard::new(child);
        let end = Instant::now() + timeout;
        while !vhost_sock.exists() {
            if let Ok(Some(s)) = backend_guard.child().try_wait() {
                return Err(VsockRigError::Exited("vhost-device-vsock", s));
            }
            if Instant::now() >= end {
                return Err(VsockRigError::Timeout(
                    "the backend's vhost-user socket",
                    timeout,
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }

        let mut c = qemu::command(machine, elf, append, &dir.join("com2.log"));
        c.args(["-object"])
            .arg(format!(
                "memory-backend-memfd,id=mem,size={GUEST_MEM},share=on"
            ))
            .arg("-chardev")
            .arg(format!(
                "socket,id=vhostvsock,path={}",
                vhost_sock.display()
            ));
        match machine {
            Machine::Q35 => c.args([
                "-numa",
                "node,memdev=mem",
                "-device",
                "vhost-user-vsock-pci,chardev=vhostvsock",
            ]),
            // Machine options merge with qemu::command's `-M microvm`.
            Machine::Microvm => c.args([
                "-machine",
                "acpi=off,memory-backend=mem",
                "-device",
                "vhost-user-vsock-device,chardev=vhostvsock",
            ]),
        };
        c.stdin(Stdio::null())
            .stdout(file("com1.out")?)
            .stderr(file("qemu.err")?);
        let qemu = ChildGuard::new(c.spawn().map_err(|e| VsockRigError::Spawn(qemu::QEMU, e))?);
        cleanup.disarm();
        Ok(Self {
            dir,
            elf: elf.to_path_buf(),
            port,
            listener,
            qemu,
            backend: backend_guard,
        })
    }

    /// The host port the guest connects to.
    #[must_use]
    pub fn port(&self) -> u32 {
        self.port
    }

    /// Waits at most `timeout` for the guest's connection.
    ///
    /// # Errors
    /// [`VsockRigError::Timeout`], or [`VsockRigError::Exited`] when QEMU ends first.
    pub fn accept(&mut self, timeout: Duration) -> Result<VsockTransport, VsockRigError> {
        let end = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((s, _)) => return transport(s, timeout),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(VsockRigError::Io("accepting the guest's connection", e)),
            }
            if let Ok(Some(s)) = self.qemu.child().try_wait() {
                return Err(VsockRigError::Exited("QEMU", s));
            }
            if Instant::now() >= end {
                return Err(VsockRigError::Timeout(
                    "the guest's vsock connection",
                    timeout,
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Connects to the guest's port `port` (an agent started with `vsock=listen`) through the
    /// backend's `CONNECT <port>` handshake ([`connect_vhost_uds`]). The backend drops
    /// connections made before the guest's queues are up, and an early experiment saw one
    /// connect in twenty hang, so each attempt has its own 2 s deadline and failures are
    /// retried until `timeout`, watching QEMU in between.
    ///
    /// # Errors
    /// [`VsockRigError::Timeout`] with the last failure, or [`VsockRigError::Exited`] when QEMU
    /// ends first.
    pub fn connect(
        &mut self,
        port: u32,
        timeout: Duration,
    ) -> Result<VsockTransport, VsockRigError> {
        let end = Instant::now() + timeout;
        let uds = self.dir.join("vm.vsock");
        loop {
            let attempt = ConnectOptions {
                connect_timeout: end
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_secs(2))
                    .max(MIN_WAIT),
                io_timeout: timeout,
            };
            if let Ok(s) = connect_vhost_uds(&uds, port, &attempt) {
                return transport(s, timeout);
            }
            if let Ok(Some(s)) = self.qemu.child().try_wait() {
                return Err(VsockRigError::Exited("QEMU", s));
            }
            if Instant::now() >= end {
                return Err(VsockRigError::Timeout("the guest to accept", timeout));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits at most `timeout` for `needle` to appear in the agent's COM2 log, e.g. the agent's
    /// `vsock: listening on port P` before connecting to it: vhost-device-vsock 0.3 can wedge a
    /// VM's host-initiated connections for good when one arrives before the guest's driver is
    /// up (seen about once in twenty runs under load), so the rig does not connect early.
    ///
    /// # Errors
    /// [`VsockRigError::Timeout`], or [`VsockRigError::Exited`] when QEMU ends first.
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) -> Result<(), VsockRigError> {
        let end = Instant::now() + timeout;
        loop {
            if self.com2_log().contains(needle) {
                return Ok(());
            }
            if let Ok(Some(s)) = self.qemu.child().try_wait() {
                return Err(VsockRigError::Exited("QEMU", s));
            }
            if Instant::now() >= end {
                return Err(VsockRigError::Timeout("a line in the agent's log", timeout));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits at most `timeout` for QEMU to exit.
    ///
    /// # Errors
    /// [`VsockRigError::Timeout`].
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, VsockRigError> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(s) = self
                .qemu
                .child()
                .try_wait()
                .map_err(|e| VsockRigError::Io("waiting for QEMU", e))?
            {
                return Ok(s);
            }
            if Instant::now() >= end {
                return Err(VsockRigError::Timeout("QEMU to exit", timeout));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The agent's COM2 log so far, decoded from its defmt frames.
    #[must_use]
    pub fn com2_log(&self) -> String {
        super::defmt_log::decode_file_text(&self.elf, &self.dir.join("com2.log"))
    }

    /// Everything the rig's processes said, for failure messages.
    #[must_use]
    pub fn diagnostics(&self) -> String {
        let read = |n: &str| std::fs::read_to_string(self.dir.join(n)).unwrap_or_default();
        format!(
            "--- COM2 ---\n{}\n--- QEMU stderr ---\n{}\n--- vhost-device-vsock stderr ---\n{}",
            self.com2_log(),
            read("qemu.err"),
            read("backend.err")
        )
    }

    /// PIDs of QEMU and the backend.
    #[must_use]
    pub fn pids(&self) -> (u32, u32) {
        (self.qemu.pid(), self.backend.pid())
    }
}

impl Drop for VsockRig {
    fn drop(&mut self) {
        // The guards kill QEMU, then the backend, by PID as the fields drop after this; the
        // sockets and logs go now (Unix lets a running process keep what it has open).
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The session transport on an accepted or connected stream: blocking, no single read or
/// write longer than `per_read`.
fn transport(s: UnixStream, per_read: Duration) -> Result<VsockTransport, VsockRigError> {
    s.set_nonblocking(false)
        .map_err(|e| VsockRigError::Io("configuring the stream", e))?;
    StreamTransport::new(s, per_read).map_err(|e| VsockRigError::Io("configuring the stream", e))
}

/// Smallest socket timeout used (zero would mean "no timeout").
const MIN_WAIT: Duration = Duration::from_millis(1);

/// Removes a directory on drop unless disarmed.
struct Cleanup(Option<PathBuf>);

impl Cleanup {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
