//! The sections measured by criterion benches and by small binaries: timeline conversion,
//! the probe protocol, estimators, the recorder (and bytes per event on the wire), trace.dat
//! writing (and its memory), the host scan, the agent's size.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};

use super::criterion::{Measured, Results};
use super::format::{rate, ratio, si, sig3, thousands, time_ns, verdict, whole};
use super::{
    Plan, Section, Stat, TRACE_CMD_PTP_BYTES_PER_PROBE_X10, criterion_command, criterion_run, rel,
    run_capture, shown,
};
use crate::{agent, bench_scan, display};

/// A table of criterion results: one row per `(label, id)`, with the time per `unit` (per
/// iteration when `None`), the rate when the bench declared a throughput, and optionally how
/// many times the time of `base` each row takes, medians against medians and fastest samples
/// against fastest samples.
pub(super) fn criterion_table(
    r: &Results,
    rows: &[(&str, &str)],
    unit: Option<&str>,
    base: Option<&Measured>,
) -> Result<String> {
    let mut s = String::new();
    let elements = unit.is_some()
        && rows
            .iter()
            .filter_map(|(_, id)| r.by_id.get(*id))
            .any(|m| m.elements.is_some());
    let per = unit.unwrap_or("iteration");
    let _ = write!(s, "| benchmark | time per {per} (min / median / max) |");
    if elements {
        let _ = write!(s, " {per}s/s (min / median / max) |");
    }
    if base.is_some() {
        s.push_str(" time vs the first row (median; fastest sample) |");
    }
    s.push_str("\n|---|---:|");
    if elements {
        s.push_str("---:|");
    }
    if base.is_some() {
        s.push_str("---:|");
    }
    s.push('\n');
    for (label, id) in rows {
        let m = r.get(id)?;
        let t = if unit.is_some() {
            m.ns_per_element()
        } else {
            m.ns
        };
        let _ = write!(s, "| {label} | {} |", t.show(time_ns));
        if elements {
            let _ = write!(
                s,
                " {} |",
                m.per_second()
                    .map_or_else(|| "—".into(), |p| p.show(si_rate))
            );
        }
        if let Some(b) = base {
            let _ = write!(
                s,
                " {}; {} |",
                ratio(m.ns.median / b.ns.median),
                ratio(m.ns.min / b.ns.min)
            );
        }
        s.push('\n');
    }
    let samples: Vec<usize> = rows
        .iter()
        .filter_map(|(_, id)| r.by_id.get(*id).map(|m| m.samples))
        .collect();
    if let (Some(lo), Some(hi)) = (samples.iter().min(), samples.iter().max()) {
        let _ = writeln!(
            s,
            "\n{} criterion samples per benchmark.",
            if lo == hi {
                lo.to_string()
            } else {
                format!("{lo}–{hi}")
            }
        );
    }
    Ok(s)
}

/// A rate without its `/s` (the column header says per second).
fn si_rate(v: f64) -> String {
    si(v).trim_end().to_owned()
}

