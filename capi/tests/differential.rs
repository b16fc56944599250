//! The C recorder against vmtsync-core's Rust recorder (`MemRecorder`): the same generated call
//! sequences (init shapes, publication, records with every kind of id and payload length 0..=17,
//! beacons, both modes, fills past capacity, several vCPUs and two recorders, counters moved
//! next to a 32-bit carry, span begins and ends, function entries and exits, relocations) must
//! leave the same memory byte for byte, return the same results and do the same port I/O.
//! Function records carry 4-byte addresses from `-m32` code and 8-byte ones from `-m64` code,
//! so the Rust side records `u32`s against the `-m32` builds and `u64`s against the others. The C side is `tests/driver.c`, built with gcc and clang for
//! `-m64` and `-m32` and run as a subprocess per case.

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use vmtsync_capi::{Toolchain, usable_toolchains};
use vmtsync_core::arch::{PortIo, Tsc};
use vmtsync_core::recorder::{
    ClockKind, HeaderInfo, LayoutError, MemRecorder, Mode, RecordError, RingRef, Slot,
};

/// One call of the C API (recorder `r` is 0 or 1).
#[derive(Clone, Debug)]
enum Call {
    Init {
        r: u8,
        vcpus: u32,
        capacity: u32,
        mode: u32,
        len: usize,
        misalign: usize,
    },
    Publish {
        r: u8,
        nonce: u64,
        tsc_khz: u64,
        clock: u32,
        port: u16,
    },
    Record {
        r: u8,
        vcpu: u32,
        id: u16,
        payload: Option<Vec<u8>>,
        len: u32,
    },
    Beacon {
        r: u8,
        vcpu: u32,
    },
    /// A ring header word (0 head, 1 refused, 3 beacons) set as if the ring had run that far.
    Poke {
        r: u8,
        vcpu: u32,
        word: usize,
        value: u64,
    },
    Produced {
        r: u8,
        vcpu: u32,
    },
    Refused {
        r: u8,
        vcpu: u32,
    },
    /// `vmtsync_span_begin` (or `_end`) of a name: its bytes, `None` for a NULL pointer.
    Span {
        r: u8,
        vcpu: u32,
        end: bool,
        name: Option<String>,
    },
    /// `vmtsync_func_enter` (or `_exit`).
    Func {
        r: u8,
        vcpu: u32,
        exit: bool,
        func: u64,
        site: u64,
    },
    Reloc {
        r: u8,
        vcpu: u32,
        link: u64,
        runtime: u64,
        len: u32,
    },
}

impl Call {
    fn line(&self) -> String {
        match self {
            Self::Init {
                r,
                vcpus,
                capacity,
                mode,
                len,
                misalign,
            } => format!("init {r} {vcpus} {capacity} {mode} {len} {misalign}"),
            Self::Publish {
                r,
                nonce,
                tsc_khz,
                clock,
                port,
            } => format!("publish {r} {nonce} {tsc_khz} {clock} {port}"),
            Self::Record {
                r,
                vcpu,
                id,
                payload,
                len,
            } => {
                // The driver reads pairs of hex digits; `-` is a NULL pointer, and `z` (no
                // pair) an empty payload.
                let hex = match payload {
                    None => "-".to_string(),
                    Some(p) if p.is_empty() => "z".to_string(),
                    Some(p) => p.iter().map(|b| format!("{b:02x}")).collect(),
                };
                format!("record {r} {vcpu} {id} {len} {hex}")
            }
            Self::Beacon { r, vcpu } => format!("beacon {r} {vcpu}"),
            Self::Poke {
                r,
                vcpu,
                word,
                value,
            } => format!("poke {r} {vcpu} {word} {value}"),
            Self::Produced { r, vcpu } => format!("produced {r} {vcpu}"),
            Self::Refused { r, vcpu } => format!("refused {r} {vcpu}"),
            Self::Span { r, vcpu, end, name } => {
                let hex = match name {
                    None => "-".to_string(),
                    Some(n) if n.is_empty() => "z".to_string(),
                    Some(n) => n.bytes().map(|b| format!("{b:02x}")).collect(),
                };
                format!("span {r} {vcpu} {} {hex}", u8::from(*end))
            }
            Self::Func {
                r,
                vcpu,
                exit,
                func,
                site,
            } => format!("func {r} {vcpu} {} {func} {site}", u8::from(*exit)),
            Self::Reloc {
                r,
                vcpu,
                link,
                runtime,
                len,
            } => format!("reloc {r} {vcpu} {link} {runtime} {len}"),
        }
    }
}

