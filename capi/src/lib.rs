//! # vmtsync-capi
//!
//! The C ABI of vmtsync-core's recorder in caller-provided memory
//! ([`vmtsync_core::recorder::MemRecorder`]) and of its sync beacons: what C firmware, a C
//! unikernel or EDK2/coreboot code links (`libvmtsync_capi.a`, built for
//! `x86_64-unknown-none`) with `include/vmtsync.h`. The byte layout the host reads is
//! docs/memory-layout.md's.
//!
//! One recorder per program: [`vmtsync_recorder_init`] lays it out in the caller's buffer and
//! remembers it, [`vmtsync_publish`] writes the self-describing header, and
//! [`vmtsync_record`] and [`vmtsync_beacon`] store events and beacons on one vCPU's ring.
//! Every function returns a status ([`VMTSYNC_OK`] or a negative `VMTSYNC_E*` code); none
//! panics on bad input.
//!
//! Concurrency: each ring has one producer, as in Rust. C code must call `vmtsync_record` and
//! `vmtsync_beacon` for vCPU `v` only from vCPU `v` (or otherwise one caller at a time per
//! ring), and call `vmtsync_recorder_init` once before any other vCPU records.
#![cfg_attr(target_os = "none", no_std)]
#![deny(missing_docs)]

use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use vmtsync_core::arch::NativePorts;
use vmtsync_core::arch::x86_64::{NativeCpuid, NativeTsc, boot_nonce};
use vmtsync_core::recorder::{
    ClockKind, HeaderInfo, LayoutError, MemRecorder, Mode, RecordError, SLOT_SIZE, Slot,
};

/// Success.
pub const VMTSYNC_OK: i32 = 0;
/// The vCPU count is outside 1..=1024 or the capacity is not a power of two in 2..=2^31.
pub const VMTSYNC_EBAD_SHAPE: i32 = -1;
/// The buffer is smaller than `vmtsync_storage_bytes` says it must be.
pub const VMTSYNC_ETOO_SMALL: i32 = -2;
/// The buffer does not start on a 64-byte boundary (or is null).
pub const VMTSYNC_EMISALIGNED: i32 = -3;
/// No recorder: `vmtsync_recorder_init` has not succeeded yet.
pub const VMTSYNC_ENOT_INITIALISED: i32 = -4;
/// An argument is out of its range (a mode or clock other than 0 or 1, a null payload with a
/// non-zero length).
pub const VMTSYNC_EINVALID: i32 = -5;
/// The stop-when-full ring is full; the event was counted as refused.
pub const VMTSYNC_EFULL: i32 = -6;
/// The payload is longer than 16 bytes; nothing was stored or counted.
pub const VMTSYNC_EPAYLOAD_TOO_LONG: i32 = -7;
/// The recorder has no ring for that vCPU; nothing was counted.
pub const VMTSYNC_ENO_SUCH_VCPU: i32 = -8;
/// A beacon was asked for, but the header is not published or names no beacon port.
pub const VMTSYNC_ENO_BEACON_PORT: i32 = -9;
/// The event id is reserved for vmtsync (`VMTSYNC_RESERVED_ID_MIN` and above).
pub const VMTSYNC_ERESERVED_ID: i32 = -10;

/// The recorder's buffer (null until [`vmtsync_recorder_init`] succeeds).
static STORAGE: AtomicPtr<Slot> = AtomicPtr::new(core::ptr::null_mut());
/// The buffer's length in slots.
static SLOTS: AtomicUsize = AtomicUsize::new(0);
/// The number of rings.
static VCPUS: AtomicUsize = AtomicUsize::new(0);
/// Records per ring.
static CAPACITY: AtomicUsize = AtomicUsize::new(0);

fn layout_status(e: LayoutError) -> i32 {
    match e {
        LayoutError::BadShape => VMTSYNC_EBAD_SHAPE,
        LayoutError::TooSmall => VMTSYNC_ETOO_SMALL,
        LayoutError::Misaligned => VMTSYNC_EMISALIGNED,
        _ => VMTSYNC_EINVALID,
    }
}