pub(super) fn timeline(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "timeline")?;
    let g = "timeline_guest_to_host_4096_segments";
    let id = |f: &str| format!("{g}/{f}");
    let batch = r.get(&id("cursor_batch"))?;
    let per_event = r.get(&id("cursor_per_event"))?;
    let search = r.get(&id("binary_search_per_event"))?;
    let dense = r.get(&id("binary_search_dense_starts_per_event"))?;
    let rows = [
        (
            "`Cursor::try_convert_slice_floor` (streaming batch)",
            id("cursor_batch"),
        ),
        (
            "`Cursor::try_convert_floor` (our streaming cursor, per event)",
            id("cursor_per_event"),
        ),
        (
            "baseline: binary search per event + linear map (trace-cmd's reader)",
            id("binary_search_per_event"),
        ),
        (
            "baseline variant: binary search over a dense array of starts",
            id("binary_search_dense_starts_per_event"),
        ),
        (
            "memory floor (read + add + write the buffer; not a converter)",
            id("memory_floor_add_one"),
        ),
    ];
    let rows: Vec<(&str, &str)> = rows.iter().map(|(l, i)| (*l, i.as_str())).collect();
    let mut body = criterion_table(&r, &rows, Some("event"), Some(batch))?;
    let vs_search = search.ns.median / batch.ns.median;
    let vs_cursor = per_event.ns.median / batch.ns.median;
    let vs_dense = dense.ns.median / batch.ns.median;
    let batch_rate = batch.per_second().map_or(0.0, |p| p.median);
    let _ = writeln!(
        body,
        "\nThe batch converter is **{} faster than trace-cmd's per-event binary search** \
         ({} against the dense-starts variant) and **{} faster than our own per-event \
         cursor**, same run, same buffer (medians; fastest samples: {}, {}). Goals: ≥ 300 M events/s on one core \
         ({}: {}) and ≥ 10× the per-event binary search ({}: {}).",
        ratio(vs_search),
        ratio(vs_dense),
        ratio(vs_cursor),
        ratio(search.ns.min / batch.ns.min),
        ratio(per_event.ns.min / batch.ns.min),
        rate(batch_rate),
        verdict(batch_rate >= 300e6),
        ratio(vs_search),
        verdict(vs_search >= 10.0),
    );
    let k = "timeline_kvm_guest_to_host";
    let kb = r.get(&format!("{k}/cursor_batch"))?;
    let ks = r.get(&format!("{k}/binary_search_per_event"))?;
    let kvm_rows = [
        (
            "batch (corrected reciprocal kernel)",
            format!("{k}/cursor_batch"),
        ),
        (
            "exact u128 division per event (`try_host_from_guest_ceil`)",
            format!("{k}/binary_search_per_event"),
        ),
    ];
    let kvm_rows: Vec<(&str, &str)> = kvm_rows.iter().map(|(l, i)| (*l, i.as_str())).collect();
    let _ = writeln!(
        body,
        "\nOne exact KVM segment (ratio 1.1 at 48 fractional bits; the batch output equals the \
         exact inverse bit for bit, asserted before timing):\n"
    );
    body.push_str(&criterion_table(&r, &kvm_rows, Some("event"), Some(kb))?);
    let _ = writeln!(
        body,
        "\nBatch vs exact division per event: {}.",
        ratio(ks.ns.median / kb.ns.median)
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            [
                "timeline batch conversion, one core".into(),
                "≥ 300 M events/s".into(),
                batch
                    .per_second()
                    .map_or_else(|| "—".into(), |p| p.show(rate)),
                verdict(batch_rate >= 300e6),
            ],
            [
                "batch vs trace-cmd-style per-event binary search".into(),
                "≥ 10×".into(),
                ratio(vs_search),
                verdict(vs_search >= 10.0),
            ],
            [
                "batch vs our own per-event cursor".into(),
                "— (for scale)".into(),
                ratio(vs_cursor),
                "—".into(),
            ],
        ],
    })
}

/// One `name: key=value …` line the proto bench prints.
pub(super) fn kv_line<'a>(text: &'a str, name: &str) -> Option<BTreeMap<&'a str, &'a str>> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?;
    Some(
        line.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect(),
    )
}

