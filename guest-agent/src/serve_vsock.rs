//! `transport=vsock`: the probe protocol over a virtio-vsock stream with the host (CID 2).
//!
//! Runs where `serve` runs (ring 3 with IOPL 3 by default): it sets up the heap, finds and
//! initialises the virtio socket device on PCI ([`vmtsync_agent::vsock`]), connects to the
//! host port from `port=` (or, with `vsock=listen`, accepts the host's connection to that
//! port), sends the ready beacon (a lone `0x00`, an empty frame every receiver skips) and runs
//! the core [`Agent`] on the stream until the host says `Shutdown`, then exits through
//! isa-debug-exit with the `exit=` code. If the host closes the stream first, the agent
//! connects (or listens) again for a new session. A setup failure is logged on COM2 and exits
//! with [`vsock::SETUP_FAILED_EXIT_CODE`].

use linked_list_allocator::LockedHeap;
use vmtsync_agent::events::MessageEvents;
use vmtsync_agent::heap::{self, IdentityHal};
use vmtsync_agent::options::Wire;
use vmtsync_agent::pci::{DEFAULT_MMIO_WINDOW, PortCam};
use vmtsync_agent::port;
use vmtsync_agent::vsock::{self, VsockError, VsockLink, VsockTransport};
use vmtsync_agent::vsock_stream::OneStream;
use vmtsync_core::agent::{Agent, AgentClock as _, AgentError, AgentState, Link as _, LinkError};
use vmtsync_core::arch::Tsc;
use vmtsync_core::arch::x86_64::NativeTsc;

use crate::Ctx;

/// The allocator virtio-drivers' socket driver uses, over [`heap::take_region`].
#[global_allocator]
static HEAP: LockedHeap = LockedHeap::empty();

/// TSC rate assumed for deadlines when CPUID does not report one.
const FALLBACK_TSC_KHZ: u64 = 3_000_000;
/// Connection attempts before giving up (the host may not be listening yet).
const CONNECT_ATTEMPTS: u32 = 20;
/// The pause after DRIVER_OK before the first queue notification, in milliseconds: the vhost
/// backend may not own the queues yet (see [`VsockTransport`]).
const SETTLE_MS: u64 = 20;
/// How long `vsock=listen` waits for the host, in milliseconds.
const LISTEN_MS: u64 = 60_000;

type Stream = OneStream<IdentityHal, VsockTransport>;

/// Sets up the vsock transport and serves the protocol on it; never returns.
pub fn serve(ctx: &Ctx) -> ! {
    let opts = &ctx.opts;
    let tsc = ctx.tsc();
    if opts.wire == Wire::Line {
        log!("vsock: wire=line is for COM1 only; the vsock stream speaks postcard");
    }
    let khz = ctx.clock.tsc_khz().map_or(FALLBACK_TSC_KHZ, u64::from);
    let ms = |n: u64| n.saturating_mul(khz);
    let start = tsc.read_ordered();

    let Some(region) = heap::take_region() else {
        fail("heap setup", "region already taken")
    };
    HEAP.lock().init_from_slice(region);

    let transport = find_device(ctx);
    let mut stream: Stream = OneStream::new(transport, opts.vsock_port)
        .unwrap_or_else(|e| fail("socket device init", e.describe()));

    let mut session = 0u32;
    loop {
        session += 1;
        establish(ctx, &mut stream, ms);
        log!(
            "vsock: session {}: guest cid {} port {} connected with host cid {}:{} \
             after {} cycles, heap {} bytes used",
            session,
            stream.guest_cid(),
            if opts.vsock_listen {
                opts.vsock_port
            } else {
                vsock::LOCAL_PORT
            },
            vsock::HOST_CID,
            stream.peer_port(),
            tsc.read_ordered().wrapping_sub(start),
            HEAP.lock().used()
        );
        stream = run_session(ctx, VsockLink::new(stream, tsc, ms(1_000)));
        log!("vsock: the host closed the stream; waiting for a new session");
    }
}

/// The virtio socket device: on virtio-mmio when the command line names windows (QEMU
/// `microvm`), else on PCI (q35), whose BARs are placed here.
fn find_device(ctx: &Ctx) -> VsockTransport {
    if ctx.opts.virtio_mmio.iter().any(Option::is_some) {
        match vsock::open_mmio(&ctx.opts.virtio_mmio) {
            Ok(t) => {
                log!("vsock: virtio socket device on virtio-mmio");
                return VsockTransport::mmio(t, settle_cycles(ctx));
            }
            Err(e) => log!("vsock: virtio-mmio: {}; trying PCI", e.describe()),
        }
    }
    let mut window = DEFAULT_MMIO_WINDOW;
    let (transport, df) = vsock::open_pci::<IdentityHal, _>(PortCam, &mut window, |b| {
        log!(
            "vsock: BAR{} at {:#x}, {} bytes",
            b.index,
            b.address,
            b.size
        );
    })
    .unwrap_or_else(|e| fail("PCI device setup", e.describe()));
    log!(
        "vsock: virtio socket device at {}",
        defmt::Display2Format(&df)
    );
    VsockTransport::pci(transport, settle_cycles(ctx))
}

