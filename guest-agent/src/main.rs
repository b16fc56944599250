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
//! `vmtsync_core::agent::Agent` over core's ready-made pieces: COM1 as a
//! `vmtsync_core::arch::uart16550::Uart16550` link (`uarttx=` picks its `TxOrder`) and
//! `vmtsync_core::arch::x86_64::NativeClock` (with the pvclock page and `syncport=`) through
//! [`vmtsync_agent::clock::GuestClock`]'s skew. When COM1 is ready the agent sends one `0x00`
//! byte (an empty frame, which receivers skip): a host may wait for it instead of retrying its
//! hello. After `Shutdown` → `Exiting` the agent writes its `exit=` code to isa-debug-exit.
//! With `console=N` it also writes console text on COM1 between frames (boot lines, then one
//! line per N messages), which the shared-UART wire rule keeps apart from the frames.
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
use core::fmt::Write as _;
use vmtsync_agent::clock::GuestClock;
use vmtsync_agent::console::ConsoleLines;
use vmtsync_agent::events::{AgentEvents, BootRing, FramePerPoll, MessageEvents, Workload};
use vmtsync_agent::options::{MAX_VCPUS, Options, TxOrder, Wire};
use vmtsync_agent::tsc::SkewedTsc;
use vmtsync_agent::{port, pvh};
use vmtsync_core::agent::{Agent, AgentClock as _, AgentState};
use vmtsync_core::recorder::{ClockKind, HeaderInfo, MemRecorder, Mode, Recorder, Slot};

use vmtsync_core::arch::cpuid::kvm_info;
use vmtsync_core::arch::uart16550::{Delimit, Uart16550};
use vmtsync_core::arch::x86_64::{
    NativeClock, NativeCpuid, NativeTsc, boot_nonce, register_pvclock,
};
use vmtsync_core::arch::{NativePorts, PvclockPage, Tsc};
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

/// Records per ring of the recorder a host reads from guest memory (`transport=none`):
/// 16 Ki records, 512 KiB of .bss.
const MEM_RING: usize = 16 * 1024;

/// Rings of that recorder: one, the boot vCPU's (ring 0; under QEMU the boot vCPU is
/// `vcpu0`). The application processors record nothing with `transport=none`.
const MEM_VCPUS: usize = 1;

/// The slots of that recorder's storage, header included.
const MEM_SLOTS: usize = match MemRecorder::storage_slots(MEM_VCPUS, MEM_RING) {
    Some(n) => n,
    None => panic!("the in-memory recorder's shape is invalid"),
};

/// Storage for the recorder a host reads from guest memory, 64-byte aligned as the layout
/// requires. It is all zero in the image (.bss), so no copy of the image holds a header; the
/// agent lays it out and publishes it at run time ([`serve_memory`]), in the mode `flight=`
/// picks.
#[repr(C, align(64))]
struct MemStorage([Slot; MEM_SLOTS]);

static MEM_STORAGE: MemStorage = MemStorage([const { Slot::new() }; MEM_SLOTS]);

/// Every event ring, as the agent drains them.
fn agent_events() -> AgentEvents<'static, EVENT_RING, MAX_VCPUS, AP_EVENT_RING> {
    AgentEvents {
        bsp: EVENTS.ring(),
        aps: &AP_EVENTS,
    }
}

/// Byte-wide port I/O for the ports the host chose on the command line (`syncport=`, the
/// `workload=` port) and fw_cfg's data port (`smp.rs`).
pub(crate) const fn native_ports() -> NativePorts {
    // SAFETY: used only on those ports: a sync or workload port the host picked among the
    // ports its VMM leaves unused (the options' docs), and fw_cfg's data port, whose reads
    // touch no guest memory. No other code relies on their state.
    unsafe { NativePorts::new() }
}

/// COM1 as `uarttx=` says to write it.
/// COM1 as the agent drives it. Every byte of text the agent writes there goes through this
/// `Uart16550` (`console`), so text ends itself with a `0x00` and frames need no leading
/// one: no exit between a probe's TSC read and its reply's first byte (core's
/// `arch::uart16550` docs).
const fn com1(opts: &Options) -> Uart16550 {
    Uart16550::COM1
        .with_tx_order(opts.uart_tx)
        .with_delimit(Delimit::Text)
}

