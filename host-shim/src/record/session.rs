//! The protocol front end of `vmtsync record`: the probe session over a link (hello, sync
//! rounds, event drains) and the accounting of the agent's batches. It feeds events and
//! per-vCPU segments into the shared stages ([`super::place`], [`super::write`]).

use std::time::{Duration, Instant};

use vmtsync_core::estimate::{EstimateError, ProbeSample};
use vmtsync_core::proto::EventClock;

use super::place::{Placed, State};
use super::target::Target;
use super::write::{Out, finish, trace_id};
use super::{EndReason, HostTime, RecordError, RecordFormat, RecordOptions, RecordSummary};
use crate::formats::perfetto::clock::ClockSnapshot;
use crate::link::ConnectOptions;
use crate::link::StampedTransport;
use crate::link::connect;
use crate::probe::anchor;
use crate::probe::{ConsoleLog, ProbeError, ProbeLog, ProbeOptions, ProbeSession, Progress};
use crate::sync::{Placement, Round};
use crate::syncfile::{SyncHeader, SyncWriter};

/// Connects to `opts.probe.addr` and records (see [`run_record_on`]).
///
/// # Errors
/// [`RecordError`].
pub fn run_record(
    opts: &RecordOptions,
    progress: &mut Progress,
) -> Result<RecordSummary, RecordError> {
    // Sync rounds are exit-anchored as `probe`'s are (docs/anchor.md), decided before
    // connecting so `--anchor kvm-pio` fails at once; the event drains in between pass through
    // unrefined.
    let note = &mut |m: &str| eprintln!("vmtsync: record: {m}");
    let setup = anchor::prepare(
        &opts.probe.addr,
        &opts.probe.anchor,
        opts.probe.connect_timeout,
        note,
    )?;
    let transport = connect::connect_until_stopped(
        &opts.probe.addr,
        &ConnectOptions {
            connect_timeout: opts.probe.connect_timeout,
            io_timeout: opts.probe.timeout,
        },
        opts.probe.stop,
    )
    .map_err(ProbeError::from)?;
    let mut t = setup.wrap(transport);
    let r = run_record_on(&mut t, opts, progress);
    if let Some(why) = t.gave_up() {
        note(&format!(
            "not exit-anchored: the agent's first exchange was not among the VM's UART exits ({why:?}); host stamps were taken in this process"
        ));
    }
    r
}

