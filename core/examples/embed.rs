//! How a unikernel that is not ours embeds vmtsync: a static event recorder, the agent state
//! machine on the unikernel's own byte link, and the host's side of a drain.
//!
//! Runs on the host (`cargo run -p vmtsync-core --example embed`): the "guest" and the "host"
//! are two halves of this process joined by an in-memory link, and the clock is the machine's
//! real TSC. In a unikernel, the three pieces marked GUEST are all there is:
//!
//! 1. a [`Link`]: send one frame whole (or refuse it), receive whatever bytes arrived, never
//!    block on the host. On a 16550 UART it is ready-made:
//!    `vmtsync_core::arch::uart16550::Uart16550::COM1` (call `init()` once), which also takes
//!    console text between frames through `core::fmt::Write`. Here, an in-memory mailbox;
//! 2. an [`AgentClock`]: ready-made as [`NativeClock::detect`] (the ordered TSC, the APIC id,
//!    the TSC frequency and invariance from CPUID);
//! 3. a `static` [`Recorder`] that the application's code records into, and a loop that calls
//!    [`Agent::poll`] whenever the unikernel has a moment (idle loop, timer tick); the
//!    [`PollAt`] it returns says whether to call again at once or when input arrives.
//!
//! The host (`vmtsync probe` / `vmtsync record`) then syncs the clocks with probes over the same
//! link and drains the events; here a few lines of `vmtsync_core::proto` play that part.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use vmtsync_core::agent::{Agent, AgentClock, Link, LinkError, PollAt};
use vmtsync_core::arch::Tsc;
use vmtsync_core::arch::x86_64::{NativeClock, NativeCpuid, NativeTsc};
use vmtsync_core::proto::{
    Feed, FrameReceiver, Hello, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION, Transport, encode_frame,
};
use vmtsync_core::recorder::Recorder;

// ---------------------------------------------------------------------------------- GUEST --

/// One ring per vCPU, 1024 records each, in static storage: no heap, usable from any code.
static RECORDER: Recorder<1, 1024> = Recorder::new();

/// Application event ids (any `u16`; the host carries them through to the trace).
const REQUEST_START: u16 = 1;
const REQUEST_DONE: u16 = 2;

/// The unikernel's byte link. A real one would poke a UART or a virtio queue; this one is two
/// in-memory queues the host half of the example reads and writes.
struct MailboxLink {
    to_host: Rc<RefCell<VecDeque<u8>>>,
    to_guest: Rc<RefCell<VecDeque<u8>>>,
}

impl Link for MailboxLink {
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        // A whole frame or nothing: a real link refuses with WouldBlock when its queue is full.
        self.to_host.borrow_mut().extend(frame);
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut q = self.to_guest.borrow_mut();
        let n = buf.len().min(q.len());
        for (dst, src) in buf.iter_mut().zip(q.drain(..n)) {
            *dst = src;
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        Transport::Memory
    }
}

/// What the unikernel's application does: record events around its work.
fn handle_request(tsc: &NativeTsc, n: u32) {
    // `record` never blocks, allocates or panics; a full ring counts the event as dropped.
    let Some(ring) = RECORDER.ring(0) else {
        return;
    };
    let _ = ring.record(tsc, REQUEST_START, &n.to_le_bytes());
    let work: u64 = (0..1000u64).map(|i| i * u64::from(n)).sum();
    let _ = ring.record(tsc, REQUEST_DONE, &work.to_le_bytes());
}

// ----------------------------------------------------------------------------------- HOST --

/// Sends one message to the guest and returns every message the guest answered, after
/// letting the guest's loop run once.
fn ask(
    to_guest: &RefCell<VecDeque<u8>>,
    to_host: &RefCell<VecDeque<u8>>,
    rx: &mut FrameReceiver,
    msg: &Message,
    run_guest: &mut dyn FnMut(),
) -> Vec<Message> {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(msg, &mut buf).expect("every message fits MAX_FRAME_SIZE");
    to_guest.borrow_mut().extend(frame.iter());
    run_guest();
    let bytes: Vec<u8> = to_host.borrow_mut().drain(..).collect();
    let mut input = &bytes[..];
    let mut out = Vec::new();
    while !input.is_empty() {
        match rx.feed(input) {
            Feed::Consumed => break,
            Feed::Message { msg, rest } => {
                out.push(msg);
                input = rest;
            }
            Feed::Error { error, rest } => {
                eprintln!("host: a bad frame ({error:?}) skipped");
                input = rest;
            }
        }
    }
    out
}

fn main() {
    let tsc = NativeTsc::detect(&NativeCpuid);
    let to_host = Rc::new(RefCell::new(VecDeque::new()));
    let to_guest = Rc::new(RefCell::new(VecDeque::new()));

    // GUEST: the agent drains vCPU 0's ring into the protocol when the host asks.
    let link = MailboxLink {
        to_host: Rc::clone(&to_host),
        to_guest: Rc::clone(&to_guest),
    };
    // The recorder's ring index is the vCPU the clock reports (the APIC id), here folded onto
    // the one ring this example has: the host process may run on any CPU.
    let clock = NativeClock::detect().with_vcpu(0);
    println!(
        "guest: vCPU {}, TSC {:?} kHz, invariant {}",
        clock.vcpu_id(),
        clock.tsc_khz(),
        clock.invariant_tsc()
    );
    let ring = RECORDER.ring(0).expect("vCPU 0 has a ring");
    let mut agent = Agent::with_events(link, clock, ring);
    for n in 0..10 {
        handle_request(&tsc, n);
    }
    let mut run_guest = || {
        // The unikernel's idle loop: poll answers everything that arrived, then says when it
        // needs to run again (at once while input was left waiting).
        while agent.poll().expect("the mailbox never fails").next == PollAt::Now {}
    };

    // HOST: hello, one probe, then drain the events.
    let mut rx = FrameReceiver::new();
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        features: vmtsync_core::proto::Features::EVENTS,
    });
    let caps = ask(&to_guest, &to_host, &mut rx, &hello, &mut run_guest);
    println!("host: agent said {caps:?}");
    let send = tsc.read_ordered();
    let reply = ask(
        &to_guest,
        &to_host,
        &mut rx,
        &Message::ProbeFull { seq: 1 },
        &mut run_guest,
    );
    let recv = tsc.read_ordered();
    if let [Message::ProbeReplyFull(r)] = reply.as_slice() {
        // Same machine, same TSC: the guest's reading lies between the host's two.
        println!(
            "host: probe bracket [{send}, {recv}] holds the guest's reading {}: {}",
            r.tsc,
            send <= r.tsc && r.tsc <= recv
        );
    }
    let batches = ask(
        &to_guest,
        &to_host,
        &mut rx,
        &Message::EventsRequest { max: 1000 },
        &mut run_guest,
    );
    let mut events = 0;
    for m in &batches {
        let Message::Events(b) = m else { continue };
        for r in b.timestamped() {
            let Some((t, r)) = r else {
                eprintln!("host: a timestamp out of range");
                continue;
            };
            events += 1;
            println!(
                "host: vCPU {} event {} at TSC {t}, payload {:02x?}",
                b.vcpu,
                r.id,
                r.payload.as_slice()
            );
        }
        println!(
            "host: batch: {} dropped so far, {} still queued",
            b.dropped, b.remaining
        );
    }
    assert_eq!(events, 20, "ten requests, two events each");
}
