//! trace-cmd's two PTP offset estimators, ported faithfully so ours can be compared with them
//! on the same samples (trace-cmd 3.4 `lib/trace-cmd/trace-timesync-ptp.c`).
//!
//! Roles are swapped relative to trace-cmd. There the **guest** drives the round trip (its
//! `'s'`/`'r'` markers bracket the host's `'r'` marker) and the offset is `host - guest_mid`,
//! applied as `host ≈ guest + offset`. Here the **host** drives the round trip, so the same
//! formula reads `guest - host_mid`, which is already our sign convention (`guest - host`,
//! KVM's `tsc-offset`). Numerically: `ours = -(trace-cmd's)` for the same physical relation.
//!
//! Rounding is trace-cmd's: `ts = (s + r) / 2` in C `long long` truncates toward zero, which
//! for non-negative TSC values is a floor, so the offset `remote - floor(mid)` is the exact
//! midpoint offset rounded **up** by half a tick when `s + r` is odd.
//!
//! Deliberate differences, each because trace-cmd's behaviour there is an artefact of its
//! storage rather than of the estimator:
//! - `good_probe()` drops probes with a zero timestamp (zero marks a lost ftrace marker in its
//!   arrays). Our samples carry no such sentinel, so every sample is used.
//! - No samples → `EstimateError::NoSamples` instead of a silent offset 0.
//! - Histogram bin width 0 (spread of `|offset|` below 339 ticks, an integer division by zero
//!   in trace-cmd) → width 1, i.e. one bin per distinct `|offset|`; every index is then below
//!   339, so nothing is excluded and the modal rule is otherwise unchanged.
//! - `llabs(LLONG_MIN)` is undefined in C; here `|offset|` is an exact `u64`.

use super::sample::{EstimateError, ProbeSample, same_vcpu};
use crate::HostTicks;

/// trace-cmd's `PTP_SYNC_LOOP`: probes per PTP sample, and the number of histogram bins
/// (ptp.c:28).
pub const TRACE_CMD_PTP_SYNC_LOOP: usize = 339;

/// One trace-cmd PTP result: the chosen probe's offset and its midpoint timestamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct TraceCmdEstimate {
    /// `guest - floor((host_send + host_recv) / 2)` of the chosen probe (our sign).
    pub offset: i64,
    /// `floor((host_send + host_recv) / 2)` of the chosen probe, trace-cmd's `ts`.
    pub at: HostTicks,
}

/// trace-cmd's per-probe `(ts, offset)` (ptp.c:294-295), in our roles and sign.
fn probe_offset(s: &ProbeSample) -> Result<(u64, i64), EstimateError> {
    let sum = u128::from(s.host_send.0) + u128::from(s.host_recv.0);
    // The floor of the mean of two u64 values fits a u64.
    #[allow(clippy::cast_possible_truncation)]
    let mid = (sum / 2) as u64;
    let off = i128::from(s.guest.0) - i128::from(mid);
    let off = i64::try_from(off).map_err(|_| EstimateError::Overflow)?;
    Ok((mid, off))
}

/// trace-cmd's default `FASTEST_RESPONSE` estimator (ptp.c:272-320): the offset of the probe
/// with the smallest round-trip time; on ties the first such probe wins (`delta_min > delta`).
///
/// The RTT is `host_recv - host_send` as a signed value, exactly as trace-cmd subtracts its
/// markers, so a reversed sample is not rejected (it would simply win).
///
/// # Errors
/// `NoSamples` for an empty slice, `VcpuMismatch` for mixed vCPUs, `Overflow` if the chosen
/// probe's offset does not fit an `i64`.
pub fn trace_cmd_fastest(samples: &[ProbeSample]) -> Result<TraceCmdEstimate, EstimateError> {
    same_vcpu(samples)?;
    let mut best: Option<(i128, &ProbeSample)> = None;
    for s in samples {
        let delta = i128::from(s.host_recv.0) - i128::from(s.host_send.0);
        if best.is_none_or(|(min, _)| min > delta) {
            best = Some((delta, s));
        }
    }
    let (_, s) = best.ok_or(EstimateError::NoSamples)?;
    let (mid, offset) = probe_offset(s)?;
    Ok(TraceCmdEstimate {
        offset,
        at: HostTicks(mid),
    })
}

