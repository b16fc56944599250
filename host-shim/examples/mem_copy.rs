//! The memory reader's raw copy and drain costs on a live VMM process, for `cargo xtask
//! bench`'s memory section (issue 27):
//!
//! ```text
//! cargo build --release -p vmtsync --example mem_copy
//! target/release/examples/mem_copy PID PASSES CHUNK[,CHUNK...]
//! ```
//!
//! Arguments: the VMM's PID (its guest holds a recorder whose rings were filled and no longer
//! change: the C guest's `hold`), timed passes, and chunk sizes in bytes. The header is found
//! by a scan (`vmtsync::guestmem::find`), then, for each read method of
//! `vmtsync::guestmem::ProcMemory` (`pread` on `/proc/PID/mem` and `process_vm_readv`):
//!
//! - **raw copy**: every ring's slots (capacity × 32 bytes per ring), copied out of the VMM
//!   in reads of CHUNK bytes into one reused buffer, PASSES times per chunk size (methods and
//!   sizes interleaved within a pass). One line per method and size:
//!   `mem-copy: method=M chunk=C bytes=B seconds=s1,s2,… gbps=G records_per_s=R` (`gbps` and
//!   `records_per_s` from the median pass; a record is 32 bytes);
//! - **drain without a writer**: `Drainer::poll` at its default bound
//!   (`DEFAULT_MAX_PER_ROUND`) from record 0 until nothing is left, records handed to a sink
//!   that only counts them, PASSES times; then the fixed cost of a round that delivers one
//!   record (a drainer bounded to 1 record per round, 2,000 rounds, per ring), and of a
//!   round over rings with nothing new (the drained drainer polled 2,000 more times). One line
//!   per method: `mem-poll: method=M rings=V records=N drain_seconds=s1,… ns_per_record=P
//!   busy_round_ns=B idle_poll_ns=I head_bytewise_ns=W head_batched_ns=X` (`busy_round_ns`
//!   and `idle_poll_ns` per ring and round; the last two: ring 0's `head` read a byte at a
//!   time, most significant first, as 8 reads and as one `read_many` of 8 parts; medians of
//!   PASSES).
//!
//! With a fourth argument, EVICT_MIB, the raw copy is also timed **from memory**: before each
//! of PASSES more passes per method and size, EVICT_MIB MiB are written elsewhere (make it a
//! few times the last-level cache; a fresh buffer each time, freed before the pass, as
//! `--evict` below leaves memory to the reader it runs before), so the rings start out of the
//! cache, as a reader that comes to them after other work finds them; one line per method and
//! size, `mem-copy-cold: …` with the words of `mem-copy:`. The first passes above run right after
//! one another, so the rings stay in a cache large enough to hold them.
//!
//! With two more, FLOOR_DIR and FLOOR_BYTES[,FLOOR_BYTES...], after the copies from memory
//! (and with the same writing elsewhere before each pass), **the floor of a drain that
//! writes** an output of each size (sizes interleaved within a pass): every ring's
//! slots copied out with the method `ProcMemory::open` chose, in a drain round's chunks
//! (`DEFAULT_MAX_PER_ROUND` slots), each slot's commit stamp checked
//! (`layout::decode_committed`, the one test a drain cannot skip), and each chunk handed to a
//! second thread that writes its share of FLOOR_BYTES (the size of a drain's output) into a
//! file in FLOOR_DIR through the drain's own writer (`atomic_file::BackgroundFile` on that
//! thread, with its syncing thread; the file is dropped uncommitted, so removed). Nothing is
//! placed or formatted: no drain that writes that many bytes can be faster. Timed from the
//! first read to the last byte written (the sync in progress then is waited for untimed, as a
//! drain's time ends at its last write), with the process's CPU time over the pass (user +
//! system, every thread's: `getrusage`, as a reader's own CPU is counted); one line per size,
//! `mem-floor: method=M chunk=C bytes=B records=N checked=K seconds=s1,… cpu_seconds=c1,…
//! records_per_s=R` (`checked`: slots whose stamp held; `records_per_s` from the median
//! pass).
//!
//! `mem_copy --evict MIB` only writes MIB MiB (a fresh buffer) and exits: what `cargo xtask
//! bench` runs before each timed drain, so the drains start like the copies from memory.
//!
//! Then **KVM's mapping of a vCPU**, which `vmtsync record --from-memory` reads for every vCPU
//! after every round (`vmtsync::kvm::debugfs::VcpuDir::read_mapping`, the directory held open,
//! its files opened by name): vCPU 0's read ROUNDS times per pass, PASSES passes. One line,
//! `mem-kvm: reads=ROUNDS read_ns=R` (the median pass's time per read).
//!
//! The first line, `mem-open: method=M`, names the method `ProcMemory::open` chose (what
//! `vmtsync record --from-memory` reads with). Needs ptrace rights over the process (root).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Instant;

