//! Why a probe run failed: one error enum, each message saying what to try next (the CLI maps
//! them to exit codes).

use std::io;
use std::time::Duration;

use thiserror::Error;
use vmtsync_core::estimate::EstimateError;

use super::connect::ConnectError;
use super::transport::TransportError;
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
