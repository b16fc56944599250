//! The `vmtsync convert` and `vmtsync tsc compose` command lines against vmtsync-core's
//! mapping math, over seeded random values (the seed is printed on failure), plus the CLI
//! contract: help on every command, exit codes, broken pipe.

use std::io::Write;
use std::process::Stdio;

use serde_json::Value;
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::sim::SplitMix64;
use vmtsync_core::{GuestTicks, HostTicks};

use crate::util::{run, vmtsync};

/// A random mapping like KVM's: Intel or AMD frac bits, a ratio within ±50% of identity (or
/// exactly identity), any offset.
fn random_mapping(rng: &mut SplitMix64) -> KvmTscMapping {
    let frac = if rng.below(2) == 0 { 48 } else { 32 };
    let one = 1u64 << frac;
    let ratio = match rng.below(3) {
        0 => one,
        _ => one / 2 + rng.below(one),
    };
    let offset = rng.next_u64().cast_signed() >> rng.below(64);
    KvmTscMapping::try_new(offset, ratio, frac).unwrap()
}

#[test]
fn convert_matches_core_over_random_values() {
    for seed in 1..=12u64 {
        let mut rng = SplitMix64::new(seed);
        let m = random_mapping(&mut rng);
        let to_guest = seed % 3 == 0;
        let floor = seed % 4 == 1;
        let mut input = String::new();
        let mut expect = String::new();
        for _ in 0..2000 {
            // Realistic TSC values (up to ~2^50) and, sometimes, anything.
            let v = if rng.below(8) == 0 {
                rng.next_u64()
            } else {
                rng.next_u64() >> 14
            };
            let r = if to_guest {
                m.try_guest_from_host(HostTicks(v)).map(|g| g.0)
            } else if floor {
                m.try_host_from_guest_floor(GuestTicks(v)).map(|h| h.0)
            } else {
                m.try_host_from_guest_ceil(GuestTicks(v)).map(|h| h.0)
            };
            // Values without a 64-bit result are skipped by --skip-bad; tested separately.
            if let Some(r) = r {
                input.push_str(&format!("{v}\n"));
                expect.push_str(&format!("{r}\n"));
            }
        }
        let (o, r, f) = (
            m.offset().to_string(),
            m.ratio().to_string(),
            m.frac_bits().to_string(),
        );
        let mut args = vec!["convert", "--offset", &o, "--ratio", &r, "--frac-bits", &f];
        if to_guest {
            args.extend(["--to", "guest"]);
        }
        if floor {
            args.extend(["--round", "floor"]);
        }
        let out = run(&args, input.as_bytes());
        assert!(
            out.status.success(),
            "seed {seed}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout) == expect,
            "seed {seed}: {m:?} to_guest={to_guest} floor={floor}: output differs from vmtsync-core"
        );
    }
}

#[test]
fn convert_reports_bad_lines_by_number() {
    let out = run(&["convert", "--offset", "-100"], b"100\n200\nabc\n300\n");
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200\n300\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "vmtsync: line 3: expected one decimal TSC value (0..=18446744073709551615), found \"abc\" (use --skip-bad to skip such lines)\n"
    );
    let out = run(
        &["convert", "--offset", "-100", "--skip-bad"],
        b"100\n-5\n\n300",
    );
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200\n400\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("skipped line 2: ") && err.contains("skipped line 3: "),
        "{err}"
    );
    assert!(
        err.ends_with("vmtsync: converted 2 values, skipped 2 bad lines\n"),
        "{err}"
    );
    // Half-rate guest: guest values above 2^63 have no 64-bit host tick.
    let out = run(
        &[
            "convert",
            "--offset",
            "0",
            "--ratio",
            "1",
            "--frac-bits",
            "1",
        ],
        b"7\n18446744073709551615\n",
    );
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "14\n");
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with(
            "vmtsync: line 2: 18446744073709551615 is outside the range of this mapping"
        )
    );
}

