//! The reader against a real process, without KVM: this test binary re-executed as a child
//! that lays out the core's own `Recorder` in its own memory, publishes it and records into
//! it while the parent finds and drains it through
//! `/proc/PID/mem`. Truth comes from the child: it counts what it stored and refused itself
//! and reports it on stdout; every record's contents are a function of its index.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vmtsync_core::arch::Tsc;
use vmtsync_core::recorder::{ClockKind, HeaderInfo, Recorder};

use super::*;
use crate::kvm::procinfo::ProcFs;

/// The child's environment variable: `stop` or `flight`, the record count, and `big` for a
/// 4 GiB untouched mapping besides.
const CHILD_ENV: &str = "VMTSYNC_GUESTMEM_CHILD";
/// Set to also time a scan that reads every page (no page map): slow, for measurements only.
const MEASURE_ENV: &str = "VMTSYNC_GUESTMEM_MEASURE";
/// Records per ring of the stop-when-full recorder (64 Ki: 2 MiB of slots).
const STOP_CAP: usize = 1 << 16;
/// Records per ring of the flight recorder.
const FLIGHT_CAP: usize = 1 << 12;
/// The child's header nonce.
const CHILD_NONCE: u64 = 0x5eed_0000_0000_0016;
/// How long a real-process test may take before it fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(120);

// The core's recorders, header first, all zero until published (the stop-when-full one
// lands in .bss, the flight one in .data for its mode bytes).
static STOP: Recorder<1, STOP_CAP> = Recorder::new();
static FLIGHT: Recorder<1, FLIGHT_CAP> = Recorder::new_flight();

/// A clock that counts its reads: record `n`'s `tsc` is `n`.
struct Counter(AtomicU64);

impl Tsc for Counter {
    fn read_ordered(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// Publishes `r` through the core's own publication (the guest's code path), then
/// overwrites the stack below this frame: publication builds the whole header in a local
/// buffer, and a stale copy of it on the child's stack would be a second valid header.
fn publish<const CAP: usize>(r: &Recorder<1, CAP>) {
    r.publish(&HeaderInfo {
        nonce: CHILD_NONCE,
        tsc_khz: 0,
        clock: ClockKind::Other,
        beacon_port: 0,
    });
    scrub_stack();
}

#[inline(never)]
fn scrub_stack() {
    let mut junk = [0u8; 16 * 1024];
    std::hint::black_box(&mut junk);
}

fn payload(n: u64) -> [u8; 16] {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&n.to_le_bytes());
    p[8..].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    p
}

fn id_of(n: u64) -> u16 {
    u16::try_from(n % 1000).unwrap_or(0)
}

/// The child's records, `total` of them (ids and payloads from the index), as fast as the
/// core records. Returns (stored, refused) as the child counted them.
fn produce<const CAP: usize>(rec: &Recorder<1, CAP>, total: u64) -> (u64, u64) {
    let clock = Counter(AtomicU64::new(0));
    let (mut stored, mut refused) = (0u64, 0u64);
    for _ in 0..total {
        let n = stored;
        match rec
            .ring(0)
            .expect("vCPU 0")
            .record(&clock, id_of(n), &payload(n))
        {
            Ok(()) => stored += 1,
            Err(_) => refused += 1,
        }
    }
    (stored, refused)
}

/// Whether `r` is the record the child stored at its index, which is its clock (the child's
/// clock counts its records).
fn intact(r: &GuestRecord) -> bool {
    r.vcpu == 0 && r.id == id_of(r.tsc) && r.payload == payload(r.tsc)
}

/// The child's side. When the variable is unset (an ordinary test run), the same producer
/// and reader meet in this process instead, at the storage's named address through
/// `/proc/self/mem` (other tests' fakes in this process rule out a scan here).
#[test]
fn guestmem_real_process_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        publish(&STOP);
        let (stored, refused) = produce(&STOP, STOP_CAP as u64 + 10);
        assert_eq!((stored, refused), (STOP_CAP as u64, 10));
        let mut mem = ProcMemory::open(&ProcFs::default(), std::process::id()).expect("self");
        let addr = std::ptr::from_ref(&STOP) as u64;
        let f = find(&mut mem, Location::HostAddress(addr)).expect("own recorder");
        let mut d = Drainer::new(&f, DEFAULT_MAX_PER_ROUND);
        let mut bad = 0u64;
        while d
            .poll(&mut mem, &mut |r| bad += u64::from(!intact(r)))
            .expect("poll")
            .more
        {}
        let c = d.counts()[0];
        assert_eq!(
            (c.delivered, c.refused, c.overwritten, c.corrupt, bad),
            (stored, 10, 0, 0, 0)
        );
        return;
    };
    let mut parts = spec.split(',');
    let mode = parts.next().unwrap_or("");
    let total: u64 = parts.next().and_then(|t| t.parse().ok()).expect("count");
    let big = parts.next() == Some("big");
    let _big_map = big.then(BigMap::new);
    let stdin = std::io::stdin();
    let mut line = String::new();
    let (stored, refused) = if mode == "flight" {
        publish(&FLIGHT);
        println!("vmtsync-child ready");
        stdin.lock().read_line(&mut line).expect("go");
        produce(&FLIGHT, total)
    } else {
        publish(&STOP);
        // The stop-when-full ring is filled before the parent starts, so its drain time is
        // the reader's alone.
        let counts = produce(&STOP, total);
        println!("vmtsync-child ready");
        stdin.lock().read_line(&mut line).expect("go");
        counts
    };
    println!("vmtsync-child done {stored} {refused}");
    // Stay alive until the parent has drained and closes stdin.
    let _ = stdin.lock().read_line(&mut line);
}

