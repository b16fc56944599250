//! The output stage both front ends share: where events go while recording ([`Out`]) and
//! the writers of every format, reading placements from the [`State`].

use std::path::Path;

use super::place::{Placed, State};
use super::target::Target;
use super::{RecordError, RecordFormat, spool};
use crate::formats::jsonl::JsonlWriter;
use crate::formats::perfetto::PerfettoWriter;
use crate::formats::perfetto::clock::{BootClock, ClockSnapshot};
use crate::sync::Placement;

/// Appends `p` to the JSON Lines output, an error naming the file being written.
pub(super) fn jsonl_write(w: &mut JsonlWriter, p: &Placed<'_>) -> Result<(), RecordError> {
    w.write(&p.line()).map_err(|e| RecordError::io(w.path())(e))
}

/// The CTF output: the host's TSC frequency (`ctf::host_tsc_hz`), named after the directory;
/// `exact`: every event placed exactly (exact memory mode), so no interval fields
/// ([`crate::formats::ctf::Interval::Exact`]).
pub(super) fn create_ctf(
    opts: &Target,
    exact: bool,
) -> Result<crate::formats::ctf::GuestCtf, RecordError> {
    use crate::formats::ctf;
    let o = ctf::CtfOptions {
        tsc_hz: ctf::host_tsc_hz()?,
        name: opts
            .out
            .file_name()
            .map_or_else(|| "vmtsync".into(), |n| n.to_string_lossy().into_owned()),
        env: vec![("vmtsync_agent".into(), opts.source.clone())],
    };
    let fields = if exact {
        ctf::GuestFields::EXACT
    } else {
        ctf::GuestFields::ALL
    };
    let mut w = ctf::GuestCtf::create(&opts.out, &o, fields)?;
    w.set_spans(&opts.spans);
    Ok(w)
}

/// Where events go while recording.
pub(super) enum Out {
    Jsonl(JsonlWriter),
    Ctf(crate::formats::ctf::GuestCtf),
    Spool(spool::Spool),
    /// Two-sided placement: every event is spooled and placed when the recording ends, with
    /// every round known; JSON Lines are also streamed to `OUT.partial` as soon as the round
    /// after them is known (`live`, with the spool index of the first event still waiting),
    /// so a killed run keeps all but the last round's events.
    Held {
        spool: spool::Spool,
        live: Option<(JsonlWriter, u64)>,
        ctf: Option<crate::formats::ctf::GuestCtf>,
    },
    /// Exact mode: every record is final when read, so trace.dat and Perfetto stream too.
    TraceDat(Box<super::stream::TraceDatStream>),
    Perfetto(Box<super::stream::PerfettoStream>),
}

impl Out {
    /// Where events go for `target`: with two-sided placement every event is spooled and
    /// placed at the end; otherwise JSON Lines and CTF are streamed as placed now.
    pub(super) fn create(target: &Target, placement: Placement) -> Result<Self, RecordError> {
        Ok(match target.format {
            _ if placement == Placement::TwoSided => Out::Held {
                spool: spool::Spool::new().map_err(RecordError::io(&target.out))?,
                live: match target.format {
                    RecordFormat::Jsonl => Some((
                        JsonlWriter::create(&target.out).map_err(RecordError::io(&target.out))?,
                        0,
                    )),
                    _ => None,
                },
                ctf: match target.format {
                    RecordFormat::Ctf => Some(create_ctf(target, false)?),
                    _ => None,
                },
            },
            RecordFormat::Jsonl => {
                Out::Jsonl(JsonlWriter::create(&target.out).map_err(RecordError::io(&target.out))?)
            }
            RecordFormat::TraceCmd | RecordFormat::Perfetto => {
                Out::Spool(spool::Spool::new().map_err(RecordError::io(&target.out))?)
            }
            RecordFormat::Ctf => Out::Ctf(create_ctf(target, false)?),
        })
    }

