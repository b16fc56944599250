//! The memory front end of `vmtsync record --from-memory`: no link and no agent protocol.
//! The guest's recorder is found in its VMM process's memory ([`crate::guestmem::find`]) and
//! drained while the guest runs ([`crate::guestmem::Drainer`]); each record's host time
//! comes from KVM's own per-vCPU mapping in debugfs (exact mode: the header says the records
//! hold the raw TSC). Events and per-vCPU segments go into the same placement and output
//! stages as the protocol front end's ([`super::place`], [`super::write`]).
//!
//! Ring `r` is vCPU `r` (debugfs `vcpuR`). A vCPU's mapping `guest = host + tsc_offset`
//! becomes one segment of width 0; debugfs is read again after every drain round, and a
//! mapping that changed starts a new segment. The records drained in the round in which a
//! change was seen were written either before it (old mapping) or after it (new mapping):
//! each is placed with the one mapping under which its host time is consistent with when
//! the change could have happened, and one that fits both is counted as ambiguous and not
//! written.

use std::time::{Duration, Instant};

use super::beacons::{BeaconStats, Beacons};
use super::error::{MemoryError, Unplaceable};
use super::*;
use crate::guestmem::{self, Drainer, GuestClock, GuestRecord, Location, ProcMemory};
use crate::kvm::debugfs::{VcpuState, VmDir, read_vcpu};
use crate::kvm::hosttsc::read_host_tsc;
use crate::kvm::procinfo::ProcFs;
use crate::probe::anchor::PioTrace;
use crate::syncfile::{AnchorKind, OffsetModel};

/// Everything `vmtsync record --from-memory` needs.
#[derive(Clone, Debug)]
pub struct MemoryOptions {
    /// The VM's debugfs directory (its VMM's PID is the process whose memory is read).
    pub vm: VmDir,
    /// The proc tree (normally `/proc`).
    pub proc_root: PathBuf,
    /// Where the recorder's header is.
    pub location: Location,
    /// The output file.
    pub out: PathBuf,
    /// Its format.
    pub format: RecordFormat,
    /// trace.dat version.
    pub file_version: FileVersion,
    /// Stop after this many events.
    pub events: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Time between two drain rounds that found nothing.
    pub poll: Duration,
    /// `--trust-raw-tsc`: the header's clock claim is taken as stated (width 0).
    pub trust_raw_tsc: bool,
    /// How long to wait for the guest to publish its header.
    pub find_timeout: Duration,
    /// SIGINT/SIGTERM.
    pub stop: Option<&'static std::sync::atomic::AtomicBool>,
    /// `--beacon-port`: the port whose `kvm_pio` exits are traced from the start, before the
    /// header that names it is found (the header must then name the same port).
    pub beacon_port: Option<u16>,
    /// The VMM is paused and this resumes it (`record --from-memory -- VMM…`): the reader
    /// arms its trace first, so the guest's every exit follows a host time it took.
    pub paused: Option<super::launch::Resume>,
    /// `--sync-out`: the segments the recording placed its events by, written when it ends
    /// (see [`write_sync_out`]).
    pub sync_out: Option<PathBuf>,
    /// `--tracefs` for the beacons' kvm_pio trace (default: the usual mount points).
    pub tracefs: Option<PathBuf>,
}

/// The default time between two idle drain rounds.
pub const DEFAULT_POLL: Duration = Duration::from_millis(2);

/// What a memory recording read, beyond the common summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySummary {
    /// The header's host virtual address in the VMM.
    pub header_addr: u64,
    /// Records per ring.
    pub capacity: u64,
    /// Sync beacons read (not written: in exact mode they carry nothing the mapping lacks).
    pub beacons: u64,
    /// Records the guest overwrote before the reader got them (exact, all rings).
    pub overwritten: u64,
    /// Records a full stop-when-full ring refused (the guest's own count).
    pub refused: u64,
    /// Records whose slot broke the layout's rules (not written).
    pub corrupt: u64,
    /// Events read after `--events` was reached (not written).
    pub past_limit: u64,
    /// Events drained in a round where the vCPU's mapping changed that fit both mappings.
    pub ambiguous: u64,
    /// Mapping changes seen.
    pub mapping_changes: u64,
    /// Drain rounds.
    pub polls: u64,
    /// Time from the start of the first round that delivered records to the end of the last
    /// one that did, its records written (the guest was producing in between; waiting for
    /// the header or for the end is not in it).
    pub drain: Duration,
    /// Records read in the drain loop (events, written or not, and beacons).
    pub records: u64,
    /// Drain rounds that delivered records (one such round has a read time, not a rate).
    pub active_rounds: u64,
    /// From the header found to the end of the recording.
    pub elapsed: Duration,
    /// What beacon mode counted (beacons bracketed, disagreements with KVM's mapping).
    pub beacon_stats: BeaconStats,
    /// Beacon mode, raw-TSC guest: events of a vCPU no bracketed beacon covers (a late
    /// attach), placed by KVM's mapping alone with width 0: exact if the header's raw-TSC
    /// claim holds, which no beacon checked.
    pub unverified: u64,
    /// Each guest boot's counts, in order (a reset that republishes the header starts the
    /// next one).
    pub boots: Vec<BootCounts>,
}

