//! KVM's own mapping of each vCPU, read from debugfs, and the records it places: exact
//! (width 0) segments, and the one mapping a record read across a change belongs to.

use crate::kvm::debugfs::{VcpuDir, VcpuState, VmDir};
use crate::record::error::MemoryError;
use crate::syncfile::{AnchorKind, OffsetModel, SyncSegment};

/// One vCPU's mapping as debugfs said it, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Reading {
    pub(super) offset: i64,
    /// Host TSC before and after the read.
    pub(super) before: u64,
    pub(super) after: u64,
}

pub(super) fn reading(v: &VcpuState) -> Result<Reading, MemoryError> {
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
pub(super) enum Side {
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
pub(super) fn across_change(tsc: u64, old: Reading, new: Reading) -> Option<Side> {
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
/// before it, else the first) and that segment's round, as `sync::place` would give with no
/// arithmetic beyond the subtraction; `None` outside the host's range.
pub(super) fn exact_at(segments: &[SyncSegment], g: u64) -> Option<(u64, u64)> {
    let s = crate::sync::covering(segments, g)?;
    Some((g.checked_add_signed(s.offset.checked_neg()?)?, s.round))
}

/// The width-0 segment of mapping `r` from guest tick `guest_start` on.
pub(super) fn exact_segment(vcpu: u32, round: u64, guest_start: u64, r: Reading) -> SyncSegment {
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

/// KVM's mapping of vCPUs `0..n` of a VM (one per ring of the current boot), read round
/// after round from their debugfs directories, held open (`perf` of a recording at 1 M
/// events/s put opening the VM's directory and walking to each file at about a fifth of its
/// reading thread).
#[derive(Debug)]
pub(super) struct Mappings(Vec<VcpuDir>);

impl Mappings {
    /// Opens vCPUs `0..n` of the VM `vm`.
    pub(super) fn open(vm: &VmDir, n: u32) -> Result<Self, MemoryError> {
        let dirs = (0..n)
            .map(|v| VcpuDir::open(&vm.path.join(format!("vcpu{v}")), v))
            .collect::<Result<_, _>>()?;
        Ok(Self(dirs))
    }

    /// Each vCPU's mapping now (`VcpuDir::read_mapping`: only its mapping's files).
    pub(super) fn read(&self) -> Result<Vec<Reading>, MemoryError> {
        self.0.iter().map(|d| reading(&d.read_mapping()?)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::place::State;
    use crate::sync::{self, Placement};

    #[test]
    fn an_exact_segment_places_every_tick_with_width_zero() {
        let r = Reading {
            offset: -1_000_000,
            before: 5_000_000,
            after: 5_000_100,
        };
        let seg = exact_segment(0, 0, 0, r);
        let p = sync::place(&[seg], 7_000_000, Placement::TwoSided).unwrap();
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
            let want = sync::place(&segs, g, Placement::OneSided).map(|p| (p.host, p.round));
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
