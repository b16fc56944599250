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

//!
//! The steps, each a file: [`recording::Armed`] opens the VMM's memory and finds the header
//! (`recording.rs`), [`recording::Recording`] drains, places and writes round by round;
//! `mapping.rs` reads KVM's mapping and places by it, `mode.rs` chooses exact or beacon mode
//! and makes the beacons' segments, `pipe.rs` writes exact mode's rounds on a thread of their
//! own, `hold.rs` keeps beacon mode's records until the sync round after them, `vmm.rs` tells
//! a VMM's exit from a guest's restart.

mod hold;
mod mapping;
mod mode;
mod pipe;
mod recording;
mod vmm;

use std::path::PathBuf;
use std::time::Duration;

use super::beacons::BeaconStats;
use super::launch::Resume;
use super::{OutputOptions, RecordError, RecordSummary};
use crate::guestmem::{self, Location};
use crate::kvm::debugfs::VmDir;
use crate::probe::Progress;
use recording::{Armed, Recording};

/// Everything `vmtsync record --from-memory` needs.
#[derive(Clone, Debug)]
pub struct MemoryOptions {
    /// The VM's debugfs directory (its VMM's PID is the process whose memory is read).
    pub vm: VmDir,
    /// The proc tree (normally `/proc`).
    pub proc_root: PathBuf,
    /// Where the recorder's header is.
    pub location: Location,
    /// The output file and format, when to stop, `--sync-out`.
    pub output: OutputOptions,
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
    pub paused: Option<Resume>,
    /// `--tracefs` for the beacons' kvm_pio trace (default: the usual mount points).
    pub tracefs: Option<PathBuf>,
    /// How span records are named in the outputs that show spans.
    pub spans: crate::spans::SpanConfig,
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
    /// Exact mode: events placed in a round in which the vCPUs' mappings were not all one
    /// (before or after it). Their host times rest on the header's word that ring r holds
    /// vCPU r's records; every other event's host time is the same whichever vCPU wrote it.
    pub ring_claimed: u64,
    /// Drain rounds.
    pub polls: u64,
    /// The longest time from the start of one drain round to the end of the next one's
    /// reading (within one guest boot): no ring waited longer between two reads, so a flight
    /// ring that holds this long at its rate lost nothing to the reader's pace.
    pub longest_reread: Duration,
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
    /// Beacon mode: events placed before the sync round after them was known, because the
    /// records waiting for it reached their bound (their intervals rest on the rounds before
    /// them: wider, still guaranteed).
    pub early_placed: u64,
    /// Beacon mode: the most events that waited on disk at once for their vCPU's first sync
    /// round (the records waiting in memory had reached their bound).
    pub spilled: u64,
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
    pub(super) fn add(&mut self, counts: &[guestmem::RingCounts]) {
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

/// Records a guest by reading its recorder out of its VMM's memory (see the module docs).
///
/// # Errors
/// [`RecordError`]; events read before a failure are still written.
pub fn run_record_memory(
    opts: &MemoryOptions,
    progress: &mut Progress,
) -> Result<(RecordSummary, MemorySummary), RecordError> {
    let armed = Armed::arm(opts)?;
    let mut rec = Recording::start(opts, armed)?;
    let result = rec.drain(progress)?;
    rec.last_beacons(&result)?;
    progress.clear();
    rec.finish(result)
}