/// The Rust side's clock: the same sequence as the driver's fake TSC.
struct FakeClock(Cell<u64>);

impl Tsc for FakeClock {
    fn read_ordered(&self) -> u64 {
        self.0.set(self.0.get() + 3);
        self.0.get()
    }
}

/// Port I/O written to the transcript, as the driver logs it.
struct LogPorts<'a>(&'a RefCell<String>);

impl PortIo for LogPorts<'_> {
    fn inb(&self, port: u16) -> u8 {
        writeln!(self.0.borrow_mut(), "in {port}").unwrap();
        0xff
    }
    fn outb(&self, port: u16, value: u8) {
        writeln!(self.0.borrow_mut(), "out {port} {value}").unwrap();
    }
}

/// One Rust recorder's block: slots (one spare so the block can start on 64 bytes), where the
/// block starts, its length, and the shape `init` accepted.
#[derive(Default)]
struct Block {
    slots: Vec<Slot>,
    start: usize,
    len_slots: usize,
    shape: Option<(usize, usize)>,
    port: u16,
}

impl Block {
    /// The block's words as atomics (how a poke or the 0xa5 fill reaches them).
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `Slot` is `repr(C)` of four `AtomicU64` (32 bytes, no padding; core's
        // const asserts pin it), so a slice of n slots is a slice of 4n atomic words with the
        // same lifetime and alignment.
        unsafe {
            std::slice::from_raw_parts(
                self.slots.as_ptr().cast::<AtomicU64>(),
                self.slots.len() * 4,
            )
        }
    }

    fn storage(&self) -> &[Slot] {
        &self.slots[self.start..self.start + self.len_slots]
    }

    fn rec(&self) -> Option<MemRecorder<'_>> {
        let (v, c) = self.shape?;
        MemRecorder::view(self.storage(), v, c).ok()
    }
}

const OK: i32 = 0;

fn layout_status(e: LayoutError) -> i32 {
    match e {
        LayoutError::BadShape => -1,
        LayoutError::TooSmall => -2,
        LayoutError::Misaligned => -3,
        _ => -5,
    }
}