    /// Where a memory recording's events go: each placed once, for good, every format
    /// streams them (`stream.rs`); `st` names the vCPUs known at the start. With
    /// `preconverted` a trace.dat's timestamps are host ticks (points that do not follow
    /// KVM's mapping), else raw guest ticks with a TIME_SHIFT. `exact`: exact mode, whose
    /// events are each placed at one host tick (a CTF trace declares its intervals exact
    /// and carries none), and whose output is written on a thread that already runs beside
    /// the reading (its writer thread), so a trace.dat or CTF trace writes its file data on
    /// that thread too ([`crate::formats::tracedat::WriterOptions::write_here`],
    /// [`crate::formats::ctf::CtfTrace::write_here`]).
    pub(super) fn stream(
        target: &Target,
        st: &State,
        preconverted: bool,
        exact: bool,
    ) -> Result<Self, RecordError> {
        let keys: Vec<u32> = st.vcpus.iter().map(|v| v.vcpu).collect();
        Ok(match target.format {
            RecordFormat::TraceCmd => {
                let mut s = super::stream::TraceDatStream::create(
                    target,
                    &keys,
                    st.keyed,
                    trace_id(target, st),
                    exact,
                )?;
                if preconverted {
                    s.preconvert();
                }
                Out::TraceDat(Box::new(s))
            }
            RecordFormat::Perfetto => Out::Perfetto(Box::new(
                super::stream::PerfettoStream::create(target, st.keyed)?,
            )),
            RecordFormat::Ctf => {
                let mut w = create_ctf(target, exact)?;
                if exact {
                    w.write_here();
                }
                Out::Ctf(w)
            }
            _ => Self::create(target, Placement::OneSided)?,
        })
    }

    /// From now on a trace.dat's timestamps are host ticks: the points stopped following
    /// KVM's mapping.
    pub(super) fn preconvert(&mut self) {
        if let Self::TraceDat(w) = self {
            w.preconvert();
        }
    }

    /// The end of a drain round (exact mode's Perfetto stream may open its writer), and the
    /// clock snapshot taken with it, if any.
    pub(super) fn round_end(&mut self, snap: Option<ClockSnapshot>) -> Result<(), RecordError> {
        if let Self::Perfetto(p) = self {
            p.round_end()?;
            if let Some(s) = snap {
                p.snapshot(s)?;
            }
        }
        Ok(())
    }

    /// One event, placed with what is known now: streamed, or spooled to be placed again
    /// when the recording ends.
    #[inline]
    pub(super) fn push(&mut self, p: &Placed<'_>, out: &Path) -> Result<(), RecordError> {
        match self {
            Self::TraceDat(w) => w.push(p),
            Self::Perfetto(w) => w.push(p),
            Self::Held { spool, .. } | Self::Spool(spool) => spool
                .push(p.vcpu, p.guest, p.id, p.payload)
                .map_err(RecordError::io(out)),
            Self::Jsonl(w) => jsonl_write(w, p),
            Self::Ctf(w) => Ok(w.push_in_boot(&p.export(), p.boot())?),
        }
    }

    /// Exact mode: as many of `records` as `run` places plainly, written in one go (the
    /// spools and JSON Lines take each record through [`Self::push`]). Returns how many.
    #[inline]
    pub(super) fn push_run(
        &mut self,
        run: &super::stream::ExactRun,
        records: &[crate::guestmem::GuestRecord],
    ) -> Result<usize, RecordError> {
        match self {
            Self::TraceDat(w) => w.push_run(run, records),
            Self::Perfetto(w) => w.push_run(*run, records),
            Self::Ctf(w) if w.takes_exact_runs() => {
                Ok(w.push_exact_while(run.key, records, |r| {
                    // Each is a plain event the run places (a run holds no other:
                    // `memory::pipe`'s `Item::Run`).
                    let host = run.places(r)?;
                    Some(crate::formats::ctf::ExactEvent {
                        id: r.id,
                        host_tsc: host,
                        guest_tsc: r.tsc,
                        payload: crate::formats::event::Payload::from_padded(r.len, r.payload)
                            .unwrap_or_default(),
                    })
                })?)
            }
            Self::Ctf(w) => Ok(super::stream::for_each_plain(run, records, |e| w.push(e))?),
            _ => Ok(0),
        }
    }

    /// A sync round was made: the JSON Lines events waiting for it are placed with it and
    /// written.
    pub(super) fn round_made(&mut self, st: &State, opts: &Target) -> Result<(), RecordError> {
        let Self::Held {
            spool,
            live: Some((w, next)),
            ..
        } = self
        else {
            return Ok(());
        };
        for rec in spool.iter_from(*next).map_err(RecordError::io(&opts.out))? {
            let rec = rec.map_err(RecordError::io(&opts.out))?;
            *next += 1;
            if let Some(placed) = st.placed(&rec) {
                jsonl_write(w, &placed)?;
            }
        }
        w.flush().map_err(|e| RecordError::io(w.path())(e))
    }
}

