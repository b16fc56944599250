//! The link's vocabulary: how long to try ([`ConnectOptions`]), why a connection failed
//! ([`ConnectError`]), and retrying while the other side starts up ([`Retry`]: backoff, one
//! deadline, a stop flag). Every other file of the link imports these from here.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;

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

impl ConnectError {
    /// [`ConnectError::Io`] at `addr`, as the function every step of a connection maps its
    /// non-retryable I/O errors with.
    pub(super) fn io(addr: &str) -> impl Fn(io::Error) -> Self + Copy + '_ {
        move |source| Self::Io {
            addr: addr.to_owned(),
            source,
        }
    }
}

/// The longest single sleep or blocking wait while connecting, so a raised stop flag is
/// seen within about this long.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Backoff between retries: starts at 20 ms, doubles, capped at 200 ms and at the deadline.
#[derive(Debug)]
pub(super) struct Retry {
    deadline: Instant,
    delay: Duration,
    pub(super) last: String,
    /// Raised from a signal handler to give up early ([`ConnectError::Interrupted`]).
    stop: Option<&'static AtomicBool>,
}

impl Retry {
    pub(super) fn new(within: Duration, stop: Option<&'static AtomicBool>) -> Self {
        Self {
            deadline: Instant::now() + within,
            delay: Duration::from_millis(20),
            last: String::from("none"),
            stop,
        }
    }

    pub(super) fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub(super) fn stopped(&self) -> bool {
        self.stop.is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Records a retryable error and sleeps (in [`STOP_POLL`] steps); `false` once the
    /// deadline has passed or the stop flag is raised ([`timeout_err`] tells which).
    pub(super) fn again(&mut self, why: impl ToString) -> bool {
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

/// Errors worth retrying while the other side starts up.
pub(super) fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::TimedOut
            | io::ErrorKind::WouldBlock
    )
}

/// The error for a connect that ran out of time, or was stopped.
pub(super) fn timeout_err(name: &str, retry: &Retry, opts: &ConnectOptions) -> ConnectError {
    if retry.stopped() {
        return ConnectError::Interrupted(name.to_owned());
    }
    ConnectError::Timeout {
        addr: name.to_owned(),
        waited: opts.connect_timeout,
        last: retry.last.clone(),
    }
}
