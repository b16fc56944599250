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

mod common;

use std::process::ExitCode;

use common::{WriterArgs, synthetic_event};
use vmtsync::formats::ctf::{CtfOptions, GuestCtf, GuestFields};

fn main() -> ExitCode {
    let a = match WriterArgs::parse("ctf_write OUT_DIR EVENTS VCPUS") {
        Ok(a) => a,
        Err(code) => return code,
    };
    let opts = CtfOptions {
        tsc_hz: 2_300_000_000,
        name: "ctf_write".into(),
        env: Vec::new(),
    };
    let run = || -> Result<u64, vmtsync::formats::ExportError> {
        let mut w = GuestCtf::create(a.out.as_ref(), &opts, GuestFields::ALL)?;
        let mut ts = 1_000_000u64;
        for i in 0..a.events {
            ts += 1000;
            let id = u16::try_from(i & 0xffff).unwrap_or(0);
            w.push(&synthetic_event(i, a.vcpus, id, ts + 123_456, ts))?;
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