fn record_status(r: Result<(), RecordError>) -> i32 {
    match r {
        Ok(()) => VMTSYNC_OK,
        Err(RecordError::Full) => VMTSYNC_EFULL,
        Err(RecordError::PayloadTooLong) => VMTSYNC_EPAYLOAD_TOO_LONG,
        Err(RecordError::NoSuchVcpu) => VMTSYNC_ENO_SUCH_VCPU,
        Err(RecordError::NoBeaconPort) => VMTSYNC_ENO_BEACON_PORT,
        Err(RecordError::ReservedId) => VMTSYNC_ERESERVED_ID,
        Err(_) => VMTSYNC_EINVALID,
    }
}

/// The recorder [`vmtsync_recorder_init`] laid out, if any.
fn recorder() -> Option<MemRecorder<'static>> {
    let ptr = STORAGE.load(Ordering::Acquire);
    if ptr.is_null() {
        return None;
    }
    let slots = SLOTS.load(Ordering::Relaxed);
    // SAFETY: `vmtsync_recorder_init`'s caller promised that the buffer stays valid, and is
    // touched by nothing but this library, for the rest of the program; it stored `ptr` and
    // `slots` (a non-null, 64-aligned pointer and a length within the buffer) with Release
    // after `SLOTS`, and Acquire above makes them visible. `Slot` is four atomic words, so
    // shared references to it allow every access the recorder makes.
    let storage = unsafe { core::slice::from_raw_parts(ptr.cast_const(), slots) };
    MemRecorder::view(
        storage,
        VCPUS.load(Ordering::Relaxed),
        CAPACITY.load(Ordering::Relaxed),
    )
    .ok()
}

/// The bytes a recorder of `vcpus` rings of `capacity` records needs (header included), or 0
/// for a shape no header can describe. `VMTSYNC_STORAGE_BYTES` in the header is the same sum
/// for static buffers.
#[unsafe(no_mangle)]
pub extern "C" fn vmtsync_storage_bytes(vcpus: u32, capacity: u64) -> usize {
    let (Ok(v), Ok(c)) = (usize::try_from(vcpus), usize::try_from(capacity)) else {
        return 0;
    };
    MemRecorder::storage_bytes(v, c).unwrap_or(0)
}

/// Lays out an empty recorder of `vcpus` rings of `capacity` records in `mem` (`len` bytes,
/// 64-byte aligned) in `mode` (0 stop-when-full, 1 overwrite-oldest) and makes it the one
/// the other functions use. The header stays unpublished (zero) until [`vmtsync_publish`].
///
/// # Safety
/// `mem` must be valid for reads and writes of `len` bytes for the rest of the program, and
/// nothing but this library may access it after this call (the host reads it from outside,
/// which is fine). Call it once, before any vCPU records.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vmtsync_recorder_init(
    mem: *mut core::ffi::c_void,
    len: usize,
    vcpus: u32,
    capacity: u64,
    mode: u32,
) -> i32 {
    let mode = match mode {
        0 => Mode::StopWhenFull,
        1 => Mode::Overwrite,
        _ => return VMTSYNC_EINVALID,
    };
    let (Ok(v), Ok(c)) = (usize::try_from(vcpus), usize::try_from(capacity)) else {
        return VMTSYNC_EBAD_SHAPE;
    };
    let ptr = mem.cast::<Slot>();
    if ptr.is_null() || !ptr.addr().is_multiple_of(64) {
        return VMTSYNC_EMISALIGNED;
    }
    let slots = len / SLOT_SIZE;
    // SAFETY: the caller hands over `len` valid bytes for good (above); `ptr` is non-null and
    // 64-aligned (Slot needs 8), and `slots * 32 <= len`. Any bytes are a valid `Slot` (four
    // atomic u64 words), and from here on only atomic accesses touch them.
    let storage: &'static [Slot] = unsafe { core::slice::from_raw_parts(ptr, slots) };
    if let Err(e) = MemRecorder::init(storage, v, c, mode) {
        return layout_status(e);
    }
    VCPUS.store(v, Ordering::Relaxed);
    CAPACITY.store(c, Ordering::Relaxed);
    SLOTS.store(slots, Ordering::Relaxed);
    STORAGE.store(ptr, Ordering::Release);
    VMTSYNC_OK
}

