//! Probes through the built-in KVM VMM's COM1, with three host-TSC brackets per exchange.
//!
//! The VMM stamps every VM exit with `lfence; rdtsc` right after `KVM_RUN` returns, and this
//! module also stamps the host thread around its own send and receive, so one exchange yields:
//!
//! - `exit-tight`: `[exit before the reply's first byte, exit of that byte]`. The agent reads
//!   its TSC, encodes a few bytes and writes the first byte with no VM exit in between
//!   (`guest-agent/src/link.rs` invariant), and the previous exit's stamp was taken before the
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
use vmtsync_core::proto::{Feed, FrameReceiver, MAX_FRAME_SIZE, Message, encode_frame};
use vmtsync_tests::vmm::tsc::host_tsc;
use vmtsync_tests::vmm::{SerialHost, Vm, VmConfig, VmExit};

use crate::{Exchanged, ProbeLink, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 5;

/// The host stamps of one exchange through the built-in VMM (host TSC ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStamps {
    /// Exit where the guest read the request's last byte.
    pub request_read: u64,
    /// Exit just before the reply's first byte.
    pub prev_exit: u64,
    /// Exit of the reply's first byte.
    pub first_byte: u64,
    /// This thread, right before queueing the request.
    pub thread_send: u64,
    /// This thread, right after the reply's last byte arrived.
    pub thread_recv: u64,
    /// This thread, right after the reply's first byte arrived.
    pub thread_first: u64,
}

/// COM1 of a running VM as a [`ProbeLink`].
struct Com1<'a> {
    host: &'a SerialHost,
    rx: FrameReceiver,
}

impl ProbeLink for Com1<'_> {
    type Stamps = ExitStamps;

    fn exchange(&mut self, msg: &Message) -> Result<Exchanged<ExitStamps>> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame = encode_frame(msg, &mut buf).map_err(|e| anyhow::anyhow!("encode: {e:?}"))?;
        let sent = frame.len();
        let thread_send = host_tsc();
        self.host.send(frame);
        let end = Instant::now() + STEP;
        let mut received = 0;
        let mut first = None;
        let (reply, thread_recv) = loop {
            let b = self
                .host
                .recv_timeout(end.saturating_duration_since(Instant::now()))
                .context("no reply from the agent in time")?;
            received += 1;
            if first.is_none() {
                first = Some((b, host_tsc()));
            }
            match self.rx.feed(&[b.byte]) {
                Feed::Consumed => {}
                Feed::Message { msg, .. } => break (msg, host_tsc()),
                Feed::Error { error, .. } => bail!("bad frame from the agent: {error:?}"),
            }
        };
        // The guest read every request byte before it answered: all deliveries are queued.
        let mut request_read = 0;
        for _ in 0..sent {
            request_read = self
                .host
                .delivered_timeout(Duration::from_secs(1))
                .context("request byte delivery not recorded")?
                .host_tsc;
        }
        let (first, thread_first) = first.context("empty reply")?;
        Ok(Exchanged {
            reply,
            sent,
            received,
            stamps: ExitStamps {
                request_read,
                prev_exit: first.prev_exit_host_tsc,
                first_byte: first.host_tsc,
                thread_send,
                thread_recv,
                thread_first,
            },
        })
    }
}

/// Boots the agent in the built-in VMM with `cmdline` (plus `exit=5`), runs `sessions`
/// sessions of `probes` probes, shuts it down and checks it exited cleanly.
///
/// # Errors
/// Boot, protocol or shutdown failures, with the agent's COM2 log attached.
pub fn run(
    elf: &Path,
    cmdline: &str,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<ExitStamps>>, KvmTscMapping)> {
    let cfg = VmConfig {
        cmdline: format!("{cmdline} exit={EXIT_CODE}"),
        timeout: Duration::from_secs(100),
        ..VmConfig::default()
    };
    let vm = Vm::boot(elf, &cfg).context("booting the agent in the built-in VMM")?;
    let end = Instant::now() + STEP;
    let ready = loop {
        match vm
            .com1()
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            Some(b) if b.byte == 0 => break true,
            Some(_) => {}
            None => break false,
        }
    };
    if !ready {
        bail!("no ready beacon; COM2 log:\n{}", vm.log_text());
    }
    // The truth's KVM side: this VM's mapping in debugfs.
    let kvm = vmtsync_tests::truth::truth_mapping_of(vm.debugfs_id(), 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    let mut link = Com1 {
        host: vm.com1(),
        rx: FrameReceiver::new(),
    };
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("COM2 log:\n{}", vm.log_text()))?;
    let bye = link.exchange(&Message::Shutdown)?;
    if bye.reply != Message::Exiting {
        bail!("shutdown answered with {:?}", bye.reply);
    }
    let outcome = vm.wait().context("waiting for the VM to exit")?;
    if outcome.exit != VmExit::DebugExit(u32::from(EXIT_CODE)) {
        bail!("VM ended with {:?}; log:\n{}", outcome.exit, outcome.log);
    }
    Ok((out, kvm))
}
