//! Times `vmtsync trace-cmd attach`'s work (`tracedat::attach_time_shift`) on a synthetic guest
//! trace.dat of about `MB` megabytes, against a full walk of its events, for `cargo xtask
//! bench`:
//!
//! ```text
//! cargo build --release -p vmtsync --example attach_time
//! target/release/examples/attach_time /tmp 100 0 3    # 100 MB of payload-less events
//! target/release/examples/attach_time /tmp 100 16 3   # 100 MB, 16-byte payloads (fewer events)
//! ```
//!
//! Arguments: directory, megabytes, payload bytes per event (0..=16), runs. Prints one line
//! `attach-time: events=N bytes=B attach_ms=a,b,… walk_ms=x,y,…`. Attaching copies the file
//! (`copy_file_range`) and reads each CPU's first and last page, so its time should follow
//! the file's size, not its event count; the walk reads every event.

use std::process::ExitCode;
use std::time::Instant;

use vmtsync::formats::tracedat::{
    ShiftMode, SyncSegment, TimeShift, TraceDatWriter, WriterOptions, attach_time_shift,
    cpu_time_ranges, for_each_record, read_layout,
};
use vmtsync_core::HostTicks;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(mb), Some(payload), Some(runs)) = (
        args.get(1),
        args.get(2).and_then(|s| s.parse::<u64>().ok()),
        args.get(3)
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&p| p <= 16),
        args.get(4).and_then(|s| s.parse::<usize>().ok()),
    ) else {
        eprintln!("usage: attach_time DIR MB PAYLOAD(0..=16) RUNS");
        return ExitCode::from(2);
    };
    match run(dir.as_ref(), mb, payload, runs) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("attach_time: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    dir: &std::path::Path,
    mb: u64,
    payload: usize,
    runs: usize,
) -> Result<String, vmtsync::formats::tracedat::TraceDatError> {
    let guest = dir.join(format!("attach-time-{}-{payload}.dat", std::process::id()));
    let out = dir.join(format!(
        "attach-time-{}-{payload}.out.dat",
        std::process::id()
    ));
    let r = measure(&guest, &out, mb, payload, runs);
    let _ = std::fs::remove_file(&guest);
    let _ = std::fs::remove_file(&out);
    r
}

fn measure(
    guest: &std::path::Path,
    out: &std::path::Path,
    mb: u64,
    payload: usize,
    runs: usize,
) -> Result<String, vmtsync::formats::tracedat::TraceDatError> {
    // 4 bytes of header plus 12 (no payload) or 32 bytes of record per event.
    let per_event = if payload == 0 { 16 } else { 36 };
    let events = mb * 1_000_000 / per_event;
    let mut w = TraceDatWriter::create(guest, WriterOptions::new(2, 0x5eed))?;
    let bytes = [0xa5u8; 16];
    for i in 0..events {
        w.push(
            u32::from(i % 2 == 1),
            1_000_000 + i * 1000,
            0,
            &bytes[..payload],
        )?;
    }
    w.finish(None)?;
    let shift = TimeShift {
        peer_trace_id: 0,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment::offset_only(HostTicks(1_000_000), -123_456)]; 2],
    };
    let (mut attach_ms, mut walk_ms) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let layout = read_layout(guest)?;
        let ranges = cpu_time_ranges(guest, &layout)?;
        attach_time_shift(guest, out, &layout, &ranges, &shift, 1)?;
        attach_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let mut n = 0u64;
        for_each_record(guest, &layout, 0, |_, _, _| n += 1)?;
        walk_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(n, events);
    }
    let size = std::fs::metadata(guest).map_or(0, |m| m.len());
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    Ok(format!(
        "attach-time: events={events} bytes={size} attach_ms={} walk_ms={}",
        list(&attach_ms),
        list(&walk_ms)
    ))
}
