//! The recorder's cost per event, every contender in this one process on the same clock:
//! the C recorder (`capi/`, `vmtsync_record`), core's `Recorder` and `MemRecorder`, barectf
//! (when tests/build.rs generated it) and three floors: `lfence; rdtsc` alone; with a plain
//! 32-byte slot store; and with the least a ring read through a head word adds (load the head,
//! mark the slot busy, commit it, store the head). Each event carries an 8-byte payload; every ring is a flight ring of
//! 4096 records, so no event is refused and nothing drains in the timed loop.
//!
//! The process pins itself to one CPU; each round runs every contender once (`--events` events
//! each, in a rotated order), stamping `lfence; rdtsc` before and after, and the medians over
//! `--rounds` rounds are printed as one JSON object (`cargo xtask bench --only recorder`
//! writes the table). Ticks become nanoseconds through a TSC frequency calibrated here against
//! CLOCK_MONOTONIC.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use vmtsync_core::arch::Tsc;
use vmtsync_core::recorder::{MemRecorder, Mode, Recorder, Slot};

#[link(name = "vmtsync_recorder_bench", kind = "static")]
unsafe extern "C" {
    fn vb_floor_tsc(n: u64) -> u64;
    fn vb_floor_store(n: u64, payload: u64) -> u64;
    fn vb_c_init() -> i32;
    fn vb_c_record(n: u64, payload: u64) -> u64;
    fn vb_c_produced() -> u64;
    fn vb_barectf_init() -> i32;
    fn vb_barectf(n: u64, payload: u64) -> u64;
    fn vb_floor_head(n: u64, payload: u64) -> u64;
}

/// The one clock every contender reads: `lfence; rdtsc` (NativeTsc may pick RDTSCP).
struct LfenceTsc;

impl Tsc for LfenceTsc {
    #[inline(always)]
    fn read_ordered(&self) -> u64 {
        stamp()
    }
}

#[inline(always)]
fn stamp() -> u64 {
    // SAFETY: LFENCE and RDTSC have no memory operands and exist on every x86_64 CPU.
    unsafe {
        core::arch::x86_64::_mm_lfence();
        core::arch::x86_64::_rdtsc()
    }
}

const CAP: usize = 4096;
static RECORDER: Recorder<1, CAP> = Recorder::new_flight();
const MEM_SLOTS: usize = match MemRecorder::storage_slots(1, CAP) {
    Some(n) => n,
    None => panic!("a valid shape"),
};
#[repr(C, align(64))]
struct Storage([Slot; MEM_SLOTS]);
static MEM: Storage = Storage([const { Slot::new() }; MEM_SLOTS]);

const PAYLOAD: u64 = 0x0123_4567_89ab_cdef;

#[derive(Clone, Copy)]
enum Contender {
    FloorTsc,
    FloorStore,
    C,
    Recorder,
    MemRecorder,
    Barectf,
    FloorHead,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Self::FloorTsc => "floor_tsc",
            Self::FloorStore => "floor_tsc_store",
            Self::C => "c_recorder",
            Self::Recorder => "rust_recorder",
            Self::MemRecorder => "rust_mem_recorder",
            Self::Barectf => "barectf",
            Self::FloorHead => "floor_tsc_store_head",
        }
    }
}

fn run(c: Contender, n: u64, mem: &MemRecorder<'_>) -> u64 {
    let tsc = LfenceTsc;
    let payload = PAYLOAD.to_le_bytes();
    match c {
        // SAFETY: the C functions touch only their own static buffers, from this one thread.
        Contender::FloorTsc => unsafe { vb_floor_tsc(n) },
        // SAFETY: as above.
        Contender::FloorStore => unsafe { vb_floor_store(n, PAYLOAD) },
        // SAFETY: as above; vb_c_init succeeded before the first round.
        Contender::C => unsafe { vb_c_record(n, PAYLOAD) },
        // SAFETY: as above; vb_barectf_init succeeded before the first round.
        Contender::Barectf => unsafe { vb_barectf(n, PAYLOAD) },
        // SAFETY: as above.
        Contender::FloorHead => unsafe { vb_floor_head(n, PAYLOAD) },
        Contender::Recorder => {
            let t0 = stamp();
            // The same call as the C contender's: constant vCPU, id and payload length.
            for _ in 0..n {
                let _ = RECORDER.ring(0).map(|r| r.record(&tsc, 7, &payload));
            }
            stamp() - t0
        }
        Contender::MemRecorder => {
            let t0 = stamp();
            for _ in 0..n {
                let _ = mem.ring(0).map(|r| r.record(&tsc, 7, &payload));
            }
            stamp() - t0
        }
    }
}

