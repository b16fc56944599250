//! A memory recording's steps: [`Armed`] (the VMM's memory opened, the recorder's header
//! found, the mode chosen), then [`Recording`]: drain rounds that place and write what they
//! read, a guest's restarts, the beacons read last, and the summaries.

use std::time::{Duration, Instant};

use super::hold::Hold;
use super::mapping::{Mappings, Reading, Side, across_change, exact_at, exact_segment};
use super::mode::{
    Mode, exact_list, mode_for, start_beacons, start_trace, use_samples, write_sync_out,
};
use super::pipe::{Item, Pipe};
use super::vmm::{EXIT_GRACE, find_again, is_restart, vmm_gone, vmm_gone_within};
use super::{BootCounts, MemoryOptions, MemorySummary};
use crate::exits::PioTrace;
use crate::formats::perfetto::clock::ClockSnapshot;
use crate::guestmem::{
    self, ClockKind, DrainError, Drainer, Found, GuestRecord, PollSummary, ProcMemory, RoundRing,
};
use crate::kvm::hosttsc::read_host_tsc;
use crate::kvm::procinfo::ProcFs;
use crate::probe::Progress;
use crate::record::beacons::Beacons;
use crate::record::error::MemoryError;
use crate::record::place::{State, VcpuSync, boot_key};
use crate::record::stream::ExactRun;
use crate::record::target::Target;
use crate::record::write::{Out, finish, trace_id};
use crate::record::{EndReason, HostTime, RecordError, RecordFormat, RecordSummary};
use crate::sync::Placement;

/// How a recording ended: why, or the error that ended it (what was read is still written).
pub(super) type Ended = Result<EndReason, RecordError>;

/// Where a recording's records go: beacon mode's wait for the sync round after them and are
/// then written on the recording's thread (`hold.rs`); exact mode's go through the writer
/// thread (`pipe.rs`).
pub(super) enum Writer {
    Held { out: Box<Out>, hold: Hold },
    Piped(Pipe),
}

/// Whether the host times of a round's events depend on which vCPU wrote which ring: in
/// exact mode, when the vCPUs' mappings before (`last`) or after (`now`) the round are not
/// one (one offset: scaling is refused). Beacon mode's intervals come from exits of every
/// vCPU thread, whichever ring a vCPU writes.
fn rests_on_ring_claim(mode: Mode, last: &[Reading], now: &[Reading]) -> bool {
    let one = |r: &[Reading]| r.windows(2).all(|w| w[0].offset == w[1].offset);
    mode == Mode::Exact && !(one(last) && one(now))
}

/// Whether SIGINT/SIGTERM asked the recording to stop.
fn stopped(opts: &MemoryOptions) -> bool {
    opts.stop
        .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
}

/// Why the recording should end now (a stop, or its duration past), if it should.
fn ended(opts: &MemoryOptions, started: Instant) -> Option<EndReason> {
    if stopped(opts) {
        Some(EndReason::Stopped)
    } else if opts.output.duration.is_some_and(|d| started.elapsed() >= d) {
        Some(EndReason::Duration)
    } else {
        None
    }
}

/// The first step: the VMM's memory open, the early trace running, the guest resumed, its
/// recorder's header found and the mode its records are placed in chosen.
pub(super) struct Armed {
    proc: ProcFs,
    mem: ProcMemory,
    found: Found,
    /// `--beacon-port`'s trace, started before the header was found.
    early: Option<(PioTrace, u16)>,
    /// The host time before a paused VMM was resumed.
    armed_at: Option<u64>,
    mode: Mode,
    /// The header says its records hold the raw TSC.
    raw: bool,
}

impl Armed {
    /// Opens the VMM's memory, starts `--beacon-port`'s trace, resumes a paused VMM and waits
    /// for the guest to publish its recorder.
    pub(super) fn arm(opts: &MemoryOptions) -> Result<Self, RecordError> {
        let proc = ProcFs::new(&opts.proc_root);
        let mut mem = ProcMemory::open(&proc, opts.vm.id.pid).map_err(MemoryError::from)?;
        // `--beacon-port`: the trace runs before the guest can emit a beacon we would not see.
        let early = match opts.beacon_port {
            Some(port) => {
                let trace = start_trace(opts.tracefs.as_deref(), &proc, &opts.vm, port).map_err(
                    |e| match e {
                        // Beacon mode needs it; exact mode is not known before the header is
                        // found.
                        MemoryError::Trace { port, source, .. } => MemoryError::Trace {
                            port,
                            needed: !opts.trust_raw_tsc,
                            source,
                        },
                        e => e,
                    },
                )?;
                Some((trace, port))
            }
            None => None,
        };
        // A paused VMM: every guest exit comes after this host time, taken with the trace (if
        // any) already running and before the guest runs its first instruction.
        let armed_at = match &opts.paused {
            Some(resume) => {
                let t = read_host_tsc().0;
                resume.cont().map_err(MemoryError::from)?;
                Some(t)
            }
            None => None,
        };
        let found = wait_for_header(&mut mem, opts)?;
        let port = found.header.beacon_port;
        if let Some((_, armed)) = &early
            && *armed != port
        {
            return Err(MemoryError::PortMismatch {
                armed: *armed,
                addr: found.addr,
                named: port,
            }
            .into());
        }
        let raw = found.header.clock == ClockKind::RawTsc;
        let mode =
            mode_for(raw, port, opts.trust_raw_tsc).map_err(|why| MemoryError::Unplaceable {
                addr: found.addr,
                why,
            })?;
        Ok(Self {
            proc,
            mem,
            found,
            early,
            armed_at,
            mode,
            raw,
        })
    }
}

