//! Exit anchoring: each probe's host bracket taken from the host kernel's `kvm:kvm_pio` stamps
//! of the guest's own port I/O instead of from this process (docs/anchor.md).
//!
//! A guest agent on a UART reads the request byte by byte (`in` on the data port) and writes
//! its reply byte by byte (`out`); KVM stamps every such exit with the host TSC (trace clock
//! `x86-tsc`) before the VMM sees it. The agent reads its TSC after it has read the request's
//! delimiter and before it writes the reply's first byte, so
//! `h(delimiter in) ≤ host time of the guest's read ≤ h(first reply byte out)`: the exits of
//! the vCPU thread bracket the read, whatever the VMM and the host socket add on top.
//!
//! [`AnchoredTransport`] wraps any [`StampedTransport`]: it remembers the last request frame it
//! sent and the bytes received since, and in [`StampedTransport::refine`] drains the private
//! tracefs instance's `trace_pipe_raw` ([`PioTrace`]) and looks for the exchange's exits
//! ([`match_uart`]): the request's bytes read in order ending in its delimiter, then the
//! reply's bytes written in order, all by one vCPU thread, inside the process's own bracket.
//! The refined pair is returned only when every byte matches; otherwise the probe is dropped
//! and counted ([`AnchorStats`], `SessionStats::unanchored`), never guessed.

mod matching;
mod setup;
mod trace;
mod transport;

pub use matching::{UartBracket, match_sync_port, match_uart};
pub use setup::{
    AnchorMode, AnchorOptions, AnchorSetup, anchor_transport, matcher_for, prepare, prepare_matcher,
};
pub use trace::{PioTrace, filter};
pub use transport::AnchoredTransport;

use crate::ftrace::format::KvmPio;

/// The tracepoint, as tracefs names its directory.
pub const EVENT: &str = "kvm/kvm_pio";

/// The first 16550's data register (COM1), where the agent's UART protocol runs.
pub const COM1_DATA: u16 = 0x3f8;

/// The sync port `vmtsync probe` expects by default (agent option `syncport=0x2400`): no
/// device decodes it on QEMU microvm or q35 (docs/anchor.md; `0x510`, which looks free, is
/// fw_cfg on both).
pub const DEFAULT_SYNC_PORT: u16 = 0x2400;

/// How an exchange's exits are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matcher {
    /// The request's and the reply's bytes on the UART data port ([`match_uart`]).
    Uart {
        /// The data register.
        port: u16,
    },
    /// The agent's sync-port pair tagged with the probe's sequence number
    /// ([`match_sync_port`]).
    SyncPort {
        /// The sync port.
        port: u16,
    },
}

/// Exits kept between two probes at most; older ones are dropped first (a probe needs the
/// exits of its own request and reply, a few dozen). Bounds memory whatever the guest does.
pub const MAX_EXITS: usize = 4096;

/// Which stamps a probe's bracket came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnchorKind {
    /// `lfence; rdtsc` in this process around the system calls (or a test VMM's own stamps).
    #[default]
    InProcess,
    /// `kvm:kvm_pio` exits of the UART data port (request delimiter `in`, first reply `out`).
    KvmPioUart,
    /// `kvm:kvm_pio` exits of the agent's sync port (`in` before, `out` of the seq after the
    /// TSC read).
    KvmPioSyncPort,
}

impl AnchorKind {
    /// The name used in reports and sync files.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::InProcess => "in-process",
            Self::KvmPioUart => "kvm-pio-uart",
            Self::KvmPioSyncPort => "kvm-pio-sync-port",
        }
    }
}

/// One port exit of a traced vCPU thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PioExit {
    /// The exit's host TSC (the event timestamp, trace clock `x86-tsc`).
    pub ts: u64,
    /// The record.
    pub pio: KvmPio,
}

/// Why an exchange's exits were not found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmatched {
    /// The request frame or the reply frame is not known (nothing sent, no complete reply,
    /// too many bytes).
    Frames,
    /// No run of `out`s by one thread inside the bracket spells the reply.
    Reply,
    /// No run of `in`s before the reply, by its thread, spells the request.
    Request,
}

/// Counters of the anchor (reported next to the session's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnchorStats {
    /// Exchanges whose bracket came from the exits.
    pub matched: u64,
    /// Exchanges dropped: frames unknown.
    pub no_frames: u64,
    /// Exchanges dropped: the reply's `out`s were not all found.
    pub no_reply: u64,
    /// Exchanges dropped: the request's `in`s were not all found.
    pub no_request: u64,
    /// Exits dropped because more than [`MAX_EXITS`] were waiting.
    pub exits_overflowed: u64,
    /// Ring-buffer pages that flagged events lost by the kernel, or did not walk.
    pub damaged_pages: u64,
}
