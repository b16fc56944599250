//! vhost-device-vsock's host-initiated connection (`vsock-uds:`): connect to its Unix socket,
//! send `CONNECT <port>\n`, read exactly `OK <n>\n` and nothing after it, so the agent's first
//! bytes stay in the stream. This is the one implementation of the handshake; the test rigs
//! reuse it through [`connect_vhost_uds`].

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::options::{ConnectError, ConnectOptions, Retry, retryable, timeout_err};
use super::sockets::connect_unix;

/// Connects to the guest's vsock port `port` through vhost-device-vsock's Unix socket `path`,
/// retrying until `opts.connect_timeout`; the stream is returned blocking, with no timeouts
/// set, positioned right after the `OK` line.
///
/// # Errors
/// As [`super::connect::connect`] for a `vsock-uds:` address.
pub fn connect_vhost_uds(
    path: &Path,
    port: u32,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    let name = format!("vsock-uds:{}:{port}", path.display());
    let mut retry = Retry::new(opts.connect_timeout, None);
    vsock_uds_handshake(path, port, &name, &mut retry, opts)
}

/// The longest `OK …` line accepted; vhost-device-vsock sends `OK <local port>\n`.
const MAX_HANDSHAKE_LINE: usize = 64;
/// The longest one handshake attempt waits for `OK` before reconnecting.
const HANDSHAKE_ATTEMPT: Duration = Duration::from_secs(1);

/// vhost-device-vsock's host-initiated connection: connect to its Unix socket, send
/// `CONNECT <port>\n`, read `OK <n>\n`. A connection closed before `OK` (the guest's queues
/// are not up yet) or an `OK` that does not come within a second is retried until the
/// connect deadline.
///
/// # Errors
/// [`ConnectError::Handshake`] for a reply other than `OK`, [`ConnectError::Timeout`] when
/// the deadline passes, [`ConnectError::Io`] for other errors.
pub(super) fn vsock_uds_handshake(
    path: &Path,
    port: u32,
    name: &str,
    retry: &mut Retry,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    let io_err = ConnectError::io(name);
    loop {
        let mut s = connect_unix(path, name, retry, opts)?;
        let wait = retry.left().min(HANDSHAKE_ATTEMPT);
        if wait.is_zero() {
            return Err(timeout_err(name, retry, opts));
        }
        s.set_read_timeout(Some(wait)).map_err(io_err)?;
        s.set_write_timeout(Some(wait)).map_err(io_err)?;
        // One deadline for the whole handshake, not a timeout per byte: a peer that dribbles
        // bytes cannot stretch an attempt past HANDSHAKE_ATTEMPT.
        let deadline = Instant::now() + wait;
        let attempt = s
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .and_then(|()| read_line(&mut s, deadline));
        match attempt {
            Ok(Some(line)) if is_ok_reply(&line) => {
                s.set_read_timeout(None).map_err(io_err)?;
                s.set_write_timeout(None).map_err(io_err)?;
                return Ok(s);
            }
            Ok(Some(line)) => {
                return Err(ConnectError::Handshake {
                    addr: name.to_owned(),
                    reply: line.escape_ascii().to_string(),
                });
            }
            Ok(None) => {
                if !retry.again("connection closed before OK (guest vsock not ready)") {
                    return Err(timeout_err(name, retry, opts));
                }
            }
            Err(e) if retryable(&e) || e.kind() == io::ErrorKind::BrokenPipe => {
                if !retry.again(&e) {
                    return Err(timeout_err(name, retry, opts));
                }
            }
            Err(source) => return Err(io_err(source)),
        }
    }
}

