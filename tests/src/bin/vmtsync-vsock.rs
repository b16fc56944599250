//! `vmtsync-vsock`: boots a PVH ELF (the guest agent) under QEMU q35 + qboot with
//! `vhost-user-vsock-pci` and the `vhost-device-vsock` backend (installed on first use), accepts
//! the agent's vsock connection, runs a probe session over it and prints what it measured.
//! `cargo xtask run-agent --transport vsock` runs it.
//!
//! Usage: `vmtsync-vsock ELF [--machine q35|microvm] [--port P] [--probes N] [--timeout SECS]
//! [-- AGENT OPTIONS...]` (q35: `vhost-user-vsock-pci`; microvm: `vhost-user-vsock-device`).
//! The agent gets `transport=vsock port=P` followed by the extra options; with `vsock=listen`
//! among them the tool connects to the agent instead of accepting its connection.
//!
//! When KVM debugfs is readable (root), the probes are compared with the truth: the VM's KVM
//! mapping from debugfs followed by the agent's `skew=` option, if one is given
//! (`vmtsync_tests::truth`); otherwise the tool says why it cannot and prints only what it
//! measured.
//!
//! Exit codes: the guest's isa-debug-exit value when it wrote one; 1 on errors (the agent's
//! COM2 log and the processes' stderr are printed); 2 on usage errors.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use vmtsync_core::proto::Message;
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::client::{probe_run, wait_ready};
use vmtsync_tests::vmm::qemu::Machine;
use vmtsync_tests::vmm::vsock::{VsockRig, ensure_vhost_device_vsock};

const USAGE: &str = "usage: vmtsync-vsock ELF [--machine q35|microvm] [--port P] [--probes N] \
                     [--timeout SECS] [-- AGENT OPTIONS...]";

