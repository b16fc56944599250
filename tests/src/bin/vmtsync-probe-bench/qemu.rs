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
//!
//! The same probes are exit-anchored at the same time (`vmtsync probe --anchor kvm-pio`'s
//! `AnchoredTransport` around the pipes): the host kernel's `kvm:kvm_pio` stamps of the
//! vCPU thread's COM1 exits, from a private tracefs instance. The session's samples use those
//! brackets (a probe whose exits are not found is lost, and fails the run); every probe keeps
//! its in-process stamps too, so the rows compare brackets on one run's probes.
//!
//! With [`Matcher::SyncPort`] (the agent booted with `syncport=N`) the same run brackets every
//! probe by the agent's own sync-port exits instead of the UART's (`…/sync-port`), which is
//! how the boot vCPU's ring-0 and ring-3 brackets are compared (docs/anchor.md).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync::exits::{Matcher, UartBracket};
use vmtsync::kvm::scan::VmSelector;
use vmtsync::probe::anchor::{AnchorMode, AnchorOptions, AnchoredTransport, prepare_matcher};
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

/// One probe's brackets: in this process, and from the exits.
#[derive(Debug, Clone, Copy)]
pub struct Stamps {
    /// This thread's stamps around the system calls.
    pub pipe: PipeExchange,
    /// The exits of the probe's request and reply (UART matching only).
    pub exits: UartBracket,
    /// The bracket the session used, from whichever exits the matcher found.
    pub anchored: (u64, u64),
}

impl Recorded for AnchoredTransport<PipeTransport> {
    type Stamps = Stamps;

    fn last(&self) -> (Stamps, usize, usize) {
        let (pipe, sent, received) = self.inner().last();
        let exits = self.last_bracket().unwrap_or(UartBracket {
            delimiter_in: pipe.send,
            first_out: pipe.recv,
        });
        // An exchange whose exits were not found is lost (the session asks again), so the last
        // anchored pair is this probe's.
        let anchored = self
            .last_pair()
            .map_or((pipe.send, pipe.recv), |(_, a)| (a.send.0, a.recv.0));
        (
            Stamps {
                pipe,
                exits,
                anchored,
            },
            sent,
            received,
        )
    }
}

/// Boots the agent (boot options `append`) under QEMU `machine` with COM1 on stdio, runs
/// `sessions` sessions of `probes` probes exit-anchored as `matcher` says, shuts it down and
/// checks QEMU's exit status. Returns the sessions and KVM's mapping of QEMU's vCPU (debugfs), the truth's KVM
/// side.
///
/// # Errors
/// Start, protocol or shutdown failures, with the agent's COM2 log attached.
pub fn run(
    elf: &Path,
    machine: Machine,
    append: &str,
    matcher: Matcher,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<Stamps>>, KvmTscMapping)> {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("vmtsync-probe-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("temp dir")?;
    let com2 = dir.join("com2.log");
    let com2_text = || vmtsync_tests::vmm::defmt_log::decode_file_text(elf, &com2);
    let append = format!("transport=uart exit={EXIT_CODE} {append}");
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
    let anchor = AnchorOptions {
        mode: AnchorMode::KvmPio,
        vm: Some(VmSelector::Pid(guard.pid())),
        ..AnchorOptions::default()
    };
    let mut link = prepare_matcher(matcher, &anchor, STEP, &mut |_| {})
        .context("exit anchoring (root, tracefs, kvm_pio)")?
        .wrap(link);
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("COM2 log:\n{}", com2_text()))?;
    drop(link);
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
