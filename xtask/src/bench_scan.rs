//! `cargo xtask bench-scan [--vms N] [--vcpus N] [--runs N]`: the host shim's scan goal, as a
//! user sees it. Generates a KVM debugfs tree (default 1000 VMs × 4 vCPUs, five files per vCPU,
//! Intel-style scaling), runs the release `vmtsync kvm --json --debugfs-root TREE` several
//! times as a separate process, checks its output names every VM, and prints the median wall
//! time. The goal (issue: at most 100 ms for 1000 × 4) is judged by a human reading the
//! figure on a quiet machine, never asserted: these machines are shared and noisy.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::{cargo, sh};

struct Args {
    vms: u32,
    vcpus: u32,
    runs: usize,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        vms: 1000,
        vcpus: 4,
        runs: 31,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || -> Result<u64> {
            it.next()
                .with_context(|| format!("{flag} needs a number"))?
                .parse()
                .with_context(|| format!("{flag} needs a number"))
        };
        match flag.as_str() {
            "--vms" => a.vms = u32::try_from(value()?)?,
            "--vcpus" => a.vcpus = u32::try_from(value()?)?,
            "--runs" => a.runs = usize::try_from(value()?)?,
            other => bail!("bench-scan: unknown flag {other}"),
        }
    }
    Ok(a)
}

fn write_tree(root: &Path, vms: u32, vcpus: u32) -> Result<()> {
    std::fs::create_dir_all(root)?;
    for vm in 0..vms {
        for c in 0..vcpus {
            let d = root.join(format!("{}-{}/vcpu{c}", 10_000 + vm, 10 + vm % 7));
            std::fs::create_dir_all(&d)?;
            let offset = 1_000_000_007_u64 * u64::from(vm + 1);
            std::fs::write(d.join("tsc-offset"), format!("-{offset}\n"))?;
            std::fs::write(d.join("tsc-scaling-ratio"), "281474976710656\n")?;
            std::fs::write(d.join("tsc-scaling-ratio-frac-bits"), "48\n")?;
            std::fs::write(d.join("guest_mode"), "0\n")?;
            std::fs::write(d.join("pid"), format!("{}\n", 20_000 + vm * 8 + c))?;
        }
    }
    Ok(())
}

/// What one scan benchmark measured.
#[derive(Debug, Clone)]
pub(crate) struct Measured {
    /// Files in the generated tree.
    pub files: u64,
    /// Wall time of each timed run, sorted.
    pub times: Vec<Duration>,
}

/// Generates a tree of `vms` × `vcpus` in a temporary directory and times `runs` scans of it
/// by `bin` (`vmtsync`), after one untimed warm-up run.
pub(crate) fn measure(bin: &Path, vms: u32, vcpus: u32, runs: usize) -> Result<Measured> {
    ensure!(
        runs > 0 && vms > 0 && vcpus > 0,
        "bench-scan: counts must be positive"
    );
    let dir = std::env::temp_dir().join(format!("vmtsync-bench-scan-{}", std::process::id()));
    let tree = dir.join("kvm");
    let result = (|| {
        write_tree(&tree, vms, vcpus)?;
        let mut times = Vec::with_capacity(runs);
        // One untimed run warms the page cache, as every later scan of a live tree finds it.
        for i in 0..=runs {
            let t = Instant::now();
            let out = Command::new(bin)
                .args(["kvm", "--json", "--debugfs-root"])
                .arg(&tree)
                .stderr(Stdio::null())
                .output()
                .with_context(|| format!("running {}", bin.display()))?;
            let took = t.elapsed();
            ensure!(out.status.success(), "vmtsync kvm failed: {}", out.status);
            let text = String::from_utf8_lossy(&out.stdout);
            let found = text.matches("\"pid\":").count();
            ensure!(
                found == vms as usize,
                "scan reported {found} VMs, expected {vms}"
            );
            if i > 0 {
                times.push(took);
            }
        }
        times.sort();
        Ok::<_, anyhow::Error>(times)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Measured {
        files: u64::from(vms) * u64::from(vcpus) * 5,
        times: result?,
    })
}

pub(crate) fn bench_scan(args: &[String]) -> Result<()> {
    let a = parse(args)?;
    sh(cargo().args([
        "build",
        "--release",
        "-q",
        "-p",
        "vmtsync",
        "--bin",
        "vmtsync",
    ]))?;
    let bin = crate::root().join("target/release/vmtsync");
    let m = measure(&bin, a.vms, a.vcpus, a.runs)?;
    let times = m.times;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "vmtsync kvm --json over {} VMs x {} vCPUs ({} files), {} runs: median {:.1} ms, min {:.1} ms, max {:.1} ms",
        a.vms,
        a.vcpus,
        m.files,
        times.len(),
        ms(times[times.len() / 2]),
        ms(times[0]),
        ms(times[times.len() - 1]),
    );
    Ok(())
}