/// The guest publishes its header at run time: waits for it, wherever it is to appear (a
/// scan, a named address or a guest-physical one finds nothing valid before).
fn wait_for_header(mem: &mut ProcMemory, opts: &MemoryOptions) -> Result<Found, MemoryError> {
    let deadline = Instant::now() + opts.find_timeout;
    loop {
        match guestmem::find(mem, opts.location) {
            Ok(f) => return Ok(f),
            Err(e) if e.not_yet() && Instant::now() < deadline && !stopped(opts) => {
                // Soon after it appears: a beacon-mode recording brackets beacons from the
                // second after the first read on.
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) if source.not_yet() => {
                return Err(MemoryError::NotPublished {
                    waited: opts.find_timeout,
                    source,
                });
            }
            Err(e) => return Err(MemoryError::Find(e)),
        }
    }
}

/// A recording under way: everything its rounds share, from the first drain round to the
/// written file.
pub(super) struct Recording<'a> {
    opts: &'a MemoryOptions,
    proc: ProcFs,
    mem: ProcMemory,
    mode: Mode,
    raw: bool,
    port: u16,
    /// The first boot's rings (vCPUs).
    vcpus: Vec<u32>,
    /// KVM's mapping of the current boot's vCPUs, when it is read (records that hold the raw
    /// TSC, and a mapping that can be read).
    mappings: Option<Mappings>,
    /// The boot drained now, its rings, and where its rings' vCPUs start in the state.
    boot: u32,
    rings: u32,
    base: usize,
    /// KVM's mapping at the end of the last round.
    last: Vec<Reading>,
    beacons: Option<Beacons>,
    /// Exact mode: the beacons' check, its trace still being set up.
    checking: Option<std::thread::JoinHandle<Result<Option<Beacons>, MemoryError>>>,
    target: Target,
    st: State,
    out: Writer,
    drainer: Drainer,
    /// The current boot's counts.
    cur: BootCounts,
    ms: MemorySummary,
    started: Instant,
    /// The first and last rounds that delivered records.
    active: Option<(Instant, Instant)>,
    /// Each ring's head when a stop or the duration was seen: the rounds after it read
    /// everything the guest stored until then (however many rounds that takes), and stop
    /// there.
    stop_heads: Option<Vec<u64>>,
    /// When the last TSC/BOOTTIME snapshot was taken.
    last_clock: Instant,
    /// When the last drain round of this boot began (for [`MemorySummary::longest_reread`]).
    last_round: Option<Instant>,
}

