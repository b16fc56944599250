//! Writes a synthetic guest Perfetto trace with the streaming writer, for measuring memory and
//! for looking at the output in ui.perfetto.dev or the trace processor:
//!
//! ```text
//! cargo build --release -p vmtsync --example perfetto_write
//! /usr/bin/time -v target/release/examples/perfetto_write /tmp/1m.perfetto-trace 1000000 2
//! /usr/bin/time -v target/release/examples/perfetto_write /tmp/10m.perfetto-trace 10000000 2
//! ```
//!
//! Arguments: output path, events, vCPUs. Events alternate between vCPUs, 1000 host ticks
//! apart (BOOTTIME from two real snapshots of this host taken at the start), each with its
//! guest TSC and a ±5000-tick interval, every other one with an 8-byte counter payload. Max RSS
//! (`Maximum resident set size` in `/usr/bin/time -v`) must not grow with the event count.

mod common;

use std::process::ExitCode;

use common::{WriterArgs, synthetic_event};
use vmtsync::formats::perfetto::{PerfettoOptions, PerfettoWriter, boot_clock_now};

fn main() -> ExitCode {
    let a = match WriterArgs::parse("perfetto_write OUT EVENTS VCPUS") {
        Ok(a) => a,
        Err(code) => return code,
    };
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let clock = boot_clock_now(std::time::Duration::from_millis(20))?;
        let start = clock.snapshots()[0].tsc;
        let mut w = PerfettoWriter::create(
            a.out.as_ref(),
            PerfettoOptions {
                machine_id: 1,
                guest_name: "perfetto_write".into(),
                clock,
            },
        )?;
        for i in 0..a.events {
            let host = start + i * 1000;
            let id = u16::try_from(i & 7).unwrap_or(0);
            w.push(&synthetic_event(i, a.vcpus, id, host + 12_345, host))?;
        }
        let s = w.finish()?;
        eprintln!("{} events, {} vCPUs, {} bytes", s.events, s.vcpus, s.bytes);
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("perfetto_write: {e}");
            ExitCode::FAILURE
        }
    }
}