/// One guest boot's exact counts: `records + overwritten` is what its rings produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootCounts {
    /// The header's boot nonce.
    pub nonce: u64,
    /// Its rings.
    pub rings: u32,
    /// Records read (events, written or not, and beacons).
    pub records: u64,
    /// Of these, sync beacons.
    pub beacons: u64,
    /// Records the guest overwrote before the reader got them.
    pub overwritten: u64,
    /// Records its full stop-when-full rings refused (the guest's count).
    pub refused: u64,
    /// Records whose slot broke the layout's rules.
    pub corrupt: u64,
}

impl BootCounts {
    /// Adds a drained boot's ring counts.
    fn add(&mut self, counts: &[guestmem::RingCounts]) {
        for c in counts {
            self.records += c.delivered;
            self.overwritten += c.overwritten;
            self.refused += c.refused;
            self.corrupt += c.corrupt;
        }
    }
}

impl MemorySummary {
    /// Records read per second while the guest produced them ([`MemorySummary::records`]
    /// over [`MemorySummary::drain`]): a floor of the reader's rate, not its ceiling.
    #[must_use]
    pub fn rate(&self) -> f64 {
        let secs = self.drain.as_secs_f64();
        if secs > 0.0 {
            self.records as f64 / secs
        } else {
            0.0
        }
    }
}

/// One vCPU's mapping as debugfs said it, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reading {
    offset: i64,
    /// Host TSC before and after the read.
    before: u64,
    after: u64,
}

fn reading(v: &VcpuState) -> Result<Reading, MemoryError> {
    if v.guest_mode == Some(true) {
        return Err(MemoryError::Nested { vcpu: v.vcpu });
    }
    if !v.scaling.is_identity() {
        return Err(MemoryError::Scaled {
            vcpu: v.vcpu,
            ratio: v.scaling.ratio,
            frac_bits: v.scaling.frac_bits,
        });
    }
    Ok(Reading {
        offset: v.tsc_offset,
        before: v.bracket.before.0,
        after: v.bracket.after.0,
    })
}

/// Which mapping a record read in the round of a mapping change belongs to, with its host
/// time under it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// Written before the change.
    Old(u64),
    /// Written after it.
    New(u64),
}

/// A record with guest tick `tsc`, read after reading `old` and before reading `new` of a
/// mapping that changed in between. The change happened after `old.after` and before
/// `new.before`; a record written before it has, under the old mapping, a host time no later
/// than `new.before`, and one written after it has, under the new mapping, a host time no
/// earlier than `old.after`. Exactly one of the two holding decides; both or neither
/// (`None`) leave it ambiguous. (A record's host time under a negative offset past 2^64 is
/// outside the host's range and cannot fit.)
fn across_change(tsc: u64, old: Reading, new: Reading) -> Option<Side> {
    let host = |offset: i64| tsc.checked_add_signed(offset.checked_neg()?);
    let fits_old = host(old.offset).filter(|&h| h <= new.before);
    let fits_new = host(new.offset).filter(|&h| h >= old.after);
    match (fits_old, fits_new) {
        (Some(h), None) => Some(Side::Old(h)),
        (None, Some(h)) => Some(Side::New(h)),
        _ => None,
    }
}

/// Guest tick `g` through the width-0 segments `segments` (KVM's mappings, in guest
/// order): its host tick `g - offset` under the covering one (the last that starts at or
/// before it, else the first) and that segment's round, as `bounds::place` would give with no
/// arithmetic beyond the subtraction; `None` outside the host's range.
fn exact_at(segments: &[SyncSegment], g: u64) -> Option<(u64, u64)> {
    let i = segments
        .partition_point(|s| s.guest_start <= g)
        .saturating_sub(1);
    let s = segments.get(i)?;
    Some((g.checked_add_signed(s.offset.checked_neg()?)?, s.round))
}

/// Record `r` of guest boot `boot` at host tick `host` with width 0, in segment round
/// `round`.
fn exact_placed(r: &GuestRecord, boot: u32, host: u64, round: u64) -> Placed<'_> {
    Placed {
        vcpu: super::place::boot_key(boot, r.vcpu),
        keyed: true,
        id: r.id,
        guest: r.tsc,
        payload: r.payload(),
        host,
        lo: host,
        hi: host,
        round,
    }
}