pub(super) fn proto(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "proto")?;
    let rows = [
        (
            "probe request encode + decode",
            "probe/request encode+decode",
        ),
        ("probe reply encode + decode", "probe/reply encode+decode"),
        (
            "agent's path after reading the TSC (`ProbeReplyFrame::finish`)",
            "probe/reply finish (agent late-TSC path)",
        ),
        (
            "… of which the CRC-16 continuation over the TSC bytes",
            "probe/reply CRC-16 continuation over the TSC bytes",
        ),
        (
            "generic `encode_frame` of the same reply",
            "probe/reply encode_frame (generic)",
        ),
        (
            "host receive + decode + 32-bit TSC unwrap",
            "probe/host receive+unwrap reply",
        ),
    ];
    let mut body = criterion_table(&r, &rows, None, None)?;
    let compact = kv_line(&r.stdout, "probe_round_trip")
        .context("the proto bench printed no `probe_round_trip:` line")?;
    let full = kv_line(&r.stdout, "full_probe_round_trip")
        .context("the proto bench printed no `full_probe_round_trip:` line")?;
    let num = |m: &BTreeMap<&str, &str>, k: &str| -> Result<u64> {
        m.get(k)
            .with_context(|| format!("no {k}= in the proto bench's wire line"))?
            .parse()
            .with_context(|| format!("{k}= is not a number"))
    };
    let (lo, hi) = (num(&compact, "bytes_min")?, num(&compact, "bytes_max")?);
    let (flo, fhi) = (num(&full, "bytes_min")?, num(&full, "bytes_max")?);
    let tc = TRACE_CMD_PTP_BYTES_PER_PROBE_X10 as f64 / 10.0;
    let range = |a: u64, b: u64| {
        if a == b {
            format!("{a} B")
        } else {
            format!("{a}–{b} B")
        }
    };
    let _ = writeln!(
        body,
        "\n**Bytes per probe round trip: {}** for a compact probe (request {} B + reply {} B at \
         seq 0; COBS, checksum and the 0x00 delimiter included; every seq 0..=255, guest TSC \
         ≈ 2^45, vCPU 3), {} with the full-width TSC, printed by the bench from the real \
         encoder. trace-cmd's PTP plugin spends 32,778 B on its 339 probes ≈ {tc} B per probe: \
         {} more than ours.",
        range(lo, hi),
        num(&compact, "request")?,
        num(&compact, "reply")?,
        range(flo, fhi),
        if lo == hi {
            ratio(tc / hi as f64)
        } else {
            format!(
                "{} to {}",
                ratio(tc / hi as f64),
                ratio(tc / lo.max(1) as f64)
            )
        },
    );
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![[
            "bytes per probe round trip (compact)".into(),
            "≤ 16 B".into(),
            format!("{} (trace-cmd PTP ≈ {tc} B)", range(lo, hi)),
            verdict(hi <= 16),
        ]],
    })
}

pub(super) fn estimate(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "estimate")?;
    let names = [
        ("trace-cmd fastest RTT (faithful port)", "trace_cmd_fastest"),
        ("trace-cmd histogram (port)", "trace_cmd_histogram"),
        ("ours: guaranteed offset interval", "ours_offset_interval"),
        (
            "ours: convex-hull drift bounds (hull capacity 32)",
            "ours_drift_hull32",
        ),
    ];
    let sizes = [64, 339];
    let mut body = String::from(
        "| estimator | ns per sample, 64 samples (min / median / max) | 339 samples |\n|---|---:|---:|\n",
    );
    for (label, name) in names {
        let _ = write!(body, "| {label} |");
        for n in sizes {
            let m = r.get(&format!("estimate/{name}/{n}"))?;
            let _ = write!(body, " {} |", m.ns_per_element().show(time_ns));
        }
        body.push('\n');
    }
    let _ = writeln!(
        body,
        "\n64 samples is our default round; 339 is trace-cmd's `PTP_SYNC_LOOP`."
    );
    let ours = r.get("estimate/ours_offset_interval/64")?.ns_per_element();
    let tc = r.get("estimate/trace_cmd_fastest/64")?.ns_per_element();
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![[
            "offset interval estimator, 64 samples".into(),
            "— (for scale)".into(),
            format!(
                "{} per sample ({} trace-cmd fastest RTT's time)",
                time_ns(ours.median),
                ratio(ours.median / tc.median)
            ),
            "—".into(),
        ]],
    })
}

/// A full event batch as the agent sends it, encoded: `(frame bytes, events)`.
pub(super) fn event_batch_frame() -> Result<(usize, usize)> {
    use vmtsync_core::proto::{
        EVENT_BATCH_MAX, EventBatch, EventClock, MAX_FRAME_SIZE, Message, encode_frame,
    };
    // A guest TSC near 2^45 (hours after boot), 2600 ticks between events: a million events
    // per second at 2.6 GHz.
    let base = (1u64 << 45) + 12_345;
    let mut batch = EventBatch::new(1, EventClock::Guest, base);
    let mut prev = base;
    for i in 0..EVENT_BATCH_MAX {
        let t = prev + 2600;
        let id = u16::try_from(i % 100).unwrap_or(0);
        ensure!(
            batch.push(prev, t, id, &[]),
            "EventBatch::push refused record {i}"
        );
        prev = t;
    }
    let events = batch.records.len();
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(&Message::Events(batch), &mut buf)
        .map_err(|e| anyhow::anyhow!("encode_frame: {e:?}"))?;
    Ok((frame.len(), events))
}

