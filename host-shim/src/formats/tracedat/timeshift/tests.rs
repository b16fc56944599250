use proptest::prelude::*;

use super::*;

fn seg(start: u64, off: i64) -> SyncSegment {
    SyncSegment::offset_only(HostTicks(start), off)
}

/// The TIME_SHIFT the encoding tests write: CPU 0 with two segments, CPU 1 with one.
fn two_cpu_shift(mode: ShiftMode) -> TimeShift {
    TimeShift {
        peer_trace_id: 0x1122_3344_5566_7788,
        mode,
        cpus: vec![vec![seg(100, 5), seg(200, 6)], vec![seg(100, -1)]],
    }
}

fn plan(segs: &[SyncSegment], mode: ShiftMode, range: (u64, u64)) -> CpuPlan {
    plan_cpu(0, segs, mode, Some(range)).unwrap()
}

fn flags(mode: ShiftMode) -> u32 {
    match mode {
        ShiftMode::Step => 0,
        ShiftMode::Interpolate => TSYNC_FLAG_INTERPOLATE,
    }
}

#[test]
fn step_uses_the_last_segment_after_its_start_thanks_to_the_sentinel() {
    // Without the sentinel, trace-cmd would use the second-to-last offset after the last start.
    let segs = [seg(1_000, 50), seg(2_000, -70), seg(3_000, 10)];
    let p = plan(&segs, ShiftMode::Step, (0, 10_000));
    assert_eq!(p.samples.len(), 4);
    assert_eq!(p.samples[3].time, i64::MAX);
    assert_eq!(p.max_error, 0);
    for (g, want) in [(0, -50), (1_049, 999), (1_930, 2_000), (5_000, 4_990)] {
        let got = trace_cmd_host_time(&p.samples, 0, g).unwrap();
        assert_eq!(got.cast_signed(), want, "guest {g}");
        // KVM's offset addition is modular, and so is trace-cmd's: both wrap below 0 alike.
        assert_eq!(
            exact_host_time(&segs, ShiftMode::Step, g),
            Some(want.cast_unsigned())
        );
    }
}

#[test]
fn a_single_segment_is_a_constant_offset() {
    let segs = [seg(1_000, -7)];
    let p = plan(&segs, ShiftMode::Step, (900, 5_000));
    for g in [900, 993, 5_000] {
        assert_eq!(trace_cmd_host_time(&p.samples, 0, g), Some(g + 7));
    }
}

#[test]
fn unsorted_or_colliding_starts_are_refused() {
    // 2000 + 0 and 1500 + 500 land on the same guest tick.
    let segs = [seg(1_500, 500), seg(2_000, 0)];
    assert_eq!(
        plan_cpu(3, &segs, ShiftMode::Step, None),
        Err(TimeShiftError::NotIncreasing { cpu: 3, index: 1 })
    );
    let shift = TimeShift {
        peer_trace_id: 1,
        mode: ShiftMode::Step,
        cpus: vec![vec![seg(0, 0)]],
    };
    assert_eq!(
        encode(&shift, &[None, None], 1),
        Err(TimeShiftError::CpuCount { cpus: 2, got: 1 })
    );
}

#[test]
fn interpolate_refuses_scaled_segments() {
    let map = KvmTscMapping::try_new(0, (1 << 48) + 1, 48).unwrap();
    let segs = [
        seg(0, 0),
        SyncSegment {
            start: HostTicks(10),
            map,
        },
    ];
    assert_eq!(
        plan_cpu(0, &segs, ShiftMode::Interpolate, None),
        Err(TimeShiftError::InterpolateNeedsIdentity { cpu: 0, index: 1 })
    );
}

#[test]
fn encoding_has_trace_cmds_layout() {
    let shift = two_cpu_shift(ShiftMode::Interpolate);
    let (bytes, errs) = encode(&shift, &[Some((150, 300)), None], 1).unwrap();
    // 16 header + 4 per CPU + 32 per sample (time, offset, scaling, fraction).
    assert_eq!(bytes.len(), 16 + 4 * 2 + 32 * 3);
    assert_eq!(&bytes[..8], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&bytes[8..12], &1u32.to_le_bytes());
    assert_eq!(&bytes[12..16], &2u32.to_le_bytes());
    assert_eq!(&bytes[16..20], &2u32.to_le_bytes());
    // First time is 100 + 5, first offset -5.
    assert_eq!(&bytes[20..28], &105i64.to_le_bytes());
    assert_eq!(&bytes[36..44], &(-5i64).to_le_bytes());
    assert_eq!(errs, vec![1, 0]);
}

#[test]
fn ratio_1_0001_fits_one_tick_only_over_a_short_span() {
    // guest = host * 1.0001 (Intel 48 fraction bits), a host TSC of a freshly booted machine.
    let ratio = (1u64 << 48) + (1u64 << 48) / 10_000;
    let map = KvmTscMapping::try_new(-1_000_000, ratio, 48).unwrap();
    let s = SyncSegment {
        start: HostTicks(2_300_000_000_000),
        map,
    };
    let g0 = map.try_guest_from_host(s.start).unwrap().0;
    let short = plan(&[s], ShiftMode::Step, (g0, g0 + 1_000_000));
    assert!(short.max_error <= 1, "{}", short.max_error);
    let long = plan(&[s], ShiftMode::Step, (g0, g0 + 10_000_000_000));
    assert!(long.max_error > 1, "{}", long.max_error);
}