/// Records over an open transport (see the module docs).
///
/// # Errors
/// [`RecordError`]; events received before a failure are still written.
pub fn run_record_on<T: StampedTransport>(
    transport: T,
    opts: &RecordOptions,
    progress: &mut Progress,
) -> Result<RecordSummary, RecordError> {
    let p = &opts.probe;
    let target = Target::of(opts);
    let console = p.console.as_deref().map(ConsoleLog::create).transpose()?;
    let mut session = ProbeSession::hello_until_stopped(transport, p.timeout, p.stop, console)?;
    if let Some(path) = &p.probe_log {
        session.log_probes(ProbeLog::create(path, &p.addr, &p.anchor)?);
    }
    let session_vcpu = session.info().vcpu;
    if !session
        .info()
        .features
        .contains(vmtsync_core::proto::Features::EVENTS)
    {
        return Err(RecordError::NoEvents);
    }
    // Every vCPU the agent serves is synced on itself each round: a unikernel may record on
    // any of them, and each vCPU's TSC is its own clock (docs/smp.md).
    let vcpus = session.vcpus()?;
    let mut out = Out::create(&target, opts.placement)?;
    let sync_out = match &opts.output.sync_out {
        Some(path) => Some(
            SyncWriter::open(path, &SyncHeader::now(p.addr.to_string()))
                .map_err(ProbeError::from)?,
        ),
        None => None,
    };
    let mut st = State::new(&vcpus, sync_out, opts.placement);
    let started = Instant::now();
    // The initial sync: nothing can be placed before it.
    let first = st.sync(&mut session, p);
    let end = match first {
        Ok(()) if st.segments() == 0 => {
            return Err(RecordError::NoSync(
                st.refused.unwrap_or(EstimateError::NoSamples),
            ));
        }
        Ok(()) => record_loop(&mut session, opts, &mut st, &mut out, started, progress),
        Err(ProbeError::Interrupted) => return Err(ProbeError::Interrupted.into()),
        Err(e) => return Err(e.into()),
    };
    progress.clear();
    let end = match end {
        Ok(end) => end,
        Err(e) => {
            // Whatever was received is written, then the error is reported.
            if let Out::Held { spool, .. } = &mut out {
                st.final_widths(spool);
            }
            let _ = finish(out, &target, &st);
            return Err(e);
        }
    };
    if opts.placement == Placement::TwoSided
        && matches!(end, EndReason::Events | EndReason::Duration)
    {
        // One more round, so the last drain's events have a round after them too. It is not
        // needed for correctness: without it they keep the one-sided interval.
        if let Err(e) = st.sync(&mut session, p) {
            eprintln!(
                "vmtsync: warning: the closing sync round failed ({e}); the last events are placed from the rounds before them"
            );
        }
    }
    if let Out::Held { spool, .. } = &mut out {
        st.final_widths(spool);
    }
    let console_bytes = if p.shutdown && end != EndReason::AgentExited {
        session.shutdown()
    } else {
        session.stats()
    }
    .console_bytes;
    let (preconverted, clamped) = finish(out, &target, &st)?;
    Ok(RecordSummary {
        events: st.events,
        dropped: st.vcpus.iter().map(|v| v.ledger.refused).sum(),
        overwritten: st.vcpus.iter().map(|v| v.ledger.overwritten).sum(),
        segments: st.segments(),
        breaks: st.breaks,
        widths: st.widths.summary(),
        lost: st.lost,
        replayed: st.replayed,
        failed_drains: st.failed_drains,
        host_stamped_skipped: st.host_stamped,
        unplaceable: st.unplaceable,
        preconverted,
        clamped,
        end,
        vcpu: session_vcpu,
        vcpus,
        trace_id: if opts.output.format == RecordFormat::TraceCmd {
            trace_id(&target, &st)
        } else {
            0
        },
        out: opts.output.out.clone(),
        console_bytes,
        console: p.console.clone(),
        host_time: HostTime::Sync,
    })
}

/// Drains that may fail in a row before the recording gives up.
pub(super) const MAX_FAILED_DRAINS: u32 = 3;

impl State {
    /// One sync round: every vCPU in turn; appends each vCPU's segment (if its probes
    /// produced samples).
    fn sync<T: StampedTransport>(
        &mut self,
        session: &mut ProbeSession<T>,
        p: &ProbeOptions,
    ) -> Result<(), ProbeError> {
        // A failed snapshot only thins the BOOTTIME mapping; the Perfetto writer needs two.
        self.clocks.extend(ClockSnapshot::take().ok());
        let round = self.round;
        self.round += 1;
        for v in &mut self.vcpus {
            session.select_vcpu(v.vcpu)?;
            session.forget_reference();
            let samples: Vec<ProbeSample> =
                session.probe_round(p.probes, p.interval, &mut Progress::hidden())?;
            if samples.is_empty() {
                continue;
            }
            let r = match Round::from_samples(&samples) {
                Ok(r) => r,
                // The samples fit no constant relation (the clock stepped inside the round,
                // or a bracket was wrong): nothing trustworthy to add.
                Err(e) => {
                    self.refused = Some(e);
                    continue;
                }
            };
            let anchor = session.stats().anchor;
            let seg = v.cumulative.add_round(&r, &samples, round, anchor)?;
            self.breaks += u64::from(seg.is_break);
            if let Some(w) = &mut self.sync_out {
                w.append(&seg)?;
            }
            v.segments.push(seg);
        }
        Ok(())
    }
}

