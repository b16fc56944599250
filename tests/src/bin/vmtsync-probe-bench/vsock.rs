//! Probes over virtio-vsock through vhost-device-vsock (never AF_VSOCK), in two
//! configurations, each its own VM:
//!
//! - [`run_plain`]: QEMU microvm with `vhost-user-vsock-device`, the agent listening; the host
//!   stamps with `lfence; rdtsc` right before the `write(2)` of the request and right after the
//!   `read(2)` that completed the reply, on vmtsync's own socket transport (what
//!   `vmtsync probe --connect vsock-uds:` does). The guest read its TSC in between: the request
//!   cannot reach it before the write, and the reply cannot be read before it was written. This
//!   is the path where one-way delays vary most from probe to probe (docs/vsock.md), used to
//!   compare the estimators on the same samples.
//! - [`run_sync_port`]: QEMU q35 + qboot with `vhost-user-vsock-pci`, the agent connecting,
//!   bracketed two ways on the same probes: by this thread's `rdtsc` around the socket calls
//!   (`vsock/stream`), and by the agent's sync-port exits (`syncport=0x2400`: an `in` right
//!   before its TSC read, an `out` of the probe's sequence number right after, stamped by the
//!   host kernel's `kvm:kvm_pio`; `vsock/sync-port`, what `vmtsync probe --anchor kvm-pio` uses
//!   on vsock). A probe whose sync-port exits are not found is lost, and fails the run.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync::exits::{DEFAULT_SYNC_PORT, Matcher};
use vmtsync::kvm::scan::VmSelector;
use vmtsync::link::{FrameStamps, Received, StampedTransport, TransportError};
use vmtsync::probe::anchor::{AnchorMode, AnchorOptions, AnchoredTransport, prepare_matcher};
use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::vmm::client::wait_ready;
use vmtsync_tests::vmm::qemu::{Machine, debug_exit_status};
use vmtsync_tests::vmm::vsock::{VsockRig, VsockTransport, ensure_vhost_device_vsock};

use crate::{Recorded, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const PLAIN_EXIT_CODE: u8 = 11;
/// The guest port the agent listens on.
const PLAIN_PORT: u32 = 5_600;

/// The rig's socket transport, recording the stamps and byte counts of its last exchange.
#[derive(Debug)]
pub struct VsockRecorded {
    inner: VsockTransport,
    last: FrameStamps,
    sent: usize,
    received: usize,
    /// Bytes received since the last completed exchange.
    pending: usize,
}

impl StampedTransport for VsockRecorded {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        let stamp = self.inner.send(frame)?;
        self.sent = frame.len();
        Ok(stamp)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        let r = self.inner.recv(buf, deadline)?;
        self.pending += r.len;
        Ok(r)
    }

    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        let refined = self.inner.refine(stamps);
        if let Some(s) = refined {
            self.last = s;
        }
        self.received = core::mem::take(&mut self.pending);
        refined
    }
}

impl Recorded for VsockRecorded {
    type Stamps = FrameStamps;

    fn last(&self) -> (FrameStamps, usize, usize) {
        (self.last, self.sent, self.received)
    }
}