/// A 4 GiB zeroed allocation, untouched but for one byte per GiB: the shape of a large guest
/// whose RAM is mostly never written. The allocator takes a block this size straight from an
/// anonymous mapping whose pages stay absent until written (no `unsafe` here: the crate
/// forbids it).
struct BigMap(#[allow(dead_code)] Vec<u8>);

const BIG: usize = 4 << 30;

impl BigMap {
    fn new() -> Self {
        let mut v = vec![0u8; BIG];
        for g in 0..4 {
            v[g << 30] = 1;
        }
        Self(std::hint::black_box(v))
    }
}

/// The re-executed child, killed by PID if the test ends early.
struct ChildGuard {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl ChildGuard {
    fn spawn(spec: &str) -> Self {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args([
                "guestmem::proc_tests::guestmem_real_process_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                // libtest prints the test's name on the same line first.
                if let Some((_, rest)) = l.split_once("vmtsync-child ")
                    && tx.send(rest.to_owned()).is_err()
                {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn expect_line(&self, prefix: &str) -> String {
        let l = self.lines.recv_timeout(DEADLINE).expect("child line");
        assert!(l.starts_with(prefix), "child said {l:?}, expected {prefix}");
        l
    }

    fn go(&mut self) {
        let s = self.stdin.as_mut().expect("stdin");
        s.write_all(b"go\n").expect("go");
        s.flush().expect("flush");
    }

    /// The child's `done STORED REFUSED` line, if it has come.
    fn done(&self, wait: Duration) -> Option<(u64, u64)> {
        let l = self.lines.recv_timeout(wait).ok()?;
        let mut w = l.strip_prefix("done ")?.split(' ');
        Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
    }

    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "child {status}");
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A memory that hides the page map, so every page is read (for the measurement only).
struct NoPagemap(ProcMemory);

impl GuestMemory for NoPagemap {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.0.read(addr, buf)
    }
    fn regions(&mut self) -> Result<Vec<Region>, MemError> {
        self.0.regions()
    }
}

fn proc_available() -> bool {
    // Reading another process's memory needs ptrace rights: root, or the same user with a
    // permissive yama scope. A child of ours is the same user, so this holds nearly always.
    std::path::Path::new("/proc/self/mem").exists()
}

#[test]
fn guestmem_real_process_scan_and_drain_stop_when_full() {
    assert!(proc_available(), "/proc is needed for this test");
    let total = STOP_CAP as u64 + 1000;
    let mut child = ChildGuard::spawn(&format!("stop,{total},big"));
    child.expect_line("ready");
    let mut mem = ProcMemory::open(&ProcFs::default(), child.pid()).expect("open child mem");
    let regions = find::coalesce(mem.regions().expect("maps"));
    let t = Instant::now();
    let (found, stats) = scan(&mut mem, &regions).expect("scan");
    let scan_time = t.elapsed();
    assert_eq!(found.len(), 1, "exactly the child's recorder: {stats:?}");
    assert!(stats.pagemap, "the page map reads here");
    let f = find(&mut mem, Location::Scan).expect("find");
    assert_eq!(f.header.capacity, STOP_CAP as u64);
    assert_eq!(f.header.nonce, CHILD_NONCE);
    eprintln!(
        "measure: scan of {} writable mappings, {} MiB mapped, {} MiB read, {} pages skipped: {:?}",
        stats.regions,
        stats.bytes_mapped >> 20,
        stats.bytes_read >> 20,
        stats.pages_skipped,
        scan_time
    );
    if std::env::var_os(MEASURE_ENV).is_some() {
        let mut all = NoPagemap(ProcMemory::open(&ProcFs::default(), child.pid()).expect("mem"));
        let t = Instant::now();
        let (found2, stats2) = scan(&mut all, &regions).expect("scan");
        eprintln!(
            "measure: scan without the page map, {} MiB read: {:?} ({} found)",
            stats2.bytes_read >> 20,
            t.elapsed(),
            found2.len()
        );
    }
    child.go();
    let (stored, refused) = child.done(DEADLINE).expect("child done");
    let mut d = Drainer::new(&f, DEFAULT_MAX_PER_ROUND);
    let mut bad = 0u64;
    let t = Instant::now();
    while d
        .poll(&mut mem, &mut |r| bad += u64::from(!intact(r)))
        .expect("poll")
        .more
    {}
    let drain_time = t.elapsed();
    let c = d.counts()[0];
    eprintln!(
        "measure: drained {} records (stop-when-full, prefilled) in {:?}: {:.1} M records/s",
        c.delivered,
        drain_time,
        c.delivered as f64 / drain_time.as_secs_f64() / 1e6
    );
    assert_eq!((stored, refused), (STOP_CAP as u64, 1000));
    assert_eq!(
        (c.delivered, c.refused, c.overwritten, c.corrupt, bad),
        (stored, refused, 0, 0, 0)
    );
    child.finish();
}

#[test]
fn guestmem_real_process_flight_recorder_racing_the_reader() {
    assert!(proc_available(), "/proc is needed for this test");
    let total: u64 = 2_000_000;
    let mut child = ChildGuard::spawn(&format!("flight,{total}"));
    child.expect_line("ready");
    let mut mem = ProcMemory::open(&ProcFs::default(), child.pid()).expect("open child mem");
    let f = find(&mut mem, Location::Scan).expect("find");
    assert_eq!(f.header.mode, Mode::Overwrite);
    let mut d = Drainer::new(&f, DEFAULT_MAX_PER_ROUND);
    let mut bad = 0u64;
    let mut last = None::<u64>;
    let mut ordered = true;
    let mut sink = |r: &GuestRecord| {
        bad += u64::from(!intact(r));
        ordered &= last.is_none_or(|l| r.tsc > l);
        last = Some(r.tsc);
    };
    child.go();
    let start = Instant::now();
    let produced = loop {
        assert!(start.elapsed() < DEADLINE, "child did not finish");
        d.poll(&mut mem, &mut sink)
            .expect("poll while the child records");
        if let Some(done) = child.done(Duration::ZERO) {
            break done;
        }
    };
    let live = start.elapsed();
    let live_delivered = d.counts()[0].delivered;
    while d.poll(&mut mem, &mut sink).expect("final poll").more {}
    let c = d.counts()[0];
    eprintln!(
        "measure: flight ring of {FLIGHT_CAP}, child stored {} in {live:?}; reader delivered {} \
         live ({:.1} M/s), {} in all, {} overwritten",
        produced.0,
        live_delivered,
        live_delivered as f64 / live.as_secs_f64() / 1e6,
        c.delivered,
        c.overwritten
    );
    assert_eq!(produced, (total, 0));
    assert!(ordered);
    assert_eq!(bad, 0);
    assert_eq!(c.corrupt, 0);
    assert_eq!(c.delivered + c.overwritten, total);
    assert_eq!(c.head, total);
    child.finish();
}

#[test]
fn guestmem_elf_symbol_of_this_binary_is_its_load_address() {
    // This test binary is an ELF image with a symbol table; the static's runtime address
    // minus the image's load bias (from /proc/self/maps: the mapping of file offset 0) is
    // the link-time address the image's segments place it at.
    let exe = std::env::current_exe().expect("exe");
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let exe_name = exe.to_string_lossy().into_owned();
    let bias = maps
        .lines()
        .find(|l| l.ends_with(&exe_name) && l.split_whitespace().nth(2) == Some("00000000"))
        .and_then(|l| l.split('-').next())
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .expect("the binary's first mapping");
    // The static's symbol is Rust-mangled (an unmangled one would need `no_mangle`, which the
    // crate's `forbid(unsafe_code)` refuses): find its full name in the binary's own table.
    let image = std::fs::read(&exe).expect("read the test binary");
    let name = {
        use object::{Object, ObjectSymbol};
        let file = object::File::parse(&*image).expect("the test binary parses");
        file.symbols()
            .filter_map(|s| s.name().ok().map(str::to_owned))
            .find(|n| n.contains("VMTSYNC_GUESTMEM_ELF_PROBE"))
            .expect("the probe static's symbol")
    };
    match symbol_guest_physical_in(&exe, &name) {
        Ok(gpa) => {
            let runtime = std::ptr::from_ref(&VMTSYNC_GUESTMEM_ELF_PROBE) as u64;
            assert_eq!(gpa, runtime - bias);
        }
        Err(e) => panic!("{e}"),
    }
    let e = symbol_guest_physical_in(&exe, "no_such_symbol_here").expect_err("absent");
    assert!(matches!(e, ElfError::NoSymbol(_)), "{e}");
    let e = symbol_guest_physical(b"not an elf", "x").expect_err("not elf");
    assert!(matches!(e, ElfError::Parse(_)), "{e}");
}

/// A symbol for the ELF test to look up.
static VMTSYNC_GUESTMEM_ELF_PROBE: [u8; 64] = [7; 64];