/// Reads one `\n`-terminated line (without it), byte by byte so nothing after it is consumed.
/// `None` at end of stream; an overlong line is returned truncated (and then rejected).
/// Fails with `TimedOut` once `deadline` passes.
fn read_line(s: &mut UnixStream, deadline: Instant) -> io::Result<Option<Vec<u8>>> {
    let mut line = Vec::with_capacity(16);
    let mut b = [0u8; 1];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no complete OK line within the handshake deadline",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut b) {
            Ok(0) => return Ok(None),
            Ok(_) if b[0] == b'\n' => return Ok(Some(line)),
            Ok(_) => {
                line.push(b[0]);
                if line.len() >= MAX_HANDSHAKE_LINE {
                    return Ok(Some(line));
                }
            }
            // The kernel timeout (WouldBlock) fired: loop, and the deadline check says TimedOut.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

/// True for exactly `OK <n>` (vhost-device-vsock's reply with the host-side port number):
/// `OK` followed by a space and a decimal u32, nothing else.
fn is_ok_reply(line: &[u8]) -> bool {
    line.strip_prefix(b"OK ").is_some_and(|n| {
        !n.is_empty()
            && n.iter().all(u8::is_ascii_digit)
            && std::str::from_utf8(n).is_ok_and(|t| t.parse::<u32>().is_ok())
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread;

    use super::*;

    #[test]
    fn only_an_exact_ok_line_completes_the_handshake() {
        assert!(is_ok_reply(b"OK 1073741824"));
        assert!(is_ok_reply(b"OK 5"));
        for bad in [
            &b"OK"[..],
            b"OK ",
            b"OKAY 5",
            b"OK 5 6",
            b"OK -5",
            b"OK 99999999999",
            b"ok 5",
            b" OK 5",
        ] {
            assert!(!is_ok_reply(bad), "{}", bad.escape_ascii());
        }
    }

    #[test]
    fn the_handshake_deadline_covers_the_whole_line() {
        // A peer that sends a byte every 20 ms forever: with a timeout per byte this never
        // ended; with one deadline it ends with TimedOut.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let dribbler = thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) && b.write_all(b"O").is_ok() {
                thread::sleep(Duration::from_millis(20));
            }
        });
        let err = read_line(&mut a, Instant::now() + Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        stop.store(true, Ordering::Relaxed);
        drop(a);
        dribbler.join().unwrap();
    }

    /// A stand-in for vhost-device-vsock's host side: answers one `CONNECT` line with `reply`,
    /// then writes `then` on the same stream (an empty `reply` closes the stream instead).
    fn fake_backend(
        reply: &'static [u8],
        then: &'static [u8],
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        thread::JoinHandle<String>,
    ) {
        let (dir, path) = crate::testutil::temp_path("vmtsync-vhost-uds-", "vm.vsock");
        let listener = UnixListener::bind(&path).unwrap();
        let name = path.clone();
        let handle = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // One connection only: later attempts find no socket.
            let _ = std::fs::remove_file(name);
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while line.last() != Some(&b'\n') && s.read(&mut b).unwrap() == 1 {
                line.push(b[0]);
            }
            s.write_all(reply).unwrap();
            s.write_all(then).unwrap();
            // Keep an accepted stream open until the client is done with it; a refused one
            // closes at once, as the backend does when nothing listens in the guest.
            if !reply.is_empty() {
                let _ = s.read(&mut b);
            }
            String::from_utf8_lossy(&line).into_owned()
        });
        (dir, path, handle)
    }

    #[test]
    fn the_handshake_leaves_the_agents_first_bytes_unread() {
        let (_dir, path, backend) = fake_backend(b"OK 1024\n", &[0, 7]);
        let mut s = connect_vhost_uds(&path, 1234, &ConnectOptions::default()).unwrap();
        // The beacon (an empty frame) and the byte right behind the OK line were not
        // swallowed.
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut got = [0u8; 2];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, [0, 7]);
        drop(s);
        assert_eq!(backend.join().unwrap(), "CONNECT 1234\n");
        assert!(!path.exists());
    }

    #[test]
    fn a_refused_connect_is_an_error_not_a_stream() {
        let (_dir, path, backend) = fake_backend(b"", b"");
        let opts = ConnectOptions {
            connect_timeout: Duration::from_millis(300),
            io_timeout: Duration::from_millis(50),
        };
        let err = connect_vhost_uds(&path, 9, &opts).unwrap_err();
        // Closed before OK, then no socket at all: retried until the deadline.
        assert!(matches!(err, ConnectError::Timeout { .. }), "{err}");
        backend.join().unwrap();
    }
}
