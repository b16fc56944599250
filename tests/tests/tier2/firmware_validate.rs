//! Tier 2: SeaBIOS checked against the host kernel's own stamps of its port I/O (issue 24).
//!
//! The traced SeaBIOS records an event right before and right after each write to fw_cfg's
//! selector (0x510) and DMA address (0x518), carrying the write's step number
//! (`vmtsync_seabios.c`, docs/firmware.md). A private tracefs instance (x86-tsc) stamps every
//! `kvm_pio` exit of fw_cfg and of PCI configuration space from before QEMU starts, and
//! `vmtsync record --from-memory --guest-phys … --beacon-port … -- qemu…` starts the VMM
//! itself, so every beacon is bracketed. Then:
//! - `vmtsync validate --before/--after` on both ports with the recording's own sync file:
//!   0 violations; the same sync shifted either way: violations (exit 9), so the check can fail;
//! - `trace-cmd report -i HOST_COPY -i GUEST.dat`: SeaBIOS's phases and the host's exits of
//!   fw_cfg and PCI configuration in one report, in seconds, in host time order, each fw_cfg
//!   write's before-event ahead of its exit and its after-event behind it.

use std::path::Path;
use std::time::Duration;

use vmtsync_launch::firmware::{
    self, FW_CFG_CTL_EVENTS, FW_CFG_CTL_PORT, FW_CFG_DMA_EVENTS, FW_CFG_DMA_PORT, MEMORY_MIB,
    PHASE_BEGIN, PHASES, Variant,
};
use vmtsync_launch::qemu::command_firmware;

use crate::causality::{run_validate, shifted};
use crate::firmware::{launch_reader, launched_qemu, seabios_ready, stop_reader, wait_log};
use crate::util::{HostTrace, count_before, scratch, text, trace_cmd, vcpu_thread};

crate::trials!(
    ready; seabios_fw_cfg_writes_validate_against_their_kvm_pio_exits;
);

/// [`seabios_ready`] and a host trace of `kvm_pio`.
fn ready(test: &str) -> bool {
    seabios_ready(test) && crate::util::host_trace_ready(test, "kvm/kvm_pio")
}

/// The host trace's ports: fw_cfg's selector, data and DMA registers, and PCI configuration
/// space's address and data ports (decimal: the tracefs filter's numbers).
const FILTER: &str = "port == 1296 || port == 1297 || (port >= 1300 && port <= 1307) || \
                      (port >= 3320 && port <= 3327)";

/// The seconds of a `trace-cmd report` line (`comm-pid [CPU] 12.345678: …`).
fn seconds(line: &str) -> Option<&str> {
    let rest = line.split_once("] ")?.1;
    let ts = rest.split(':').next()?.trim();
    ts.contains('.').then_some(ts)
}

