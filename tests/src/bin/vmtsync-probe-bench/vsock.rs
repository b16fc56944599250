//! Probes over virtio-vsock (QEMU q35 + qboot, `vhost-user-vsock-pci`, vhost-device-vsock;
//! never AF_VSOCK), bracketed two ways on the same probes: by this thread's `rdtsc` around the
//! socket's `write()` and `read()` (`vsock/stream`), and by the agent's sync-port exits
//! (`syncport=0x2400`: an `in` right before its TSC read, an `out` of the probe's sequence
//! number right after, stamped by the host kernel's `kvm:kvm_pio`; `vsock/sync-port`, what
//! `vmtsync probe --anchor kvm-pio` uses on vsock). A probe whose sync-port exits are not found
//! is lost, and fails the run.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use vmtsync::probe::FrameStamps;
use vmtsync::probe::anchor::{
    AnchorMode, AnchorOptions, AnchoredTransport, DEFAULT_SYNC_PORT, Matcher, prepare_matcher,
};
use vmtsync::scan::VmSelector;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::vmm::client::wait_ready;
use vmtsync_tests::vmm::qemu::{Machine, debug_exit_status};
use vmtsync_tests::vmm::vsock::{VsockRig, VsockTransport, ensure_vhost_device_vsock};

use crate::{Recorded, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 5;
/// The agent's vsock port.
const PORT: u32 = 1251;

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
            send: vmtsync_core::HostTicks(0),
            recv: vmtsync_core::HostTicks(0),
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
pub fn run(
    elf: &Path,
    append: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<Stamps>>, KvmTscMapping)> {
    let backend = ensure_vhost_device_vsock().context("vhost-device-vsock")?;
    let append = format!(
        "transport=vsock vsock=connect port={PORT} ring=3 exit={EXIT_CODE} \
         syncport={DEFAULT_SYNC_PORT:#x} {append}"
    );
    let mut rig = VsockRig::start(Machine::Q35, &backend, elf, &append, PORT, STEP)
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
    if status.code() != Some(debug_exit_status(EXIT_CODE)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    Ok((out, kvm))
}