pub(super) fn record_loop<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &RecordOptions,
    st: &mut State,
    out: &mut Out,
    started: Instant,
    progress: &mut Progress,
) -> Result<EndReason, RecordError> {
    let p = &opts.probe;
    let mut last_sync = Instant::now();
    let mut failed_drains = 0u32;
    loop {
        if p.stopped() {
            return Ok(EndReason::Stopped);
        }
        if opts.output.duration.is_some_and(|d| started.elapsed() >= d) {
            return Ok(EndReason::Duration);
        }
        if last_sync.elapsed() >= opts.resync {
            last_sync = Instant::now();
            match st.sync(session, p) {
                Ok(()) => out.round_made(st, &Target::of(opts))?,
                Err(ProbeError::Interrupted) => return Ok(EndReason::Stopped),
                Err(ProbeError::AgentExited) => return Ok(EndReason::AgentExited),
                Err(e) => return Err(e.into()),
            }
        }
        let want = opts.output.events.map_or(opts.drain_max, |n| {
            u32::try_from(n.saturating_sub(st.events))
                .unwrap_or(u32::MAX)
                .min(opts.drain_max)
        });
        let batches = match session.drain_events(want) {
            Ok(b) => {
                failed_drains = 0;
                b
            }
            Err(ProbeError::AgentExited) => return Ok(EndReason::AgentExited),
            Err(ProbeError::Interrupted) => return Ok(EndReason::Stopped),
            // A drain lost to line noise, a corrupted request or a stalled link: the next one
            // goes on (its batches' `first` index counts what this one lost), unless it keeps
            // happening.
            Err(e @ (ProbeError::Timeout { .. } | ProbeError::Protocol(_)))
                if failed_drains < MAX_FAILED_DRAINS =>
            {
                failed_drains += 1;
                st.failed_drains += 1;
                eprintln!("vmtsync: warning: an event drain failed ({e}); asking again");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut got = 0u64;
        for b in &batches {
            // The session accepts batches only of the vCPUs it was told of, all synced here.
            let Some(vi) = st.index_of(b.vcpu) else {
                st.unplaceable += b.records.len() as u64;
                continue;
            };
            let v = &mut st.vcpus[vi];
            // Records before the next expected index were delivered already (a replay): skip
            // them. A gap after it is records the ring overwrote before sending them (a
            // flight ring says how many) and records the agent sent that never reached us.
            let (skip, lost) = v.ledger.batch(b);
            st.lost += lost;
            st.replayed += skip as u64;
            if b.clock == EventClock::Host {
                st.host_stamped += b.records.len().saturating_sub(skip) as u64;
                continue;
            }
            for (guest, r) in b.timestamped().flatten().skip(skip) {
                // Placed with the rounds known now; two-sided placement places it again
                // later, never wider (it is intersected with this).
                let placed = st
                    .place_as(b.vcpu, guest, Placement::OneSided)
                    .map(|p| (p.host, p.lo, p.hi, p.round));
                let Some((host, lo, hi, round)) = placed else {
                    // No segment of this vCPU (it never answered a probe), or outside the
                    // host's 64-bit range: no host tick to give it.
                    st.unplaceable += 1;
                    continue;
                };
                let placed = Placed {
                    vcpu: b.vcpu,
                    id: r.id,
                    guest,
                    payload: r.payload.as_slice(),
                    host,
                    lo,
                    hi,
                    round,
                    keyed: false,
                };
                out.push(&placed, &opts.output.out)?;
                st.widths.push(hi - lo);
                st.events += 1;
                got += 1;
            }
        }
        if let Out::Jsonl(w) = out {
            w.flush().map_err(|e| RecordError::io(w.path())(e))?;
        }
        progress.status(&format!(
            "vmtsync record: {} events, {} dropped, {} segments",
            st.events,
            st.vcpus
                .iter()
                .map(|v| v.ledger.refused + v.ledger.overwritten)
                .sum::<u64>(),
            st.segments()
        ));
        if opts.output.events.is_some_and(|n| st.events >= n) {
            return Ok(EndReason::Events);
        }
        if got == 0 {
            // Nothing waiting: do not spin on the link; a stop is still seen within 10 ms.
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