#[test]
fn convert_exits_zero_on_broken_pipe() {
    let mut guard = vmtsync_tests::ChildGuard::new(
        vmtsync()
            .args(["convert", "--offset", "5"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let child = guard.child();
    // Close the reading end first; the output buffer's first flush then hits EPIPE.
    drop(child.stdout.take());
    let mut stdin = child.stdin.take().unwrap();
    let line = b"123456789\n".repeat(10_000);
    for _ in 0..100 {
        if stdin.write_all(&line).is_err() {
            break;
        }
    }
    drop(stdin);
    let mut err = String::new();
    use std::io::Read;
    guard
        .child()
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = guard.child().wait().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(err, "");
}

#[test]
fn compose_matches_kernel_formula_and_sequential_application() {
    let mut checked = 0u32;
    for seed in 1..=200u64 {
        let mut rng = SplitMix64::new(seed ^ 0xd1b5_4a32_d192_ed03);
        let l1 = random_mapping(&mut rng);
        let l2 = KvmTscMapping::try_new(
            rng.next_u64().cast_signed() >> rng.below(64),
            if rng.below(3) == 0 {
                1 << l1.frac_bits()
            } else {
                (1 << l1.frac_bits()) / 2 + rng.below(1 << l1.frac_bits())
            },
            l1.frac_bits(),
        )
        .unwrap();
        let arg = |m: &KvmTscMapping| format!("{},{},{}", m.offset(), m.ratio(), m.frac_bits());
        let out = run(
            &[
                "tsc",
                "compose",
                "--l1",
                &arg(&l1),
                "--l2",
                &arg(&l2),
                "--json",
            ],
            b"",
        );
        assert!(
            out.status.success(),
            "seed {seed}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let c = KvmTscMapping::try_new(
            v["tsc_offset"].as_i64().unwrap(),
            v["tsc_scaling_ratio"].as_u64().unwrap(),
            u32::try_from(v["tsc_frac_bits"].as_u64().unwrap()).unwrap(),
        )
        .unwrap();
        assert_eq!(v["schema"], 1);
        assert_eq!(
            Some(c),
            KvmTscMapping::try_compose_nested(&l1, &l2),
            "seed {seed}"
        );
        // Against applying the two mappings in sequence: equal for identity ratios, within the
        // documented bound otherwise (KVM's composed ratio is floored).
        for _ in 0..50 {
            let h = rng.next_u64() >> 16;
            let Some(g1) = l1.try_guest_from_host(HostTicks(h)) else {
                continue;
            };
            // The bound assumes the L1 tick offset_01 + F_01(h) does not wrap as an integer.
            let f01 = (u128::from(h) * u128::from(l1.ratio())) >> l1.frac_bits();
            let l1_tick = i128::from(l1.offset()) + i128::try_from(f01).unwrap();
            if !(0..1i128 << 64).contains(&l1_tick) {
                continue;
            }
            let Some(seq) = l2.try_guest_from_host(HostTicks(g1.0)) else {
                continue;
            };
            let Some(comp) = c.try_guest_from_host(HostTicks(h)) else {
                continue;
            };
            let diff = seq.0.wrapping_sub(comp.0).cast_signed();
            checked += 1;
            if l1.is_identity_ratio() && l2.is_identity_ratio() {
                assert_eq!(diff, 0, "seed {seed} h {h}");
            } else {
                let b = KvmTscMapping::try_nested_deviation_bound(&l2, HostTicks(h)).unwrap();
                assert!(
                    -i128::from(b.below) <= i128::from(diff)
                        && i128::from(diff) <= i128::from(b.above),
                    "seed {seed} h {h}: sequential - composed = {diff}, bound {b:?}"
                );
            }
        }
    }
    assert!(
        checked > 2000,
        "only {checked} of 10000 samples were in the bound's domain"
    );
    let out = run(
        &[
            "tsc",
            "compose",
            "--l1",
            "-5,281474976710657,48",
            "--l2",
            "1,4294967297,32",
        ],
        b"",
    );
    assert_eq!(out.status.code(), Some(5));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .starts_with("vmtsync: cannot compose: frac bits differ (48 vs 32)")
    );
    let out = run(&["tsc", "compose", "--l1", "-5,1,0", "--l2", "7,1,0"], b"");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "L0->L2: tsc_offset 2 tsc_scaling_ratio 1 tsc_frac_bits 0\n"
    );
    // A no-scaling reading (ratio 1, frac 0, what `kvm` prints without TSC scaling) composes
    // with a scaled one: it is rewritten to the other side's fraction bits.
    let out = run(
        &[
            "tsc",
            "compose",
            "--l1",
            "-1000,1,0",
            "--l2",
            "5,422212465065984,48",
        ],
        b"",
    );
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
        ),
        (
            Some(0),
            "L0->L2: tsc_offset -1495 tsc_scaling_ratio 422212465065984 tsc_frac_bits 48\n"
                .to_owned()
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_command_has_help_and_usage_errors_exit_2() {
    for cmd in [
        &["--help"][..],
        &["kvm", "--help"],
        &["convert", "--help"],
        &["tsc", "--help"],
        &["tsc", "compose", "--help"],
    ] {
        let out = run(cmd, b"");
        assert!(out.status.success(), "{cmd:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Usage: vmtsync"), "{cmd:?}: {text}");
    }
    let help = String::from_utf8_lossy(&run(&["kvm", "--help"], b"").stdout).into_owned();
    for flag in [
        "--debugfs-root",
        "--vm",
        "--json",
        "--watch",
        "--interval",
        "--trace-events",
        "--mount-debugfs",
        "Exit codes:",
    ] {
        assert!(help.contains(flag), "kvm --help lacks {flag}");
    }
    assert!(
        !help.contains("--proc-root"),
        "--proc-root is a hidden test flag"
    );
    let out = run(&["convert"], b"");
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["kvm", "--interval", "5"], b"");
    assert_eq!(out.status.code(), Some(2));
}
