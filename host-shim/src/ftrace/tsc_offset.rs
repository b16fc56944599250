//! Subscribing to the `kvm:kvm_write_tsc_offset` tracepoint so watch mode misses no offset
//! change between two polls.
//!
//! The event is enabled in a private tracefs instance ([`Instance`], purpose `watch`) whose
//! clock is `x86-tsc`, so the global tracing state other tools use is untouched and every
//! event carries a host TSC timestamp; its text `trace_pipe` is read. The instance is removed
//! on drop.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};

use super::instance::{Instance, TraceError, nothing_to_read_now};

/// The most `trace_pipe` bytes one [`Subscription::wait`] reads (about 800 event lines): a
/// guest that writes its TSC in a loop makes the kernel produce events faster than we can
/// print them, and the reader must still get back to polling debugfs and to the stop flag.
/// Whatever is left stays in the pipe for the next wait (or is overwritten by the kernel).
pub const MAX_READ_PER_WAIT: usize = 64 * 1024;

/// The tracepoint KVM fires on every TSC offset write (arch/x86/kvm/trace.h).
pub const EVENT: &str = "kvm/kvm_write_tsc_offset";

/// One `kvm_write_tsc_offset` event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TscOffsetWrite {
    /// TID of the thread that wrote the offset.
    pub thread: u32,
    /// The event's timestamp: host TSC when the instance clock is `x86-tsc`.
    pub timestamp: u64,
    /// The vCPU id.
    pub vcpu: u32,
    /// The offset before (as the kernel's u64, reinterpreted as the signed offset).
    pub previous: i64,
    /// The offset after.
    pub next: i64,
}

/// Parses one `trace_pipe` line of the event, e.g.
/// `  qemu-1234  [001] d..1.  987654321: kvm_write_tsc_offset: vcpu=0 prev=0 next=5`.
/// Returns `None` for any other line.
#[must_use]
pub fn parse_line(line: &str) -> Option<TscOffsetWrite> {
    let (head, tail) = line.split_once(": kvm_write_tsc_offset: ")?;
    let mut fields = tail.split_ascii_whitespace();
    let mut field = |key: &str| fields.next()?.strip_prefix(key)?.parse::<u64>().ok();
    let vcpu = u32::try_from(field("vcpu=")?).ok()?;
    // The kernel stores offsets as u64; the debugfs file prints them signed. Same bits.
    let previous = i64::from_ne_bytes(field("prev=")?.to_ne_bytes());
    let next = i64::from_ne_bytes(field("next=")?.to_ne_bytes());
    let mut words = head.split_ascii_whitespace();
    let task = words.next()?;
    let thread = task.rsplit_once('-')?.1.parse().ok()?;
    let timestamp = words.next_back()?.parse().ok()?;
    Some(TscOffsetWrite {
        thread,
        timestamp,
        vcpu,
        previous,
        next,
    })
}

/// A live subscription: a private tracefs instance with the event enabled.
#[derive(Debug)]
pub struct Subscription {
    /// Declared before `instance`: closed first, so the instance directory can be removed.
    pipe: File,
    buf: Vec<u8>,
    instance: Instance,
}

impl Subscription {
    /// Creates the instance under `tracefs` and enables the event.
    ///
    /// # Errors
    /// Any tracefs write failure (the instance is removed again).
    pub fn start(tracefs: &Path) -> Result<Self, TraceError> {
        let mut instance = Instance::create(tracefs, "watch")?;
        instance.enable(EVENT)?;
        let pipe = instance.open_nonblocking("trace_pipe")?;
        Ok(Self {
            pipe,
            buf: Vec::with_capacity(8192),
            instance,
        })
    }

    /// True if the instance clock could be set to `x86-tsc` (timestamps are host TSC).
    #[must_use]
    pub const fn tsc_clock(&self) -> bool {
        self.instance.tsc_clock()
    }

    /// Waits up to `timeout` for events and returns those that arrived (possibly none).
    ///
    /// # Errors
    /// Read errors on `trace_pipe`.
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<TscOffsetWrite>, TraceError> {
        let mut fds = [PollFd::new(&self.pipe, PollFlags::IN)];
        // A timeout too long for a timespec waits without one, as good as forever here.
        let timeout = Timespec::try_from(timeout).ok();
        if let Err(errno) = rustix::event::poll(&mut fds, timeout.as_ref()) {
            let e = io::Error::from(errno);
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(Vec::new());
            }
            return Err(TraceError::Io {
                action: "poll",
                path: self.instance.path().join("trace_pipe"),
                source: e,
            });
        }
        read_bounded(&mut self.pipe, &mut self.buf, MAX_READ_PER_WAIT).map_err(|source| {
            TraceError::Io {
                action: "read",
                path: self.instance.path().join("trace_pipe"),
                source,
            }
        })?;
        Ok(take_events(&mut self.buf))
    }
}

