//! Tier 2: exit-anchored probing (`--anchor kvm-pio`) on real KVM with QEMU: the agent on a
//! QEMU serial chardev socket, its COM1 exits read from a private tracefs instance.
//!
//! Truth: KVM's mapping of QEMU's vCPU (debugfs) composed with the agent's software skew
//! (`Skew::pick()`: an offset derived from the host TSC now, rate 1.0001), so the anchored
//! brackets must contain a line that is not "offset 0, rate 1". Every sample's bracket and
//! every session's guaranteed interval are checked against it; the instance must be gone
//! afterwards, also after SIGINT.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmtsync::kvm::scan::VmSelector;
use vmtsync::link::ConnectOptions;
use vmtsync::link::ProbeAddr;
use vmtsync::link::connect::connect_until_stopped;
use vmtsync::probe::anchor::{AnchorMode, AnchorOptions, anchor_transport};
use vmtsync::probe::{ProbeSession, ProbeSummary, Progress};
use vmtsync::syncfile::AnchorKind;
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{self, Machine};
use vmtsync_tests::{ChildGuard, require};

use crate::util::anchor_ready;

crate::trials!(
    anchor_ready;
    anchored_probes_bracket_a_skewed_truth_in_every_session,
    sigint_during_an_anchored_run_removes_the_instance,
    boot_vcpu_sync_port_brackets_in_ring_0_hold_a_skewed_truth;
    anchor_qboot_ready;
    sync_port_anchored_probes_over_vsock_bracket_a_skewed_truth,
);

/// The vsock test's prerequisites: [`anchor_ready`] and QEMU's qboot firmware.
fn anchor_qboot_ready(test: &str) -> bool {
    anchor_ready(test)
        && require(
            test,
            Path::new(qemu::QBOOT).is_file(),
            "qboot.rom is missing (apt-get install qemu-system-x86)",
        )
}

const STEP: Duration = Duration::from_secs(20);

/// Sessions per run: every one must contain the truth.
const SESSIONS: usize = 3;

