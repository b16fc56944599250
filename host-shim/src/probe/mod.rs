//! `vmtsync probe`: measure a guest's TSC offset (and drift) by ping-pong probes against the
//! guest agent, with guaranteed bounds, next to trace-cmd's estimate on the same samples.
//!
//! Layers:
//! - [`addr`]: the `--connect ADDR` forms and the AF_VSOCK socket address.
//! - [`args`]: the flags as a clap `Args` struct for the CLI.
//! - [`connect`]: opening an address; with `retry` (backoff, one deadline, the stop flag),
//!   `sockets` (Unix, TCP), [`vhost_uds`] (vhost-device-vsock's `CONNECT` handshake, also used
//!   by the test rigs) and [`vsock`] (AF_VSOCK through the rust-vmm `vsock` crate).
//! - [`transport`]: [`StampedTransport`], the byte stream that stamps with the host TSC, and
//!   its socket implementation; the test VMM's COM1 implements the trait with its VM-exit
//!   stamps (`vmtsync_tests::vmm::client`).
//! - [`session`]: the one host-side protocol driver: hello, probes, requests, garbage, flood
//!   and timeout handling, every rejection counted; [`reference`](mod@reference): the window a reply's TSC
//!   must lie in, which makes compact replies unambiguous (docs/probe.md).
//! - [`report`]: estimates, RTT statistics, text and `--json` (schema 1) output.
//! - [`continuous`]: periodic re-sync into a sync file ([`crate::syncfile`]).
//! - `testutil` (tests only): `SimTransport`, the core agent on a simulated host clock.
//!
//! The CLI parses [`ProbeArgs`] and calls [`run_probe`] with [`ProbeArgs::to_options`];
//! in-process users call [`run_probe_on`] with their own transport.

pub mod addr;
pub mod args;
pub mod connect;
pub mod continuous;
pub mod progress;
pub mod reference;
pub mod report;
mod retry;
pub mod session;
mod sockets;
#[cfg(test)]
pub(crate) mod testutil;
pub mod transport;
pub mod vhost_uds;
pub mod vsock;

use std::io::{self, Write};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use thiserror::Error;
use vmtsync_core::estimate::EstimateError;

pub use addr::{AddrError, ProbeAddr};
pub use args::ProbeArgs;
pub use connect::{ConnectError, ConnectOptions};
pub use continuous::{ContinuousOptions, ContinuousSummary};
pub use progress::Progress;
pub use report::{OffsetModel, ProbeSummary};
pub use session::{AgentInfo, ProbeSession, SessionStats};
pub use transport::{FrameStamps, Received, StampedTransport, StreamTransport, TransportError};

use crate::syncfile::SyncFileError;

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
    /// Print the schema-1 JSON object instead of text (`--json`).
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
        }
    }
}

/// Why a probe run failed. Each message says what to try next.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The connection could not be established.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// No (complete) reply within the timeout.
    #[error(
        "the guest agent did not send {what} within {after:?} ({bad_frames} undecodable frames so far): is the agent running on this socket? (raise --timeout for slow guests)"
    )]
    Timeout {
        /// What we were waiting for.
        what: &'static str,
        /// The timeout.
        after: Duration,
        /// Frames skipped as garbage so far (many: the peer is not a vmtsync agent).
        bad_frames: u64,
    },
    /// The transport failed.
    #[error("while waiting for {what}: {source}")]
    Transport {
        /// What we were doing.
        what: &'static str,
        /// The error.
        source: TransportError,
    },
    /// The agent speaks another protocol version.
    #[error(
        "the guest agent speaks protocol version {agent}, this vmtsync speaks {host}: rebuild the agent and vmtsync from the same release"
    )]
    VersionMismatch {
        /// Ours.
        host: u16,
        /// The agent's.
        agent: u16,
    },
    /// The guest sent far more than the protocol needs while the host waited for a reply,
    /// several probes in a row ([`session::MAX_BYTES_PER_WAIT`] bytes per wait).
    #[error(
        "the guest sent {bytes} bytes while the host waited for {what}, more than a vmtsync agent ever sends: is something else writing to this channel?"
    )]
    Flooded {
        /// What we were waiting for.
        what: &'static str,
        /// Bytes received during that wait.
        bytes: u64,
    },
    /// The agent forgot the session (it restarted?).
    #[error("the guest agent answered NotReady: it restarted or lost the session; run probe again")]
    AgentNotReady,
    /// The agent shut down.
    #[error("the guest agent exited during the session")]
    AgentExited,
    /// No usable sample, or the samples contradict every model.
    #[error(
        "cannot estimate: {0:?} (NoSamples: every probe was lost; SegmentBreak: the guest clock stepped during the round, run again)"
    )]
    Estimate(EstimateError),
    /// The sync file could not be written.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// Writing the report failed.
    #[error("writing output: {0}")]
    Output(io::Error),
    /// The stop flag was raised (SIGINT/SIGTERM in the CLI) outside continuous mode, or before
    /// continuous mode measured anything: the run was abandoned.
    #[error("interrupted")]
    Interrupted,
    /// A bug: an invariant of this crate did not hold.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl ProbeError {
    /// True for a write to a closed pipe (`vmtsync probe --json | head -1`), which the CLI
    /// treats as success.
    #[must_use]
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Self::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }
}

impl From<EstimateError> for ProbeError {
    fn from(e: EstimateError) -> Self {
        Self::Estimate(e)
    }
}

/// Connects to `opts.addr` and runs [`run_probe_on`].
///
/// # Errors
/// [`ProbeError`].
pub fn run_probe(opts: &ProbeOptions, out: &mut dyn Write) -> Result<ProbeSummary, ProbeError> {
    let transport = connect::connect_until_stopped(
        &opts.addr,
        &ConnectOptions {
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.timeout,
        },
        opts.stop,
    )?;
    run_probe_on(transport, opts, out)
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
