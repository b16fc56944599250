//! Tier 2: a memory recording follows its guest across resets. The traced SeaBIOS, started by
//! `vmtsync record --from-memory -- qemu…` (QEMU without `-no-reboot`), runs its POST and
//! every boot attempt; the test then resets the guest over its own QMP socket, and SeaBIOS
//! re-POSTs and publishes its recorder again with a new nonce. The reader must keep what the
//! first boot recorded and record the second as its own boot.
//!
//! The truth is the firmware's and KVM's: SeaBIOS prints its ring's produced count at each
//! boot attempt (each boot's last line accounts for every record of that boot), and KVM's
//! mapping of vCPU 0, read from debugfs in each boot (a reset may change it on other hosts),
//! gives each event's exact host time.

use std::path::Path;
use std::time::{Duration, Instant};

use vmtsync_launch::firmware::{self, BOOT_EVENT, MEMORY_MIB, PHASES, Variant};
use vmtsync_launch::qemu::{command_firmware_resets, qmp_execute};
use vmtsync_tests::truth::truth_mapping;
use vmtsync_tests::{ChildGuard, require};

use crate::firmware::{
    assert_holds_truth, expected_phase_events, launch_reader, launched_qemu, payload, phase_event,
};
use crate::util::{anchor_ready, lines_of, scratch, u};

crate::trials!(reset_ready; seabios_reset);

/// [`anchor_ready`] (QEMU, KVM, debugfs, the `kvm_pio` tracepoint) and a SeaBIOS build.
fn reset_ready(test: &str) -> bool {
    let build = firmware::build_ready();
    anchor_ready(test)
        && require(
            test,
            build.is_ok(),
            &build.err().map_or_else(String::new, |e| e.to_string()),
        )
}

