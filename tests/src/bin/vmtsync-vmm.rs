//! `vmtsync-vmm`: boots a PVH ELF (the guest agent) in the built-in test VMM, interactively.
//!
//! COM1 is connected to this process's stdin/stdout, COM2 (the agent's defmt log, decoded
//! against the ELF; raw bytes for an ELF without defmt data) is copied to stderr as it grows. `cargo xtask run-agent --vmm builtin` runs it.
//!
//! Usage: `vmtsync-vmm ELF [--timeout SECS] [-- AGENT OPTIONS...]`
//!
//! Exit codes: the guest's isa-debug-exit value when it wrote one (truncated to 0..=255);
//! 124 when the watchdog ended the run; 125 when the guest halted, triple-faulted or failed
//! entry; 2 on usage errors; 1 on VMM errors.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use vmtsync_tests::vmm::{Vm, VmConfig, VmExit};

const USAGE: &str = "usage: vmtsync-vmm ELF [--timeout SECS] [-- AGENT OPTIONS...]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (ours, agent) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (&args[..], &[][..]),
    };
    let mut elf = None;
    let mut timeout = Duration::from_secs(3600);
    let mut it = ours.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--timeout" => match it.next().and_then(|s| s.parse::<u64>().ok()) {
                Some(s) => timeout = Duration::from_secs(s),
                None => {
                    eprintln!("vmtsync-vmm: --timeout needs whole seconds\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ if elf.is_none() => elf = Some(PathBuf::from(a)),
            other => {
                eprintln!("vmtsync-vmm: unexpected argument `{other}`\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(elf) = elf else {
        eprintln!("vmtsync-vmm: no ELF given\n{USAGE}");
        return ExitCode::from(2);
    };
    let cfg = VmConfig {
        cmdline: agent.join(" "),
        timeout,
        ..VmConfig::default()
    };
    let vm = match Vm::boot(&elf, &cfg) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("vmtsync-vmm: {e}");
            return ExitCode::FAILURE;
        }
    };

    // stdin → COM1 in a thread (it blocks); COM1 → stdout and COM2 → stderr here.
    let to_guest = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        let mut stdin = std::io::stdin().lock();
        while let Ok(n @ 1..) = stdin.read(&mut buf) {
            if to_guest.0.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut logged = 0;
    let mut out = std::io::stdout().lock();
    while !vm.is_finished() {
        while let Ok(bytes) = to_guest.1.try_recv() {
            vm.com1().send(&bytes);
        }
        if let Some(b) = vm.com1().recv_timeout(Duration::from_millis(5)) {
            let _ = out.write_all(&[b.byte]);
            while let Some(b) = vm.com1().recv_timeout(Duration::ZERO) {
                let _ = out.write_all(&[b.byte]);
            }
            let _ = out.flush();
        }
        logged = copy_log(&vm, logged);
    }
    while let Some(b) = vm.com1().recv_timeout(Duration::ZERO) {
        let _ = out.write_all(&[b.byte]);
    }
    let _ = out.flush();
    copy_log(&vm, logged);
    match vm.wait() {
        Ok(o) => {
            eprintln!(
                "vmtsync-vmm: {:?} after {} I/O exits in {:?}",
                o.exit, o.io_exits, o.run_time
            );
            match o.exit {
                VmExit::DebugExit(v) => ExitCode::from(u8::try_from(v & 0xff).unwrap_or(255)),
                VmExit::Timeout => ExitCode::from(124),
                VmExit::Stopped => ExitCode::SUCCESS,
                VmExit::Halted | VmExit::Shutdown | VmExit::FailEntry(_) => ExitCode::from(125),
            }
        }
        Err(e) => {
            eprintln!("vmtsync-vmm: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Copies the COM2 log text past byte `from` to stderr; returns the new length. Decoding a
/// longer stream only appends lines, so the text grows at its end.
fn copy_log(vm: &Vm, from: usize) -> usize {
    let log = vm.log_text();
    if log.len() > from {
        let _ = std::io::stderr().write_all(&log.as_bytes()[from..]);
    }
    log.len().max(from)
}