impl<'a> Recording<'a> {
    /// The state before the first round: boot 0's mappings as its first segments, the
    /// beacons' trace (beacon mode, or a check of exact mode), the output created.
    pub(super) fn start(opts: &'a MemoryOptions, armed: Armed) -> Result<Self, RecordError> {
        // The early trace and the resume time are taken where the beacons are set up, below.
        let Armed {
            proc,
            mem,
            found,
            mode,
            raw,
            ..
        } = armed;
        let port = found.header.beacon_port;
        let rings = found.header.vcpus;
        let vcpus: Vec<u32> = (0..rings).collect();
        // The mapping is read only for records that hold the raw TSC. In beacon mode a
        // mapping exact mode refuses (a scaled TSC, a nested guest) only loses the exact
        // points.
        let opened = raw.then(|| {
            let m = Mappings::open(&opts.vm, rings)?;
            m.read().map(|last| (m, last))
        });
        let (mappings, last) = match opened {
            None => (None, Vec::new()),
            Some(Ok((m, last))) => (Some(m), last),
            Some(Err(e)) if mode == Mode::Beacons => {
                eprintln!(
                    "vmtsync: note: no exact points from KVM's mapping ({e}); the beacons place every event"
                );
                (None, Vec::new())
            }
            Some(Err(e)) => return Err(e.into()),
        };
        let use_mapping = mappings.is_some();
        let mut checking = None;
        let beacons = match (armed.early, mode) {
            // Armed before the guest ran (a paused VMM): chains bracket from beacon 0.
            (Some((trace, port)), _) => {
                Some(Beacons::new(trace, port, vcpus.len(), armed.armed_at))
            }
            (None, Mode::Beacons) => {
                start_beacons(opts.tracefs.as_deref(), &proc, &opts.vm, &vcpus, port, mode)?
            }
            // Exact mode places without the beacons: their check starts beside the drain
            // (a tracefs instance takes the kernel tens of ms to set up) and begins with the
            // round after it is ready.
            (None, Mode::Exact) if port != 0 => {
                let (tracefs, proc, vm, vcpus) = (
                    opts.tracefs.clone(),
                    proc.clone(),
                    opts.vm.clone(),
                    vcpus.clone(),
                );
                checking = Some(std::thread::spawn(move || {
                    start_beacons(tracefs.as_deref(), &proc, &vm, &vcpus, port, mode)
                }));
                None
            }
            (None, Mode::Exact) => None,
        };
        let target = Target {
            out: opts.output.out.clone(),
            format: opts.output.format,
            file_version: opts.output.file_version,
            source: format!("memory of VMM {} at {:#x}", opts.vm.id.pid, found.addr),
            spans: opts.spans.clone(),
        };
        let placement = match mode {
            Mode::Exact => Placement::OneSided,
            Mode::Beacons => Placement::TwoSided,
        };
        // Boot 0's keys are its rings' numbers.
        let mut st = State::new(&vcpus, None, placement);
        st.keyed = true;
        for (v, r) in st.vcpus.iter_mut().zip(&last) {
            let seg = exact_segment(v.vcpu, 0, 0, *r);
            exact_list(v, mode).push(seg);
        }
        st.round = 1;
        // Host TSC/BOOTTIME snapshots for the Perfetto output (it needs two or more): one
        // now, one a second while draining, and the one its writer takes at the end.
        st.clocks.extend(ClockSnapshot::take().ok());
        // Every output streams: exact mode places each record for good when it reads it,
        // beacon mode once the round after it is known. A trace.dat keeps the raw guest TSC
        // while the points are KVM's mapping's (exact mode, or a raw-TSC guest's beacons).
        let out = match mode {
            Mode::Exact => Writer::Piped(Pipe::start(
                Out::stream(&target, &st, false, true)?,
                target.out.clone(),
            )?),
            Mode::Beacons => Writer::Held {
                out: Box::new(Out::stream(&target, &st, !use_mapping, false)?),
                hold: Hold::new(),
            },
        };
        Ok(Self {
            opts,
            proc,
            mem,
            mode,
            raw,
            port,
            vcpus,
            mappings,
            boot: 0,
            rings,
            base: 0,
            last,
            beacons,
            checking,
            target,
            st,
            out,
            drainer: Drainer::new(&found, guestmem::DEFAULT_MAX_PER_ROUND),
            cur: BootCounts {
                nonce: found.header.nonce,
                rings,
                ..BootCounts::default()
            },
            ms: MemorySummary {
                header_addr: found.addr,
                capacity: found.header.capacity,
                ..MemorySummary::default()
            },
            started: Instant::now(),
            active: None,
            stop_heads: None,
            last_clock: Instant::now(),
            last_round: None,
        })
    }

    /// Exact mode: the beacons' check once its trace runs (or, with `wait`, once its set-up
    /// ends), or the warning that there is none. The beacons read before it count as emitted
    /// before the trace could see them.
    fn adopt_check(&mut self, wait: bool) {
        if !wait && !self.checking.as_ref().is_some_and(|t| t.is_finished()) {
            return;
        }
        let Some(t) = self.checking.take() else {
            return;
        };
        match t.join() {
            Ok(Ok(Some(mut b))) => {
                b.stats.read += self.ms.beacons;
                b.stats.early += self.ms.beacons;
                self.beacons = Some(b);
            }
            Ok(Ok(None)) => {}
            Ok(Err(why)) => {
                eprintln!("vmtsync: warning: beacons not checked against KVM's mapping: {why}");
            }
            Err(_) => eprintln!(
                "vmtsync: warning: beacons not checked against KVM's mapping: its set-up failed"
            ),
        }
    }

    /// KVM's mapping of the current boot's vCPUs now, or none when it is not used.
    fn read_all(&self) -> Result<Vec<Reading>, RecordError> {
        match &self.mappings {
            Some(m) => Ok(m.read()?),
            None => Ok(Vec::new()),
        }
    }

    /// `failed` unless the VMM turns out to have exited meanwhile: then its end.
    fn unless_gone(&self, failed: RecordError) -> Ended {
        if vmm_gone_within(&self.proc, &self.opts.vm, EXIT_GRACE) {
            Ok(EndReason::VmmExited)
        } else {
            Err(failed)
        }
    }

