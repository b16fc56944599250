//! What the CTF and Perfetto writing sections share: a criterion table of the writer's bench,
//! the throughput goal of its `push`, and the max RSS of its example binary at a small and a
//! large event count (which must not grow).

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use super::format::{rate, sig3, thousands, verdict, whole};
use super::sections::{criterion_table, max_rss_kib};
use super::{Plan, Section, Stat, criterion_command, criterion_run, rel};

/// One writer's section: what differs between CTF and Perfetto.
pub(super) struct Writer<'a> {
    /// The criterion bench (`cargo bench --bench NAME`).
    pub bench: &'a str,
    /// Its rows: label and criterion id.
    pub rows: &'a [(&'a str, &'a str)],
    /// The row the ≥ 20 M events/s goal is about, and how the goal line and the summary name
    /// it.
    pub goal_id: &'a str,
    pub goal_what: &'a str,
    pub goal_claim: &'a str,
    /// The example binary (`examples/NAME`, run as `NAME OUT EVENTS 2`), what its output
    /// argument is called in the command shown, and whether its output is one file (whose
    /// size the memory table shows) or a directory.
    pub example: &'a str,
    pub out_arg: &'a str,
    pub one_file: bool,
    /// How the summary names the memory row (followed by "N vs M events").
    pub rss_claim: &'a str,
}

/// The section: the bench's table and goal line, then the memory table and its goal.
pub(super) fn section(plan: &Plan, work: &Path, w: &Writer<'_>) -> Result<Section> {
    let r = criterion_run(plan, work, w.bench)?;
    let mut body = criterion_table(&r, w.rows, Some("event"), None)?;
    let push = r
        .get(w.goal_id)?
        .per_second()
        .with_context(|| format!("{} bench has no throughput", w.bench))?;
    let _ = writeln!(
        body,
        "\nGoal ≥ 20 M events/s in-process ({}): {} ({}).",
        w.goal_what,
        rate(push.median),
        verdict(push.median >= 20e6)
    );
    let bin = plan.bin_dir.join("examples").join(w.example);
    let out = std::env::temp_dir().join(format!(
        "vmtsync-bench-{}-{}",
        w.example,
        std::process::id()
    ));
    let remove = || {
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_file(&out);
    };
    let (small, large, runs) = plan.rss;
    let mut table = String::from("| events | max RSS (KiB, min / median / max) |");
    table.push_str(if w.one_file {
        " file |\n|---:|---:|---:|\n"
    } else {
        "\n|---:|---:|\n"
    });
    // The two sizes alternate run by run, so a drift of the machine's state during the
    // runs moves both alike.
    let mut kib = [Vec::new(), Vec::new()];
    let mut size = [0, 0];
    for _ in 0..runs {
        for (k, n) in [small, large].into_iter().enumerate() {
            remove();
            let mut cmd = Command::new(&bin);
            cmd.arg(&out).arg(n.to_string()).arg("2");
            kib[k].push(max_rss_kib(&cmd)? as f64);
            size[k] = std::fs::metadata(&out).map_or(0, |m| m.len());
            remove();
        }
    }
    let mut medians = Vec::new();
    for (k, n) in [small, large].into_iter().enumerate() {
        let st = Stat::of(&kib[k]).context("no runs")?;
        medians.push(st.median);
        let _ = write!(
            table,
            "| {} | {} |",
            thousands(n),
            st.show(|x| thousands(whole(x)))
        );
        if w.one_file {
            let _ = write!(table, " {} MB |", sig3(size[k] as f64 / 1e6));
        }
        table.push('\n');
    }
    let growth = medians[1] / medians[0] - 1.0;
    let within = growth.abs() <= 0.10;
    let _ = writeln!(
        body,
        "\nMemory: `/usr/bin/time -v {} {} N 2` (built by `cargo build {} --example {}`), \
         {runs} run(s) per row, the two sizes in turn:\n\n{table}\nMax RSS at {} events vs {}: {:+.1} %. Goal: \
         within 10 %: {}.",
        rel(&bin),
        w.out_arg,
        plan.build_profile.join(" "),
        w.example,
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
                w.goal_claim.into(),
                "≥ 20 M events/s".into(),
                push.show(rate),
                verdict(push.median >= 20e6),
            ],
            [
                format!(
                    "{}, {} vs {} events",
                    w.rss_claim,
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