/// The width-0 segment of mapping `r` from guest tick `guest_start` on.
fn exact_segment(vcpu: u32, round: u64, guest_start: u64, r: Reading) -> SyncSegment {
    SyncSegment {
        vcpu,
        round,
        guest_start,
        host_anchor: r.before,
        guest_anchor: r.before.wrapping_add_signed(r.offset),
        offset: r.offset,
        offset_lo: r.offset,
        offset_hi: r.offset,
        drift_ppb: 0,
        drift_ppb_lo: Some(0),
        drift_ppb_hi: Some(0),
        model: OffsetModel::Offset,
        probes: 0,
        rtt_min_ticks: 0,
        host_first: r.before,
        host_last: r.after,
        is_break: true,
        anchor: AnchorKind::InProcess,
    }
}

/// Whether the VMM is gone: its KVM debugfs directory went away (the VM's last file closed),
/// or its process is no more than a zombie (its memory is unreadable before it is reaped).
fn vmm_gone(proc: &ProcFs, vm: &VmDir) -> bool {
    if !vm.path.exists() {
        return true;
    }
    let stat = proc.root().join(vm.id.pid.to_string()).join("stat");
    match std::fs::read_to_string(stat) {
        // The state is the first field after the parenthesised command name.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| matches!(state, 'Z' | 'X')),
        Err(_) => true,
    }
}

