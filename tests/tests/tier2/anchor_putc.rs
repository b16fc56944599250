//! Tier 2: exit anchoring of a guest whose Link is an ordinary console `putc` (the bundled
//! agent booted with `uarttx=wait-then-write`: it polls the line status register for THRE
//! before every byte, so status-register exits lie between a probe's TSC read and the `out` of
//! its reply's first byte; issue 17). Every probe's bracket and every reported interval must
//! hold the truth, with `--anchor kvm-pio`, with `--anchor auto`, and on every vCPU.
//!
//! Truth: KVM's mapping of each vCPU (debugfs, read independently of the code under test)
//! composed with the software skew this test derives from the host TSC at boot
//! (`Skew::pick`, `Skew::pick_per_vcpu`: offsets that follow the host's uptime, rate 1.0001).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use vmtsync::kvm::scan::VmSelector;
use vmtsync::link::ConnectOptions;
use vmtsync::link::ProbeAddr;
use vmtsync::link::connect::connect_until_stopped;
use vmtsync::probe::anchor::{AnchorMode, AnchorOptions, anchor_transport};
use vmtsync::probe::{ProbeSession, ProbeSummary, Progress};
use vmtsync::syncfile::AnchorKind;
use vmtsync_core::HostTicks;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{self, Machine};

use crate::util::anchor_ready;

crate::trials!(
    anchor_ready;
    uart_brackets_hold_the_truth_whichever_order_the_link_polls_thre,
    the_cli_anchors_a_putc_guest_and_its_interval_holds_the_truth,
    every_vcpu_of_a_putc_guest_holds_its_truth,
);

const STEP: Duration = Duration::from_secs(20);

/// Sessions per guest: every one must hold the truth.
const SESSIONS: usize = 3;

/// Probes per session.
const PROBES: u32 = 64;

/// The boot option of the defect's guest.
const PUTC: &str = "uarttx=wait-then-write";

