//! The few Perfetto trace messages vmtsync writes, as hand-written prost structs (no protoc).
//!
//! Field numbers and types follow Perfetto's `protos/perfetto/trace/` (proto2): `trace.proto`,
//! `trace_packet.proto`, `clock_snapshot.proto`, `trace_packet_defaults.proto`,
//! `interned_data/interned_data.proto` and `track_event/{track_event,track_descriptor,
//! process_descriptor,debug_annotation}.proto`. Only the fields vmtsync sets are declared; a
//! reader skips nothing it needs, and fields that form a `oneof` upstream (a packet's payload,
//! an annotation's value) are separate `optional`s here, which is the same wire format as long
//! as at most one is set, as the writer does.

use prost::Message;

/// `Trace.packet` is field 1: a file is these packets, each as a length-delimited field 1, so
/// packets can be appended one by one and the concatenation of two traces is a trace.
pub const TRACE_PACKET_FIELD: u32 = 1;

/// `BuiltinClock.BUILTIN_CLOCK_BOOTTIME` (`common/builtin_clock.proto`): the default trace
/// clock, CLOCK_BOOTTIME in ns.
pub const CLOCK_BOOTTIME: u32 = 6;

/// The first sequence-scoped clock id (`ClockSnapshot.Clock.clock_id` 64..127 are valid only on
/// the packet sequence that emitted the snapshot). vmtsync names the host TSC with it.
pub const CLOCK_HOST_TSC: u32 = 64;

/// `TracePacket.SequenceFlags.SEQ_INCREMENTAL_STATE_CLEARED`.
pub const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
/// `TracePacket.SequenceFlags.SEQ_NEEDS_INCREMENTAL_STATE`.
pub const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;

/// `TrackEvent.Type.TYPE_SLICE_BEGIN`.
pub const TYPE_SLICE_BEGIN: i32 = 1;
/// `TrackEvent.Type.TYPE_SLICE_END`.
pub const TYPE_SLICE_END: i32 = 2;
/// `TrackEvent.Type.TYPE_INSTANT`.
pub const TYPE_INSTANT: i32 = 3;

/// `perfetto.protos.TracePacket`.
#[derive(Clone, PartialEq, Message)]
pub struct TracePacket {
    /// Field 8: the timestamp, in the packet's clock (BOOTTIME ns unless overridden).
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    /// Field 58: the clock of `timestamp`.
    #[prost(uint32, optional, tag = "58")]
    pub timestamp_clock_id: Option<u32>,
    /// Field 6 (payload): a clock snapshot.
    #[prost(message, optional, tag = "6")]
    pub clock_snapshot: Option<ClockSnapshot>,
    /// Field 11 (payload): a track event.
    #[prost(message, optional, tag = "11")]
    pub track_event: Option<TrackEvent>,
    /// Field 60 (payload): a track descriptor.
    #[prost(message, optional, tag = "60")]
    pub track_descriptor: Option<TrackDescriptor>,
    /// Field 10: the packet sequence (interning and defaults are per sequence).
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    /// Field 12: names interned on this sequence from this packet on.
    #[prost(message, optional, tag = "12")]
    pub interned_data: Option<InternedData>,
    /// Field 13: `SEQ_*` flags.
    #[prost(uint32, optional, tag = "13")]
    pub sequence_flags: Option<u32>,
    /// Field 59: defaults for later packets of the sequence.
    #[prost(message, optional, tag = "59")]
    pub trace_packet_defaults: Option<TracePacketDefaults>,
    /// Field 87: set on a sequence's first packet (no loss before it).
    #[prost(bool, optional, tag = "87")]
    pub first_packet_on_sequence: Option<bool>,
    /// Field 98: the machine the packet comes from (0 or absent: the host).
    #[prost(uint32, optional, tag = "98")]
    pub machine_id: Option<u32>,
}

/// `perfetto.protos.ClockSnapshot`.
#[derive(Clone, PartialEq, Message)]
pub struct ClockSnapshot {
    /// Field 1: the clocks read at one instant.
    #[prost(message, repeated, tag = "1")]
    pub clocks: Vec<Clock>,
}

