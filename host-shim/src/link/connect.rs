//! Opening a [`ProbeAddr`]: the dispatch from an address to a connected [`StreamTransport`].
//!
//! Every wait has a deadline. A guest whose vsock queues are not up yet makes
//! vhost-device-vsock drop (or, about one connect in twenty in early experiments, hang) a
//! host connection, so connects and handshakes are retried with a short backoff until the
//! connect deadline passes (docs/probe.md). The pieces: [`super::options`] (what to wait for, why it failed, backoff, deadline,
//! stop flag), `sockets` (Unix and TCP), [`super::vhost_uds`] (vhost-device-vsock's
//! `CONNECT` handshake), [`super::vsock`] (AF_VSOCK).

use std::io;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::addr::ProbeAddr;
use super::options::{ConnectError, ConnectOptions, Retry, retryable, timeout_err};
use super::sockets::{accept_unix, connect_tcp, connect_unix};
use super::transport::{SocketStream, StampedTransport, StreamTransport};
use super::vhost_uds::vsock_uds_handshake;
use super::vsock::VsockStream;

/// Connects to `addr` and wraps the socket in a [`StreamTransport`].
///
/// # Errors
/// [`ConnectError`]; never waits longer than `opts.connect_timeout` in total.
pub fn connect(
    addr: &ProbeAddr,
    opts: &ConnectOptions,
) -> Result<Box<dyn StampedTransport + Send>, ConnectError> {
    connect_until_stopped(addr, opts, None)
}

/// [`connect`], giving up with [`ConnectError::Interrupted`] within about 20 ms of `stop`
/// being raised (the CLI's SIGINT/SIGTERM flag), so Ctrl-C is not held up by the retries.
///
/// # Errors
/// As [`connect`], plus [`ConnectError::Interrupted`].
pub fn connect_until_stopped(
    addr: &ProbeAddr,
    opts: &ConnectOptions,
    stop: Option<&'static AtomicBool>,
) -> Result<Box<dyn StampedTransport + Send>, ConnectError> {
    let name = addr.to_string();
    let io_err = ConnectError::io(&name);
    let mut retry = Retry::new(opts.connect_timeout, stop);
    match addr {
        ProbeAddr::Unix(path) => {
            let s = connect_unix(path, &name, &mut retry, opts)?;
            wrap(s, opts.io_timeout).map_err(io_err)
        }
        ProbeAddr::UnixListen(path) => {
            let s = accept_unix(path, &name, &retry, opts)?;
            wrap(s, opts.io_timeout).map_err(io_err)
        }
        ProbeAddr::VsockUds { path, port } => {
            let s = vsock_uds_handshake(path, *port, &name, &mut retry, opts)?;
            wrap(s, opts.io_timeout).map_err(io_err)
        }
        ProbeAddr::Tcp { host, port } => {
            let s = connect_tcp(host, *port, &name, &mut retry, opts)?;
            wrap(s, opts.io_timeout).map_err(io_err)
        }
        ProbeAddr::Vsock { cid, port } => {
            // A guest whose agent is not listening yet resets the connection: retry.
            let s = loop {
                match VsockStream::connect(*cid, *port) {
                    Ok(s) => break s,
                    Err(e) if retryable(&e) => {
                        if !retry.again(&e) {
                            return Err(timeout_err(&name, &retry, opts));
                        }
                    }
                    Err(e) => return Err(io_err(e)),
                }
            };
            wrap(s, opts.io_timeout).map_err(io_err)
        }
    }
}

fn wrap<S: SocketStream + Send + 'static>(
    s: S,
    io_timeout: Duration,
) -> io::Result<Box<dyn StampedTransport + Send>> {
    Ok(Box::new(StreamTransport::new(s, io_timeout)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::AtomicBool;
    use std::thread;
    use std::time::Instant;

    use super::*;

    /// `name` in a fresh temp dir, removed (with its contents) when the guard drops.
    fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        crate::testutil::temp_path("vmtsync-connect-", name)
    }

    #[test]
    fn unix_connect_retries_until_the_listener_appears() {
        let (_tmp_dir, path) = tmp("late.sock");
        let p2 = path.clone();
        let server = thread::spawn(move || {
            thread::sleep(Duration::from_millis(60));
            let l = UnixListener::bind(&p2).unwrap();
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"x").unwrap();
        });
        let opts = ConnectOptions::default();
        let mut t = connect(&ProbeAddr::Unix(path.clone()), &opts).unwrap();
        let mut b = [0u8; 1];
        let r = t
            .recv(&mut b, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!((r.len, b[0]), (1, b'x'));
        server.join().unwrap();
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn connect_gives_up_at_the_deadline() {
        let (_tmp_dir, path) = tmp("never.sock");
        let opts = ConnectOptions {
            connect_timeout: Duration::from_millis(50),
            io_timeout: Duration::from_millis(50),
        };
        let err = connect(&ProbeAddr::Unix(path), &opts).err().unwrap();
        assert!(matches!(err, ConnectError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("agent started"), "{err}");
    }

    #[test]
    fn a_raised_stop_flag_ends_the_retries_with_interrupted() {
        static STOP: AtomicBool = AtomicBool::new(true);
        let (_tmp_dir, path) = tmp("stopped.sock");
        // An hour to connect to nothing: only the flag ends it (it did not, before).
        let opts = ConnectOptions {
            connect_timeout: Duration::from_secs(3600),
            io_timeout: Duration::from_millis(50),
        };
        for addr in [
            ProbeAddr::Unix(path.clone()),
            ProbeAddr::UnixListen(path.clone()),
            ProbeAddr::VsockUds {
                path: path.clone(),
                port: 5000,
            },
        ] {
            let err = connect_until_stopped(&addr, &opts, Some(&STOP))
                .err()
                .unwrap();
            assert!(matches!(err, ConnectError::Interrupted(_)), "{addr}: {err}");
        }
    }

    #[test]
    fn unix_listen_accepts_and_removes_its_socket() {
        let (_tmp_dir, path) = tmp("listen.sock");
        let p2 = path.clone();
        let client = thread::spawn(move || {
            let mut retry = Retry::new(Duration::from_secs(5), None);
            let opts = ConnectOptions::default();
            let mut s = connect_unix(&p2, "c", &mut retry, &opts).unwrap();
            s.write_all(b"y").unwrap();
        });
        let mut t = connect(
            &ProbeAddr::UnixListen(path.clone()),
            &ConnectOptions::default(),
        )
        .unwrap();
        let mut b = [0u8; 1];
        t.recv(&mut b, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(b[0], b'y');
        client.join().unwrap();
        assert!(!path.exists());
        // An existing path is refused rather than clobbered.
        std::fs::write(&path, b"").unwrap();
        let err = connect(
            &ProbeAddr::UnixListen(path.clone()),
            &ConnectOptions::default(),
        )
        .err()
        .unwrap();
        assert!(matches!(err, ConnectError::PathInUse(_)), "{err}");
        std::fs::remove_file(path).unwrap();
    }
}
