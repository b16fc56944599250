//! [`SpanTracker`]: span records in, [`SpanStep`]s out, one stack per vCPU and kind.

use std::collections::BTreeMap;
use std::sync::Arc;

use vmtsync_core::recorder::span::{SpanRecord, decode};

use super::symbols::{Namer, Reloc, Symbols};
use super::{Span, SpanEnd, SpanKind, SpanStep};
use crate::formats::ExportEvent;

/// The deepest a stack may grow; an entry beyond it is shown as abandoned at once, so a guest
/// that never returns cannot make the host's memory grow.
pub const MAX_DEPTH: usize = 4096;

/// What a tracker is told before the first record.
#[derive(Clone, Debug, Default)]
pub struct SpanConfig {
    /// The guest image's function symbols (`--symbols`), if given.
    pub symbols: Option<Arc<Symbols>>,
    /// Relocations the user names (`--reloc`), in force from the start.
    pub relocs: Vec<Reloc>,
}

/// How many of each the tracker met.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpanCounts {
    /// Entries and begins.
    pub entries: u64,
    /// Spans closed by their exit.
    pub closed: u64,
    /// Frames an outer frame's exit left behind (or beyond [`MAX_DEPTH`]).
    pub abandoned: u64,
    /// Exits whose entry was not seen.
    pub orphans: u64,
    /// Relocation records.
    pub relocs: u64,
}

/// What identifies a frame for its exit.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Key {
    Name(String),
    Addr(u64),
}

#[derive(Debug)]
struct Frame {
    key: Key,
    span: Span,
}

/// Pairs entries with exits as records stream in (each vCPU's records in its own order;
/// vCPUs may interleave).
#[derive(Debug, Default)]
pub struct SpanTracker {
    namer: Namer,
    stacks: BTreeMap<(u32, SpanKind), Vec<Frame>>,
    /// Each vCPU's guest boot so far.
    boots: BTreeMap<u32, u32>,
    counts: SpanCounts,
}

impl SpanTracker {
    /// A tracker with `cfg`'s symbols and relocations.
    #[must_use]
    pub fn new(cfg: &SpanConfig) -> Self {
        Self {
            namer: Namer::new(cfg.symbols.clone(), &cfg.relocs),
            ..Self::default()
        }
    }

    /// Takes `e` if it is a span record (`true`: its steps are appended to `out`); `false`:
    /// an ordinary event, for the caller to handle as before.
    pub fn push(&mut self, e: &ExportEvent, out: &mut Vec<SpanStep>) -> bool {
        self.push_in_boot(e, 0, out)
    }