/// With `console=N`, writes console text on COM1 (between frames: the callers run between
/// polls or before the first). Out of line so the formatting code exists once.
#[inline(never)]
fn console(opts: &Options, args: core::fmt::Arguments<'_>) {
    if opts.console > 0 {
        let mut line = Line {
            uart: com1(opts),
            buf: [0; 256],
            len: 0,
        };
        let _ = line.write_fmt(args);
        line.flush();
    }
}

/// A console line formatted whole before it goes out: one run of text and one delimiter per
/// line (`Delimit::Text` ends every `write_str`), not one per formatted piece. A line longer
/// than the buffer goes out in several runs, which the host joins byte for byte.
struct Line {
    uart: Uart16550,
    buf: [u8; 256],
    len: usize,
}

impl Line {
    fn flush(&mut self) {
        let text = self.buf.get(..self.len).unwrap_or_default();
        // The bytes, then the delimiter that ends them (what `write_str` does in
        // `Delimit::Text`; raw bytes because a buffer boundary may cut a character).
        if !text.is_empty() {
            self.uart.write_bytes(text);
            self.uart.write_byte(0);
        }
        self.len = 0;
    }
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for &b in s.as_bytes() {
            if self.len == self.buf.len() {
                self.flush();
            }
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = b;
                self.len += 1;
            }
        }
        Ok(())
    }
}

