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
    /// Field 3: an unsigned value.
    #[prost(uint64, optional, tag = "3")]
    pub uint_value: Option<u64>,
    /// Field 6: a string value.
    #[prost(string, optional, tag = "6")]
    pub string_value: Option<String>,
}

/// Appends `packet` to `buf` as one `Trace.packet` field (tag, length, bytes).
pub fn append_packet(packet: &TracePacket, buf: &mut Vec<u8>) {
    prost::encoding::message::encode(TRACE_PACKET_FIELD, packet, buf);
}

/// An argument of an event packet written by [`append_event_packet`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg<'a> {
    /// `DebugAnnotation.uint_value`.
    Uint(u64),
    /// `DebugAnnotation.string_value`.
    Str(&'a str),
    /// `DebugAnnotation.string_value`: these bytes in lowercase hex (two characters each).
    Hex(&'a [u8]),
}

impl Arg<'_> {
    /// The string value, if it is one (a [`Arg::Hex`] spelled out).
    #[must_use]
    pub fn string(&self) -> Option<String> {
        match *self {
            Arg::Uint(_) => None,
            Arg::Str(s) => Some(s.to_owned()),
            Arg::Hex(b) => Some(b.iter().map(|x| format!("{x:02x}")).collect()),
        }
    }

    /// The length of the string value in bytes (0 for a number).
    fn str_len(&self) -> usize {
        match *self {
            Arg::Uint(_) => 0,
            Arg::Str(s) => s.len(),
            Arg::Hex(b) => 2 * b.len(),
        }
    }
}

/// The most arguments [`append_event_packet`] writes.
pub const MAX_ARGS: usize = 8;
/// The longest string argument [`append_event_packet`] writes.
pub const MAX_STR: usize = 64;

/// Writes protobuf bytes into a slice of exactly the right length.
struct Cursor<'a> {
    b: &'a mut [u8],
    n: usize,
}

impl Cursor<'_> {
    fn byte(&mut self, x: u8) {
        // The slice was sized from the same lengths: a miss would be a bug in them, and `get_mut`
        // turns it into a short packet rather than a panic.
        if let Some(slot) = self.b.get_mut(self.n) {
            *slot = x;
        }
        self.n += 1;
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.byte(u8::try_from(v & 0x7f).unwrap_or(0) | 0x80);
            v >>= 7;
        }
        self.byte(u8::try_from(v).unwrap_or(0));
    }

    fn bytes(&mut self, x: &[u8]) {
        if let Some(dst) = self.b.get_mut(self.n..self.n + x.len()) {
            dst.copy_from_slice(x);
        }
        self.n += x.len();
    }
}

