//! Host tests of the ABI: the functions called the way C calls them, and the hand-written
//! header compiled by gcc against this crate's and core's constants.

use core::mem::offset_of;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use vmtsync_core::recorder::{
    BEACON_ID, HEADER_SIZE, HeaderLayout, LAYOUT_VERSION, MAGIC, MAX_CAPACITY, MAX_PAYLOAD,
    MAX_VCPUS, MIN_CAPACITY, RESERVED_ID_MIN, RING_HEADER_SIZE, SLOT_SIZE,
};

use super::*;

/// One cache line, 64-byte aligned as the recorder requires.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// A 64-byte aligned buffer of `bytes` bytes (rounded up to whole cache lines).
fn aligned(bytes: usize) -> Vec<Line> {
    vec![Line([0u64; 8]); bytes.div_ceil(64)]
}

// One test, because the ABI keeps one recorder per program in statics: separate tests would
// race over it.
#[test]
fn init_publish_record_and_every_error_as_c_sees_them() {
    assert_eq!(vmtsync_storage_bytes(0, 8), 0);
    assert_eq!(vmtsync_storage_bytes(1, 3), 0);
    assert_eq!(vmtsync_storage_bytes(2, 8), 128 + 2 * (128 + 32 * 8));

    // Nothing works before init.
    assert_eq!(vmtsync_publish(1, 0, 0, 0), VMTSYNC_ENOT_INITIALISED);
    // SAFETY: no payload pointer is read (len 0).
    let status = unsafe { vmtsync_record(0, 1, core::ptr::null(), 0) };
    assert_eq!(status, VMTSYNC_ENOT_INITIALISED);

    let need = vmtsync_storage_bytes(2, 8);
    let mut buf = aligned(need);
    let mem = buf.as_mut_ptr().cast::<core::ffi::c_void>();
    // SAFETY: `buf` outlives every use of the recorder in this test, and the statics are
    // never used again after it.
    unsafe {
        assert_eq!(vmtsync_recorder_init(mem, need, 2, 8, 2), VMTSYNC_EINVALID);
        assert_eq!(
            vmtsync_recorder_init(mem, need, 2, 6, 0),
            VMTSYNC_EBAD_SHAPE
        );
        assert_eq!(
            vmtsync_recorder_init(mem, need - 1, 2, 8, 0),
            VMTSYNC_ETOO_SMALL
        );
        assert_eq!(
            vmtsync_recorder_init(mem.cast::<u8>().add(8).cast(), need, 2, 8, 0),
            VMTSYNC_EMISALIGNED
        );
        assert_eq!(
            vmtsync_recorder_init(core::ptr::null_mut(), need, 2, 8, 0),
            VMTSYNC_EMISALIGNED
        );
        assert_eq!(vmtsync_recorder_init(mem, need, 2, 8, 0), VMTSYNC_OK);
    }
    // Unpublished: the magic is still zero.
    assert_eq!(buf[0].0[0], 0);
    assert_eq!(vmtsync_publish(7, 2_000_000, 2, 0), VMTSYNC_EINVALID);
    assert_eq!(vmtsync_publish(7, 2_000_000, 0, 0), VMTSYNC_OK);
    let bytes: Vec<u8> = buf
        .iter()
        .flat_map(|l| l.0)
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let h = HeaderLayout::from_bytes(bytes[..HEADER_SIZE].try_into().unwrap());
    assert_eq!(h.magic, MAGIC);
    assert_eq!(
        (h.nonce, h.vcpus, h.capacity, h.tsc_khz),
        (7, 2, 8, 2_000_000)
    );

    let payload = 42u64.to_le_bytes();
    // SAFETY: `payload` is 8 readable bytes; the long one below is never read past 16.
    unsafe {
        for _ in 0..8 {
            assert_eq!(vmtsync_record(1, 5, payload.as_ptr().cast(), 8), VMTSYNC_OK);
        }
        // Stop-when-full: the ninth is refused.
        assert_eq!(
            vmtsync_record(1, 5, payload.as_ptr().cast(), 8),
            VMTSYNC_EFULL
        );
        assert_eq!(
            vmtsync_record(2, 5, payload.as_ptr().cast(), 8),
            VMTSYNC_ENO_SUCH_VCPU
        );
        assert_eq!(vmtsync_record(0, 5, core::ptr::null(), 1), VMTSYNC_EINVALID);
        let long = [0u8; 17];
        assert_eq!(
            vmtsync_record(0, 5, long.as_ptr().cast(), 17),
            VMTSYNC_EPAYLOAD_TOO_LONG
        );
        // No beacon port published: refused before any port I/O.
        assert_eq!(vmtsync_beacon(0), VMTSYNC_ENO_BEACON_PORT);
    }
    let rec = recorder().unwrap();
    let ring = rec.ring(1).unwrap();
    assert_eq!(ring.end(), 8);
    assert_eq!(ring.refused(), 1);
    assert_eq!(rec.ring(0).unwrap().end(), 0);
}

