//! The C recorder as a firmware build takes it: the header's constants and struct layout equal
//! the Rust values, both files build warning-free and freestanding with every compiler and ABI
//! (i386 as SeaBIOS builds it too), and the objects need no symbol from libc or libgcc. Also the
//! header checksum's test vector of docs/memory-layout.md, against both implementations.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use vmtsync_capi::{FREESTANDING, STRICT, Toolchain, include_dir, source, usable_toolchains};
use vmtsync_core::recorder::{
    BEACON_ID, ClockKind, FUNC_ENTRY_ID, FUNC_EXIT_ID, HEADER_SIZE, HeaderInfo, HeaderLayout,
    LAYOUT_VERSION, MAGIC, MAX_CAPACITY, MAX_PAYLOAD, MAX_VCPUS, MIN_CAPACITY, MemRecorder, Mode,
    RELOC_ID, RESERVED_ID_MIN, RING_HEADER_SIZE, SLOT_SIZE, SPAN_BEGIN_ID, SPAN_END_ID, checksum,
};

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The flag sets each toolchain must build the recorder with: C11, and for i386 also the
/// gnu99 `-march=i386` a firmware such as SeaBIOS uses.
fn flag_sets(t: &Toolchain) -> Vec<Vec<&'static str>> {
    let mut c11: Vec<&str> = STRICT.to_vec();
    c11.extend(FREESTANDING);
    let mut sets = vec![c11.clone()];
    if t.abi == "-m32" {
        let mut gnu: Vec<&str> = c11
            .into_iter()
            .map(|f| if f == "-std=c11" { "-std=gnu99" } else { f })
            .collect();
        gnu.push("-march=i386");
        sets.push(gnu);
    }
    sets
}

