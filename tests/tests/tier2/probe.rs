//! The probe engine against real guests (the tier-1 probe tests, over loopback transports, are
//! in the `it` target): the built-in VMM's COM1 and the agent under QEMU.

/// Both submodules' tests.
pub(crate) fn trials() -> Vec<libtest_mimic::Trial> {
    let mut all = vmm::trials();
    all.extend(qemu_serial::trials());
    all
}

/// The probe engine over the built-in VMM's COM1, stamped at VM exits (tier 2: /dev/kvm).
mod vmm {
    use std::time::Duration;

    use vmtsync::probe::{ProbeSession, ProbeSummary};
    use vmtsync_core::HostTicks;
    use vmtsync_core::estimate::ProbeSample;
    use vmtsync_tests::truth::{GuestTruth, Skew, truth_mapping_of};
    use vmtsync_tests::vmm::client::{Com1Exchange, Com1Transport};
    use vmtsync_tests::vmm::{Vm, VmConfig, VmExit, agent_elf};

    use crate::util::kvm_truth_ready;

    crate::trials!(kvm_truth_ready; probe_engine_over_builtin_vmm_com1_with_exit_stamps);

    /// The session's samples re-bracketed by `pick(exchange)`: the same guest readings.
    fn rebracket(
        samples: &[ProbeSample],
        exchanges: &[Com1Exchange],
        pick: impl Fn(&Com1Exchange) -> (u64, u64),
    ) -> Vec<ProbeSample> {
        samples
            .iter()
            .zip(exchanges)
            .map(|(s, x)| {
                let (send, recv) = pick(x);
                ProbeSample {
                    host_send: HostTicks(send),
                    host_recv: HostTicks(recv),
                    ..*s
                }
            })
            .collect()
    }

    /// The probe engine over the built-in VMM's COM1 transport, whose `refine` replaces the
    /// host-call stamps with the VM exits (the guest's read of the request's delimiter, its
    /// write of the reply's first byte).
    fn probe_engine_over_builtin_vmm_com1_with_exit_stamps() {
        // Software skew in the agent, from the host TSC now; the truth is KVM's mapping of the
        // VM's vCPU (debugfs) followed by the skew.
        let skew = Skew::pick();
        let cfg = VmConfig {
            // The tight exit pair below rests on no exit between the TSC read and the reply's
            // first byte, so no sync port (on by default) either.
            cmdline: format!("transport=uart syncport=off exit=5 {}", skew.agent_option()),
            timeout: Duration::from_secs(120),
            ..VmConfig::default()
        };
        let vm = Vm::boot(&agent_elf().expect("agent builds"), &cfg).expect("VM boots");
        let mut session =
            ProbeSession::hello(Com1Transport::new(vm.com1()), Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("{e}; COM2 log:\n{}", vm.log_text()));
        let truth = GuestTruth::new(
            truth_mapping_of(vm.debugfs_id(), 0).expect("truth from debugfs"),
            Some(skew),
        );
        let info = *session.info();
        let (mut exit_samples, mut exchanges) = (Vec::new(), Vec::new());
        for _ in 0..64 {
            let sample = session
                .probe()
                .unwrap_or_else(|e| panic!("{e}; COM2 log:\n{}", vm.log_text()))
                .unwrap_or_else(|| panic!("probe lost: {:?}", session.stats()));
            let x = session.transport().last_exchange();
            // The session's stamps are the transport's refined exit bracket.
            assert_eq!(
                (sample.host_send.0, sample.host_recv.0),
                (x.request_read, x.first_byte)
            );
            exit_samples.push(sample);
            exchanges.push(x);
        }
        let stats = session.shutdown();
        assert_eq!(exit_samples.len(), 64);
        // The same guest readings bracketed by the host-call stamps (what a socket gives), and
        // by the tightest exit pair (the agent polls LSR, reads the TSC and writes the reply's
        // first byte with no exit between).
        let call_samples = rebracket(&exit_samples, &exchanges, |x| {
            (x.thread_send, x.thread_recv)
        });
        let tight_samples = rebracket(&exit_samples, &exchanges, |x| (x.prev_exit, x.first_byte));
        let exits = ProbeSummary::from_samples(&info, &exit_samples, stats).unwrap();
        let calls = ProbeSummary::from_samples(&info, &call_samples, stats).unwrap();
        let tight = ProbeSummary::from_samples(&info, &tight_samples, stats).unwrap();
        // Each guest reading lies, by the truth, inside every one of its brackets: the
        // transport's exits are real instants around the agent's TSC read.
        for (label, samples) in [
            ("exit", &exit_samples),
            ("tight exit", &tight_samples),
            ("host-call", &call_samples),
        ] {
            for x in samples {
                assert!(
                    truth.in_bracket(x.host_send, x.guest, x.host_recv),
                    "{label} bracket [{}, {}] misses guest {} (true [{:?}, {:?}])",
                    x.host_send.0,
                    x.host_recv.0,
                    x.guest.0,
                    truth.guest_at(x.host_send),
                    truth.guest_at(x.host_recv)
                );
            }
        }
        for (label, s) in [
            ("exit stamps", &exits),
            ("tight exit stamps", &tight),
            ("host-call stamps", &calls),
        ] {
            let at = truth.offset_at(s.at_host).expect("no overflow");
            println!(
                "builtin VMM, {label}: offset {} (error {:+}), bounds [{}, {}] width {}, rtt min {} median {}, trace-cmd fastest error {:+}",
                s.offset,
                i128::from(s.offset) - at,
                s.bound_lo,
                s.bound_hi,
                s.width(),
                s.rtt.min,
                s.rtt.median,
                i128::from(s.tracecmd_fastest) - at
            );
            truth
                .check(s.at_host, s.bound_lo, s.bound_hi)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
        }
        // Exit stamps are inside the host-call stamps, so the intervals they prove at a
        // constant offset can only be tighter (the guaranteed bounds refer to slightly
        // different host times, `at_host`, so their widths need not nest).
        let w = |s: &ProbeSummary| s.rate1.map(|(lo, hi)| hi.abs_diff(lo));
        assert!(w(&exits) <= w(&calls), "{exits:?} {calls:?}");
        assert!(w(&tight) <= w(&exits), "{tight:?} {exits:?}");
        let outcome = vm.wait().expect("run ends");
        assert_eq!(outcome.exit, VmExit::DebugExit(5), "log:\n{}", outcome.log);
    }
}