/// Compiles a C file against include/vmtsync.h with gcc in which every constant, the header
/// struct's size and each field's offset are `_Static_assert`ed equal to the Rust values.
#[test]
fn the_header_matches_the_rust_layout() {
    let Ok(out) = Command::new("gcc").arg("--version").output() else {
        // gcc is a prerequisite `cargo xtask setup` installs; without it this check cannot
        // run at all, so it fails rather than pass silently.
        panic!("gcc not found: install it (cargo xtask setup) to check include/vmtsync.h");
    };
    assert!(out.status.success());
    let mut c = String::from("#include \"vmtsync.h\"\n#include <stddef.h>\n");
    let mut eq = |lhs: &str, rhs: String| {
        writeln!(c, "_Static_assert(({lhs}) == ({rhs}), \"{lhs}\");").unwrap();
    };
    eq("VMTSYNC_MAGIC", format!("{MAGIC}ULL"));
    eq("VMTSYNC_LAYOUT_VERSION", LAYOUT_VERSION.to_string());
    eq("VMTSYNC_HEADER_SIZE", HEADER_SIZE.to_string());
    eq("VMTSYNC_RING_HEADER_SIZE", RING_HEADER_SIZE.to_string());
    eq("VMTSYNC_SLOT_SIZE", SLOT_SIZE.to_string());
    eq("VMTSYNC_MAX_PAYLOAD", MAX_PAYLOAD.to_string());
    eq("VMTSYNC_MAX_VCPUS", MAX_VCPUS.to_string());
    eq("VMTSYNC_MIN_CAPACITY", MIN_CAPACITY.to_string());
    eq("VMTSYNC_MAX_CAPACITY", format!("{MAX_CAPACITY}ULL"));
    eq("VMTSYNC_BEACON_ID", BEACON_ID.to_string());
    eq("VMTSYNC_RESERVED_ID_MIN", RESERVED_ID_MIN.to_string());
    eq(
        "VMTSYNC_MODE_STOP_WHEN_FULL",
        (Mode::StopWhenFull as u32).to_string(),
    );
    eq(
        "VMTSYNC_MODE_OVERWRITE",
        (Mode::Overwrite as u32).to_string(),
    );
    eq(
        "VMTSYNC_CLOCK_RAW_TSC",
        (ClockKind::RawTsc as u32).to_string(),
    );
    eq("VMTSYNC_CLOCK_OTHER", (ClockKind::Other as u32).to_string());
    for (name, v) in [
        ("VMTSYNC_OK", VMTSYNC_OK),
        ("VMTSYNC_EBAD_SHAPE", VMTSYNC_EBAD_SHAPE),
        ("VMTSYNC_ETOO_SMALL", VMTSYNC_ETOO_SMALL),
        ("VMTSYNC_EMISALIGNED", VMTSYNC_EMISALIGNED),
        ("VMTSYNC_ENOT_INITIALISED", VMTSYNC_ENOT_INITIALISED),
        ("VMTSYNC_EINVALID", VMTSYNC_EINVALID),
        ("VMTSYNC_EFULL", VMTSYNC_EFULL),
        ("VMTSYNC_EPAYLOAD_TOO_LONG", VMTSYNC_EPAYLOAD_TOO_LONG),
        ("VMTSYNC_ENO_SUCH_VCPU", VMTSYNC_ENO_SUCH_VCPU),
        ("VMTSYNC_ENO_BEACON_PORT", VMTSYNC_ENO_BEACON_PORT),
        ("VMTSYNC_ERESERVED_ID", VMTSYNC_ERESERVED_ID),
    ] {
        eq(name, v.to_string());
    }
    for (v, cap) in [(1usize, 2usize), (4, 65536), (1024, 1 << 31)] {
        eq(
            &format!("VMTSYNC_STORAGE_BYTES({v}, {cap})"),
            MemRecorder::storage_bytes(v, cap).unwrap().to_string(),
        );
    }
    eq(
        "sizeof(struct vmtsync_header)",
        size_of::<HeaderLayout>().to_string(),
    );
    macro_rules! field {
        ($($f:ident),*) => {$(
            eq(
                concat!("offsetof(struct vmtsync_header, ", stringify!($f), ")"),
                offset_of!(HeaderLayout, $f).to_string(),
            );
        )*};
    }
    field!(
        magic,
        version,
        header_size,
        nonce,
        vcpus,
        slot_size,
        capacity,
        tsc_khz,
        mode,
        clock,
        rings_offset,
        ring_stride,
        beacon_port,
        reserved0,
        checksum,
        reserved1
    );
    let dir = std::env::temp_dir().join(format!("vmtsync-capi-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("check.c");
    std::fs::write(&file, &c).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let out = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(&include)
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "include/vmtsync.h disagrees with the Rust layout:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
