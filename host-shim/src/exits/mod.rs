//! The exits wing: the host's own record of a guest's port I/O. KVM stamps every `kvm:kvm_pio`
//! exit of a vCPU thread with the host TSC (trace clock `x86-tsc`) before the VMM sees it;
//! this module traces them in a private tracefs instance ([`PioTrace`], `trace.rs`), finds an
//! exchange's exits among them ([`match_uart`], [`match_sync_port`], `matching.rs`) and
//! brackets a guest's sync beacons with them ([`BeaconChain`], `beacon.rs`), with the
//! counters of what was matched, dropped or lost ([`AnchorStats`]).
//!
//! Used by `probe` (exit-anchored probes, docs/anchor.md), `record` (beacon mode) and
//! `validate` (events and probes checked against the exits); it depends on none of them.

mod beacon;
mod matching;
mod trace;

pub use beacon::{BeaconBracket, BeaconChain, ChainBroken};
pub use matching::{UartBracket, match_sync_port, match_uart};
pub use trace::{PioTrace, filter};

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
    /// No run of `in`s inside the bracket spells the request.
    Request,
    /// The earliest whole reading of the request ends after the latest writing of the reply
    /// starts: no guest that answers what it read leaves such exits (exits are missing).
    Order,
    /// Exits of this exchange may be missing: the kernel lost some (a flagged or unreadable
    /// ring-buffer page), more than [`MAX_EXITS`] were waiting, a drain left pages unread, or
    /// the trace could not be read.
    TraceLost,
}

impl Unmatched {
    /// What happened, in words (for messages).
    #[must_use]
    pub const fn describe(self) -> &'static str {
        match self {
            Self::Frames => "the request or the reply frame was not known",
            Self::Reply => "no writes of the reply's bytes were traced",
            Self::Request => "no reads of the request's bytes were traced",
            Self::Order => "the traced exits had the reply written before the request was read",
            Self::TraceLost => {
                "kvm_pio events were lost, or could not be read, during the exchange"
            }
        }
    }
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
    /// Exchanges dropped: the exits found had the reply before the request.
    pub disordered: u64,
    /// Exchanges dropped: the kernel lost exits while they ran.
    pub trace_lost: u64,
    /// Exits dropped because more than [`MAX_EXITS`] were waiting.
    pub exits_overflowed: u64,
    /// Ring-buffer pages that flagged events lost by the kernel, or did not walk.
    pub damaged_pages: u64,
    /// Drains that stopped at their page limit with pages still waiting.
    pub drains_capped: u64,
}

impl AnchorStats {
    /// Counts one exchange dropped because its exits were not found, under its reason: each
    /// [`Unmatched`] has its own counter.
    pub fn count_unmatched(&mut self, why: Unmatched) {
        *match why {
            Unmatched::Frames => &mut self.no_frames,
            Unmatched::Reply => &mut self.no_reply,
            Unmatched::Request => &mut self.no_request,
            Unmatched::Order => &mut self.disordered,
            Unmatched::TraceLost => &mut self.trace_lost,
        } += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::{AnchorStats, Unmatched};

    /// Each reason an exchange went unmatched has its own counter, and only that one moves.
    #[test]
    fn each_unmatched_reason_counts_in_its_own_counter() {
        let mut s = AnchorStats::default();
        for why in [
            Unmatched::Frames,
            Unmatched::Reply,
            Unmatched::Reply,
            Unmatched::Request,
            Unmatched::Order,
            Unmatched::TraceLost,
        ] {
            s.count_unmatched(why);
        }
        let want = AnchorStats {
            no_frames: 1,
            no_reply: 2,
            no_request: 1,
            disordered: 1,
            trace_lost: 1,
            ..AnchorStats::default()
        };
        assert_eq!(s, want);
    }
}
