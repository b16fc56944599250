//! # vmtsync-agent
//!
//! A bare-metal x86_64 guest that answers vmtsync probes. It boots through PVH (a Xen ELF note
//! naming a 32-bit entry), so QEMU `-kernel` and the built-in VMM in `vmtsync-tests` load the
//! same ELF unchanged. COM1 (0x3f8) carries the probe protocol, COM2 (0x2f8) defmt log frames
//! (see `logger.rs`; the host decodes them against this ELF); isa-debug-exit (0xf4) ends the VM.
//! A panic is logged through defmt too (`PANIC: <message and location>`, level error), after
//! ending any frame the panic interrupted, then exits with code 0x7e.
//!
//! Boot options (PVH command line): see [`vmtsync_agent::options`].
//!
//! ## `wire=postcard` (default)
//!
//! The vmtsync probe protocol (`vmtsync_core::proto`), served by the core state machine
//! `vmtsync_core::agent::Agent` over [`vmtsync_agent::link::UartLink`] and
//! [`vmtsync_agent::clock::GuestClock`]. When COM1 is ready the agent sends one `0x00` byte (an
//! empty frame, which receivers skip): a host may wait for it instead of retrying its hello.
//! After `Shutdown` → `Exiting` the agent writes its `exit=` code to isa-debug-exit.
//!
//! Guest events go through the core's recorder: the boot vCPU's `vmtsync_core::recorder::Ring`
//! ([`EVENTS`]) and one ring per application processor ([`AP_EVENTS`]), each stamped with the
//! same skewed TSC its vCPU's probes report, drained together ([`agent_events`]). With
//! `events=N`, after each handled message (its reply sent) the agent records one event whose
//! payload is the number of messages handled so far, until N events are recorded, and each AP
//! records one (`AP_PROBE_EVENT`, the probe's seq) per probe it answers, up to N; `workload=RATE,COUNT[,PORT]` emits
//! events at a steady rate between polls ([`vmtsync_agent::events`]). The
//! host drains them with `EventsRequest`; once it pushed a mapping (`SetMapping`), they come
//! back stamped in the host clock. Event `k` lies between the exit carrying the first byte of
//! reply `k` and the guest's read of request `k + 1`.
//!
//! ## `transport=vsock port=N`
//!
//! The same protocol over a virtio-vsock stream instead of COM1 (`serve_vsock.rs`): the agent
//! finds the virtio socket device on PCI, places its BARs, connects to host CID 2 port N (or
//! accepts the host's connection with `vsock=listen`), sends the ready beacon on the stream and
//! reports `VirtioVsock` in its `Capabilities`.
//!
//! ## `wire=line` (debugging by hand)
//!
//! One request byte, one text line back:
//!
//! - at boot the agent sends `H vmtsync-agent\n`;
//! - `p` → `T<16 lowercase hex digits of the (skewed) TSC>\n`. The TSC is read right after THR
//!   is known empty, and `T` is written the next instruction, so the VM exit carrying `T` is
//!   the host's upper bound on the read;
//! - `q` → `Q\n`, then isa-debug-exit with the `exit=` code;
//! - `!` → a deliberate panic (tests the panic path: log on COM2, exit code 0x7e);
//! - `w` → `W\n`, then a spin loop with no VM exits (tests the host's watchdog);
//! - any other byte is echoed back.
#![no_std]
#![no_main]

mod boot;
mod logger;
mod smp;

use core::cell::UnsafeCell;
use vmtsync_agent::clock::GuestClock;
use vmtsync_agent::events::{
    AgentEvents, BootRing, FramePerPoll, MessageEvents, NativePortIo, Workload,
};
use vmtsync_agent::link::UartLink;
use vmtsync_agent::options::{MAX_VCPUS, Options, TxOrder, Wire};
use vmtsync_agent::tsc::SkewedTsc;
use vmtsync_agent::uart::{COM1, COM2};
use vmtsync_agent::{port, pvh};
use vmtsync_core::agent::{Agent, AgentState};
use vmtsync_core::arch::Cpuid as _;
use vmtsync_core::recorder::Recorder;

use vmtsync_core::arch::cpuid::{has_invariant_tsc, kvm_info, tsc_freq};
use vmtsync_core::arch::x86_64::{NativeCpuid, NativeTsc, register_pvclock};
use vmtsync_core::arch::{PvclockPage, Tsc};
use vmtsync_core::proto::Features;
use vmtsync_core::pvclock::PvclockVcpuTimeInfo;

