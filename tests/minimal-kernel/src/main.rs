//! A minimal kernel that is not `vmtsync-agent`: the complete example of docs/embedding.md.
//!
//! It boots through its own PVH entry ([`boot`]), prints a boot log on its console (COM1),
//! and runs a tiny application that handles [`REQUESTS`] "requests", recording a
//! [`REQUEST_START`] and a [`REQUEST_DONE`] event around each (payload: the request's sequence
//! number, `u64` LE), with a write to port [`DOORBELL`] after the start and a read from it
//! before the done, so the host's `kvm:kvm_pio` exits of that port fall between each pair.
//! Everything between the `vmtsync-glue: begin` / `end` markers is what embedding vmtsync
//! costs; the `vmtsync-tests` test `minimal_kernel_glue_is_at_most_30_lines` counts it.
//!
//! The host (`vmtsync record --connect unix:COM1 --shutdown`) syncs the clocks and drains the
//! events over COM1; on its shutdown the kernel ends the VM through isa-debug-exit with 0.
//! With `memory` on its command line the kernel runs the same application in memory mode
//! ([`memory`]): it publishes its recorder in its own memory for a host to read there, with no
//! link and no poll loop, and COM1 carries only its console.

#![no_std]
#![no_main]

mod boot;
mod io;
mod memory;

use core::fmt::Write as _;

/// How many requests the application handles (two events each).
pub const REQUESTS: u64 = 1000;
/// The application's event id recorded when a request starts.
pub const REQUEST_START: u16 = 0x51;
/// The application's event id recorded when a request is done.
pub const REQUEST_DONE: u16 = 0x52;
/// An I/O port nothing in the VM decodes: the application writes it after each request's
/// start and reads it before its done, so each request has two VM exits the host can see
/// between its two events.
pub const DOORBELL: u16 = 0x2402;
/// TSC ticks between two requests (about a millisecond at 2-3 GHz): the requests run while
/// the host records, not only before it attaches.
const REQUEST_PERIOD: u64 = 1 << 21;
/// The application prints a progress line on its console after every this many requests,
/// between two polls of the agent: console text on the UART the protocol shares.
pub const PROGRESS_EVERY: u64 = 250;
/// `XEN_HVM_START_MAGIC_VALUE`, the first word of the PVH start info (Xen
/// `public/arch-x86/hvm/start_info.h`).
const PVH_START_MAGIC: u32 = 0x336e_c578;
/// Offset of `cmdline_paddr` (u64: the NUL-terminated command line's physical address, 0 for
/// none) in the PVH start info (Xen `public/arch-x86/hvm/start_info.h`).
const PVH_CMDLINE_PADDR: u64 = 24;
/// The longest command line the kernel reads.
const CMDLINE_MAX: usize = 256;

/// The application: one request whenever its period has passed, until [`REQUESTS`] are done.
struct App {
    // vmtsync-glue: begin (core's TSC read, which the app paces itself by too, and the one
    // producer handle of vCPU 0's ring)
    tsc: NativeTsc,
    events: Producer<'static>,
    // vmtsync-glue: end
    next: u64,
    done: u64,
}

impl App {
    fn step(&mut self) {
        if self.done == REQUESTS || self.tsc.read_ordered() < self.next {
            return;
        }
        let seq = self.done.to_le_bytes();
        // vmtsync-glue: begin (the application's two tracepoints)
        let _ = self.events.record(&self.tsc, REQUEST_START, &seq);
        // vmtsync-glue: end
        io::outb(DOORBELL, seq[0]);
        let work: u64 = (0..64).map(|i| i * self.done).sum();
        core::hint::black_box(work);
        let _ = io::inb(DOORBELL);
        // vmtsync-glue: begin
        let _ = self.events.record(&self.tsc, REQUEST_DONE, &seq);
        // vmtsync-glue: end
        self.done += 1;
        self.next += REQUEST_PERIOD;
        if self.done.is_multiple_of(PROGRESS_EVERY) {
            let _ = writeln!(io::Console, "minimal-kernel: {} requests done", self.done);
        }
    }
}

