//! Speed goals of the host shim, measured on generated trees (no wall-clock asserts in tests):
//! - a full `vmtsync kvm --json` scan of 1000 VMs x 4 vCPUs in at most 100 ms;
//! - `vmtsync convert` streaming fast enough never to be a pipe's bottleneck.

use std::fs;
use std::hint::black_box;
use std::path::{Path, PathBuf};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use vmtsync::exact_convert::{ConvertOptions, Direction, Rounding, convert_stream};
use vmtsync::kvm::debugfs::KvmDebugfs;
use vmtsync::kvm::procinfo::ProcFs;
use vmtsync::kvm::scan::Scanner;
use vmtsync_core::mapping::KvmTscMapping;

/// Writes a KVM debugfs tree like an Intel host with TSC scaling: `vms` VMs of `vcpus` vCPUs,
/// five files each, plus the per-VM statistics files a real tree has at the top level.
fn write_tree(root: &Path, vms: u32, vcpus: u32) {
    fs::create_dir_all(root).unwrap();
    for stat in ["exits", "halt_exits", "blocking", "pages_4k"] {
        fs::write(root.join(stat), "0\n").unwrap();
    }
    for vm in 0..vms {
        for c in 0..vcpus {
            let d = root.join(format!("{}-{}/vcpu{c}", 10_000 + vm, 10 + vm % 7));
            fs::create_dir_all(&d).unwrap();
            fs::write(
                d.join("tsc-offset"),
                format!("-{}\n", 1_000_000_007 * u64::from(vm + 1)),
            )
            .unwrap();
            fs::write(d.join("tsc-scaling-ratio"), "281474976710656\n").unwrap();
            fs::write(d.join("tsc-scaling-ratio-frac-bits"), "48\n").unwrap();
            fs::write(d.join("guest_mode"), "0\n").unwrap();
            fs::write(d.join("pid"), format!("{}\n", 20_000 + vm * 8 + c)).unwrap();
        }
    }
}

fn temp_tree() -> PathBuf {
    let root = std::env::temp_dir().join(format!("vmtsync-bench-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    write_tree(&root.join("kvm"), 1000, 4);
    root
}

fn bench_scan(c: &mut Criterion) {
    let root = temp_tree();
    let scanner = Scanner {
        debugfs: KvmDebugfs::open(root.join("kvm")).unwrap(),
        // A proc root without these PIDs: names are looked up and not found, as for VMs of
        // exited processes; the real /proc would add one small read per VM.
        proc: ProcFs::new(root.join("proc")),
    };
    let report = scanner.scan(None).unwrap();
    assert_eq!(report.vms.len(), 1000);
    assert!(report.vms.iter().all(|v| v.vcpus.len() == 4));
    let mut g = c.benchmark_group("kvm_scan");
    g.sample_size(20);
    g.bench_function("scan_json_1000vms_x4", |b| {
        let mut out = Vec::with_capacity(2 << 20);
        b.iter(|| {
            out.clear();
            let r = scanner.scan(None).unwrap();
            serde_json::to_writer(&mut out, &r).unwrap();
            black_box(out.len())
        });
    });
    g.finish();
    let _ = fs::remove_dir_all(&root);
}

fn bench_convert(c: &mut Criterion) {
    let lines = 100_000u64;
    let mut input = Vec::new();
    for i in 0..lines {
        input.extend_from_slice(format!("{}\n", 1_000_000_000_000 + i * 7919).as_bytes());
    }
    let mut g = c.benchmark_group("convert");
    g.throughput(Throughput::Elements(lines));
    for (name, m) in [
        ("offset_only", KvmTscMapping::offset_only(-123_456_789)),
        (
            "intel_scaled",
            KvmTscMapping::try_new(-123_456_789, 351_843_720_888_320, 48).unwrap(),
        ),
    ] {
        let o = ConvertOptions {
            mapping: m,
            to: Direction::Host,
            rounding: Rounding::Ceil,
            skip_bad: false,
        };
        g.bench_function(name, |b| {
            let mut out = Vec::with_capacity(input.len() * 2);
            b.iter(|| {
                out.clear();
                let s =
                    convert_stream(&mut &input[..], &mut out, &mut std::io::sink(), &o).unwrap();
                black_box(s.converted)
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_scan, bench_convert);
criterion_main!(benches);
