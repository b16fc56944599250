//! Tier 2: SeaBIOS's spans. The function-tracing build (`vmtsync_launch::firmware::Variant::
//! Functions`: all of its 32-bit flat code but the recorder, headers and `stacks.c` built with
//! `-finstrument-functions`, POST phases as spans, a relocation record where SeaBIOS moves its
//! init code) and the hung build (the same, stopping for ever inside `ps2port_setup` during
//! device setup) boot under QEMU `-M pc` with KVM, started by `vmtsync record --from-memory -- qemu…`
//! so that every beacon is bracketed.
//!
//! The truth is the firmware's, the image's and KVM's, never the reader's: the firmware's own
//! produced count (its debug console) accounts for every record; its debug console's
//! `Relocating init from L to R (size N)` line is what the relocation record must say; every
//! function address, with the relocation undone, must be a function symbol of the image
//! (`nm out/rom.o`); and KVM's mapping of vCPU 0 (debugfs) gives each event's exact host time,
//! which its interval must hold. `vmtsync spans` then pairs and names the recording: its
//! counts must be the ones this test finds by pairing the records itself, every exit has its
//! entry or is marked open, the spans' ends hold the truth, and the hung build's open spans
//! are where it hangs.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use vmtsync_core::recorder::span::{SpanRecord, decode};
use vmtsync_core::recorder::{FUNC_ENTRY_ID, FUNC_EXIT_ID, RELOC_ID, SPAN_BEGIN_ID, SPAN_END_ID};
use vmtsync_launch::firmware::BOOT_EVENT;
use vmtsync_launch::firmware::{
    self, HUNG_IN, MEMORY_MIB, PHASE_BEGIN, PHASE_END, PHASES, Variant,
};
use vmtsync_launch::qemu::{command_firmware, command_firmware_resets, qmp_execute, qmp_hmp};
use vmtsync_tests::require;
use vmtsync_tests::truth::truth_mapping;

use crate::firmware::{
    assert_holds_truth, expected_phase_events, launch_reader, launched_qemu, payload, phase_event,
    seabios_ready, stop_reader, wait_log,
};
use crate::util::{count_before, have_program, lines_of, scratch, text, u, vmtsync};

crate::trials!(
    ready; seabios_function_tracing_records_every_entry_and_exit_at_its_host_time,
    seabios_hung_in_post_leaves_its_last_functions_open,
    seabios_function_tracing_starts_afresh_after_a_reset;
);

/// [`seabios_ready`], and `nm` for the image's symbols.
fn ready(test: &str) -> bool {
    seabios_ready(test)
        && require(
            test,
            have_program("nm"),
            "`nm` is missing (apt-get install binutils)",
        )
}

/// The longest wait for a traced POST: every function entry and exit costs an emulated ring-0
/// store sequence on this project's nested hosts.
const POST_LIMIT: Duration = Duration::from_secs(600);

/// The image's function symbols (`nm`'s `t`/`T` lines of `rom.o`), by address.
fn symbols(rom: &Path) -> BTreeMap<u64, String> {
    let o = std::process::Command::new("nm")
        .arg(rom)
        .output()
        .expect("nm runs");
    assert!(o.status.success(), "nm {}", rom.display());
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (addr, kind, name) = (w.next()?, w.next()?, w.next()?);
            matches!(kind, "t" | "T")
                .then(|| Some((u64::from_str_radix(addr, 16).ok()?, name.to_owned())))?
        })
        .collect()
}

/// A recording's span records, decoded, with their JSON lines' indices; every record with a
/// span id must decode.
fn spans(lines: &[serde_json::Value]) -> Vec<(usize, SpanRecord)> {
    let span_ids = [
        SPAN_BEGIN_ID,
        SPAN_END_ID,
        FUNC_ENTRY_ID,
        FUNC_EXIT_ID,
        RELOC_ID,
    ]
    .map(u64::from);
    lines
        .iter()
        .enumerate()
        .filter(|(_, v)| span_ids.contains(&u(v, "id")))
        .map(|(i, v)| {
            let id = u16::try_from(u(v, "id")).unwrap();
            let p = payload(v);
            if id == FUNC_ENTRY_ID || id == FUNC_EXIT_ID {
                assert_eq!(p.len(), 8, "32-bit code: 4-byte addresses: {v}");
            }
            (
                i,
                decode(id, &p).unwrap_or_else(|| panic!("a span record: {v}")),
            )
        })
        .collect()
}

