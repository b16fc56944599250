//! Why a probe run failed: one error enum, each message saying what to try next (the CLI maps
//! them to exit codes).

use std::io;
use std::time::Duration;

use thiserror::Error;
use vmtsync_core::estimate::EstimateError;

use crate::link::ConnectError;
use crate::link::transport::TransportError;
use crate::syncfile::SyncFileError;

/// Why a probe run failed. Each message says what to try next.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The connection could not be established.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// No (complete) reply within the timeout.
    #[error(
        "the guest agent did not send {what} within {after:?} ({bad_frames} undecodable frames so far): is the agent running on this socket? (raise --timeout-ms for slow guests)"
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
    /// several probes in a row ([`super::session::MAX_BYTES_PER_WAIT`] bytes per wait).
    #[error(
        "the guest sent {bytes} bytes while the host waited for {what}, more than a vmtsync agent ever sends: is something else writing to this channel?"
    )]
    Flooded {
        /// What we were waiting for.
        what: &'static str,
        /// Bytes received during that wait.
        bytes: u64,
    },
    /// The agent broke the protocol (an answer that cannot be right); nothing of it was used.
    #[error("the guest agent broke the protocol: {0}")]
    Protocol(String),
    /// The agent forgot the session (it restarted?).
    #[error("the guest agent answered NotReady: it restarted or lost the session; run probe again")]
    AgentNotReady,
    /// The vCPU asked for does not answer probes.
    #[error(
        "vCPU {vcpu} does not answer probes: the agent serves vCPUs {online:?} (an agent brings up the vCPUs its VM has; see docs/smp.md)"
    )]
    UnknownVcpu {
        /// The vCPU asked for.
        vcpu: u32,
        /// The vCPUs the agent serves.
        online: Vec<u32>,
    },
    /// The agent shut down.
    #[error("the guest agent exited during the session")]
    AgentExited,
    /// No usable sample, or the samples contradict every model.
    #[error("cannot estimate: {}", refusal_text(*.0))]
    Estimate(EstimateError),
    /// The sync file could not be written.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// Writing the report failed.
    #[error("writing output: {0}")]
    Output(io::Error),
    /// The probe log (`--probe-log`) could not be written.
    #[error("writing the probe log {path}: {source}")]
    ProbeLog {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The console file (`--console`) could not be written.
    #[error("writing the guest's console text to {path}: {source}")]
    Console {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// `--anchor kvm-pio` was asked for and cannot be done (docs/anchor.md).
    #[error("exit anchoring (--anchor kvm-pio): {0}")]
    Anchor(String),
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

/// Why a round's samples gave no estimate, in words that say what happened and what to do
/// (shared by `probe`, its `--json` refusal object and `record`).
#[must_use]
pub const fn refusal_text(e: EstimateError) -> &'static str {
    match e {
        EstimateError::NoSamples => {
            "no probe gave a sample: every probe of the round was lost (the counts of lost probes say why; is the agent answering? try a longer --timeout-ms)"
        }
        EstimateError::SegmentBreak => {
            "the probes' brackets contradict each other: no constant offset and rate fits them all (no probe was lost for it). Either the guest clock stepped during the round (run again), or a bracket missed its guest's TSC read: a guest that reads its TSC before it has the request or after it started its reply, or a fault in vmtsync's anchoring (keep the probes with --probe-log FILE and report it)"
        }
        EstimateError::Overflow => {
            "a value left the range the exact arithmetic is proven for (a guest TSC near wrapping, or a skew too large for it)"
        }
        EstimateError::OutOfOrder => "the samples' host stamps went backwards",
        EstimateError::VcpuMismatch => "samples of different vCPUs were mixed",
        EstimateError::InvalidSample => "a sample's host bracket ends before it starts",
        EstimateError::Unbounded => "the samples do not bound the rate yet",
        _ => "the estimators refused the samples",
    }
}

/// A short name of [`refusal_text`]'s cause, for the `--json` refusal object's `error` key.
#[must_use]
pub const fn refusal_kind(e: EstimateError) -> &'static str {
    match e {
        EstimateError::NoSamples => "no-samples",
        EstimateError::SegmentBreak => "contradictory-samples",
        EstimateError::Overflow => "overflow",
        _ => "refused-samples",
    }
}
