//! One `vmtsync probe` run: the options, connecting, the hello, one round or continuous mode,
//! the report.

use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use vmtsync_core::estimate::EstimateError;

use super::addr::ProbeAddr;
use super::anchor::{self, AnchorMode, AnchorOptions};
use super::connect::{self, ConnectOptions};
use super::continuous::{self, ContinuousOptions};
use super::error::ProbeError;
use super::progress::Progress;
use super::report::ProbeSummary;
use super::session::ProbeSession;
use super::transport::StampedTransport;

/// Default number of probes per round.
pub const DEFAULT_PROBES: u32 = 64;

/// Everything `vmtsync probe` needs; build with [`ProbeOptions::new`] and adjust fields.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// Where the agent is.
    pub addr: ProbeAddr,
    /// Probes per round (`--probes`, default 64).
    pub probes: u32,
    /// Pause between probes (`--interval MS`, default 0: back to back).
    pub interval: Duration,
    /// The longest wait for any reply (`--timeout MS`, default 2 s).
    pub timeout: Duration,
    /// The longest wait to connect, retries included (default 10 s).
    pub connect_timeout: Duration,
    /// Print the schema-2 JSON object instead of text (`--json`).
    pub json: bool,
    /// Show progress on stderr when it is a terminal.
    pub progress: bool,
    /// Continuous mode (`--continuous --out FILE`), or one round.
    pub continuous: Option<ContinuousOptions>,
    /// Set from another thread or a signal handler (e.g. the CLI's `static STOP`): ends
    /// continuous mode after the current round, and otherwise abandons the connect, hello or
    /// round within about 20 ms with [`ProbeError::Interrupted`].
    pub stop: Option<&'static AtomicBool>,
    /// End the agent when done (`--shutdown`): send `Shutdown` and wait for `Exiting`. Off by
    /// default: probing must not stop the guest being traced; the agent then serves the next
    /// session's hello.
    pub shutdown: bool,
    /// Exit anchoring (`--anchor`; off by default here, `auto` in the CLI).
    pub anchor: AnchorOptions,
}

impl ProbeOptions {
    /// Defaults: 64 back-to-back probes, 2 s reply timeout, 10 s connect timeout, text
    /// output, progress on a terminal, one round.
    #[must_use]
    pub fn new(addr: ProbeAddr) -> Self {
        Self {
            addr,
            probes: DEFAULT_PROBES,
            interval: Duration::ZERO,
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            json: false,
            progress: true,
            continuous: None,
            stop: None,
            shutdown: false,
            anchor: AnchorOptions::default(),
        }
    }
}

/// Connects to `opts.addr`, sets up exit anchoring as `opts.anchor` says (notes on stderr)
/// and runs [`run_probe_on`].
///
/// # Errors
/// [`ProbeError`]; [`ProbeError::Anchor`] when `--anchor kvm-pio` cannot be done, or no
/// exchange's exits were found.
pub fn run_probe(opts: &ProbeOptions, out: &mut dyn Write) -> Result<ProbeSummary, ProbeError> {
    let note = &mut |m: &str| eprintln!("vmtsync: probe: {m}");
    let setup = anchor::prepare(&opts.addr, &opts.anchor, opts.connect_timeout, note)?;
    let transport = connect::connect_until_stopped(
        &opts.addr,
        &ConnectOptions {
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.timeout,
        },
        opts.stop,
    )?;
    let mut t = setup.wrap(transport);
    let r = run_probe_on(&mut t, opts, out);
    if let Some(why) = t.gave_up() {
        note(&format!(
            "not exit-anchored: the agent's first exchange was not among the VM's UART exits ({why:?}); host stamps were taken in this process"
        ));
    }
    match r {
        Err(ProbeError::Estimate(EstimateError::NoSamples))
            if opts.anchor.mode == AnchorMode::KvmPio && t.stats().matched == 0 =>
        {
            let how = match anchor::matcher_for(&opts.addr, &opts.anchor) {
                anchor::Matcher::Uart { port } => format!("the UART at {port:#x}"),
                anchor::Matcher::SyncPort { port } => {
                    format!("the sync port {port:#x} (boot the agent with syncport={port:#x})")
                }
            };
            Err(ProbeError::Anchor(format!(
                "no probe's exits were found among the kvm_pio events of the VM's vCPU threads on {how}: is the agent in that VM (--vm)?"
            )))
        }
        r => r,
    }
}

/// Runs hello, then one round of `opts.probes` (printing its report), or continuous mode;
/// then shuts the session down. Returns the (last) round's summary.
///
/// # Errors
/// [`ProbeError`]; in continuous mode, `Estimate(NoSamples)` if no round produced a sample.
pub fn run_probe_on<T: StampedTransport>(
    transport: T,
    opts: &ProbeOptions,
    out: &mut dyn Write,
) -> Result<ProbeSummary, ProbeError> {
    let mut progress = Progress::stderr_if_terminal(opts.progress);
    let mut session = ProbeSession::hello_until_stopped(transport, opts.timeout, opts.stop)?;
    let result = match &opts.continuous {
        Some(cont) => continuous::run(&mut session, opts, cont, out, &mut progress).and_then(|c| {
            c.last.ok_or(if opts.stopped() {
                // Stopped before any round measured something: interrupted, not "no samples".
                ProbeError::Interrupted
            } else {
                ProbeError::Estimate(EstimateError::NoSamples)
            })
        }),
        None => one_round(&mut session, opts, out, &mut progress),
    };
    if opts.shutdown {
        session.shutdown();
    }
    result
}

fn one_round<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &ProbeOptions,
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<ProbeSummary, ProbeError> {
    let samples = session.probe_round(opts.probes, opts.interval, progress)?;
    let summary = ProbeSummary::from_samples(session.info(), &samples, session.stats())?;
    if opts.json {
        summary.write_json(out)
    } else {
        writeln!(out, "vmtsync probe {}", opts.addr).and_then(|()| summary.write_text(out))
    }
    .map_err(ProbeError::Output)?;
    Ok(summary)
}