use vmtsync::atomic_file::{AtomicFile, BackgroundFile};
use vmtsync::guestmem::layout::{RECORD_SIZE as RECORD_BYTES, RING_PREFIX, decode_committed};
use vmtsync::guestmem::{
    self, DEFAULT_MAX_PER_ROUND, Drainer, Found, GuestMemory, Location, ProcMemory, ReadMethod,
};
use vmtsync::kvm::debugfs::{DEFAULT_KVM_DEBUGFS, KvmDebugfs, VcpuDir};
use vmtsync::kvm::procinfo::ProcFs;

/// Rounds timed for the fixed costs.
const ROUNDS: u32 = 2000;

type Error = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--evict") {
        return match args.get(2).and_then(|s| s.parse::<usize>().ok()) {
            Some(mib) if mib > 0 => {
                evict(mib);
                ExitCode::SUCCESS
            }
            _ => {
                eprintln!("usage: mem_copy --evict MIB(>0)");
                ExitCode::from(2)
            }
        };
    }
    let chunks: Option<Vec<usize>> = args.get(3).and_then(|s| {
        s.split(',')
            .map(|c| c.parse::<usize>().ok().filter(|&c| c > 0))
            .collect()
    });
    let (Some(pid), Some(passes), Some(chunks)) = (
        args.get(1).and_then(|s| s.parse::<u32>().ok()),
        args.get(2)
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&r| r > 0),
        chunks,
    ) else {
        eprintln!(
            "usage: mem_copy PID PASSES(>0) CHUNK_BYTES[,CHUNK_BYTES...] [EVICT_MIB [FLOOR_DIR FLOOR_BYTES]]"
        );
        return ExitCode::from(2);
    };
    let evict_mib = match args.get(4).map(|s| s.parse::<usize>()) {
        None => None,
        Some(Ok(m)) if m > 0 => Some(m),
        Some(_) => {
            eprintln!("mem_copy: EVICT_MIB must be a positive number of MiB");
            return ExitCode::from(2);
        }
    };
    let sizes: Option<Vec<u64>> = args.get(6).and_then(|s| {
        s.split(',')
            .map(|b| b.parse::<u64>().ok().filter(|&b| b > 0))
            .collect()
    });
    let floor = match (args.get(5), sizes) {
        (None, None) => None,
        (Some(dir), Some(sizes)) if evict_mib.is_some() => Some((PathBuf::from(dir), sizes)),
        _ => {
            eprintln!(
                "mem_copy: FLOOR_DIR FLOOR_BYTES(>0)[,FLOOR_BYTES...] come after EVICT_MIB, both \
                 or neither"
            );
            return ExitCode::from(2);
        }
    };
    match run(pid, passes, &chunks, evict_mib, floor.as_ref()) {
        Ok(lines) => {
            for l in lines {
                println!("{l}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mem_copy: {e}");
            ExitCode::FAILURE
        }
    }
}

const METHODS: [ReadMethod; 2] = [ReadMethod::Pread, ReadMethod::VmReadv];