fn pin(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// TSC ticks per microsecond (MHz), against CLOCK_MONOTONIC over `span`.
fn tsc_mhz(span: Duration) -> f64 {
    let (t0, c0) = (Instant::now(), stamp());
    while t0.elapsed() < span {
        std::hint::spin_loop();
    }
    let (c1, dt) = (stamp(), t0.elapsed());
    (c1 - c0) as f64 / dt.as_secs_f64() / 1e6
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn arg(args: &[String], name: &str, default: u64) -> Result<u64, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a number")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = (|| -> Result<(u64, u64, u64), String> {
        Ok((
            arg(&args, "--rounds", 31)?,
            arg(&args, "--events", 200_000)?,
            arg(&args, "--cpu", 1)?,
        ))
    })();
    let (rounds, events, cpu) = match parsed {
        Ok(p) => p,
        Err(e) => {
            eprintln!("vmtsync-recorder-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let pinned = pin(usize::try_from(cpu).unwrap_or(0));
    let mem = MemRecorder::init(&MEM.0, 1, CAP, Mode::Overwrite).expect("a valid shape");
    // SAFETY: called once, before any other vb_* function, from this one thread.
    let c_ok = unsafe { vb_c_init() } == 0;
    // SAFETY: as above.
    let barectf = unsafe { vb_barectf_init() } == 1;
    if !c_ok {
        eprintln!("vmtsync-recorder-bench: the C recorder refused its shape");
        return ExitCode::FAILURE;
    }
    let mut contenders = vec![
        Contender::FloorTsc,
        Contender::FloorStore,
        Contender::C,
        Contender::Recorder,
        Contender::MemRecorder,
        Contender::FloorHead,
    ];
    if barectf {
        contenders.push(Contender::Barectf);
    }
    let mhz_before = tsc_mhz(Duration::from_millis(200));
    // A warm-up round, not counted.
    for &c in &contenders {
        run(c, events, &mem);
    }
    let mut ticks: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
    for round in 0..rounds {
        let k = contenders.len();
        for j in 0..k {
            let i = (j + usize::try_from(round).unwrap_or(0)) % k;
            let t = run(contenders[i], events, &mem);
            ticks[i].push(t as f64 / events as f64);
        }
    }
    let mhz = (mhz_before + tsc_mhz(Duration::from_millis(200))) / 2.0;
    // The C ring really stored every event (a recorder that stored nothing would be fast).
    // SAFETY: as above.
    let c_stored = unsafe { vb_c_produced() };
    let expect = events * (rounds + 1);
    if c_stored != expect {
        eprintln!("vmtsync-recorder-bench: the C recorder stored {c_stored} of {expect} events");
        return ExitCode::FAILURE;
    }
    let mut out = serde_json::Map::new();
    out.insert("tsc_mhz".into(), mhz.into());
    out.insert("pinned".into(), pinned.into());
    out.insert("rounds".into(), rounds.into());
    out.insert("events_per_round".into(), events.into());
    out.insert("barectf_built".into(), barectf.into());
    for (i, c) in contenders.iter().enumerate() {
        let v = &mut ticks[i];
        let med = median(v);
        let min = v.first().copied().unwrap_or(f64::NAN);
        out.insert(
            c.name().into(),
            serde_json::json!({
                "ticks_median": med,
                "ticks_min": min,
                "ns_median": med / mhz * 1e3,
                "ns_min": min / mhz * 1e3,
            }),
        );
    }
    println!("{}", serde_json::Value::Object(out));
    ExitCode::SUCCESS
}
