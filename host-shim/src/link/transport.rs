//! The byte transport the probe engine runs over, and where its host timestamps come from.
//!
//! A probe sample is only as good as its two host stamps: `host_send` must not be later than
//! the moment the guest could first have seen the request, and `host_recv` must not be earlier
//! than the moment the reply's last byte existed on the host. [`StampedTransport`] makes each
//! transport responsible for its own stamps:
//!
//! - sockets ([`StreamTransport`]) read `lfence; rdtsc` immediately before the `write(2)` of
//!   the request and immediately after the `read(2)` that returned the reply's bytes;
//! - an in-process VMM stamps the VM exits at which the guest consumed the request and
//!   produced the reply, and tightens the pair to them in [`StampedTransport::refine`] (the
//!   test VMM's COM1, `vmtsync_tests::vmm::client::Com1Transport`, does; docs/probe.md lists
//!   every implementation).
//!
//! Every wait is bounded: `recv` takes a deadline and fails with [`TransportError::Timeout`]
//! once it passes.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use thiserror::Error;
use vmtsync_core::HostTicks;

/// Reads the host TSC with `lfence; rdtsc` (ordered after every earlier instruction, so a
/// stamp taken after a `read(2)` is not executed before it).
#[cfg(target_arch = "x86_64")]
#[inline]
#[must_use]
pub fn host_tsc_now() -> HostTicks {
    HostTicks(vmtsync_core::arch::x86_64::lfence_rdtsc())
}

/// Not an x86 host: there is no TSC to stamp with, so this is nanoseconds of a process-local
/// monotonic clock. Samples stay sound (both sides of the bracket use the same clock) but are
/// not on any trace clock.
#[cfg(not(target_arch = "x86_64"))]
#[must_use]
pub fn host_tsc_now() -> HostTicks {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let ns = START.get_or_init(Instant::now).elapsed().as_nanos();
    HostTicks(u64::try_from(ns).unwrap_or(u64::MAX))
}

/// Why a transport operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The deadline passed with no (or an incomplete) answer.
    #[error(
        "timed out after {0:?} waiting for the guest agent: is it running and attached to this socket? (raise --timeout-ms for slow guests)"
    )]
    Timeout(Duration),
    /// The peer closed the connection.
    #[error("the guest agent closed the connection")]
    Closed,
    /// Any other I/O error.
    #[error("transport I/O error: {0}")]
    Io(#[from] io::Error),
}

/// Bytes received and when the host had them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// How many bytes were written to the buffer (at least 1).
    pub len: usize,
    /// A host TSC reading taken after the last of these bytes arrived.
    pub stamp: HostTicks,
}

/// The host stamps bracketing one probe: request sent, reply received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameStamps {
    /// Not later than the guest could have seen the request.
    pub send: HostTicks,
    /// Not earlier than the reply existed on the host.
    pub recv: HostTicks,
}

/// A byte stream to the guest agent that stamps what it moves with the host TSC.
pub trait StampedTransport {
    /// Sends one whole frame; returns a host TSC reading taken no later than the first moment
    /// the guest could read it (for sockets: just before the write).
    ///
    /// # Errors
    /// [`TransportError`] if the frame could not be sent whole.
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError>;

    /// Waits until at least one byte arrives or `deadline` passes; copies the bytes to `buf`.
    ///
    /// # Errors
    /// [`TransportError::Timeout`] once `deadline` passes, [`TransportError::Closed`] at end
    /// of stream, [`TransportError::Io`] otherwise.
    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError>;

    /// Called with the stamps of each completed exchange (the reply's last byte was the last
    /// byte this transport returned); a transport that observed the guest consume the request
    /// later than `send` returned (a VMM seeing the VM exit of the read), or produce the reply
    /// earlier than `recv` said, returns the tighter pair. It must stay a bracket of the
    /// guest's TSC read. The default keeps the stamps.
    ///
    /// `None` says the transport vouches for its own stamps and could not establish them for
    /// this exchange (an exit-anchored transport that did not find the exchange's exits,
    /// [`super::anchor`]): the session then drops the probe and counts it
    /// ([`super::SessionStats::unanchored`]) rather than mix in a guessed bracket; for a hello
    /// or another request it keeps `stamps`, which still bracket the reply.
    fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
        Some(stamps)
    }

    /// Where this transport's stamps come from, for reports and sync files.
    fn anchor(&self) -> crate::syncfile::AnchorKind {
        crate::syncfile::AnchorKind::InProcess
    }

    /// The host TSC now, on the clock `send` and `recv` stamp with (a simulation's own clock;
    /// the real host TSC by default). The session uses it to decide whether a compact probe
    /// can still be unwrapped.
    fn now(&mut self) -> HostTicks {
        host_tsc_now()
    }
}