/// The length of `v` as a varint.
fn varint_len(v: u64) -> usize {
    // 1 byte per started group of 7 bits, at least one.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// Appends one instant-event packet to `buf` as a `Trace.packet` field, equal (once decoded)
/// to the [`TracePacket`] with `timestamp`, `trusted_packet_sequence_id`, `machine_id`,
/// `sequence_flags = SEQ_NEEDS_INCREMENTAL_STATE` and a `TYPE_INSTANT` track event with
/// `name_iid` and one debug annotation per argument (interned name, value), but written
/// without prost's generic path: it is the one packet written per event, and encoding it
/// through prost (lengths computed once per nesting level, one call per varint byte) cost
/// ~16 times the trace.dat writer's time per event. The bytes equal prost's (tested against
/// its encoding and decoding). Returns `false`, writing nothing, for more than [`MAX_ARGS`]
/// arguments or a string longer than [`MAX_STR`] bytes (write those with [`append_packet`]).
///
/// One pass: every message of an event packet is almost always under 128 bytes, so its length
/// prefix is one byte, reserved before the message and filled in after it. A packet with a
/// longer message is written again by the two-pass encoder, which sizes everything first.
pub fn append_event_packet(
    buf: &mut Vec<u8>,
    timestamp: u64,
    sequence: u32,
    machine_id: u32,
    name_iid: u64,
    args: &[(u64, Arg<'_>)],
) -> bool {
    let mut slot = [0; EVENT_PACKET_MAX];
    match write_event_packet(&mut slot, timestamp, sequence, machine_id, name_iid, args) {
        Some(n) => {
            buf.extend_from_slice(&slot[..n]);
            true
        }
        None => append_event_packet_sized(buf, timestamp, sequence, machine_id, name_iid, args),
    }
}

/// The room [`write_event_packet`] needs: more than the largest packet it writes (at most
/// [`MAX_ARGS`] arguments of at most 15 + [`MAX_STR`] bytes each, 36 bytes of the rest, and
/// 10 bytes past the end that a varint store may touch).
pub const EVENT_PACKET_MAX: usize = 1024;
const _: () = assert!(46 + MAX_ARGS * (15 + MAX_STR) < EVENT_PACKET_MAX);

/// [`append_event_packet`] in one pass straight into `out` (e.g. the tail of an output
/// buffer): returns the packet's length, the bytes from `out[0]` on (later bytes of `out` are
/// scratch and may be overwritten), or `None` when the two-pass encoder must write it
/// ([`append_event_packet`] does that): a message of 128 bytes or more (its length prefix
/// takes two bytes), more than [`MAX_ARGS`] arguments, or a string longer than [`MAX_STR`].
///
/// Every message of an event packet is almost always under 128 bytes, so its length prefix is
/// one byte, reserved before the message and filled in after it.
pub fn write_event_packet(
    out: &mut [u8; EVENT_PACKET_MAX],
    timestamp: u64,
    sequence: u32,
    machine_id: u32,
    name_iid: u64,
    args: &[(u64, Arg<'_>)],
) -> Option<usize> {
    if args.len() > MAX_ARGS || args.iter().any(|(_, a)| a.str_len() > MAX_STR) {
        return None;
    }
    let mut c = OnePass {
        b: out,
        n: 0,
        long: false,
    };
    // Fields in tag order, as prost writes them. The packet: timestamp (8),
    // trusted_packet_sequence_id (10), track_event (11), sequence_flags (13), machine_id (98,
    // a two-byte key).
    c.byte(0x0a);
    let packet = c.open();
    c.byte(0x40);
    c.varint(timestamp);
    c.byte(0x50);
    c.varint(u64::from(sequence));
    c.byte(0x5a);
    let event = c.open();
    // The track event: debug_annotations (4, each name_iid (1) and uint_value (3) or
    // string_value (6)), type (9), name_iid (10).
    for &(iid, a) in args {
        c.byte(0x22);
        let arg = c.open();
        c.byte(0x08);
        c.varint(iid);
        match a {
            Arg::Uint(v) => {
                c.byte(0x18);
                c.varint(v);
            }
            Arg::Str(s) => {
                c.byte(0x32);
                c.varint(s.len() as u64);
                c.bytes(s.as_bytes());
            }
            Arg::Hex(b) => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                c.byte(0x32);
                c.varint(2 * b.len() as u64);
                for &x in b {
                    c.byte(HEX[usize::from(x >> 4)]);
                    c.byte(HEX[usize::from(x & 15)]);
                }
            }
        }
        c.close(arg);
    }
    c.byte(0x48);
    c.byte(u8::try_from(TYPE_INSTANT).unwrap_or(3));
    c.byte(0x50);
    c.varint(name_iid);
    c.close(event);
    c.byte(0x68);
    c.byte(u8::try_from(SEQ_NEEDS_INCREMENTAL_STATE).unwrap_or(2));
    c.byte(0x90);
    c.byte(0x06);
    c.varint(u64::from(machine_id));
    c.close(packet);
    (!c.long && c.n + 10 <= EVENT_PACKET_MAX).then_some(c.n)
}

/// [`write_event_packet`]'s writer: a fixed-size array indexed modulo its power-of-two size,
/// so no store needs a bounds check (the sizes above keep it from wrapping; `n` past the end
/// is caught before the bytes are used).
struct OnePass<'a> {
    b: &'a mut [u8; EVENT_PACKET_MAX],
    n: usize,
    /// A message reached 128 bytes: its one-byte length prefix cannot hold its length.
    long: bool,
}

impl OnePass<'_> {
    #[inline(always)]
    fn byte(&mut self, x: u8) {
        self.b[self.n % EVENT_PACKET_MAX] = x;
        self.n += 1;
    }

    /// A varint without a loop over its bytes when it has at most 8 (values below 2^56): the
    /// 7-bit groups spread into bytes by three mask-and-shift steps in a register, the
    /// continuation bits of all but the last set at once, one 8-byte store (the bytes past the
    /// varint are scratch). Larger values byte by byte.
    #[inline(always)]
    fn varint(&mut self, v: u64) {
        if v >= 1 << 56 {
            let mut v = v;
            while v >= 0x80 {
                // The low byte with the continuation bit; `to_le_bytes()[0]` is the low 8 bits.
                self.byte(v.to_le_bytes()[0] | 0x80);
                v >>= 7;
            }
            self.byte(v.to_le_bytes()[0]);
            return;
        }
        let len = varint_len(v);
        // 28-bit halves into 32-bit lanes, 14-bit quarters into 16-bit lanes, 7-bit groups
        // into bytes.
        let mut t = (v & 0x0FFF_FFFF) | ((v & 0x00FF_FFFF_F000_0000) << 4);
        t = (t & 0x0000_3FFF_0000_3FFF) | ((t & 0x0FFF_C000_0FFF_C000) << 2);
        t = (t & 0x007F_007F_007F_007F) | ((t & 0x3F80_3F80_3F80_3F80) << 1);
        t |= 0x8080_8080_8080_8080 & ((1u64 << (8 * (len - 1))) - 1);
        if let Some(d) = self.b.get_mut(self.n..self.n + 8) {
            d.copy_from_slice(&t.to_le_bytes());
        }
        self.n += len;
    }

    #[inline(always)]
    fn bytes(&mut self, x: &[u8]) {
        // Out of room only if the sizes above are wrong: `n` then says so.
        if let Some(d) = self.b.get_mut(self.n..self.n + x.len()) {
            d.copy_from_slice(x);
        }
        self.n += x.len();
    }

    /// Reserves a message's one-byte length prefix; returns where the message starts.
    #[inline(always)]
    fn open(&mut self) -> usize {
        self.byte(0);
        self.n
    }

    /// Fills in the length of the message that started at `start`.
    #[inline(always)]
    fn close(&mut self, start: usize) {
        let len = self.n - start;
        self.long |= len >= 0x80;
        self.b[(start - 1) % EVENT_PACKET_MAX] = len.to_le_bytes()[0];
    }
}

/// [`append_event_packet`]'s general case: every length computed first, then the bytes (for
/// packets with a message of 128 bytes or more, whose length prefix takes two bytes).
fn append_event_packet_sized(
    buf: &mut Vec<u8>,
    timestamp: u64,
    sequence: u32,
    machine_id: u32,
    name_iid: u64,
    args: &[(u64, Arg<'_>)],
) -> bool {
    if args.len() > MAX_ARGS || args.iter().any(|(_, a)| a.str_len() > MAX_STR) {
        return false;
    }
    // Lengths first (protobuf prefixes every message with its length), then the bytes straight
    // into `buf`. Fields in tag order, as prost writes them.
    let arg_len = |iid: u64, a: Arg<'_>| {
        1 + varint_len(iid)
            + match a {
                Arg::Uint(v) => 1 + varint_len(v),
                Arg::Str(_) | Arg::Hex(_) => 1 + varint_len(a.str_len() as u64) + a.str_len(),
            }
    };
    // The track event: debug_annotations (4, each name_iid (1) and uint_value (3) or
    // string_value (6)), type (9), name_iid (10).
    let mut lens = [0usize; MAX_ARGS];
    let mut ev_len = 2 + 1 + varint_len(name_iid);
    for (l, &(iid, a)) in lens.iter_mut().zip(args) {
        *l = arg_len(iid, a);
        ev_len += 1 + varint_len(*l as u64) + *l;
    }
    // The packet: timestamp (8), trusted_packet_sequence_id (10), track_event (11),
    // sequence_flags (13), machine_id (98, a two-byte key).
    let p_len = 1
        + varint_len(timestamp)
        + 1
        + varint_len(u64::from(sequence))
        + 1
        + varint_len(ev_len as u64)
        + ev_len
        + 2
        + 2
        + varint_len(u64::from(machine_id));
    // The bytes go into a zeroed tail of exact length through a cursor: slice stores, no
    // capacity check per byte.
    let total = 1 + varint_len(p_len as u64) + p_len;
    let start = buf.len();
    buf.resize(start + total, 0);
    let mut c = Cursor {
        b: &mut buf[start..],
        n: 0,
    };
    c.byte(0x0a);
    c.varint(p_len as u64);
    c.byte(0x40);
    c.varint(timestamp);
    c.byte(0x50);
    c.varint(u64::from(sequence));
    c.byte(0x5a);
    c.varint(ev_len as u64);
    for (&l, &(iid, a)) in lens.iter().zip(args) {
        c.byte(0x22);
        c.varint(l as u64);
        c.byte(0x08);
        c.varint(iid);
        match a {
            Arg::Uint(v) => {
                c.byte(0x18);
                c.varint(v);
            }
            Arg::Str(s) => {
                c.byte(0x32);
                c.varint(s.len() as u64);
                c.bytes(s.as_bytes());
            }
            Arg::Hex(b) => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                c.byte(0x32);
                c.varint(2 * b.len() as u64);
                for &x in b {
                    c.byte(HEX[usize::from(x >> 4)]);
                    c.byte(HEX[usize::from(x & 15)]);
                }
            }
        }
    }
    c.bytes(&[0x48, u8::try_from(TYPE_INSTANT).unwrap_or(3), 0x50]);
    c.varint(name_iid);
    c.bytes(&[0x68, u8::try_from(SEQ_NEEDS_INCREMENTAL_STATE).unwrap_or(2)]);
    c.bytes(&[0x90, 0x06]);
    c.varint(u64::from(machine_id));
    debug_assert_eq!(c.n, total);
    true
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

    #[test]
    fn the_fast_event_packet_is_prosts() {
        let longest = "y".repeat(MAX_STR);
        let mut every: Vec<(u64, Arg<'_>)> = (0..MAX_ARGS as u64 - 1)
            .map(|i| (u64::MAX - i, Arg::Uint(u64::MAX >> i)))
            .collect();
        every.push((7, Arg::Str(&longest)));
        let mut cases: Vec<Vec<(u64, Arg<'_>)>> = vec![
            vec![],
            vec![(1, Arg::Uint(0)), (2, Arg::Uint(u64::MAX))],
            vec![
                (3, Arg::Uint(300)),
                (5, Arg::Str("ab01")),
                (200, Arg::Uint(1 << 40)),
            ],
            vec![(1, Arg::Str(""))],
            // Every field at its largest: messages of 128 bytes and more.
            every,
            vec![(5, Arg::Hex(&[0xab, 0x01, 0x00, 0xff])), (6, Arg::Hex(&[]))],
            vec![(5, Arg::Hex(&[0x5a; MAX_STR / 2]))],
        ];
        // Four large numbers and a string of every length: the packet, then the track event
        // crosses 128 bytes, where the one-pass encoder hands over to the two-pass one.
        for k in 0..=MAX_STR {
            let mut a: Vec<(u64, Arg<'_>)> = (1..=4).map(|i| (i, Arg::Uint(u64::MAX))).collect();
            a.push((5, Arg::Str(&longest[..k])));
            cases.push(a);
        }
        for (i, args) in cases.iter().enumerate() {
            for (ts, seq, machine, name) in [(0, 1, 1, 1), (u64::MAX, u32::MAX, u32::MAX, u64::MAX)]
            {
                let mut fast = Vec::new();
                assert!(append_event_packet(&mut fast, ts, seq, machine, name, args));
                let want = TracePacket {
                    timestamp: Some(ts),
                    trusted_packet_sequence_id: Some(seq),
                    machine_id: Some(machine),
                    sequence_flags: Some(SEQ_NEEDS_INCREMENTAL_STATE),
                    track_event: Some(TrackEvent {
                        r#type: Some(TYPE_INSTANT),
                        name_iid: Some(name),
                        debug_annotations: args
                            .iter()
                            .map(|&(iid, a)| DebugAnnotation {
                                name_iid: Some(iid),
                                uint_value: match a {
                                    Arg::Uint(v) => Some(v),
                                    Arg::Str(_) | Arg::Hex(_) => None,
                                },
                                string_value: a.string(),
                            })
                            .collect(),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let mut slow = Vec::new();
                append_packet(&want, &mut slow);
                assert_eq!(fast, slow, "case {i}: the same bytes as prost's");
                assert_eq!(Trace::decode(fast.as_slice()).unwrap().packet, vec![want]);
            }
        }
        let long = "x".repeat(MAX_STR + 1);
        let mut buf = Vec::new();
        assert!(!append_event_packet(
            &mut buf,
            0,
            1,
            1,
            1,
            &[(1, Arg::Hex(&[0; MAX_STR / 2 + 1]))]
        ));
        assert!(buf.is_empty());
        let mut buf = Vec::new();
        assert!(!append_event_packet(
            &mut buf,
            0,
            1,
            1,
            1,
            &[(1, Arg::Str(&long))]
        ));
        assert!(buf.is_empty());
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
                let mut c = OnePass {
                    b: &mut out,
                    n: 0,
                    long: false,
                };
                c.varint(v);
                let n = c.n;
                let mut want = Vec::new();
                prost::encoding::encode_varint(v, &mut want);
                assert_eq!(&out[..n], &want[..], "{v:#x}");
            }
        }
    }

    #[test]
    fn varint_lengths() {
        for (v, n) in [
            (0, 1),
            (127, 1),
            (128, 2),
            (16_383, 2),
            (16_384, 3),
            (u64::MAX, 10),
        ] {
            assert_eq!(varint_len(v), n, "{v}");
            assert_eq!(prost::encoding::encoded_len_varint(v), n);
        }
    }
}