/// QEMU microvm running the agent with `skew` (and the agent options `extra`) on COM1 = a
/// chardev socket in `dir`.
fn boot(dir: &Path, skew: Skew, extra: &str) -> (ChildGuard, PathBuf, PathBuf) {
    let elf = agent_elf().expect("agent builds");
    let sock = dir.join("com1.sock");
    let com2 = dir.join("com2.log");
    let child = qemu::command_com1_socket(
        Machine::Microvm,
        &elf,
        &format!("transport=uart exit=9 {} {extra}", skew.agent_option()),
        &com2,
        &sock,
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("qemu starts");
    (ChildGuard::new(child), sock, elf)
}

fn anchor_options(vm: u32) -> AnchorOptions {
    AnchorOptions {
        mode: AnchorMode::KvmPio,
        vm: Some(VmSelector::Pid(vm)),
        ..AnchorOptions::default()
    }
}

fn anchored_probes_bracket_a_skewed_truth_in_every_session() {
    let _one_instance = vmtsync_tests::anchor_lock();
    let tmp = tempfile::Builder::new()
        .prefix("vmtsync-anchor-")
        .tempdir()
        .unwrap();
    let skew = Skew::pick();
    // The UART bytes' bracket: the agent's default sync port would replace it.
    let (guard, sock, elf) = boot(tmp.path(), skew, "syncport=off");
    let addr = ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap();
    let connect = ConnectOptions {
        connect_timeout: STEP,
        io_timeout: STEP,
    };
    let com2 =
        || vmtsync_tests::vmm::defmt_log::decode_file_text(&elf, &tmp.path().join("com2.log"));
    let mut truth = None;
    for k in 0..SESSIONS {
        let inner = connect_until_stopped(&addr, &connect, None).expect("connects");
        let mut t = anchor_transport(inner, &addr, &anchor_options(guard.pid()), STEP, &mut |m| {
            panic!("{m}")
        })
        .expect("anchoring is possible here");
        let instance = t.instance_path().expect("an instance").to_path_buf();
        assert!(instance.is_dir(), "{}", instance.display());
        let mut s = ProbeSession::hello(&mut t, STEP)
            .unwrap_or_else(|e| panic!("hello: {e}; COM2 log:\n{}", com2()));
        let samples = s
            .probe_round(64, Duration::ZERO, &mut Progress::hidden())
            .expect("a round");
        let stats = s.stats();
        let info = *s.info();
        // The VM exists now: the truth's KVM side.
        let truth = truth.get_or_insert_with(|| {
            GuestTruth::read(guard.pid(), 0, Some(skew)).expect("truth from debugfs")
        });
        assert_eq!(stats.anchor, AnchorKind::KvmPioUart);
        for x in &samples {
            assert!(
                truth.in_bracket(x.host_send, x.guest, x.host_recv),
                "session {k}: guest TSC {} outside its exit bracket [{}, {}] by the truth ({truth:?})",
                x.guest.0,
                x.host_send.0,
                x.host_recv.0
            );
        }
        let sum = ProbeSummary::from_samples(&info, &samples, stats).expect("estimates");
        let at = truth
            .check(sum.at_host, sum.bound_lo, sum.bound_hi)
            .unwrap_or_else(|e| panic!("session {k}: {e}"));
        let a = t.stats();
        println!(
            "anchored session {k}: {} samples ({} matched, {} unanchored: {a:?}), width {}, error {:+}, rtt min {}",
            samples.len(),
            a.matched,
            stats.unanchored,
            sum.width(),
            i128::from(sum.offset) - at,
            sum.rtt.min
        );
        // Every sample that came back is an anchored one, and most probes found their exits.
        assert_eq!(samples.len() as u64 + stats.lost_probes, stats.sent);
        assert!(a.matched >= samples.len() as u64);
        assert!(samples.len() >= 32, "{stats:?} {a:?}");
        drop(t);
        assert!(!instance.exists(), "{} left behind", instance.display());
    }
}

fn sigint_during_an_anchored_run_removes_the_instance() {
    let tmp = tempfile::Builder::new()
        .prefix("vmtsync-anchor-int-")
        .tempdir()
        .unwrap();
    // The UART bytes' bracket: the agent's default sync port would replace it.
    let (qemu_guard, sock, _) = boot(tmp.path(), Skew::pick(), "syncport=off");
    let out = tmp.path().join("sync.jsonl");
    let child = Command::new(env!("CARGO_BIN_EXE_vmtsync-cli"))
        .args(["probe", "--connect"])
        .arg(format!("unix:{}", sock.display()))
        .args(["--anchor", "kvm-pio", "--vm"])
        .arg(qemu_guard.pid().to_string())
        .args(["--continuous", "--resync", "100", "--no-progress", "--out"])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vmtsync starts");
    let mut guard = ChildGuard::new(child);
    // The CLI process runs one anchored session: its instance has the plain name.
    let name = format!("vmtsync-anchor-{}", guard.pid());
    let instance = vmtsync::ftrace::TRACEFS_CANDIDATES
        .iter()
        .map(|t| Path::new(t).join("instances").join(&name));
    let instances: Vec<PathBuf> = instance.collect();
    // Wait for a segment: the run is anchored and under way.
    let end = Instant::now() + STEP;
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if text.lines().any(|l| l.contains("\"type\":\"segment\"")) {
            assert!(
                text.contains("\"anchor\":\"kvm-pio-uart\""),
                "segments say which anchor they used:\n{text}"
            );
            break;
        }
        assert!(
            guard.child().try_wait().unwrap().is_none(),
            "vmtsync exited early"
        );
        assert!(Instant::now() < end, "no segment within {STEP:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        instances.iter().any(|p| p.is_dir()),
        "no instance {name} while running"
    );
    let (code, err) = crate::util::interrupt(&mut guard);
    assert_eq!(
        code,
        Some(0),
        "continuous mode ends cleanly on SIGINT: {err}"
    );
    assert!(
        instances.iter().all(|p| !p.exists()),
        "instance {name} left behind after SIGINT"
    );
}

/// The boot vCPU's sync-port bracket on the UART transport (`syncport=0x2400`, matched on the
/// probe's sequence number) with the protocol loop in ring 0 (`ring=0`), where this project's
/// nested KVM emulates the `in; lfence; rdtsc; out` and its exits are cheap (docs/anchor.md,
/// "The boot vCPU's sync-port bracket"), anchored as `--anchor auto --vm PID` does on a serial
/// chardev: the probes must be bracketed on the sync port the hello announced, and every
/// sample must bracket the skewed truth (rate 1.0001), in every session.
fn boot_vcpu_sync_port_brackets_in_ring_0_hold_a_skewed_truth() {
    use vmtsync::exits::DEFAULT_SYNC_PORT;
    use vmtsync_core::proto::Features;

    let _one_instance = vmtsync_tests::anchor_lock();
    let tmp = tempfile::Builder::new()
        .prefix("vmtsync-anchor-ring0-")
        .tempdir()
        .unwrap();
    let skew = Skew::pick();
    let (guard, sock, elf) = boot(
        tmp.path(),
        skew,
        &format!("ring=0 syncport={DEFAULT_SYNC_PORT:#x}"),
    );
    let addr = ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap();
    let connect = ConnectOptions {
        connect_timeout: STEP,
        io_timeout: STEP,
    };
    let com2 =
        || vmtsync_tests::vmm::defmt_log::decode_file_text(&elf, &tmp.path().join("com2.log"));
    let mut truth = None;
    for k in 0..SESSIONS {
        let inner = connect_until_stopped(&addr, &connect, None).expect("connects");
        // What `vmtsync probe --anchor auto --vm PID` does on a serial chardev: the UART is
        // traced with the sync port, and the hello's SYNC_PORT moves the probes there.
        let auto = AnchorOptions {
            mode: AnchorMode::Auto,
            ..anchor_options(guard.pid())
        };
        let mut t = anchor_transport(inner, &addr, &auto, STEP, &mut |m| panic!("{m}"))
            .expect("anchoring is possible here");
        let mut s = ProbeSession::hello(&mut t, STEP)
            .unwrap_or_else(|e| panic!("hello: {e}; COM2 log:\n{}", com2()));
        let info = *s.info();
        assert!(info.features.contains(Features::SYNC_PORT), "{info:?}");
        let samples = s
            .probe_round(64, Duration::ZERO, &mut Progress::hidden())
            .unwrap_or_else(|e| panic!("round: {e}; COM2 log:\n{}", com2()));
        let stats = s.stats();
        let truth = truth.get_or_insert_with(|| {
            GuestTruth::read(guard.pid(), 0, Some(skew)).expect("truth from debugfs")
        });
        assert_eq!(stats.anchor, AnchorKind::KvmPioSyncPort);
        for x in &samples {
            assert!(
                truth.in_bracket(x.host_send, x.guest, x.host_recv),
                "session {k}: guest TSC {} outside its sync-port bracket [{}, {}] by the truth \
                 ({truth:?})",
                x.guest.0,
                x.host_send.0,
                x.host_recv.0
            );
        }
        let sum = ProbeSummary::from_samples(&info, &samples, stats).expect("estimates");
        let at = truth
            .check(sum.at_host, sum.bound_lo, sum.bound_hi)
            .unwrap_or_else(|e| panic!("session {k}: {e}"));
        let a = t.stats();
        println!(
            "ring-0 sync-port session {k}: {} samples ({} matched), width {}, error {:+}, rtt min {}",
            samples.len(),
            a.matched,
            sum.width(),
            i128::from(sum.offset) - at,
            sum.rtt.min
        );
        // Every sample is a sync-port match: none kept in-process stamps.
        assert!(a.matched >= samples.len() as u64, "{a:?}");
        assert!(samples.len() >= 32, "{stats:?} {a:?}");
    }
}

/// The sync-port variant over vsock (QEMU q35 + qboot, `vhost-user-vsock-pci`,
/// vhost-device-vsock; never AF_VSOCK): the agent boots with `syncport=0x2400` and a 1.0001
/// skew, announces the sync port in its hello, and every probe's bracket is its own `in` /
/// `out` pair on that port.
fn sync_port_anchored_probes_over_vsock_bracket_a_skewed_truth() {
    use vmtsync::exits::{DEFAULT_SYNC_PORT, Matcher};
    use vmtsync::probe::anchor::prepare_matcher;
    use vmtsync_core::proto::Features;
    use vmtsync_tests::vmm::client::{probe_run, wait_ready};
    use vmtsync_tests::vmm::vsock::{VsockRig, ensure_vhost_device_vsock};

    let _one_instance = vmtsync_tests::anchor_lock();
    let backend = ensure_vhost_device_vsock().expect("the vhost-device-vsock backend installs");
    let elf = agent_elf().expect("agent builds");
    let port = 1241;
    let skew = Skew::pick();
    let append = format!(
        "transport=vsock vsock=connect port={port} ring=3 exit=5 syncport={DEFAULT_SYNC_PORT:#x} {}",
        skew.agent_option()
    );
    let mut rig =
        VsockRig::start(Machine::Q35, &backend, &elf, &append, port, STEP).expect("rig starts");
    let mut client = rig
        .accept(STEP)
        .unwrap_or_else(|e| panic!("{e}\n{}", rig.diagnostics()));
    let qemu_pid = rig.pids().0;
    let truth = GuestTruth::read(qemu_pid, 0, Some(skew)).expect("truth from debugfs");
    if let Err(e) = wait_ready(&mut client, Instant::now() + STEP) {
        panic!("{e}\n{}", rig.diagnostics());
    }
    let mut t = prepare_matcher(
        Matcher::SyncPort {
            port: DEFAULT_SYNC_PORT,
        },
        &anchor_options(qemu_pid),
        STEP,
        &mut |m| panic!("{m}"),
    )
    .expect("anchoring is possible here")
    .wrap(client);
    let instance = t.instance_path().expect("an instance").to_path_buf();
    let (mut session, run) =
        probe_run(&mut t, 64, STEP).unwrap_or_else(|e| panic!("{e}\n{}", rig.diagnostics()));
    assert!(
        run.info.features.contains(Features::SYNC_PORT),
        "the hello announces the sync port: {:?}",
        run.info.features
    );
    assert_eq!(run.stats.anchor, AnchorKind::KvmPioSyncPort);
    let outside = run.outside_bracket(&truth);
    assert!(outside.is_empty(), "{truth:?}: outside {outside:?}");
    let sum = ProbeSummary::from_samples(&run.info, &run.samples, run.stats).expect("estimates");
    let at = truth
        .check(sum.at_host, sum.bound_lo, sum.bound_hi)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(run.samples.len() >= 32, "{:?} {:?}", run.stats, t.stats());
    let (bye, _) = session
        .request(&vmtsync_core::proto::Message::Shutdown)
        .expect("exiting");
    assert_eq!(bye, vmtsync_core::proto::Message::Exiting);
    let a = t.stats();
    println!(
        "vsock sync-port: {} samples ({} matched, {} unanchored), width {}, error {:+}, rtt min {}",
        run.samples.len(),
        a.matched,
        run.stats.unanchored,
        sum.width(),
        i128::from(sum.offset) - at,
        sum.rtt.min
    );
    drop(t);
    assert!(!instance.exists(), "{} left behind", instance.display());
    let _ = rig.wait_exit(STEP);
}