/// `f` on `vcpu`'s ring of `rec`: the C API's per-vCPU calls, which name a missing vCPU first.
fn on<T>(
    rec: &MemRecorder<'_>,
    vcpu: usize,
    f: impl FnOnce(RingRef<'_>) -> Result<T, RecordError>,
) -> Result<T, RecordError> {
    f(rec.ring(vcpu).ok_or(RecordError::NoSuchVcpu)?)
}

fn record_status(r: Result<(), RecordError>) -> i32 {
    match r {
        Ok(()) => OK,
        Err(RecordError::Full) => -6,
        Err(RecordError::PayloadTooLong) => -7,
        Err(RecordError::NoSuchVcpu) => -8,
        Err(RecordError::NoBeaconPort) => -9,
        Err(RecordError::ReservedId) => -10,
        Err(_) => -5,
    }
}

/// The transcript the Rust recorder writes for `calls`; function records with 8-byte addresses
/// when `wide` (as `-m64` code writes them), else 4-byte ones.
fn rust_transcript(calls: &[Call], wide: bool) -> String {
    let out = RefCell::new(String::new());
    let clock = FakeClock(Cell::new(1000));
    let mut blocks = [Block::default(), Block::default()];
    let say = |s: String| writeln!(out.borrow_mut(), "= {s}").unwrap();
    for call in calls {
        match *call {
            Call::Init {
                r,
                vcpus,
                capacity,
                mode,
                len,
                misalign,
            } => {
                let b = &mut blocks[usize::from(r)];
                b.slots = (0..(len + misalign) / 32 + 2)
                    .map(|_| Slot::new())
                    .collect();
                for w in b.words() {
                    w.store(0xa5a5_a5a5_a5a5_a5a5, Ordering::Relaxed);
                }
                let aligned = if (b.slots.as_ptr() as usize).is_multiple_of(64) {
                    0
                } else {
                    1
                };
                b.start = aligned + misalign / 32;
                b.len_slots = len / 32;
                b.shape = None;
                b.port = 0;
                let mode = match mode {
                    0 => Mode::StopWhenFull,
                    1 => Mode::Overwrite,
                    _ => {
                        say("-5".into());
                        continue;
                    }
                };
                let (v, c) = (vcpus as usize, capacity as usize);
                match MemRecorder::init(b.storage(), v, c, mode) {
                    Ok(_) => {
                        b.shape = Some((v, c));
                        say("0".into());
                    }
                    Err(e) => say(layout_status(e).to_string()),
                }
            }
            Call::Publish {
                r,
                nonce,
                tsc_khz,
                clock: kind,
                port,
            } => {
                let b = &mut blocks[usize::from(r)];
                let Some(rec) = b.rec() else {
                    say("-4".into());
                    continue;
                };
                let clock = match kind {
                    0 => ClockKind::RawTsc,
                    1 => ClockKind::Other,
                    _ => {
                        say("-5".into());
                        continue;
                    }
                };
                rec.publish(&HeaderInfo {
                    nonce,
                    tsc_khz,
                    clock,
                    beacon_port: port,
                });
                b.port = port;
                say("0".into());
            }
            Call::Record {
                r,
                vcpu,
                id,
                ref payload,
                len,
            } => {
                let Some(rec) = blocks[usize::from(r)].rec() else {
                    say("-4".into());
                    continue;
                };
                // The Rust recorder decides every status (its own order of checks: vCPU, id,
                // length, full), except for a NULL payload pointer, which Rust has no way to
                // pass: the C API's checks before it are the same three.
                let status = match payload {
                    Some(p) => record_status(on(&rec, vcpu as usize, |r| r.record(&clock, id, p))),
                    None if len == 0 => {
                        record_status(on(&rec, vcpu as usize, |r| r.record(&clock, id, &[])))
                    }
                    None if vcpu as usize >= rec.vcpus() => -8,
                    None if id >= 0xff00 => -10,
                    None if len > 16 => -7,
                    None => -5,
                };
                say(status.to_string());
            }
            Call::Beacon { r, vcpu } => {
                let b = &blocks[usize::from(r)];
                let Some(rec) = b.rec() else {
                    say("-4".into());
                    continue;
                };
                let status = record_status(
                    on(&rec, vcpu as usize, |r| {
                        let port = rec.beacon_port().ok_or(RecordError::NoBeaconPort)?;
                        r.beacon(&clock, &LogPorts(&out), port)
                    })
                    .map(|_| ()),
                );
                say(status.to_string());
            }
            Call::Poke {
                r,
                vcpu,
                word,
                value,
            } => {
                let b = &blocks[usize::from(r)];
                if let Some((v, c)) = b.shape
                    && (vcpu as usize) < v
                {
                    let at = (b.start * 32 + 128 + vcpu as usize * (128 + 32 * c)) / 8 + word;
                    b.words()[at].store(value, Ordering::Relaxed);
                }
                say("poked".into());
            }
            Call::Produced { r, vcpu } => {
                let n = blocks[usize::from(r)]
                    .rec()
                    .and_then(|rec| rec.ring(vcpu as usize))
                    .map_or(0, |ring| ring.end());
                say(n.to_string());
            }
            Call::Refused { r, vcpu } => {
                let n = blocks[usize::from(r)]
                    .rec()
                    .and_then(|rec| rec.ring(vcpu as usize))
                    .map_or(0, |ring| ring.refused());
                say(n.to_string());
            }
            Call::Span {
                r,
                vcpu,
                end,
                ref name,
            } => {
                let Some(rec) = blocks[usize::from(r)].rec() else {
                    say("-4".into());
                    continue;
                };
                let v = vcpu as usize;
                // C takes a NUL-terminated string: its name ends at the first NUL. A NULL
                // pointer (Rust has none) is refused after the vCPU check, like an empty name.
                let status = match name.as_deref().map(|n| n.split('\0').next().unwrap_or("")) {
                    Some(n) if end => record_status(on(&rec, v, |r| r.span_end(&clock, n))),
                    Some(n) => record_status(on(&rec, v, |r| r.span_begin(&clock, n))),
                    None if v >= rec.vcpus() => -8,
                    None => -5,
                };
                say(status.to_string());
            }
            Call::Func {
                r,
                vcpu,
                exit,
                func,
                site,
            } => {
                let Some(rec) = blocks[usize::from(r)].rec() else {
                    say("-4".into());
                    continue;
                };
                let v = vcpu as usize;
                // `-m32` code passes 32-bit pointers: the C driver's casts keep the low half.
                #[allow(clippy::cast_possible_truncation)]
                let (f32, s32) = (func as u32, site as u32);
                let status = match (exit, wide) {
                    (false, true) => on(&rec, v, |r| r.func_entry(&clock, func, site)),
                    (true, true) => on(&rec, v, |r| r.func_exit(&clock, func, site)),
                    (false, false) => on(&rec, v, |r| r.func_entry(&clock, f32, s32)),
                    (true, false) => on(&rec, v, |r| r.func_exit(&clock, f32, s32)),
                };
                say(record_status(status).to_string());
            }
            Call::Reloc {
                r,
                vcpu,
                link,
                runtime,
                len,
            } => {
                let Some(rec) = blocks[usize::from(r)].rec() else {
                    say("-4".into());
                    continue;
                };
                say(record_status(on(&rec, vcpu as usize, |r| {
                    r.reloc(&clock, link, runtime, len)
                }))
                .to_string());
            }
        }
    }
    let mut out = out.into_inner();
    for (k, b) in blocks.iter().enumerate() {
        write!(out, "mem {k} ").unwrap();
        if !b.slots.is_empty() {
            let words = b.words();
            for w in &words[b.start * 4..(b.start + b.len_slots) * 4] {
                for byte in w.load(Ordering::Relaxed).to_le_bytes() {
                    write!(out, "{byte:02x}").unwrap();
                }
            }
        }
        out.push('\n');
    }
    out
}

/// The driver built by every usable toolchain (once per test binary).
fn drivers() -> &'static [(Toolchain, PathBuf)] {
    static DRIVERS: OnceLock<Vec<(Toolchain, PathBuf)>> = OnceLock::new();
    DRIVERS.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-differential");
        std::fs::create_dir_all(&dir).unwrap();
        let driver_c = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/driver.c");
        usable_toolchains(&dir)
            .into_iter()
            .map(|t| {
                let exe = dir.join(format!("driver-{}", t.name()));
                t.program(&[&driver_c], &exe, &[])
                    .unwrap_or_else(|e| panic!("{e}"));
                (t, exe)
            })
            .collect()
    })
}