/// QEMU microvm with `vcpus` vCPUs running the agent with `append`, COM1 on a socket in
/// `dir`; waits for the socket.
fn boot(dir: &Path, append: &str, vcpus: u32) -> (ChildGuard, PathBuf) {
    let elf = agent_elf().expect("agent builds");
    let sock = dir.join("com1.sock");
    let com2 = dir.join("com2.log");
    let child = qemu::command_com1_socket_smp(Machine::Microvm, &elf, append, &com2, &sock, vcpus)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu starts");
    let guard = ChildGuard::new(child);
    let end = Instant::now() + STEP;
    while !sock.exists() {
        assert!(Instant::now() < end, "QEMU made no {}", sock.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    (guard, sock)
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

/// [`SESSIONS`] anchored UART sessions of [`PROBES`] probes against one guest booted with
/// `order` (a `uarttx=` word, or nothing for the default); every sample's bracket and every
/// session's interval must hold the truth. Returns the samples' bracket widths.
fn uart_sessions(test: &str, order: &str) -> Vec<u64> {
    let tmp = crate::util::scratch(test);
    let skew = Skew::pick();
    // The UART bytes' bracket is under test: without `syncport=off` the agent's default sync
    // port would bracket its probes instead.
    let append = format!(
        "transport=uart exit=9 syncport=off {} {order}",
        skew.agent_option()
    );
    let (guard, sock) = boot(tmp.path(), &append, 1);
    let addr = ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap();
    let connect = ConnectOptions {
        connect_timeout: STEP,
        io_timeout: STEP,
    };
    let anchor = AnchorOptions {
        mode: AnchorMode::KvmPio,
        vm: Some(VmSelector::Pid(guard.pid())),
        ..AnchorOptions::default()
    };
    let mut truth = None;
    let mut widths = Vec::new();
    for k in 0..SESSIONS {
        let inner = connect_until_stopped(&addr, &connect, None).expect("connects");
        let mut t = anchor_transport(inner, &addr, &anchor, STEP, &mut |m| panic!("{m}"))
            .expect("anchoring is possible here");
        let mut s = ProbeSession::hello(&mut t, STEP).expect("hello");
        let samples = s
            .probe_round(PROBES, Duration::ZERO, &mut Progress::hidden())
            .expect("a round");
        let (stats, info) = (s.stats(), *s.info());
        let truth = truth.get_or_insert_with(|| {
            GuestTruth::read(guard.pid(), 0, Some(skew)).expect("truth from debugfs")
        });
        assert_eq!(stats.anchor, AnchorKind::KvmPioUart);
        for x in &samples {
            assert!(
                truth.in_bracket(x.host_send, x.guest, x.host_recv),
                "{order:?} session {k}: guest TSC {} outside its exit bracket [{}, {}] by the \
                 truth ({truth:?})",
                x.guest.0,
                x.host_send.0,
                x.host_recv.0
            );
            widths.push(x.host_recv.0 - x.host_send.0);
        }
        let sum = ProbeSummary::from_samples(&info, &samples, stats)
            .unwrap_or_else(|e| panic!("{order:?} session {k}: {e:?}"));
        let at = truth
            .check(sum.at_host, sum.bound_lo, sum.bound_hi)
            .unwrap_or_else(|e| panic!("{order:?} session {k}: {e}"));
        let a = t.stats();
        println!(
            "{order:?} session {k}: {} samples ({a:?}), interval width {}, error {:+}",
            samples.len(),
            sum.width(),
            i128::from(sum.offset) - at,
        );
        // Most probes found their exits: the defect's guest is anchored, not dropped.
        assert_eq!(samples.len() as u64 + stats.lost_probes, stats.sent);
        assert!(samples.len() >= PROBES as usize / 2, "{stats:?} {a:?}");
    }
    widths
}

/// The UART brackets of the putc guest, and of the default agent (write, then wait for THRE)
/// for comparison, hold the truth in every probe and session; the median bracket widths of
/// both are printed (docs/anchor.md quotes them).
fn uart_brackets_hold_the_truth_whichever_order_the_link_polls_thre() {
    let test = "uart_brackets_hold_the_truth_whichever_order_the_link_polls_thre";
    let _one_instance = vmtsync_tests::anchor_lock();
    for order in [PUTC, ""] {
        let widths = uart_sessions(test, order);
        println!(
            "{order:?}: median UART bracket {} ticks over {} probes (min {}, max {})",
            median(widths.clone()),
            widths.len(),
            widths.iter().min().unwrap(),
            widths.iter().max().unwrap()
        );
    }
}

/// One vCPU's object of `vmtsync probe --json`.
#[derive(Debug)]
struct Row {
    vcpu: u32,
    lo: i64,
    hi: i64,
    at: HostTicks,
    probes: u64,
    anchor: String,
}

/// Runs `vmtsync probe --json` with `args` on `sock`; every stdout line must be a schema-2
/// round object (an `error` object fails the test with its message).
fn probe_cli(sock: &Path, args: &[&str]) -> (Output, Vec<Row>) {
    let o = Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
        .arg("probe")
        .arg("--connect")
        .arg(format!("unix:{}", sock.display()))
        .args(["--json", "--no-progress", "--probes", &PROBES.to_string()])
        .args(["--timeout", "20000", "--connect-timeout", "20000"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("vmtsync runs");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        o.status.success(),
        "{args:?}: {:?}\n{err}\n{text}",
        o.status
    );
    let rows = text
        .lines()
        .map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).expect("one object per line");
            assert_eq!(j["schema"], 2, "{l}");
            assert!(j.get("error").is_none(), "{args:?}: {l}\n{err}");
            let i = |k: &str| j[k].as_i64().unwrap_or_else(|| panic!("{k} in {l}"));
            let u = |k: &str| j[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
            Row {
                vcpu: u32::try_from(u("vcpu")).unwrap(),
                lo: i("bound_lo"),
                hi: i("bound_hi"),
                at: HostTicks(u("at_host_tsc")),
                probes: u("probes"),
                anchor: j["anchor"].as_str().unwrap_or("in-process").to_owned(),
            }
        })
        .collect();
    (o, rows)
}

/// Checks `rows` (one per vCPU in `vcpus`, in order) against each vCPU's truth, all anchored
/// on the UART.
fn check_rows(truths: &[GuestTruth], rows: &[Row], vcpus: &[u32], run: &str) {
    assert_eq!(
        rows.iter().map(|r| r.vcpu).collect::<Vec<_>>(),
        vcpus,
        "{run}"
    );
    for r in rows {
        assert_eq!(r.anchor, AnchorKind::KvmPioUart.name(), "{run}: {r:?}");
        let truth = truths[usize::try_from(r.vcpu).unwrap()];
        let at = truth
            .check(r.at, r.lo, r.hi)
            .unwrap_or_else(|e| panic!("{run}, vCPU {}: {e}", r.vcpu));
        println!(
            "{run}: vCPU {} interval width {}, truth at {:+} from its low end, {} probes",
            r.vcpu,
            r.hi.abs_diff(r.lo),
            at - i128::from(r.lo),
            r.probes
        );
        assert!(r.probes >= u64::from(PROBES) / 2, "{run}: {r:?}");
    }
}

/// Boots the putc guest with `vcpus` vCPUs, each with its own skew, and runs `vmtsync probe`
/// with `--anchor kvm-pio` and then `--anchor auto` (both with `--vm`, and `--all-vcpus` on an
/// SMP guest): every vCPU's interval holds its truth in both, anchored on the UART.
fn cli_runs(test: &str, vcpus: u32) {
    let tmp = crate::util::scratch(test);
    let skews = Skew::pick_per_vcpu(vcpus);
    let options: Vec<String> = (0..vcpus)
        .zip(&skews)
        .map(|(v, s)| s.agent_option_for(v))
        .collect();
    let append = format!(
        "transport=uart exit=9 syncport=off {PUTC} {}",
        options.join(" ")
    );
    let (guard, sock) = boot(tmp.path(), &append, vcpus);
    let pid = guard.pid().to_string();
    let all: Vec<u32> = (0..vcpus).collect();
    let mut every = vec!["--vm", pid.as_str()];
    if vcpus > 1 {
        every.push("--all-vcpus");
    }
    let mut truths = None;
    for mode in ["kvm-pio", "auto"] {
        let mut args = vec!["--anchor", mode];
        args.extend(&every);
        let (o, rows) = probe_cli(&sock, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("not exit-anchored"), "{mode}: {err}");
        let truths = truths.get_or_insert_with(|| {
            (0..vcpus)
                .zip(&skews)
                .map(|(v, s)| GuestTruth::read(guard.pid(), v, Some(*s)).expect("debugfs truth"))
                .collect::<Vec<_>>()
        });
        let vs = if vcpus > 1 { &all[..] } else { &all[..1] };
        check_rows(
            truths,
            &rows,
            vs,
            &format!("--anchor {mode}, {vcpus} vCPUs"),
        );
    }
}

/// `vmtsync probe --anchor kvm-pio` and `--anchor auto` on the putc guest.
fn the_cli_anchors_a_putc_guest_and_its_interval_holds_the_truth() {
    let test = "the_cli_anchors_a_putc_guest_and_its_interval_holds_the_truth";
    let _one_instance = vmtsync_tests::anchor_lock();
    cli_runs(test, 1);
}

/// The same on every vCPU of a two-vCPU putc guest (`--all-vcpus`): the application
/// processor's read lies between the boot vCPU's request and reply exits (docs/smp.md).
fn every_vcpu_of_a_putc_guest_holds_its_truth() {
    let test = "every_vcpu_of_a_putc_guest_holds_its_truth";
    let _one_instance = vmtsync_tests::anchor_lock();
    cli_runs(test, 2);
}