fn open(pid: u32, method: ReadMethod) -> Result<ProcMemory, Error> {
    let mem = ProcMemory::open_with(&ProcFs::default(), pid, method)?;
    if mem.method() != method {
        return Err(format!("{} is not available here", method.name()).into());
    }
    Ok(mem)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn seconds(v: &[f64]) -> String {
    v.iter()
        .map(|s| format!("{s:.6}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Pushes what was read before out of the cache: `mib` MiB (a few times the last-level cache)
/// of a fresh buffer written, then freed. Freed, so the memory the kernel gives the pass after
/// it (the output's page cache) is memory in use moments ago, as for a reader that `--evict`
/// ran before: a buffer held across the passes made the floor's page cache take memory this
/// machine had never touched, which in a virtual machine costs each page a fault in the
/// hypervisor, and made the floor slower than the reader it is to bound.
fn evict(mib: usize) {
    let mut other = vec![0u8; mib << 20];
    other.fill(1);
    std::hint::black_box(&mut other);
}

/// Every ring's slots copied out in reads of `chunk` bytes into `buf`: seconds.
fn copy_rings(
    mem: &mut ProcMemory,
    rings: &[(u64, u64)],
    chunk: usize,
    buf: &mut [u8],
) -> Result<f64, Error> {
    let t = Instant::now();
    for &(start, len) in rings {
        let mut at = 0;
        while at < len {
            let n = usize::try_from((len - at).min(chunk as u64))?;
            mem.read(start + at, &mut buf[..n])?;
            at += n as u64;
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// One `mem-copy…:` line per method and chunk size (`times[method][chunk]`).
fn copy_lines(prefix: &str, chunks: &[usize], times: &[Vec<Vec<f64>>], total: u64) -> Vec<String> {
    #[allow(clippy::cast_precision_loss)] // Byte counts far below 2^52.
    let total_f = total as f64;
    let mut lines = Vec::new();
    for (m, method) in METHODS.iter().enumerate() {
        for (c, &chunk) in chunks.iter().enumerate() {
            let s = median(&times[m][c]);
            lines.push(format!(
                "{prefix}: method={} chunk={chunk} bytes={total} seconds={} gbps={:.3} \
                 records_per_s={:.0}",
                method.name(),
                seconds(&times[m][c]),
                total_f / s / 1e9,
                total_f / RECORD_BYTES as f64 / s,
            ));
        }
    }
    lines
}

fn run(
    pid: u32,
    passes: usize,
    chunks: &[usize],
    evict_mib: Option<usize>,
    floor: Option<&(PathBuf, Vec<u64>)>,
) -> Result<Vec<String>, Error> {
    // What `vmtsync record --from-memory` reads with: `ProcMemory::open`'s choice.
    let mut mem = ProcMemory::open(&ProcFs::default(), pid)?;
    let found = guestmem::find(&mut mem, Location::Scan)?;
    let mut lines = vec![format!("mem-open: method={}", mem.method().name())];
    let h = found.header;
    // Every ring's slots: (address, bytes).
    let rings: Vec<(u64, u64)> = (0..h.vcpus)
        .map(|v| {
            (
                found.addr + h.ring_offset(v) + RING_PREFIX,
                h.capacity * RECORD_BYTES,
            )
        })
        .collect();
    let total: u64 = rings.iter().map(|r| r.1).sum();
    let mut mems = [open(pid, METHODS[0])?, open(pid, METHODS[1])?];

    // Raw copy.
    let biggest = chunks.iter().copied().max().unwrap_or(0);
    let mut buf = vec![0u8; biggest];
    let mut times = vec![vec![Vec::with_capacity(passes); chunks.len()]; METHODS.len()];
    // One untimed pass of each method first: the first touch of a page in the VMM may fault.
    for pass in 0..=passes {
        for (m, mem) in mems.iter_mut().enumerate() {
            for (c, &chunk) in chunks.iter().enumerate() {
                let s = copy_rings(mem, &rings, chunk, &mut buf)?;
                if pass > 0 {
                    times[m][c].push(s);
                }
            }
        }
    }
    lines.extend(copy_lines("mem-copy", chunks, &times, total));
    // From memory: the rings pushed out of the cache before each pass.
    if let Some(mib) = evict_mib {
        let mut cold = vec![vec![Vec::with_capacity(passes); chunks.len()]; METHODS.len()];
        for _ in 0..passes {
            for (m, mem) in mems.iter_mut().enumerate() {
                for (c, &chunk) in chunks.iter().enumerate() {
                    evict(mib);
                    cold[m][c].push(copy_rings(mem, &rings, chunk, &mut buf)?);
                }
            }
        }
        lines.extend(copy_lines("mem-copy-cold", chunks, &cold, total));
        if let Some((dir, sizes)) = floor {
            let mut times =
                vec![(Vec::with_capacity(passes), Vec::with_capacity(passes)); sizes.len()];
            let mut checked = vec![0; sizes.len()];
            for _ in 0..passes {
                for (i, &bytes) in sizes.iter().enumerate() {
                    evict(mib);
                    let cpu = cpu_seconds()?;
                    let (s, k) = write_floor(&mut mem, &rings, dir, bytes)?;
                    times[i].0.push(s);
                    times[i].1.push(cpu_seconds()? - cpu);
                    checked[i] = k;
                }
            }
            let records = total / RECORD_BYTES;
            for (i, &bytes) in sizes.iter().enumerate() {
                #[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
                let per_s = records as f64 / median(&times[i].0);
                lines.push(format!(
                    "mem-floor: method={} chunk={} bytes={bytes} records={records} checked={} \
                     seconds={} cpu_seconds={} records_per_s={per_s:.0}",
                    mem.method().name(),
                    DEFAULT_MAX_PER_ROUND * SLOT_BYTES,
                    checked[i],
                    seconds(&times[i].0),
                    seconds(&times[i].1),
                ));
            }
        }
    }

    // Draining without a writer, and the fixed costs of a round.
    for (m, method) in METHODS.iter().enumerate() {
        let mem = &mut mems[m];
        let (mut drain, mut busy, mut idle) = (Vec::new(), Vec::new(), Vec::new());
        let (mut bytewise, mut batched) = (Vec::new(), Vec::new());
        let mut records = 0;
        for _ in 0..passes {
            let (s, n, d) = drain_all(mem, &found)?;
            drain.push(s);
            records = n;
            busy.push(busy_round(mem, &found)? / f64::from(h.vcpus));
            idle.push(idle_polls(mem, d)? / f64::from(h.vcpus));
            let (a, b) = head_reads(mem, found.addr + h.ring_offset(0))?;
            bytewise.push(a);
            batched.push(b);
        }
        #[allow(clippy::cast_precision_loss)] // Counts far below 2^52.
        let per_record = median(&drain) / records.max(1) as f64 * 1e9;
        lines.push(format!(
            "mem-poll: method={} rings={} records={records} drain_seconds={} ns_per_record={:.2} \
             busy_round_ns={:.0} idle_poll_ns={:.0} head_bytewise_ns={:.0} head_batched_ns={:.0}",
            method.name(),
            h.vcpus,
            seconds(&drain),
            per_record,
            median(&busy) * 1e9,
            median(&idle) * 1e9,
            median(&bytewise) * 1e9,
            median(&batched) * 1e9,
        ));
    }
    let mut kvm = Vec::new();
    for _ in 0..passes {
        kvm.push(kvm_reads(pid)?);
    }
    lines.push(format!(
        "mem-kvm: reads={ROUNDS} read_ns={:.0}",
        median(&kvm) * 1e9
    ));
    Ok(lines)
}

/// Seconds per read of KVM's mapping of the VMM's vCPU 0 from its debugfs directory, held
/// open as a memory recording holds it.
fn kvm_reads(pid: u32) -> Result<f64, Error> {
    let tree = KvmDebugfs::open(DEFAULT_KVM_DEBUGFS)?;
    let vm = tree
        .vms()?
        .into_iter()
        .find(|v| v.id.pid == pid)
        .ok_or_else(|| format!("no KVM debugfs directory of process {pid}"))?;
    let dir = VcpuDir::open(&vm.path.join("vcpu0"), 0)?;
    let t = Instant::now();
    for _ in 0..ROUNDS {
        std::hint::black_box(dir.read_mapping()?);
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(ROUNDS))
}

/// This process's CPU time so far (user + system, all its threads, ended ones included).
fn cpu_seconds() -> Result<f64, Error> {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)?;
    let s = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
    Ok(s(u.user_time()) + s(u.system_time()))
}

/// A slot's bytes (a record's size).
const SLOT_BYTES: usize = vmtsync_core::recorder::SLOT_SIZE;

/// One pass of the floor of a drain that writes `bytes` into `dir` (the module docs):
/// (seconds, slots whose commit stamp held).
fn write_floor(
    mem: &mut ProcMemory,
    rings: &[(u64, u64)],
    dir: &Path,
    bytes: u64,
) -> Result<(f64, u64), Error> {
    let total: u64 = rings.iter().map(|r| r.1).sum();
    let chunk = DEFAULT_MAX_PER_ROUND * SLOT_BYTES;
    // A buffer holds a chunk's slots and its share of the output, which can be larger (an
    // output of more bytes than the slots: the bytes past the slots are written as they are).
    let buf_len = chunk.max(usize::try_from(
        (u128::from(bytes) * chunk as u128).div_ceil(u128::from(total.max(1))),
    )?);
    let (full_tx, full_rx) = mpsc::sync_channel::<(Vec<u8>, usize)>(1);
    let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
    let file = AtomicFile::new(&dir.join("mem-floor.out"))?;
    let writer = std::thread::spawn(move || -> std::io::Result<Instant> {
        let (mut out, _) = BackgroundFile::on_this_thread(file, 0)?;
        for (buf, len) in full_rx {
            let _ = free_tx.send(out.submit(buf, len)?);
        }
        let end = Instant::now();
        // Waits for the sync in progress; the file is dropped uncommitted (removed).
        drop(out.finish()?);
        Ok(end)
    });
    let mut checked = 0u64;
    let start = Instant::now();
    let mut written = 0u64;
    let mut done = 0u64;
    for &(addr, len) in rings {
        let mut at = 0;
        while at < len {
            let n = usize::try_from((len - at).min(chunk as u64))?;
            let mut buf = free_rx.try_recv().unwrap_or_else(|_| vec![0; buf_len]);
            mem.read(addr + at, &mut buf[..n])?;
            let first = at / RECORD_BYTES;
            for (k, slot) in buf[..n].chunks_exact(SLOT_BYTES).enumerate() {
                let meta = u64::from_le_bytes(slot[..8].try_into()?);
                checked += u64::from(decode_committed(meta, first + k as u64).is_some());
            }
            at += n as u64;
            done += n as u64;
            // This chunk's share of the output, so the shares add up to `bytes`.
            let upto = u64::try_from(u128::from(bytes) * u128::from(done) / u128::from(total))?;
            let share = usize::try_from(upto - written)?.min(buf.len());
            written += share as u64;
            if full_tx.send((buf, share)).is_err() {
                break;
            }
        }
    }
    drop(full_tx);
    let end = writer.join().map_err(|_| "the floor's writer panicked")??;
    Ok((end.duration_since(start).as_secs_f64(), checked))
}

/// Drains every ring from record 0 until no ring has more: (seconds, records, the drainer).
fn drain_all(mem: &mut ProcMemory, found: &Found) -> Result<(f64, u64, Drainer), Error> {
    let mut d = Drainer::new(found, DEFAULT_MAX_PER_ROUND);
    let mut n = 0u64;
    let t = Instant::now();
    while d.poll(mem, &mut |_| n += 1)?.more {}
    Ok((t.elapsed().as_secs_f64(), n, d))
}

/// Seconds per round of a drainer bounded to one record per round (each round delivers one
/// record from every ring that has one).
fn busy_round(mem: &mut ProcMemory, found: &Found) -> Result<f64, Error> {
    let mut d = Drainer::new(found, 1);
    let mut n = 0u64;
    let t = Instant::now();
    for _ in 0..ROUNDS {
        d.poll(mem, &mut |_| n += 1)?;
    }
    let s = t.elapsed().as_secs_f64();
    if n == 0 {
        return Err("the rings hold no records".into());
    }
    Ok(s / f64::from(ROUNDS))
}

/// Seconds per read of a ring's `head` word one byte at a time, most significant first (the
/// drainer's torn-read-safe read): as 8 reads, and as one `read_many` of 8 one-byte parts
/// (the same order, in one `process_vm_readv` where the method allows).
fn head_reads(mem: &mut ProcMemory, head: u64) -> Result<(f64, f64), Error> {
    let mut w = [0u8; 8];
    let t = Instant::now();
    for _ in 0..ROUNDS {
        for i in (0..8).rev() {
            mem.read(head + i as u64, &mut w[i..=i])?;
        }
    }
    let bytewise = t.elapsed().as_secs_f64() / f64::from(ROUNDS);
    let first = u64::from_le_bytes(w);
    let t = Instant::now();
    for _ in 0..ROUNDS {
        let [b0, b1, b2, b3, b4, b5, b6, b7] = &mut w;
        let mut parts: [(u64, &mut [u8]); 8] = [
            (head + 7, std::slice::from_mut(b7)),
            (head + 6, std::slice::from_mut(b6)),
            (head + 5, std::slice::from_mut(b5)),
            (head + 4, std::slice::from_mut(b4)),
            (head + 3, std::slice::from_mut(b3)),
            (head + 2, std::slice::from_mut(b2)),
            (head + 1, std::slice::from_mut(b1)),
            (head, std::slice::from_mut(b0)),
        ];
        mem.read_many(&mut parts)?;
    }
    let batched = t.elapsed().as_secs_f64() / f64::from(ROUNDS);
    if u64::from_le_bytes(w) != first {
        return Err("a held guest's head moved".into());
    }
    Ok((bytewise, batched))
}

/// Seconds per poll of a drainer that has read everything (rounds that deliver nothing).
fn idle_polls(mem: &mut ProcMemory, mut d: Drainer) -> Result<f64, Error> {
    let mut n = 0u64;
    let t = Instant::now();
    for _ in 0..ROUNDS {
        d.poll(mem, &mut |_| n += 1)?;
    }
    let s = t.elapsed().as_secs_f64();
    if n != 0 {
        return Err(format!("{n} records appeared in a held guest's rings").into());
    }
    Ok(s / f64::from(ROUNDS))
}
