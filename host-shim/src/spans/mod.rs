//! Spans of a guest: named phases (`SPAN_BEGIN`/`SPAN_END` records) and function calls
//! (`FUNC_ENTRY`/`FUNC_EXIT` records, from gcc's and clang's `-finstrument-functions` hooks),
//! paired on the host into [`Span`]s with both ends on the host timeline.
//!
//! docs/spans.md is the guide. The rule, in [`SpanTracker`]:
//! - One stack per vCPU and [`SpanKind`]: phases and functions need not nest inside each other.
//! - An exit closes the nearest frame with its key (a phase's name, a function's run-time
//!   address), searching from the top. The frames above it are *abandoned*: their entry was
//!   seen and their exit never will be (a `longjmp`, a thread switch, a record the ring
//!   overwrote). An exit with no frame is an *orphan*: its entry was not seen.
//! - Frames still on a stack when the recording ends are *open*: the guest was inside them
//!   (a hang shows here).
//! - Abandoned, orphan and open spans have one end only. No output gives them a duration.
//!
//! A span's depth is its frame's place in its own stack, 0 the outermost. Function addresses
//! are named from the image's ELF symbols after undoing relocations ([`symbols`]).

pub mod report;
pub mod symbols;
mod track;

pub use symbols::{Namer, Reloc, Symbols, parse_reloc};
pub use track::{SpanConfig, SpanCounts, SpanTracker};

use crate::formats::{Bound, ExportEvent};

/// What a span stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SpanKind {
    /// A named phase (`SPAN_BEGIN`/`SPAN_END`).
    Phase,
    /// A function call (`FUNC_ENTRY`/`FUNC_EXIT`).
    Function,
}

impl SpanKind {
    /// `"phase"` or `"function"`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Phase => "phase",
            Self::Function => "function",
        }
    }
}

/// One end of a span: the record's place on the host timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanEnd {
    /// The record on the host's TSC.
    pub host_tsc: u64,
    /// Its guaranteed interval, when the input has one.
    pub bound: Option<Bound>,
    /// The guest's TSC, when the input has it.
    pub guest_tsc: Option<u64>,
}

impl SpanEnd {
    /// The end of record `e`.
    #[must_use]
    pub fn of(e: &ExportEvent) -> Self {
        Self {
            host_tsc: e.host_tsc,
            bound: e.bound,
            guest_tsc: e.guest_tsc,
        }
    }
}

/// A span: both ends when closed, one when not ([`SpanState`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// The vCPU whose ring held its records.
    pub vcpu: u32,
    /// Phase or function.
    pub kind: SpanKind,
    /// The phase's name, or the function's symbol (`name+0x10` inside one, `0x…` unnamed).
    pub name: String,
    /// A function's address: its link address when a symbol names it (relocation undone),
    /// else its run-time address. `None` for a phase.
    pub addr: Option<u64>,
    /// Its place in its own stack, 0 the outermost.
    pub depth: u32,
    /// The entry, when seen.
    pub begin: Option<SpanEnd>,
    /// The exit, when seen.
    pub end: Option<SpanEnd>,
}

/// Which ends a span has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanState {
    /// Entry and exit: it has a duration.
    Closed,
    /// Entry only: abandoned, or still open when the recording ended.
    Open,
    /// Exit only: its entry was not seen.
    Orphan,
}

impl Span {
    /// Which ends it has.
    #[must_use]
    pub fn state(&self) -> SpanState {
        match (self.begin, self.end) {
            (Some(_), Some(_)) => SpanState::Closed,
            (Some(_), None) => SpanState::Open,
            _ => SpanState::Orphan,
        }
    }

    /// Host ticks from entry to exit (closed spans only).
    #[must_use]
    pub fn ticks(&self) -> Option<u64> {
        Some(self.end?.host_tsc.saturating_sub(self.begin?.host_tsc))
    }

    /// The guaranteed interval of its duration in host ticks, `[end.lo - begin.hi,
    /// end.hi - begin.lo]` (clamped at 0), when both ends have intervals.
    #[must_use]
    pub fn ticks_bound(&self) -> Option<Bound> {
        let b = self.begin?.bound?;
        let e = self.end?.bound?;
        Some(Bound {
            lo: e.lo.saturating_sub(b.hi),
            hi: e.hi.saturating_sub(b.lo),
        })
    }
}

/// What [`SpanTracker::push`] found, in stream order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpanStep {
    /// An entry (a begin): `end` is `None`.
    Enter(Span),
    /// A closed span, at its exit.
    Exit(Span),
    /// A frame whose exit will never come (an outer frame's exit came first): begin only.
    Abandoned(Span),
    /// An exit whose entry was not seen: end only.
    Orphan(Span),
}

impl SpanStep {
    /// The span.
    #[must_use]
    pub fn span(&self) -> &Span {
        match self {
            Self::Enter(s) | Self::Exit(s) | Self::Abandoned(s) | Self::Orphan(s) => s,
        }
    }
}
