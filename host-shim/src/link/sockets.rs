//! Unix-socket connect and accept, and TCP connect, each retried until the connect deadline.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::thread;
use std::time::Duration;

use super::options::{ConnectError, ConnectOptions, Retry, retryable, timeout_err};

pub(super) fn connect_unix(
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
            Err(source) => return Err(ConnectError::io(name)(source)),
        }
    }
}

pub(super) fn accept_unix(
    path: &Path,
    name: &str,
    retry: &Retry,
    opts: &ConnectOptions,
) -> Result<UnixStream, ConnectError> {
    if path.exists() {
        return Err(ConnectError::PathInUse(name.to_owned()));
    }
    let io_err = ConnectError::io(name);
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

pub(super) fn connect_tcp(
    host: &str,
    port: u16,
    name: &str,
    retry: &mut Retry,
    opts: &ConnectOptions,
) -> Result<TcpStream, ConnectError> {
    let io_err = ConnectError::io(name);
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
