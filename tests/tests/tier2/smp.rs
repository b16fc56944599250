//! Every vCPU of an SMP guest (tier 2: /dev/kvm, QEMU, debugfs): the agent under QEMU microvm
//! `-smp 4` brings up its application processors, each with its own software skew, and
//! `vmtsync probe --all-vcpus` / `--vcpu 2` sync them one by one over COM1. The truth of each
//! vCPU is its debugfs mapping, then its own skew; it must lie inside that vCPU's guaranteed
//! interval in every session. Idle application processors must be parked (`hlt`), not spin:
//! their vCPU threads may use next to no host CPU while nobody probes. Exit-anchored
//! (`--anchor kvm-pio`) `--all-vcpus` sessions must hold every vCPU's truth as well.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use vmtsync::kvm::debugfs::{DEFAULT_KVM_DEBUGFS, KvmDebugfs};
use vmtsync::kvm::scan::VmSelector;
use vmtsync::link::ProbeAddr;
use vmtsync::probe::anchor::{AnchorMode, AnchorOptions};
use vmtsync::probe::{ProbeError, ProbeOptions, VcpuChoice, run_probe};
use vmtsync_core::HostTicks;
use vmtsync_tests::ChildGuard;
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{self, debug_exit_status};

use crate::util::{anchor_ready, qemu_ready, vm_ready};

crate::trials!(
    vm_ready;
    every_vcpu_of_a_four_vcpu_guest_is_synced_on_itself,
    continuous_all_vcpus_writes_each_vcpus_segments_holding_its_truth;
    anchor_ready;
    exit_anchored_probes_of_every_vcpu_hold_their_truths,
    an_anchored_probe_armed_before_any_vcpu_ran_matches_every_exchange,
    sync_port_brackets_come_from_each_vcpus_own_exits;
    qemu_ready;
    record_places_every_vcpus_events_with_its_own_sync,
);

/// vCPUs of the guest.
const VCPUS: u32 = 4;

/// One vCPU's result as `vmtsync probe --json` prints it.
#[derive(Debug)]
struct Row {
    vcpu: u32,
    offset: i64,
    lo: i64,
    hi: i64,
    at: HostTicks,
    probes: u64,
    rtt_min: u64,
    anchor: String,
}

/// Parses `--json` output: one schema-2 object per line.
fn rows(out: &[u8]) -> Vec<Row> {
    let text = std::str::from_utf8(out).unwrap();
    print!("{text}");
    text.lines()
        .map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).expect("one JSON object per line");
            assert_eq!(j["schema"], 2, "{l}");
            let i = |k: &str| j[k].as_i64().unwrap_or_else(|| panic!("{k} in {l}"));
            let u = |k: &str| j[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
            Row {
                vcpu: u32::try_from(u("vcpu")).unwrap(),
                offset: i("offset_ticks"),
                lo: i("bound_lo"),
                hi: i("bound_hi"),
                at: HostTicks(u("at_host_tsc")),
                probes: u("probes"),
                rtt_min: u("rtt_min_ticks"),
                anchor: j["anchor"].as_str().unwrap_or("in-process").to_owned(),
            }
        })
        .collect()
}

/// Each vCPU's truth: its debugfs mapping, then its skew (read while the VM runs).
fn truths(pid: u32, skews: &[Skew]) -> Vec<GuestTruth> {
    (0..VCPUS)
        .zip(skews)
        .map(|(v, s)| GuestTruth::read(pid, v, Some(*s)).expect("truth from debugfs"))
        .collect()
}

/// Checks each vCPU's row against that vCPU's truth.
fn check_all(truths: &[GuestTruth], rows: &[Row], session: &str) {
    for r in rows {
        let truth = truths[usize::try_from(r.vcpu).unwrap()];
        let at = truth
            .check(r.at, r.lo, r.hi)
            .unwrap_or_else(|e| panic!("{session}, vcpu {}: {e}", r.vcpu));
        println!(
            "{session}: vcpu {} offset error {:+}, width {}, rtt min {}, {}",
            r.vcpu,
            i128::from(r.offset) - at,
            r.hi.abs_diff(r.lo),
            r.rtt_min,
            r.anchor
        );
        assert_eq!(r.probes, 64, "{session}: {r:?}");
    }
}

