//! Probes through QEMU's COM1 on a stdio chardev: the path an external host tool has.
//!
//! The host reads its TSC (`lfence; rdtsc`) right before the `write()` of the request frame and
//! right after the `read()` that completed the reply frame, in one thread with no channel in
//! between. The guest's TSC read certainly lies between: the request cannot reach the guest
//! before it is written, and the reply cannot be read before the guest wrote it.
//!
//! It also keeps the stamp right after the first `read()` that returned reply bytes: the agent
//! reads its TSC before it writes the reply's first byte, so that stamp is an equally honest
//! upper bound, and a tighter one (the rest of the frame's per-byte UART exits stay out).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::vmm::client::{PipeExchange, PipeTransport, wait_ready};
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status};

use crate::{Recorded, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 9;

impl Recorded for PipeTransport {
    type Stamps = PipeExchange;

    fn last(&self) -> (PipeExchange, usize, usize) {
        let x = self.last_exchange();
        (x, x.sent, x.received)
    }
}

/// Boots the agent under QEMU `machine` with COM1 on stdio, runs `sessions` sessions of
/// `probes` probes, shuts it down and checks QEMU's exit status. Returns the sessions and
/// KVM's mapping of QEMU's vCPU (debugfs), the truth's KVM side.
///
/// # Errors
/// Start, protocol or shutdown failures, with the agent's COM2 log attached.
pub fn run(
    elf: &Path,
    machine: Machine,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<PipeExchange>>, KvmTscMapping)> {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("vmtsync-probe-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("temp dir")?;
    let com2 = dir.join("com2.log");
    let com2_text = || vmtsync_tests::vmm::defmt_log::decode_file_text(elf, &com2);
    let append = format!("transport=uart exit={EXIT_CODE}");
    let child = qemu::command(machine, elf, &append, &com2)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let mut guard = ChildGuard::new(child);
    let mut link = PipeTransport::new(
        guard.child().stdin.take().context("QEMU stdin")?,
        guard.child().stdout.take().context("QEMU stdout")?,
    );
    // The ready beacon is a lone 0x00; anything before it is not protocol.
    wait_ready(&mut link, Instant::now() + STEP)
        .with_context(|| format!("waiting for the ready beacon; COM2 log:\n{}", com2_text()))?;
    // After the beacon QEMU's VM exists: the truth's KVM side is its mapping in debugfs.
    let kvm = vmtsync_tests::truth::truth_mapping(guard.pid(), 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("COM2 log:\n{}", com2_text()))?;
    let end = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = guard.child().try_wait().context("waiting for QEMU")? {
            break s;
        }
        if Instant::now() > end {
            bail!("QEMU did not exit after shutdown");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if status.code() != Some(debug_exit_status(EXIT_CODE)) {
        bail!("QEMU exited with {status}; COM2 log:\n{}", com2_text());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((out, kvm))
}
