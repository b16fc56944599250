//! Opening a [`ProbeAddr`]: sockets, the vhost-device-vsock `CONNECT` handshake, AF_VSOCK.
//!
//! Every wait here has a deadline. A guest whose vsock queues are not up yet makes
//! vhost-device-vsock drop (or, about one connect in twenty in early experiments, hang) a
//! host connection, so connects and handshakes are retried with a short backoff until the
//! connect deadline passes (see docs/vsock.md).

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;

use super::addr::{ProbeAddr, vsock_sockaddr};
use super::transport::{SocketStream, StampedTransport, StreamTransport};

/// How long to keep trying, and how long any single read may block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Total time allowed to establish the connection (all retries included).
    pub connect_timeout: Duration,
    /// The longest any single read or write may block once connected.
    pub io_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(2),
        }
    }
}

/// Why a connection could not be established.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The deadline passed; `last` is the last error seen while retrying.
    #[error(
        "{addr}: no connection within {waited:?} (last error: {last}); is the VM running and the agent started?"
    )]
    Timeout {
        /// The address.
        addr: String,
        /// How long we tried.
        waited: Duration,
        /// The last retryable error.
        last: String,
    },
    /// A non-retryable error.
    #[error("{addr}: {source}")]
    Io {
        /// The address.
        addr: String,
        /// The error.
        source: io::Error,
    },
    /// vhost-device-vsock answered the `CONNECT` line with something other than `OK`.
    #[error(
        "{addr}: vhost-device-vsock answered \"{reply}\" instead of \"OK <port>\": is this its --uds-path?"
    )]
    Handshake {
        /// The address.
        addr: String,
        /// The reply line, escaped.
        reply: String,
    },
    /// The socket path for `unix-listen:` is already taken.
    #[error("{0}: the path exists; remove the stale socket file or choose another path")]
    PathInUse(String),
    /// AF_VSOCK is only available on Linux.
    #[error("vsock: AF_VSOCK is only supported on Linux")]
    Unsupported,
    /// The stop flag was raised (SIGINT/SIGTERM in the CLI) while connecting.
    #[error("{0}: interrupted while connecting")]
    Interrupted(String),
}

/// The longest single sleep or blocking wait while connecting, so a raised stop flag is
/// seen within about this long.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Backoff between retries: starts at 20 ms, doubles, capped at 200 ms and at the deadline.
#[derive(Debug)]
struct Retry {
    deadline: Instant,
    delay: Duration,
    last: String,
    /// Raised from a signal handler to give up early ([`ConnectError::Interrupted`]).
    stop: Option<&'static AtomicBool>,
}

impl Retry {
    fn new(within: Duration, stop: Option<&'static AtomicBool>) -> Self {
        Self {
            deadline: Instant::now() + within,
            delay: Duration::from_millis(20),
            last: String::from("none"),
            stop,
        }
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    fn stopped(&self) -> bool {
        self.stop.is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Records a retryable error and sleeps (in [`STOP_POLL`] steps); `false` once the
    /// deadline has passed or the stop flag is raised ([`timeout_err`] tells which).
    fn again(&mut self, why: impl ToString) -> bool {
        self.last = why.to_string();
        let until = Instant::now() + self.delay.min(self.left());
        loop {
            if self.stopped() {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                break;
            }
            thread::sleep((until - now).min(STOP_POLL));
        }
        if self.left().is_zero() {
            return false;
        }
        self.delay = (self.delay * 2).min(Duration::from_millis(200));
        true
    }
}

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
    let io_err = |source| ConnectError::Io {
        addr: name.clone(),
        source,
    };
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
                let left = retry.left().max(Duration::from_millis(1));
                match VsockStream::connect(*cid, *port, left) {
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

/// Errors worth retrying while the other side starts up.
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::TimedOut
            | io::ErrorKind::WouldBlock
    )
}

fn timeout_err(name: &str, retry: &Retry, opts: &ConnectOptions) -> ConnectError {
    if retry.stopped() {
        return ConnectError::Interrupted(name.to_owned());
    }
    ConnectError::Timeout {
        addr: name.to_owned(),
        waited: opts.connect_timeout,
        last: retry.last.clone(),
    }
}

fn connect_unix(
    path: &Path,
    name: &str,
    retry: &mut Retry,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if retryable(&e) => {
                if !retry.again(&e) {
                    return Err(timeout_err(name, retry, opts));
                }
            }
            Err(source) => {
                return Err(ConnectError::Io {
                    addr: name.to_owned(),
                    source,
                });
            }
        }
    }
}

fn accept_unix(
    path: &Path,
    name: &str,
    retry: &Retry,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    if path.exists() {
        return Err(ConnectError::PathInUse(name.to_owned()));
    }
    let io_err = |source| ConnectError::Io {
        addr: name.to_owned(),
        source,
    };
    let listener = UnixListener::bind(path).map_err(io_err)?;
    // The socket file is ours: remove it whatever happens next.
    let _cleanup = RemoveOnDrop(path);
    listener.set_nonblocking(true).map_err(io_err)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(io_err)?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if retry.stopped() {
                    return Err(ConnectError::Interrupted(name.to_owned()));
                }
                let left = retry.left();
                if left.is_zero() {
                    return Err(ConnectError::Timeout {
                        addr: name.to_owned(),
                        waited: opts.connect_timeout,
                        last: "no guest connected".to_owned(),
                    });
                }
                thread::sleep(left.min(Duration::from_millis(10)));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(io_err(source)),
        }
    }
}

