//! Probes over virtio-vsock: QEMU microvm with `vhost-user-vsock-device` and the
//! `vhost-device-vsock` backend (the rig of `vmtsync_tests::vmm::vsock`), the path where
//! one-way delays vary most from probe to probe (docs/vsock.md).
//!
//! The host stamps with `lfence; rdtsc` right before the `write(2)` of the request and right
//! after the `read(2)` that completed the reply, on vmtsync's own socket transport (what
//! `vmtsync probe --connect vsock-uds:` does). The guest read its TSC in between: the request
//! cannot reach it before the write, and the reply cannot be read before it was written.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync::probe::{FrameStamps, Received, StampedTransport, TransportError};
use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::vmm::client::wait_ready;
use vmtsync_tests::vmm::qemu::Machine;
use vmtsync_tests::vmm::vsock::{VsockRig, VsockTransport, ensure_vhost_device_vsock};

use crate::{Recorded, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 11;
/// The guest port the agent listens on.
const PORT: u32 = 5_600;

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
pub fn run(
    elf: &Path,
    options: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<FrameStamps>>, KvmTscMapping)> {
    let backend = ensure_vhost_device_vsock()?;
    let append = format!("transport=vsock vsock=listen port={PORT} exit={EXIT_CODE} {options}");
    let mut rig = VsockRig::start(Machine::Microvm, &backend, elf, &append, PORT, STEP)?;
    let fail =
        |rig: &VsockRig, e: &dyn std::fmt::Display| anyhow::anyhow!("{e}\n{}", rig.diagnostics());
    // The rig connects only once the agent listens (see `VsockRig::wait_log`).
    rig.wait_log(&format!("vsock: listening on port {PORT}"), STEP)
        .map_err(|e| fail(&rig, &e))?;
    let inner = rig.connect(PORT, STEP).map_err(|e| fail(&rig, &e))?;
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
    if status.code() != Some(vmtsync_tests::vmm::qemu::debug_exit_status(EXIT_CODE)) {
        bail!("QEMU exited with {status}\n{}", rig.diagnostics());
    }
    Ok((out, kvm))
}