/// What a function record says once the relocation is undone: the image's symbol.
struct Names {
    syms: BTreeMap<u64, String>,
    reloc: Option<(u64, u64, u64)>,
}

impl Names {
    /// The symbol at `addr` (a runtime address), or `None` when no function starts there.
    fn name(&self, addr: u64) -> Option<&str> {
        let linked = match self.reloc {
            Some((link, runtime, len)) if (runtime..runtime + len).contains(&addr) => {
                addr - runtime + link
            }
            _ => addr,
        };
        self.syms.get(&linked).map(String::as_str)
    }
}

/// Pairs entries with exits as the host's rule does (one stack; an exit closes the nearest
/// frame of its function from the top, abandoning the frames above it; an exit with no frame
/// is an orphan): `(pairs, orphans, abandoned, the stack left at the end)`.
fn pair(spans: &[(usize, SpanRecord)]) -> (usize, usize, usize, Vec<u64>) {
    let (mut pairs, mut orphans, mut abandoned) = (0, 0, 0);
    let mut stack: Vec<u64> = Vec::new();
    for (_, s) in spans {
        match *s {
            SpanRecord::Entry { func, .. } => stack.push(func),
            SpanRecord::Exit { func, .. } => match stack.iter().rposition(|&f| f == func) {
                Some(at) => {
                    abandoned += stack.len() - at - 1;
                    stack.truncate(at);
                    pairs += 1;
                }
                None => orphans += 1,
            },
            _ => {}
        }
    }
    (pairs, orphans, abandoned, stack)
}

/// `vmtsync spans --from JSONL --symbols rom.o --out …`: its report and its spans.
fn run_spans(jsonl: &Path, rom: &Path) -> (String, Vec<serde_json::Value>) {
    let out = jsonl.with_extension("spans.jsonl");
    let o = vmtsync()
        .args(["spans", "--from"])
        .arg(jsonl)
        .arg("--symbols")
        .arg(rom)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("vmtsync spans runs");
    assert!(o.status.success(), "vmtsync spans: {}", text(&o.stderr));
    (text(&o.stdout), lines_of(&out))
}

