//! A loopback guest agent for tests and the demo's simulation fallback: `vmtsync_core::agent`'s
//! real state machine over a host socket, reading the host TSC plus a known skew as its "guest
//! TSC". Test code, so it lives here and not in the shipped `vmtsync` crate.
//!
//! Because the skewed clock is the host's own `lfence; rdtsc`, the true offset of such an
//! agent is exactly the skew, which lets tests check that a probe run's bounds contain the
//! truth on real sockets and real timing.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use vmtsync_core::GuestTicks;
use vmtsync_core::agent::{Agent, AgentClock, AgentState, AgentStats, Link, LinkError};
use vmtsync_core::arch::Tsc;
use vmtsync_core::proto::Transport;
use vmtsync_core::recorder::Ring;

use vmtsync::link::transport::{SocketStream, host_tsc_now};

/// A guest clock equal to the host TSC plus `skew` (wrapping): true offset `guest - host`
/// is `skew`, up to the ordering of the two reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkewedClock {
    /// `guest - host`, in ticks.
    pub skew: i64,
    /// The vCPU id reported.
    pub vcpu: u32,
}

impl AgentClock for SkewedClock {
    fn read_tsc(&mut self) -> GuestTicks {
        GuestTicks(host_tsc_now().0.wrapping_add_signed(self.skew))
    }

    fn vcpu_id(&self) -> u32 {
        self.vcpu
    }
}

/// How long one `recv` of the agent's link blocks before reporting "nothing pending".
const POLL_WAIT: Duration = Duration::from_millis(20);

/// The agent's [`Link`] over a blocking socket with a short read timeout.
#[derive(Debug)]
pub struct SocketLink<S> {
    stream: S,
}

impl<S: SocketStream> SocketLink<S> {
    /// Wraps a connected socket.
    ///
    /// # Errors
    /// If the read timeout cannot be set.
    pub fn new(stream: S) -> io::Result<Self> {
        stream.set_read_timeout(Some(POLL_WAIT))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Self { stream })
    }
}

impl<S: SocketStream> Link for SocketLink<S> {
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        self.stream.write_all(frame).map_err(|_| LinkError::Closed)
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        match self.stream.read(buf) {
            Ok(0) => Err(LinkError::Closed),
            Ok(n) => Ok(n),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(0)
            }
            Err(_) => Err(LinkError::Io),
        }
    }

    fn transport(&self) -> Transport {
        Transport::Memory
    }
}

/// Serves one session on `stream` until the host shuts it down or disconnects; returns the
/// agent's counters.
pub fn serve<S: SocketStream>(stream: S, clock: SkewedClock) -> AgentStats {
    let Ok(link) = SocketLink::new(stream) else {
        return AgentStats::default();
    };
    let mut agent: Agent<_, _> = Agent::new(link, clock);
    while let Ok(polled) = agent.poll() {
        if polled.state == AgentState::Exited {
            break;
        }
    }
    agent.stats()
}

/// A workload for the loopback agent: `count` events recorded at `rate` per second by a
/// producer thread of their own (as a unikernel's application code would), each with its
/// sequence number as payload (`u64` LE) and id [`WORKLOAD_EVENT`], stamped with the agent's
/// skewed clock — so the true host time of every event is its guest TSC minus the skew.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    /// Events to record.
    pub count: u64,
    /// Events per second (0: as fast as the ring takes them).
    pub rate: u64,
    /// The first probe replies go out late.
    pub late: Late,
}

/// The agent's first `probes` probe replies each go out `delay` after the clock read they
/// carry, as on a host too loaded to run the agent at once: each such probe's interval is wide
/// and the truth lies at its upper end (`guest - host_recv` is `delay` below it), so a round
/// of them gives a box whose centre is about `delay / 2` from the truth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Late {
    /// How many probe replies, from the first.
    pub probes: u32,
    /// How late each goes out.
    pub delay: Duration,
}

/// A skewed clock whose first probe reads are followed by a wait ([`Late`]).
struct LateClock {
    clock: SkewedClock,
    late: Late,
}

impl AgentClock for LateClock {
    fn read_tsc(&mut self) -> GuestTicks {
        self.clock.read_tsc()
    }

    fn vcpu_id(&self) -> u32 {
        self.clock.vcpu_id()
    }

    fn read_tsc_for_probe(&mut self, _seq: u8) -> GuestTicks {
        let t = self.clock.read_tsc();
        if self.late.probes > 0 {
            self.late.probes -= 1;
            thread::sleep(self.late.delay);
        }
        t
    }
}

/// The id of a workload event (the agent's `workload=` uses the same).
pub const WORKLOAD_EVENT: u16 = 0x100;

/// The loopback agent's event ring, in records.
pub const RING_CAPACITY: usize = 1 << 14;

/// The skewed clock as the recorder's TSC.
struct SkewedTsc(i64);

impl Tsc for SkewedTsc {
    fn read_ordered(&self) -> u64 {
        host_tsc_now().0.wrapping_add_signed(self.0)
    }
}

/// [`serve`] with events: a producer thread records `load` into a ring the agent drains when
/// the host asks. Returns the agent's counters and the events the ring refused (dropped).
pub fn serve_with_events<S: SocketStream>(
    stream: S,
    clock: SkewedClock,
    load: Workload,
) -> (AgentStats, u64) {
    let Ok(link) = SocketLink::new(stream) else {
        return (AgentStats::default(), 0);
    };
    // The ring lives as long as the process, like a unikernel's static.
    let ring: &'static Ring<RING_CAPACITY> = Box::leak(Box::new(Ring::new()));
    let producer = thread::spawn(move || {
        let tsc = SkewedTsc(clock.skew);
        let start = std::time::Instant::now();
        for seq in 0..load.count {
            if let Some(ns) = seq.saturating_mul(1_000_000_000).checked_div(load.rate) {
                let due = Duration::from_nanos(ns);
                while start.elapsed() < due {
                    std::hint::spin_loop();
                }
            }
            let _ = ring.view().record(&tsc, WORKLOAD_EVENT, &seq.to_le_bytes());
        }
    });
    let clock = LateClock {
        clock,
        late: load.late,
    };
    let mut agent = Agent::with_events(link, clock, ring);
    while let Ok(polled) = agent.poll() {
        if polled.state == AgentState::Exited {
            break;
        }
    }
    let _ = producer.join();
    (agent.stats(), ring.view().dropped())
}

/// Starts an agent on a Unix socket pair; returns the host's end and the agent thread.
///
/// # Errors
/// If the pair cannot be created.
pub fn spawn_unix_pair(clock: SkewedClock) -> io::Result<(UnixStream, JoinHandle<AgentStats>)> {
    let (host, guest) = UnixStream::pair()?;
    Ok((host, thread::spawn(move || serve(guest, clock))))
}

/// Starts an agent listening on a loopback TCP port for one connection; returns its port and
/// the agent thread.
///
/// # Errors
/// If the port cannot be bound.
pub fn spawn_tcp(clock: SkewedClock) -> io::Result<(u16, JoinHandle<AgentStats>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let handle = thread::spawn(move || match listener.accept() {
        Ok((s, _)) => {
            let _ = TcpStream::set_nodelay(&s, true);
            serve(s, clock)
        }
        Err(_) => AgentStats::default(),
    });
    Ok((port, handle))
}