pub(super) fn recorder(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "recorder")?;
    let rows = [
        (
            "TSC read alone (`lfence; rdtsc`)",
            "recorder/tsc_read_alone",
        ),
        (
            "`Ring::view().record`, no payload (includes the TSC read)",
            "recorder/record_no_payload",
        ),
        (
            "`Ring::view().record`, 8-byte payload",
            "recorder/record_8B_payload",
        ),
        (
            "flight recorder `Producer::record`, no payload (includes the TSC read)",
            "recorder/flight_record_no_payload",
        ),
        (
            "flight recorder `Producer::record`, 8-byte payload",
            "recorder/flight_record_8B_payload",
        ),
        (
            "the ring alone, stop-when-full (no payload, a constant clock)",
            "recorder/record_no_payload_fixed_clock",
        ),
        (
            "the ring alone, flight recorder (no payload, a constant clock)",
            "recorder/flight_record_no_payload_fixed_clock",
        ),
        (
            "record (8 B) then pop (producer + consumer)",
            "recorder/record_8B_payload_then_pop",
        ),
    ];
    let mut body = criterion_table(&r, &rows, Some("event"), None)?;
    // The two recorders over the same ring code, side by side: `Recorder` (a `static` of
    // const shape) and `MemRecorder` (caller memory, run-time shape: the C ABI's).
    let pair = [
        (
            "`Recorder::ring(0)` + `record`, no payload (stop-when-full, real TSC read)",
            "recorder/recorder_record_no_payload",
        ),
        (
            "`MemRecorder::ring(0)` + `record`, no payload (caller memory, run-time shape)",
            "recorder/mem_recorder_record_no_payload",
        ),
        (
            "`Recorder::ring(0)` + `record`, 8-byte payload",
            "recorder/recorder_record_8B_payload",
        ),
        (
            "`MemRecorder::ring(0)` + `record`, 8-byte payload",
            "recorder/mem_recorder_record_8B_payload",
        ),
        (
            "`Recorder::ring(0)` + `record` alone (no payload, a constant clock)",
            "recorder/recorder_record_no_payload_fixed_clock",
        ),
        (
            "`MemRecorder::ring(0)` + `record` alone (no payload, a constant clock)",
            "recorder/mem_recorder_record_no_payload_fixed_clock",
        ),
    ];
    let static_rec = r.get("recorder/recorder_record_no_payload")?;
    let _ = writeln!(
        body,
        "\nThe two recorders, one vCPU of 4096 records each, through their `record(vcpu, …)` \
         paths (times against the first row):\n"
    );
    body.push_str(&criterion_table(
        &r,
        &pair,
        Some("event"),
        Some(static_rec),
    )?);
    let tsc = r.get("recorder/tsc_read_alone")?.ns_per_element();
    let rec = r.get("recorder/record_no_payload")?.ns_per_element();
    let rec8 = r.get("recorder/record_8B_payload")?.ns_per_element();
    let flight = r.get("recorder/flight_record_no_payload")?.ns_per_element();
    let flight8 = r.get("recorder/flight_record_8B_payload")?.ns_per_element();
    let (frame, events) = event_batch_frame()?;
    let per_event = frame as f64 / events as f64;
    let _ = writeln!(
        body,
        "\nRecorder cost per event in criterion (median, with the real ordered TSC read): \
         stop-when-full {} without a payload, {} with 8 bytes; flight recorder {} without a \
         payload, {} with 8 bytes; the TSC read alone is {}.\n\n\
         **Bytes per event on the wire: {:.2} B** — one full batch of {events} payload-less \
         events 2600 ticks apart (a million events per second at 2.6 GHz, guest TSC ≈ 2^45) \
         encoded by `vmtsync_core::proto::encode_frame` (in `cargo xtask bench` itself) into a \
         {frame}-byte frame (tag, \
         counters, base timestamp, checksum, COBS and delimiter shared by the batch). Goal \
         ≤ 4 B/event: {}.",
        time_ns(rec.median),
        time_ns(rec8.median),
        time_ns(flight.median),
        time_ns(flight8.median),
        time_ns(tsc.median),
        per_event,
        verdict(per_event <= 4.0),
    );
    // The goals: the recorders against barectf and the floors, side by side in one process.
    let (peers_command, peers, mut summary) = super::peers::side_by_side(plan)?;
    let _ = write!(
        body,
        "\n### The recorders, barectf and the floors, side by side\n\n`{peers_command}`\n\n{peers}"
    );
    summary.push([
        "bytes per payload-less event on the wire (full batch)".into(),
        "≤ 4 B".into(),
        format!("{per_event:.2} B"),
        verdict(per_event <= 4.0),
    ]);
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary,
    })
}

