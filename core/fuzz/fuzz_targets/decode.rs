//! Feeds arbitrary bytes to every untrusted-input path of the protocol: the unframed decoder,
//! the frame decoder, and the stream receiver (plain, and keeping console text) in a chunking
//! chosen by the input itself. A
//! panic, or a decoded message that does not re-encode to something decoding to itself, is a
//! crash.
//!
//! Input: the first byte picks the chunk size (low 6 bits) and, with its top bit set, has every
//! frame's checksum rewritten to match (`reseal_stream`), so mutations get past the CRC into
//! postcard; the rest is the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmtsync_core::proto::{
    Feed, FrameReceiver, MAX_FRAME_SIZE, Message, decode, decode_frame, encode_frame, reseal_stream,
};

/// Decoded messages must survive encode → decode unchanged.
fn assert_round_trips(msg: &Message) {
    let mut buf = [0u8; MAX_FRAME_SIZE];
    let frame = encode_frame(msg, &mut buf).expect("a decoded message re-encodes");
    assert_eq!(decode_frame(frame).as_ref(), Ok(msg));
}

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode(data) {
        assert_round_trips(&msg);
    }
    let mut copy = data.to_vec();
    if let Ok(msg) = decode_frame(&mut copy) {
        assert_round_trips(&msg);
    }

    let Some((&first, raw)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(first % 64) + 1;
    let mut stream = Vec::with_capacity(raw.len() + raw.len() / 8 + 2);
    if first & 0x80 != 0 {
        reseal_stream(raw, |piece| stream.extend_from_slice(piece));
    } else {
        stream.extend_from_slice(raw);
    }
    let mut rx = FrameReceiver::new();
    for piece in stream.chunks(chunk) {
        let mut input = piece;
        loop {
            match rx.feed(input) {
                Feed::Consumed => break,
                Feed::Message { msg, rest } => {
                    assert_round_trips(&msg);
                    assert!(rest.len() < input.len(), "receiver made progress");
                    input = rest;
                }
                Feed::Error { rest, .. } => {
                    assert!(rest.len() < input.len(), "receiver made progress");
                    input = rest;
                }
            }
        }
    }

    // The same stream as a shared UART's (console text between frames): text is handed out
    // once, never a delimiter, never more than arrived.
    let mut rx = FrameReceiver::new();
    let mut text = 0usize;
    for piece in stream.chunks(chunk) {
        let mut input = piece;
        loop {
            match rx.feed_text(input, &mut |t| {
                assert!(!t.contains(&0), "a delimiter handed out as text");
                text += t.len();
            }) {
                Feed::Consumed => break,
                Feed::Message { msg, rest } => {
                    assert_round_trips(&msg);
                    assert!(rest.len() < input.len(), "receiver made progress");
                    input = rest;
                }
                Feed::Error { rest, .. } => {
                    assert!(rest.len() < input.len(), "receiver made progress");
                    input = rest;
                }
            }
        }
    }
    let zeros = stream.iter().filter(|&&b| b == 0).count();
    assert!(text + zeros <= stream.len(), "more text than bytes");
});