    /// [`Self::push`] for a recording that followed the guest across resets: `boot` numbers
    /// the guest's boots (0, 1, …). When a vCPU's boot changes, every frame it had open is
    /// abandoned first (the reset ended them; their exits will never come), and the
    /// relocations the old boot's records made are forgotten.
    pub fn push_in_boot(&mut self, e: &ExportEvent, boot: u32, out: &mut Vec<SpanStep>) -> bool {
        let Some(rec) = decode(e.id, e.payload.as_slice()) else {
            return false;
        };
        let was = *self.boots.entry(e.vcpu).or_insert(boot);
        if was != boot {
            self.boots.insert(e.vcpu, boot);
            self.namer.forget_guest_relocs();
            for kind in [SpanKind::Phase, SpanKind::Function] {
                for f in self.stacks.remove(&(e.vcpu, kind)).unwrap_or_default() {
                    self.counts.abandoned += 1;
                    out.push(SpanStep::Abandoned(f.span));
                }
            }
        }
        let at = SpanEnd::of(e);
        match rec {
            SpanRecord::Begin { name } => {
                let name = String::from_utf8_lossy(name.as_bytes()).into_owned();
                self.enter(
                    e.vcpu,
                    SpanKind::Phase,
                    Key::Name(name.clone()),
                    name,
                    None,
                    at,
                    out,
                );
            }
            SpanRecord::End { name } => {
                let name = String::from_utf8_lossy(name.as_bytes()).into_owned();
                self.exit(
                    e.vcpu,
                    SpanKind::Phase,
                    &Key::Name(name.clone()),
                    name,
                    None,
                    at,
                    out,
                );
            }
            SpanRecord::Entry { func, .. } => {
                let (name, addr) = self.namer.name(func);
                let key = Key::Addr(func);
                self.enter(e.vcpu, SpanKind::Function, key, name, Some(addr), at, out);
            }
            SpanRecord::Exit { func, .. } => {
                let (name, addr) = self.namer.name(func);
                let key = Key::Addr(func);
                self.exit(e.vcpu, SpanKind::Function, &key, name, Some(addr), at, out);
            }
            SpanRecord::Reloc { link, runtime, len } => {
                self.counts.relocs += 1;
                self.namer.add_guest_reloc(Reloc {
                    link,
                    runtime,
                    len: u64::from(len),
                });
            }
        }
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn enter(
        &mut self,
        vcpu: u32,
        kind: SpanKind,
        key: Key,
        name: String,
        addr: Option<u64>,
        at: SpanEnd,
        out: &mut Vec<SpanStep>,
    ) {
        self.counts.entries += 1;
        let stack = self.stacks.entry((vcpu, kind)).or_default();
        let span = Span {
            vcpu,
            kind,
            name,
            addr,
            depth: u32::try_from(stack.len()).unwrap_or(u32::MAX),
            begin: Some(at),
            end: None,
        };
        if stack.len() >= MAX_DEPTH {
            self.counts.abandoned += 1;
            out.push(SpanStep::Abandoned(span));
            return;
        }
        out.push(SpanStep::Enter(span.clone()));
        stack.push(Frame { key, span });
    }

    #[allow(clippy::too_many_arguments)]
    fn exit(
        &mut self,
        vcpu: u32,
        kind: SpanKind,
        key: &Key,
        name: String,
        addr: Option<u64>,
        at: SpanEnd,
        out: &mut Vec<SpanStep>,
    ) {
        let stack = self.stacks.entry((vcpu, kind)).or_default();
        let Some(i) = stack.iter().rposition(|f| f.key == *key) else {
            self.counts.orphans += 1;
            out.push(SpanStep::Orphan(Span {
                vcpu,
                kind,
                name,
                addr,
                depth: u32::try_from(stack.len()).unwrap_or(u32::MAX),
                begin: None,
                end: Some(at),
            }));
            return;
        };
        while stack.len() > i + 1 {
            if let Some(f) = stack.pop() {
                self.counts.abandoned += 1;
                out.push(SpanStep::Abandoned(f.span));
            }
        }
        if let Some(mut f) = stack.pop() {
            f.span.end = Some(at);
            self.counts.closed += 1;
            out.push(SpanStep::Exit(f.span));
        }
    }

    /// What it met so far.
    #[must_use]
    pub fn counts(&self) -> SpanCounts {
        self.counts
    }

    /// The names and relocations in force.
    #[must_use]
    pub fn namer(&self) -> &Namer {
        &self.namer
    }

    /// Function symbols as (link address, name), for an output's symbol table.
    #[must_use]
    pub fn kallsyms(&self) -> Vec<(u64, String)> {
        self.namer
            .symbols()
            .map(|s| s.iter().map(|(a, n)| (a, n.to_owned())).collect())
            .unwrap_or_default()
    }

    /// The frames still open when the recording ends, by vCPU and kind, outermost first.
    #[must_use]
    pub fn finish(self) -> Vec<Span> {
        self.stacks
            .into_values()
            .flat_map(|s| s.into_iter().map(|f| f.span))
            .collect()
    }

    /// The frames open now, without ending the recording (by vCPU and kind, outermost
    /// first).
    #[must_use]
    pub fn open_now(&self) -> Vec<Span> {
        self.stacks
            .values()
            .flat_map(|s| s.iter().map(|f| f.span.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{SpanConfig, SpanTracker};
    use crate::formats::{Bound, ExportEvent, Payload};
    use crate::spans::{SpanKind, SpanState, SpanStep};
    use vmtsync_core::recorder::{
        FUNC_ENTRY_ID, FUNC_EXIT_ID, RELOC_ID, SPAN_BEGIN_ID, SPAN_END_ID,
    };

    fn ev(vcpu: u32, id: u16, payload: &[u8], t: u64) -> ExportEvent {
        ExportEvent {
            vcpu,
            id,
            guest_tsc: Some(t),
            host_tsc: t,
            bound: Some(Bound {
                lo: t - 1,
                hi: t + 1,
            }),
            payload: Payload::new(payload).unwrap(),
        }
    }

    fn func(id: u16, f: u32, t: u64) -> ExportEvent {
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&f.to_le_bytes());
        p[4..].copy_from_slice(&0x99u32.to_le_bytes());
        ev(0, id, &p, t)
    }

    fn run(events: &[ExportEvent]) -> (Vec<SpanStep>, SpanTracker) {
        let mut t = SpanTracker::new(&SpanConfig::default());
        let mut out = Vec::new();
        for e in events {
            t.push(e, &mut out);
        }
        (out, t)
    }

    #[test]
    fn nested_calls_close_with_depths_and_ordinary_events_pass() {
        let (out, t) = run(&[
            func(FUNC_ENTRY_ID, 0x10, 10),
            func(FUNC_ENTRY_ID, 0x20, 20),
            ev(0, 7, b"x", 25),
            func(FUNC_EXIT_ID, 0x20, 30),
            func(FUNC_EXIT_ID, 0x10, 40),
        ]);
        let closed: Vec<_> = out
            .iter()
            .filter_map(|s| match s {
                SpanStep::Exit(s) => Some((s.name.as_str(), s.depth, s.ticks())),
                _ => None,
            })
            .collect();
        assert_eq!(closed, [("0x20", 1, Some(10)), ("0x10", 0, Some(30))]);
        assert_eq!(out.len(), 4, "the ordinary event is not a step");
        assert_eq!(t.counts().closed, 2);
        assert!(t.finish().is_empty());
    }

    #[test]
    fn an_outer_exit_abandons_inner_frames_and_a_lone_exit_is_an_orphan() {
        let (out, t) = run(&[
            func(FUNC_ENTRY_ID, 0x10, 10),
            func(FUNC_ENTRY_ID, 0x20, 20),
            func(FUNC_EXIT_ID, 0x10, 40),
            func(FUNC_EXIT_ID, 0x30, 50),
        ]);
        let kinds: Vec<_> = out
            .iter()
            .map(|s| (s.span().name.as_str(), s.span().state()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("0x10", SpanState::Open),
                ("0x20", SpanState::Open),
                ("0x20", SpanState::Open),
                ("0x10", SpanState::Closed),
                ("0x30", SpanState::Orphan),
            ]
        );
        assert!(matches!(out[2], SpanStep::Abandoned(_)));
        let c = t.counts();
        assert_eq!((c.closed, c.abandoned, c.orphans), (1, 1, 1));
    }

    #[test]
    fn phases_and_functions_keep_separate_stacks_and_open_frames_remain() {
        let (out, t) = run(&[
            ev(0, SPAN_BEGIN_ID, b"post", 1),
            func(FUNC_ENTRY_ID, 0x10, 2),
            ev(0, SPAN_END_ID, b"post", 3),
            ev(0, SPAN_BEGIN_ID, b"boot", 4),
            ev(1, SPAN_BEGIN_ID, b"boot", 5),
        ]);
        let post = out.iter().find_map(|s| match s {
            SpanStep::Exit(s) => Some(s.clone()),
            _ => None,
        });
        let post = post.unwrap();
        assert_eq!(
            (post.kind, post.name.as_str(), post.depth),
            (SpanKind::Phase, "post", 0)
        );
        let open: Vec<_> = t
            .finish()
            .into_iter()
            .map(|s| (s.vcpu, s.kind, s.name, s.depth))
            .collect();
        assert_eq!(
            open,
            [
                (0, SpanKind::Phase, "boot".into(), 0),
                (0, SpanKind::Function, "0x10".into(), 0),
                (1, SpanKind::Phase, "boot".into(), 0),
            ]
        );
    }

    #[test]
    fn a_relocation_record_renames_later_entries() {
        let syms = crate::spans::Symbols::from_pairs(&[(0x1000, 0x10, "init_fn")]);
        let mut t = SpanTracker::new(&SpanConfig {
            symbols: Some(std::sync::Arc::new(syms)),
            relocs: vec![],
        });
        let mut out = Vec::new();
        let mut r = [0u8; 16];
        r[..6].copy_from_slice(&0x1000u64.to_le_bytes()[..6]);
        r[6..12].copy_from_slice(&0x8000u64.to_le_bytes()[..6]);
        r[12..].copy_from_slice(&0x100u32.to_le_bytes());
        assert!(t.push(&func(FUNC_ENTRY_ID, 0x8004, 1), &mut out));
        assert!(t.push(&ev(0, RELOC_ID, &r, 2), &mut out));
        assert!(t.push(&func(FUNC_ENTRY_ID, 0x8004, 3), &mut out));
        let names: Vec<_> = out
            .iter()
            .map(|s| (s.span().name.clone(), s.span().addr))
            .collect();
        assert_eq!(
            names,
            [
                ("0x8004".to_owned(), Some(0x8004)),
                ("init_fn+0x4".to_owned(), Some(0x1004))
            ]
        );
        assert_eq!(t.counts().relocs, 1);
    }

    #[test]
    fn a_new_boot_abandons_what_the_old_one_left_open() {
        let mut t = SpanTracker::new(&SpanConfig::default());
        let mut out = Vec::new();
        t.push_in_boot(&func(FUNC_ENTRY_ID, 0x10, 1), 0, &mut out);
        t.push_in_boot(&func(FUNC_ENTRY_ID, 0x20, 2), 1, &mut out);
        t.push_in_boot(&func(FUNC_EXIT_ID, 0x20, 3), 1, &mut out);
        let steps: Vec<_> = out
            .iter()
            .map(|s| match s {
                SpanStep::Enter(s) => ("enter", s.name.clone(), s.depth),
                SpanStep::Exit(s) => ("exit", s.name.clone(), s.depth),
                SpanStep::Abandoned(s) => ("abandoned", s.name.clone(), s.depth),
                SpanStep::Orphan(s) => ("orphan", s.name.clone(), s.depth),
            })
            .collect();
        assert_eq!(
            steps,
            [
                ("enter", "0x10".into(), 0),
                ("abandoned", "0x10".into(), 0),
                ("enter", "0x20".into(), 0),
                ("exit", "0x20".into(), 0),
            ]
        );
    }

    #[test]
    fn depth_is_bounded() {
        let events: Vec<_> = (0..u32::try_from(super::MAX_DEPTH).unwrap() + 3)
            .map(|i| func(FUNC_ENTRY_ID, 0x10 + i, u64::from(i) + 1))
            .collect();
        let (out, t) = run(&events);
        assert_eq!(t.counts().abandoned, 3);
        assert!(matches!(out.last(), Some(SpanStep::Abandoned(_))));
        assert_eq!(t.finish().len(), super::MAX_DEPTH);
    }
}