/// Removes a path when dropped (best effort: the file may already be gone).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
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
fn vsock_uds_handshake(
    path: &Path,
    port: u32,
    name: &str,
    retry: &mut Retry,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    let io_err = |source| ConnectError::Io {
        addr: name.to_owned(),
        source,
    };
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
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
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

fn connect_tcp(
    host: &str,
    port: u16,
    name: &str,
    retry: &mut Retry,
    opts: &ConnectOptions,
) -> Result<TcpStream, ConnectError> {
    let io_err = |source| ConnectError::Io {
        addr: name.to_owned(),
        source,
    };
    let addrs: Vec<_> = (host, port).to_socket_addrs().map_err(io_err)?.collect();
    loop {
        for a in &addrs {
            let left = retry.left().max(Duration::from_millis(1));
            match TcpStream::connect_timeout(a, left) {
                Ok(s) => {
                    // Probes are tiny: never let Nagle hold one back.
                    s.set_nodelay(true).map_err(io_err)?;
                    return Ok(s);
                }
                Err(e) if retryable(&e) => retry.last = e.to_string(),
                Err(source) => return Err(io_err(source)),
            }
        }
        if !retry.again(retry.last.clone()) {
            return Err(timeout_err(name, retry, opts));
        }
    }
}

/// `SO_VM_SOCKETS_CONNECT_TIMEOUT` at level `AF_VSOCK`: include/uapi/linux/vm_sockets.h
/// defines it as `SO_VM_SOCKETS_CONNECT_TIMEOUT_OLD` (6, a `struct timeval`) on 64-bit ABIs.
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;

/// A connected AF_VSOCK stream socket (std has none). Used only on real hosts with
/// `/dev/vhost-vsock`; tests never create one (see docs/host-quirks.md).
#[derive(Debug)]
pub struct VsockStream(OwnedFd);

impl VsockStream {
    /// Connects to `cid:port`, with the kernel's vsock connect timeout set to `timeout`.
    ///
    /// # Errors
    /// The failing system call's error.
    pub fn connect(cid: u32, port: u32, timeout: Duration) -> io::Result<Self> {
        // SAFETY: socket(2) takes no pointers; a negative result is checked below.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by nothing else.
        let sock = Self(unsafe { OwnedFd::from_raw_fd(fd) });
        set_timeval(
            sock.0.as_raw_fd(),
            libc::AF_VSOCK,
            SO_VM_SOCKETS_CONNECT_TIMEOUT,
            Some(timeout),
        )?;
        let sa = vsock_sockaddr(cid, port);
        // sockaddr_vm is 16 bytes; the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        loop {
            // SAFETY: `sa` is a valid sockaddr_vm that outlives the call and `len` is its size.
            let rc = unsafe {
                libc::connect(
                    sock.0.as_raw_fd(),
                    std::ptr::from_ref(&sa).cast::<libc::sockaddr>(),
                    len,
                )
            };
            if rc == 0 {
                return Ok(sock);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Sets a `struct timeval` socket option (`None` = no timeout).
fn set_timeval(
    fd: libc::c_int,
    level: libc::c_int,
    name: libc::c_int,
    t: Option<Duration>,
) -> io::Result<()> {
    let mut tv = timeval_of(t.unwrap_or_default());
    // A zero timeval means "no timeout": round a sub-microsecond wait up, like std does.
    if t.is_some() && tv.tv_sec == 0 && tv.tv_usec == 0 {
        tv.tv_usec = 1;
    }
    // timeval is 16 bytes; the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    let len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: `tv` is a valid timeval that outlives the call and `len` is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            std::ptr::from_ref(&tv).cast::<libc::c_void>(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `t` as a `struct timeval`, truncated to microseconds (saturating at `time_t::MAX` s).
fn timeval_of(t: Duration) -> libc::timeval {
    libc::timeval {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(t.subsec_micros().min(999_999).cast_signed()),
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::write(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl SocketStream for VsockStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeval(self.0.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeval(self.0.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDTIMEO, t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `name` in a fresh temp dir, removed (with its contents) when the guard drops.
    fn tmp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("vmtsync-connect-")
            .tempdir()
            .unwrap();
        let p = dir.path().join(name);
        (dir, p)
    }

    #[test]
    fn timeouts_convert_to_timeval_without_opening_a_vsock() {
        let tv = timeval_of(Duration::new(3, 250_999_000));
        assert_eq!((tv.tv_sec, tv.tv_usec), (3, 250_999));
        let tv = timeval_of(Duration::from_nanos(500));
        assert_eq!((tv.tv_sec, tv.tv_usec), (0, 0));
        // set_timeval rounds that up to 1 µs so it never means "forever"; checked on a Unix
        // socket, since AF_VSOCK must not be opened here.
        let (a, _b) = UnixStream::pair().unwrap();
        set_timeval(
            a.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            Some(Duration::from_nanos(500)),
        )
        .unwrap();
        // The kernel rounds up to a jiffy; what matters is that it is a timeout, not None.
        let got = a.read_timeout().unwrap();
        assert!(matches!(got, Some(d) if !d.is_zero()), "{got:?}");
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