fn os(v: &[&'static str]) -> Vec<&'static OsStr> {
    v.iter().map(|s| OsStr::new(*s)).collect()
}

/// Every constant, the storage size and the header struct's layout, `_Static_assert`ed in C
/// against the Rust values, with every toolchain and flag set.
#[test]
fn the_header_matches_the_rust_layout() {
    // A static assertion C99 takes too (a negative array size fails to compile).
    let mut c = String::from(
        "#include \"vmtsync.h\"\n#include <stddef.h>\n\
         #define CAT_(a, b) a##b\n#define CAT(a, b) CAT_(a, b)\n\
         #define CHECK(c) typedef char CAT(check_, __LINE__)[(c) ? 1 : -1]\n",
    );
    let mut eq = |lhs: &str, rhs: String| {
        writeln!(c, "CHECK(({lhs}) == ({rhs})); /* {lhs} */").unwrap();
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
    eq("VMTSYNC_SPAN_BEGIN_ID", SPAN_BEGIN_ID.to_string());
    eq("VMTSYNC_SPAN_END_ID", SPAN_END_ID.to_string());
    eq("VMTSYNC_FUNC_ENTRY_ID", FUNC_ENTRY_ID.to_string());
    eq("VMTSYNC_FUNC_EXIT_ID", FUNC_EXIT_ID.to_string());
    eq("VMTSYNC_RELOC_ID", RELOC_ID.to_string());
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
    // The status codes are the old C ABI's, unchanged (docs/c-abi.md lists them).
    for (name, v) in [
        ("VMTSYNC_OK", 0),
        ("VMTSYNC_EBAD_SHAPE", -1),
        ("VMTSYNC_ETOO_SMALL", -2),
        ("VMTSYNC_EMISALIGNED", -3),
        ("VMTSYNC_ENOT_INITIALISED", -4),
        ("VMTSYNC_EINVALID", -5),
        ("VMTSYNC_EFULL", -6),
        ("VMTSYNC_EPAYLOAD_TOO_LONG", -7),
        ("VMTSYNC_ENO_SUCH_VCPU", -8),
        ("VMTSYNC_ENO_BEACON_PORT", -9),
        ("VMTSYNC_ERESERVED_ID", -10),
    ] {
        eq(name, v.to_string());
    }
    // The largest shape only where size_t holds it.
    for (v, cap) in [(1usize, 2usize), (4, 65536), (3, 1 << 20)] {
        eq(
            &format!("VMTSYNC_STORAGE_BYTES({v}, {cap})"),
            MemRecorder::storage_bytes(v, cap).unwrap().to_string(),
        );
    }
    eq(
        "sizeof(struct vmtsync_header)",
        size_of::<HeaderLayout>().to_string(),
    );
    // Every field of core's one table (HeaderLayout::FIELDS tiles the 128 bytes): the C
    // struct's member of that name sits at the same offset with the same size.
    for f in HeaderLayout::FIELDS {
        eq(
            &format!("offsetof(struct vmtsync_header, {})", f.name),
            f.offset.to_string(),
        );
        eq(
            &format!("sizeof(((struct vmtsync_header *)0)->{})", f.name),
            f.size.to_string(),
        );
    }
    // A static block is 64-byte aligned, and two recorders fit one image.
    c.push_str(
        "static VMTSYNC_DEFINE_STORAGE(a_, 2, 8);\nVMTSYNC_DEFINE_STORAGE(b_, 1, 4);\n\
         CHECK(sizeof a_ == VMTSYNC_STORAGE_BYTES(2, 8));\n\
         CHECK(__alignof__(a_) == 64);\n\
         unsigned char *two_(void) { return (unsigned char *)((size_t)a_ | (size_t)b_); }\n",
    );
    let dir = tmp("capi-header");
    let file = dir.join("check.c");
    std::fs::write(&file, &c).unwrap();
    let include = include_dir();
    for t in usable_toolchains(&dir) {
        for flags in flag_sets(&t) {
            let mut args = os(&flags);
            args.extend([
                OsStr::new("-fsyntax-only"),
                OsStr::new("-I"),
                include.as_os_str(),
                file.as_os_str(),
            ]);
            if let Err(e) = t.compile(&args) {
                panic!("include/vmtsync.h disagrees with the Rust layout:\n{e}");
            }
        }
    }
}

/// Builds vmtsync.c and a file calling every function (the inline hot path included) into
/// objects with each toolchain and flag set; neither may leave an undefined symbol (no libc,
/// no libgcc helper such as __udivdi3, no memcpy or memset call). vmtsync.c also with the
/// `-finstrument-functions` hooks, itself compiled with `-finstrument-functions`: its own
/// functions are not instrumented, so it needs no hook from outside either. Prints `size` per
/// object.
#[test]
fn the_recorder_builds_freestanding_with_no_outside_symbol() {
    let dir = tmp("capi-freestanding");
    let user = dir.join("user.c");
    std::fs::write(
        &user,
        "#include \"vmtsync.h\"\n\
         static VMTSYNC_DEFINE_STORAGE(block_, 2, 64);\n\
         static struct vmtsync_rec rec_;\n\
         int32_t run_(const void *d, uint32_t len) {\n\
         int32_t s = vmtsync_init(&rec_, block_, sizeof block_, 2, 64, VMTSYNC_MODE_OVERWRITE);\n\
         s |= vmtsync_publish(&rec_, 0, 0, VMTSYNC_CLOCK_RAW_TSC, 0x2400);\n\
         s |= vmtsync_record(&rec_, 1, 7, d, len);\n\
         s |= vmtsync_record(&rec_, 0, 7, d, 8);\n\
         s |= vmtsync_beacon(&rec_, 0);\n\
         s |= vmtsync_span_begin(&rec_, 0, \"phase\") | vmtsync_span_end(&rec_, 0, \"phase\");\n\
         s |= vmtsync_func_enter(&rec_, 0, (void *)d, (void *)d);\n\
         s |= vmtsync_func_exit(&rec_, 0, (void *)d, (void *)d);\n\
         s |= vmtsync_reloc(&rec_, 0, 0xf0000, 0x7fb0000, 0x12345);\n\
         return s | (int32_t)vmtsync_produced(&rec_, 0) | (int32_t)vmtsync_refused(&rec_, 1);\n\
         }\n",
    )
    .unwrap();
    let include = include_dir();
    let src = source();
    let mut built = 0;
    for t in usable_toolchains(&dir) {
        for (k, flags) in flag_sets(&t).into_iter().enumerate() {
            for (name, file, extra) in [
                ("vmtsync", src.as_path(), &[][..]),
                (
                    "vmtsync-hooks",
                    src.as_path(),
                    &["-DVMTSYNC_PROFILE_HOOKS", "-finstrument-functions"][..],
                ),
                ("user", user.as_path(), &[][..]),
            ] {
                let obj = dir.join(format!("{name}-{}-{k}.o", t.name()));
                let mut args = os(&flags);
                args.extend(os(extra));
                args.extend([
                    OsStr::new("-c"),
                    OsStr::new("-I"),
                    include.as_os_str(),
                    file.as_os_str(),
                    OsStr::new("-o"),
                    obj.as_os_str(),
                ]);
                t.compile(&args).unwrap_or_else(|e| panic!("{e}"));
                let undefined = run("nm", &[OsStr::new("-u"), obj.as_os_str()]);
                assert!(
                    undefined.trim().is_empty() || name == "user" && only_vmtsync(&undefined),
                    "{} {flags:?}: {name}.o needs outside symbols:\n{undefined}",
                    t.name()
                );
                let size = run("size", &[obj.as_os_str()]);
                let text = size.lines().nth(1).unwrap_or("").split_whitespace().next();
                eprintln!(
                    "{} {}: {name}.o text {} bytes",
                    t.name(),
                    flags.join(" "),
                    text.unwrap_or("?")
                );
                built += 1;
            }
        }
    }
    eprintln!("{built} objects built");
}

/// Whether every undefined symbol is one of vmtsync.c's own functions (user.c calls them).
fn only_vmtsync(nm: &str) -> bool {
    nm.lines()
        .filter_map(|l| l.split_whitespace().last())
        .all(|s| s.starts_with("vmtsync_"))
}

fn run(cmd: &str, args: &[&OsStr]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e} (binutils: cargo xtask setup)"));
    assert!(out.status.success(), "{cmd} failed");
    String::from_utf8(out.stdout).unwrap()
}

/// docs/memory-layout.md's checksum test vector: this header, published, has these bytes and
/// this CRC-32C.
const VECTOR_NONCE: u64 = 0x0123_4567_89ab_cdef;
const VECTOR_KHZ: u64 = 2_000_000;
const VECTOR_CRC: u32 = 0xda0d_b284;

fn vector_header() -> HeaderLayout {
    HeaderLayout::new(
        &HeaderInfo {
            nonce: VECTOR_NONCE,
            tsc_khz: VECTOR_KHZ,
            clock: ClockKind::RawTsc,
            beacon_port: 0x2400,
        },
        2,
        8,
        Mode::StopWhenFull,
    )
    .published()
}

#[test]
fn the_checksum_test_vector_holds_in_rust_and_c() {
    let h = vector_header();
    let bytes = h.to_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    eprintln!(
        "vector header bytes: {hex}\nvector crc: {:#010x}",
        h.checksum
    );
    assert_eq!(
        checksum(&bytes),
        h.checksum,
        "the published checksum is the CRC"
    );
    assert_eq!(h.checksum, VECTOR_CRC, "the documented test vector");
    assert!(h.is_valid());

    // The C recorder publishes the same 128 bytes.
    let dir = tmp("capi-vector");
    let prog = dir.join("vector.c");
    std::fs::write(
        &prog,
        format!(
            "#include <stdio.h>\n#include \"vmtsync.h\"\n\
             static VMTSYNC_DEFINE_STORAGE(block_, 2, 8);\n\
             int main(void) {{\n\
             struct vmtsync_rec r;\n\
             int i;\n\
             if (vmtsync_init(&r, block_, sizeof block_, 2, 8, 0) != 0) return 1;\n\
             if (vmtsync_publish(&r, {VECTOR_NONCE}ULL, {VECTOR_KHZ}ULL, 0, 0x2400) != 0) return 1;\n\
             for (i = 0; i < 128; i++) printf(\"%02x\", block_[i]);\n\
             return 0;\n}}\n"
        ),
    )
    .unwrap();
    let src = source();
    for t in usable_toolchains(&dir) {
        let exe = dir.join(format!("vector-{}", t.name()));
        t.program(&[&prog, &src], &exe, &[])
            .unwrap_or_else(|e| panic!("{e}"));
        let got = run(exe.to_str().unwrap(), &[]);
        assert_eq!(got, hex, "{}: the C recorder's published header", t.name());
    }
}

/// Publishing with nonce 0 makes a non-zero nonce from the TSC, and the header is valid.
#[test]
fn a_zero_nonce_is_made_from_the_tsc() {
    let dir = tmp("capi-nonce");
    let prog = dir.join("nonce.c");
    // A clock stuck at 0 is the worst case for "never 0".
    std::fs::write(
        &prog,
        "#include <stdio.h>\n#define VMTSYNC_READ_TSC() 0ULL\n#include \"vmtsync.c\"\n\
         static VMTSYNC_DEFINE_STORAGE(block_, 1, 2);\n\
         int main(void) {\n\
         struct vmtsync_rec r;\n\
         int i;\n\
         if (vmtsync_init(&r, block_, sizeof block_, 1, 2, 1) != 0) return 1;\n\
         if (vmtsync_publish(&r, 0, 0, 1, 0) != 0) return 1;\n\
         for (i = 0; i < 128; i++) printf(\"%02x\", block_[i]);\n\
         return 0;\n}\n",
    )
    .unwrap();
    for t in usable_toolchains(&dir) {
        let exe = dir.join(format!("nonce-{}", t.name()));
        t.program(&[&prog], &exe, &[])
            .unwrap_or_else(|e| panic!("{e}"));
        let hex = run(exe.to_str().unwrap(), &[]);
        let bytes: Vec<u8> = (0..128)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let h = HeaderLayout::from_bytes(bytes.as_slice().try_into().unwrap());
        assert!(h.is_valid(), "{}: {h:?}", t.name());
        assert_ne!(h.nonce, 0);
    }
}