/// Whether the VMM is gone within `limit`: a VMM that is exiting loses its mappings before
/// its process becomes a zombie and its VM directory goes, so a read that fails then is
/// given that long to turn into an exit.
fn vmm_gone_within(proc: &ProcFs, vm: &VmDir, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    loop {
        if vmm_gone(proc, vm) {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a drain error says the guest restarted: its header went away, or came back with
/// another nonce or geometry.
fn is_restart(e: &guestmem::DrainError) -> bool {
    matches!(
        e,
        guestmem::DrainError::HeaderGone { .. }
            | guestmem::DrainError::NonceChanged { .. }
            | guestmem::DrainError::GeometryChanged { .. }
    )
}

/// After a restart: waits for a valid header whose nonce is not `old` (where the first one
/// was looked for), for as long as the recording runs: `Err` with how it ends otherwise (a
/// stop, its duration, the VMM's exit, or a memory error). A header that comes back with
/// the old nonce is the old boot's, not a new one: it is waited past.
fn find_again(
    mem: &mut ProcMemory,
    opts: &MemoryOptions,
    proc: &ProcFs,
    old: u64,
    ended: &dyn Fn() -> Option<EndReason>,
) -> Result<guestmem::Found, Result<EndReason, RecordError>> {
    loop {
        if let Some(e) = ended() {
            return Err(Ok(e));
        }
        if vmm_gone(proc, &opts.vm) {
            return Err(Ok(EndReason::VmmExited));
        }
        match guestmem::find(mem, opts.location) {
            Ok(f) if f.header.nonce != old => return Ok(f),
            Ok(_) => {}
            Err(e) if e.not_yet() => {}
            Err(_) if vmm_gone_within(proc, &opts.vm, EXIT_GRACE) => {
                return Err(Ok(EndReason::VmmExited));
            }
            Err(e) => return Err(Err(MemoryError::Find(e).into())),
        }
        // Soon after it appears: the new boot's beacons are bracketed from its second on.
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How long a failed read waits for the VMM's exit to show.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Where a memory recording's intervals come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `--trust-raw-tsc`: KVM's exact mapping, width 0, on the header's word.
    Exact,
    /// The beacons' kvm_pio brackets (a raw-TSC guest's points still come from the mapping).
    Beacons,
}

/// The mode for a header that says `raw` (clock 0) and names beacon port `port`, or why it
/// cannot be recorded.
fn mode_for(raw: bool, port: u16, trust: bool) -> Result<Mode, Unplaceable> {
    match (raw, port, trust) {
        (true, _, true) => Ok(Mode::Exact),
        (false, _, true) => Err(Unplaceable::TrustNotRaw),
        (_, 0, false) if raw => Err(Unplaceable::RawUnchecked),
        (_, 0, false) => Err(Unplaceable::NoClock),
        _ => Ok(Mode::Beacons),
    }
}

/// Where a vCPU's debugfs mappings go: its segments (exact mode) or its exact points.
fn exact_list(v: &mut super::place::VcpuSync, mode: Mode) -> &mut Vec<SyncSegment> {
    match mode {
        Mode::Exact => &mut v.segments,
        Mode::Beacons => &mut v.exact,
    }
}

/// Starts the kvm_pio trace of beacon port `port` on every thread of the VMM (a beacon's
/// exits are its vCPU thread's, and every one of them must be traced for a bracket to hold,
/// whichever ring a vCPU writes), or why not. `None` without a beacon port.
fn start_beacons(
    tracefs: Option<&Path>,
    proc: &ProcFs,
    vm: &VmDir,
    vcpus: &[u32],
    port: u16,
    mode: Mode,
) -> Result<Option<Beacons>, MemoryError> {
    if port == 0 {
        return Ok(None);
    }
    let trace = start_trace(tracefs, proc, vm, port).map_err(|e| match e {
        MemoryError::Trace { port, source, .. } => MemoryError::Trace {
            port,
            needed: mode == Mode::Beacons,
            source,
        },
        e => e,
    })?;
    Ok(Some(Beacons::new(trace, port, vcpus.len(), None)))
}

/// The `kvm_pio` trace of `port` for every thread of the VMM, also one it creates later (the
/// kernel filter names only the port; the reader keeps the exits of the VMM's own threads).
fn start_trace(
    tracefs: Option<&Path>,
    proc: &ProcFs,
    vm: &VmDir,
    port: u16,
) -> Result<PioTrace, MemoryError> {
    PioTrace::start_process(tracefs, proc.root(), vm.id.pid, &[port]).map_err(|source| {
        MemoryError::Trace {
            port,
            needed: false,
            source,
        }
    })
}

/// A drain round's beacon samples: checked against KVM's mapping (`mappings`: the vCPUs'
/// readings around the round) for a raw-TSC guest, and made segments in beacon mode.
// One stage's inputs, each used once: grouping them would only rename them.
#[allow(clippy::too_many_arguments)]
fn use_samples(
    b: &mut Beacons,
    st: &mut State,
    out: &mut Out,
    target: &Target,
    mode: Mode,
    rounds: Vec<Vec<ProbeSample>>,
    mappings: &[&[Reading]],
    base: usize,
) -> Result<(), RecordError> {
    for (i, samples) in rounds.into_iter().enumerate() {
        if samples.is_empty() {
            continue;
        }
        let offsets: Vec<i64> = mappings
            .iter()
            .filter_map(|m| m.get(i))
            .map(|r| r.offset)
            .collect();
        if !offsets.is_empty() {
            for s in &samples {
                b.check_exact(s, &offsets);
            }
        }
        if mode == Mode::Beacons {
            beacon_round(st, base + i, &samples)?;
            // JSON Lines: the events the new round covers are written as they are now.
            out.round_made(st, target)?;
        }
    }
    Ok(())
}

/// One ring's beacon samples of a drain round become a segment of its vCPU, as a probe
/// round's samples do (the same estimators and bounds).
fn beacon_round(st: &mut State, i: usize, samples: &[ProbeSample]) -> Result<(), RecordError> {
    let info = beacon_info(st.vcpus[i].vcpu);
    let stats = crate::probe::SessionStats {
        anchor: AnchorKind::KvmPioBeacon,
        ..Default::default()
    };
    let s = match ProbeSummary::from_samples(&info, samples, stats) {
        Ok(s) => s,
        Err(e) => {
            st.refused = Some(e);
            return Ok(());
        }
    };
    let round = st.round;
    st.round += 1;
    let v = &mut st.vcpus[i];
    let is_break = v.cumulative.add(samples);
    let seg = segment(&v.cumulative, &s, samples, round, is_break)?;
    st.breaks += u64::from(is_break);
    v.segments.push(seg);
    Ok(())
}

/// What the estimators need to know of a beacon "agent": its vCPU (nothing else is used).
fn beacon_info(vcpu: u32) -> crate::probe::AgentInfo {
    crate::probe::AgentInfo {
        vcpu,
        transport: vmtsync_core::proto::Transport::Memory,
        features: vmtsync_core::proto::Features::NONE,
        tsc_khz: None,
        hello_tsc: vmtsync_core::GuestTicks(0),
        hello_stamps: crate::link::transport::FrameStamps {
            send: HostTicks(0),
            recv: HostTicks(0),
        },
    }
}

/// `--sync-out` of a memory recording: every vCPU's segments that placed its events, in
/// order: the beacons' (beacon mode), else KVM's mappings (exact mode, or a vCPU no bracketed
/// beacon covers). Written when the recording ends, since beacon segments are final only then.
fn write_sync_out(path: &Path, source: &str, st: &State) -> Result<(), RecordError> {
    let mut w =
        SyncWriter::open(path, &SyncHeader::now(source.to_owned())).map_err(ProbeError::from)?;
    for v in &st.vcpus {
        let segs = if v.segments.is_empty() {
            &v.exact
        } else {
            &v.segments
        };
        for seg in segs {
            w.append(seg).map_err(ProbeError::from)?;
        }
    }
    Ok(())
}

/// Records a guest by reading its recorder out of its VMM's memory (see the module docs).
///
/// # Errors
/// [`RecordError`]; events read before a failure are still written.
pub fn run_record_memory(
    opts: &MemoryOptions,
    progress: &mut Progress,
) -> Result<(RecordSummary, MemorySummary), RecordError> {
    let pid = opts.vm.id.pid;
    let proc = ProcFs::new(&opts.proc_root);
    let mut mem = ProcMemory::open(&proc, pid).map_err(MemoryError::from)?;
    let stopped = || {
        opts.stop
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
    };
    // `--beacon-port`: the trace runs before the guest can emit a beacon we would not see.
    let early = match opts.beacon_port {
        Some(port) => Some((
            start_trace(opts.tracefs.as_deref(), &proc, &opts.vm, port).map_err(|e| match e {
                // Beacon mode needs it; exact mode is not known before the header is found.
                MemoryError::Trace { port, source, .. } => MemoryError::Trace {
                    port,
                    needed: !opts.trust_raw_tsc,
                    source,
                },
                e => e,
            })?,
            port,
        )),
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
    // The guest publishes its header at run time: wait for it, wherever it is to appear (a
    // scan, a named address or a guest-physical one finds nothing valid before).
    let deadline = Instant::now() + opts.find_timeout;
    let found = loop {
        match guestmem::find(&mut mem, opts.location) {
            Ok(f) => break f,
            Err(e) if e.not_yet() && Instant::now() < deadline && !stopped() => {
                // Soon after it appears: a beacon-mode recording brackets beacons from the
                // second after the first read on.
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) if source.not_yet() => {
                return Err(MemoryError::NotPublished {
                    waited: opts.find_timeout,
                    source,
                }
                .into());
            }
            Err(e) => return Err(MemoryError::Find(e).into()),
        }
    };
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
    let raw = found.header.clock == GuestClock::RawTsc;
    let mode = mode_for(raw, port, opts.trust_raw_tsc).map_err(|why| MemoryError::Unplaceable {
        addr: found.addr,
        why,
    })?;
    let vcpus: Vec<u32> = (0..found.header.vcpus).collect();
    // KVM's mapping of vCPUs 0..n (one per ring of the current boot).
    let read_n = |n: u32| -> Result<Vec<Reading>, RecordError> {
        (0..n)
            .map(|v| {
                read_vcpu(&opts.vm.path.join(format!("vcpu{v}")), v)
                    .map_err(MemoryError::from)
                    .and_then(|s| reading(&s))
                    .map_err(RecordError::from)
            })
            .collect()
    };
    // The boot drained now, its rings, and where its rings' vCPUs start in the state.
    let mut boot: u32 = 0;
    let mut rings = found.header.vcpus;
    let mut base = 0usize;
    // The mapping is read only for records that hold the raw TSC. In beacon mode a mapping
    // exact mode refuses (a scaled TSC, a nested guest) only loses the exact points.
    let mut use_mapping = raw;
    if raw
        && mode == Mode::Beacons
        && let Err(e) = read_n(rings)
    {
        eprintln!(
            "vmtsync: note: no exact points from KVM's mapping ({e}); the beacons place every event"
        );
        use_mapping = false;
    }
    let read_all = |n: u32| {
        if use_mapping {
            read_n(n)
        } else {
            Ok(Vec::new())
        }
    };
    let mut last = read_all(rings)?;
    let armed = match early {
        // Armed before the guest ran (a paused VMM): chains bracket from beacon 0.
        Some((trace, port)) => Ok(Some(Beacons::new(trace, port, vcpus.len(), armed_at))),
        None => start_beacons(opts.tracefs.as_deref(), &proc, &opts.vm, &vcpus, port, mode),
    };
    let mut beacons = match armed {
        Ok(b) => b,
        Err(why) if mode == Mode::Exact => {
            if port != 0 {
                eprintln!("vmtsync: warning: beacons not checked against KVM's mapping: {why}");
            }
            None
        }
        Err(why) => return Err(why.into()),
    };
    let target = Target {
        out: opts.out.clone(),
        format: opts.format,
        file_version: opts.file_version,
        source: format!("memory of VMM {pid} at {:#x}", found.addr),
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
    // Host TSC/BOOTTIME snapshots for the Perfetto output (it needs two or more): one now,
    // one a second while draining, and the one its writer takes at the end.
    st.clocks.extend(ClockSnapshot::take().ok());
    let mut last_clock = Instant::now();
    let mut out = Out::create(&target, placement)?;
    let mut drainer = Drainer::new(&found, guestmem::DEFAULT_MAX_PER_ROUND);
    let mut cur = BootCounts {
        nonce: found.header.nonce,
        rings,
        ..BootCounts::default()
    };
    let mut ms = MemorySummary {
        header_addr: found.addr,
        capacity: found.header.capacity,
        ..MemorySummary::default()
    };
    let mut pending: Vec<GuestRecord> = Vec::new();
    let started = Instant::now();
    // The first and last rounds that delivered records.
    let mut active: Option<(Instant, Instant)> = None;
    // Each ring's head when a stop or the duration was seen: the rounds after it read
    // everything the guest stored until then (however many rounds that takes), and stop there.
    let mut stop_heads: Option<Vec<u64>> = None;
    let ended = || {
        if stopped() {
            Some(EndReason::Stopped)
        } else if opts.duration.is_some_and(|d| started.elapsed() >= d) {
            Some(EndReason::Duration)
        } else {
            None
        }
    };
    let result = loop {
        let now_end = ended();
        if let (Some(e), Some(heads)) = (now_end, &stop_heads)
            && drainer
                .counts()
                .iter()
                .zip(heads)
                .all(|(c, &h)| c.next >= h)
        {
            break Ok(e);
        }
        pending.clear();
        let round_start = Instant::now();
        let before = read_host_tsc().0;
        let polled = drainer.poll(&mut mem, &mut |r| pending.push(*r));
        let after = read_host_tsc().0;
        ms.polls += 1;
        if now_end.is_some() && stop_heads.is_none() && polled.is_ok() {
            stop_heads = Some(drainer.counts().iter().map(|c| c.head).collect());
        }
        let summary = match polled {
            Ok(s) => s,
            // The guest reset (or re-published its recorder): everything its old rings held
            // until the header changed was delivered; the next header starts a new boot.
            Err(e) if is_restart(&e) && !vmm_gone(&proc, &opts.vm) => {
                cur.add(drainer.counts());
                let old_nonce = cur.nonce;
                ms.boots.push(std::mem::take(&mut cur));
                progress.clear();
                eprintln!(
                    "vmtsync: boot {boot}: {e}; waiting for the guest to publish its recorder again"
                );
                let f = match find_again(&mut mem, opts, &proc, old_nonce, &ended) {
                    Ok(f) => f,
                    Err(end) => break end,
                };
                if f.header.beacon_port != port || (f.header.clock == GuestClock::RawTsc) != raw {
                    break Err(MemoryError::Restarted { addr: f.addr }.into());
                }
                boot += 1;
                rings = f.header.vcpus;
                base = st.vcpus.len();
                // KVM's mapping of the new boot, read anew: a reset may change a vCPU's offset.
                last = match read_all(rings) {
                    Ok(n) => n,
                    Err(_) if vmm_gone_within(&proc, &opts.vm, EXIT_GRACE) => {
                        break Ok(EndReason::VmmExited);
                    }
                    Err(e) => break Err(e),
                };
                for r in 0..rings {
                    st.vcpus
                        .push(super::place::VcpuSync::new(super::place::boot_key(boot, r)));
                }
                for (k, r) in last.iter().enumerate() {
                    let key = st.vcpus[base + k].vcpu;
                    let seg = exact_segment(key, st.round, 0, *r);
                    exact_list(&mut st.vcpus[base + k], mode).push(seg);
                }
                st.round += 1;
                if let Some(b) = &mut beacons {
                    b.new_boot(port, rings as usize);
                }
                eprintln!(
                    "vmtsync: boot {boot}: the recorder at {:#x}, nonce {:#x}",
                    f.addr, f.header.nonce
                );
                drainer = Drainer::new(&f, guestmem::DEFAULT_MAX_PER_ROUND);
                cur = BootCounts {
                    nonce: f.header.nonce,
                    rings,
                    ..BootCounts::default()
                };
                stop_heads = None;
                continue;
            }
            Err(e) => {
                // A VMM that exited takes its memory with it: what was read is written.
                break if vmm_gone_within(&proc, &opts.vm, EXIT_GRACE) {
                    Ok(EndReason::VmmExited)
                } else {
                    Err(MemoryError::Drain(e).into())
                };
            }
        };
        // The mapping after the round: every record just read was written before it.
        let now = match read_all(rings) {
            Ok(n) => n,
            Err(_) if vmm_gone_within(&proc, &opts.vm, EXIT_GRACE) => {
                break Ok(EndReason::VmmExited);
            }
            Err(e) => break Err(e),
        };
        let mut changed = vec![false; rings as usize];
        for (i, (old, new)) in last.iter().zip(&now).enumerate() {
            if old.offset != new.offset {
                changed[i] = true;
                ms.mapping_changes += 1;
                // From the earliest guest tick the new mapping can have started at.
                let start = old.after.wrapping_add_signed(new.offset);
                let seg = exact_segment(st.vcpus[base + i].vcpu, st.round, start, *new);
                exact_list(&mut st.vcpus[base + i], mode).push(seg);
                st.round += 1;
            }
        }
        for r in &pending {
            if r.is_beacon() {
                ms.beacons += 1;
                cur.beacons += 1;
                if let Some(b) = &mut beacons {
                    b.record(r);
                }
                continue;
            }
            if mode == Mode::Beacons {
                // Placed when the recording ends, with the beacons on both sides of it.
                if opts.events.is_some_and(|n| st.events >= n) {
                    ms.past_limit += 1;
                    continue;
                }
                // Spooled: its host time is given when the recording ends.
                out.push(&exact_placed(r, boot, 0, 0), &opts.out)?;
                st.events += 1;
                continue;
            }
            if opts.events.is_some_and(|n| st.events >= n) {
                ms.past_limit += 1;
                continue;
            }
            let i = r.vcpu as usize;
            let (host, round) = if changed.get(i).copied().unwrap_or(false) {
                match across_change(r.tsc, last[i], now[i]) {
                    Some(Side::Old(h)) => (h, st.round - 2),
                    Some(Side::New(h)) => (h, st.round - 1),
                    None => {
                        ms.ambiguous += 1;
                        continue;
                    }
                }
            } else {
                let Some(p) = exact_at(&st.vcpus[base + i].segments, r.tsc) else {
                    st.unplaceable += 1;
                    continue;
                };
                p
            };
            out.push(&exact_placed(r, boot, host, round), &opts.out)?;
            st.widths.push(0);
            st.events += 1;
        }
        if let Some(b) = &mut beacons {
            let counts = drainer.counts().to_vec();
            let rounds = b.round(&counts, before, after);
            use_samples(
                b,
                &mut st,
                &mut out,
                &target,
                mode,
                rounds,
                &[&now, &last],
                base,
            )?;
        }
        last = now;
        if !pending.is_empty() {
            // The round's records are placed and written: its end counts in the rate.
            let end = Instant::now();
            active = Some((active.map_or(round_start, |(first, _)| first), end));
            ms.active_rounds += 1;
            ms.records += pending.len() as u64;
        }
        if last_clock.elapsed() >= Duration::from_secs(1) {
            last_clock = Instant::now();
            st.clocks.extend(ClockSnapshot::take().ok());
        }
        progress.status(&format!(
            "vmtsync record: {} events from guest memory, {} lost",
            st.events,
            drainer
                .counts()
                .iter()
                .map(|c| c.overwritten + c.corrupt)
                .sum::<u64>()
        ));
        if opts.events.is_some_and(|n| st.events >= n) {
            break Ok(EndReason::Events);
        }
        if !summary.more && stop_heads.is_none() {
            // Idle: wait for the guest, but see a stop or the end of the duration at once.
            let wake = Instant::now() + opts.poll;
            while ended().is_none() {
                let left = wake.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(10)));
            }
        }
    };
    // The beacons read last wait for a count past them: one more read of the rings, unless
    // the VMM is gone, brackets them (its events are past the end and not written).
    if let (Ok(end), Some(b)) = (&result, &mut beacons)
        && *end != EndReason::VmmExited
        && b.waiting() > 0
    {
        std::thread::sleep(opts.poll.max(Duration::from_millis(10)));
        let beacons_before = ms.beacons;
        let before = read_host_tsc().0;
        let (past, read) = (&mut ms.past_limit, &mut ms.beacons);
        let polled = drainer.poll(&mut mem, &mut |r| {
            if r.is_beacon() {
                *read += 1;
                b.record(r);
            } else {
                *past += 1;
            }
        });
        let after = read_host_tsc().0;
        cur.beacons += ms.beacons - beacons_before;
        if polled.is_ok() {
            let counts = drainer.counts().to_vec();
            let rounds = b.round(&counts, before, after);
            let now = read_all(rings).unwrap_or_default();
            use_samples(
                b,
                &mut st,
                &mut out,
                &target,
                mode,
                rounds,
                &[&now, &last],
                base,
            )?;
        }
    }
    progress.clear();
    ms.drain = active.map_or(Duration::ZERO, |(first, last)| last - first);
    ms.elapsed = started.elapsed();
    cur.add(drainer.counts());
    ms.boots.push(cur);
    for c in &ms.boots {
        ms.overwritten += c.overwritten;
        ms.refused += c.refused;
        ms.corrupt += c.corrupt;
    }
    if let Some(b) = &beacons {
        ms.beacon_stats = b.stats.clone();
        ms.beacon_stats.unbracketed += b.waiting() as u64;
    }
    // A raw-TSC guest whose beacons disagree with KVM's mapping does not record the raw TSC:
    // the mapping gives no point then, the beacons do.
    let exact_points = use_mapping && ms.beacon_stats.disagree == 0;
    if !exact_points {
        for v in &mut st.vcpus {
            v.exact.clear();
        }
    }
    if mode == Mode::Beacons {
        st.final_widths(&mut out);
        if ms.beacon_stats.bracketed == 0 && st.unplaceable > 0 {
            eprintln!(
                "vmtsync: warning: no beacon was bracketed, so no event could be placed: beacon \
                 mode needs the guest to emit beacons while the reader runs (the first two after \
                 its first read are not used){}",
                if raw {
                    "; --trust-raw-tsc places raw-TSC records by KVM's mapping alone"
                } else {
                    ""
                }
            );
        }
    }
    ms.unverified = st.unverified;
    if let Some(path) = &opts.sync_out {
        write_sync_out(path, &target.source, &st)?;
    }
    let written = finish(out, &target, &st);
    let end = result?;
    let (preconverted, clamped) = written?;
    // Events were read but none could be placed: an empty output is no success.
    let unplaced = st.unplaceable + ms.ambiguous;
    if st.events == 0 && unplaced > 0 {
        return Err(RecordError::Unplaced {
            read: unplaced,
            out: opts.out.clone(),
            why: if raw {
                "no beacon was bracketed and KVM's mapping could not be used".into()
            } else {
                "the header says its records do not hold the raw TSC, so only bracketed \
                 beacons can place them, and none was (attach before the guest emits its \
                 beacons, or keep it emitting them while the reader runs)"
                    .into()
            },
        });
    }
    Ok((
        RecordSummary {
            events: st.events,
            dropped: ms.refused,
            overwritten: ms.overwritten,
            segments: st.segments(),
            breaks: match mode {
                Mode::Exact => st.segments(),
                Mode::Beacons => st.breaks,
            },
            widths: st.widths.summary(),
            host_stamped_skipped: 0,
            unplaceable: st.unplaceable + ms.ambiguous,
            lost: ms.corrupt,
            replayed: 0,
            failed_drains: 0,
            preconverted,
            clamped,
            end,
            vcpu: 0,
            vcpus: vcpus.clone(),
            trace_id: if opts.format == RecordFormat::TraceCmd {
                trace_id(&target, &st)
            } else {
                0
            },
            out: opts.out.clone(),
            console_bytes: 0,
            console: None,
            host_time: match (mode, raw) {
                (Mode::Exact, _) => HostTime::ExactDebugfs,
                (Mode::Beacons, true) if exact_points && st.unverified == st.events => {
                    HostTime::ExactUnverified
                }
                (Mode::Beacons, true) if exact_points => HostTime::BeaconsExactPoints,
                (Mode::Beacons, _) => HostTime::Beacons,
            },
        },
        ms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_segment_places_every_tick_with_width_zero() {
        let r = Reading {
            offset: -1_000_000,
            before: 5_000_000,
            after: 5_000_100,
        };
        let seg = exact_segment(0, 0, 0, r);
        let p = bounds::place(&[seg], 7_000_000, Placement::TwoSided).unwrap();
        assert_eq!((p.host, p.lo, p.hi), (8_000_000, 8_000_000, 8_000_000));
    }

    #[test]
    fn exact_placement_is_bounds_place_of_the_width_zero_segments() {
        let segs = [
            exact_segment(
                0,
                0,
                0,
                Reading {
                    offset: -1_000_000,
                    before: 5_000_000,
                    after: 5_000_100,
                },
            ),
            exact_segment(
                0,
                1,
                9_000_000,
                Reading {
                    offset: 250,
                    before: 9_000_000,
                    after: 9_000_100,
                },
            ),
        ];
        for g in [
            0,
            1,
            999_999,
            1_000_000,
            8_999_999,
            9_000_000,
            9_000_249,
            9_000_250,
            u64::MAX,
        ] {
            let want = bounds::place(&segs, g, Placement::OneSided).map(|p| (p.host, p.round));
            assert_eq!(exact_at(&segs, g), want, "guest {g}");
        }
    }

    #[test]
    fn a_vcpu_without_beacon_segments_is_placed_by_kvms_mapping_only_when_known() {
        let r = Reading {
            offset: -1_000,
            before: 5_000,
            after: 5_100,
        };
        let mut st = State::new(&[0, 1], None, Placement::TwoSided);
        // vCPU 0: KVM's mapping known, no beacon bracketed; vCPU 1: neither.
        st.vcpus[0].exact.push(exact_segment(0, 0, 0, r));
        assert_eq!(st.place(0, 7_000), Some((8_000, 8_000, 8_000)));
        assert_eq!(st.place(1, 7_000), None);
        // Once a beacon segment exists its interval rules, the mapping gives only the point.
        let mut wide = exact_segment(0, 1, 0, r);
        wide.offset_lo = r.offset - 50;
        wide.offset_hi = r.offset + 50;
        st.vcpus[0].segments.push(wide);
        let (host, lo, hi) = st.place(0, 7_000).unwrap();
        assert_eq!(host, 8_000);
        assert!(lo < host && host < hi, "{lo} {host} {hi}");
    }

    #[test]
    fn a_record_read_across_a_mapping_change_goes_to_the_one_mapping_it_fits() {
        // Read at host 1000..1010 with offset 0, then at 2000..2010 with offset 500 000 (the
        // guest TSC jumped forward between the two readings).
        let old = Reading {
            offset: 0,
            before: 1000,
            after: 1010,
        };
        let new = Reading {
            offset: 500_000,
            before: 2000,
            after: 2010,
        };
        // Guest 1500: old host 1500 (before 2000: fits), new host below 0: only old.
        assert_eq!(across_change(1500, old, new), Some(Side::Old(1500)));
        // Guest 501 500: old host 501 500 is after the second reading, so it was written
        // after the change: new host 1500.
        assert_eq!(across_change(501_500, old, new), Some(Side::New(1500)));
        // A guest jump backwards makes ticks that fit both: ambiguous, never guessed.
        let back = Reading {
            offset: -500,
            ..new
        };
        // Guest 1200: old host 1200 <= 2000 fits; new host 1700 >= 1010 fits.
        assert_eq!(across_change(1200, old, back), None);
        // Guest 2500 under offset 500 000 would be below host 0: it fits only the new
        // mapping (offset 0, read after host 2010).
        let later = Reading {
            offset: 0,
            before: 3000,
            after: 3010,
        };
        assert_eq!(across_change(2500, new, later), Some(Side::New(2500)));
    }
}