/// Host CPU ticks (utime + stime, clock ticks) of thread `tid` of process `pid`.
fn cpu_ticks(pid: u32, tid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))
        .expect("the vCPU thread's stat");
    // Fields after the parenthesised command name, which may itself hold spaces.
    let rest = &stat[stat.rfind(')').expect("comm ends with ')'") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after "pid (comm) ".
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The host thread of every vCPU of QEMU process `pid`, from debugfs.
fn vcpu_threads(pid: u32) -> Vec<(u32, u32)> {
    let debugfs = KvmDebugfs::open(DEFAULT_KVM_DEBUGFS).expect("debugfs");
    let vm = debugfs
        .vms()
        .expect("VMs")
        .into_iter()
        .find(|v| v.id.pid == pid)
        .expect("QEMU's VM");
    debugfs
        .read_vm(&vm)
        .expect("vCPUs")
        .into_iter()
        .filter_map(|s| Some((s.vcpu, s.thread_pid?)))
        .collect()
}

/// A booted SMP guest for one test: its scratch directory, each vCPU's skew, QEMU, and the
/// probe options for its COM1 socket.
struct Smp {
    tmp_dir: tempfile::TempDir,
    skews: Vec<Skew>,
    guard: ChildGuard,
    opts: ProbeOptions,
}

impl Smp {
    /// Exit anchoring on this guest's VM (`--anchor kvm-pio --vm PID`).
    fn anchor(&self) -> AnchorOptions {
        AnchorOptions {
            mode: AnchorMode::KvmPio,
            vm: Some(VmSelector::Pid(self.guard.pid())),
            ..AnchorOptions::default()
        }
    }
}

/// Boots QEMU microvm with [`VCPUS`] vCPUs running the agent (`extra` boot options), each
/// vCPU with its own skew, COM1 on a socket in a scratch directory named after `test`.
fn boot_smp(test: &str, extra: &str) -> Smp {
    boot_smp_with(test, Skew::pick_per_vcpu(VCPUS), extra)
}

/// [`boot_smp`] with the given skews, vCPU N's at index N.
fn boot_smp_with(test: &str, skews: Vec<Skew>, extra: &str) -> Smp {
    let tmp_dir = tempfile::Builder::new()
        .prefix(&format!("vmtsync-{test}-"))
        .tempdir()
        .unwrap();
    let (guard, opts) = boot(tmp_dir.path(), &skews, extra);
    Smp {
        tmp_dir,
        skews,
        guard,
        opts,
    }
}

/// QEMU microvm with [`VCPUS`] vCPUs running the agent (`extra` boot options), vCPU N with
/// `skews[N]`, COM1 on a socket in `dir`; returns the guard and the probe options for that
/// socket.
fn boot(dir: &Path, skews: &[Skew], extra: &str) -> (ChildGuard, ProbeOptions) {
    let elf = agent_elf().expect("agent builds");
    let sock = dir.join("com1.sock");
    let com2 = dir.join("com2.log");
    let child = qemu::command_com1_socket_smp(
        qemu::Machine::Microvm,
        &elf,
        &agent_append(skews, extra),
        &com2,
        &sock,
        VCPUS,
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("qemu starts");
    (ChildGuard::new(child), probe_options(&sock))
}

/// The agent's boot options: UART transport, `exit=9`, `extra`, and vCPU N's skew.
fn agent_append(skews: &[Skew], extra: &str) -> String {
    let options: Vec<String> = (0..VCPUS)
        .zip(skews)
        .map(|(v, s)| s.agent_option_for(v))
        .collect();
    format!("transport=uart exit=9 {extra} {}", options.join(" "))
}

/// `--all-vcpus --json` probe options for the COM1 socket `sock`, 20 s timeouts.
fn probe_options(sock: &Path) -> ProbeOptions {
    let mut opts =
        ProbeOptions::new(ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap());
    opts.progress = false;
    opts.timeout = Duration::from_secs(20);
    opts.connect_timeout = Duration::from_secs(20);
    opts.json = true;
    opts.vcpus = VcpuChoice::All;
    opts
}

/// The agent's COM2 log, decoded, after `e`.
fn log(dir: &Path, e: &dyn std::fmt::Display) -> String {
    let elf = agent_elf().expect("agent builds");
    format!(
        "{e}; COM2 log:\n{}",
        vmtsync_tests::vmm::defmt_log::decode_file_text(&elf, &dir.join("com2.log"))
    )
}

fn every_vcpu_of_a_four_vcpu_guest_is_synced_on_itself() {
    let test = "every_vcpu_of_a_four_vcpu_guest_is_synced_on_itself";
    let Smp {
        tmp_dir,
        skews,
        mut guard,
        mut opts,
    } = boot_smp(test, "");
    let dir = tmp_dir.path();
    let log = |e: &dyn std::fmt::Display| log(dir, e);

    // Session 1: every vCPU, one JSON object each.
    let mut out = Vec::new();
    let last = run_probe(&opts, &mut out).unwrap_or_else(|e| panic!("{}", log(&e)));
    let all = rows(&out);
    let vcpus: Vec<u32> = all.iter().map(|r| r.vcpu).collect();
    assert_eq!(vcpus, [0, 1, 2, 3]);
    assert_eq!(last.vcpu, 3);
    let pid = guard.pid();
    let truth = truths(pid, &skews);
    check_all(&truth, &all, "session 1 (--all-vcpus)");

    // Nobody probes now: every application processor must sit in `hlt`. A spinning vCPU
    // thread would use most of a host core over the second measured here; a parked one
    // uses (almost) none. The bar is a tenth of the elapsed ticks.
    let threads = vcpu_threads(pid);
    assert_eq!(threads.len(), 4, "{threads:?}");
    let before: Vec<u64> = threads.iter().map(|&(_, t)| cpu_ticks(pid, t)).collect();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    // /proc counts in USER_HZ clock ticks, 100 per second on Linux.
    let elapsed_ticks = u64::try_from(started.elapsed().as_millis() / 10).unwrap();
    for (&(vcpu, tid), b) in threads.iter().zip(&before) {
        let used = cpu_ticks(pid, tid) - b;
        println!("idle vcpu {vcpu} (thread {tid}): {used} of {elapsed_ticks} clock ticks");
        if vcpu != 0 {
            assert!(
                used * 10 <= elapsed_ticks,
                "vcpu {vcpu} used {used} of {elapsed_ticks} ticks while idle: not parked"
            );
        }
    }

    // Session 2: vCPU 2 alone.
    opts.vcpus = VcpuChoice::One(2);
    let mut out = Vec::new();
    run_probe(&opts, &mut out).unwrap_or_else(|e| panic!("{}", log(&e)));
    let two = rows(&out);
    assert_eq!(two.len(), 1);
    assert_eq!(two[0].vcpu, 2);
    check_all(&truth, &two, "session 2 (--vcpu 2)");

    // Session 3: all again, then shut the agent down; a vCPU it lacks is refused up front.
    opts.vcpus = VcpuChoice::One(VCPUS);
    let err = run_probe(&opts, &mut Vec::new()).unwrap_err();
    assert!(
        matches!(err, ProbeError::UnknownVcpu { vcpu: VCPUS, ref online }
            if online == &[0, 1, 2, 3]),
        "{err}"
    );
    opts.vcpus = VcpuChoice::All;
    opts.shutdown = true;
    let mut out = Vec::new();
    run_probe(&opts, &mut out).unwrap_or_else(|e| panic!("{}", log(&e)));
    let again = rows(&out);
    assert_eq!(again.len(), 4);
    check_all(&truth, &again, "session 3 (--all-vcpus)");
    wait_exit(&mut guard);
}

/// Waits (bounded) for QEMU to end through isa-debug-exit with the agent's `exit=9`.
fn wait_exit(guard: &mut ChildGuard) {
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = guard.child().try_wait().expect("wait qemu") {
            break st;
        }
        assert!(Instant::now() < end, "qemu did not exit after shutdown");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(debug_exit_status(9)));
}

/// `--all-vcpus --anchor kvm-pio` sessions: every vCPU's host bracket comes from the host
/// kernel's `kvm_pio` stamps of the BSP's COM1 exits (the AP's read lies between them:
/// docs/smp.md), and every vCPU's truth lies inside its interval in every session.
fn exit_anchored_probes_of_every_vcpu_hold_their_truths() {
    let test = "exit_anchored_probes_of_every_vcpu_hold_their_truths";
    let _one_instance = vmtsync_tests::anchor_lock();
    // The UART bytes' bracket is under test: the agent's default sync port would replace it.
    let mut smp = boot_smp(test, "syncport=off");
    smp.opts.anchor = smp.anchor();
    let Smp {
        tmp_dir,
        skews,
        mut guard,
        mut opts,
    } = smp;
    let (dir, pid) = (tmp_dir.path(), guard.pid());
    let mut truth = None;
    for k in 0..3 {
        opts.shutdown = k == 2;
        let mut out = Vec::new();
        run_probe(&opts, &mut out).unwrap_or_else(|e| panic!("{}", log(dir, &e)));
        // The VM exists once a session ran (and still runs: the last one shuts it down).
        let truth = truth.get_or_insert_with(|| truths(pid, &skews));
        let all = rows(&out);
        assert_eq!(all.iter().map(|r| r.vcpu).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert!(all.iter().all(|r| r.anchor == "kvm-pio-uart"), "{all:?}");
        check_all(truth, &all, &format!("anchored session {k}"));
    }
    wait_exit(&mut guard);
}

/// A probe armed while no vCPU of its VM has run yet (QEMU paused by `-S`: KVM debugfs names
/// no vCPU thread) must still see every vCPU's exits once the guest runs. The probe once took
/// the threads debugfs named when it armed: started with its VM, it could trace vCPUs 1-3
/// without the boot vCPU that answers on COM1 (KVM names a vCPU's thread at its first run, in
/// any order), and no exchange matched.
fn an_anchored_probe_armed_before_any_vcpu_ran_matches_every_exchange() {
    use vmtsync::record::launch::Vmm;
    let test = "an_anchored_probe_armed_before_any_vcpu_ran_matches_every_exchange";
    let _one_instance = vmtsync_tests::anchor_lock();
    let tmp_dir = tempfile::Builder::new()
        .prefix(&format!("vmtsync-{test}-"))
        .tempdir()
        .unwrap();
    let dir = tmp_dir.path();
    let skews = Skew::pick_per_vcpu(VCPUS);
    let elf = agent_elf().expect("agent builds");
    let sock = dir.join("com1.sock");
    let cmd = qemu::command_com1_socket_smp(
        qemu::Machine::Microvm,
        &elf,
        &agent_append(&skews, "syncport=off"),
        &dir.join("com2.log"),
        &sock,
        VCPUS,
    );
    let argv: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let vmm = Vmm::spawn_paused(&argv).expect("QEMU starts paused");
    let pid = vmm.pid();
    let mut opts = probe_options(&sock);
    opts.anchor = AnchorOptions {
        mode: AnchorMode::KvmPio,
        vm: Some(VmSelector::Pid(pid)),
        ..AnchorOptions::default()
    };
    let before = uart_traces();
    let probe = std::thread::spawn(move || {
        let mut out = Vec::new();
        run_probe(&opts, &mut out).map(|_| out)
    });
    // Armed: a new instance of this process traces kvm_pio on the UART's ports.
    let end = Instant::now() + Duration::from_secs(20);
    while uart_traces().difference(&before).next().is_none() {
        assert!(
            !probe.is_finished() && Instant::now() < end,
            "the anchored probe did not start its trace while the VM had not run"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // From outside: no vCPU has run, so debugfs names none of their threads.
    assert_eq!(vcpu_threads(pid), [], "QEMU -S ran a vCPU");
    vmm.resume().cont().expect("QMP cont");
    let out = probe
        .join()
        .expect("the probe thread")
        .unwrap_or_else(|e| panic!("{}", log(dir, &e)));
    let all = rows(&out);
    assert_eq!(all.iter().map(|r| r.vcpu).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(all.iter().all(|r| r.anchor == "kvm-pio-uart"), "{all:?}");
    // The VM still runs (no shutdown was asked): its truth is there to read; then it is
    // ended by its PID when `vmm` drops.
    check_all(&truths(pid, &skews), &all, "armed before the VM ran");
    drop(vmm);
}

/// This process's tracefs instances whose `kvm_pio` filter names the UART data port's range.
fn uart_traces() -> std::collections::BTreeSet<std::path::PathBuf> {
    let root = vmtsync::ftrace::find_tracefs(None, vmtsync::exits::EVENT).expect("tracefs");
    let suffix = format!("-{}", std::process::id());
    // The lowest port the UART trace names (a wide access from it still reaches the data port).
    let lowest = format!("port == {:#x}", vmtsync::exits::COM1_DATA - 3);
    std::fs::read_dir(root.join("instances"))
        .expect("tracefs instances")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("vmtsync-anchor") && name.ends_with(&suffix)
        })
        .filter(|p| {
            std::fs::read_to_string(p.join("events/kvm/kvm_pio/filter"))
                .is_ok_and(|f| f.contains(&lowest))
        })
        .collect()
}

/// The sync-port variant on an SMP guest (`syncport=0x2400`, its brackets matched on the
/// probe's sequence number): each application processor does the `in` and the `out` around
/// its own TSC read, so the bracket of a probe of vCPU N comes from vCPU N's own exits, and
/// every sample of every vCPU must bracket that vCPU's truth.
fn sync_port_brackets_come_from_each_vcpus_own_exits() {
    use vmtsync::exits::{DEFAULT_SYNC_PORT, Matcher};
    use vmtsync::link::ConnectOptions;
    use vmtsync::link::connect::connect_until_stopped;
    use vmtsync::probe::anchor::prepare_matcher;
    use vmtsync::probe::{ProbeSession, ProbeSummary, Progress};
    use vmtsync::syncfile::AnchorKind;
    use vmtsync_core::proto::Features;

    let test = "sync_port_brackets_come_from_each_vcpus_own_exits";
    let _one_instance = vmtsync_tests::anchor_lock();
    let mut smp = boot_smp(test, &format!("syncport={DEFAULT_SYNC_PORT:#x}"));
    let (anchor, dir, pid) = (smp.anchor(), smp.tmp_dir.path(), smp.guard.pid());
    let step = Duration::from_secs(20);
    let inner = connect_until_stopped(
        &smp.opts.addr,
        &ConnectOptions {
            connect_timeout: step,
            io_timeout: step,
        },
        None,
    )
    .expect("connects");
    let mut t = prepare_matcher(
        Matcher::SyncPort {
            port: DEFAULT_SYNC_PORT,
        },
        &anchor,
        step,
        &mut |m| panic!("{m}"),
    )
    .expect("anchoring is possible here")
    .wrap(inner);
    let mut s = ProbeSession::hello(&mut t, step).unwrap_or_else(|e| panic!("{}", log(dir, &e)));
    let info = *s.info();
    assert!(
        info.features
            .contains(Features::SYNC_PORT.union(Features::SMP)),
        "{:?}",
        info.features
    );
    let truth = truths(pid, &smp.skews);
    assert_eq!(s.vcpus().unwrap(), [0, 1, 2, 3]);
    let mut total = 0;
    for v in 0..VCPUS {
        s.select_vcpu(v).unwrap();
        let before = s.stats();
        let samples = s
            .probe_round(64, Duration::ZERO, &mut Progress::hidden())
            .unwrap_or_else(|e| panic!("{}", log(dir, &e)));
        let stats = s.stats();
        assert_eq!(stats.anchor, AnchorKind::KvmPioSyncPort);
        let t = truth[usize::try_from(v).unwrap()];
        for x in &samples {
            assert_eq!(x.vcpu, v);
            assert!(
                t.in_bracket(x.host_send, x.guest, x.host_recv),
                "vcpu {v}: guest TSC {} outside its sync-port bracket [{}, {}] by the truth",
                x.guest.0,
                x.host_send.0,
                x.host_recv.0
            );
        }
        let sum = ProbeSummary::from_samples(&info, &samples, stats)
            .unwrap_or_else(|e| panic!("vcpu {v}: {e:?}: {stats:?}"));
        let at = t
            .check(sum.at_host, sum.bound_lo, sum.bound_hi)
            .unwrap_or_else(|e| panic!("vcpu {v}: {e}"));
        println!(
            "sync port: vcpu {v} {} samples ({} lost), width {}, error {:+}, rtt min {}",
            samples.len(),
            stats.lost_probes - before.lost_probes,
            sum.width(),
            i128::from(sum.offset) - at,
            sum.rtt.min
        );
        assert!(samples.len() >= 32, "vcpu {v}: {stats:?}");
        total += samples.len() as u64;
    }
    let (bye, _) = s
        .request(&vmtsync_core::proto::Message::Shutdown)
        .expect("exiting");
    assert_eq!(bye, vmtsync_core::proto::Message::Exiting);
    drop(s);
    // Every sample's bracket is a sync-port match: none fell back to in-process stamps.
    assert!(
        t.stats().matched >= total,
        "{:?}, {total} samples",
        t.stats()
    );
    drop(t);
    wait_exit(&mut smp.guard);
}

/// `probe --all-vcpus --continuous`: each round syncs every vCPU on itself and appends one
/// segment per vCPU, each vCPU with its own estimate; every segment must hold its own vCPU's
/// truth (per-vCPU skews set them ~2^36 ticks apart, so a segment made or judged with another
/// vCPU's clock misses).
fn continuous_all_vcpus_writes_each_vcpus_segments_holding_its_truth() {
    use vmtsync::probe::ContinuousOptions;
    use vmtsync::syncfile::SyncFile;

    let test = "continuous_all_vcpus_writes_each_vcpus_segments_holding_its_truth";
    let Smp {
        tmp_dir,
        skews,
        mut guard,
        mut opts,
    } = boot_smp(test, "");
    let dir = tmp_dir.path();
    let sync = dir.join("sync.jsonl");
    opts.json = false;
    opts.shutdown = true;
    opts.continuous = Some(ContinuousOptions {
        out: sync.clone(),
        resync: Duration::from_millis(200),
        rounds: Some(3),
    });
    let mut out = Vec::new();
    run_probe(&opts, &mut out).unwrap_or_else(|e| panic!("{}", log(dir, &e)));
    print!("{}", String::from_utf8_lossy(&out));
    let file = SyncFile::read(&sync).expect("the sync file reads");
    let order: Vec<(u64, u32)> = file.segments.iter().map(|g| (g.round, g.vcpu)).collect();
    let want: Vec<(u64, u32)> = (0..3)
        .flat_map(|r| (0..VCPUS).map(move |v| (r, v)))
        .collect();
    assert_eq!(order, want, "one segment per vCPU per round, in vCPU order");
    let pid = guard.pid();
    let truth = truths(pid, &skews);
    for g in &file.segments {
        let t = truth[usize::try_from(g.vcpu).unwrap()];
        let at = t
            .check(HostTicks(g.host_anchor), g.offset_lo, g.offset_hi)
            .unwrap_or_else(|e| panic!("round {} vcpu {}: {e}", g.round, g.vcpu));
        println!(
            "round {} vcpu {}: error {:+}, width {}{}",
            g.round,
            g.vcpu,
            i128::from(g.offset) - at,
            g.offset_hi.abs_diff(g.offset_lo),
            if g.is_break { ", BREAK" } else { "" }
        );
        assert!(!g.is_break, "a vCPU's own rounds never break: {g:?}");
    }
    wait_exit(&mut guard);
}

/// `vmtsync record` on a four-vCPU guest whose application processors record events
/// (`events=N`: one per probe each answers, on top of the boot vCPU's one per message): every vCPU is synced on itself each round, every
/// event's interval holds its own vCPU's truth (debugfs + that vCPU's skew), and the trace.dat
/// has one CPU per vCPU whose events trace-cmd 3.1.6 puts on the host timeline through that
/// CPU's own TIME_SHIFT (within the run's widest interval of the truth).
fn record_places_every_vcpus_events_with_its_own_sync() {
    use crate::util::{text, trace_cmd};
    use vmtsync::probe::Progress;
    use vmtsync::record::{DRAIN_MAX, OutputOptions, RecordFormat, RecordOptions, run_record};
    use vmtsync_core::GuestTicks;
    use vmtsync_core::mapping::KvmTscMapping;

    let test = "record_places_every_vcpus_events_with_its_own_sync";
    // Identity rates (offsets only), so the trace.dat keeps raw guest TSCs with a TIME_SHIFT
    // per CPU that trace-cmd applies; the offsets still differ per vCPU.
    let identity: Vec<Skew> = Skew::pick_per_vcpu(VCPUS)
        .into_iter()
        .map(|s| Skew(KvmTscMapping::offset_only(s.0.offset())))
        .collect();
    let Smp {
        tmp_dir,
        skews,
        mut guard,
        mut opts,
    } = boot_smp_with(test, identity, "events=1000000");
    let dir = tmp_dir.path();
    opts.json = false;
    let pid = guard.pid();
    // Rounds of 16 probes: a round of all four vCPUs then takes about a second here, so the
    // 8 s recording has several even on a loaded host (with 64, a CI run on two busy cores
    // once ended before the first round of every vCPU, so no event could be placed).
    opts.probes = 16;
    let run = |format: RecordFormat, out: &Path, shutdown: bool| {
        let mut probe = opts.clone();
        probe.shutdown = shutdown;
        let o = RecordOptions {
            probe,
            output: OutputOptions {
                out: out.to_owned(),
                format,
                file_version: vmtsync::formats::tracedat::FileVersion::V7,
                // A time, not a count: a count would end the drain that reaches it early (the
                // boot vCPU's ring drains first), a time takes every vCPU's events.
                events: None,
                duration: Some(Duration::from_secs(8)),
                sync_out: None,
            },
            resync: Duration::from_millis(300),
            drain_max: DRAIN_MAX,
            placement: vmtsync::sync::Placement::default(),
            spans: vmtsync::spans::SpanConfig::default(),
        };
        let s =
            run_record(&o, &mut Progress::hidden()).unwrap_or_else(|e| panic!("{}", log(dir, &e)));
        println!("{s:?}");
        s
    };
    let jsonl = dir.join("events.jsonl");
    let s = run(RecordFormat::Jsonl, &jsonl, false);
    assert_eq!(s.vcpus, [0, 1, 2, 3]);
    // The VM runs now (the agent keeps serving after the first recording).
    let truth = truths(pid, &skews);
    let lines = crate::util::read_jsonl(&jsonl);
    let mut per_vcpu = [0u32; VCPUS as usize];
    for v in &lines {
        let vcpu = usize::try_from(crate::util::u(v, "vcpu")).unwrap();
        let (g, lo, hi) = (
            crate::util::u(v, "guest_tsc"),
            crate::util::u(v, "host_lo"),
            crate::util::u(v, "host_hi"),
        );
        assert!(
            truth[vcpu].in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi)),
            "vCPU {vcpu}'s event misses its truth: {v}"
        );
        per_vcpu[vcpu] += 1;
    }
    println!("events per vCPU (JSON Lines): {per_vcpu:?}");
    assert!(
        per_vcpu.iter().all(|&n| n > 0),
        "events from every vCPU: {per_vcpu:?}"
    );

    let dat = dir.join("guest.dat");
    let s = run(RecordFormat::TraceCmd, &dat, true);
    assert!(!s.preconverted, "identity rates keep raw TSCs");
    let max_width = s.widths.expect("events have widths").2;
    // `[CPU] timestamp:` of every event line, raw and with the TIME_SHIFT applied.
    let events = |args: &[&str]| -> Vec<(usize, u64)> {
        let out = trace_cmd(args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
            .lines()
            .filter(|l| l.contains("event_data:"))
            .map(crate::util::report_cpu_ts)
            .collect()
    };
    let path = dat.to_str().unwrap();
    // trace-cmd merges the CPUs by timestamp, and the raw guest TSCs of different vCPUs are
    // on different clocks: pair raw and shifted times CPU by CPU, in each CPU's order.
    let per_cpu = |all: Vec<(usize, u64)>| -> Vec<Vec<u64>> {
        let mut by = vec![Vec::new(); VCPUS as usize];
        for (cpu, ts) in all {
            by[cpu].push(ts);
        }
        by
    };
    let raw = per_cpu(events(&["report", "--raw-ts", "-i", path]));
    let host = per_cpu(events(&[
        "report",
        "-t",
        crate::util::TICKS[0],
        crate::util::TICKS[1],
        "-i",
        path,
    ]));
    let total: usize = raw.iter().map(Vec::len).sum();
    assert_eq!(total as u64, s.events, "every event in the file");
    let mut cpus = [0usize; VCPUS as usize];
    for (cpu, (raw, host)) in raw.iter().zip(&host).enumerate() {
        assert_eq!(raw.len(), host.len(), "CPU {cpu}");
        // CPU N holds vCPU N here (vCPUs 0-3, in order): its TIME_SHIFT must be its own.
        let exact = truth[cpu].composed().expect("truth composes");
        for (&r, &h) in raw.iter().zip(host) {
            let t = exact
                .try_host_from_guest_ceil(GuestTicks(r))
                .expect("maps")
                .0;
            assert!(
                h.abs_diff(t) <= max_width,
                "CPU {cpu}: trace-cmd put guest {r} at {h}, the truth says {t} (width {max_width})"
            );
        }
        cpus[cpu] = raw.len();
    }
    println!("events per CPU (trace.dat, trace-cmd report): {cpus:?}");
    assert!(cpus.iter().all(|&n| n > 0), "events on every CPU: {cpus:?}");
    wait_exit(&mut guard);
}