/// `Maximum resident set size` of one `tracedat_write` run, in KiB, and the file's size.
pub(super) fn max_rss(bin: &Path, file: &Path, events: u64, version: u32) -> Result<(u64, u64)> {
    let mut cmd = Command::new(bin);
    cmd.arg(file)
        .arg(events.to_string())
        .arg("2")
        .arg(version.to_string());
    let kib = max_rss_kib(&cmd)?;
    let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
    let _ = std::fs::remove_file(file);
    Ok((kib, bytes))
}

/// `Maximum resident set size` of one run of `cmd` (program and arguments) under
/// `/usr/bin/time -v`, in KiB.
pub(super) fn max_rss_kib(cmd: &Command) -> Result<u64> {
    let mut cmd = {
        let mut c = Command::new("/usr/bin/time");
        c.arg("-v").arg(cmd.get_program()).args(cmd.get_args());
        c
    };
    let shown_cmd = shown(&cmd);
    eprintln!("$ {}", display(&cmd));
    let out = cmd
        .output()
        .with_context(|| format!("running {shown_cmd} (is /usr/bin/time installed?)"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{shown_cmd} failed: {stderr}");
    let kib = stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes):"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no maximum RSS in the output of {shown_cmd}"))?;
    Ok(kib)
}

pub(super) fn tracedat(plan: &Plan, work: &Path) -> Result<Section> {
    let r = criterion_run(plan, work, "tracedat")?;
    let rows = [
        (
            "v7 `push` only (pages written as they fill)",
            "tracedat/push_v7",
        ),
        (
            "v7 `push` + `finish` (spill append, fsync, full read-back verification)",
            "tracedat/push_and_finish_v7",
        ),
        ("v6 `push` only", "tracedat/push_v6"),
        ("v6 `push` + `finish`", "tracedat/push_and_finish_v6"),
    ];
    let mut body = criterion_table(&r, &rows, Some("event"), None)?;
    let push = r
        .get("tracedat/push_v7")?
        .per_second()
        .context("tracedat bench has no throughput")?;
    let _ = writeln!(
        body,
        "\nGoal ≥ 20 M events/s in-process (`push`, v7): {} ({}).",
        rate(push.median),
        verdict(push.median >= 20e6)
    );

    let bin = plan.bin_dir.join("examples/tracedat_write");
    let file = std::env::temp_dir().join(format!("vmtsync-bench-rss-{}.dat", std::process::id()));
    let (small, large, runs) = plan.rss;
    let mut table = String::from(
        "| events | max RSS v7 (KiB, min / median / max) | max RSS v6 | file (v7) |\n|---:|---:|---:|---:|\n",
    );
    let mut medians = BTreeMap::new();
    for n in [small, large] {
        let mut cells = Vec::new();
        let mut size = 0;
        for v in [7u32, 6] {
            let mut kib = Vec::new();
            for _ in 0..runs {
                let (k, bytes) = max_rss(&bin, &file, n, v)?;
                kib.push(k as f64);
                if v == 7 {
                    size = bytes;
                }
            }
            let st = Stat::of(&kib).context("no runs")?;
            medians.insert((n, v), st.median);
            cells.push(st.show(|x| thousands(whole(x))));
        }
        let _ = writeln!(
            table,
            "| {} | {} | {} | {} MB |",
            thousands(n),
            cells[0],
            cells[1],
            sig3(size as f64 / 1e6)
        );
    }
    let growth = |v: u32| medians[&(large, v)] / medians[&(small, v)] - 1.0;
    let (g7, g6) = (growth(7), growth(6));
    let within = g7.abs() <= 0.10 && g6.abs() <= 0.10;
    let _ = writeln!(
        body,
        "\nMemory: `/usr/bin/time -v {} OUT.dat N 2 V` (built by `cargo build {} --example \
         tracedat_write`), {runs} run(s) per cell; `N` is the event count, `V` the file \
         version:\n\n{table}\n\
         Max RSS at {} events vs {}: {:+.1} % (v7), {:+.1} % (v6). Goal: within 10 %: {}.",
        rel(&bin),
        plan.build_profile.join(" "),
        thousands(large),
        thousands(small),
        g7 * 100.0,
        g6 * 100.0,
        verdict(within),
    );
    let (attach_body, attach_row) = attach_time(plan, work)?;
    body.push_str(&attach_body);
    Ok(Section {
        command: criterion_command(&r),
        body,
        summary: vec![
            attach_row,
            [
                "trace.dat `push`, in-process (v7)".into(),
                "≥ 20 M events/s".into(),
                push.show(rate),
                verdict(push.median >= 20e6),
            ],
            [
                format!(
                    "trace.dat max RSS, {} vs {} events",
                    thousands(large),
                    thousands(small)
                ),
                "within 10 %".into(),
                format!("{:+.1} % (v7), {:+.1} % (v6)", g7 * 100.0, g6 * 100.0),
                verdict(within),
            ],
        ],
    })
}