// vmtsync-glue: begin (the statics)
use vmtsync_core::agent::{Agent, PollAt};
use vmtsync_core::arch::uart16550::Uart16550;
use vmtsync_core::arch::x86_64::{NativeClock, NativeTsc};
use vmtsync_core::arch::{NativePorts, Tsc as _};
use vmtsync_core::recorder::{Producer, Recorder};

/// One ring of 4096 records (32 bytes each) for the one vCPU.
static RECORDER: Recorder<1, 4096> = Recorder::new();
/// The agent's sync port: another port nothing decodes. The clock reads it right before each
/// probe's TSC read and writes it right after, so the host's exits of this port bracket the
/// read within a few instructions (the kernel runs in ring 0, where nested KVM emulates every
/// instruction: the UART's own exits would bracket hundreds).
const SYNC_PORT: u16 = 0x2400;
// vmtsync-glue: end

/// The kernel's main, entered by [`boot`] in long mode with the start-info address.
#[unsafe(no_mangle)]
extern "C" fn kmain(start_info: u64) -> ! {
    io::com1_init();
    let mut con = io::Console;
    // SAFETY: the PVH loader passes the start info's physical address, which the boot code's
    // identity map covers; its first word is the magic. Volatile: the loader wrote it.
    let magic = unsafe { (start_info as *const u32).read_volatile() };
    let pvh = if magic == PVH_START_MAGIC {
        "ok"
    } else {
        "bad"
    };
    let _ = writeln!(con, "minimal-kernel: long mode, PVH start info {pvh}");
    let memory_mode = magic == PVH_START_MAGIC
        && cmdline(start_info)
            .split(|&b| b == b' ')
            .any(|w| w == b"memory");
    let _ = writeln!(
        con,
        "minimal-kernel: {REQUESTS} requests, events {REQUEST_START:#x}/{REQUEST_DONE:#x}, \
         doorbell port {DOORBELL:#x}"
    );
    // vmtsync-glue: begin (the application's TSC read and producer handle)
    let tsc = NativeTsc::lfence_rdtsc();
    let events = RECORDER.producer(0).expect("vCPU 0 has a ring");
    // vmtsync-glue: end
    let mut app = App {
        tsc,
        events,
        next: tsc.read_ordered(),
        done: 0,
    };
    if memory_mode {
        memory::run(app);
    }
    // vmtsync-glue: begin (the clock, the link, the poll loop)
    // SAFETY: nothing in the VM decodes SYNC_PORT: its I/O only exits to the host.
    let sync = unsafe { NativePorts::new() };
    let clock = NativeClock::detect().with_sync_port(sync, SYNC_PORT);
    let mut agent = Agent::with_events(Uart16550::COM1, clock, &RECORDER);
    loop {
        app.step();
        if agent.poll().map(|p| p.next) == Ok(PollAt::Never) {
            io::exit(0);
        }
    }
    // vmtsync-glue: end
}

/// The command line the PVH start info at `start_info` names, up to its NUL (at most
/// [`CMDLINE_MAX`] bytes; empty if there is none).
fn cmdline(start_info: u64) -> &'static [u8] {
    // SAFETY: the start info is valid (its magic was checked) and identity-mapped; its
    // `cmdline_paddr` word is 8-byte aligned. Volatile: the loader wrote it.
    let at = unsafe { ((start_info + PVH_CMDLINE_PADDR) as *const u64).read_volatile() };
    if at == 0 {
        return &[];
    }
    // SAFETY: the loader placed the command line in low RAM, which the boot code's
    // identity map covers, and nothing writes it after; reading stops at its NUL.
    let len = (0..CMDLINE_MAX)
        .find(|&i| unsafe { ((at + i as u64) as *const u8).read_volatile() } == 0)
        .unwrap_or(CMDLINE_MAX);
    // SAFETY: those `len` bytes are readable, as above, and stay unchanged.
    unsafe { core::slice::from_raw_parts(at as *const u8, len) }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let _ = writeln!(io::Console, "minimal-kernel: {info}");
    io::exit(0x31)
}
