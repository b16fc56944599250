//! The committed seed corpora of the fuzz targets (`core/fuzz/seeds/<target>/`,
//! `host-shim/fuzz/seeds/<target>/`) are real encodings: this test generates them from the
//! encoders themselves (the core's frames, a real `ProbeSession` against the core's agent
//! state machine, the sync-file writer) and fails when a committed seed differs, so a wire or
//! format change cannot leave the fuzzers starting from stale inputs. The recorded session's
//! TSC readings follow the host TSC (the session checks replies against its own clock), so
//! those seeds are compared message by message with the readings masked.
//!
//! Regenerate after such a change with
//! `VMTSYNC_WRITE_FUZZ_SEEDS=1 cargo test -p vmtsync --test fuzz_seeds`.
//!
//! Every seed starts with the targets' control byte: low 6 bits the chunk size minus one, top
//! bit "rewrite checksums" (see the targets' docs). The guestmem seeds start with that
//! target's own two control bytes instead (see its docs).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use vmtsync::link::transport::host_tsc_now;
use vmtsync::link::{Received, StampedTransport, TransportError};
use vmtsync::probe::ProbeSession;
use vmtsync::syncfile::{OffsetModel, SyncHeader, SyncSegment, SyncWriter};
use vmtsync_core::agent::fake::FakeLink;
use vmtsync_core::agent::{Agent, AgentClock};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::proto::{
    Capabilities, ErrorCode, EventBatch, EventClock, Features, Feed, FrameReceiver, Hello,
    MAX_FRAME_SIZE, MappingPush, Message, PROTOCOL_VERSION, ProbeReply, ProbeReplyFull,
    PvclockReport, Transport, encode_frame,
};
use vmtsync_core::{GuestTicks, HostTicks};

/// Whole chunks, checksums as they are.
const PLAIN: u8 = 0x3f;
/// 7-byte chunks, checksums rewritten.
const RESEAL_CHUNK7: u8 = 0x80 | 6;

/// A guest clock equal to the host TSC plus `skew`: the recorded session's agent reads the
/// same clock the host stamps with, so its replies unwrap in the session's verified window.
#[derive(Clone, Copy, Debug)]
struct SkewedClock {
    skew: i64,
    vcpu: u32,
}

impl AgentClock for SkewedClock {
    fn read_tsc(&mut self) -> GuestTicks {
        GuestTicks(host_tsc_now().0.wrapping_add_signed(self.skew))
    }

    fn vcpu_id(&self) -> u32 {
        self.vcpu
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn frame(msg: &Message) -> Vec<u8> {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    encode_frame(msg, &mut buf).expect("encodes").to_vec()
}

fn with_control(control: u8, stream: &[u8]) -> Vec<u8> {
    let mut v = vec![control];
    v.extend_from_slice(stream);
    v
}

/// `stream` as two seeds: `name` in whole chunks, and `name-resealed-chunk7` in 7-byte chunks
/// with the checksums rewritten.
fn plain_and_resealed(name: &str, stream: &[u8]) -> [(String, Vec<u8>); 2] {
    [
        (name.to_owned(), with_control(PLAIN, stream)),
        (
            format!("{name}-resealed-chunk7"),
            with_control(RESEAL_CHUNK7, stream),
        ),
    ]
}

/// One message of every kind, with realistic values.
fn every_message() -> Vec<(&'static str, Message)> {
    let mapping = KvmTscMapping::try_new(-123_456_789, (1 << 48) + 777, 48).expect("valid");
    let base = 0x2000_0000_0000_u64;
    let mut batch = EventBatch::new(0, EventClock::Guest, base);
    batch.dropped = 1;
    batch.last = true;
    assert!(batch.push(base, base, 1, &[]));
    assert!(batch.push(base, base + 2600, 7, &[0xaa, 0x00, 0x55]));
    assert!(batch.push(base + 2600, base + 2500, 300, &[]));
    vec![
        (
            "hello",
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: Features::EVENTS.union(Features::MAPPING),
            }),
        ),
        (
            "capabilities",
            Message::Capabilities(Capabilities {
                version: PROTOCOL_VERSION,
                transport: Transport::Uart16550,
                features: Features::PVCLOCK.union(Features::EVENTS),
                vcpu: 0,
                tsc: GuestTicks(0x2000_1234_5678),
                tsc_khz: Some(2_995_200),
            }),
        ),
        ("probe", Message::Probe { seq: 200 }),
        (
            "probe-reply",
            Message::ProbeReply(ProbeReply {
                seq: 200,
                vcpu: 0,
                tsc_low32: 0x1234_5678,
            }),
        ),
        ("probe-full", Message::ProbeFull { seq: 0 }),
        (
            "probe-reply-full",
            Message::ProbeReplyFull(ProbeReplyFull {
                seq: 0,
                vcpu: 0,
                tsc: 0x2000_1234_5678,
            }),
        ),
        (
            "set-mapping",
            Message::SetMapping(MappingPush { vcpu: 0, mapping }),
        ),
        ("mapping-applied", Message::MappingApplied { vcpu: 0 }),
        ("pvclock-request", Message::PvclockRequest),
        (
            "pvclock-report",
            Message::PvclockReport(PvclockReport {
                vcpu: 0,
                version: 4,
                tsc_timestamp: 0x2000_0000_0000,
                system_time: 123_456_789_000,
                mul: 0xa6f3_b2c1,
                shift: -1,
                flags: 1,
                tsc: GuestTicks(0x2000_0001_0000),
            }),
        ),
        ("events-request", Message::EventsRequest { max: 8 }),
        ("events", Message::Events(batch)),
        ("shutdown", Message::Shutdown),
        ("exiting", Message::Exiting),
        ("error", Message::Error(ErrorCode::NotReady)),
        (
            "probe-on",
            Message::ProbeOn {
                seq: 200,
                vcpu: 2,
                full: false,
            },
        ),
        ("vcpus-request", Message::VcpusRequest),
        ("vcpus", Message::Vcpus { online: 0xf }),
    ]
}

