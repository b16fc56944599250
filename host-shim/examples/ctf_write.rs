//! Writes a synthetic guest CTF trace with the streaming writer, for measuring memory and for
//! looking at the output with babeltrace2:
//!
//! ```text
//! cargo build --release -p vmtsync --example ctf_write
//! /usr/bin/time -v target/release/examples/ctf_write /tmp/1m 1000000 2
//! babeltrace2 --clock-cycles /tmp/1m | head
//! ```
//!
//! Arguments: output directory, events, vCPUs. Events go round-robin over the vCPUs, 1000 host
//! ticks apart, every field set, every other one with an 8-byte counter payload. Max RSS
//! (`Maximum resident set size` in `/usr/bin/time -v`) must not grow with the event count.

use std::process::ExitCode;

use vmtsync::formats::ctf::{CtfOptions, GuestCtf, GuestFields};
use vmtsync::formats::{Bound, ExportEvent, Payload};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(out), Some(n), Some(vcpus)) = (
        args.get(1),
        args.get(2).and_then(|s| s.parse::<u64>().ok()),
        args.get(3)
            .and_then(|s| s.parse::<u32>().ok())
            .filter(|&v| v > 0),
    ) else {
        eprintln!("usage: ctf_write OUT_DIR EVENTS VCPUS");
        return ExitCode::from(2);
    };
    let opts = CtfOptions {
        tsc_hz: 2_300_000_000,
        name: "ctf_write".into(),
        env: Vec::new(),
    };
    let run = || -> Result<u64, vmtsync::formats::ExportError> {
        let mut w = GuestCtf::create(out.as_ref(), &opts, GuestFields::ALL)?;
        let mut ts = 1_000_000u64;
        for i in 0..n {
            ts += 1000;
            let bytes = i.to_le_bytes();
            w.push(&ExportEvent {
                vcpu: u32::try_from(i % u64::from(vcpus)).unwrap_or(0),
                id: u16::try_from(i & 0xffff).unwrap_or(0),
                guest_tsc: Some(ts + 123_456),
                host_tsc: ts,
                bound: Some(Bound {
                    lo: ts - 5_000,
                    hi: ts + 5_000,
                }),
                payload: Payload::new(if i % 2 == 0 { &[] } else { &bytes }).unwrap_or_default(),
            })?;
        }
        Ok(w.finish()?.events)
    };
    match run() {
        Ok(events) => {
            println!("{events} events");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ctf_write: {e}");
            ExitCode::FAILURE
        }
    }
}