    /// Drain rounds until the recording ends. `Err`: a failure that leaves nothing to write.
    pub(super) fn drain(&mut self, progress: &mut Progress) -> Result<Ended, RecordError> {
        loop {
            if let Some(end) = self.round(progress)? {
                return Ok(end);
            }
        }
    }

    /// One drain round: read the rings, re-read KVM's mapping, place and write the records,
    /// make the beacons' segments. `Some`: the recording ends.
    fn round(&mut self, progress: &mut Progress) -> Result<Option<Ended>, RecordError> {
        let now_end = ended(self.opts, self.started);
        if let (Some(e), Some(heads)) = (now_end, &self.stop_heads)
            && self
                .drainer
                .counts()
                .iter()
                .zip(heads)
                .all(|(c, &h)| c.next >= h)
        {
            return Ok(Some(Ok(e)));
        }
        let round_start = Instant::now();
        let before = read_host_tsc().0;
        let polled = self.drainer.poll_round(&mut self.mem);
        let after = read_host_tsc().0;
        // Every ring was read in the last round after it began, and again in this one
        // before now.
        if let Some(last) = self.last_round.replace(round_start) {
            self.ms.longest_reread = self.ms.longest_reread.max(last.elapsed());
        }
        self.ms.polls += 1;
        if now_end.is_some() && self.stop_heads.is_none() && polled.is_ok() {
            self.stop_heads = Some(self.drainer.counts().iter().map(|c| c.head).collect());
        }
        let summary = match polled {
            Ok(s) => s,
            // The guest reset (or re-published its recorder): everything its old rings held
            // until the header changed was delivered; the next header starts a new boot.
            Err(e) if is_restart(&e) && !vmm_gone(&self.proc, &self.opts.vm) => {
                return Ok(self.restart(&e, progress));
            }
            // A VMM that exited takes its memory with it: what was read is written.
            Err(e) => return Ok(Some(self.unless_gone(MemoryError::Drain(e).into()))),
        };
        // The mapping after the round: every record just read was written before it.
        let now = match self.read_all() {
            Ok(n) => n,
            Err(e) => return Ok(Some(self.unless_gone(e))),
        };
        let changed = self.mapping_changes(&now);
        self.adopt_check(false);
        // Exact mode places a ring's records by its vCPU's mapping: while the vCPUs' mappings
        // are one, which vCPU wrote a ring changes no host time; otherwise it rests on the
        // header's word that ring r is vCPU r.
        let on_claim = rests_on_ring_claim(self.mode, &self.last, &now);
        let events_before = self.st.events;
        self.place_round(&now, &changed)?;
        if on_claim {
            self.ms.ring_claimed += self.st.events - events_before;
        }
        self.beacon_rounds(before, after, &now)?;
        self.release(false)?;
        self.last = now;
        self.after_round(round_start, progress)?;
        if self.opts.output.events.is_some_and(|n| self.st.events >= n) {
            return Ok(Some(Ok(EndReason::Events)));
        }
        self.idle(&summary);
        Ok(None)
    }

    /// A guest restart: the old boot's counts kept, the new header waited for, and the new
    /// boot's rings, mappings and beacon chains set up. `Some`: the recording ends.
    fn restart(&mut self, e: &DrainError, progress: &mut Progress) -> Option<Ended> {
        // The wait for the new header is no wait between two reads of one ring.
        self.last_round = None;
        // No later round places the old boot's records: they are written now.
        if let Err(e) = self.release(true) {
            return Some(Err(e));
        }
        self.cur.add(self.drainer.counts());
        let old_nonce = self.cur.nonce;
        self.ms.boots.push(std::mem::take(&mut self.cur));
        progress.clear();
        eprintln!(
            "vmtsync: boot {}: {e}; waiting for the guest to publish its recorder again",
            self.boot
        );
        let (opts, started) = (self.opts, self.started);
        let f = match find_again(&mut self.mem, opts, &self.proc, old_nonce, &|| {
            ended(opts, started)
        }) {
            Ok(f) => f,
            Err(end) => return Some(end),
        };
        if f.header.beacon_port != self.port || (f.header.clock == ClockKind::RawTsc) != self.raw {
            return Some(Err(MemoryError::Restarted { addr: f.addr }.into()));
        }
        self.boot += 1;
        self.rings = f.header.vcpus;
        self.base = self.st.vcpus.len();
        // KVM's mapping of the new boot, read anew: a reset may change a vCPU's offset, and
        // the new boot may have other rings.
        if self.mappings.is_some() {
            self.mappings = match Mappings::open(&self.opts.vm, self.rings) {
                Ok(m) => Some(m),
                Err(e) => return Some(self.unless_gone(e.into())),
            };
        }
        self.last = match self.read_all() {
            Ok(n) => n,
            Err(e) => return Some(self.unless_gone(e)),
        };
        for r in 0..self.rings {
            self.st.vcpus.push(VcpuSync::new(boot_key(self.boot, r)));
        }
        for (k, r) in self.last.iter().enumerate() {
            let key = self.st.vcpus[self.base + k].vcpu;
            let seg = exact_segment(key, self.st.round, 0, *r);
            exact_list(&mut self.st.vcpus[self.base + k], self.mode).push(seg);
        }
        self.st.round += 1;
        if let Some(b) = &mut self.beacons {
            b.new_boot(self.port, self.rings as usize);
        }
        eprintln!(
            "vmtsync: boot {}: the recorder at {:#x}, nonce {:#x}",
            self.boot, f.addr, f.header.nonce
        );
        self.drainer = Drainer::new(&f, guestmem::DEFAULT_MAX_PER_ROUND);
        self.cur = BootCounts {
            nonce: f.header.nonce,
            rings: self.rings,
            ..BootCounts::default()
        };
        self.stop_heads = None;
        None
    }