/// A [`StampedTransport`] into the core's agent state machine over its fake link, recording
/// every byte the agent sends.
struct AgentTransport {
    agent: Agent<FakeLink, SkewedClock>,
    recorded: Rc<RefCell<Vec<u8>>>,
}

impl StampedTransport for AgentTransport {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        let stamp = host_tsc_now();
        if !self.agent.link_mut().push_inbound(frame) {
            return Err(TransportError::Closed);
        }
        self.agent.poll().map_err(|_| TransportError::Closed)?;
        Ok(stamp)
    }

    fn recv(&mut self, buf: &mut [u8], _deadline: Instant) -> Result<Received, TransportError> {
        let mut frame = [0u8; MAX_FRAME_SIZE];
        let n = self
            .agent
            .link_mut()
            .next_sent_frame(&mut frame)
            .ok_or(TransportError::Closed)?;
        assert!(n <= buf.len() && n <= MAX_FRAME_SIZE);
        buf[..n].copy_from_slice(&frame[..n]);
        self.recorded.borrow_mut().extend_from_slice(&frame[..n]);
        Ok(Received {
            len: n,
            stamp: host_tsc_now(),
        })
    }
}

/// What the agent sends during a real `ProbeSession`: capabilities, compact probes, a
/// full-width probe after the reference is dropped, and the exit.
fn recorded_session() -> Vec<u8> {
    let recorded = Rc::new(RefCell::new(Vec::new()));
    let transport = AgentTransport {
        agent: Agent::new(
            FakeLink::new(),
            SkewedClock {
                skew: 1_000_000_007,
                vcpu: 0,
            },
        ),
        recorded: Rc::clone(&recorded),
    };
    let mut s = ProbeSession::hello(transport, Duration::from_secs(5)).expect("hello");
    for _ in 0..6 {
        assert!(s.probe().expect("probe").is_some());
    }
    s.forget_reference();
    for _ in 0..2 {
        assert!(s.probe().expect("probe").is_some());
    }
    s.shutdown();
    recorded.take()
}

fn sync_file() -> Vec<u8> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("seed.sync");
    let header = SyncHeader {
        schema: 1,
        tool: "vmtsync 0.1.0".into(),
        host_clock: "x86-tsc".into(),
        created_unix_s: 1_764_576_000,
        source: "unix:/run/agent.sock".into(),
    };
    let mut w = SyncWriter::open(&path, &header).expect("open");
    let host = 0x2000_0000_0000_u64;
    let segment = |vcpu, round, host_anchor: u64, offset: i64, drift_ppb, is_break| SyncSegment {
        vcpu,
        round,
        guest_start: host_anchor.wrapping_add_signed(offset) - 1_000_000,
        host_anchor,
        guest_anchor: host_anchor.wrapping_add_signed(offset),
        offset,
        offset_lo: offset - 1500,
        offset_hi: offset + 1500,
        drift_ppb,
        drift_ppb_lo: (drift_ppb != 0).then_some(drift_ppb - 50),
        drift_ppb_hi: (drift_ppb != 0).then_some(drift_ppb + 50),
        model: if drift_ppb == 0 {
            OffsetModel::Offset
        } else {
            OffsetModel::Drift
        },
        probes: 64,
        rtt_min_ticks: 2900,
        host_first: host_anchor - 200_000,
        host_last: host_anchor + 200_000,
        is_break,
        anchor: vmtsync::syncfile::AnchorKind::InProcess,
    };
    for seg in [
        segment(0, 0, host, -3_000_000, 0, false),
        segment(0, 1, host + 3_000_000_000, -3_000_000, 120, false),
        segment(0, 2, host + 6_000_000_000, 5_000_000, 0, true),
        segment(1, 0, host + 10_000, -3_000_000, 0, false),
    ] {
        w.append(&seg).expect("append");
    }
    std::fs::read(&path).expect("read back")
}

