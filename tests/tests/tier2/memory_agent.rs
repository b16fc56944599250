//! The bundled agent with `transport=none` (issue 16): no UART, no vsock, no poll loop; it
//! publishes its recorder header in guest memory and records its workload there with sync
//! beacons. Tier 2 boots it under QEMU microvm/KVM and looks at the VMM process's memory from
//! outside through `/proc/PID/mem`.
//!
//! The scan and parse below are a test oracle written from docs/memory-layout.md alone: they
//! use neither the host's reader nor the core's layout code (the CRC is computed bit by bit
//! here), so a mistake in either cannot hide behind itself.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::time::{Duration, Instant};

use vmtsync_tests::ChildGuard;

use crate::util::{boot_qemu, scratch, vm_ready};

crate::trials!(vm_ready;
    agent_without_a_transport_publishes_its_rings_in_guest_memory,
    agent_without_a_transport_keeps_the_newest_records_in_flight_mode);

/// The workload the test asks for: events per second and how many (fewer than a ring holds,
/// so the stop-when-full ring refuses none), and the beacon interval.
const RATE: u64 = 200_000;
const COUNT: u64 = 10_000;
const BEACON_EVERY: u64 = 100;
/// The agent's workload event id (guest-agent/src/events.rs) and the reserved beacon id.
const WORKLOAD_EVENT: u64 = 0x100;
const BEACON_ID: u64 = 0xffff;
/// The agent's ring capacity with `transport=none` (guest-agent/src/main.rs, `MEM_RING`).
const CAPACITY: u64 = 16 * 1024;
const SYNC_PORT: u64 = 0x2400;

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn le32(b: &[u8], at: usize) -> u64 {
    u64::from(u32::from_le_bytes(b[at..at + 4].try_into().unwrap()))
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and xorout all ones), bit by
/// bit: the checksum docs/memory-layout.md names.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The VMM's writable mappings, as (start, end) addresses from `/proc/PID/maps`.
fn writable_mappings(pid: u32) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps readable");
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let (a, b) = range.split_once('-')?;
            perms.starts_with("rw").then_some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

pub(crate) fn read_at(mem: &mut File, addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    mem.seek(SeekFrom::Start(addr)).ok()?;
    mem.read_exact(&mut buf).ok()?;
    Some(buf)
}

/// Every address, at 64-byte alignment in a writable mapping, holding the magic and a
/// header whose checksum matches.
pub(crate) fn find_headers(pid: u32, mem: &mut File) -> Vec<u64> {
    const CHUNK: u64 = 1 << 20;
    let magic = b"VMTSRING";
    let mut found = Vec::new();
    for (start, end) in writable_mappings(pid) {
        let mut at = start;
        while at < end {
            let len = (end - at).min(CHUNK);
            // Unreadable pieces (guard pages, device windows) are skipped.
            if let Some(buf) = read_at(mem, at, usize::try_from(len).unwrap()) {
                for off in (0..buf.len().saturating_sub(127)).step_by(64) {
                    let h = &buf[off..off + 128];
                    if &h[..8] == magic && crc32c(&h[..120]) == u32::try_from(le32(h, 120)).unwrap()
                    {
                        found.push(at + off as u64);
                    }
                }
            }
            at += len;
        }
    }
    found
}

/// QEMU running the agent, its memory, and the address of the one valid header in it.
pub(crate) struct Booted {
    /// QEMU; dropping it ends the VM.
    pub(crate) guard: ChildGuard,
    pub(crate) mem: File,
    pub(crate) base: u64,
    pub(crate) header: Vec<u8>,
}