/// Logs one line at info level on COM2: `defmt::info!` (defmt format syntax: `{}`/`{=u32}`
/// with positional arguments, `defmt::Debug2Format` for `core::fmt`-only types).
macro_rules! log {
    ($($arg:tt)*) => { defmt::info!($($arg)*) };
}

// After `log!`, which it uses.
mod serve_vsock;

/// Capacity of the agent's event ring, in records (32 bytes each: 128 KiB of .bss per mode;
/// `flight=` picks the stop-when-full ring or the flight recorder at boot).
const EVENT_RING: usize = 4096;

/// The boot vCPU's event ring: the protocol loop is its consumer, the loop's event sources
/// (`events=`, `workload=`) its producer, all on the boot vCPU.
static EVENTS: BootRing<EVENT_RING> = BootRing::new();

/// Capacity of each application processor's event ring, in records (8 KiB each of .bss:
/// an AP records one event per probe it answers, and .bss is zeroed in emulated ring 0).
const AP_EVENT_RING: usize = 256;

/// The application processors' event rings, by APIC id: AP N alone produces into ring N
/// (`smp.rs`), the protocol loop drains them with the boot vCPU's ([`agent_events`]).
static AP_EVENTS: Recorder<MAX_VCPUS, AP_EVENT_RING> = Recorder::new();

/// Every event ring, as the agent drains them.
fn agent_events() -> AgentEvents<'static, EVENT_RING, MAX_VCPUS, AP_EVENT_RING> {
    AgentEvents {
        bsp: EVENTS.ring(),
        aps: &AP_EVENTS,
    }
}

/// The workload from the options, timed on the agent's TSC (`None` without `workload=`).
fn workload(ctx: &Ctx, tsc: &SkewedTsc<NativeTsc>) -> Option<Workload> {
    let w = ctx.opts.workload?;
    let khz = ctx.tsc_khz.unwrap_or_else(|| {
        defmt::warn!("workload: TSC frequency unknown; timing it as 1 GHz");
        1_000_000
    });
    log!(
        "workload: {=u64} events/s, {=u64} events (0: unlimited), port {}",
        w.rate,
        w.count,
        w.port
    );
    Workload::new(w.rate, w.count, w.port, khz, tsc.read_ordered())
}

/// The pvclock page KVM writes once registered: 32 bytes, aligned so it never crosses a page.
#[repr(C, align(64))]
struct PvclockCell(UnsafeCell<PvclockVcpuTimeInfo>);

// SAFETY: the agent is single-CPU; the only writer is the hypervisor, and every read goes
// through `PvclockPage`'s volatile loads and seqlock.
unsafe impl Sync for PvclockCell {}

/// Zero-initialised, so it lives in .bss (32 bytes zeroed at boot) and reads version 0 until
/// KVM publishes it.
static PVCLOCK: PvclockCell = PvclockCell(UnsafeCell::new(PvclockVcpuTimeInfo {
    version: 0,
    pad0: 0,
    tsc_timestamp: 0,
    system_time: 0,
    tsc_to_system_mul: 0,
    tsc_shift: 0,
    flags: 0,
    pad: [0; 2],
}));

/// Registers [`PVCLOCK`] with KVM when CPUID offers `KVM_FEATURE_CLOCKSOURCE2`. Ring 0 only.
fn register_pvclock_page(cpuid: &NativeCpuid) -> Option<PvclockPage<'static>> {
    let kvm = kvm_info(cpuid)?;
    if !kvm.features.clocksource2() {
        defmt::warn!("pvclock: KVM without CLOCKSOURCE2; not registering");
        return None;
    }
    let ptr = PVCLOCK.0.get().cast_const();
    // The first 4 GiB are identity-mapped, so the static's address is its physical address.
    let phys = ptr as u64;
    // SAFETY: we run at CPL 0 (kmain, before any ring switch) under KVM with CLOCKSOURCE2, and
    // `phys` is 32 bytes of RAM reserved for the page for the rest of the run.
    if unsafe { register_pvclock(phys) }.is_err() {
        return None;
    }
    log!(
        "pvclock: page at {=u64:#x}, stable bit {}",
        phys,
        kvm.features.stable_bit()
    );
    // SAFETY: PVCLOCK is a static (valid forever), aligned, and only the hypervisor writes it.
    unsafe { PvclockPage::new(ptr) }
}