#[test]
fn timeline_segments_convert_when_trace_cmd_can_hold_them() {
    use vmtsync_core::timeline::{Segment, Slope};
    // An offset segment: guest 5000 is host 4000 → guest - host = 1000.
    let lin = Segment::try_offset(GuestTicks(5_000), -1_000).unwrap();
    let s = SyncSegment::try_from_timeline(&lin).unwrap();
    assert_eq!(s, SyncSegment::offset_only(HostTicks(4_000), 1_000));
    for g in [1_000, 5_000, 9_999_999] {
        assert_eq!(
            exact_host_time(&[s], ShiftMode::Step, g),
            lin.try_convert_floor(GuestTicks(g)).map(|h| h.0)
        );
    }
    // A KVM segment with an identity ratio keeps its mapping and start.
    let kvm = Segment::try_from_kvm(GuestTicks(7_000), 3_000, 1 << 48, 48).unwrap();
    let s = SyncSegment::try_from_timeline(&kvm).unwrap();
    assert_eq!(s.start, HostTicks(4_000));
    // A drifting slope has no exact TIME_SHIFT form.
    let drift = Segment::try_from_anchor(
        GuestTicks(0),
        GuestTicks(0),
        HostTicks(10),
        Slope::try_from_ppb_floor(1_000).unwrap(),
    )
    .unwrap();
    assert_eq!(SyncSegment::try_from_timeline(&drift), None);
}

fn check_bound(map: KvmTscMapping, lo: u64, len: u64, picks: &[u64]) {
    let hi = lo + len;
    let s = SyncSegment {
        start: map.try_host_from_guest_ceil(GuestTicks(lo)).unwrap(),
        map,
    };
    let Ok(p) = plan_cpu(0, &[s], ShiftMode::Step, Some((lo, hi))) else {
        return;
    };
    for &x in picks.iter().chain(&[0, len]) {
        let g = lo + x % (len + 1);
        let got = trace_cmd_host_time(&p.samples, 0, g).unwrap();
        let want = map.try_host_from_guest_ceil(GuestTicks(g)).unwrap().0;
        assert!(
            got.abs_diff(want) <= p.max_error,
            "g {g}: trace-cmd {got}, exact {want}, bound {}",
            p.max_error
        );
    }
}

/// Up to 8 offset-only segments at distinct guest starts, and 16 guest times to convert.
fn segments_and_times() -> impl Strategy<Value = (Vec<SyncSegment>, Vec<u64>)> {
    (
        proptest::collection::btree_set(1_000_000u64..1_000_000_000, 1..8),
        proptest::collection::vec(-100_000i64..100_000, 8),
        proptest::collection::vec(0u64..1_100_000_000, 16),
    )
        .prop_map(|(starts, offs, gs)| {
            let segs = starts.iter().zip(&offs).map(|(&s, &o)| seg(s, o)).collect();
            (segs, gs)
        })
}

proptest! {
    #[test]
    fn step_identity_is_exact(
        (segs, gs) in segments_and_times(),
    ) {
        let Ok(p) = plan_cpu(0, &segs, ShiftMode::Step, Some((0, 1_100_000_000))) else {
            // Colliding guest starts are refused; nothing to check.
            return Ok(());
        };
        for g in gs {
            let want = exact_host_time(&segs, ShiftMode::Step, g);
            let got = trace_cmd_host_time(&p.samples, flags(ShiftMode::Step), g);
            if let Some(w) = want {
                prop_assert_eq!(got, Some(w));
            }
        }
    }

    #[test]
    fn interpolate_is_within_its_bound_of_the_exact_line(
        (segs, gs) in segments_and_times(),
    ) {
        let range = (500_000, 1_100_000_000);
        let Ok(p) = plan_cpu(0, &segs, ShiftMode::Interpolate, Some(range)) else {
            return Ok(());
        };
        prop_assert!(p.max_error <= 1);
        for g in gs.into_iter().filter(|&g| g >= range.0) {
            let want = exact_host_time(&segs, ShiftMode::Interpolate, g).unwrap();
            let got = trace_cmd_host_time(&p.samples, flags(ShiftMode::Interpolate), g).unwrap();
            prop_assert!(got.abs_diff(want) <= p.max_error, "g {} got {} want {}", g, got, want);
        }
    }

    #[test]
    fn scaled_bound_contains_the_truth(
        ppm in -2_000i64..2_000,
        frac in prop_oneof![Just(32u32), Just(48u32)],
        offset in -1_000_000_000i64..1_000_000_000,
        lo in 1_000_000_000u64..5_000_000_000_000,
        len in 0u64..20_000_000,
        picks in proptest::collection::vec(any::<u64>(), 32),
    ) {
        let one = 1u64 << frac;
        let ratio = one.checked_add_signed(one.cast_signed() / 1_000_000 * ppm).unwrap();
        let map = KvmTscMapping::try_new(offset, ratio, frac).unwrap();
        check_bound(map, lo, len, &picks);
    }
}

#[test]
fn decode_reads_back_what_encode_wrote_and_refuses_damage() {
    let shift = two_cpu_shift(ShiftMode::Step);
    let (bytes, _) = encode(&shift, &[Some((150, 300)), Some((99, 500))], 1).unwrap();
    let d = decode(&bytes).unwrap();
    assert_eq!(d.peer_trace_id, 0x1122_3344_5566_7788);
    assert_eq!(d.flags, 0);
    let planned: Vec<Vec<TraceCmdSample>> = shift
        .cpus
        .iter()
        .map(|s| plan(s, ShiftMode::Step, (0, 1000)).samples)
        .collect();
    assert_eq!(d.cpus, planned);
    // The decoded samples convert as the segments do.
    assert_eq!(trace_cmd_host_time(&d.cpus[0], d.flags, 250), Some(244));
    // Every truncation is an error, never a panic.
    for n in 0..bytes.len() {
        assert!(decode(&bytes[..n]).is_err(), "{n} bytes");
    }
    // A count claiming more samples than the body holds is refused before allocating.
    let mut big = bytes.clone();
    big[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&big).unwrap_err().0, 16);
}