/// `perfetto.protos.ClockSnapshot.Clock`.
#[derive(Clone, PartialEq, Message)]
pub struct Clock {
    /// Field 1: builtin (1..63) or sequence-scoped (64..127) clock id.
    #[prost(uint32, optional, tag = "1")]
    pub clock_id: Option<u32>,
    /// Field 2: its reading.
    #[prost(uint64, optional, tag = "2")]
    pub timestamp: Option<u64>,
    /// Field 3: packets in this clock give the delta from the previous one's timestamp.
    #[prost(bool, optional, tag = "3")]
    pub is_incremental: Option<bool>,
}

/// `perfetto.protos.TracePacketDefaults`.
#[derive(Clone, PartialEq, Message)]
pub struct TracePacketDefaults {
    /// Field 58: the default `timestamp_clock_id`.
    #[prost(uint32, optional, tag = "58")]
    pub timestamp_clock_id: Option<u32>,
    /// Field 11: defaults for track events.
    #[prost(message, optional, tag = "11")]
    pub track_event_defaults: Option<TrackEventDefaults>,
}

/// `perfetto.protos.TrackEventDefaults`.
#[derive(Clone, PartialEq, Message)]
pub struct TrackEventDefaults {
    /// Field 11: the track of events that name none.
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
}

/// `perfetto.protos.InternedData`.
#[derive(Clone, PartialEq, Message)]
pub struct InternedData {
    /// Field 2: event names.
    #[prost(message, repeated, tag = "2")]
    pub event_names: Vec<InternedString>,
    /// Field 3: debug annotation names.
    #[prost(message, repeated, tag = "3")]
    pub debug_annotation_names: Vec<InternedString>,
}

/// `perfetto.protos.EventName` and `DebugAnnotationName` (the same two fields).
#[derive(Clone, PartialEq, Message)]
pub struct InternedString {
    /// Field 1: the id packets refer to.
    #[prost(uint64, optional, tag = "1")]
    pub iid: Option<u64>,
    /// Field 2: the string.
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
}

/// `perfetto.protos.TrackDescriptor`.
#[derive(Clone, PartialEq, Message)]
pub struct TrackDescriptor {
    /// Field 1: the track's id, global to the trace.
    #[prost(uint64, optional, tag = "1")]
    pub uuid: Option<u64>,
    /// Field 5: the enclosing track.
    #[prost(uint64, optional, tag = "5")]
    pub parent_uuid: Option<u64>,
    /// Field 2: the name shown.
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    /// Field 3: makes this the process track of a process.
    #[prost(message, optional, tag = "3")]
    pub process: Option<ProcessDescriptor>,
}

/// `perfetto.protos.ProcessDescriptor`.
#[derive(Clone, PartialEq, Message)]
pub struct ProcessDescriptor {
    /// Field 1: the pid.
    #[prost(int32, optional, tag = "1")]
    pub pid: Option<i32>,
    /// Field 6: the process name.
    #[prost(string, optional, tag = "6")]
    pub process_name: Option<String>,
}

/// `perfetto.protos.TrackEvent`.
#[derive(Clone, PartialEq, Message)]
pub struct TrackEvent {
    /// Field 9: `TYPE_*`.
    #[prost(int32, optional, tag = "9")]
    pub r#type: Option<i32>,
    /// Field 11: the track (else the sequence's default).
    #[prost(uint64, optional, tag = "11")]
    pub track_uuid: Option<u64>,
    /// Field 10: the interned name.
    #[prost(uint64, optional, tag = "10")]
    pub name_iid: Option<u64>,
    /// Field 23: the name, not interned.
    #[prost(string, optional, tag = "23")]
    pub name: Option<String>,
    /// Field 4: key/value arguments.
    #[prost(message, repeated, tag = "4")]
    pub debug_annotations: Vec<DebugAnnotation>,
}

/// `perfetto.protos.DebugAnnotation`.
#[derive(Clone, PartialEq, Message)]
pub struct DebugAnnotation {
    /// Field 1: the interned name.
    #[prost(uint64, optional, tag = "1")]
    pub name_iid: Option<u64>,
    /// Field 10: the name, not interned.
    #[prost(string, optional, tag = "10")]
    pub name: Option<String>,
    /// Field 2: a boolean value.
    #[prost(bool, optional, tag = "2")]
    pub bool_value: Option<bool>,
    /// Field 3: an unsigned value.
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    /// Field 4: a signed value.
    #[prost(int64, optional, tag = "4")]
    pub int_value: Option<i64>,
    /// Field 6: a string value.
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
}

