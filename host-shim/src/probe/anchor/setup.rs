//! `--anchor`: deciding whether a run is exit-anchored, and setting it up.
//!
//! Anchoring needs the VM (KVM debugfs names it and its VMM process), tracefs with `kvm:kvm_pio`
//! and root. With [`AnchorMode::Auto`] any of them missing is a note on stderr and the run goes
//! on with in-process stamps; with [`AnchorMode::KvmPio`] it is [`ProbeError::Anchor`] (CLI exit
//! code 8). The UART variant applies to a `unix:` address (a VMM's serial chardev), where an
//! agent that announces a sync port has its probes bracketed there; every other transport is
//! anchored on the agent's sync port (`syncport=N`, docs/anchor.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::AnchoredTransport;
use crate::exits::{COM1_DATA, DEFAULT_SYNC_PORT, Matcher, PioTrace};
use crate::kvm::debugfs::{DEFAULT_KVM_DEBUGFS, KvmDebugfs};
use crate::kvm::procinfo::{DEFAULT_PROC_ROOT, ProcFs};
use crate::kvm::scan::{Scanner, VmSelector};
use crate::link::addr::ProbeAddr;
use crate::link::transport::StampedTransport;
use crate::probe::ProbeError;

/// Ports below a register from which a 2- or 4-byte access still covers it.
const REACH: u16 = 3;

/// `vmtsync probe --anchor`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AnchorMode {
    /// Exit-anchor when `--vm` names the agent's VM and tracefs, `kvm_pio` and root are
    /// there; otherwise stamp in this process (saying why on stderr when `--vm` was given).
    Auto,
    /// Exit-anchor through `kvm:kvm_pio`, or fail (exit code 8).
    KvmPio,
    /// Stamp in this process (`lfence; rdtsc` around the system calls).
    #[default]
    None,
}

/// Where anchoring looks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnchorOptions {
    /// Whether to anchor.
    pub mode: AnchorMode,
    /// The VM the agent runs in (`--vm`); `None`: the only VM in debugfs.
    pub vm: Option<VmSelector>,
    /// tracefs (`--tracefs`); `None`: the standard mount points.
    pub tracefs: Option<PathBuf>,
    /// KVM debugfs.
    pub debugfs_root: PathBuf,
    /// `/proc`, for VM names.
    pub proc_root: PathBuf,
    /// The UART data port the agent's protocol runs on (serial chardev addresses).
    pub port: u16,
    /// The agent's sync port (`syncport=N`; every other transport).
    pub sync_port: u16,
}

impl Default for AnchorOptions {
    fn default() -> Self {
        Self {
            mode: AnchorMode::None,
            vm: None,
            tracefs: None,
            debugfs_root: PathBuf::from(DEFAULT_KVM_DEBUGFS),
            proc_root: PathBuf::from(DEFAULT_PROC_ROOT),
            port: COM1_DATA,
            sync_port: DEFAULT_SYNC_PORT,
        }
    }
}

/// The VMM process of the VM (`--vm`, or the only VM in KVM debugfs).
fn vm_process(o: &AnchorOptions) -> Result<u32, String> {
    let debugfs = KvmDebugfs::open(&o.debugfs_root).map_err(|e| e.to_string())?;
    let scanner = Scanner {
        debugfs,
        proc: ProcFs::new(&o.proc_root),
    };
    let report = scanner.scan(o.vm.as_ref()).map_err(|e| e.to_string())?;
    match report.vms.as_slice() {
        [vm] => Ok(vm.pid),
        [] => Err("no VM in KVM debugfs".into()),
        vms => {
            let list: Vec<String> = vms.iter().map(|v| format!("{}-{}", v.pid, v.fd)).collect();
            Err(format!(
                "{} VMs in KVM debugfs ({}): pass --vm to say which one runs the agent",
                vms.len(),
                list.join(", ")
            ))
        }
    }
}

/// How often the VM is looked for while it does not exist yet.
const VM_POLL: Duration = Duration::from_millis(50);

/// How the exchanges on `addr` are anchored: a serial chardev socket (`unix:PATH`) by the
/// UART's own exits, anything else by the agent's sync port.
#[must_use]
pub fn matcher_for(addr: &ProbeAddr, o: &AnchorOptions) -> Matcher {
    match addr {
        ProbeAddr::Unix(_) => Matcher::Uart { port: o.port },
        _ => Matcher::SyncPort { port: o.sync_port },
    }
}