/// Writes the output; returns (pre-converted, clamped timestamps).
pub(super) fn finish(out: Out, opts: &Target, st: &State) -> Result<(bool, u64), RecordError> {
    match out {
        Out::Held {
            mut spool,
            live,
            ctf,
        } => match (opts.format, live, ctf) {
            (RecordFormat::Jsonl, live, _) => {
                // Placed again from the start with every round: the live file is replaced.
                drop(live);
                let mut w = JsonlWriter::create(&opts.out).map_err(RecordError::io(&opts.out))?;
                for rec in spool.iter().map_err(RecordError::io(&opts.out))? {
                    let rec = rec.map_err(RecordError::io(&opts.out))?;
                    if let Some(placed) = st.placed(&rec) {
                        jsonl_write(&mut w, &placed)?;
                    }
                }
                w.finish().map_err(RecordError::io(&opts.out))?;
                Ok((false, 0))
            }
            (RecordFormat::Ctf, _, Some(mut w)) => {
                for rec in spool.iter().map_err(RecordError::io(&opts.out))? {
                    let rec = rec.map_err(RecordError::io(&opts.out))?;
                    if let Some(placed) = st.placed(&rec) {
                        w.push_in_boot(&placed.export(), placed.boot())?;
                    }
                }
                Ok((false, w.finish()?.raised))
            }
            (RecordFormat::Perfetto, ..) => write_perfetto(spool, opts, st),
            _ => write_trace_dat(spool, opts, st),
        },
        Out::Jsonl(w) => {
            w.finish().map_err(RecordError::io(&opts.out))?;
            Ok((false, 0))
        }
        Out::Spool(s) if opts.format == RecordFormat::Perfetto => write_perfetto(s, opts, st),
        Out::Ctf(w) => Ok((false, w.finish()?.raised)),
        Out::Spool(s) => write_trace_dat(s, opts, st),
        Out::TraceDat(w) => {
            let (host_ticks, clamped) = w.finish()?;
            Ok((host_ticks > 0, clamped))
        }
        Out::Perfetto(w) => {
            w.finish()?;
            Ok((false, 0))
        }
    }
}

/// The Perfetto trace from the spool: each event placed as the JSON Lines output places it,
/// its host TSC mapped to BOOTTIME through the rounds' snapshots and one taken now.
pub(super) fn write_perfetto(
    mut s: spool::Spool,
    opts: &Target,
    st: &State,
) -> Result<(bool, u64), RecordError> {
    use crate::formats::perfetto::{DEFAULT_MACHINE_ID, PerfettoError, PerfettoOptions};
    let mut snaps = st.clocks.clone();
    snaps.extend(ClockSnapshot::take().ok());
    let clock = BootClock::new(snaps).map_err(PerfettoError::from)?;
    let mut w = PerfettoWriter::create(
        &opts.out,
        PerfettoOptions {
            machine_id: DEFAULT_MACHINE_ID,
            guest_name: format!("vmtsync guest ({})", opts.source),
            clock,
        },
    )?;
    w.set_spans(&opts.spans);
    for rec in s.iter().map_err(RecordError::io(&opts.out))? {
        let rec = rec.map_err(RecordError::io(&opts.out))?;
        if let Some(p) = st.placed(&rec) {
            super::stream::write_perfetto_event(&mut w, &p, st.keyed)?;
        }
    }
    w.finish()?;
    Ok((false, 0))
}

/// The trace.dat from the spool, each event placed as the JSON Lines output places it and
/// written as a memory recording streams it ([`super::stream::TraceDatStream`]): raw guest
/// TSCs with a TIME_SHIFT of the offsets the points follow when every segment is at identity
/// rate (trace-cmd then shows each event at its point, inside its interval), else host TSCs.
pub(super) fn write_trace_dat(
    mut s: spool::Spool,
    opts: &Target,
    st: &State,
) -> Result<(bool, u64), RecordError> {
    let identity = st
        .vcpus
        .iter()
        .flat_map(|v| v.time_segments())
        .all(|g| g.drift_ppb == 0);
    let keys: Vec<u32> = st.vcpus.iter().map(|v| v.vcpu).collect();
    let mut w =
        super::stream::TraceDatStream::create(opts, &keys, st.keyed, trace_id(opts, st), false)?;
    if !identity {
        // trace-cmd's TIME_SHIFT cannot follow another rate exactly (docs/record.md).
        w.preconvert();
    }
    for rec in s.iter().map_err(RecordError::io(&opts.out))? {
        let rec = rec.map_err(RecordError::io(&opts.out))?;
        if let Some(p) = st.placed(&rec) {
            w.push(&p)?;
        }
    }
    let (host_ticks, clamped) = w.finish()?;
    Ok((host_ticks > 0, clamped))
}

