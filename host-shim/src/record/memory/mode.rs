//! How a memory recording places its events: exact mode (KVM's mapping on the header's
//! word) or beacon mode (the guest's beacons bracketed by the host's `kvm_pio` exits), the
//! beacons' trace, and the segments their samples make.

use std::path::Path;

use vmtsync_core::estimate::ProbeSample;

use super::mapping::Reading;
use crate::exits::PioTrace;
use crate::kvm::debugfs::VmDir;
use crate::kvm::procinfo::ProcFs;
use crate::probe::ProbeError;
use crate::record::RecordError;
use crate::record::beacons::Beacons;
use crate::record::error::{MemoryError, Unplaceable};
use crate::record::place::{State, VcpuSync};
use crate::sync::Round;
use crate::syncfile::{AnchorKind, SyncHeader, SyncSegment, SyncWriter};

/// Where a memory recording's intervals come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// `--trust-raw-tsc`: KVM's exact mapping, width 0, on the header's word.
    Exact,
    /// The beacons' kvm_pio brackets (a raw-TSC guest's points still come from the mapping).
    Beacons,
}

/// The mode for a header that says `raw` (clock 0) and names beacon port `port`, or why it
/// cannot be recorded.
pub(super) fn mode_for(raw: bool, port: u16, trust: bool) -> Result<Mode, Unplaceable> {
    match (raw, port, trust) {
        (true, _, true) => Ok(Mode::Exact),
        (false, _, true) => Err(Unplaceable::TrustNotRaw),
        (_, 0, false) if raw => Err(Unplaceable::RawUnchecked),
        (_, 0, false) => Err(Unplaceable::NoClock),
        _ => Ok(Mode::Beacons),
    }
}

/// Where a vCPU's debugfs mappings go: its segments (exact mode) or its exact points.
pub(super) fn exact_list(v: &mut VcpuSync, mode: Mode) -> &mut Vec<SyncSegment> {
    match mode {
        Mode::Exact => &mut v.segments,
        Mode::Beacons => &mut v.exact,
    }
}

/// Starts the kvm_pio trace of beacon port `port` on every thread of the VMM (a beacon's
/// exits are its vCPU thread's, and every one of them must be traced for a bracket to hold,
/// whichever ring a vCPU writes), or why not. `None` without a beacon port.
pub(super) fn start_beacons(
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
pub(super) fn start_trace(
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
pub(super) fn use_samples(
    b: &mut Beacons,
    st: &mut State,
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
        }
    }
    Ok(())
}

/// One ring's beacon samples of a drain round become a segment of its vCPU, as a probe
/// round's samples do (the same estimators and bounds).
fn beacon_round(st: &mut State, i: usize, samples: &[ProbeSample]) -> Result<(), RecordError> {
    let r = match Round::from_samples(samples) {
        Ok(r) => r,
        Err(e) => {
            st.refused = Some(e);
            return Ok(());
        }
    };
    let round = st.round;
    st.round += 1;
    let v = &mut st.vcpus[i];
    let seg = v
        .cumulative
        .add_round(&r, samples, round, AnchorKind::KvmPioBeacon)
        .map_err(ProbeError::from)?;
    st.breaks += u64::from(seg.is_break);
    v.segments.push(seg);
    Ok(())
}

/// `--sync-out` of a memory recording: every vCPU's segments that placed its events, in
/// order: the beacons' (beacon mode), else KVM's mappings (exact mode, or a vCPU no bracketed
/// beacon covers). Written when the recording ends, since beacon segments are final only then.
pub(super) fn write_sync_out(path: &Path, source: &str, st: &State) -> Result<(), RecordError> {
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