/// The pause after DRIVER_OK (see [`VsockTransport`]), in TSC cycles.
fn settle_cycles(ctx: &Ctx) -> u64 {
    ctx.clock
        .tsc_khz()
        .map_or(FALLBACK_TSC_KHZ, u64::from)
        .saturating_mul(SETTLE_MS)
}

/// Serves one session; exits the VM on `Shutdown`, returns the stream when the host closes it.
fn run_session(ctx: &Ctx, mut link: VsockLink<Stream, NativeTsc>) -> Stream {
    let opts = &ctx.opts;
    // Ready beacon: an empty frame, skipped by every frame receiver.
    if let Err(e) = link.send(&[0]).and_then(|()| link.flush()) {
        log!("vsock: ready beacon not sent: {}", defmt::Debug2Format(&e));
    }
    let (clock, tsc) = crate::agent_clock(ctx);
    let mut agent = Agent::with_events(link, clock, crate::agent_events());
    // `events=N`: one event per poll that handled messages (a poll may handle several here:
    // the stream delivers whole packets).
    let mut events = MessageEvents::new(opts.events);
    let mut load = crate::workload(ctx, &tsc);
    log!(
        "ready: postcard on vsock port {}, vcpu {}",
        opts.vsock_port,
        ctx.vcpu()
    );
    let ports = crate::native_ports();
    loop {
        let polled = agent.poll().map(|p| p.state);
        events.after_poll(&agent, crate::EVENTS.ring(), &tsc);
        if let Some(w) = &mut load {
            w.tick(crate::EVENTS.ring().view(), &tsc, &ports);
        }
        match polled {
            Ok(AgentState::Exited) => {
                let s = agent.stats();
                let l = agent.link().stats();
                log!(
                    "shutdown after {} probes, {} messages, {} bad frames, {} events ({} \
                     packets, {} credit waits, {} refused sends, {} link errors; {=u64} \
                     workload, {=u64} sent, {=u64} dropped): isa-debug-exit {}",
                    s.probes,
                    s.messages_in,
                    s.bad_frames,
                    events.recorded(),
                    l.packets,
                    l.credit_waits,
                    l.refused_sends,
                    l.errors,
                    load.map_or(0, |w| w.emitted()),
                    s.events_out,
                    crate::EVENTS.ring().view().dropped(),
                    opts.exit_code
                );
                port::exit(opts.exit_code);
            }
            Ok(AgentState::AwaitHello | AgentState::Ready) => {}
            Err(AgentError::Link(LinkError::Closed)) => return agent.into_parts().0.into_stream(),
            Err(e) => log!("agent: {}", defmt::Debug2Format(&e)),
        }
    }
}

/// Connects to the host (retrying while nothing listens there yet) or, with `vsock=listen`,
/// accepts the host's connection; exits the VM when neither happens in time.
fn establish(ctx: &Ctx, stream: &mut Stream, ms: impl Fn(u64) -> u64) {
    let opts = &ctx.opts;
    let tsc = ctx.tsc();
    if opts.vsock_listen {
        log!("vsock: listening on port {}", opts.vsock_port);
        if let Err(e) = stream.accept(opts.vsock_port, &tsc, ms(LISTEN_MS)) {
            fail("accept", e.describe());
        }
        return;
    }
    let mut attempt = 1;
    loop {
        match stream.connect(&tsc, ms(2_000)) {
            Ok(()) => return,
            Err(e @ (VsockError::Refused | VsockError::Timeout)) if attempt < CONNECT_ATTEMPTS => {
                log!(
                    "vsock: connect attempt {}: {}; retrying",
                    attempt,
                    e.describe()
                );
                attempt += 1;
                let t0 = tsc.read_ordered();
                while tsc.read_ordered().wrapping_sub(t0) < ms(250) {
                    core::hint::spin_loop();
                }
            }
            Err(e) => fail("connect", e.describe()),
        }
    }
}

/// Logs a setup failure and exits; out of line so its formatting code exists once.
#[inline(never)]
fn fail(what: &str, why: &str) -> ! {
    log!(
        "vsock: {} failed: {}; isa-debug-exit {}",
        what,
        why,
        vsock::SETUP_FAILED_EXIT_CODE
    );
    port::exit(vsock::SETUP_FAILED_EXIT_CODE)
}