    /// Beacon mode: the records whose round after is known are written (`all`: every one
    /// still waiting, placed with the rounds known now). Once a raw-TSC guest's beacons
    /// disagree with KVM's mapping, its points are the beacons' (the mapping's are dropped),
    /// and a trace.dat's timestamps from then on are host ticks.
    fn release(&mut self, all: bool) -> Result<(), RecordError> {
        let Writer::Held { out, hold } = &mut self.out else {
            return Ok(());
        };
        if self.mappings.is_some()
            && self.beacons.as_ref().is_some_and(|b| b.stats.disagree > 0)
            && self.st.vcpus.iter().any(|v| !v.exact.is_empty())
        {
            for v in &mut self.st.vcpus {
                v.exact.clear();
            }
            out.preconvert();
        }
        if all {
            hold.release_all(&mut self.st, out, &self.target.out)
        } else {
            hold.release(&mut self.st, out, &self.target.out)
        }
    }

    /// Each vCPU whose mapping changed since the last round starts a new segment; returns
    /// which changed.
    fn mapping_changes(&mut self, now: &[Reading]) -> Vec<bool> {
        let mut changed = vec![false; self.rings as usize];
        for (i, (old, new)) in self.last.iter().zip(now).enumerate() {
            if old.offset != new.offset {
                changed[i] = true;
                self.ms.mapping_changes += 1;
                // From the earliest guest tick the new mapping can have started at.
                let start = old.after.wrapping_add_signed(new.offset);
                let seg = exact_segment(
                    self.st.vcpus[self.base + i].vcpu,
                    self.st.round,
                    start,
                    *new,
                );
                exact_list(&mut self.st.vcpus[self.base + i], self.mode).push(seg);
                self.st.round += 1;
            }
        }
        changed
    }

    /// The round's records: beacons to their chains, events placed (exact mode) or spooled
    /// for the end (beacon mode) and written.
    fn place_round(&mut self, now: &[Reading], changed: &[bool]) -> Result<(), RecordError> {
        let Self {
            drainer,
            ms,
            cur,
            beacons,
            opts,
            st,
            mode,
            out,
            boot,
            base,
            last,
            ..
        } = self;
        let mut round = Round {
            ms,
            cur,
            beacons,
            opts,
            st,
            mode: *mode,
            out,
            boot: *boot,
            base: *base,
            last,
            now,
            changed,
            zeros: 0,
        };
        let (records, reserved) = (drainer.round_records(), drainer.round_reserved());
        let placed = drainer
            .round_rings()
            .iter()
            .try_for_each(|ring| round.place_ring(ring, records, reserved));
        round.st.widths.push_n(0, round.zeros);
        placed
    }

    /// After a round: the read rate's window, a clock snapshot a second, the progress line.
    fn after_round(
        &mut self,
        round_start: Instant,
        progress: &mut Progress,
    ) -> Result<(), RecordError> {
        let read = self.drainer.round_records().len();
        if read > 0 {
            // The round's records are placed and written: its end counts in the rate.
            let end = Instant::now();
            self.active = Some((self.active.map_or(round_start, |(first, _)| first), end));
            self.ms.active_rounds += 1;
            self.ms.records += read as u64;
        }
        let mut snap = None;
        if self.last_clock.elapsed() >= Duration::from_secs(1) {
            self.last_clock = Instant::now();
            snap = ClockSnapshot::take().ok();
            self.st.clocks.extend(snap);
        }
        match &mut self.out {
            Writer::Held { out, .. } => out.round_end(snap)?,
            Writer::Piped(pipe) => {
                let drainer = &mut self.drainer;
                pipe.send_round(|spare| drainer.swap_round(spare), snap)?;
            }
        }
        progress.status(&format!(
            "vmtsync record: {} events from guest memory, {} lost",
            self.st.events,
            self.drainer
                .counts()
                .iter()
                .map(|c| c.overwritten + c.corrupt)
                .sum::<u64>()
        ));
        Ok(())
    }

