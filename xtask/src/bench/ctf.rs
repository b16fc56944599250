//! The CTF writing section: `cargo bench -p vmtsync --bench ctf` (`push` only and `push` +
//! `finish`) and the max RSS of `examples/ctf_write` at a small and a large event count.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use super::format::{rate, thousands, verdict, whole};
use super::sections::{criterion_table, max_rss_kib};
use super::{Plan, Section, Stat, criterion_command, criterion_run, rel};

pub(super) fn ctf(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "ctf")?;
    let rows = [
        ("`push` only (packets written as they fill)", "ctf/push"),
        (
            "`push` + `finish` (last packets, metadata, fsync, rename)",
            "ctf/push_and_finish",
        ),
    ];
    let mut body = criterion_table(&r, &rows, Some("event"), None)?;
    let push = r
        .get("ctf/push")?
        .per_second()
        .context("ctf bench has no throughput")?;
    let _ = writeln!(
        body,
        "\nGoal ≥ 20 M events/s in-process (`push`): {} ({}).",
        rate(push.median),
        verdict(push.median >= 20e6)
    );
    let bin = plan.bin_dir.join("examples/ctf_write");
    let dir = std::env::temp_dir().join(format!("vmtsync-bench-ctf-{}", std::process::id()));
    let (small, large, runs) = plan.rss;
    let mut medians = BTreeMap::new();
    let mut table = String::from("| events | max RSS (KiB, min / median / max) |\n|---:|---:|\n");
    for n in [small, large] {
        let mut kib = Vec::new();
        for _ in 0..runs {
            let _ = std::fs::remove_dir_all(&dir);
            let mut cmd = Command::new(&bin);
            cmd.arg(&dir).arg(n.to_string()).arg("2");
            kib.push(max_rss_kib(&cmd)? as f64);
            let _ = std::fs::remove_dir_all(&dir);
        }
        let st = Stat::of(&kib).context("no runs")?;
        medians.insert(n, st.median);
        let _ = writeln!(
            table,
            "| {} | {} |",
            thousands(n),
            st.show(|x| thousands(whole(x)))
        );
    }
    let growth = medians[&large] / medians[&small] - 1.0;
    let within = growth.abs() <= 0.10;
    let _ = writeln!(
        body,
        "\nMemory: `/usr/bin/time -v {} DIR N 2` (built by `cargo build {} --example ctf_write`), \
         {runs} run(s) per row:\n\n{table}\nMax RSS at {} events vs {}: {:+.1} %. Goal: within \
         10 %: {}.",
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
                "CTF `push`, in-process".into(),
                "≥ 20 M events/s".into(),
                push.show(rate),
                verdict(push.median >= 20e6),
            ],
            [
                format!(
                    "CTF max RSS, {} vs {} events",
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