/// Publishes the recorder's self-describing header (magic last), after which a host reading
/// guest memory finds it. `nonce` 0 asks for one made here (RDRAND where the CPU has it, mixed
/// with the TSC); `tsc_khz` 0 means unknown; `clock` 0 says records hold the raw TSC (what
/// this library's `vmtsync_record` stores), 1 some other guest clock; `beacon_port` 0 means no
/// beacons. Publishing again with another nonce tells a reader the recording restarted.
#[unsafe(no_mangle)]
pub extern "C" fn vmtsync_publish(nonce: u64, tsc_khz: u64, clock: u32, beacon_port: u16) -> i32 {
    let clock = match clock {
        0 => ClockKind::RawTsc,
        1 => ClockKind::Other,
        _ => return VMTSYNC_EINVALID,
    };
    let Some(rec) = recorder() else {
        return VMTSYNC_ENOT_INITIALISED;
    };
    let nonce = if nonce == 0 {
        boot_nonce(&NativeCpuid)
    } else {
        nonce
    };
    rec.publish(&HeaderInfo {
        nonce,
        tsc_khz,
        clock,
        beacon_port,
    });
    VMTSYNC_OK
}

/// Records event `id` with `len` bytes of payload from `data` (at most 16; `data` may be null
/// when `len` is 0) on `vcpu`'s ring, stamped with an ordered TSC read (`lfence; rdtsc`).
///
/// # Safety
/// `data` must be valid for reads of `len` bytes (when `len` is non-zero), and only one caller
/// at a time may record or beacon on `vcpu`'s ring.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vmtsync_record(
    vcpu: u32,
    id: u16,
    data: *const core::ffi::c_void,
    len: usize,
) -> i32 {
    let Some(rec) = recorder() else {
        return VMTSYNC_ENOT_INITIALISED;
    };
    let payload: &[u8] = if len == 0 {
        &[]
    } else if data.is_null() {
        return VMTSYNC_EINVALID;
    } else if len > vmtsync_core::recorder::MAX_PAYLOAD {
        return VMTSYNC_EPAYLOAD_TOO_LONG;
    } else {
        // SAFETY: the caller promised `len` readable bytes at the non-null `data`.
        unsafe { core::slice::from_raw_parts(data.cast::<u8>(), len) }
    };
    let Ok(v) = usize::try_from(vcpu) else {
        return VMTSYNC_ENO_SUCH_VCPU;
    };
    record_status(rec.record(v, &NativeTsc::lfence_rdtsc(), id, payload))
}

/// Emits `vcpu`'s next sync beacon on the published beacon port: `in` from the port, an
/// ordered TSC read stored as a beacon record, `out` of the sequence number's low byte.
///
/// # Safety
/// Only one caller at a time may record or beacon on `vcpu`'s ring, and the code must be
/// allowed port I/O (ring 0, or IOPL 3); the beacon port must be one no device uses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vmtsync_beacon(vcpu: u32) -> i32 {
    let Some(rec) = recorder() else {
        return VMTSYNC_ENOT_INITIALISED;
    };
    let Ok(v) = usize::try_from(vcpu) else {
        return VMTSYNC_ENO_SUCH_VCPU;
    };
    // SAFETY: the port is the published beacon port, which the caller vouches no device uses.
    let ports = unsafe { NativePorts::new() };
    record_status(
        rec.beacon(v, &NativeTsc::lfence_rdtsc(), &ports)
            .map(|_| ()),
    )
}

/// Halts this vCPU for good: a bare-metal staticlib has no unwinder, and a panic (none is
/// reachable through the ABI above) must not return into C code.
#[cfg(target_os = "none")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    loop {
        // SAFETY: `cli; hlt` touches no memory; with interrupts off the vCPU stays halted.
        unsafe { core::arch::asm!("cli", "hlt", options(nomem, nostack)) };
    }
}

#[cfg(test)]
mod tests;