/// Rust entry, called by `boot.rs` in long mode with the physical address of the PVH start info.
#[unsafe(no_mangle)]
pub extern "C" fn kmain(start_info_phys: u64) -> ! {
    COM2.init();
    COM1.init();
    log!(
        "vmtsync-agent {=str}: long mode, start_info at {=u64:#x}",
        env!("CARGO_PKG_VERSION"),
        start_info_phys
    );

    // SAFETY: boot.rs passes the loader's ebx unchanged and identity-maps the first 4 GiB.
    let Some(si) = (unsafe { pvh::read(start_info_phys) }) else {
        defmt::error!("bad hvm_start_info magic; exiting");
        port::exit(port::PANIC_EXIT_CODE);
    };
    // SAFETY: `si` came from `pvh::read`.
    let cmdline = unsafe { pvh::cmdline(&si) };
    log!(
        "start_info v{} cmdline \"{=str}\"",
        si.version,
        core::str::from_utf8(cmdline).unwrap_or("<not utf-8>")
    );
    let opts = Options::parse(cmdline, |word, err| {
        defmt::warn!(
            "ignoring option \"{=str}\": {}",
            core::str::from_utf8(word).unwrap_or("<not utf-8>"),
            defmt::Debug2Format(&err)
        );
    });
    log!(
        "options: transport={} wire={} ring={} exit={} events={} workload={} skew={}+(tsc*{})>>{} \
         uarttx wait-then-write {}",
        defmt::Debug2Format(&opts.transport),
        defmt::Debug2Format(&opts.wire),
        opts.ring,
        opts.exit_code,
        opts.events,
        opts.workload.is_some(),
        opts.skew.offset,
        opts.skew.ratio,
        opts.skew.frac_bits,
        opts.uart_tx == TxOrder::WaitThenWrite
    );

    EVENTS.choose(opts.flight);

    let cpuid = NativeCpuid;
    let mut features = Features::NONE;
    if has_invariant_tsc(&cpuid) {
        features = features.union(Features::INVARIANT_TSC);
    }
    let tsc_khz = tsc_freq(&cpuid).and_then(|f| u32::try_from(f.hz / 1000).ok());
    // Never RDTSCP here: it kills the VM on the project's nested KVM (see docs/host-quirks.md).
    let tsc = NativeTsc::lfence_rdtsc();
    log!(
        "cpu: invariant tsc {}, tsc_khz {}, tsc at ready {}",
        features.contains(Features::INVARIANT_TSC),
        tsc_khz,
        tsc.read_ordered()
    );

    let pvclock = register_pvclock_page(&cpuid);
    // The initial APIC id (CPUID.1:EBX[31:24]) is the id KVM names `vcpuN` after.
    let vcpu = cpuid.cpuid(1, 0).ebx >> 24;
    let vcpus = smp::start(&opts, vcpu, tsc_khz);
    log!("vcpus online: {=u64:#x}", vcpus.online());
    let ctx = Ctx {
        opts,
        tsc,
        pvclock,
        vcpu,
        vcpus,
        invariant_tsc: features.contains(Features::INVARIANT_TSC),
        tsc_khz,
    };
    if opts.ring == 3 {
        log!("entering ring 3 with IOPL 3");
        // SAFETY: we are in ring 0 on boot.rs's GDT and page tables; `ctx` lives in this frame,
        // which never returns (enter_ring3 diverges), so the pointer stays valid.
        unsafe { boot::enter_ring3(serve, core::ptr::from_ref(&ctx) as usize) }
    }
    serve(core::ptr::from_ref(&ctx) as usize)
}

/// What the protocol loop needs from boot.
struct Ctx {
    opts: Options,
    tsc: NativeTsc,
    pvclock: Option<PvclockPage<'static>>,
    vcpu: u32,
    /// The application processors that checked in (docs/smp.md).
    vcpus: smp::Vcpus,
    invariant_tsc: bool,
    tsc_khz: Option<u32>,
}

/// The protocol loop, in ring 3 or ring 0. `ctx` is the address of a [`Ctx`] that lives forever.
extern "C" fn serve(ctx: usize) -> ! {
    // SAFETY: kmain passes the address of its `Ctx`, in a frame that is never unwound.
    let ctx = unsafe { &*(ctx as *const Ctx) };
    log!("serving at CPL {}", port::cpl());
    if ctx.opts.transport == vmtsync_agent::options::Transport::Vsock {
        serve_vsock::serve(ctx);
    }
    match ctx.opts.wire {
        Wire::Postcard => serve_postcard(ctx),
        Wire::Line => serve_line(&ctx.opts, ctx.tsc),
    }
}

