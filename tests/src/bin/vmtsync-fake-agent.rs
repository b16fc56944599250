//! `vmtsync-fake-agent`: the loopback guest agent (`vmtsync_tests::fake_agent`) on a Unix socket,
//! for `cargo xtask demo` on a machine without `/dev/kvm`.
//!
//! Usage: `vmtsync-fake-agent SOCKET [SKEW]`. It binds `SOCKET`, serves one probe session
//! (the core's agent state machine, its "guest TSC" the host TSC plus `SKEW`, default 0) and
//! exits 0 when the host shuts the session down or disconnects; 2 on usage errors, 1 when the
//! socket cannot be bound or accepted.

use std::os::unix::net::UnixListener;
use std::process::ExitCode;

use vmtsync_tests::fake_agent::{SkewedClock, serve};

const USAGE: &str = "usage: vmtsync-fake-agent SOCKET [SKEW]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, skew) = match args.as_slice() {
        [p] => (p, 0),
        [p, s] => match s.parse::<i64>() {
            Ok(s) => (p, s),
            Err(_) => {
                eprintln!("vmtsync-fake-agent: SKEW must be an i64\n{USAGE}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
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
    let stats = serve(stream, SkewedClock { skew, vcpu: 0 });
    eprintln!("vmtsync-fake-agent: session ended: {stats:?}");
    ExitCode::SUCCESS
}