/// The names the report lists as open when the recording ended, outermost first, with their
/// kind (`phase` or `function`).
fn open_at_end(report: &str) -> Vec<(String, String)> {
    report
        .lines()
        .skip_while(|l| !l.starts_with("open when the recording ended"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| {
            let rest = l.split_once("vCPU 0 ")?.1;
            let mut w = rest.split_whitespace();
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .collect()
}

/// Checks `vmtsync spans`' spans: each is closed (both ends, in order), open (its entry only)
/// or an orphan (its exit only); every end's guaranteed interval holds its exact host time
/// under `kvm`; returns the count of each (state, kind).
fn check_spans(
    spans: &[serde_json::Value],
    kvm: &vmtsync_core::mapping::KvmTscMapping,
) -> BTreeMap<(String, String), u64> {
    let mut counts = BTreeMap::new();
    for s in spans {
        let state = s["state"].as_str().expect("a state").to_owned();
        let kind = s["kind"].as_str().expect("a kind").to_owned();
        let (b, e) = (&s["begin"], &s["end"]);
        match state.as_str() {
            "closed" => assert!(
                !b.is_null() && !e.is_null() && u(b, "host_tsc") <= u(e, "host_tsc"),
                "{s}"
            ),
            "open" => assert!(!b.is_null() && e.is_null(), "{s}"),
            "orphan" => assert!(b.is_null() && !e.is_null(), "{s}"),
            other => panic!("state {other}: {s}"),
        }
        for end in [b, e].into_iter().filter(|x| !x.is_null()) {
            let g = vmtsync_core::GuestTicks(u(end, "guest_tsc"));
            let x = kvm.try_host_from_guest_ceil(g).expect("in range").0;
            let y = kvm.try_host_from_guest_floor(g).expect("in range").0;
            assert!(
                u(end, "lo") <= x.min(y) && x.max(y) <= u(end, "hi"),
                "a span's end misses its exact host time [{x}, {y}]: {s}"
            );
        }
        if kind == "function" {
            let name = s["name"].as_str().unwrap_or("");
            assert!(!name.starts_with("0x"), "every function named: {s}");
        }
        *counts.entry((state, kind)).or_insert(0) += 1;
    }
    counts
}

fn seabios_function_tracing_records_every_entry_and_exit_at_its_host_time() {
    let test = "seabios_function_tracing_records_every_entry_and_exit_at_its_host_time";
    let out = firmware::build(Variant::Functions).expect("the function-tracing SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let jsonl = dir.path().join("functions.jsonl");
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let started = Instant::now();
    let rec = launch_reader(
        &qemu,
        &jsonl,
        &["--format", "jsonl", "--duration", "900"],
        &[],
    );
    let text_log = wait_log(&log, "No bootable device", POST_LIMIT);
    let post = started.elapsed();
    let kvm = truth_mapping(launched_qemu(&rec), 0).expect("truth from debugfs");
    let counts = firmware::counts_in(&text_log);
    let &(_, produced, refused) = counts.last().expect("a counts line per boot attempt");
    assert_eq!(refused, 0, "a flight ring refuses nothing: {text_log}");
    let reloc = firmware::reloc_in(&text_log).expect("SeaBIOS's relocation line");
    let (ok, stderr) = stop_reader(rec, &jsonl);
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    println!("SeaBIOS with function tracing: {}", stderr.trim());

    let lines = lines_of(&jsonl);
    // Every record the firmware stored is accounted for (the hooks stop at the first boot
    // attempt, so the last counts line is final).
    let beacons = count_before(&stderr, "beacons (");
    let overwritten = count_before(&stderr, "overwritten,");
    assert_eq!(
        lines.len() as u64 + beacons + overwritten,
        produced,
        "events + beacons + overwritten = the firmware's produced count: {stderr}"
    );
    assert_eq!(
        count_before(&stderr, "bracketed by kvm_pio exits"),
        beacons,
        "every beacon bracketed: {stderr}"
    );
    assert!(stderr.contains("0 disagree with KVM's mapping"), "{stderr}");

    let spans = spans(&lines);
    // The phases, in order, amid the functions.
    let phases: Vec<(bool, String)> = lines.iter().filter_map(phase_event).collect();
    assert_eq!(
        phases,
        expected_phase_events(),
        "every phase begins and ends"
    );
    // One relocation, saying what SeaBIOS printed.
    let relocs: Vec<(u64, u64, u64)> = spans
        .iter()
        .filter_map(|(_, s)| match *s {
            SpanRecord::Reloc { link, runtime, len } => Some((link, runtime, u64::from(len))),
            _ => None,
        })
        .collect();
    assert_eq!(relocs, [reloc], "the relocation record is the printed one");
    // Every function address names a function of the image, the relocation undone.
    let names = Names {
        syms: symbols(&out.join("rom.o")),
        reloc: Some(reloc),
    };
    let (mut entries, mut exits, mut relocated) = (0u64, 0u64, 0u64);
    for (i, s) in &spans {
        let (SpanRecord::Entry { func, .. } | SpanRecord::Exit { func, .. }) = *s else {
            continue;
        };
        if matches!(s, SpanRecord::Entry { .. }) {
            entries += 1;
        } else {
            exits += 1;
        }
        relocated += u64::from((reloc.1..reloc.1 + reloc.2).contains(&func));
        assert!(
            names.name(func).is_some(),
            "function {func:#x} is no symbol of rom.o (relocation {reloc:x?}): {}",
            lines[*i]
        );
    }
    assert!(
        entries > 1000 && exits > 1000,
        "{entries} entries, {exits} exits"
    );
    assert!(relocated > 0, "functions ran in the relocated init code");
    let (pairs, orphans, abandoned, open) = pair(&spans);
    let open_names: Vec<&str> = open.iter().filter_map(|&f| names.name(f)).collect();
    println!(
        "SeaBIOS POST to its first boot attempt: {entries} function entries, {exits} exits \
         ({pairs} paired, {orphans} exits without an entry and {abandoned} entries without an exit \
         from cooperative threads), open at the end: {open_names:?}; {} events in all, \
         {produced} records produced, {overwritten} overwritten; wall clock to \"No bootable \
         device\": {:.1} s; {relocated} records in the relocated init code",
        lines.len(),
        post.as_secs_f64()
    );
    // The hooks stop at the first boot attempt, inside do_boot, which POST's main function
    // reached through startBoot: those frames stay open.
    assert_eq!(open_names.last(), Some(&"do_boot"), "{open_names:?}");
    assert!(open_names.contains(&"maininit"), "{open_names:?}");
    assert!(
        pairs as u64 > entries * 9 / 10,
        "{pairs} of {entries} paired"
    );

    for v in &lines {
        assert_holds_truth(v, &kvm, "function tracing");
    }
    let ticks: Vec<u64> = lines.iter().map(|v| u(v, "guest_tsc")).collect();
    assert!(ticks.windows(2).all(|w| w[0] <= w[1]), "records in order");

    // `vmtsync spans`: the same pairing, every exit with its entry or marked open, the
    // relocation stated, every function named, every end's interval holding the truth.
    let (report, spans) = run_spans(&jsonl, &out.join("rom.o"));
    println!("vmtsync spans:\n{report}");
    let (link, runtime, len) = reloc;
    assert!(
        report.contains(&format!(
            "relocation: code linked at {link:#x}..{:#x} runs at {runtime:#x}..",
            link + len
        )),
        "{report}"
    );
    let counts = check_spans(&spans, &kvm);
    let n = |state: &str, kind: &str| {
        counts
            .get(&(state.to_owned(), kind.to_owned()))
            .copied()
            .unwrap_or(0)
    };
    assert_eq!(n("closed", "function"), pairs as u64, "{counts:?}");
    assert_eq!(n("orphan", "function"), orphans as u64, "{counts:?}");
    assert_eq!(
        n("open", "function"),
        (abandoned + open.len()) as u64,
        "{counts:?}"
    );
    // Every exit is a closed span's end or an orphan; every entry a closed span's begin or open.
    assert_eq!(n("closed", "function") + n("orphan", "function"), exits);
    assert_eq!(n("closed", "function") + n("open", "function"), entries);
    let phase_spans: Vec<(&str, u64)> = spans
        .iter()
        .filter(|s| s["kind"] == "phase")
        .map(|s| (s["name"].as_str().unwrap_or(""), u(s, "depth")))
        .collect();
    let want: Vec<(&str, u64)> = PHASES.iter().map(|p| (*p, 0)).collect();
    assert_eq!(
        phase_spans, want,
        "every phase a closed span, at depth 0, in order"
    );
    assert_eq!(n("closed", "phase"), PHASES.len() as u64);
    let listed: Vec<String> = open_at_end(&report).into_iter().map(|(_, n)| n).collect();
    assert_eq!(
        listed, open_names,
        "the report's open spans are the stack left at the end"
    );
}

/// Waits until the hung build's vCPU halts with interrupts off (QEMU's `info registers`:
/// `HLT=1` with EFLAGS.IF clear): SeaBIOS runs its 32-bit code with interrupts off and halts
/// with them on when it waits, so this is the hang and nothing else.
fn wait_hung(qmp: &Path, limit: Duration) -> String {
    let end = Instant::now() + limit;
    loop {
        let regs = qmp_hmp(qmp, "info registers", Duration::from_secs(20)).unwrap_or_default();
        let eflags = regs
            .split("EFL=")
            .nth(1)
            .and_then(|r| u64::from_str_radix(r.get(..8)?, 16).ok());
        if regs.contains("HLT=1") && eflags.is_some_and(|f| f & 0x200 == 0) {
            return regs;
        }
        assert!(
            Instant::now() < end,
            "the hung SeaBIOS never halted with interrupts off within {limit:?}:\n{regs}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn seabios_hung_in_post_leaves_its_last_functions_open() {
    let test = "seabios_hung_in_post_leaves_its_last_functions_open";
    let out = firmware::build(Variant::Hung).expect("the hung SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let qmp = dir.path().join("qmp.sock");
    let jsonl = dir.path().join("hung.jsonl");
    let qemu = command_firmware(&out.join("bios.bin"), &log, MEMORY_MIB);
    let rec = launch_reader(
        &qemu,
        &jsonl,
        &["--format", "jsonl", "--duration", "900"],
        &[
            "-qmp".to_owned(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ],
    );
    let regs = wait_hung(&qmp, POST_LIMIT);
    let kvm = truth_mapping(launched_qemu(&rec), 0).expect("truth from debugfs");
    // The ring's head no longer moves: the reader's last drain (on SIGINT) takes every record.
    let (ok, stderr) = stop_reader(rec, &jsonl);
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    println!("hung SeaBIOS: {}", stderr.trim());
    let text_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        firmware::counts_in(&text_log).is_empty() && !text_log.contains("No bootable device"),
        "POST never reached a boot attempt:\n{text_log}"
    );
    let reloc = firmware::reloc_in(&text_log).expect("SeaBIOS's relocation line");
    let lines = lines_of(&jsonl);
    assert!(!lines.is_empty(), "{stderr}");
    let spans = spans(&lines);

    // The phases up to the hung one begin and end in order; the hung one ("devices") begins and
    // never ends.
    let (hung_fn, hung_phase) = HUNG_IN;
    let upto = PHASES.iter().position(|p| *p == hung_phase).unwrap();
    let mut want = expected_phase_events();
    want.truncate(2 * upto + 1);
    let phases: Vec<(bool, String)> = lines.iter().filter_map(phase_event).collect();
    assert_eq!(phases, want, "phases up to the hang; the last one open");
    assert_eq!(
        u(
            lines
                .iter()
                .rev()
                .find(|v| phase_event(v).is_some())
                .unwrap(),
            "id"
        ),
        u64::from(PHASE_BEGIN)
    );
    assert!(lines.iter().all(|v| u(v, "id") != u64::from(PHASE_END)
        || phase_event(v).is_some_and(|(_, n)| n != hung_phase)));

    // Its last records: the entry of the function it hangs in, whose exit never comes, nested
    // in the device setup and POST's main function, all open.
    let names = Names {
        syms: symbols(&out.join("rom.o")),
        reloc: Some(reloc),
    };
    let last = spans.last().expect("span records").1;
    let SpanRecord::Entry { func, .. } = last else {
        panic!("the last record is an entry: {last:?}");
    };
    assert_eq!(names.name(func), Some(hung_fn), "{last:?}");
    let (pairs, orphans, abandoned, open) = pair(&spans);
    let open_names: Vec<&str> = open.iter().filter_map(|&f| names.name(f)).collect();
    assert_eq!(
        open.len(),
        open_names.len(),
        "every open frame names a function"
    );
    println!(
        "hung SeaBIOS: {} events, {pairs} calls paired, {orphans} orphan exits, {abandoned} \
         abandoned entries; open at the end (outermost first): {open_names:?}; vCPU: {}",
        lines.len(),
        regs.lines()
            .find(|l| l.contains("HLT="))
            .unwrap_or("")
            .trim()
    );
    assert_eq!(open_names.last(), Some(&hung_fn), "{open_names:?}");
    for f in ["maininit", "device_hardware_setup"] {
        assert!(open_names.contains(&f), "{f} open: {open_names:?}");
    }
    for v in &lines {
        assert_holds_truth(v, &kvm, "hung");
    }

    // `vmtsync spans` shows where it hangs: open at the end, outermost first, the hung phase
    // and the functions down to the one it hangs in.
    let (report, spans) = run_spans(&jsonl, &out.join("rom.o"));
    println!("vmtsync spans:\n{report}");
    check_spans(&spans, &kvm);
    let listed = open_at_end(&report);
    let functions: Vec<&str> = listed
        .iter()
        .filter(|(k, _)| k == "function")
        .map(|(_, n)| n.as_str())
        .collect();
    assert_eq!(functions, open_names, "{report}");
    assert!(
        listed.contains(&("phase".to_owned(), hung_phase.to_owned())),
        "{report}"
    );
    assert!(
        spans
            .iter()
            .any(|s| s["kind"] == "phase" && s["name"] == hung_phase && s["state"] == "open"),
        "the hung phase is an open span"
    );
}

/// The function hooks across a reset in the middle of POST: RAM at 16 MiB still holds the
/// first boot's recorder, and QEMU leaves SeaBIOS's shadowed BIOS data as it was (the hooks'
/// flag set), so SeaBIOS's reboot path (`handle_resume32`, which restores its pristine image and
/// resets again) would record into the old recording, with the reset TSC, unless the glue turns
/// the hooks off there. The first boot's records stay in order and on KVM's mapping of that
/// boot; the second POST is recorded afresh (new nonce) and accounted for by its own counts.
fn seabios_function_tracing_starts_afresh_after_a_reset() {
    let test = "seabios_function_tracing_starts_afresh_after_a_reset";
    let out = firmware::build(Variant::Functions).expect("the function-tracing SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let qmp = dir.path().join("qmp.sock");
    let jsonl = dir.path().join("reset.jsonl");
    let err = jsonl.with_extension("stderr");
    let qemu = command_firmware_resets(&out.join("bios.bin"), &log, MEMORY_MIB, true);
    let mut rec = launch_reader(
        &qemu,
        &jsonl,
        &["--format", "jsonl", "--duration", "900"],
        &[
            "-qmp".to_owned(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ],
    );
    // Mid-POST: the init code has moved and the hooks are recording.
    crate::memory_reset::wait_log(&log, firmware::RELOC_LINE, 1, POST_LIMIT, &mut rec, &err);
    let pid = launched_qemu(&rec);
    let kvm0 = truth_mapping(pid, 0).expect("truth from debugfs");
    qmp_execute(&qmp, "system_reset", Duration::from_secs(20)).expect("QEMU resets");
    let done = "No bootable device";
    let text_log = crate::memory_reset::wait_log(&log, done, 1, POST_LIMIT, &mut rec, &err);
    let kvm1 = truth_mapping(pid, 0).expect("truth from debugfs");
    let (ok, stderr) = stop_reader(rec, &jsonl);
    assert!(ok, "record --from-memory -- qemu: {stderr}");
    println!(
        "SeaBIOS with function tracing, reset mid-POST: {}",
        stderr.trim()
    );
    assert!(stderr.contains(" 0 ambiguous across"), "{stderr}");
    let lines = lines_of(&jsonl);
    let func_ids = [FUNC_ENTRY_ID, FUNC_EXIT_ID].map(u64::from);
    let boot = |b: u64| -> Vec<&serde_json::Value> {
        lines
            .iter()
            .filter(|v| v.get("boot").and_then(serde_json::Value::as_u64) == Some(b))
            .collect()
    };
    let (first, second) = (boot(0), boot(1));
    assert_eq!(
        first.len() + second.len(),
        lines.len(),
        "two boots: {stderr}"
    );
    // The first boot: cut short, its records in order on its own mapping (a record from the
    // reboot path would carry the reset TSC: out of order, off this mapping).
    let ticks: Vec<u64> = first.iter().map(|v| u(v, "guest_tsc")).collect();
    assert!(
        ticks.windows(2).all(|w| w[0] <= w[1]),
        "boot 0's records in order"
    );
    for v in &first {
        assert_holds_truth(v, &kvm0, "boot 0");
    }
    let f0 = first
        .iter()
        .filter(|v| func_ids.contains(&u(v, "id")))
        .count();
    assert!(f0 > 0, "the hooks recorded before the reset");
    // Nothing of the reboot path after the reset (QEMU's reset need not reset the TSC, so
    // order and mapping alone cannot tell): no function of it in the first boot's records.
    let names = Names {
        syms: symbols(&out.join("rom.o")),
        reloc: firmware::reloc_in(&text_log),
    };
    let reboot_path = ["handle_resume32", "tryReboot", "qemu_reboot"];
    let leaked: Vec<&str> = first
        .iter()
        .filter(|v| func_ids.contains(&u(v, "id")))
        .filter_map(|v| {
            let p = payload(v);
            names.name(u64::from(u32::from_le_bytes(p.get(..4)?.try_into().ok()?)))
        })
        .filter(|n| reboot_path.contains(n))
        .collect();
    assert!(
        leaked.is_empty(),
        "the reboot path recorded into boot 0: {leaked:?}"
    );
    // The second: whole, its first record its first phase's begin, every record accounted for.
    assert_eq!(
        second.first().and_then(|v| phase_event(v)),
        Some((true, PHASES[0].to_owned())),
        "boot 1's first record"
    );
    let phases: Vec<(bool, String)> = second.iter().filter_map(|v| phase_event(v)).collect();
    assert_eq!(phases, expected_phase_events(), "boot 1: every phase");
    let f1 = second
        .iter()
        .filter(|v| func_ids.contains(&u(v, "id")))
        .count();
    assert!(f1 > 1000, "boot 1: {f1} function records");
    let first_boot = second
        .iter()
        .position(|v| u(v, "id") == u64::from(BOOT_EVENT))
        .expect("a boot attempt");
    assert!(
        second[first_boot..]
            .iter()
            .all(|v| !func_ids.contains(&u(v, "id"))),
        "boot 1: no function record after the first boot attempt"
    );
    let &(_, produced, refused) = firmware::counts_in(&text_log)
        .last()
        .expect("a counts line");
    assert_eq!(refused, 0);
    let (_, beacons, overwritten) = crate::memory_reset::boot_counts(&stderr, 1);
    assert_eq!(
        second.len() as u64 + beacons + overwritten,
        produced,
        "boot 1: events + beacons + overwritten = its produced count: {stderr}"
    );
    for v in &second {
        assert_holds_truth(v, &kvm1, "boot 1");
    }
    println!(
        "reset mid-POST: boot 0 {} events ({f0} function records) before the reset; boot 1 {} \
         events ({f1} function records), {produced} records produced",
        first.len(),
        second.len()
    );
}