/// trace-cmd's histogram estimator (ptp.c:322-384), used when `FASTEST_RESPONSE` is off.
///
/// 339 bins of width `(max|offset| - min|offset|) / 339` (integer) over the **absolute**
/// offsets; each probe in turn increments its bin (a top-edge index of 339 is dropped, as in
/// trace-cmd), and the probe whose increment last raised the global maximum count is the
/// result: one member of the modal bin, not its centre. A width of 0 is taken as 1 (see the
/// module docs) instead of dividing by zero.
///
/// # Errors
/// `NoSamples`, `VcpuMismatch`, or `Overflow` if a probe's offset does not fit an `i64`.
pub fn trace_cmd_histogram(samples: &[ProbeSample]) -> Result<TraceCmdEstimate, EstimateError> {
    same_vcpu(samples)?;
    let mut min_abs = u64::MAX;
    let mut max_abs = 0_u64;
    for s in samples {
        let (_, off) = probe_offset(s)?;
        min_abs = min_abs.min(off.unsigned_abs());
        max_abs = max_abs.max(off.unsigned_abs());
    }
    // One sample at least exists (same_vcpu checked), so min_abs <= max_abs.
    let bins = TRACE_CMD_PTP_SYNC_LOOP as u64;
    let bin = ((max_abs - min_abs) / bins).max(1);
    let mut hist = [0_u32; TRACE_CMD_PTP_SYNC_LOOP];
    let mut max_count = 0_u32;
    let mut result = None;
    for s in samples {
        let (mid, off) = probe_offset(s)?;
        let ind = (off.unsigned_abs() - min_abs) / bin;
        let Ok(ind) = usize::try_from(ind) else {
            continue;
        };
        if let Some(count) = hist.get_mut(ind) {
            *count = count.saturating_add(1);
            if max_count < *count {
                max_count = *count;
                result = Some(TraceCmdEstimate {
                    offset: off,
                    at: HostTicks(mid),
                });
            }
        }
    }
    // The sample with the smallest |offset| always lands in bin 0, so a result exists.
    result.ok_or(EstimateError::NoSamples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec;

    /// Line-by-line transliteration of ptp.c:322-384 (arrays, `llabs`, the `ind < 339` test),
    /// with trace-cmd's markers mapped to our roles; `bin == 0` becomes 1 as documented.
    fn c_histogram(samples: &[ProbeSample]) -> (i64, i64) {
        let mut timestamps = Vec::new();
        let mut offsets = Vec::new();
        let (mut offset_min, mut offset_max) = (i128::from(i64::MAX), 0_i128);
        for s in samples {
            let ts = (i128::from(s.host_send.0) + i128::from(s.host_recv.0)) / 2;
            let off = i128::from(s.guest.0) - ts;
            offset_max = offset_max.max(off.abs());
            offset_min = offset_min.min(off.abs());
            timestamps.push(ts);
            offsets.push(off);
        }
        let mut bin = (offset_max - offset_min) / 339;
        if bin == 0 {
            bin = 1;
        }
        let mut hist = [0_i32; 339];
        let (mut max, mut ret) = (0, (0, 0));
        for (ts, off) in timestamps.iter().zip(&offsets) {
            let ind = (off.abs() - offset_min) / bin;
            if ind < 339 {
                let ind = usize::try_from(ind).unwrap();
                hist[ind] += 1;
                if max < hist[ind] {
                    max = hist[ind];
                    ret = (i64::try_from(*off).unwrap(), i64::try_from(*ts).unwrap());
                }
            }
        }
        ret
    }

    /// ptp.c:272-320 transliterated.
    fn c_fastest(samples: &[ProbeSample]) -> (i64, i64) {
        let mut delta_min = i128::MAX;
        let mut ret = (0, 0);
        for s in samples {
            let ts = (i128::from(s.host_send.0) + i128::from(s.host_recv.0)) / 2;
            let off = i128::from(s.guest.0) - ts;
            let delta = i128::from(s.host_recv.0) - i128::from(s.host_send.0);
            if delta_min > delta {
                delta_min = delta;
                ret = (i64::try_from(off).unwrap(), i64::try_from(ts).unwrap());
            }
        }
        ret
    }

    proptest! {
        #[test]
        fn ports_match_c_transliteration(
            base in 0_u64..1 << 50,
            probes in proptest::collection::vec((0_u64..1 << 20, 0_u64..1 << 14, 0_u64..1 << 14), 1..339),
            offset in -(1_i64 << 12)..(1_i64 << 12),
        ) {
            // Offsets near zero make |offset| fold both signs, as in the C code.
            let samples: Vec<ProbeSample> = probes
                .iter()
                .map(|&(start, fwd, back)| {
                    let send = base + start;
                    let g = i128::from(send + fwd) + i128::from(offset);
                    p(send, u64::try_from(g.max(0)).unwrap(), send + fwd + back)
                })
                .collect();
            let h = trace_cmd_histogram(&samples).unwrap();
            let want = c_histogram(&samples);
            prop_assert_eq!((h.offset, i64::try_from(h.at.0).unwrap()), want);
            let f = trace_cmd_fastest(&samples).unwrap();
            let want = c_fastest(&samples);
            prop_assert_eq!((f.offset, i64::try_from(f.at.0).unwrap()), want);
        }
    }

    fn p(send: u64, guest: u64, recv: u64) -> ProbeSample {
        crate::estimate::sample::test_sample(send, guest, recv, 3)
    }

    #[test]
    fn fastest_picks_min_rtt_first_on_ties_and_floors_mid() {
        let s = [
            p(100, 1_000, 200),
            p(300, 1_400, 311), // rtt 11, mid floor(305.5) = 305, offset 1095
            p(400, 1_500, 411), // same rtt: the first one wins
            p(500, 1_500, 530),
        ];
        assert_eq!(
            trace_cmd_fastest(&s),
            Ok(TraceCmdEstimate {
                offset: 1_095,
                at: HostTicks(305)
            })
        );
    }

    #[test]
    fn fastest_negative_offset_and_errors() {
        assert_eq!(
            trace_cmd_fastest(&[p(1_000, 10, 1_002)]).map(|e| e.offset),
            Ok(-991)
        );
        assert_eq!(trace_cmd_fastest(&[]), Err(EstimateError::NoSamples));
        let mut mixed = [p(1, 1, 2), p(3, 3, 4)];
        mixed[1].vcpu = 4;
        assert_eq!(trace_cmd_fastest(&mixed), Err(EstimateError::VcpuMismatch));
        assert_eq!(
            trace_cmd_fastest(&[p(u64::MAX, 0, u64::MAX)]),
            Err(EstimateError::Overflow)
        );
        // Reversed samples are accepted as trace-cmd does: negative RTT wins.
        assert_eq!(
            trace_cmd_fastest(&[p(0, 50, 100), p(60, 60, 40)]).map(|e| e.offset),
            Ok(10)
        );
    }

    #[test]
    fn histogram_identical_samples_do_not_divide_by_zero() {
        let s = [p(1_000, 5_000, 1_010); 64];
        assert_eq!(
            trace_cmd_histogram(&s),
            Ok(TraceCmdEstimate {
                offset: 3_995,
                at: HostTicks(1_005)
            })
        );
        // A spread below 339 ticks: bin width 1, each distinct |offset| its own bin.
        let s = [
            p(0, 10, 0),
            p(0, 20, 0),
            p(0, 20, 0),
            p(0, 30, 0),
            p(0, 30, 0),
            p(0, 30, 0),
        ];
        assert_eq!(trace_cmd_histogram(&s).map(|e| e.offset), Ok(30));
    }

    #[test]
    fn histogram_folds_sign_and_drops_top_edge() {
        // |offset| spread 0..=678 → bin width 2. Offsets ±100 share bin 50 (abs folding);
        // the last probe raising the maximum (the second -100) is the result.
        let s = [
            p(1_000, 1_000, 1_000), // offset 0, bin 0
            p(1_000, 1_100, 1_000), // +100, bin 50 (count 1; max already 1: no change)
            p(1_000, 900, 1_000),   // -100, bin 50 (count 2: new max)
            p(1_000, 1_678, 1_000), // +678, bin 339: dropped
            p(1_000, 1_678, 1_000), // dropped again, never becomes modal
            p(1_000, 1_678, 1_000),
        ];
        assert_eq!(trace_cmd_histogram(&s).map(|e| e.offset), Ok(-100));
    }

    #[test]
    fn histogram_errors() {
        assert_eq!(trace_cmd_histogram(&[]), Err(EstimateError::NoSamples));
        assert_eq!(
            trace_cmd_histogram(&[p(u64::MAX, 0, u64::MAX)]),
            Err(EstimateError::Overflow)
        );
    }
}
