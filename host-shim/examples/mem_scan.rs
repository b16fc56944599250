//! Times the memory reader's header scan (`vmtsync::guestmem::find` with `Location::Scan`, what
//! `vmtsync record --from-memory` does without `--addr`) on a live VMM process, for `cargo
//! xtask bench`'s memory section:
//!
//! ```text
//! cargo build --release -p vmtsync --example mem_scan
//! target/release/examples/mem_scan PID 5
//! ```
//!
//! Arguments: the VMM's PID, runs. Each run opens `/proc/PID/mem` afresh and times `find`;
//! then one `guestmem::scan` over the same mappings reports what a scan looks at. Prints one
//! line `mem-scan: addr=0x… nonce=0x… find_ms=a,b,… regions=R bytes_mapped=M bytes_read=B
//! pages_skipped=P pagemap=true|false`. Needs ptrace rights over the process (root).

use std::process::ExitCode;
use std::time::Instant;

use vmtsync::guestmem::{self, GuestMemory, Location, ProcMemory};
use vmtsync::kvm::procinfo::ProcFs;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(pid), Some(runs)) = (
        args.get(1).and_then(|s| s.parse::<u32>().ok()),
        args.get(2)
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&r| r > 0),
    ) else {
        eprintln!("usage: mem_scan PID RUNS(>0)");
        return ExitCode::from(2);
    };
    match run(pid, runs) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mem_scan: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(pid: u32, runs: usize) -> Result<String, Box<dyn std::error::Error>> {
    let proc = ProcFs::default();
    let mut times = Vec::with_capacity(runs);
    let mut found = None;
    for _ in 0..runs {
        let mut mem = ProcMemory::open(&proc, pid)?;
        let t = Instant::now();
        let f = guestmem::find(&mut mem, Location::Scan)?;
        times.push(format!("{:.3}", t.elapsed().as_secs_f64() * 1e3));
        if found
            .as_ref()
            .is_some_and(|g: &guestmem::Found| g.addr != f.addr)
        {
            return Err("the header moved between two scans".into());
        }
        found = Some(f);
    }
    let found = found.ok_or("no run")?;
    let mut mem = ProcMemory::open(&proc, pid)?;
    let regions = guestmem::find::coalesce(mem.regions()?);
    let (_, stats) = guestmem::scan(&mut mem, &regions)?;
    Ok(format!(
        "mem-scan: addr={:#x} nonce={:#x} find_ms={} regions={} bytes_mapped={} bytes_read={} \
         pages_skipped={} pagemap={}",
        found.addr,
        found.header.nonce,
        times.join(","),
        stats.regions,
        stats.bytes_mapped,
        stats.bytes_read,
        stats.pages_skipped,
        stats.pagemap
    ))
}
