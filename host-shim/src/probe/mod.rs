//! `vmtsync probe`: measure a guest's TSC offset (and drift) by ping-pong probes against the
//! guest agent, with guaranteed bounds, next to trace-cmd's estimate on the same samples.
//!
//! Layers:
//! - The byte stream it runs on is [`crate::link`]'s.
//! - [`session`]: the one host-side protocol driver: hello, probes, requests, garbage, flood
//!   and timeout handling, every rejection counted; [`reference`](mod@reference): the window a reply's TSC
//!   must lie in, which makes compact replies unambiguous (docs/probe.md).
//! - [`report`]: estimates, RTT statistics, text and `--json` (schema 2) output.
//! - [`continuous`]: periodic re-sync into a sync file ([`crate::syncfile`]).
//! - [`log`](mod@log): `--probe-log`, every probe exchange for `vmtsync validate`.
//! - [`console`]: `--console`, the guest's console text from the UART it shares with the
//!   protocol.
//! - `run` ([`run_probe`], [`ProbeOptions`]) and `error` ([`ProbeError`]): one run, and why it
//!   failed.
//! - `testutil` (tests only): `SimTransport`, the core agent on a simulated host clock.
//!
//! The CLI parses `vmtsync::cli::probe::ProbeArgs` and calls [`run_probe`] with its options;
//! in-process users call [`run_probe_on`] with their own transport.

pub mod anchor;
pub mod console;
pub mod continuous;
mod error;
pub mod log;
pub mod progress;
pub mod reference;
pub mod report;
mod run;
pub mod session;
#[cfg(test)]
pub(crate) mod testutil;

pub use console::ConsoleLog;
pub use continuous::{ContinuousOptions, ContinuousSummary};
pub use error::{ProbeError, refusal_kind, refusal_text};
pub use log::{ProbeExchange, ProbeLog, ProbePath};
pub use progress::Progress;
pub use report::ProbeSummary;
pub use run::{
    DEFAULT_PROBES, ProbeOptions, VcpuChoice, run_probe, run_probe_on, run_probe_vcpus_on,
};
pub use session::{AgentInfo, ProbeSession, SessionStats};