fn c_transcript(exe: &PathBuf, input: &str) -> String {
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "driver {} failed", exe.display());
    String::from_utf8(out.stdout).unwrap()
}

/// Asserts that every C build leaves what the Rust recorder leaves.
fn compare(calls: &[Call]) -> Result<(), TestCaseError> {
    let input: String = calls.iter().map(|c| c.line() + "\n").collect();
    let wants = [rust_transcript(calls, false), rust_transcript(calls, true)];
    for (t, exe) in drivers() {
        let want = &wants[usize::from(t.abi == "-m64")];
        let got = c_transcript(exe, &input);
        if got != *want {
            let first = got
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(TestCaseError::fail(format!(
                "{} differs from Rust at transcript line {first}:\n C:    {}\n Rust: {}\ninput:\n{input}",
                t.name(),
                got.lines().nth(first).unwrap_or("<end>"),
                want.lines().nth(first).unwrap_or("<end>"),
            )));
        }
    }
    Ok(())
}

fn id() -> impl Strategy<Value = u16> {
    prop_oneof![
        Just(0u16),
        1u16..0xff00,
        Just(0xfeffu16),
        Just(0xff00u16),
        Just(0xffffu16),
        any::<u16>(),
    ]
}

/// Span names: empty, short, 16 bytes, longer (cut at 16, also inside a UTF-8 character),
/// with an occasional NUL (where C's name ends).
fn span_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z_]{1,20}",
        "[a-zé\\x{1F600}]{1,12}",
        "[a-z]{0,5}\\x00[a-z]{0,5}",
    ]
}

/// Addresses: 32-bit ones, canonical 64-bit ones from both halves, and any (relocations
/// refuse the non-canonical ones).
fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..0x1_0000_0000,
        0u64..0x8000_0000_0000,
        0xffff_8000_0000_0000u64..,
        any::<u64>(),
    ]
}

