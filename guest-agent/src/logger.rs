//! The defmt global logger: binary log frames on COM2, decoded on the host.
//!
//! Each `defmt::info!` (and core's log calls, through its `defmt` feature) becomes one frame:
//! the interned format string's index, the timestamp, and the arguments in defmt's binary
//! encoding, rzCOBS-framed by [`defmt::Encoder`] (`0x00` ends every frame). The strings stay
//! in the ELF's `.defmt` section (linked by `defmt.x`, see build.rs); the host decodes the
//! stream against the same ELF (`vmtsync_tests::vmm::defmt_log`, `cargo xtask run-agent`).
//! Frames are short (a few bytes each), so logging costs far fewer port writes than text did.
//!
//! Timestamps are the raw TSC (`lfence; rdtsc`, never skewed): on the project's machines guest
//! TSC == host TSC, so a log line can be placed on the host's timeline as it is.
//!
//! Concurrency: the agent runs on one CPU with interrupts off, so nothing can interleave with
//! a frame except a panic raised inside a log call. [`recover`] lets the panic handler end
//! such a half-written frame (the host drops it as malformed) before it logs the panic.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, Ordering};

use vmtsync_core::arch::uart16550::Uart16550;

/// The logger `defmt` calls; all state is in the statics below.
#[defmt::global_logger]
struct Com2Logger;

/// Set between `acquire` and `release`.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// The frame encoder, only touched by the holder of [`TAKEN`].
struct EncoderCell(UnsafeCell<defmt::Encoder>);

// SAFETY: single CPU without interrupts; every access happens with `TAKEN` held (acquire,
// write, release) or in `recover`, which runs only in the panic handler, after which the
// interrupted frame never resumes (the panic handler does not return).
unsafe impl Sync for EncoderCell {}

static ENCODER: EncoderCell = EncoderCell(UnsafeCell::new(defmt::Encoder::new()));

/// Writes encoded bytes to COM2.
fn emit(bytes: &[u8]) {
    Uart16550::COM2.write_bytes(bytes);
}

/// The encoder.
///
/// # Safety
/// The caller holds [`TAKEN`] (or is the panic handler after [`recover`]) and keeps the
/// reference for the duration of one call only.
unsafe fn encoder() -> &'static mut defmt::Encoder {
    // SAFETY: exclusive per the caller's contract: one CPU, no interrupts, `TAKEN` held.
    unsafe { &mut *ENCODER.0.get() }
}

// SAFETY: `acquire` refuses re-entry, so frames never interleave; `write` and `release` are
// only called by defmt between `acquire` and `release` (the trait's contract).
unsafe impl defmt::Logger for Com2Logger {
    fn acquire() {
        assert!(
            !TAKEN.swap(true, Ordering::Acquire),
            "defmt logger re-entered"
        );
        // SAFETY: we just took `TAKEN`.
        unsafe { encoder() }.start_frame(emit);
    }

    unsafe fn flush() {
        // The UART model is synchronous: every byte is out once `outb` returns.
    }

    unsafe fn release() {
        // SAFETY: defmt calls `release` only while we hold `TAKEN`.
        unsafe { encoder() }.end_frame(emit);
        TAKEN.store(false, Ordering::Release);
    }

    unsafe fn write(bytes: &[u8]) {
        // SAFETY: defmt calls `write` only while we hold `TAKEN`.
        unsafe { encoder() }.write(bytes, emit);
    }
}

/// Ends a frame a panic interrupted, so the panic handler can log. Writes a lone `0x00` (the
/// rzCOBS delimiter: the host decoder drops the partial frame as malformed and resyncs), resets
/// the encoder, and releases the logger. Does nothing when no frame is open.
pub fn recover() {
    if TAKEN.load(Ordering::Acquire) {
        emit(&[0]);
        // SAFETY: called from the panic handler only; the interrupted frame never resumes.
        unsafe { *encoder() = defmt::Encoder::new() };
        TAKEN.store(false, Ordering::Release);
    }
}

// The raw TSC as every frame's timestamp (ring 3 may execute RDTSC: CR4.TSD is clear).
defmt::timestamp!("{=u64}", vmtsync_core::arch::x86_64::lfence_rdtsc());