/// Boots the agent under QEMU microvm with its vsock transport listening (`vsock=listen`),
/// connects through the backend, runs `sessions` sessions of `probes` probes, shuts it down
/// and checks QEMU's exit status. `options` are extra agent options (a `skew=`). Returns the
/// sessions and KVM's mapping of QEMU's vCPU (debugfs), the truth's KVM side.
///
/// # Errors
/// Install, start, protocol or shutdown failures, with the rig's logs attached.
pub fn run_plain(
    elf: &Path,
    options: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<FrameStamps>>, KvmTscMapping)> {
    let backend = ensure_vhost_device_vsock()?;
    let append =
        format!("transport=vsock vsock=listen port={PLAIN_PORT} exit={PLAIN_EXIT_CODE} {options}");
    let mut rig = VsockRig::start(Machine::Microvm, &backend, elf, &append, PLAIN_PORT, STEP)?;
    let fail =
        |rig: &VsockRig, e: &dyn std::fmt::Display| anyhow::anyhow!("{e}\n{}", rig.diagnostics());
    // The rig connects only once the agent listens (see `VsockRig::wait_log`).
    rig.wait_log(&format!("vsock: listening on port {PLAIN_PORT}"), STEP)
        .map_err(|e| fail(&rig, &e))?;
    let inner = rig.connect(PLAIN_PORT, STEP).map_err(|e| fail(&rig, &e))?;
    let mut link = VsockRecorded {
        inner,
        last: FrameStamps {
            send: HostTicks(0),
            recv: HostTicks(0),
        },
        sent: 0,
        received: 0,
        pending: 0,
    };
    wait_ready(&mut link, Instant::now() + STEP).map_err(|e| fail(&rig, &e))?;
    // Connected: QEMU's VM and vCPU exist, so KVM's side of the truth is readable.
    let kvm = vmtsync_tests::truth::truth_mapping(rig.pids().0, 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    let out = run_sessions(&mut link, sessions, probes).map_err(|e| fail(&rig, &e))?;
    let status = rig
        .wait_exit(Duration::from_secs(20))
        .map_err(|e| fail(&rig, &e))?;
    if status.code() != Some(debug_exit_status(PLAIN_EXIT_CODE)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    Ok((out, kvm))
}

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const SYNC_EXIT_CODE: u8 = 5;
/// The agent's vsock port.
const SYNC_PORT_VSOCK: u32 = 1251;

/// One probe's brackets: in this process, and from the sync-port exits.
#[derive(Debug, Clone, Copy)]
pub struct Stamps {
    /// This thread's stamps around the system calls.
    pub stream: FrameStamps,
    /// The sync-port exits.
    pub exits: FrameStamps,
}

impl Recorded for AnchoredTransport<VsockTransport> {
    type Stamps = Stamps;

    fn last(&self) -> (Stamps, usize, usize) {
        let zero = FrameStamps {
            send: HostTicks(0),
            recv: HostTicks(0),
        };
        let (stream, exits) = self.last_pair().unwrap_or((zero, zero));
        (Stamps { stream, exits }, 0, 0)
    }
}

/// Boots the agent on vsock with `append` and `syncport=`, runs `sessions` sync-port anchored
/// sessions of `probes` probes, shuts it down and checks QEMU's exit status. Returns the
/// sessions and KVM's mapping of QEMU's vCPU (debugfs).
///
/// # Errors
/// Start, protocol or shutdown failures, with the rig's diagnostics.
pub fn run_sync_port(
    elf: &Path,
    append: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<Stamps>>, KvmTscMapping)> {
    let backend = ensure_vhost_device_vsock().context("vhost-device-vsock")?;
    let append = format!(
        "transport=vsock vsock=connect port={SYNC_PORT_VSOCK} ring=3 exit={SYNC_EXIT_CODE} \
         syncport={DEFAULT_SYNC_PORT:#x} {append}"
    );
    let mut rig = VsockRig::start(Machine::Q35, &backend, elf, &append, SYNC_PORT_VSOCK, STEP)
        .context("starting the vsock rig")?;
    let mut client = rig
        .accept(STEP)
        .with_context(|| format!("accepting the agent\n{}", rig.diagnostics()))?;
    let qemu_pid = rig.pids().0;
    let kvm = vmtsync_tests::truth::truth_mapping(qemu_pid, 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    wait_ready(&mut client, Instant::now() + STEP)
        .with_context(|| format!("waiting for the ready beacon\n{}", rig.diagnostics()))?;
    let anchor = AnchorOptions {
        mode: AnchorMode::KvmPio,
        vm: Some(VmSelector::Pid(qemu_pid)),
        ..AnchorOptions::default()
    };
    let mut link = prepare_matcher(
        Matcher::SyncPort {
            port: DEFAULT_SYNC_PORT,
        },
        &anchor,
        STEP,
        &mut |_| {},
    )
    .context("exit anchoring (root, tracefs, kvm_pio)")?
    .wrap(client);
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("vsock sessions\n{}", rig.diagnostics()))?;
    drop(link);
    let status = rig.wait_exit(STEP).context("waiting for QEMU")?;
    if status.code() != Some(debug_exit_status(SYNC_EXIT_CODE)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    Ok((out, kvm))
}
