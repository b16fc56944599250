//! Probes through the built-in KVM VMM's COM1, with three host-TSC brackets per exchange.
//!
//! The VMM stamps every VM exit with `lfence; rdtsc` right after `KVM_RUN` returns, and this
//! module also stamps the host thread around its own send and receive, so one exchange yields:
//!
//! - `exit-tight`: `[exit before the reply's first byte, exit of that byte]`. The agent reads
//!   its TSC, encodes a few bytes and writes the first byte with no VM exit in between (the
//!   bundled agent's default `TxOrder::WriteThenWait` of core's `Uart16550`, docs/uart.md;
//!   the `Link` contract does not promise it), and the previous exit's stamp was taken before the
//!   vCPU re-entered the guest, so the read certainly lies inside. The tightest honest bracket.
//! - `exit-loose`: `[exit where the guest read the request's delimiter, exit of the reply's
//!   first byte]`: the guest cannot have acted on the request before the first.
//! - `host-thread`: `[rdtsc before queueing the request, rdtsc after the reply's delimiter
//!   reached this thread]`: what a tool outside the VMM sees, including thread wake-ups.
//! - `host-thread-first`: the same, closed when the reply's first byte reached this thread
//!   (the agent read its TSC before writing that byte, so this is as honest and tighter).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_tests::vmm::client::{Com1Exchange, Com1Transport, wait_ready};
use vmtsync_tests::vmm::{Vm, VmConfig, VmExit};

use crate::{Recorded, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 5;

impl Recorded for Com1Transport<'_> {
    type Stamps = Com1Exchange;

    fn last(&self) -> (Com1Exchange, usize, usize) {
        let x = self.last_exchange();
        (x, x.sent, x.received)
    }
}

/// Boots the agent in the built-in VMM with `cmdline` (plus `exit=5`), runs `sessions`
/// sessions of `probes` probes, shuts it down and checks it exited cleanly. Returns the
/// sessions and KVM's mapping of the VM's vCPU (debugfs), the truth's KVM side.
///
/// # Errors
/// Boot, protocol or shutdown failures, with the agent's COM2 log attached.
pub fn run(
    elf: &Path,
    cmdline: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<Com1Exchange>>, KvmTscMapping)> {
    let cfg = VmConfig {
        cmdline: format!("{cmdline} exit={EXIT_CODE}"),
        timeout: Duration::from_secs(100),
        ..VmConfig::default()
    };
    let vm = Vm::boot(elf, &cfg).context("booting the agent in the built-in VMM")?;
    let mut link = Com1Transport::new(vm.com1());
    if wait_ready(&mut link, Instant::now() + STEP).is_err() {
        bail!("no ready beacon; COM2 log:\n{}", vm.log_text());
    }
    // The truth's KVM side: this VM's mapping in debugfs.
    let kvm = vmtsync_tests::truth::truth_mapping_of(vm.debugfs_id(), 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("COM2 log:\n{}", vm.log_text()))?;
    let outcome = vm.wait().context("waiting for the VM to exit")?;
    if outcome.exit != VmExit::DebugExit(u32::from(EXIT_CODE)) {
        bail!("VM ended with {:?}; log:\n{}", outcome.exit, outcome.log);
    }
    Ok((out, kvm))
}
