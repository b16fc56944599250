//! Tier 2: the guest agent under the built-in VMM on real KVM.

use std::time::Duration;

use vmtsync_tests::vmm::{SerialByte, Vm, VmConfig, VmExit, agent_elf, tsc::host_tsc};
use vmtsync_tests::{have_kvm, require};

const STEP: Duration = Duration::from_secs(20);

fn text(line: &[SerialByte]) -> String {
    line.iter().map(|b| char::from(b.byte)).collect()
}

#[test]
fn builtin_vmm_boots_agent_and_brackets_its_tsc() {
    if !require(
        "builtin_vmm_boots_agent_and_brackets_its_tsc",
        have_kvm(),
        "/dev/kvm is not accessible read-write",
    ) {
        return;
    }
    let elf = agent_elf().expect("agent builds");
    let cfg = VmConfig {
        cmdline: "transport=uart exit=5".into(),
        timeout: Duration::from_secs(60),
        ..VmConfig::default()
    };
    let vm = Vm::boot(&elf, &cfg).expect("VM boots");
    let hello = vm.com1().recv_line(STEP);
    let log = vm.log_text();
    let hello = hello.unwrap_or_else(|| panic!("no hello on COM1; COM2 log:\n{log}"));
    assert_eq!(text(&hello), "H vmtsync-agent\n");
    assert!(log.contains("vmtsync-agent"), "COM2 log: {log}");
    assert!(
        log.contains("cmdline \"transport=uart exit=5\""),
        "COM2 log: {log}"
    );

    for round in 0..5 {
        let before = host_tsc();
        vm.com1().send(b"p");
        let line = vm.com1().recv_line(STEP).expect("probe answer");
        let after = host_tsc();
        let delivered = vm
            .com1()
            .delivered_timeout(STEP)
            .expect("probe byte was read");
        let s = text(&line);
        assert!(s.starts_with('T') && s.len() == 18, "answer {s:?}");
        let guest = u64::from_str_radix(&s[1..17], 16).expect("hex TSC");
        let sent = line[0].host_tsc;
        eprintln!(
            "round {round}: delivered {} guest {} T-exit {} | rx->guest {} guest->tx {} cycles, \
             host bracket {}",
            delivered.host_tsc,
            guest,
            sent,
            guest.wrapping_sub(delivered.host_tsc),
            sent.wrapping_sub(guest),
            after - before
        );
        assert!(before <= delivered.host_tsc && delivered.host_tsc <= sent && sent <= after);
        assert!(
            delivered.host_tsc <= guest && guest <= sent,
            "guest TSC {guest} outside the exit bracket [{}, {sent}]",
            delivered.host_tsc
        );
    }

    vm.com1().send(b"q");
    let bye = vm.com1().recv_line(STEP).expect("quit answer");
    assert_eq!(text(&bye), "Q\n");
    let out = vm.wait().expect("run ends");
    eprintln!(
        "exit {:?} after {} I/O exits in {:?}",
        out.exit, out.io_exits, out.run_time
    );
    assert_eq!(out.exit, VmExit::DebugExit(5), "log:\n{}", out.log);
    assert!(
        out.log.contains("quit: isa-debug-exit 5"),
        "log:\n{}",
        out.log
    );
}

fn boot_agent(test: &str, cmdline: &str, timeout: Duration) -> Option<Vm> {
    if !require(test, have_kvm(), "/dev/kvm is not accessible read-write") {
        return None;
    }
    let elf = agent_elf().expect("agent builds");
    let cfg = VmConfig {
        cmdline: cmdline.into(),
        timeout,
        ..VmConfig::default()
    };
    let vm = Vm::boot(&elf, &cfg).expect("VM boots");
    let hello = vm.com1().recv_line(STEP).expect("hello on COM1");
    assert_eq!(text(&hello), "H vmtsync-agent\n");
    Some(vm)
}

#[test]
fn builtin_vmm_agent_panic_logs_and_exits_with_failure_code() {
    let Some(vm) = boot_agent(
        "builtin_vmm_agent_panic_logs_and_exits_with_failure_code",
        "",
        Duration::from_secs(60),
    ) else {
        return;
    };
    vm.com1().send(b"!");
    let out = vm.wait().expect("run ends");
    assert_eq!(out.exit, VmExit::DebugExit(0x7e), "log:\n{}", out.log);
    assert!(
        out.log.contains("PANIC: panicked at") && out.log.contains("host asked for a panic"),
        "log:\n{}",
        out.log
    );
}

#[test]
fn builtin_vmm_watchdog_ends_a_guest_that_spins_without_exits() {
    let timeout = Duration::from_secs(3);
    let Some(vm) = boot_agent(
        "builtin_vmm_watchdog_ends_a_guest_that_spins_without_exits",
        "",
        timeout,
    ) else {
        return;
    };
    vm.com1().send(b"w");
    let ack = vm.com1().recv_line(STEP).expect("spin acknowledged");
    assert_eq!(text(&ack), "W\n");
    assert!(vm.wait_log("spinning without exits", STEP));
    let out = vm.wait().expect("watchdog stops the vCPU");
    eprintln!(
        "watchdog: {:?} after {:?}, rip {:#x}",
        out.exit, out.run_time, out.rip
    );
    assert_eq!(out.exit, VmExit::Timeout, "log:\n{}", out.log);
    assert!(out.run_time >= timeout);
}

#[test]
fn builtin_vmm_agent_applies_software_skew() {
    // reported = offset + ((tsc * ratio) >> frac): ratio 3/2 (frac 1), offset -1000.
    let Some(vm) = boot_agent(
        "builtin_vmm_agent_applies_software_skew",
        "skew=-1000,3,1 exit=0",
        Duration::from_secs(60),
    ) else {
        return;
    };
    assert!(
        vm.log_text()
            .contains(&format!("skew={}+(tsc*3)>>1", 0u64.wrapping_sub(1000))),
        "log:\n{}",
        vm.log_text()
    );
    vm.com1().send(b"p");
    let line = vm.com1().recv_line(STEP).expect("probe answer");
    let rx = vm
        .com1()
        .delivered_timeout(STEP)
        .expect("probe byte was read");
    let s = text(&line);
    let reported = u64::from_str_radix(&s[1..17], 16).expect("hex TSC");
    let skew = |t: u64| {
        let scaled = u64::try_from((u128::from(t) * 3) >> 1).expect("fits");
        scaled.wrapping_sub(1000)
    };
    // The skew is monotonic, so the exit bracket maps through it.
    assert!(
        skew(rx.host_tsc) <= reported && reported <= skew(line[0].host_tsc),
        "reported {reported} outside [{}, {}]",
        skew(rx.host_tsc),
        skew(line[0].host_tsc)
    );
    vm.com1().send(b"q");
    assert_eq!(vm.wait().expect("run ends").exit, VmExit::DebugExit(0));
}