/// A small trace.dat from our writer: two vCPUs, events with and without payloads across a
/// time extend, a TIME_SHIFT of two segments per CPU.
fn trace_dat(version: vmtsync::formats::tracedat::FileVersion) -> Vec<u8> {
    use vmtsync::formats::tracedat::{
        ShiftMode, SyncSegment as Seg, TimeShift, TraceDatWriter, WriterOptions,
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("seed.dat");
    let mut o = WriterOptions::new(2, 0x5eed);
    o.version = version;
    o.uname = Some("vmtsync fuzz seed".into());
    let mut w = TraceDatWriter::create(&path, o).expect("create");
    for i in 0..40u64 {
        // A jump of 2^40 ticks halfway: a time extend.
        let ts = 1_000_000 + i * 2_600 + if i >= 20 { 1 << 40 } else { 0 };
        let payload = i.to_le_bytes();
        let len = usize::try_from(i % 9).expect("small");
        w.push(u32::try_from(i % 2).expect("small"), ts, 7, &payload[..len])
            .expect("push");
    }
    let segs = vec![
        Seg::offset_only(HostTicks(500_000), 500),
        Seg::offset_only(HostTicks(1_050_000), 700),
    ];
    let shift = TimeShift {
        peer_trace_id: 0xabcd,
        mode: ShiftMode::Step,
        cpus: vec![segs.clone(), segs],
    };
    w.finish(Some(&shift)).expect("finish");
    std::fs::read(&path).expect("read back")
}

/// A clock for the recorder seeds: 1000 ticks a read.
struct StepTsc(std::cell::Cell<u64>);

impl vmtsync_core::arch::Tsc for StepTsc {
    fn read_ordered(&self) -> u64 {
        let t = self.0.get() + 1000;
        self.0.set(t);
        t
    }
}

/// A published core recorder's bytes after `records` events per ring, with the guestmem
/// target's control bytes (round bound 4, then `stores` guest stores) in front.
fn guest_memory(flight: bool, records: u64, stores: &[(u32, u64)]) -> Vec<u8> {
    use vmtsync_core::recorder::{ClockKind, HeaderInfo, Recorder};
    let rec: Recorder<2, 4> = if flight {
        Recorder::new_flight()
    } else {
        Recorder::new()
    };
    rec.publish(&HeaderInfo {
        nonce: 0x16,
        tsc_khz: 2_000_000,
        clock: ClockKind::RawTsc,
        beacon_port: 0x510,
    });
    let tsc = StepTsc(std::cell::Cell::new(0));
    for n in 0..records {
        for vcpu in 0..2 {
            let _ = rec
                .ring(vcpu)
                .expect("two rings")
                .record(&tsc, 7, &n.to_le_bytes());
        }
    }
    let mut out = vec![4, u8::try_from(stores.len()).expect("few stores")];
    for (off, v) in stores {
        out.extend_from_slice(&off.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    let mut image = vec![0u8; 128 + 2 * (128 + 32 * 4)];
    assert_eq!(rec.copy_bytes(&mut image), image.len());
    out.extend_from_slice(&image);
    out
}

/// Every seed file, by path relative to the workspace root.
fn seeds() -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut put = |dir: &str, name: &str, bytes: Vec<u8>| {
        out.insert(Path::new(dir).join(name), bytes);
    };
    let all: Vec<u8> = every_message().iter().flat_map(|(_, m)| frame(m)).collect();
    for (name, msg) in every_message() {
        put(
            "core/fuzz/seeds/decode",
            name,
            with_control(PLAIN, &frame(&msg)),
        );
    }
    for (name, bytes) in plain_and_resealed("all", &all) {
        put("core/fuzz/seeds/decode", &name, bytes);
    }

    // The agent target says hello itself; these are a session's requests after it.
    let requests: Vec<u8> = every_message()
        .iter()
        .filter(|(n, _)| {
            [
                "probe",
                "probe-full",
                "set-mapping",
                "pvclock-request",
                "events-request",
            ]
            .contains(n)
        })
        .flat_map(|(_, m)| frame(m))
        .chain(frame(&Message::Shutdown))
        .collect();
    for (name, bytes) in plain_and_resealed("requests", &requests) {
        put("core/fuzz/seeds/agent", &name, bytes);
    }

    let session = recorded_session();
    for (name, bytes) in plain_and_resealed("agent-replies", &session) {
        put("host-shim/fuzz/seeds/session", &name, bytes);
    }

    put("host-shim/fuzz/seeds/syncfile", "two-vcpus", sync_file());
    put(
        "host-shim/fuzz/seeds/guestmem",
        "flight-lapped",
        guest_memory(true, 6, &[]),
    );
    put(
        "host-shim/fuzz/seeds/guestmem",
        "stop-full",
        guest_memory(false, 6, &[]),
    );
    // Ring 0's head moved on, then a slot's meta rewritten, while the reader reads.
    put(
        "host-shim/fuzz/seeds/guestmem",
        "flight-racing",
        guest_memory(true, 3, &[(128, 9), (256, 0)]),
    );
    put(
        "host-shim/fuzz/seeds/tracedat",
        "v7",
        trace_dat(vmtsync::formats::tracedat::FileVersion::V7),
    );
    put(
        "host-shim/fuzz/seeds/tracedat",
        "v6",
        trace_dat(vmtsync::formats::tracedat::FileVersion::V6),
    );
    // What `trace-cmd extract` writes here: zstd sections and chunked CPU data (the reader's
    // fixture, made by trace-cmd 3.1.6 itself).
    put(
        "host-shim/fuzz/seeds/tracedat",
        "v7-zstd",
        include_bytes!("../src/formats/tracedat/reader/fixtures/sample-v7-zstd.dat").to_vec(),
    );

    for (name, contents) in [
        ("tsc-offset", &b"-3000000000000\n"[..]),
        ("tsc-offset-min", b"-9223372036854775808\n"),
        ("tsc-scaling-ratio", b"281474976710656\n"),
        ("tsc-scaling-ratio-frac-bits", b"48\n"),
        ("u64-max", b"18446744073709551615\n"),
        ("vm-dir", b"1234-11"),
        ("vcpu-dir", b"vcpu3"),
    ] {
        put("host-shim/fuzz/seeds/debugfs", name, contents.to_vec());
    }
    out
}

/// The messages of a recorded stream with every TSC reading zeroed (`None` for a frame that
/// does not decode).
fn masked_messages(stream: &[u8]) -> Vec<Option<Message>> {
    let mut rx = FrameReceiver::new();
    let mut out = Vec::new();
    let mut input = stream;
    loop {
        match rx.feed(input) {
            Feed::Consumed => break,
            Feed::Message { mut msg, rest } => {
                match &mut msg {
                    Message::Capabilities(c) => c.tsc = GuestTicks(0),
                    Message::ProbeReply(r) => r.tsc_low32 = 0,
                    Message::ProbeReplyFull(r) => r.tsc = 0,
                    _ => {}
                }
                out.push(Some(msg));
                input = rest;
            }
            Feed::Error { rest, .. } => {
                out.push(None);
                input = rest;
            }
        }
    }
    out
}

#[test]
fn fuzz_seeds_are_generated_from_current_encodings() {
    let root = root();
    let seeds = seeds();
    let dirs: std::collections::BTreeSet<PathBuf> = seeds
        .keys()
        .filter_map(|p| p.parent().map(Path::to_path_buf))
        .collect();
    let write = std::env::var_os("VMTSYNC_WRITE_FUZZ_SEEDS").is_some();
    let mut stale = Vec::new();
    for dir in &dirs {
        let dir = root.join(dir);
        if write {
            // Drop seeds no longer generated.
            if dir.exists() {
                std::fs::remove_dir_all(&dir).expect("remove old seeds");
            }
            std::fs::create_dir_all(&dir).expect("create seed dir");
        }
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let rel = entry
                .path()
                .strip_prefix(&root)
                .expect("under root")
                .to_path_buf();
            if !seeds.contains_key(&rel) {
                stale.push(format!("{} is not generated", rel.display()));
            }
        }
    }
    for (rel, bytes) in &seeds {
        let path = root.join(rel);
        if write {
            std::fs::write(&path, bytes).expect("write seed");
        }
        let same = |on_disk: &[u8]| {
            if rel.starts_with("host-shim/fuzz/seeds/session") {
                on_disk.first() == bytes.first()
                    && masked_messages(&on_disk[1..]) == masked_messages(&bytes[1..])
            } else {
                on_disk == bytes.as_slice()
            }
        };
        match std::fs::read(&path) {
            Ok(on_disk) if same(&on_disk) => {}
            Ok(_) => stale.push(format!("{} differs", rel.display())),
            Err(e) => stale.push(format!("{}: {e}", rel.display())),
        }
    }
    assert!(
        stale.is_empty(),
        "fuzz seeds are stale: {stale:#?}\nregenerate with \
         VMTSYNC_WRITE_FUZZ_SEEDS=1 cargo test -p vmtsync --test fuzz_seeds"
    );
    println!(
        "{} fuzz seeds in {} directories are current",
        seeds.len(),
        dirs.len()
    );
}