/// The agent's clock over every vCPU that checked in (docs/smp.md), and the BSP's skewed TSC
/// its events are stamped with: the same for every transport.
fn agent_clock(
    ctx: &Ctx,
) -> (
    smp::SmpClock<GuestClock<NativeTsc, PvclockPage<'static>>>,
    SkewedTsc<NativeTsc>,
) {
    let opts = &ctx.opts;
    let skew = opts.skew_of(ctx.vcpu);
    let clock = smp::SmpClock {
        bsp: GuestClock::new(
            ctx.tsc,
            ctx.pvclock,
            skew,
            ctx.vcpu,
            ctx.tsc_khz,
            ctx.invariant_tsc,
        )
        .with_sync_port(opts.sync_port),
        vcpus: ctx.vcpus,
    };
    (clock, SkewedTsc { tsc: ctx.tsc, skew })
}

fn serve_postcard(ctx: &Ctx) -> ! {
    let opts = &ctx.opts;
    let (clock, tsc) = agent_clock(ctx);
    // One frame per poll, so `events=N` records one event per message (see `events`).
    let mut agent = Agent::with_events(
        FramePerPoll::new(UartLink::new(COM1, opts.uart_tx)),
        clock,
        agent_events(),
    );
    log!("ready: postcard on COM1, vcpu {}", ctx.vcpu);
    // Ready beacon: an empty frame, skipped by every frame receiver.
    COM1.write(0);
    let mut events = MessageEvents::new(opts.events);
    let mut load = workload(ctx, &tsc);
    loop {
        let polled = agent.poll().map(|p| p.state);
        events.after_poll(&agent, EVENTS.ring(), &tsc);
        if let Some(w) = &mut load {
            w.tick(EVENTS.ring(), &tsc, &NativePortIo);
        }
        agent.link_mut().rearm();
        match polled {
            Ok(AgentState::Exited) => {
                let s = agent.stats();
                log!(
                    "shutdown after {} probes, {} messages, {} bad frames, {} events \
                     ({=u64} workload, {=u64} sent, {=u64} dropped): isa-debug-exit {}",
                    s.probes,
                    s.messages_in,
                    s.bad_frames,
                    events.recorded(),
                    load.map_or(0, |w| w.emitted()),
                    s.events_out,
                    EVENTS.ring().dropped(),
                    opts.exit_code
                );
                port::exit(opts.exit_code);
            }
            Ok(AgentState::AwaitHello | AgentState::Ready) => {}
            // The UART link never fails; log anything else and keep serving.
            Err(e) => defmt::warn!("agent: {}", e),
        }
    }
}

fn serve_line(opts: &Options, tsc: NativeTsc) -> ! {
    COM1.write_all(b"H vmtsync-agent\n");
    log!("ready: line protocol on COM1");
    loop {
        match COM1.read() {
            b'p' => {
                COM1.wait_thr_empty();
                let raw = tsc.read_ordered();
                COM1.write_unchecked(b'T');
                let t = opts.skew.apply(raw);
                let mut hex = [0u8; 16];
                for (i, d) in hex.iter_mut().enumerate() {
                    let nibble = (t >> (60 - 4 * i)) & 0xf;
                    *d = b"0123456789abcdef"[usize::try_from(nibble).unwrap_or(0)];
                }
                COM1.write_all(&hex);
                COM1.write(b'\n');
            }
            b'q' => {
                COM1.write_all(b"Q\n");
                log!("quit: isa-debug-exit {}", opts.exit_code);
                port::exit(opts.exit_code);
            }
            b'!' => panic!("host asked for a panic"),
            b'w' => {
                COM1.write_all(b"W\n");
                log!("spinning without exits until the host's watchdog ends the VM");
                loop {
                    core::hint::spin_loop();
                }
            }
            other => COM1.write(other),
        }
    }
}

/// Logs the panic through defmt (message and location, formatted on the target: panics are
/// rare and the text must survive whatever state the agent was in), then exits with 0x7e.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    logger::recover();
    defmt::error!("PANIC: {}", defmt::Display2Format(info));
    port::exit(port::PANIC_EXIT_CODE)
}