    /// Idle (the round found nothing more): waits for the guest, but sees a stop or the end
    /// of the duration at once.
    fn idle(&self, summary: &PollSummary) {
        if summary.more || self.stop_heads.is_some() {
            return;
        }
        let wake = Instant::now() + self.opts.poll;
        while ended(self.opts, self.started).is_none() {
            let left = wake.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(10)));
        }
    }

    /// The beacons read last wait for a count past them: one more read of the rings, unless
    /// the VMM is gone, brackets them (its events are past the end and not written).
    pub(super) fn last_beacons(&mut self, result: &Ended) -> Result<(), RecordError> {
        let Some(b) = &mut self.beacons else {
            return Ok(());
        };
        if !matches!(result, Ok(end) if *end != EndReason::VmmExited) || b.waiting() == 0 {
            return Ok(());
        }
        std::thread::sleep(self.opts.poll.max(Duration::from_millis(10)));
        let beacons_before = self.ms.beacons;
        let before = read_host_tsc().0;
        let (past, read) = (&mut self.ms.past_limit, &mut self.ms.beacons);
        let polled = self.drainer.poll(&mut self.mem, &mut |r| {
            if r.is_beacon() {
                *read += 1;
                b.record(r);
            } else {
                *past += 1;
            }
        });
        let after = read_host_tsc().0;
        self.cur.beacons += self.ms.beacons - beacons_before;
        if polled.is_ok() {
            let now = self.read_all().unwrap_or_default();
            self.beacon_rounds(before, after, &now)?;
        }
        Ok(())
    }

    /// The beacons' samples of the rounds read between host times `before` and `after`,
    /// checked against KVM's mapping around them (`now` and the last round's) and, in beacon
    /// mode, made segments.
    fn beacon_rounds(
        &mut self,
        before: u64,
        after: u64,
        now: &[Reading],
    ) -> Result<(), RecordError> {
        let Some(b) = &mut self.beacons else {
            return Ok(());
        };
        let counts = self.drainer.counts().to_vec();
        let rounds = b.round(&counts, before, after);
        use_samples(
            b,
            &mut self.st,
            self.mode,
            rounds,
            &[now, &self.last],
            self.base,
        )
    }

    /// The end: the counts summed, the final placement of beacon mode, `--sync-out`, the
    /// output finished, and the summaries.
    pub(super) fn finish(
        mut self,
        result: Ended,
    ) -> Result<(RecordSummary, MemorySummary), RecordError> {
        // A check still being set up ends with its trace (nothing left for it to see).
        self.adopt_check(true);
        // Beacon mode: what still waits is placed with every round known.
        let released = self.release(true);
        self.sum_counts();
        // A raw-TSC guest whose beacons disagree with KVM's mapping does not record the raw
        // TSC: the mapping gives no point then, the beacons do (`release` dropped its points).
        let exact_points = self.mappings.is_some() && self.ms.beacon_stats.disagree == 0;
        if self.mode == Mode::Beacons {
            if let Writer::Held { hold, .. } = &self.out {
                self.ms.early_placed = hold.early;
                self.ms.spilled = hold.spilled_most;
            }
            if self.ms.beacon_stats.bracketed == 0 && self.st.unplaceable > 0 {
                eprintln!(
                    "vmtsync: warning: no beacon was bracketed, so no event could be placed: \
                     beacon mode needs the guest to emit beacons while the reader runs (the \
                     first two after its first read are not used){}",
                    if self.raw {
                        "; --trust-raw-tsc places raw-TSC records by KVM's mapping alone"
                    } else {
                        ""
                    }
                );
            }
        }
        self.ms.unverified = self.st.unverified;
        if let Some(path) = &self.opts.output.sync_out {
            write_sync_out(path, &self.target.source, &self.st)?;
        }
        let Self {
            out,
            target,
            st,
            mut ms,
            opts,
            mode,
            raw,
            vcpus,
            beacons,
            active,
            ..
        } = self;
        // The beacons' trace is done: removing its tracefs instance waits on the kernel (tens
        // of ms), and so does finishing the output (its sync): side by side.
        let teardown = beacons.map(|b| std::thread::spawn(move || drop(b)));
        let written = released.and_then(|()| match out {
            Writer::Held { out, .. } => finish(*out, &target, &st),
            // Exact mode: the writer writes what it was sent, and the drain lasts until it did.
            Writer::Piped(mut pipe) => pipe.finish().and_then(|(out, last_written)| {
                if let (Some((first, _)), Some(w)) = (active, last_written) {
                    ms.drain = ms.drain.max(w - first);
                }
                finish(out, &target, &st)
            }),
        });
        if let Some(t) = teardown {
            // A panic while removing the instance leaves it for the next run's cleanup.
            let _ = t.join();
        }
        let end = result?;
        let (preconverted, clamped) = written?;
        let done = Done {
            opts,
            mode,
            raw,
            vcpus,
            target,
            st,
            ms,
        };
        done.summaries(end, exact_points, preconverted, clamped)
    }

    /// The counts of every boot, and the beacons', into the memory summary.
    fn sum_counts(&mut self) {
        let ms = &mut self.ms;
        ms.drain = self
            .active
            .map_or(Duration::ZERO, |(first, last)| last - first);
        ms.elapsed = self.started.elapsed();
        self.cur.add(self.drainer.counts());
        ms.boots.push(std::mem::take(&mut self.cur));
        for c in &ms.boots {
            ms.overwritten += c.overwritten;
            ms.refused += c.refused;
            ms.corrupt += c.corrupt;
        }
        if let Some(b) = &self.beacons {
            ms.beacon_stats = b.stats.clone();
            ms.beacon_stats.unbracketed += b.waiting() as u64;
        }
    }
}