pub(super) fn scan(plan: &Plan, work: &Path) -> Result<Section> {
    let (vms, vcpus, runs) = plan.scan;
    let bin = plan.bin_dir.join("vmtsync");
    let m = bench_scan::measure(&bin, vms, vcpus, runs)?;
    let ms: Vec<f64> = m.times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let st = Stat::of(&ms).context("no scan runs")?;
    let ms_text = |v: f64| format!("{} ms", sig3(v));
    let full_size = vms == 1000 && vcpus == 4;
    let command = format!("cargo xtask bench-scan --vms {vms} --vcpus {vcpus} --runs {runs}");
    let mut body = format!(
        "`bench-scan` generates a KVM \
         debugfs tree of {vms} VMs × {vcpus} vCPUs (five files per vCPU, Intel-style scaling: \
         {} files), runs `vmtsync kvm --json --debugfs-root TREE` {runs} times as a separate \
         process after one untimed warm-up, checks each output lists all {vms} VMs, and times \
         it: {} wall time per scan (min / median / max). Goal ≤ 100 ms for 1000 × 4: {}. \
         Nearly all of it is three system calls per file (openat, read, close) on this host.\n",
        thousands(m.files),
        st.show(ms_text),
        if full_size {
            verdict(st.median <= 100.0)
        } else {
            "not judged at this size".into()
        },
    );
    let r = criterion_run(plan, work, "kvm_scan")?;
    let _ = writeln!(
        body,
        "\nIn-process (`{}`): the scan and JSON serialisation of 1000 × 4, and `vmtsync \
         convert`'s streaming conversion of 100,000 decimal guest TSCs (lines):\n",
        criterion_command(&r)
    );
    body.push_str(&criterion_table(
        &r,
        &[(
            "scan + JSON, 1000 VMs × 4 vCPUs",
            "kvm_scan/scan_json_1000vms_x4",
        )],
        None,
        None,
    )?);
    body.push('\n');
    body.push_str(&criterion_table(
        &r,
        &[
            ("convert, offset-only mapping", "convert/offset_only"),
            (
                "convert, Intel-scaled mapping (exact u128)",
                "convert/intel_scaled",
            ),
        ],
        Some("line"),
        None,
    )?);
    Ok(Section {
        command,
        body,
        summary: vec![[
            format!("`vmtsync kvm --json`, {vms} VMs × {vcpus} vCPUs, separate process"),
            "≤ 100 ms (1000 × 4)".into(),
            st.show(ms_text),
            if full_size {
                verdict(st.median <= 100.0)
            } else {
                "not judged at this size".into()
            },
        ]],
    })
}

