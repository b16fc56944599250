//! `vmtsync validate --probe-log` on a real run (tier 2): the agent under QEMU answers
//! `vmtsync probe --continuous --probe-log` while a private tracefs instance records the
//! `kvm_pio` exits of its UART. Truth comes from the host kernel's exit stamps, which the sync
//! code of this run never read (its own anchor instance is another one): each logged probe's
//! guest TSC, converted with the sync file, must lie between the exits around its read, and a
//! sync file shifted by one bracket width either way must be caught on the probes. The agent
//! also brackets each read with its sync port, so the same probes are paired through the
//! sync-port matcher too.

use std::path::Path;

use serde_json::Value;
use vmtsync_tests::truth::Skew;

use crate::causality::{run_validate, shifted};
use crate::util::{HostTrace, boot_qemu, qemu_pio_trace_ready, text, wait_vcpu_thread};
use crate::util::{guarded_output, vmtsync};

crate::trials!(
    qemu_pio_trace_ready;
    a_real_runs_probes_validate_and_a_shifted_sync_file_is_caught_on_them,
);

/// Continuous-mode rounds (64 probes each).
const ROUNDS: &str = "4";
/// The agent's sync port (its default, docs/anchor.md).
const SYNC_PORT: u16 = 0x2400;

/// `vmtsync validate --probe-log`'s JSON report and exit code.
fn validate(sync: &Path, host: &Path, log: &Path, thread: u64) -> (Option<i32>, Value, String) {
    run_validate(&[
        "--sync",
        sync.to_str().unwrap(),
        "--host-trace",
        host.to_str().unwrap(),
        "--probe-log",
        log.to_str().unwrap(),
        "--thread",
        &format!("0={thread}"),
    ])
}

