//! `vmtsync-fake-agent`: the loopback guest agent (`vmtsync_tests::fake_agent`) on a Unix socket,
//! for `cargo xtask demo` on a machine without `/dev/kvm`.
//!
//! Usage: `vmtsync-fake-agent SOCKET [SKEW [EVENTS [RATE]]]`. It binds `SOCKET`, serves one
//! probe session (the core's agent state machine, its "guest TSC" the host TSC plus `SKEW`,
//! default 0; with `EVENTS`, a producer thread records that many events at `RATE` per second,
//! default 0 = as fast as possible) and exits 0 when the host shuts the session down or
//! disconnects; 2 on usage errors, 1 when the socket cannot be bound or accepted.

use std::os::unix::net::UnixListener;
use std::process::ExitCode;

use vmtsync_tests::fake_agent::{SkewedClock, Workload, serve_with_events};

const USAGE: &str = "usage: vmtsync-fake-agent SOCKET [SKEW [EVENTS [RATE]]]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((path, rest)) = args.split_first().filter(|(_, r)| r.len() <= 3) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let num = |i: usize| rest.get(i).map(|s| s.parse::<i64>());
    let (skew, count, rate) = match (num(0), num(1), num(2)) {
        (Some(Err(_)), ..) | (_, Some(Err(_)), _) | (.., Some(Err(_))) => {
            eprintln!("vmtsync-fake-agent: SKEW, EVENTS and RATE must be integers\n{USAGE}");
            return ExitCode::from(2);
        }
        (s, c, r) => (
            s.and_then(Result::ok).unwrap_or(0),
            c.and_then(Result::ok).unwrap_or(0),
            r.and_then(Result::ok).unwrap_or(0),
        ),
    };
    let (Ok(count), Ok(rate)) = (u64::try_from(count), u64::try_from(rate)) else {
        eprintln!("vmtsync-fake-agent: EVENTS and RATE must not be negative\n{USAGE}");
        return ExitCode::from(2);
    };
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vmtsync-fake-agent: binding {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stream = match listener.accept() {
        Ok((s, _)) => s,
        Err(e) => {
            eprintln!("vmtsync-fake-agent: accepting on {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (stats, dropped) = serve_with_events(
        stream,
        SkewedClock { skew, vcpu: 0 },
        Workload {
            count,
            rate,
            ..Workload::default()
        },
    );
    eprintln!("vmtsync-fake-agent: session ended: {stats:?}, {dropped} events dropped");
    ExitCode::SUCCESS
}