pub(super) fn agent_size() -> Result<Section> {
    let elf = agent::build()?;
    let text = agent::section_size(&elf, ".text")?;
    let embedded = agent::section_size(&agent::build_minimal_kernel()?, ".text")?;
    let limit = agent::TEXT_LIMIT;
    Ok(Section {
        command: "cargo xtask build-agent && (cd tests/minimal-kernel && cargo build --release)"
            .into(),
        body: format!(
            "`.text` of the release agent: **{} bytes** ({:.1} KiB), with both transports \
             (16550 UART and virtio-vsock over PCI or MMIO, with a heap for the virtio driver), \
             SMP bring-up, defmt logging, its console and the core agent state machine.\n\n\
             `.text` of `tests/minimal-kernel/`, the embedding example: **{} bytes** ({:.1} KiB \
             of the {} KiB budget): its own PVH boot and application with vmtsync-core's agent \
             state machine, its UART link and memory mode, so an upper bound on what an \
             embedder links. The budget is on this one because it is what goes into other \
             people's guests (docs/embedding.md: a guest links vmtsync-core and nothing else \
             of this repository). The bundled agent is a kernel of its own that nobody embeds, \
             and no loader bounds its `.text` (its link.ld starts `.rodata` at the next page; \
             PVH loaders load each segment at its address), so its size is a figure.",
            thousands(text),
            text as f64 / 1024.0,
            thousands(embedded),
            embedded as f64 / 1024.0,
            limit / 1024
        ),
        summary: vec![
            [
                "guest agent `.text` (bundled: both transports, SMP, logging)".into(),
                "— (figure: not embedded)".into(),
                format!("{} B", thousands(text)),
                "—".into(),
            ],
            [
                "`.text` an embedder links (`tests/minimal-kernel/`: core's agent, memory mode)"
                    .into(),
                format!("≤ {} KiB", limit / 1024),
                format!("{} B", thousands(embedded)),
                verdict(embedded <= limit),
            ],
        ],
    })
}

/// `trace-cmd attach` (`examples/attach_time`) on two guest traces of the same size and
/// different event counts (payload-less events vs 16-byte payloads): its time should follow
/// the size (a `copy_file_range` copy plus the first and last pages), not the events, while
/// a walk of every event is shown for scale.
fn attach_time(plan: &Plan, work: &Path) -> Result<(String, [String; 4])> {
    let bin = plan.bin_dir.join("examples/attach_time");
    let (mb, runs) = plan.attach;
    let mut table = String::from(
        "| events | file | attach (ms, min / median / max) | walk of every event (ms) |\n|---:|---:|---:|---:|\n",
    );
    let mut medians = Vec::new();
    for payload in [0u32, 16] {
        let mut cmd = Command::new(&bin);
        cmd.arg(work)
            .arg(mb.to_string())
            .arg(payload.to_string())
            .arg(runs.to_string());
        let (out, status) = run_capture(&mut cmd)?;
        ensure!(status.success(), "{} failed: {out}", shown(&cmd));
        let kv = kv_line(&out, "attach-time").context("no attach-time line")?;
        let num = |k: &str| -> Result<Vec<f64>> {
            kv.get(k)
                .context("attach-time line incomplete")?
                .split(',')
                .map(|v| v.parse::<f64>().map_err(Into::into))
                .collect()
        };
        let events: f64 = num("events")?[0];
        let bytes: f64 = num("bytes")?[0];
        let attach = Stat::of(&num("attach_ms")?).context("no runs")?;
        let walk = Stat::of(&num("walk_ms")?).context("no runs")?;
        medians.push((events, attach.median));
        let _ = writeln!(
            table,
            "| {} | {} MB | {} | {} |",
            thousands(whole(events)),
            sig3(bytes / 1e6),
            attach.show(sig3),
            walk.show(sig3)
        );
    }
    let (e_ratio, t_ratio) = (medians[0].0 / medians[1].0, medians[0].1 / medians[1].1);
    // Independent: the time ratio stays far closer to 1 than the event ratio (noise on this
    // shared machine is tens of percent per run, fsync included).
    let met = t_ratio < 1.0 + (e_ratio - 1.0) / 2.0;
    let body = format!(
        "\n`trace-cmd attach` of a ~{mb} MB v7 guest trace (`{} DIR {mb} PAYLOAD {runs}`, built \
         with the binaries above; read, TIME_SHIFT planned from the first and last pages, \
         copied, re-read, fsynced, renamed), {runs} run(s) per file:\n\n{table}\n\
         {:.2}x the events take {:.2}x the attach time. Goal: independent of the event count \
         (time ratio below halfway to the event ratio): {}.\n",
        rel(&bin),
        e_ratio,
        t_ratio,
        verdict(met)
    );
    let row = [
        format!("trace-cmd attach, ~{mb} MB trace"),
        "independent of the event count".into(),
        format!("{e_ratio:.2}x events → {t_ratio:.2}x time"),
        verdict(met),
    ];
    Ok((body, row))
}
