//! Retrying a connection while the other side starts up: backoff, one deadline, a stop flag.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::connect::{ConnectError, ConnectOptions};

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