/// [`StampedTransport`] for each pointer type given (over `T`): every method forwards to the
/// transport pointed to, its own overrides included.
macro_rules! forward_stamped_transport {
    ($($ptr:ty),*) => {$(
        impl<T: StampedTransport + ?Sized> StampedTransport for $ptr {
            fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
                (**self).send(frame)
            }

            fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
                (**self).recv(buf, deadline)
            }

            fn refine(&mut self, stamps: FrameStamps) -> Option<FrameStamps> {
                (**self).refine(stamps)
            }

            fn now(&mut self) -> HostTicks {
                (**self).now()
            }

            fn anchor(&self) -> crate::syncfile::AnchorKind {
                (**self).anchor()
            }
        }
    )*};
}

forward_stamped_transport!(Box<T>, &mut T);

/// A connected stream socket with kernel-side read timeouts.
pub trait SocketStream: Read + Write {
    /// Sets `SO_RCVTIMEO` (`None`: block forever, which [`StreamTransport`] never asks for).
    ///
    /// # Errors
    /// The `setsockopt(2)` error.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;

    /// Sets `SO_SNDTIMEO`, so a peer that stops reading cannot block a write forever.
    ///
    /// # Errors
    /// The `setsockopt(2)` error.
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl SocketStream for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl SocketStream for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, t)
    }
}

/// A [`StampedTransport`] over a socket: stamps right around the system calls.
///
/// The read timeout is kept at `min(per_read, time left to the deadline)` and only re-set
/// when that changes, so the common probe costs one `write(2)` and one `read(2)` between its
/// stamps and no `setsockopt(2)`.
#[derive(Debug)]
pub struct StreamTransport<S> {
    stream: S,
    /// The longest any single read may block.
    per_read: Duration,
    /// The `SO_RCVTIMEO` currently set.
    current: Duration,
}

impl<S: SocketStream> StreamTransport<S> {
    /// Wraps a connected socket; no read or write blocks longer than `per_read` (which must be
    /// non-zero; zero is taken as 1 ms).
    ///
    /// # Errors
    /// If the timeouts cannot be set.
    pub fn new(stream: S, per_read: Duration) -> io::Result<Self> {
        let per_read = per_read.max(Duration::from_millis(1));
        stream.set_read_timeout(Some(per_read))?;
        stream.set_write_timeout(Some(per_read))?;
        Ok(Self {
            stream,
            per_read,
            current: per_read,
        })
    }

    /// The socket (e.g. to shut it down).
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    fn set_timeout(&mut self, t: Duration) -> io::Result<()> {
        if t != self.current {
            self.stream.set_read_timeout(Some(t))?;
            self.current = t;
        }
        Ok(())
    }
}

impl<S: SocketStream> StampedTransport for StreamTransport<S> {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        // Restore the full per-read timeout if the last wait shortened it (outside the stamps).
        self.set_timeout(self.per_read)?;
        let stamp = host_tsc_now();
        match self.stream.write_all(frame) {
            Ok(()) => Ok(stamp),
            Err(e) if is_timeout(&e) => Err(TransportError::Timeout(self.per_read)),
            Err(e) if is_closed(&e) => Err(TransportError::Closed),
            Err(e) => Err(e.into()),
        }
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<Received, TransportError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout(self.per_read));
            }
            if left < self.current {
                self.set_timeout(left)?;
            }
            match self.stream.read(buf) {
                Ok(0) => return Err(TransportError::Closed),
                Ok(len) => {
                    let stamp = host_tsc_now();
                    return Ok(Received { len, stamp });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The kernel timeout fired: loop to check the deadline.
                Err(e) if is_timeout(&e) => {}
                Err(e) if is_closed(&e) => return Err(TransportError::Closed),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// `SO_RCVTIMEO`/`SO_SNDTIMEO` expiry shows up as `EAGAIN` (WouldBlock) on Linux.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_bracket_the_round_trip() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut t = StreamTransport::new(a, Duration::from_secs(5)).unwrap();
        let send = t.send(b"ping\0").unwrap();
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping\0");
        let mid = host_tsc_now();
        b.write_all(b"pong\0").unwrap();
        let mut buf = [0u8; 16];
        let r = t
            .recv(&mut buf, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(&buf[..r.len], b"pong\0");
        assert!(send <= mid && mid <= r.stamp, "{send:?} {mid:?} {r:?}");
    }

    #[test]
    fn silent_peer_is_a_timeout_and_closed_peer_is_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut t = StreamTransport::new(a, Duration::from_millis(20)).unwrap();
        let mut buf = [0u8; 4];
        // The deadline is shorter than the per-read timeout: the wait is cut to it.
        let err = t
            .recv(&mut buf, Instant::now() + Duration::from_millis(5))
            .unwrap_err();
        assert!(matches!(err, TransportError::Timeout(_)), "{err}");
        // A deadline already past fails without reading.
        let err = t.recv(&mut buf, Instant::now()).unwrap_err();
        assert!(matches!(err, TransportError::Timeout(_)), "{err}");
        drop(b);
        let err = t
            .recv(&mut buf, Instant::now() + Duration::from_secs(5))
            .unwrap_err();
        assert!(matches!(err, TransportError::Closed), "{err}");
        assert!(err.to_string().contains("closed"));
    }

    #[test]
    fn host_tsc_is_monotonic_on_one_thread() {
        let a = host_tsc_now();
        let b = host_tsc_now();
        assert!(b >= a);
    }
}