/// A TRACEID for the guest file: stable for one run (source and first anchor).
pub(super) fn trace_id(opts: &Target, st: &State) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let first = st
        .vcpus
        .iter()
        .find_map(|v| v.segments.first())
        .map_or(0, |g| g.host_anchor);
    for b in opts.source.bytes().chain(first.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::tracedat::consts::option;
    use crate::formats::tracedat::timeshift::{decode, trace_cmd_host_time};
    use crate::formats::tracedat::{read_layout, reader};
    use crate::syncfile::{AnchorKind, OffsetModel, SyncSegment};

    /// A round at host tick `at` whose box of offsets is `[lo, hi]` around `centre`, the rate
    /// within 50 ppb of the host's.
    fn round(round: u64, at: u64, (lo, centre, hi): (i64, i64, i64)) -> SyncSegment {
        SyncSegment {
            vcpu: 0,
            round,
            guest_start: at.checked_add_signed(centre).unwrap(),
            host_anchor: at,
            guest_anchor: at.checked_add_signed(centre).unwrap(),
            offset: centre,
            offset_lo: lo,
            offset_hi: hi,
            drift_ppb: 0,
            drift_ppb_lo: Some(-50),
            drift_ppb_hi: Some(50),
            model: OffsetModel::Drift,
            probes: 8,
            rtt_min_ticks: 1,
            host_first: at,
            host_last: at,
            is_break: false,
            anchor: AnchorKind::InProcess,
        }
    }

    /// A `record --connect` trace.dat at identity rate puts every event, as trace-cmd
    /// computes it from the TIME_SHIFT, inside the event's guaranteed interval, with one
    /// sample per segment, also when a round's own offset lies outside the interval the
    /// rounds around it give (a round slowed down on a loaded machine: a wide box whose centre
    /// is far from the truth, between two narrow ones).
    #[test]
    fn trace_cmd_shows_every_event_inside_its_interval_when_a_wide_rounds_centre_is_off() {
        const TRUTH: i64 = 1_000_000;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("g.dat");
        let mut st = State::new(&[0], None, Placement::TwoSided);
        st.vcpus[0].segments = vec![
            round(0, 10_000_000, (TRUTH - 200, TRUTH, TRUTH + 200)),
            round(
                1,
                20_000_000,
                (TRUTH - 300_000, TRUTH - 125_000, TRUTH + 50_000),
            ),
            round(2, 30_000_000, (TRUTH - 100, TRUTH, TRUTH + 100)),
            round(3, 40_000_000, (TRUTH - 100, TRUTH + 100, TRUTH + 300)),
        ];
        let mut spool = spool::Spool::new().unwrap();
        let hosts: Vec<u64> = (0..400).map(|i| 5_000_000 + i * 100_000).collect();
        for (i, &h) in hosts.iter().enumerate() {
            let g = h.checked_add_signed(TRUTH).unwrap();
            spool
                .push(0, g, 7, &u32::try_from(i).unwrap().to_le_bytes())
                .unwrap();
        }
        let target = Target::test(&out, RecordFormat::TraceCmd);
        assert_eq!(write_trace_dat(spool, &target, &st).unwrap(), (false, 0));
        let layout = read_layout(&out).unwrap();
        let body = &layout.options_with(option::TIME_SHIFT).next().unwrap().data;
        let shift = decode(body).unwrap();
        let samples = &shift.cpus[0];
        let (mut n, mut moved) = (0, 0);
        reader::for_each_event(&out, &layout, 0, |e| {
            let i = u32::from_le_bytes(e.payload[..4].try_into().unwrap()) as usize;
            let (h, g) = (hosts[i], e.ts);
            let (point, lo, hi) = st.place(0, g).unwrap();
            assert!(
                (lo..=hi).contains(&h),
                "the scenario's truth {h} in [{lo}, {hi}]"
            );
            let shown = trace_cmd_host_time(samples, shift.flags, g).unwrap();
            assert_eq!(shown, point, "guest tick {g}");
            assert!((lo..=hi).contains(&shown), "{shown} outside [{lo}, {hi}]");
            // The wide round's own offset would have shown its events 125,000 ticks early.
            moved += usize::from(g < 30_000_000 + TRUTH as u64 && g >= 20_000_000 + TRUTH as u64);
            n += 1;
        })
        .unwrap();
        assert_eq!((n, moved), (400, 100));
        // One sample per segment (and step mode's closing copy at the largest time).
        let starts: Vec<i64> = samples.iter().map(|s| s.time).collect();
        assert_eq!(starts.len(), 5, "{samples:?}");
        assert_eq!(
            samples[1].offset,
            -(TRUTH - 100),
            "the overlap's nearest offset"
        );
    }
}