/// Why this run cannot be anchored, or the trace to anchor it with. A VMM just started may not
/// have made its VM yet: it is looked for again until `wait` has passed. The trace keeps the
/// exits of every thread of the VMM process, also of a vCPU thread that has not run yet (KVM
/// debugfs names a vCPU's thread only after its first run, and a probe that starts with the
/// VM would otherwise miss the exits of a vCPU that ran later: docs/anchor.md).
fn open_trace(
    matcher: Matcher,
    sync_port: Option<u16>,
    o: &AnchorOptions,
    wait: Duration,
) -> Result<PioTrace, String> {
    // The instance first: without tracefs or root there is nothing to wait for.
    crate::ftrace::find_tracefs(o.tracefs.as_deref(), crate::exits::EVENT)
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + wait;
    let pid = loop {
        match vm_process(o) {
            Ok(t) => break t,
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(VM_POLL),
        }
    };
    let mut ports: Vec<u16> = match matcher {
        // The data register and the three ports below it, from which a word or double-word
        // access also reaches it: `match_uart` counts every access that covers the data port
        // and nothing else (status polls cannot move its bracket, so they are not traced).
        Matcher::Uart { port } => (port.saturating_sub(REACH)..=port).collect(),
        Matcher::SyncPort { port } => vec![port],
    };
    ports.extend(sync_port.filter(|p| !ports.contains(p)));
    PioTrace::start_process(o.tracefs.as_deref(), &o.proc_root, pid, &ports)
        .map_err(|e| e.to_string())
}

/// What [`prepare`] decided: the trace to anchor with (and how strictly), or none.
#[derive(Debug)]
pub struct AnchorSetup {
    trace: Option<PioTrace>,
    mode: AnchorMode,
    matcher: Matcher,
    /// A UART run's sync port, traced too (see [`AnchoredTransport::with_sync_port`]).
    sync_port: Option<u16>,
}

/// Decides whether a run on `addr` is anchored, before connecting (so `--anchor kvm-pio`
/// fails at once when it cannot be done): opens the trace for `KvmPio` and `Auto`, waiting up
/// to `wait` for the VM to appear; `Auto` tells `note` why not when it cannot.
/// A serial chardev's trace also holds the sync port (`o.sync_port`): when the agent's hello
/// announces one, its probes are bracketed there, the tighter bracket (docs/anchor.md).
///
/// # Errors
/// [`ProbeError::Anchor`] when `o.mode` is `KvmPio` and anchoring is not possible.
pub fn prepare(
    addr: &ProbeAddr,
    o: &AnchorOptions,
    wait: Duration,
    note: &mut dyn FnMut(&str),
) -> Result<AnchorSetup, ProbeError> {
    let matcher = matcher_for(addr, o);
    let sync_port = matches!(matcher, Matcher::Uart { .. }).then_some(o.sync_port);
    prepare_with(matcher, sync_port, o, wait, note)
}

/// [`prepare`] for a matcher chosen by the caller (a test rig that knows its transport), with
/// no other port traced.
///
/// # Errors
/// As [`prepare`].
pub fn prepare_matcher(
    matcher: Matcher,
    o: &AnchorOptions,
    wait: Duration,
    note: &mut dyn FnMut(&str),
) -> Result<AnchorSetup, ProbeError> {
    prepare_with(matcher, None, o, wait, note)
}

fn prepare_with(
    matcher: Matcher,
    sync_port: Option<u16>,
    o: &AnchorOptions,
    wait: Duration,
    note: &mut dyn FnMut(&str),
) -> Result<AnchorSetup, ProbeError> {
    let trace = match (o.mode, &o.vm) {
        // Without --vm, auto does not guess which VM runs the agent (the only VM on the host
        // may be someone else's): it stamps in this process, quietly.
        (AnchorMode::None, _) | (AnchorMode::Auto, None) => None,
        (AnchorMode::KvmPio, _) => {
            Some(open_trace(matcher, sync_port, o, wait).map_err(ProbeError::Anchor)?)
        }
        (AnchorMode::Auto, Some(_)) => match open_trace(matcher, sync_port, o, wait) {
            Ok(t) => Some(t),
            Err(why) => {
                note(&format!(
                    "not exit-anchored ({why}); host stamps are taken in this process (--anchor none: no anchoring, no note)"
                ));
                None
            }
        },
    };
    Ok(AnchorSetup {
        trace,
        mode: o.mode,
        matcher,
        sync_port,
    })
}

impl AnchorSetup {
    /// Wraps the connected transport: an [`AnchoredTransport`] that anchors (`KvmPio`: every
    /// exchange, or drops it; `Auto`: unless the first exchange does not match), or one that
    /// passes the stamps through.
    pub fn wrap<T: StampedTransport>(self, inner: T) -> AnchoredTransport<T> {
        match (self.trace, self.mode) {
            (Some(t), AnchorMode::KvmPio) => {
                AnchoredTransport::new(inner, t, self.matcher).with_sync_port(self.sync_port)
            }
            (Some(t), _) => {
                AnchoredTransport::new_auto(inner, t, self.matcher).with_sync_port(self.sync_port)
            }
            (None, _) => AnchoredTransport::passthrough(inner),
        }
    }
}

/// [`prepare`] then [`AnchorSetup::wrap`], for a transport already connected.
///
/// # Errors
/// As [`prepare`].
pub fn anchor_transport<T: StampedTransport>(
    inner: T,
    addr: &ProbeAddr,
    o: &AnchorOptions,
    wait: Duration,
    note: &mut dyn FnMut(&str),
) -> Result<AnchoredTransport<T>, ProbeError> {
    Ok(prepare(addr, o, wait, note)?.wrap(inner))
}