/// The last step: a recording whose output is written, and what its summaries need.
struct Done<'a> {
    opts: &'a MemoryOptions,
    mode: Mode,
    raw: bool,
    vcpus: Vec<u32>,
    target: Target,
    st: State,
    ms: MemorySummary,
}

impl Done<'_> {
    /// The two summaries of a recording that wrote its output, or [`RecordError::Unplaced`]
    /// when events were read but none could be placed (an empty output is no success).
    fn summaries(
        self,
        end: EndReason,
        exact_points: bool,
        preconverted: bool,
        clamped: u64,
    ) -> Result<(RecordSummary, MemorySummary), RecordError> {
        let (st, ms, opts) = (&self.st, self.ms, self.opts);
        let unplaced = st.unplaceable + ms.ambiguous;
        if st.events == 0 && unplaced > 0 {
            return Err(RecordError::Unplaced {
                read: unplaced,
                out: opts.output.out.clone(),
                why: if self.raw {
                    "no beacon was bracketed and KVM's mapping could not be used".into()
                } else {
                    "the header says its records do not hold the raw TSC, so only bracketed \
                     beacons can place them, and none was (attach before the guest emits its \
                     beacons, or keep it emitting them while the reader runs)"
                        .into()
                },
            });
        }
        let summary = RecordSummary {
            events: st.events,
            dropped: ms.refused,
            overwritten: ms.overwritten,
            segments: st.segments(),
            breaks: match self.mode {
                Mode::Exact => st.segments(),
                Mode::Beacons => st.breaks,
            },
            widths: st.widths.summary(),
            host_stamped_skipped: 0,
            unplaceable: unplaced,
            lost: ms.corrupt,
            replayed: 0,
            failed_drains: 0,
            preconverted,
            clamped,
            end,
            vcpu: 0,
            vcpus: self.vcpus,
            trace_id: if opts.output.format == RecordFormat::TraceCmd {
                trace_id(&self.target, st)
            } else {
                0
            },
            out: opts.output.out.clone(),
            console_bytes: 0,
            console: None,
            host_time: match (self.mode, self.raw) {
                (Mode::Exact, _) => HostTime::ExactDebugfs,
                (Mode::Beacons, true) if exact_points && st.unverified == st.events => {
                    HostTime::ExactUnverified
                }
                (Mode::Beacons, true) if exact_points => HostTime::BeaconsExactPoints,
                (Mode::Beacons, _) => HostTime::Beacons,
            },
        };
        Ok((summary, ms))
    }
}

/// What placing one round's records borrows from its [`Recording`].
struct Round<'r, 'a> {
    ms: &'r mut MemorySummary,
    cur: &'r mut BootCounts,
    beacons: &'r mut Option<Beacons>,
    opts: &'a MemoryOptions,
    st: &'r mut State,
    mode: Mode,
    out: &'r mut Writer,
    boot: u32,
    base: usize,
    /// KVM's mapping before the round and after it, and which vCPUs' changed.
    last: &'r [Reading],
    now: &'r [Reading],
    changed: &'r [bool],
    /// Events placed with width 0 (added to the widths once, at the end of the round).
    zeros: u64,
}

