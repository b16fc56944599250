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
}