/// Appends `packet` to `buf` as one `Trace.packet` field (tag, length, bytes).
pub fn append_packet(packet: &TracePacket, buf: &mut Vec<u8>) {
    prost::encoding::message::encode(TRACE_PACKET_FIELD, packet, buf);
}

/// The clock of the event timestamps on a vCPU's sequence (sequence-scoped, so each vCPU's is
/// its own): incremental, in ns, pinned to BOOTTIME by one snapshot at the start of the
/// sequence, so an event packet carries the few bytes of its distance from the previous event
/// instead of 7–9 bytes of BOOTTIME (docs/perfetto.md).
pub const CLOCK_EVENT_DELTA: u32 = 65;

/// The debug-annotation names every vCPU sequence interns, in the order an event packet writes
/// them: `ANNOTATIONS[i]` has iid `i + 1`. `before_ns` and `after_ns` are the guaranteed
/// interval as distances from the event's timestamp (`ts - before_ns`, `ts + after_ns`). The
/// event id has no argument: the event's name, `event <id>`, says it.
pub const ANNOTATIONS: [&str; 5] = ["host_tsc", "guest_tsc", "before_ns", "after_ns", "payload"];
const IID_HOST_TSC: u64 = 1;
const IID_GUEST_TSC: u64 = 2;
const IID_BEFORE: u64 = 3;
const IID_AFTER: u64 = 4;
const IID_PAYLOAD: u64 = 5;

/// The longest payload an event packet carries (as twice as many hex digits).
pub const MAX_PAYLOAD: usize = 16;

/// The one packet vmtsync writes per event: an instant track event on the sequence's default
/// track, its interned name and its arguments as debug annotations with interned names
/// ([`ANNOTATIONS`]; the guest TSC and the interval only when known, the payload only when not
/// empty).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventPacket<'a> {
    /// On [`CLOCK_EVENT_DELTA`] (the sequence's default clock): ns since the previous event
    /// timestamped in it; with `absolute`, BOOTTIME ns (for an event earlier than that one:
    /// the incremental clock only moves forward here).
    pub timestamp: u64,
    /// `timestamp` is BOOTTIME (`timestamp_clock_id` = [`CLOCK_BOOTTIME`] on the packet).
    pub absolute: bool,
    /// `trusted_packet_sequence_id`.
    pub sequence: u32,
    /// `machine_id`.
    pub machine_id: u32,
    /// The interned event name (`event <id>`).
    pub name_iid: u64,
    /// `host_tsc`.
    pub host_tsc: u64,
    /// `guest_tsc`.
    pub guest_tsc: Option<u64>,
    /// `before_ns`, `after_ns`.
    pub interval: Option<(i64, i64)>,
    /// `payload`, written as lowercase hex; at most [`MAX_PAYLOAD`] bytes (longer is cut).
    pub payload: &'a [u8],
}

/// The room [`EventPacket::write`] needs: [`WRAP`] bytes it indexes modulo (it writes packets
/// of under 130 bytes), and 16 more that its 8-byte stores past the end may touch.
pub const EVENT_PACKET_MAX: usize = WRAP + 16;
const WRAP: usize = 256;