impl Round<'_, '_> {
    /// One ring's records of the round (`ring` of the round's `records`, its reserved ones
    /// listed in `reserved`). Exact mode: the runs of plain events its latest segment places
    /// go to the writer as one item each ([`Item::Run`]); every other record goes through
    /// [`Self::place`]. When the ring's clock range shows that the segment places every
    /// record without a reserved id, the runs are the stretches between the reserved ones,
    /// with no look at each record.
    fn place_ring(
        &mut self,
        ring: &RoundRing,
        records: &[GuestRecord],
        reserved: &[usize],
    ) -> Result<(), RecordError> {
        let run = self.run(ring.vcpu);
        if let Some(run) = run.filter(|r| r.places_unreserved(ring))
            && matches!(self.out, Writer::Piped(_))
        {
            let mut i = ring.records.start;
            for &next in reserved[ring.reserved.clone()]
                .iter()
                .chain(std::iter::once(&ring.records.end))
            {
                let taken = self.push_run(run, i, next);
                for (at, r) in records.iter().enumerate().take(next).skip(i + taken) {
                    self.place(r, at)?;
                }
                if next < ring.records.end {
                    self.place(&records[next], next)?;
                }
                i = next + 1;
            }
            return Ok(());
        }
        let mut i = ring.records.start;
        while i < ring.records.end {
            if let Some(run) = run {
                let n = records[i..ring.records.end]
                    .iter()
                    .take(self.left())
                    .take_while(|r| run.places(r).is_some())
                    .count();
                if self.push_run(run, i, i + n) > 0 {
                    i += n;
                    continue;
                }
            }
            self.place(&records[i], i)?;
            i += 1;
        }
        Ok(())
    }

    /// Events the recording may still write (`--events`).
    fn left(&self) -> usize {
        self.opts.output.events.map_or(usize::MAX, |n| {
            usize::try_from(n.saturating_sub(self.st.events)).unwrap_or(usize::MAX)
        })
    }

    /// The round's records `from..to`, all plain events `run` places, to the writer as one
    /// run, as many as the recording may still write: how many it took (none without a
    /// writer thread).
    fn push_run(&mut self, run: ExactRun, from: usize, to: usize) -> usize {
        let n = (to - from).min(self.left());
        let Writer::Piped(pipe) = &mut *self.out else {
            return 0;
        };
        if n > 0 {
            pipe.items.push(Item::Run {
                run,
                from,
                to: from + n,
            });
            self.st.events += n as u64;
            self.zeros += n as u64;
        }
        n
    }

    /// Exact mode: ring `ring`'s latest segment, when KVM's mapping of its vCPU did not
    /// change during the round (every record then falls in it or before it).
    fn run(&self, ring: u32) -> Option<ExactRun> {
        let i = ring as usize;
        if self.mode != Mode::Exact || self.changed.get(i).copied().unwrap_or(true) {
            return None;
        }
        let v = self.st.vcpus.get(self.base + i)?;
        let s = v.segments.last()?;
        Some(ExactRun {
            key: v.vcpu,
            offset: s.offset,
            start: s.guest_start,
            round: s.round,
        })
    }

    /// One record of the round, its record `at` (see [`Recording::place_round`]).
    fn place(&mut self, r: &GuestRecord, at: usize) -> Result<(), RecordError> {
        let st = &mut *self.st;
        if r.is_beacon() {
            self.ms.beacons += 1;
            self.cur.beacons += 1;
            if let Some(b) = self.beacons {
                b.record(r);
            }
            return Ok(());
        }
        if self.opts.output.events.is_some_and(|n| st.events >= n) {
            self.ms.past_limit += 1;
            return Ok(());
        }
        let key = boot_key(self.boot, r.vcpu);
        let pipe = match &mut *self.out {
            // Beacon mode: placed once the sync round after it is known, with the beacons on
            // both sides of it.
            Writer::Held { hold, .. } => {
                hold.push(key, r, &self.opts.output.out)?;
                st.events += 1;
                return Ok(());
            }
            Writer::Piped(pipe) => pipe,
        };
        let i = r.vcpu as usize;
        let (host, round) = if self.changed.get(i).copied().unwrap_or(false) {
            match across_change(r.tsc, self.last[i], self.now[i]) {
                Some(Side::Old(h)) => (h, st.round - 2),
                Some(Side::New(h)) => (h, st.round - 1),
                None => {
                    self.ms.ambiguous += 1;
                    return Ok(());
                }
            }
        } else {
            let Some(p) = exact_at(&st.vcpus[self.base + i].segments, r.tsc) else {
                st.unplaceable += 1;
                return Ok(());
            };
            p
        };
        pipe.items.push(Item::One {
            at,
            key,
            host,
            round,
        });
        self.zeros += 1;
        st.events += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_exact_round_with_unequal_mappings_rests_on_the_ring_claim() {
        let at = |offset| Reading {
            offset,
            before: 10,
            after: 20,
        };
        let (same, split) = ([at(-5), at(-5)], [at(-5), at(7)]);
        assert!(!rests_on_ring_claim(Mode::Exact, &same, &same));
        assert!(!rests_on_ring_claim(Mode::Exact, &[at(3)], &[at(9)]));
        assert!(rests_on_ring_claim(Mode::Exact, &same, &split));
        assert!(rests_on_ring_claim(Mode::Exact, &split, &same));
        assert!(!rests_on_ring_claim(Mode::Beacons, &split, &split));
    }
}