/// Appends what `r` has ready (until it would block or ends) to `buf`, at most `cap` bytes;
/// returns how many were read.
fn read_bounded(r: &mut impl Read, buf: &mut Vec<u8>, cap: usize) -> io::Result<usize> {
    let mut chunk = [0u8; 4096];
    let mut total = 0;
    while total < cap {
        let want = chunk.len().min(cap - total);
        match r.read(&mut chunk[..want]) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                total += n;
            }
            Err(e) if nothing_to_read_now(&e) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// Parses and removes the complete lines of `buf`, keeping a partial last line (unless it
/// has grown past [`MAX_READ_PER_WAIT`] without a newline: then it is no event line and is
/// dropped, so the buffer stays bounded).
fn take_events(buf: &mut Vec<u8>) -> Vec<TscOffsetWrite> {
    let complete = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let out = buf[..complete]
        .split(|&b| b == b'\n')
        .filter_map(|line| std::str::from_utf8(line).ok().and_then(parse_line))
        .collect();
    buf.drain(..complete);
    if buf.len() > MAX_READ_PER_WAIT {
        buf.clear();
    }
    out
}

/// Offset writes of one vCPU thread merged over an interval: the first write's `previous`,
/// the last write's `next` and timestamp, and how many writes there were.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoalescedWrites {
    /// The merged write (`previous` of the first, `next` and `timestamp` of the last).
    pub write: TscOffsetWrite,
    /// How many writes were merged (at least 1).
    pub writes: u64,
}

/// Merges `events` per (thread, vCPU), in order of each pair's first event, so a guest
/// writing its TSC in a loop yields one line per vCPU per interval instead of a flood.
#[must_use]
pub fn coalesce(events: &[TscOffsetWrite]) -> Vec<CoalescedWrites> {
    let mut out = Vec::new();
    coalesce_into(&mut out, events);
    out
}

/// [`coalesce`] into an accumulator that already holds merged writes (so a whole interval of
/// waits takes memory per vCPU, not per event).
pub fn coalesce_into(out: &mut Vec<CoalescedWrites>, events: &[TscOffsetWrite]) {
    for ev in events {
        match out
            .iter_mut()
            .find(|c| c.write.thread == ev.thread && c.write.vcpu == ev.vcpu)
        {
            Some(c) => {
                c.write.next = ev.next;
                c.write.timestamp = ev.timestamp;
                c.writes += 1;
            }
            None => out.push(CoalescedWrites {
                write: ev.clone(),
                writes: 1,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_event_lines() {
        let l = "           idle-vmm-4242    [001] d..1.  123456789012: kvm_write_tsc_offset: vcpu=3 prev=0 next=18446744073709551611";
        assert_eq!(
            parse_line(l),
            Some(TscOffsetWrite {
                thread: 4242,
                timestamp: 123_456_789_012,
                vcpu: 3,
                previous: 0,
                next: -5,
            })
        );
        assert_eq!(parse_line("foo-1 [000] ... 5: kvm_pio: x"), None);
        assert_eq!(
            parse_line("x-1 [0] 5: kvm_write_tsc_offset: vcpu=a prev=0 next=0"),
            None
        );
        assert_eq!(parse_line(""), None);
    }

    fn ev(thread: u32, vcpu: u32, ts: u64, previous: i64, next: i64) -> TscOffsetWrite {
        TscOffsetWrite {
            thread,
            timestamp: ts,
            vcpu,
            previous,
            next,
        }
    }

    #[test]
    fn coalescing_keeps_one_write_per_vcpu_thread() {
        let evs = [
            ev(10, 0, 1, 0, 5),
            ev(11, 1, 2, 0, 7),
            ev(10, 0, 3, 5, 6),
            ev(10, 0, 4, 6, 9),
        ];
        assert_eq!(
            coalesce(&evs),
            [
                CoalescedWrites {
                    write: ev(10, 0, 4, 0, 9),
                    writes: 3
                },
                CoalescedWrites {
                    write: ev(11, 1, 2, 0, 7),
                    writes: 1
                },
            ]
        );
        // A flood of 100 000 writes from one vCPU is one line.
        let flood: Vec<_> = (0..100_000)
            .map(|i| ev(10, 0, i, i.cast_signed(), i.cast_signed() + 1))
            .collect();
        assert_eq!(
            coalesce(&flood),
            [CoalescedWrites {
                write: ev(10, 0, 99_999, 0, 100_000),
                writes: 100_000
            }]
        );
    }

    #[test]
    fn reads_are_capped_and_the_buffer_stays_bounded() {
        let line = b"  q-7 [000] d..1. 55: kvm_write_tsc_offset: vcpu=0 prev=0 next=1\n";
        // A pipe that never runs dry (a flooding guest): one wait reads at most the cap.
        let mut endless = std::io::repeat(b'x').take(u64::MAX);
        let mut buf = Vec::new();
        assert_eq!(
            read_bounded(&mut endless, &mut buf, MAX_READ_PER_WAIT).unwrap(),
            MAX_READ_PER_WAIT
        );
        assert_eq!(buf.len(), MAX_READ_PER_WAIT);
        // Bytes without a newline: kept up to the cap, then dropped.
        assert!(take_events(&mut buf).is_empty());
        assert_eq!(buf.len(), MAX_READ_PER_WAIT);
        buf.push(b'x');
        assert!(take_events(&mut buf).is_empty());
        assert!(buf.is_empty());
        // Complete lines are parsed; a partial one waits for its end.
        let mut lines = line.repeat(3);
        lines.extend_from_slice(&line[..10]);
        let mut r = &lines[..];
        read_bounded(&mut r, &mut buf, MAX_READ_PER_WAIT).unwrap();
        assert_eq!(take_events(&mut buf).len(), 3);
        assert_eq!(buf, &line[..10]);
    }
}
