//! `transport=vsock`: the probe protocol over a virtio-vsock stream to host CID 2.
//!
//! Runs where `serve` runs (ring 3 with IOPL 3 by default): it sets up the heap, finds and
//! initialises the virtio socket device on PCI ([`vmtsync_agent::vsock`]), connects to the
//! host port from `port=` (or, with `vsock=listen`, accepts the host's connection to that
//! port), sends the ready beacon (a lone `0x00`, an empty frame every receiver
//! skips) and serves [`Server`] on the stream until the host says `Shutdown`, then exits through
//! isa-debug-exit with the `exit=` code. A setup failure is logged on COM2 and exits with
//! [`vsock::SETUP_FAILED_EXIT_CODE`].

use core::fmt::Write as _;

use linked_list_allocator::LockedHeap;
use virtio_drivers::transport::pci::PciTransport;
use vmtsync_agent::heap::{self, IdentityHal};
use vmtsync_agent::link::Link;
use vmtsync_agent::options::{Options, Wire};
use vmtsync_agent::pci::{DEFAULT_MMIO_WINDOW, PortCam};
use vmtsync_agent::port;
use vmtsync_agent::server::{Outcome, Server};
use vmtsync_agent::vsock::{self, VsockError, VsockLink};
use vmtsync_agent::vsock_stream::OneStream;
use vmtsync_core::arch::Tsc;
use vmtsync_core::arch::x86_64::NativeTsc;
use vmtsync_core::proto::Features;

/// The allocator virtio-drivers' socket driver uses, over [`heap::take_region`].
#[global_allocator]
static HEAP: LockedHeap = LockedHeap::empty();

/// TSC rate assumed for deadlines when CPUID does not report one.
const FALLBACK_TSC_KHZ: u64 = 3_000_000;
/// Connection attempts before giving up (the host may not be listening yet).
const CONNECT_ATTEMPTS: u32 = 20;
/// How long `vsock=listen` waits for the host, in milliseconds.
const LISTEN_MS: u64 = 60_000;

/// Sets up the vsock transport and serves the protocol on it; never returns.
pub fn serve(opts: &Options, tsc: NativeTsc, features: Features, tsc_khz: Option<u32>) -> ! {
    if opts.wire == Wire::Line {
        log!("vsock: wire=line is for COM1 only; the vsock stream speaks postcard");
    }
    let khz = tsc_khz.map_or(FALLBACK_TSC_KHZ, u64::from);
    let ms = |n: u64| n.saturating_mul(khz);
    let start = tsc.read_ordered();
    let Some(region) = heap::take_region() else {
        fail("heap setup", "region already taken")
    };
    HEAP.lock().init_from_slice(region);

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
    log!("vsock: virtio socket device at {df}");

    let mut stream = OneStream::<IdentityHal, _>::new(transport, opts.vsock_port)
        .unwrap_or_else(|e| fail("socket device init", e.describe()));
    if opts.vsock_listen {
        log!("vsock: listening on port {}", opts.vsock_port);
        stream
            .accept(opts.vsock_port, &tsc, ms(LISTEN_MS))
            .unwrap_or_else(|e| fail("accept", e.describe()));
    } else {
        connect(&mut stream, tsc, ms);
    }
    log!(
        "vsock: guest cid {} port {} connected with host cid {}:{} after {} cycles, heap {} \
         bytes used",
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

    let mut link = VsockLink::new(stream, tsc, ms(1_000));
    // Ready beacon: an empty frame, skipped by every frame receiver.
    link.send_now(&[0]);
    let mut server = Server::new(link, tsc, opts.skew, features, tsc_khz);
    log!("ready: postcard on vsock port {}", opts.vsock_port);
    loop {
        if server.poll() == Outcome::Shutdown {
            let s = server.stats();
            let l = server.link_mut().stats();
            log!(
                "shutdown after {} probes, {} bad frames ({} credit waits, {} dropped sends, {} \
                 link errors): isa-debug-exit {}",
                s.probes,
                s.bad_frames,
                l.credit_waits,
                l.dropped_sends,
                l.errors,
                opts.exit_code
            );
            port::exit(opts.exit_code);
        }
    }
}

/// Logs a setup failure and exits; out of line so its formatting code exists once.
#[inline(never)]
fn fail(what: &str, why: &str) -> ! {
    log!(
        "vsock: {what} failed: {why}; isa-debug-exit {}",
        vsock::SETUP_FAILED_EXIT_CODE
    );
    port::exit(vsock::SETUP_FAILED_EXIT_CODE)
}

/// Connects to the host, retrying while nothing listens there yet.
fn connect(
    stream: &mut OneStream<IdentityHal, PciTransport>,
    tsc: NativeTsc,
    ms: impl Fn(u64) -> u64,
) {
    let mut attempt = 1;
    loop {
        match stream.connect(&tsc, ms(2_000)) {
            Ok(()) => return,
            Err(e @ (VsockError::Refused | VsockError::Timeout)) if attempt < CONNECT_ATTEMPTS => {
                log!(
                    "vsock: connect attempt {attempt}: {}; retrying",
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