fn call(r_max: u8, vcpus: u32) -> impl Strategy<Value = Call> {
    let r = 0..=r_max;
    let v = 0..vcpus + 1;
    prop_oneof![
        8 => (r.clone(), v.clone(), id(), 0u32..=17, prop::collection::vec(any::<u8>(), 17), prop::bool::weighted(0.03))
            .prop_map(|(r, vcpu, id, len, bytes, null)| Call::Record {
                r, vcpu, id, len, payload: (!null).then(|| bytes[..len as usize].to_vec()),
            }),
        2 => (r.clone(), v.clone()).prop_map(|(r, vcpu)| Call::Beacon { r, vcpu }),
        1 => (r.clone(), 1u64.., any::<u64>(), 0u32..=2, prop_oneof![Just(0u16), Just(0x2400u16), any::<u16>()])
            .prop_map(|(r, nonce, tsc_khz, clock, port)| Call::Publish { r, nonce, tsc_khz, clock, port }),
        1 => (r.clone(), v.clone(), prop_oneof![Just(0usize), Just(1), Just(3)],
              prop_oneof![(0xffff_fff0u64..0x1_0000_0000), (0xff_ffff_fff0u64..0x100_0000_0000), 0u64..64])
            .prop_map(|(r, vcpu, word, value)| Call::Poke { r, vcpu, word, value }),
        1 => (r.clone(), v.clone()).prop_map(|(r, vcpu)| Call::Produced { r, vcpu }),
        1 => (r.clone(), v.clone()).prop_map(|(r, vcpu)| Call::Refused { r, vcpu }),
        2 => (r.clone(), v.clone(), any::<bool>(), prop::option::weighted(0.95, span_name()))
            .prop_map(|(r, vcpu, end, name)| Call::Span { r, vcpu, end, name }),
        3 => (r.clone(), v.clone(), any::<bool>(), addr(), addr())
            .prop_map(|(r, vcpu, exit, func, site)| Call::Func { r, vcpu, exit, func, site }),
        1 => (r, v, addr(), addr(), any::<u32>())
            .prop_map(|(r, vcpu, link, runtime, len)| Call::Reloc { r, vcpu, link, runtime, len }),
    ]
}