/// Waits (at most `limit`) until the debug log at `log` holds `what` `n` times, while the
/// reader `rec` (whose stderr is `err`) runs: a reader that ends meanwhile (and ends the QEMU
/// it started) fails the test with its own words.
pub(crate) fn wait_log(
    log: &Path,
    what: &str,
    n: usize,
    limit: Duration,
    rec: &mut ChildGuard,
    err: &Path,
) -> String {
    let end = Instant::now() + limit;
    loop {
        if let Some(status) = rec.wait_timeout(Duration::ZERO).expect("waitpid") {
            panic!(
                "the reader ended ({status}) before SeaBIOS printed {what:?} {n} times: {}",
                std::fs::read_to_string(err).unwrap_or_default()
            );
        }
        let t = std::fs::read_to_string(log).unwrap_or_default();
        if t.matches(what).count() >= n {
            return t;
        }
        assert!(
            Instant::now() < end,
            "SeaBIOS's debug log has {what:?} fewer than {n} times after {limit:?}:\n{t}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Boot `b`'s (records read, beacons, overwritten) from the reader's per-boot summary line.
pub(crate) fn boot_counts(stderr: &str, b: usize) -> (u64, u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("vmtsync: boot {b} (nonce")))
        .unwrap_or_else(|| panic!("no summary line of boot {b}: {stderr}"));
    let num = |what: &str| -> u64 {
        let head = line[..line.find(what).expect(what)].trim_end();
        let from = head
            .rfind(|c: char| !c.is_ascii_digit())
            .map_or(0, |k| k + 1);
        head[from..].parse().expect("a count")
    };
    (num(" records read"), num(" beacons)"), num(" overwritten"))
}

fn seabios_reset() {
    let test = "seabios_reset";
    let out = firmware::build(Variant::Traced).expect("the traced SeaBIOS builds");
    let dir = scratch(test);
    let log = dir.path().join("debug.log");
    let qmp = dir.path().join("qmp.sock");
    let jsonl = dir.path().join("reset.jsonl");
    let qemu = command_firmware_resets(&out.join("bios.bin"), &log, MEMORY_MIB, true);
    let mut rec = launch_reader(
        &qemu,
        &jsonl,
        &["--format", "jsonl", "--duration", "400"],
        &[
            "-qmp".to_owned(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ],
    );
    let done = "No bootable device";
    let err_path = jsonl.with_extension("stderr");
    wait_log(&log, done, 1, Duration::from_secs(180), &mut rec, &err_path);
    let qemu_pid = launched_qemu(&rec);
    // Each boot's truth is KVM's mapping read during that boot.
    let kvm0 = truth_mapping(qemu_pid, 0).expect("truth from debugfs");
    qmp_execute(&qmp, "system_reset", Duration::from_secs(20)).expect("QEMU resets");
    let text_log = wait_log(&log, done, 2, Duration::from_secs(180), &mut rec, &err_path);
    let kvm1 = truth_mapping(qemu_pid, 0).expect("truth from debugfs");
    // The counts lines, split into boots where the attempt number starts again.
    let mut boots: Vec<Vec<(u32, u64, u64)>> = Vec::new();
    for c in firmware::counts_in(&text_log) {
        if c.0 == 0 {
            boots.push(Vec::new());
        }
        boots.last_mut().expect("attempt 0 first").push(c);
    }
    assert_eq!(boots.len(), 2, "two boots in the log:\n{text_log}");

    rec.signal(libc::SIGINT).expect("SIGINT the reader");
    let status = rec
        .wait_timeout(Duration::from_secs(60))
        .expect("waitpid")
        .expect("the reader ends within 60 s of SIGINT");
    let stderr = std::fs::read_to_string(jsonl.with_extension("stderr")).unwrap();
    println!("SeaBIOS reset: {}", stderr.trim());
    assert!(status.success(), "the reader: {status}: {stderr}");

    let lines = lines_of(&jsonl);
    for (b, (counts, kvm)) in boots.iter().zip([&kvm0, &kvm1]).enumerate() {
        let &(_, produced, refused) = counts.last().expect("a counts line");
        assert_eq!(refused, 0, "boot {b}: {text_log}");
        let mine: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|v| v.get("boot").and_then(serde_json::Value::as_u64) == Some(b as u64))
            .collect();
        let phases: Vec<(bool, String)> = mine.iter().filter_map(|v| phase_event(v)).collect();
        assert_eq!(
            phases,
            expected_phase_events(),
            "boot {b}: every POST phase begins and ends once, in order"
        );
        let attempts: Vec<u32> = mine
            .iter()
            .filter(|v| u(v, "id") == u64::from(BOOT_EVENT))
            .map(|v| u32::from_le_bytes(payload(v).try_into().expect("4 bytes")))
            .collect();
        let want: Vec<u32> = (0..u32::try_from(counts.len()).unwrap()).collect();
        assert_eq!(attempts, want, "boot {b}: every boot attempt");
        // Besides phases and boot attempts, only the fw_cfg events around each fw_cfg write.
        let fw_cfg = [
            firmware::FW_CFG_CTL_EVENTS.0,
            firmware::FW_CFG_CTL_EVENTS.1,
            firmware::FW_CFG_DMA_EVENTS.0,
            firmware::FW_CFG_DMA_EVENTS.1,
        ];
        let others = mine
            .iter()
            .filter(|v| fw_cfg.iter().any(|&id| u(v, "id") == u64::from(id)))
            .count();
        assert_eq!(
            mine.len(),
            2 * PHASES.len() + counts.len() + others,
            "boot {b}: no other"
        );
        let (_, beacons, overwritten) = boot_counts(&stderr, b);
        assert_eq!(
            mine.len() as u64 + beacons + overwritten,
            produced,
            "boot {b}: events + beacons + overwritten = its produced count: {stderr}"
        );
        for v in &mine {
            assert_holds_truth(v, kvm, &format!("boot {b}"));
        }
    }
    assert!(
        lines.iter().all(|v| matches!(
            v.get("boot").and_then(serde_json::Value::as_u64),
            Some(0 | 1)
        )),
        "no event of another boot"
    );
}
