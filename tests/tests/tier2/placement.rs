//! Two-sided placement under QEMU (tier 2): the bundled agent runs 100 ppm fast (a software
//! skew derived from the host TSC) with a steady workload that records from boot, so events
//! wait in its ring before the first sync round; `vmtsync record` (exit-anchored on the VM's
//! UART exits, JSON Lines) places every event with the round before and the round after it.
//! The truth is KVM's debugfs mapping under the skew the test chose, never vmtsync's: every
//! event's guaranteed interval must hold it, and the intervals must be about as narrow as the
//! rounds'. The same recording's sync file also gives the one-sided placement of the same
//! events (`vmtsync::sync::place`), so both are measured on one run and reported.

use std::time::Duration;

use serde_json::Value;
use vmtsync::sync::Placement;
use vmtsync::sync::place;
use vmtsync::syncfile::SyncFile;
use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_tests::truth::{GuestTruth, Skew};

use crate::util::{QemuAgent, qemu_ready, text, wait_vcpu_thread};

crate::trials!(
    qemu_ready;
    events_are_as_tight_as_their_rounds_and_hold_the_truth,
);

/// Events to record: at the workload's 400 per second about 5 s, ten rounds 500 ms apart.
const EVENTS: u64 = 2000;

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn events_are_as_tight_as_their_rounds_and_hold_the_truth() {
    let test = "placement::events_are_as_tight_as_their_rounds_and_hold_the_truth";
    let dir = tempfile::Builder::new()
        .prefix("vmtsync-placement-")
        .tempdir()
        .unwrap();
    let skew = Skew::pick();
    let vm = QemuAgent::boot(
        dir.path(),
        &format!(
            "transport=uart exit=0 workload=400,0 {}",
            skew.agent_option()
        ),
    );
    wait_vcpu_thread(vm.guard.pid());
    let truth = GuestTruth::read(vm.guard.pid(), 0, Some(skew)).expect("truth from debugfs");
    // Let the workload fill part of the ring first: those events precede the first round.
    std::thread::sleep(Duration::from_secs(1));
    let guest = dir.path().join("guest.jsonl");
    let sync = dir.path().join("sync.jsonl");
    let pid = vm.guard.pid().to_string();
    let out = vm.record(
        &guest,
        EVENTS,
        500,
        &[
            "--format",
            "jsonl",
            "--sync-out",
            sync.to_str().unwrap(),
            "--anchor",
            "kvm-pio",
            "--vm",
            &pid,
            "--placement",
            "two-sided",
            "--shutdown",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "record: {}", text(&out.stderr));
    drop(vm);

    let segments = SyncFile::read(&sync).unwrap().segments;
    assert!(segments.len() >= 3, "{segments:?}");
    // Anchored on the sync port the agent's default boot enables.
    assert!(
        segments
            .iter()
            .all(|s| s.anchor == vmtsync::syncfile::AnchorKind::KvmPioSyncPort),
        "{segments:?}"
    );
    let mut rounds: Vec<u64> = segments
        .iter()
        .map(|s| s.offset_hi.abs_diff(s.offset_lo))
        .collect();
    let widest_round = *rounds.iter().max().unwrap();
    let median_round = median(&mut rounds);

    // Each round's width, by its place in the file (rounds in guest-time order).
    let width_of = |i: usize| segments[i].offset_hi.abs_diff(segments[i].offset_lo);
    let (mut two, mut one) = (Vec::new(), Vec::new());
    // Each event's width against the wider of the rounds on either side of it, in percent:
    // an event can be only as tight as the rounds that place it, and a loaded host widens
    // some rounds and not others.
    let mut against_neighbours = Vec::new();
    let mut before_first = 0;
    for line in std::fs::read_to_string(&guest).unwrap().lines() {
        let j: Value = serde_json::from_str(line).unwrap();
        let g = j["guest_tsc"].as_u64().unwrap();
        let (lo, hi) = (
            j["host_lo"].as_u64().unwrap(),
            j["host_hi"].as_u64().unwrap(),
        );
        // The truth inside: the skewed KVM mapping takes lo and hi around the guest tick.
        assert!(
            truth.in_bracket(HostTicks(lo), GuestTicks(g), HostTicks(hi)),
            "the truth lies outside event {line}: guest at lo {:?}, at hi {:?}",
            truth.guest_at(HostTicks(lo)),
            truth.guest_at(HostTicks(hi))
        );
        let o = place(&segments, g, Placement::OneSided).unwrap();
        assert!(
            truth.in_bracket(HostTicks(o.lo), GuestTicks(g), HostTicks(o.hi)),
            "one-sided {o:?}"
        );
        assert!(
            o.lo <= lo && hi <= o.hi,
            "wider than one-sided {o:?}: {line}"
        );
        before_first += u64::from(g < segments[0].guest_start);
        two.push(hi - lo);
        one.push(o.hi - o.lo);
        let after = segments.partition_point(|s| s.guest_start <= g);
        let neighbours = [
            after.checked_sub(1),
            (after < segments.len()).then_some(after),
        ];
        let wider = neighbours
            .into_iter()
            .flatten()
            .map(width_of)
            .max()
            .unwrap_or(1);
        against_neighbours.push((hi - lo) * 100 / wider.max(1));
    }
    assert!(two.len() as u64 >= EVENTS, "{} events", two.len());
    assert!(before_first > 0, "no event preceded the first round");
    let (widest_two, widest_one) = (*two.iter().max().unwrap(), *one.iter().max().unwrap());
    let (median_two, median_one) = (median(&mut two), median(&mut one));
    let ratio = |a: u64, b: u64| a as f64 / b as f64;
    eprintln!(
        "{test}: {} events ({before_first} before the first round), {} rounds: median round {median_round}, widest {widest_round} ticks; \
         one-sided: median {median_one} ({:.2}x), widest {widest_one} ({:.2}x); \
         two-sided: median {median_two} ({:.2}x), widest {widest_two} ({:.2}x)",
        two.len(),
        segments.len(),
        ratio(median_one, median_round),
        ratio(widest_one, widest_round),
        ratio(median_two, median_round),
        ratio(widest_two, widest_round),
    );
    let median_against = median(&mut against_neighbours);
    eprintln!("{test}: median event width {median_against}% of the wider round beside it");
    assert!(
        median_against <= 125,
        "median event {median_against}% > 125% of the wider of the rounds beside it (median \
         event {median_two}, median round {median_round})"
    );
    assert!(
        widest_two <= 3 * widest_round,
        "widest event {widest_two} > 3 x widest round {widest_round}"
    );
}