/// A sequence: both recorders initialised (mostly valid shapes), then calls.
fn sequence() -> impl Strategy<Value = Vec<Call>> {
    let shape = (1u32..=3, 1u32..=4, 0u32..=1);
    (
        shape.clone(),
        shape,
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.05),
    )
        .prop_flat_map(|((v0, c0, m0), (v1, c1, m1), short, misaligned)| {
            let size = |v: u32, c: u32| 128 + v as usize * (128 + 32 * (1usize << c));
            let init0 = Call::Init {
                r: 0,
                vcpus: v0,
                capacity: 1 << c0,
                mode: m0,
                len: size(v0, c0) - if short { 32 } else { 0 },
                misalign: if misaligned { 32 } else { 0 },
            };
            let init1 = Call::Init {
                r: 1,
                vcpus: v1,
                capacity: 1 << c1,
                mode: m1,
                len: size(v1, c1),
                misalign: 0,
            };
            prop::collection::vec(call(1, v0.max(v1)), 0..120).prop_map(move |mut calls| {
                calls.insert(0, init1.clone());
                calls.insert(0, init0.clone());
                calls
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_c_recorder_leaves_the_rust_recorders_bytes(calls in sequence()) {
        compare(&calls)?;
    }
}

/// Shapes and arguments init must refuse, with the same status on both sides.
#[test]
fn init_refuses_what_the_rust_recorder_refuses() {
    let mut calls = Vec::new();
    for (vcpus, capacity, mode) in [
        (0, 4, 0),
        (1025, 4, 0),
        (1, 3, 0),
        (1, 1, 0),
        (1, 0, 0),
        (1, 4, 2),
        (1, 1 << 31, 0),
    ] {
        calls.push(Call::Init {
            r: 0,
            vcpus,
            capacity,
            mode,
            len: 128 + 128 + 32 * 4,
            misalign: 0,
        });
    }
    calls.push(Call::Init {
        r: 1,
        vcpus: 1,
        capacity: 4,
        mode: 0,
        len: 128 + 128 + 32 * 4,
        misalign: 32,
    });
    // Nothing initialised: every call refuses.
    calls.push(Call::Publish {
        r: 0,
        nonce: 1,
        tsc_khz: 0,
        clock: 0,
        port: 0,
    });
    calls.push(Call::Record {
        r: 0,
        vcpu: 0,
        id: 1,
        payload: None,
        len: 0,
    });
    calls.push(Call::Beacon { r: 1, vcpu: 0 });
    compare(&calls).unwrap();
}

/// Head, refused and the beacon count cross a 32-bit carry (on i386 the one store that is a
/// `lock cmpxchg8b`), in both modes, with the same bytes as the Rust recorder.
#[test]
fn counters_carry_into_their_high_half_alike() {
    for mode in [0, 1] {
        let mut calls = vec![
            Call::Init {
                r: 0,
                vcpus: 2,
                capacity: 4,
                mode,
                len: 128 + 2 * (128 + 32 * 4),
                misalign: 0,
            },
            Call::Publish {
                r: 0,
                nonce: 9,
                tsc_khz: 1,
                clock: 0,
                port: 0x2400,
            },
        ];
        for (word, value) in [(0usize, 0xffff_fffeu64), (1, 0xffff_ffff), (3, 0xffff_ffff)] {
            calls.push(Call::Poke {
                r: 0,
                vcpu: 1,
                word,
                value,
            });
        }
        for _ in 0..3 {
            calls.push(Call::Record {
                r: 0,
                vcpu: 1,
                id: 3,
                payload: Some(vec![1, 2, 3]),
                len: 3,
            });
            calls.push(Call::Beacon { r: 0, vcpu: 1 });
        }
        calls.push(Call::Produced { r: 0, vcpu: 1 });
        calls.push(Call::Refused { r: 0, vcpu: 1 });
        // The carries happened: stop-when-full refuses all six (the ring looks full), flight
        // stores them.
        let rust = rust_transcript(&calls, true);
        let last: Vec<&str> = rust.lines().rev().skip(2).take(2).collect();
        let (produced, refused) = if mode == 0 {
            (0xffff_fffe_u64, 0xffff_ffff_u64 + 6)
        } else {
            (0xffff_fffe + 6, 0xffff_ffff)
        };
        assert_eq!(
            last,
            [format!("= {refused}"), format!("= {produced}")],
            "{rust}"
        );
        // The beacon count crossed its carry: sequence bytes 255, 0, 1.
        let outs: Vec<&str> = rust.lines().filter(|l| l.starts_with("out ")).collect();
        assert_eq!(outs, ["out 9216 255", "out 9216 0", "out 9216 1"], "{rust}");
        compare(&calls).unwrap();
    }
}

/// Every span call with a fixed sequence on both ABIs: names cut at 16 bytes, at a NUL, and
/// refused when empty or NULL; 32- and 64-bit function addresses; relocations at the edges of
/// the canonical range; a full stop-when-full ring refusing and counting them.
#[test]
fn span_records_match_byte_for_byte() {
    let mut calls = vec![Call::Init {
        r: 0,
        vcpus: 2,
        capacity: 8,
        mode: 0,
        len: 128 + 2 * (128 + 32 * 8),
        misalign: 0,
    }];
    for (end, name) in [
        (false, Some("post")),
        (true, Some("a_phase_name_longer_than_16")),
        (false, Some("")),
        (true, None),
        (false, Some("ab\0cd")),
    ] {
        calls.push(Call::Span {
            r: 0,
            vcpu: 1,
            end,
            name: name.map(str::to_owned),
        });
    }
    for (exit, func, site) in [
        (false, 0x000f_1234, 0x000f_0010),
        (true, 0xffff_ffff_8100_0000, 0x7fff_ffff_ffff),
    ] {
        calls.push(Call::Func {
            r: 0,
            vcpu: 1,
            exit,
            func,
            site,
        });
    }
    for (link, runtime) in [
        (0x000f_0000, 0x07fb_0000),
        (0xffff_8000_0000_0000, 0x7fff_ffff_ffff),
        (0x8000_0000_0000, 0),
    ] {
        calls.push(Call::Reloc {
            r: 0,
            vcpu: 1,
            link,
            runtime,
            len: 0x1_2345,
        });
    }
    // Ring 1 holds 8: four more fill it, the rest are refused and counted.
    for _ in 0..6 {
        calls.push(Call::Func {
            r: 0,
            vcpu: 1,
            exit: false,
            func: 1,
            site: 2,
        });
    }
    calls.push(Call::Span {
        r: 0,
        vcpu: 2,
        end: false,
        name: Some("x".into()),
    });
    calls.push(Call::Produced { r: 0, vcpu: 1 });
    calls.push(Call::Refused { r: 0, vcpu: 1 });
    let rust = rust_transcript(&calls, false);
    let results: Vec<&str> = rust.lines().filter(|l| l.starts_with("= ")).collect();
    assert_eq!(
        results[1..],
        [
            "= 0", "= 0", "= -5", "= -5", "= 0", // the spans
            "= 0", "= 0", // the functions
            "= 0", "= 0", "= -5", // the relocations
            "= 0", "= -6", "= -6", "= -6", "= -6", "= -6", // a full ring
            "= -8", "= 8", "= 5",
        ],
        "{rust}"
    );
    compare(&calls).unwrap();
}