/// `vmtsync probe --continuous` on `sock`, anchored as `anchor` says, logging its probes.
fn probe(sock: &Path, vm: u32, anchor: &str, sync: &Path, log: &Path) {
    let o = guarded_output(
        vmtsync().args([
            "probe",
            "--connect",
            &format!("unix:{}", sock.display()),
            "--continuous",
            "--out",
            sync.to_str().unwrap(),
            "--rounds",
            ROUNDS,
            "--resync",
            "200",
            "--timeout",
            "10000",
            "--no-progress",
            "--anchor",
            anchor,
            "--vm",
            &vm.to_string(),
            "--probe-log",
            log.to_str().unwrap(),
        ]),
        b"",
    );
    assert_eq!(o.status.code(), Some(0), "probe: {}", text(&o.stderr));
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Identity rate with a non-zero software offset: the exit-anchored sync file passes on every
/// probe; shifted by one bracket width either way it fails (exit 9) on the probes. The same
/// VM probed with in-process stamps is reported for comparison, never with a false bound.
fn a_real_runs_probes_validate_and_a_shifted_sync_file_is_caught_on_them() {
    let test = "validate::a_real_runs_probes_validate_and_a_shifted_sync_file_is_caught_on_them";
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-validate-probes-")
        .tempdir()
        .unwrap();
    // The host's own record of the UART's exits (the data port and the status registers the
    // agent polls) and of the sync port, on from before boot, in a buffer no probe session
    // overflows.
    let mut trace = HostTrace::start("validate-probes", "kvm/kvm_pio");
    trace.buffer_kb(8192);
    trace
        .instance()
        .set_filter(
            "kvm/kvm_pio",
            &format!("(port >= 0x3f8 && port <= 0x3ff) || port == {SYNC_PORT:#x}"),
        )
        .unwrap();
    trace.instance().enable("kvm/kvm_pio").unwrap();
    let skew = Skew(vmtsync_core::mapping::KvmTscMapping::offset_only(
        Skew::pick().0.offset(),
    ));
    let (qemu_guard, sock) = boot_qemu(
        dir.path(),
        &format!(
            "transport=uart exit=0 syncport={SYNC_PORT:#x} {}",
            skew.agent_option()
        ),
    );
    let thread = wait_vcpu_thread(qemu_guard.pid());
    let (sync, log) = (
        dir.path().join("sync.jsonl"),
        dir.path().join("probes.jsonl"),
    );
    probe(&sock, qemu_guard.pid(), "kvm-pio", &sync, &log);
    let (sync_ip, log_ip) = (
        dir.path().join("sync-in-process.jsonl"),
        dir.path().join("probes-in-process.jsonl"),
    );
    probe(&sock, qemu_guard.pid(), "none", &sync_ip, &log_ip);
    drop(qemu_guard);
    let host = dir.path().join("host.dat");
    trace.extract(&host);

    let logged = lines(&log);
    // The agent announced its sync port in the hello, so `--anchor kvm-pio` on the serial
    // chardev brackets every probe there (docs/anchor.md, "The sync port on a serial chardev").
    assert!(
        logged
            .iter()
            .all(|p| p["anchor"] == "kvm-pio-sync-port" && p["path"] == "sync-port"),
        "{logged:?}"
    );
    let (code, v, err) = validate(&sync, &host, &log, thread);
    eprintln!("{test}: validate: {v}");
    assert_eq!(code, Some(0), "validate: {err} {v}");
    let p = &v["probes"];
    assert_eq!(p["logged"].as_u64(), Some(logged.len() as u64), "{v}");
    // The host trace saw every exit the session's own anchor matched.
    assert_eq!(p["checked"], p["logged"], "{v}");
    assert!(p["checked"].as_u64().unwrap() >= 200, "{v}");
    assert_eq!(
        (&p["violations"], &p["bound_violations"]),
        (&0.into(), &0.into())
    );

    let width = lines(&sync)
        .iter()
        .filter(|s| s["type"] == "segment")
        .map(|s| s["offset_hi"].as_i64().unwrap() - s["offset_lo"].as_i64().unwrap())
        .max()
        .unwrap();
    for by in [width, -width] {
        let bad = dir.path().join(format!("shifted{by}.jsonl"));
        shifted(&sync, &bad, by);
        let (code, v, err) = validate(&bad, &host, &log, thread);
        eprintln!("{test}: shifted by {by}: {}", v["probes"]);
        assert_eq!(code, Some(9), "shifted by {by}: {err} {v}");
        assert!(v["probes"]["violations"].as_u64().unwrap() > 0, "{v}");
    }

    // The same probes through the UART matcher: the request's `in`s and the reply's `out`s,
    // a bracket around the sync port's. Every probe pairs; the guaranteed bounds hold the
    // truth, so they meet every bracket; where the estimate falls in this wider one is
    // reported.
    let by_uart = dir.path().join("probes-uart.jsonl");
    let rewritten: String = logged
        .iter()
        .map(|p| {
            let mut p = p.clone();
            p["path"] = "uart".into();
            p["port"] = vmtsync::exits::COM1_DATA.into();
            format!("{p}\n")
        })
        .collect();
    std::fs::write(&by_uart, rewritten).unwrap();
    let (code, v, err) = validate(&sync, &host, &by_uart, thread);
    eprintln!("{test}: through the UART: {}", v["probes"]);
    assert!(matches!(code, Some(0 | 9)), "validate: {err} {v}");
    assert_eq!(v["probes"]["checked"], v["probes"]["logged"], "{v}");
    assert_eq!(v["probes"]["bound_violations"], 0, "{v}");

    // In-process stamps: the guaranteed bounds hold the truth, so they always meet the exit
    // bracket; where the estimate falls is reported.
    let (code, v, err) = validate(&sync_ip, &host, &log_ip, thread);
    eprintln!("{test}: in-process: {}", v["probes"]);
    assert!(matches!(code, Some(0 | 9)), "validate: {err} {v}");
    assert_eq!(v["probes"]["checked"], v["probes"]["logged"], "{v}");
    assert_eq!(v["probes"]["bound_violations"], 0, "{v}");
}
