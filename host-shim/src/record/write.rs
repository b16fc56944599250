//! The output stage both front ends share: where events go while recording ([`Out`]) and
//! the writers of every format, reading placements from the [`State`].

use std::path::Path;

use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;

use super::place::{Placed, State};
use super::target::{Target, host_tsc2nsec};
use super::{RecordError, RecordFormat, spool};
use crate::formats::jsonl::JsonlWriter;
use crate::formats::perfetto::PerfettoWriter;
use crate::formats::perfetto::clock::{BootClock, ClockSnapshot};
use crate::formats::tracedat::{self, ShiftMode, TimeShift, TraceDatWriter, WriterOptions};
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

/// The trace.dat from the spool: raw guest TSCs plus a TIME_SHIFT when every segment is at
/// identity rate (trace-cmd then computes exactly what we do), else host TSCs.
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
    if identity {
        match write_trace_dat_as(&mut s, opts, st, true) {
            // Raw guest TSCs that go backwards (the guest clock stepped back) or segments
            // trace-cmd's TIME_SHIFT cannot hold: write host TSCs instead.
            Err(RecordError::TraceDat(
                tracedat::TraceDatError::NotMonotonic { .. }
                | tracedat::TraceDatError::TimeShift(_),
            )) => {}
            r => return r,
        }
    }
    write_trace_dat_as(&mut s, opts, st, false)
}

/// One attempt at the trace.dat: raw guest TSCs with a TIME_SHIFT (`identity`), or host TSCs.
pub(super) fn write_trace_dat_as(
    s: &mut spool::Spool,
    opts: &Target,
    st: &State,
    identity: bool,
) -> Result<(bool, u64), RecordError> {
    let trace_id = trace_id(opts, st);
    // One CPU buffer per vCPU synced, in increasing vCPU order (`cpu` N of the file is the
    // N-th of them: the UNAME names them).
    let cpus = u32::try_from(st.vcpus.len()).unwrap_or(u32::MAX);
    let mut wo = WriterOptions::new(cpus, trace_id);
    wo.version = opts.file_version;
    wo.tsc2nsec = host_tsc2nsec();
    let names: Vec<String> = st
        .vcpus
        .iter()
        .map(|v| super::stream::cpu_name(v.vcpu, st.keyed))
        .collect();
    wo.uname = Some(super::stream::uname(&names, identity));
    let tsc2nsec = wo.tsc2nsec;
    let mut w = TraceDatWriter::create(&opts.out, wo)?;
    // Span records are also written as the function graph trace-cmd prints.
    let mut graph = tracedat::SpanGraph::new(&opts.spans, tsc2nsec);
    let mut clamped = 0;
    // The last timestamp written per CPU: each CPU's buffer must be in order.
    let mut last = vec![0u64; st.vcpus.len()];
    for rec in s.iter().map_err(RecordError::io(&opts.out))? {
        let rec = rec.map_err(RecordError::io(&opts.out))?;
        let Some(cpu) = st.index_of(rec.vcpu) else {
            continue;
        };
        let ts = if identity {
            rec.guest
        } else {
            let host = st
                .place(rec.vcpu, rec.guest)
                .map_or(last[cpu], |(h, _, _)| h);
            if host < last[cpu] {
                clamped += 1;
            }
            host.max(last[cpu])
        };
        last[cpu] = ts;
        let cpu = u32::try_from(cpu).unwrap_or(u32::MAX);
        match st.place(rec.vcpu, rec.guest) {
            Some((host, lo, hi)) => graph.push(
                &mut w,
                cpu,
                ts,
                &crate::formats::ExportEvent {
                    // Each boot's rings are CPUs of their own here: keyed, they are stacks
                    // of their own too.
                    vcpu: rec.vcpu,
                    id: rec.id,
                    guest_tsc: Some(rec.guest),
                    host_tsc: host,
                    bound: Some(crate::formats::Bound { lo, hi }),
                    payload: crate::formats::Payload::new(rec.payload()).unwrap_or_default(),
                },
            )?,
            // No host time: a span record left out of the graph (an exit then finds no entry).
            None => w.push(cpu, ts, u32::from(rec.id), rec.payload())?,
        }
    }
    graph.finish(&mut w, cpus);
    let shift = identity.then(|| TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: st
            .vcpus
            .iter()
            .map(|v| {
                v.time_segments()
                    .iter()
                    .map(|g| tracedat::SyncSegment {
                        // The host tick where the segment's first guest tick falls.
                        start: HostTicks(g.guest_start.wrapping_sub(g.offset.cast_unsigned())),
                        map: KvmTscMapping::offset_only(g.offset),
                    })
                    .collect()
            })
            .collect(),
    });
    w.finish(shift.as_ref())?;
    Ok((!identity, clamped))
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
