//! Writes a synthetic guest trace.dat with the streaming writer, for measuring memory and for
//! looking at the output with trace-cmd:
//!
//! ```text
//! cargo build --release -p vmtsync --example tracedat_write
//! /usr/bin/time -v target/release/examples/tracedat_write /tmp/1m.dat 1000000 2 7
//! /usr/bin/time -v target/release/examples/tracedat_write /tmp/10m.dat 10000000 2 7
//! ```
//!
//! Arguments: output path, events, CPUs, file version (6 or 7). Events alternate between CPUs,
//! 1000 ticks apart with every 1000th gap 2^30 ticks (a time extend), every other one carries
//! an 8-byte counter payload; one identity TIME_SHIFT segment per CPU (offset 123456). Max RSS
//! (`Maximum resident set size` in `/usr/bin/time -v`) must not grow with the event count.

use std::process::ExitCode;

use vmtsync::formats::tracedat::{
    FileVersion, ShiftMode, SyncSegment, TimeShift, TraceDatWriter, WriterOptions,
};
use vmtsync_core::HostTicks;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(n), Some(cpus), Some(ver)) = (
        args.get(1),
        args.get(2).and_then(|s| s.parse::<u64>().ok()),
        args.get(3).and_then(|s| s.parse::<u32>().ok()),
        args.get(4).and_then(|s| s.parse::<u32>().ok()),
    ) else {
        eprintln!("usage: tracedat_write OUT EVENTS CPUS VERSION(6|7)");
        return ExitCode::from(2);
    };
    let mut opts = WriterOptions::new(cpus, 0x5eed);
    opts.version = if ver == 6 {
        FileVersion::V6
    } else {
        FileVersion::V7
    };
    let run = || -> Result<(), vmtsync::formats::tracedat::TraceDatError> {
        let mut w = TraceDatWriter::create(path.as_ref(), opts)?;
        let mut ts = 1_000_000u64;
        for i in 0..n {
            ts += if i % 1000 == 999 { 1 << 30 } else { 1000 };
            let cpu = u32::try_from(i % u64::from(cpus)).unwrap_or(0);
            let payload = i.to_le_bytes();
            let payload: &[u8] = if i % 2 == 0 { &[] } else { &payload };
            w.push(cpu, ts, u32::try_from(i & 0xffff).unwrap_or(0), payload)?;
        }
        let shift = TimeShift {
            peer_trace_id: 1,
            mode: ShiftMode::Step,
            cpus: (0..cpus)
                .map(|_| vec![SyncSegment::offset_only(HostTicks(0), 123_456)])
                .collect(),
        };
        let s = w.finish(Some(&shift))?;
        eprintln!(
            "{} events, {} pages, {} bytes",
            s.events.iter().sum::<u64>(),
            s.pages.iter().sum::<u64>(),
            s.bytes
        );
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tracedat_write: {e}");
            ExitCode::FAILURE
        }
    }
}