struct Args {
    machine: Machine,
    elf: PathBuf,
    port: u32,
    probes: u16,
    timeout: Duration,
    agent: Vec<String>,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let (ours, agent) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    let mut elf = None;
    let mut machine = Machine::Q35;
    let mut port = 1234;
    let mut probes = 100;
    let mut timeout = Duration::from_secs(20);
    let mut it = ours.iter();
    while let Some(a) = it.next() {
        let mut num = |what: &str| {
            it.next()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or(format!("{a} needs {what}"))
        };
        match a.as_str() {
            "--machine" => {
                machine = match it.next().map(String::as_str) {
                    Some("q35") => Machine::Q35,
                    Some("microvm") => Machine::Microvm,
                    _ => return Err("--machine takes q35 or microvm".into()),
                };
            }
            "--port" => port = u32::try_from(num("a port")?).map_err(|e| e.to_string())?,
            "--probes" => probes = u16::try_from(num("a count")?).map_err(|e| e.to_string())?,
            "--timeout" => timeout = Duration::from_secs(num("whole seconds")?),
            _ if elf.is_none() && !a.starts_with('-') => elf = Some(PathBuf::from(a)),
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    Ok(Args {
        machine,
        elf: elf.ok_or("no ELF given")?,
        port,
        probes,
        timeout,
        agent: agent.to_vec(),
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let a = match parse(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmtsync-vsock: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&a) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("vmtsync-vsock: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<u8, String> {
    let backend = ensure_vhost_device_vsock().map_err(|e| e.to_string())?;
    // The agent's skew, for the truth (the last `skew=` word wins, as in the agent).
    let skew = a
        .agent
        .iter()
        .rev()
        .find_map(|o| o.strip_prefix("skew="))
        .map(|v| Skew::parse(v).ok_or(format!("bad agent option skew={v}")))
        .transpose()?;
    let mut append = format!("transport=vsock port={}", a.port);
    for o in &a.agent {
        append.push(' ');
        append.push_str(o);
    }
    eprintln!("vmtsync-vsock: booting {} with `{append}`", a.elf.display());
    let mut rig = VsockRig::start(a.machine, &backend, &a.elf, &append, a.port, a.timeout)
        .map_err(|e| e.to_string())?;
    let fail = |rig: &VsockRig, e: &dyn std::fmt::Display| format!("{e}\n{}", rig.diagnostics());
    // With `vsock=listen` the agent waits for us (the last `vsock=` word wins, as in the agent).
    let listen = a
        .agent
        .iter()
        .rev()
        .find(|o| o.starts_with("vsock="))
        .is_some_and(|o| o == "vsock=listen");
    let connection = if listen {
        rig.wait_log(&format!("vsock: listening on port {}", a.port), a.timeout)
            .and_then(|()| rig.connect(a.port, a.timeout))
    } else {
        rig.accept(a.timeout)
    };
    let mut client = connection.map_err(|e| fail(&rig, &e))?;
    // Connected: QEMU has created its VM and vCPU, so KVM's side of the truth is readable.
    let truth = GuestTruth::read(rig.pids().0, 0, skew)
        .inspect_err(|e| eprintln!("vmtsync-vsock: no truth to compare with: {e}"))
        .ok();
    wait_ready(&mut client, Instant::now() + a.timeout).map_err(|e| fail(&rig, &e))?;
    let (mut session, run) =
        probe_run(client, u32::from(a.probes), a.timeout).map_err(|e| fail(&rig, &e))?;
    println!("agent: {:?}", run.info);
    for (seq, s) in run.samples.iter().enumerate() {
        println!(
            "probe {seq}: host sent {}, guest tsc {}, host received {} (rtt {})",
            s.host_send.0,
            s.guest.0,
            s.host_recv.0,
            s.host_recv.0.wrapping_sub(s.host_send.0)
        );
    }
    let rtts = run.rtts_sorted();
    let interval = run
        .offset_interval()
        .map_or_else(|e| format!("{e:?}"), |(lo, hi)| format!("[{lo}, {hi}]"));
    if let (Some(min), Some(med)) = (rtts.first(), rtts.get(rtts.len() / 2)) {
        println!(
            "{} probes ({:?}): rtt min {min} / median {med} cycles; offset (guest - host) in \
             {interval}",
            run.samples.len(),
            run.stats,
        );
    }
    if let Some(truth) = &truth {
        let errs = run.midpoint_errors_sorted(truth);
        println!(
            "truth {truth:?}: {} probes outside their bracket; midpoint |error| median {} \
             ticks",
            run.outside_bracket(truth).len(),
            errs.get(errs.len() / 2).map_or(0, |e| *e)
        );
    }
    let (bye, _) = session
        .request(&Message::Shutdown)
        .map_err(|e| fail(&rig, &e))?;
    if bye != Message::Exiting {
        return Err(fail(&rig, &format!("expected Exiting, got {bye:?}")));
    }
    let status = rig.wait_exit(a.timeout).map_err(|e| fail(&rig, &e))?;
    eprint!("{}", rig.com2_log());
    match status.code() {
        // QEMU's isa-debug-exit status is (value << 1) | 1.
        Some(s) if s & 1 == 1 => Ok(u8::try_from((s >> 1) & 0xff).unwrap_or(u8::MAX)),
        _ => Err(fail(
            &rig,
            &format!("QEMU ended without isa-debug-exit: {status}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn arguments_parse_and_validate() {
        let a = parse(&args(&[
            "a.elf",
            "--machine",
            "microvm",
            "--port",
            "9",
            "--probes",
            "3",
            "--",
            "exit=2",
        ]))
        .expect("valid");
        assert_eq!(
            (a.machine, a.elf, a.port, a.probes, a.agent),
            (
                Machine::Microvm,
                PathBuf::from("a.elf"),
                9,
                3,
                args(&["exit=2"])
            )
        );
        assert!(parse(&args(&["a.elf", "--machine", "pc"])).is_err());
        assert!(parse(&args(&[])).is_err());
        assert!(parse(&args(&["a.elf", "--probes", "70000"])).is_err());
        assert!(parse(&args(&["a.elf", "--port"])).is_err());
        assert!(parse(&args(&["a.elf", "b.elf"])).is_err());
    }
}