/// Boots the agent with `append` and finds its header from outside: exactly one valid
/// header must appear in QEMU's writable memory (none in its ROM copy of the image).
pub(crate) fn boot_and_find(dir: &std::path::Path, append: &str) -> Booted {
    let (mut guard, _sock) = boot_qemu(dir, append);
    let pid = guard.child().id();
    let mut mem = File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem (run as root)");
    let end = Instant::now() + Duration::from_secs(30);
    let headers = loop {
        let h = find_headers(pid, &mut mem);
        if !h.is_empty() || Instant::now() > end {
            break h;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        headers.len(),
        1,
        "exactly one valid header in QEMU's memory (no copy in its ROM of the image): {headers:x?}"
    );
    let base = headers[0];
    let header = read_at(&mut mem, base, 128).unwrap();
    Booted {
        guard,
        mem,
        base,
        header,
    }
}

/// Waits until ring 0 holds `count` workload events and its beacons and stops changing (the
/// agent halted); returns the ring header's (head, refused, beacons).
fn wait_done(b: &mut Booted, count: u64) -> (u64, u64, u64) {
    let ring = b.base + 128;
    let end = Instant::now() + Duration::from_secs(30);
    let mut last = None;
    loop {
        let r = read_at(&mut b.mem, ring, 128).unwrap();
        let now = (le64(&r, 0), le64(&r, 8), le64(&r, 24));
        let (head, _, beacons) = now;
        if head >= count + beacons && beacons >= 2 && last == Some(now) || Instant::now() > end {
            return now;
        }
        last = Some(now);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Checks records `from..head` of ring 0: each committed with its own stamp and length 8,
/// workload and beacon sequence numbers each counting up by one (from `first_work` and
/// `first_beacon`), the TSC never going back. Returns the (workload, beacon) records seen.
fn check_records(b: &mut Booted, from: u64, head: u64) -> (Vec<u64>, Vec<u64>) {
    let ring = b.base + 128;
    let slots = read_at(
        &mut b.mem,
        ring + 128,
        usize::try_from(32 * CAPACITY).unwrap(),
    )
    .unwrap();
    let (mut work, mut beacon, mut last_tsc) = (Vec::new(), Vec::new(), 0u64);
    for n in from..head {
        let s = &slots[usize::try_from(32 * (n % CAPACITY)).unwrap()..][..32];
        let meta = le64(s, 0);
        assert_eq!(meta >> 25, n + 1, "record {n}'s stamp");
        assert_eq!(meta & (1 << 24), 0, "record {n} not busy");
        let (id, len, tsc, payload) = (meta & 0xffff, (meta >> 16) & 0xff, le64(s, 8), le64(s, 16));
        assert!(tsc >= last_tsc, "record {n}: tsc {tsc} after {last_tsc}");
        last_tsc = tsc;
        assert_eq!(len, 8, "record {n}'s length");
        let seen = match id {
            WORKLOAD_EVENT => &mut work,
            BEACON_ID => &mut beacon,
            other => panic!("record {n}: unexpected id {other:#x}"),
        };
        if let Some(&prev) = seen.last() {
            assert_eq!(
                payload,
                prev + 1,
                "record {n} ({id:#x}) follows its predecessor"
            );
        }
        seen.push(payload);
    }
    let last = usize::try_from(32 * ((head - 1) % CAPACITY)).unwrap();
    assert_eq!(
        le64(&slots, last) & 0xffff,
        BEACON_ID,
        "a beacon comes last"
    );
    (work, beacon)
}

fn agent_without_a_transport_publishes_its_rings_in_guest_memory() {
    let test = "agent_without_a_transport_publishes_its_rings_in_guest_memory";
    let dir = scratch(test);
    // A skew makes the records' clock not the raw TSC, which the header must say (clock 1).
    let append = format!(
        "transport=none workload={RATE},{COUNT} beacons={BEACON_EVERY} skew=1000,3,1 \
         syncport={SYNC_PORT:#x}"
    );
    let mut b = boot_and_find(dir.path(), &append);
    let h = b.header.clone();
    assert_eq!(
        (le32(&h, 8), le32(&h, 12)),
        (1, 128),
        "version, header size"
    );
    assert_ne!(le64(&h, 16), 0, "nonce");
    assert_eq!((le32(&h, 24), le32(&h, 28)), (1, 32), "vCPUs, slot size");
    assert_eq!(le64(&h, 32), CAPACITY);
    assert_ne!(le64(&h, 40), 0, "the agent knows its TSC kHz under KVM");
    assert_eq!(
        (le32(&h, 48), le32(&h, 52)),
        (0, 1),
        "stop-when-full, skewed clock"
    );
    assert_eq!((le64(&h, 56), le64(&h, 64)), (128, 128 + 32 * CAPACITY));
    assert_eq!(u64::from(u16::from_le_bytes([h[72], h[73]])), SYNC_PORT);
    assert!(
        h[74..120].iter().all(|&b| b == 0) && le32(&h, 124) == 0,
        "reserved"
    );

    // Ring 0 fills: every workload event plus the beacons, then the agent halts.
    let (head, refused, beacons) = wait_done(&mut b, COUNT);
    assert_eq!(refused, 0, "nothing refused");
    assert_eq!(head, COUNT + beacons, "every event and beacon stored");
    // One before the first event, one after the last, and one per burst that crossed K.
    let max_burst = 64;
    assert!(
        (2 + COUNT / (BEACON_EVERY + max_burst)..=2 + COUNT / BEACON_EVERY).contains(&beacons),
        "{beacons} beacons"
    );
    let (work, beacon) = check_records(&mut b, 0, head);
    assert_eq!((work.first(), work.len() as u64), (Some(&0), COUNT));
    assert_eq!((beacon.first(), beacon.len() as u64), (Some(&0), beacons));
    let first = read_at(&mut b.mem, b.base + 256, 8).unwrap();
    assert_eq!(le64(&first, 0) & 0xffff, BEACON_ID, "a beacon comes first");
}

/// `flight=1` without a skew: the header says overwrite mode and the raw TSC, and after the
/// guest overwrote its ring a few times the ring holds exactly the newest `CAPACITY`
/// records, intact and in sequence.
fn agent_without_a_transport_keeps_the_newest_records_in_flight_mode() {
    let test = "agent_without_a_transport_keeps_the_newest_records_in_flight_mode";
    const LAPS_COUNT: u64 = 3 * CAPACITY + 123;
    let dir = scratch(test);
    let append = format!(
        "transport=none flight=1 workload=1000000,{LAPS_COUNT} beacons=1000 \
         syncport={SYNC_PORT:#x}"
    );
    let mut b = boot_and_find(dir.path(), &append);
    let h = b.header.clone();
    assert_eq!(
        (le32(&h, 48), le32(&h, 52)),
        (1, 0),
        "overwrite mode, raw TSC"
    );
    let (head, refused, beacons) = wait_done(&mut b, LAPS_COUNT);
    assert_eq!((head, refused), (LAPS_COUNT + beacons, 0));
    let (work, beacon) = check_records(&mut b, head - CAPACITY, head);
    assert_eq!(
        work.len() + beacon.len(),
        usize::try_from(CAPACITY).unwrap()
    );
    assert_eq!(
        work.last(),
        Some(&(LAPS_COUNT - 1)),
        "the newest workload event is there"
    );
    assert_eq!(beacon.last(), Some(&(beacons - 1)), "and the newest beacon");
}