impl EventPacket<'_> {
    fn payload(&self) -> &[u8] {
        self.payload.get(..MAX_PAYLOAD).unwrap_or(self.payload)
    }

    /// The packet as a prost message (for packets [`Self::write`] leaves, and what its bytes
    /// are tested against).
    #[must_use]
    pub fn to_message(&self) -> TracePacket {
        let ann = |iid, uint_value, int_value, string_value| DebugAnnotation {
            name_iid: Some(iid),
            uint_value,
            int_value,
            string_value,
            ..Default::default()
        };
        let mut args = vec![ann(IID_HOST_TSC, Some(self.host_tsc), None, None)];
        if let Some(g) = self.guest_tsc {
            args.push(ann(IID_GUEST_TSC, Some(g), None, None));
        }
        if let Some((b, a)) = self.interval {
            args.push(ann(IID_BEFORE, None, Some(b), None));
            args.push(ann(IID_AFTER, None, Some(a), None));
        }
        let p = self.payload();
        if !p.is_empty() {
            let hex = p.iter().map(|x| format!("{x:02x}")).collect();
            args.push(ann(IID_PAYLOAD, None, None, Some(hex)));
        }
        TracePacket {
            timestamp: Some(self.timestamp),
            timestamp_clock_id: self.absolute.then_some(CLOCK_BOOTTIME),
            trusted_packet_sequence_id: Some(self.sequence),
            machine_id: Some(self.machine_id),
            track_event: Some(TrackEvent {
                r#type: Some(TYPE_INSTANT),
                name_iid: Some(self.name_iid),
                debug_annotations: args,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Writes the packet as a `Trace.packet` field (tag, length, bytes) straight into `out`
    /// (e.g. the tail of an output buffer), with the bytes prost writes for
    /// [`Self::to_message`] (tested); returns its length, the bytes from `out[0]` on (later
    /// bytes of `out` are scratch and may be overwritten), or `None` when the packet reaches
    /// 128 bytes (only with extreme values: timestamps and TSCs near 2^64, negative interval
    /// ends, huge ids and a full payload together), whose length prefix takes two bytes:
    /// write that one with [`append_packet`] of [`Self::to_message`].
    ///
    /// It is the one packet written per event, so it is specialised to its fixed layout, in
    /// one pass with no per-argument dispatch: each annotation's key, length, name and value
    /// key in one store, each varint made in a register and stored at once, each message's
    /// one-byte length prefix reserved before it and filled in after it. Encoding it through
    /// prost's generic path cost ~16 times the trace.dat writer's time per event. (Sizing
    /// every field first and then writing, with no filling in, made more instructions: the
    /// sizes of nine fields held at once spill out of the registers.)
    #[inline(always)]
    pub fn write(&self, out: &mut [u8; EVENT_PACKET_MAX]) -> Option<usize> {
        let mut c = OnePass { b: out, n: 0 };
        // Fields in tag order, as prost writes them. The packet: timestamp (8),
        // trusted_packet_sequence_id (10), track_event (11), timestamp_clock_id (58, a
        // two-byte key), machine_id (98, a two-byte key).
        c.word(0x40_00_0a, 3);
        c.varint(self.timestamp);
        c.word(0x50, 1);
        c.varint(u64::from(self.sequence));
        c.word(0x00_5a, 2);
        let event = c.n;
        // The track event: debug_annotations (4: key, length, then name_iid (1) and
        // uint_value (3), int_value (4) or string_value (6)), type (9), name_iid (10).
        c.annotation(IID_HOST_TSC, 0x18, self.host_tsc);
        if let Some(g) = self.guest_tsc {
            c.annotation(IID_GUEST_TSC, 0x18, g);
        }
        if let Some((b, a)) = self.interval {
            // int64 is the varint of the two's complement (10 bytes when negative).
            c.annotation(IID_BEFORE, 0x20, b.cast_unsigned());
            c.annotation(IID_AFTER, 0x20, a.cast_unsigned());
        }
        let p = self.payload();
        if !p.is_empty() {
            c.hex_annotation(IID_PAYLOAD, p);
        }
        c.word(0x50_03_48, 3);
        c.varint(self.name_iid);
        let event_len = c.n - event;
        if self.absolute {
            c.word(0xd0 | 0x03 << 8 | u64::from(CLOCK_BOOTTIME) << 16, 3);
        }
        c.word(0x06_90, 2);
        c.varint(u64::from(self.machine_id));
        // The packet under 128 bytes, so the event inside it: both prefixes are one byte.
        let packet_len = c.n - 2;
        if packet_len >= 0x80 || c.n + 16 > WRAP {
            return None;
        }
        c.b[1] = packet_len.to_le_bytes()[0];
        c.b[event - 1] = event_len.to_le_bytes()[0];
        Some(c.n)
    }
}

/// By the leading zeros of a value (or'd with 1): its varint's length and the continuation
/// bits of its first eight bytes (all but the last byte's). A table lookup, where computing
/// them took a division by 7 and a variable shift on every varint's critical path (measured
/// with `perf`: the encoder's hottest line).
const VARINT_SHAPE: [(usize, u64); 64] = {
    let mut t = [(0, 0); 64];
    let mut lz: usize = 0;
    while lz < 64 {
        let len = (64 - lz).div_ceil(7);
        let cont = if len > 8 {
            0x8080_8080_8080_8080
        } else {
            0x8080_8080_8080_8080 & ((1u64 << (8 * (len - 1))) - 1)
        };
        t[lz] = (len, cont);
        lz += 1;
    }
    t
};

/// Each byte's two lowercase hex digits, the first in the low byte.
static HEX_PAIRS: [u16; 256] = {
    let digits = *b"0123456789abcdef";
    let mut t = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = digits[b >> 4] as u16 | (digits[b & 15] as u16) << 8;
        b += 1;
    }
    t
};

/// [`EventPacket::write`]'s writer: a fixed-size array indexed modulo [`WRAP`] with room for
/// 16 bytes of stores past it, so no store needs a bounds check (a packet of under 130 bytes
/// never comes near wrapping; `write` checks before using the bytes).
struct OnePass<'a> {
    b: &'a mut [u8; EVENT_PACKET_MAX],
    n: usize,
}

impl OnePass<'_> {
    /// The low `len` bytes of `w` (little-endian), by one 8-byte store (the bytes past them
    /// are scratch).
    #[inline(always)]
    fn word(&mut self, w: u64, len: usize) {
        let i = self.n % WRAP;
        self.b[i..i + 8].copy_from_slice(&w.to_le_bytes());
        self.n += len;
    }

    /// A varint: one byte as it is (sequence and machine ids, names: a branch each call site
    /// predicts), else [`Self::spread`].
    #[inline(always)]
    fn varint(&mut self, v: u64) {
        if v < 0x80 {
            self.word(v, 1);
        } else {
            let shape = VARINT_SHAPE[(v | 1).leading_zeros() as usize % 64];
            self.spread(v, shape);
        }
    }

    /// A varint of `shape` ([`VARINT_SHAPE`]) with no loop over its bytes: the low 56 bits'
    /// 7-bit groups spread into bytes by three mask-and-shift steps in a register, the
    /// continuation bits or'd in, one 8-byte store; the top 8 bits, when there are any, as one
    /// or two more bytes. Building the bytes in a stack array and reading them back stalled
    /// store forwarding (measured with `perf`).
    #[inline(always)]
    fn spread(&mut self, v: u64, (len, cont): (usize, u64)) {
        // 28-bit halves into 32-bit lanes, 14-bit quarters into 16-bit lanes, 7-bit groups
        // into bytes; short values (deltas of a few µs: the timestamp, the interval) skip the
        // steps their bits do not need (a branch each call site predicts).
        let t = if len <= 2 {
            (v & 0x7F) | (v & 0x3F80) << 1
        } else if len <= 4 {
            let t = (v & 0x3FFF) | (v & 0x0FFF_C000) << 2;
            (t & 0x007F_007F) | (t & 0x3F80_3F80) << 1
        } else {
            let low = v & ((1 << 56) - 1);
            let mut t = (low & 0x0FFF_FFFF) | ((low & 0x00FF_FFFF_F000_0000) << 4);
            t = (t & 0x0000_3FFF_0000_3FFF) | ((t & 0x0FFF_C000_0FFF_C000) << 2);
            (t & 0x007F_007F_007F_007F) | ((t & 0x3F80_3F80_3F80_3F80) << 1)
        };
        if len <= 8 {
            self.word(t | cont, len);
        } else {
            self.word(t | cont, 8);
            // A ninth byte, and a tenth for the very top bit.
            let top = v >> 56;
            self.word(
                (top & 0x7f) | (top >> 7) << 8 | u64::from(top >= 0x80) << 7,
                len - 8,
            );
        }
    }

    /// A debug annotation with an interned name and a varint value under `key` (0x18
    /// `uint_value`, 0x20 `int_value`): its key, length, name key, name and value key in one
    /// store, then the value (a one-byte value in the same store).
    #[inline(always)]
    fn annotation(&mut self, iid: u64, key: u64, v: u64) {
        let head = 0x22 | 0x08 << 16 | iid << 24 | key << 32;
        if v < 0x80 {
            self.word(head | 4 << 8 | v << 40, 6);
        } else {
            let shape = VARINT_SHAPE[(v | 1).leading_zeros() as usize % 64];
            self.word(head | (3 + shape.0 as u64) << 8, 5);
            self.spread(v, shape);
        }
    }

    /// A debug annotation whose `string_value` is `p` in lowercase hex (at most
    /// [`MAX_PAYLOAD`] bytes, so every length is one byte): four bytes to eight digits at a
    /// time, each byte's two digits looked up ([`HEX_PAIRS`]) and the four pairs stored at
    /// once. (Computing the digits in a register, each nibble moved into its own byte and
    /// `'0'` or `'a' - 10` added, took about 5 % more of the whole recording's CPU.)
    #[inline(always)]
    fn hex_annotation(&mut self, iid: u64, p: &[u8]) {
        let digits = 2 * p.len() as u64;
        self.word(
            0x22 | (4 + digits) << 8 | 0x08 << 16 | iid << 24 | 0x32 << 32 | digits << 40,
            6,
        );
        let end = self.n + 2 * p.len();
        for chunk in p.chunks(4) {
            // A short last chunk reads as if padded with zeros (its digits past the end are
            // scratch).
            let x = match <[u8; 4]>::try_from(chunk) {
                Ok(a) => u64::from(u32::from_le_bytes(a)),
                Err(_) => chunk
                    .iter()
                    .rev()
                    .fold(0, |acc, &b| acc << 8 | u64::from(b)),
            };
            let d = |k: u32| u64::from(HEX_PAIRS[((x >> (8 * k)) & 0xFF) as usize]) << (16 * k);
            self.word(d(0) | d(1) | d(2) | d(3), 8);
        }
        self.n = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Trace` itself, for decoding what the writer produced.
    #[derive(Clone, PartialEq, Message)]
    pub struct Trace {
        #[prost(message, repeated, tag = "1")]
        pub packet: Vec<TracePacket>,
    }

    #[test]
    fn appended_packets_decode_as_a_trace() {
        let a = TracePacket {
            timestamp: Some(1_000),
            trusted_packet_sequence_id: Some(7),
            machine_id: Some(2),
            track_event: Some(TrackEvent {
                r#type: Some(TYPE_INSTANT),
                name_iid: Some(1),
                ..Default::default()
            }),
            ..Default::default()
        };
        let b = TracePacket {
            clock_snapshot: Some(ClockSnapshot {
                clocks: vec![Clock {
                    clock_id: Some(CLOCK_BOOTTIME),
                    timestamp: Some(5),
                    is_incremental: None,
                }],
            }),
            ..Default::default()
        };
        let mut buf = Vec::new();
        append_packet(&a, &mut buf);
        append_packet(&b, &mut buf);
        let t = Trace::decode(buf.as_slice()).unwrap();
        assert_eq!(t.packet, vec![a, b]);
    }

    #[test]
    fn field_numbers_are_perfettos() {
        // Golden bytes: timestamp (field 8, varint) = 0x08 << 3 | 0 = 0x40; machine_id (field
        // 98) = 98 << 3 = 784 = varint 0x90 0x06; track_event (field 11, length-delimited) =
        // 0x5a.
        let p = TracePacket {
            timestamp: Some(1),
            machine_id: Some(3),
            track_event: Some(TrackEvent {
                r#type: Some(TYPE_INSTANT),
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = p.encode_to_vec();
        assert_eq!(bytes, [0x40, 1, 0x5a, 2, 0x48, 3, 0x90, 0x06, 3]);
    }

    /// Every argument combination, every varint length of every field, payloads of every
    /// length, and packets on both sides of the 128-byte limit of a one-byte length prefix:
    /// the one-pass bytes are prost's, or the writer says it cannot write them.
    #[test]
    fn the_fast_event_packet_is_prosts() {
        let payload: Vec<u8> = (0..=u8::try_from(MAX_PAYLOAD).unwrap() + 1)
            .map(|i| i.wrapping_mul(37).wrapping_add(0xa5))
            .collect();
        let wide: Vec<u64> = (0..64)
            .flat_map(|k| [(1u64 << k) - 1, 1 << k])
            .chain([u64::MAX])
            .collect();
        let mut cases = Vec::new();
        let base = EventPacket {
            timestamp: 1,
            absolute: false,
            sequence: 2,
            machine_id: 1,
            name_iid: 1,
            host_tsc: 0,
            guest_tsc: None,
            interval: None,
            payload: &[],
        };
        for (i, &v) in wide.iter().enumerate() {
            let w = wide[(i * 7 + 3) % wide.len()];
            let len = i % (MAX_PAYLOAD + 2);
            cases.push(EventPacket {
                timestamp: v,
                absolute: i % 2 == 0,
                sequence: u32::try_from(w >> 32).unwrap(),
                machine_id: u32::try_from(v & u64::from(u32::MAX)).unwrap(),
                name_iid: w,
                host_tsc: w,
                guest_tsc: (i % 3 != 0).then_some(v),
                interval: (i % 4 != 1).then_some((v.cast_signed(), w.cast_signed())),
                payload: &payload[..len],
            });
            cases.push(EventPacket {
                host_tsc: v,
                ..base
            });
        }
        // Large arguments and a payload of every length: the packet, then the track event,
        // crosses 128 bytes.
        for len in 0..=MAX_PAYLOAD {
            for big in [u64::MAX, 1 << 40] {
                cases.push(EventPacket {
                    timestamp: big,
                    host_tsc: big,
                    guest_tsc: Some(big),
                    interval: Some((-1, big.cast_signed())),
                    payload: &payload[..len],
                    ..base
                });
            }
        }
        // Every field at its largest: the track event and the packet past 128 bytes.
        cases.push(EventPacket {
            timestamp: u64::MAX,
            absolute: true,
            sequence: u32::MAX,
            machine_id: u32::MAX,
            name_iid: u64::MAX,
            host_tsc: u64::MAX,
            guest_tsc: Some(u64::MAX),
            interval: Some((-1, i64::MIN)),
            payload: &payload,
        });
        let (mut fast, mut long) = (0, 0);
        let mut slot = [0xee; EVENT_PACKET_MAX];
        for (i, e) in cases.iter().enumerate() {
            let want = e.to_message();
            let mut slow = Vec::new();
            append_packet(&want, &mut slow);
            assert_eq!(Trace::decode(slow.as_slice()).unwrap().packet, vec![want]);
            // The packet's length prefix is two bytes exactly when a message reached 128.
            match (e.write(&mut slot), slow[1] >= 0x80) {
                (Some(n), false) => {
                    assert_eq!(&slot[..n], &slow[..], "case {i}: the same bytes as prost's");
                    fast += 1;
                }
                (None, true) => long += 1,
                (got, _) => panic!("case {i}: {got:?} for a {}-byte packet", slow.len()),
            }
        }
        assert!(
            fast > 100 && long > 0,
            "{fast} written, {long} left to prost"
        );
        // The payload is cut at MAX_PAYLOAD bytes by both encoders.
        let e = EventPacket {
            payload: &payload,
            ..base
        };
        let hex = e.to_message().track_event.unwrap().debug_annotations[1]
            .string_value
            .clone()
            .unwrap();
        assert_eq!(hex.len(), 2 * MAX_PAYLOAD);
        assert!(hex.starts_with("a5ca"), "{hex}");
    }

    #[test]
    fn payload_hex_is_lowercase_and_in_order() {
        let all: Vec<u8> = (0..=255).collect();
        let mut slot = [0; EVENT_PACKET_MAX];
        for p in all.chunks(MAX_PAYLOAD).chain(all.chunks(3)) {
            let e = EventPacket {
                timestamp: 5,
                absolute: false,
                sequence: 2,
                machine_id: 1,
                name_iid: 1,
                host_tsc: 2,
                guest_tsc: None,
                interval: None,
                payload: p,
            };
            let n = e.write(&mut slot).unwrap();
            let got = Trace::decode(&slot[..n]).unwrap().packet.remove(0);
            let s = got.track_event.unwrap().debug_annotations[1]
                .string_value
                .clone()
                .unwrap();
            let want: String = p.iter().map(|x| format!("{x:02x}")).collect();
            assert_eq!(s, want);
        }
    }

    #[test]
    fn varints_are_prosts() {
        let mut out = [0; EVENT_PACKET_MAX];
        for k in 0..64 {
            for v in [
                (1u64 << k) - 1,
                1 << k,
                (1 << k) | 0x5555_5555_5555_5555 >> (63 - k),
            ] {
                let mut c = OnePass { b: &mut out, n: 0 };
                c.varint(v);
                let n = c.n;
                let mut want = Vec::new();
                prost::encoding::encode_varint(v, &mut want);
                assert_eq!(&out[..n], &want[..], "{v:#x}");
            }
        }
    }

    #[test]
    fn varint_shapes_are_prosts_lengths() {
        for k in 0..64 {
            for v in [(1u64 << k) - 1, 1 << k] {
                let (len, _) = VARINT_SHAPE[(v | 1).leading_zeros() as usize];
                assert_eq!(len, prost::encoding::encoded_len_varint(v), "{v:#x}");
            }
        }
    }
}