fn seabios_fw_cfg_writes_validate_against_their_kvm_pio_exits() {
    let test = "seabios_fw_cfg_writes_validate_against_their_kvm_pio_exits";
    let out = firmware::build(Variant::Traced).expect("the traced SeaBIOS builds");
    let dir = scratch(test);
    let path = |name: &str| dir.path().join(name);
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let mut trace = HostTrace::start("fw-validate", "kvm/kvm_pio");
    trace.buffer_kb(16384);
    trace.instance().set_filter("kvm/kvm_pio", FILTER).unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();

    let (log, dat, sync) = (path("debug.log"), path("guest.dat"), path("run.sync"));
    let (host, host_out) = (path("host.dat"), path("host_out.dat"));
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let rec = launch_reader(
        &qemu,
        &dat,
        &[
            "--format",
            "trace-cmd",
            "--sync-out",
            &s(&sync),
            "--host-trace",
            &s(&host),
            "--host-output",
            &s(&host_out),
            "--duration",
            "180",
        ],
        &[],
    );
    let text_log = wait_log(&log, "No bootable device", Duration::from_secs(180));
    let &(_, produced, refused) = firmware::counts_in(&text_log)
        .last()
        .expect("a counts line per boot attempt");
    assert_eq!(refused, 0, "the ring refused records: {text_log}");
    // The host trace is complete (SeaBIOS now waits for ever): extracted before the reader
    // ends, which copies it with the GUEST option.
    trace.extract(&host);
    // The host trace takes every VM's exits on these ports (tests run side by side): name
    // this VM's vCPU thread, read while it runs.
    let tid = vcpu_thread(launched_qemu(&rec)).expect("the vCPU's host thread");
    let (ok, stderr) = stop_reader(rec, &dat);
    println!("SeaBIOS, fw_cfg run: {}", stderr.trim());
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    assert_eq!(
        count_before(&stderr, "bracketed by kvm_pio exits"),
        count_before(&stderr, "beacons ("),
        "every beacon bracketed: {stderr}"
    );
    println!("SeaBIOS: {produced} records produced, {refused} refused");

    // validate: each fw_cfg write's events against its own exit, numbered from QEMU's start
    // (the host trace began before it).
    let rules = [
        (FW_CFG_CTL_EVENTS, FW_CFG_CTL_PORT),
        (FW_CFG_DMA_EVENTS, FW_CFG_DMA_PORT),
    ]
    .map(|((b, a), port)| (format!("{b}:{port:#x}"), format!("{a}:{port:#x}")));
    let validate = |sync: &Path| {
        let mut args = vec![
            "--sync".to_owned(),
            s(sync),
            "--host-trace".to_owned(),
            s(&host),
            "--guest-trace".to_owned(),
            s(&dat),
            "--from-boot".to_owned(),
            "--thread".to_owned(),
            format!("0={tid}"),
        ];
        for (b, a) in &rules {
            args.extend(["--before".to_owned(), b.clone()]);
            args.extend(["--after".to_owned(), a.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_validate(&args)
    };
    let (code, v, err) = validate(&sync);
    println!("validate --sync (record's own), fw_cfg 0x510 and 0x518: {v}");
    let checked = v["checked"].as_u64().unwrap_or(0);
    assert!(checked > 0, "{v} {err}");
    assert_eq!(v["violations"].as_u64(), Some(0), "{v} {err}");
    assert_eq!(v["bound_violations"].as_u64(), Some(0), "{v} {err}");
    assert_eq!(v["unmatched_events"].as_u64(), Some(0), "{v} {err}");
    assert_eq!(code, Some(0), "{err}");
    // A wrong sync is caught: shifted either way by more than any event's lag to its exit
    // plus an interval's width (measured in this run: emulated ring 0 makes lags vary with
    // the load), every event crosses its exit.
    let reach = v["lag"]["max"].as_i64().expect("a lag")
        + v["widths"]["event_max"].as_i64().expect("a width")
        + 1;
    for by in [-reach, reach] {
        let bad = path(&format!("shifted{by}.sync"));
        shifted(&sync, &bad, by);
        let (code, v, err) = validate(&bad);
        println!(
            "validate --sync (shifted by {by} ticks): {} violations of {}",
            v["violations"], v["checked"]
        );
        assert!(v["violations"].as_u64().unwrap_or(0) > 0, "{v} {err}");
        assert_eq!(code, Some(9), "{err}");
    }

    // One report of both files, in seconds of the host's clock, in host time order.
    let rep = trace_cmd(&["report", "-i", &s(&host_out), "-i", &s(&dat)]);
    assert!(rep.status.success(), "report: {}", text(&rep.stderr));
    let report = text(&rep.stdout);
    let lines: Vec<&str> = report.lines().filter(|l| seconds(l).is_some()).collect();
    let mut last = 0u64;
    for l in &lines {
        let ts = seconds(l).unwrap();
        let (sec, frac) = ts.split_once('.').unwrap();
        assert!(frac.len() >= 6, "seconds with a fraction: {l}");
        let ns: u64 = format!("{sec}{frac:0<9}")[..sec.len() + 9].parse().unwrap();
        assert!(ns >= last, "host time order: {l}");
        last = ns;
    }
    // Each phase by its begin (its end is the next one's begin, moments earlier).
    let phase = |l: &&&str| l.contains(&format!("id={PHASE_BEGIN} "));
    let pio = |l: &&&str, port: u16| l.contains(" kvm_pio: ") && l.contains(&format!("{port:#x}"));
    let phase_at: Vec<usize> = (0..lines.len()).filter(|&i| phase(&&lines[i])).collect();
    assert_eq!(phase_at.len(), PHASES.len(), "every phase in the report");
    for port in [FW_CFG_CTL_PORT, FW_CFG_DMA_PORT, 0xcf8, 0xcfc] {
        let at: Vec<usize> = (0..lines.len())
            .filter(|&i| pio(&&lines[i], port))
            .collect();
        assert!(!at.is_empty(), "kvm_pio exits of {port:#x} in the report");
        println!(
            "trace-cmd report: {} kvm_pio lines of port {port:#x}, {}..{} s",
            at.len(),
            seconds(lines[at[0]]).unwrap(),
            seconds(lines[*at.last().unwrap()]).unwrap()
        );
    }
    // Interleaved: exits of PCI configuration space lie between SeaBIOS's phases.
    let between = phase_at
        .windows(2)
        .filter(|w| (w[0]..w[1]).any(|i| pio(&&lines[i], 0xcf8)))
        .count();
    assert!(between > 0, "PCI exits between two phases:\n{report}");
    for (i, l) in lines
        .iter()
        .enumerate()
        .filter(|(i, _)| phase_at.contains(i))
    {
        println!("  phase line {i}: {l}");
    }
    // Each fw_cfg write: its before-event, then the exit, then its after-event, in the report
    // (the guest's events placed by the beacons, the exit as the host kernel stamped it).
    let (before_id, after_id) = FW_CFG_CTL_EVENTS;
    let mut triples = 0;
    for (i, l) in lines.iter().enumerate() {
        if pio(&l, FW_CFG_CTL_PORT) && l.contains("write") {
            let prev = lines[..i].iter().rev().find(|m| {
                m.contains(&format!("id={before_id} ")) || m.contains(&format!("id={after_id} "))
            });
            let next = lines[i + 1..].iter().find(|m| {
                m.contains(&format!("id={before_id} ")) || m.contains(&format!("id={after_id} "))
            });
            if let (Some(p), Some(n)) = (prev, next) {
                triples += 1;
                assert!(
                    p.contains(&format!("id={before_id} "))
                        && n.contains(&format!("id={after_id} ")),
                    "before-event, exit, after-event:\n{p}\n{l}\n{n}"
                );
            }
        }
    }
    println!("trace-cmd report: {triples} fw_cfg selector writes between their two events");
    assert!(triples > 0, "{report}");
}
