//! Fixtures the check's tests share (and the CLI's tests of how its report is printed).

use super::report::ExitCheck;
use crate::syncfile::{AnchorKind, OffsetModel, SyncSegment};

/// Guest tick 3 converted by round 9's segment to host tick 4, guaranteed within `[5, 6]`,
/// against the exits `exit_lo` and `exit_hi`.
pub(crate) fn exit_check<X>(exit_lo: X, exit_hi: X, bound_false: bool) -> ExitCheck<X> {
    ExitCheck {
        guest_tsc: 3,
        host_tsc: 4,
        host_lo: 5,
        host_hi: 6,
        exit_lo,
        exit_hi,
        round: 9,
        bound_false,
    }
}

/// vCPU 0's round 0 anchored at host `anchor`: offset `offset` with guaranteed bounds `half`
/// either side, at identity rate and no drift, its fastest probe `rtt` ticks.
pub(super) fn segment_at(anchor: u64, offset: i64, half: i64, rtt: u64) -> SyncSegment {
    SyncSegment {
        vcpu: 0,
        round: 0,
        guest_start: 0,
        host_anchor: anchor,
        guest_anchor: anchor.checked_add_signed(offset).unwrap(),
        offset,
        offset_lo: offset - half,
        offset_hi: offset + half,
        drift_ppb: 0,
        drift_ppb_lo: Some(0),
        drift_ppb_hi: Some(0),
        model: OffsetModel::Drift,
        probes: 64,
        rtt_min_ticks: rtt,
        host_first: anchor,
        host_last: anchor,
        is_break: false,
        anchor: AnchorKind::KvmPioUart,
    }
}