/// The workload from the options, timed on the agent's TSC (`None` without `workload=`).
fn workload(ctx: &Ctx, tsc: &SkewedTsc<NativeTsc>) -> Option<Workload> {
    let w = ctx.opts.workload?;
    let khz = ctx.clock.tsc_khz().unwrap_or_else(|| {
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
    Uart16550::COM2.init();
    Uart16550::COM1.init();
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
         uarttx wait-then-write {} console {}",
        defmt::Debug2Format(&opts.transport),
        defmt::Debug2Format(&opts.wire),
        opts.ring,
        opts.exit_code,
        opts.events,
        opts.workload.is_some(),
        opts.skew.offset,
        opts.skew.ratio,
        opts.skew.frac_bits,
        opts.uart_tx == TxOrder::WaitThenWrite,
        opts.console
    );
    console(
        &opts,
        format_args!(
            "vmtsync-agent {}: cmdline \"{}\"\n",
            env!("CARGO_PKG_VERSION"),
            core::str::from_utf8(cmdline).unwrap_or("<not utf-8>")
        ),
    );

    EVENTS.choose(opts.flight);

    let cpuid = NativeCpuid;
    // Never RDTSCP here: it kills the VM on the project's nested KVM (see docs/host-quirks.md).
    // The vCPU is the initial APIC id (CPUID.1:EBX[31:24]), the id KVM names `vcpuN` after.
    let mut clock = NativeClock::from_cpuid(NativeTsc::lfence_rdtsc(), &cpuid);
    log!(
        "cpu: invariant tsc {}, tsc_khz {}, tsc at ready {}",
        clock.invariant_tsc(),
        clock.tsc_khz(),
        clock.tsc().read_ordered()
    );
    if let Some(page) = register_pvclock_page(&cpuid) {
        clock = clock.with_pvclock(page);
    }
    if let Some(port) = opts.sync_port {
        clock = clock.with_sync_port(native_ports(), port);
    }
    let vcpus = smp::start(&opts, clock.vcpu_id(), clock.tsc_khz());
    log!("vcpus online: {=u64:#x}", vcpus.online());
    console(
        &opts,
        format_args!(
            "vmtsync-agent: vcpu {}, tsc_khz {}, vcpus online {:#x}\n",
            clock.vcpu_id(),
            clock.tsc_khz().unwrap_or(0),
            vcpus.online()
        ),
    );
    let ctx = Ctx { opts, clock, vcpus };
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
    /// The boot vCPU's clock, unskewed, with its pvclock page and sync port.
    clock: NativeClock,
    /// The application processors that checked in (docs/smp.md).
    vcpus: smp::Vcpus,
}

impl Ctx {
    /// The boot vCPU's raw TSC.
    fn tsc(&self) -> NativeTsc {
        *self.clock.tsc()
    }

    /// The boot vCPU's APIC id.
    fn vcpu(&self) -> u32 {
        self.clock.vcpu_id()
    }
}

/// The protocol loop, in ring 3 or ring 0. `ctx` is the address of a [`Ctx`] that lives forever.
extern "C" fn serve(ctx: usize) -> ! {
    // SAFETY: kmain passes the address of its `Ctx`, in a frame that is never unwound.
    let ctx = unsafe { &*(ctx as *const Ctx) };
    log!("serving at CPL {}", port::cpl());
    console(
        &ctx.opts,
        format_args!("vmtsync-agent: serving at CPL {}\n", port::cpl()),
    );
    match ctx.opts.transport {
        vmtsync_agent::options::Transport::Vsock => serve_vsock::serve(ctx),
        vmtsync_agent::options::Transport::None => serve_memory(ctx),
        vmtsync_agent::options::Transport::Uart => {}
    }
    match ctx.opts.wire {
        Wire::Postcard => serve_postcard(ctx),
        Wire::Line => serve_line(&ctx.opts, ctx.tsc()),
    }
}

/// The agent's clock over every vCPU that checked in (docs/smp.md), and the BSP's skewed TSC
/// its events are stamped with: the same for every transport.
fn agent_clock(ctx: &Ctx) -> (smp::SmpClock<GuestClock<NativeClock>>, SkewedTsc<NativeTsc>) {
    let skew = ctx.opts.skew_of(ctx.vcpu());
    let clock = smp::SmpClock {
        bsp: GuestClock::new(ctx.clock, skew),
        vcpus: ctx.vcpus,
    };
    (
        clock,
        SkewedTsc {
            tsc: ctx.tsc(),
            skew,
        },
    )
}

/// `transport=none`: no link and no poll loop. Publishes the recorder header in guest memory,
/// records the workload into ring 0 with a sync beacon before the first event, after every
/// `beacons=K` events and after the last, and halts the boot vCPU once a finite workload is
/// done (the VM stays up, so a host can read the rest of the records after that).
fn serve_memory(ctx: &Ctx) -> ! {
    let opts = &ctx.opts;
    let mode = if opts.flight {
        Mode::Overwrite
    } else {
        Mode::StopWhenFull
    };
    let Ok(rec) = MemRecorder::init(&MEM_STORAGE.0, MEM_VCPUS, MEM_RING, mode) else {
        defmt::error!("memory: the recorder's storage does not fit its layout");
        port::halt_forever();
    };
    let Some(ring) = rec.ring(0) else {
        port::halt_forever();
    };
    let skew = opts.skew_of(ctx.vcpu());
    let tsc = SkewedTsc {
        tsc: ctx.tsc(),
        skew,
    };
    // The records hold the raw TSC exactly when the skew is the identity (offset 0, ratio
    // 1.0); any other skew is a guest clock the host can place only through beacons.
    // (`claim=raw` makes the header say so anyway: a lying guest, for the host's checks.)
    let raw = opts.claim_raw
        || (skew.offset == 0 && skew.frac_bits < 64 && skew.ratio == 1 << skew.frac_bits);
    let beacon_port = opts.sync_port.filter(|_| opts.beacon_every > 0);
    let header = rec.publish(&HeaderInfo {
        nonce: boot_nonce(&NativeCpuid),
        tsc_khz: ctx.clock.tsc_khz().map_or(0, u64::from),
        clock: if raw {
            ClockKind::RawTsc
        } else {
            ClockKind::Other
        },
        beacon_port: beacon_port.unwrap_or(0),
    });
    log!(
        "ready: recorder in memory at {=u64:#x}, nonce {=u64:#x}, {=u32} ring of {=u64} \
         ({}), clock {=u32}, beacon port {=u16:#x}, vcpu {}",
        MEM_STORAGE.0.as_ptr() as u64,
        header.nonce,
        header.vcpus,
        header.capacity,
        defmt::Debug2Format(&mode),
        header.clock,
        header.beacon_port,
        ctx.vcpu()
    );
    let ports = native_ports();
    let beacon = || {
        if let Some(port) = beacon_port {
            let _ = ring.beacon(&tsc, &ports, port);
        }
    };
    beacon();
    let Some(mut load) = workload(ctx, &tsc) else {
        log!("memory: no workload; halting");
        port::halt_forever();
    };
    let every = u64::from(opts.beacon_every);
    let mut since_beacon = 0;
    loop {
        since_beacon += load.tick(ring, &tsc, &ports);
        // A tick emits a burst of at most 64 overdue events, so a beacon follows the burst
        // in which the K-th event since the last one was recorded.
        if every > 0 && since_beacon >= every {
            beacon();
            since_beacon = 0;
        }
        if load.done() {
            beacon();
            log!(
                "memory: workload done, {=u64} events, {=u64} refused, {=u64} beacons; halting",
                load.emitted(),
                ring.refused(),
                ring.beacons()
            );
            port::halt_forever();
        }
    }
}

fn serve_postcard(ctx: &Ctx) -> ! {
    let opts = &ctx.opts;
    let (clock, tsc) = agent_clock(ctx);
    // One frame per poll, so `events=N` records one event per message (see `events`).
    let com1 = com1(opts);
    let mut agent = Agent::with_events(FramePerPoll::new(com1), clock, agent_events());
    log!("ready: postcard on COM1, vcpu {}", ctx.vcpu());
    // Ready beacon: an empty frame, skipped by every frame receiver.
    com1.write_byte(0);
    let mut events = MessageEvents::new(opts.events);
    let mut load = workload(ctx, &tsc);
    let ports = native_ports();
    let mut lines = ConsoleLines::new(opts.console);
    loop {
        let polled = agent.poll().map(|p| p.state);
        events.after_poll(&agent, EVENTS.ring(), &tsc);
        if let Some(w) = &mut load {
            w.tick(EVENTS.ring().view(), &tsc, &ports);
        }
        agent.link_mut().rearm();
        let s = agent.stats();
        if lines.due(s.messages_in) {
            console(
                opts,
                format_args!(
                    "vmtsync-agent: {} messages, {} probes\n",
                    s.messages_in, s.probes
                ),
            );
        }
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
                    EVENTS.ring().view().dropped(),
                    opts.exit_code
                );
                console(
                    opts,
                    format_args!("vmtsync-agent: shutdown after {} messages\n", s.messages_in),
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
    let com1 = com1(opts);
    com1.write_bytes(b"H vmtsync-agent\n");
    log!("ready: line protocol on COM1");
    loop {
        let request = loop {
            if let Some(b) = com1.try_read() {
                break b;
            }
        };
        match request {
            b'p' => {
                // Write-then-wait (the default) left THR empty, so `T` goes out with the next
                // instruction after the read.
                com1.wait_thr_empty();
                let raw = tsc.read_ordered();
                com1.write_byte(b'T');
                let t = opts.skew.apply(raw);
                let mut hex = [0u8; 16];
                for (i, d) in hex.iter_mut().enumerate() {
                    let nibble = (t >> (60 - 4 * i)) & 0xf;
                    *d = b"0123456789abcdef"[usize::try_from(nibble).unwrap_or(0)];
                }
                com1.write_bytes(&hex);
                com1.write_byte(b'\n');
            }
            b'q' => {
                com1.write_bytes(b"Q\n");
                log!("quit: isa-debug-exit {}", opts.exit_code);
                port::exit(opts.exit_code);
            }
            b'!' => panic!("host asked for a panic"),
            b'w' => {
                com1.write_bytes(b"W\n");
                log!("spinning without exits until the host's watchdog ends the VM");
                loop {
                    core::hint::spin_loop();
                }
            }
            other => com1.write_byte(other),
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
