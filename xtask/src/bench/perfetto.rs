//! The Perfetto writing section: `cargo bench -p vmtsync --bench perfetto` (`push` with every
//! argument and with the host TSC only, `push` + `finish`) and the max RSS of
//! `examples/perfetto_write` at a small and a large event count.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use super::format::{rate, sig3, thousands, verdict, whole};
use super::sections::{criterion_table, max_rss_kib};
use super::{Plan, Section, Stat, criterion_command, criterion_run, rel};

pub(super) fn perfetto(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "perfetto")?;
    let rows = [
        (
            "`push`, every argument (guest TSC, interval, payload: the JSON Lines case)",
            "perfetto/push",
        ),
        (
            "`push`, host TSC only (a pre-converted trace.dat)",
            "perfetto/push_host_only",
        ),
        (
            "`push` + `finish` (flush, fsync, rename)",
            "perfetto/push_and_finish",
        ),
    ];
    let mut body = criterion_table(&r, &rows, Some("event"), None)?;
    let push = r
        .get("perfetto/push")?
        .per_second()
        .context("perfetto bench has no throughput")?;
    let _ = writeln!(
        body,
        "\nGoal ≥ 20 M events/s in-process (`push`, every argument): {} ({}).",
        rate(push.median),
        verdict(push.median >= 20e6)
    );
    let bin = plan.bin_dir.join("examples/perfetto_write");
    let file = std::env::temp_dir().join(format!(
        "vmtsync-bench-rss-{}.perfetto-trace",
        std::process::id()
    ));
    let (small, large, runs) = plan.rss;
    let mut table =
        String::from("| events | max RSS (KiB, min / median / max) | file |\n|---:|---:|---:|\n");
    let mut medians = Vec::new();
    for n in [small, large] {
        let (mut kib, mut size) = (Vec::new(), 0);
        for _ in 0..runs {
            let mut cmd = Command::new(&bin);
            cmd.arg(&file).arg(n.to_string()).arg("2");
            kib.push(max_rss_kib(&cmd)? as f64);
            size = std::fs::metadata(&file).map_or(0, |m| m.len());
            let _ = std::fs::remove_file(&file);
        }
        let st = Stat::of(&kib).context("no runs")?;
        medians.push(st.median);
        let _ = writeln!(
            table,
            "| {} | {} | {} MB |",
            thousands(n),
            st.show(|x| thousands(whole(x))),
            sig3(size as f64 / 1e6)
        );
    }
    let growth = medians[1] / medians[0] - 1.0;
    let within = growth.abs() <= 0.10;
    let _ = writeln!(
        body,
        "\nMemory: `/usr/bin/time -v {} OUT N 2` (built by `cargo build {} --example \
         perfetto_write`), {runs} run(s) per row:\n\n{table}\n\
         Max RSS at {} events vs {}: {:+.1} %. Goal: within 10 %: {}.",
        rel(&bin),
        plan.build_profile.join(" "),
        thousands(large),
        thousands(small),
        growth * 100.0,
        verdict(within),
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            [
                "Perfetto `push`, in-process (every argument)".into(),
                "≥ 20 M events/s".into(),
                push.show(rate),
                verdict(push.median >= 20e6),
            ],
            [
                format!(
                    "Perfetto writer max RSS, {} vs {} events",
                    thousands(large),
                    thousands(small)
                ),
                "within 10 %".into(),
                format!("{:+.1} %", growth * 100.0),
                verdict(within),
            ],
        ],
    })
}