/// `vmtsync probe --connect unix:PATH` against the agent under QEMU, COM1 on a chardev socket
/// (tier 2: /dev/kvm and QEMU).
mod qemu_serial {
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    use vmtsync::link::ProbeAddr;
    use vmtsync::probe::{ProbeOptions, run_probe};
    use vmtsync_tests::ChildGuard;
    use vmtsync_tests::truth::{GuestTruth, Skew};
    use vmtsync_tests::vmm::agent_elf;
    use vmtsync_tests::vmm::qemu::{self, debug_exit_status};

    use crate::util::vm_ready;

    crate::trials!(vm_ready; probe_over_a_qemu_serial_chardev_socket);

    fn probe_over_a_qemu_serial_chardev_socket() {
        let test = "probe_over_a_qemu_serial_chardev_socket";
        let elf = agent_elf().expect("agent builds");
        let tmp_dir = tempfile::Builder::new()
            .prefix(&format!("vmtsync-{test}-"))
            .tempdir()
            .unwrap();
        let dir = tmp_dir.path();
        let sock = dir.join("com1.sock");
        let com2 = dir.join("com2.log");
        let _ = std::fs::remove_file(&sock);
        let skew = Skew::pick();
        let child = qemu::command_com1_socket(
            qemu::Machine::Microvm,
            &elf,
            &format!("transport=uart exit=9 {}", skew.agent_option()),
            &com2,
            &sock,
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
        let mut guard = ChildGuard::new(child);
        let mut opts =
            ProbeOptions::new(ProbeAddr::parse(&format!("unix:{}", sock.display())).unwrap());
        opts.progress = false;
        opts.timeout = Duration::from_secs(20);
        opts.connect_timeout = Duration::from_secs(20);
        let mut out = Vec::new();
        let s = run_probe(&opts, &mut out).unwrap_or_else(|e| {
            panic!(
                "{e}; COM2 log:\n{}",
                vmtsync_tests::vmm::defmt_log::decode_file_text(&elf, &com2)
            )
        });
        print!("{}", String::from_utf8_lossy(&out));
        // The VM still runs (no --shutdown yet): read KVM's side of the truth.
        let truth = GuestTruth::read(guard.pid(), 0, Some(skew)).expect("truth from debugfs");
        let at = truth.offset_at(s.at_host).expect("no overflow");
        println!(
            "qemu serial: offset error {:+}, width {}, rtt min {} median {}, trace-cmd fastest error {:+}",
            i128::from(s.offset) - at,
            s.width(),
            s.rtt.min,
            s.rtt.median,
            i128::from(s.tracecmd_fastest) - at
        );
        truth
            .check(s.at_host, s.bound_lo, s.bound_hi)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.probes, 64);
        // Without --shutdown the agent keeps serving: a second session gets a fresh hello and
        // its own bounds; this one ends the agent, which exits through isa-debug-exit.
        opts.shutdown = true;
        let again = run_probe(&opts, &mut Vec::new()).expect("a second session");
        truth
            .check(again.at_host, again.bound_lo, again.bound_hi)
            .unwrap_or_else(|e| panic!("second session: {e}"));
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
}
