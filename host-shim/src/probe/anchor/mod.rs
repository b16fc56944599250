//! Exit anchoring: each probe's host bracket taken from the host kernel's `kvm:kvm_pio` stamps
//! of the guest's own port I/O instead of from this process (docs/anchor.md).
//!
//! A guest agent on a UART reads the request byte by byte (`in` on the data port) and writes
//! its reply byte by byte (`out`); KVM stamps every such exit with the host TSC (trace clock
//! `x86-tsc`) before the VMM sees it. A guest cannot answer a request before it has read it,
//! and writes a reply frame (which holds the TSC it read) only once the frame is whole, so
//! `h(in that completed the request) ≤ host time of the guest's read ≤ h(first reply out)`,
//! whatever the VMM and the host socket add on top, and whatever else the guest does with its
//! ports in between (status polls, console text, other devices, other vCPUs).
//!
//! [`AnchoredTransport`] wraps any [`crate::link::StampedTransport`]: it remembers the last request frame it
//! sent and the bytes received since, and in [`crate::link::StampedTransport::refine`] drains the private
//! tracefs instance's `trace_pipe_raw` ([`crate::exits::PioTrace`]) and looks for the exchange's exits
//! ([`crate::exits::match_uart`]): the earliest run of data-port reads spelling the request and the latest
//! run of data-port writes spelling the reply, inside the process's own bracket, chosen so
//! that no extra access can move either end inwards past the read. The refined pair is
//! returned only when both are found in order and the kernel lost no exits meanwhile;
//! otherwise the probe is dropped and counted ([`crate::exits::AnchorStats`], `SessionStats::unanchored`),
//! never guessed.

//!
//! The exits themselves (the trace, the matchers, the counters) are the exits wing's
//! ([`crate::exits`]); this module puts them under a probe session.

mod setup;
mod transport;

pub use setup::{
    AnchorMode, AnchorOptions, AnchorSetup, anchor_transport, matcher_for, prepare, prepare_matcher,
};
pub use transport::AnchoredTransport;
