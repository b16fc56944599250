//! Framing: postcard + CRC + COBS, one checked decode path, a stream receiver, and the agent's
//! late-TSC probe reply encoder.
//!
//! A frame on the wire is `COBS(body)` followed by one `0x00` delimiter, where the body is
//! `postcard(message)` followed by a checksum of those bytes:
//!
//! - every message ends in a big-endian CRC-16/PROFIBUS ([`CRC16`]),
//! - except the compact [`Message::Probe`] request (host → guest, tag 2), whose body is
//!   `tag, seq` and ends in a CRC-8/AUTOSAR ([`CRC8`]), which keeps a probe round trip at 16
//!   bytes,
//! - and [`Message::Events`] (guest → host, tag 11), up to about 2 KiB, which ends in a
//!   big-endian CRC-32/BZIP2 ([`CRC32`]): CRC-16/PROFIBUS keeps Hamming distance 4 only up
//!   to 342 bytes.
//!
//! The first body byte (the postcard tag) says which checksum follows; why these two and why
//! the request may have the shorter one is in `docs/wire-integrity.md`.
//!
//! COBS removes every zero from the body, so a receiver that lost sync (line noise, a reset
//! peer, a frame too long) recovers at the next `0x00`. Empty frames (`0x00 0x00`) are skipped,
//! so a sender may emit a lone `0x00` first to flush a receiver that is mid-garbage.
//!
//! Untrusted bytes enter only through [`decode`] (an unframed body), [`decode_frame`] (which
//! undoes COBS and calls `decode`) and [`FrameReceiver::feed`] (which reassembles a frame and
//! calls `decode_frame`). `decode` checks the checksum before postcard sees a byte, then
//! decodes strictly: the message must use every byte up to the checksum (the checksum fixes
//! the length, so a spare byte is corruption, not padding). postcard's decoder validates the
//! types (e.g. a [`crate::mapping::KvmTscMapping`] only decodes through its checked
//! constructor), never panics, and every failure is a [`DecodeError`].

use crc::{CRC_8_AUTOSAR, CRC_16_PROFIBUS, CRC_32_BZIP2, Crc, Digest};
use postcard::experimental::max_size::MaxSize;

use super::message::Message;
use crate::units::GuestTicks;

/// The checksum that ends every frame body but the compact probe request's: CRC-16/PROFIBUS
/// (polynomial 0x1DCF, init and xorout 0xFFFF), appended big-endian. Hamming distance 5 for
/// bodies up to 13 bytes before it (every probe message), 4 up to 342 bytes (far beyond
/// [`MAX_MESSAGE_SIZE`]); tested in `golden.rs` against the polynomial itself.
pub static CRC16: Crc<u16> = Crc::<u16>::new(&CRC_16_PROFIBUS);

/// The checksum that ends the compact [`Message::Probe`] request: CRC-8/AUTOSAR (polynomial
/// 0x2F, init and xorout 0xFF), Hamming distance 4 over its two payload bytes.
pub static CRC8: Crc<u8> = Crc::<u8>::new(&CRC_8_AUTOSAR);

/// The checksum that ends an event batch ([`Message::Events`]): CRC-32/BZIP2 (the IEEE 802.3
/// polynomial 0x04C11DB7, not reflected, init and xorout 0xFFFF_FFFF), appended big-endian.
/// Hamming distance 4 up to 91,607 bits (Koopman's CRC tables), far beyond the largest batch.
pub static CRC32: Crc<u32> = Crc::<u32>::new(&CRC_32_BZIP2);

/// postcard tag of [`Message::Probe`], the one message checked by [`CRC8`] (pinned by the
/// golden tests).
const TAG_PROBE: u8 = 2;

/// postcard tag of [`Message::Events`], the one message checked by [`CRC32`].
const TAG_EVENTS: u8 = 11;

/// Bytes of the checksum that follows a message whose postcard tag is `tag`.
#[must_use]
pub const fn checksum_len(tag: Option<&u8>) -> usize {
    match tag {
        Some(&TAG_PROBE) => 1,
        Some(&TAG_EVENTS) => 4,
        _ => 2,
    }
}

/// The largest postcard encoding of any [`Message`] (from `MaxSize`, so a slight overestimate),
/// without its checksum.
pub const MAX_MESSAGE_SIZE: usize = Message::POSTCARD_MAX_SIZE;

/// The largest frame body: [`MAX_MESSAGE_SIZE`] plus the longest checksum (CRC-32).
pub const MAX_BODY_SIZE: usize = MAX_MESSAGE_SIZE + 4;

/// The largest frame: [`MAX_BODY_SIZE`] plus COBS overhead (one byte per started 254-byte
/// block) plus the `0x00` delimiter. Every frame buffer in this crate has this size.
pub const MAX_FRAME_SIZE: usize = cobs_max_len(MAX_BODY_SIZE) + 1;

/// COBS output length bound for `n` input bytes (the cobs crate's `max_encoding_length`, made
/// at least 1 because an empty body still gets a code byte).
const fn cobs_max_len(n: usize) -> usize {
    n + if n == 0 { 1 } else { n.div_ceil(254) }
}

/// Why bytes did not decode to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes ended before the message (or its checksum) was complete.
    Truncated,
    /// The frame is not valid COBS.
    BadCobs,
    /// The checksum does not match the body: the frame was corrupted on the way.
    Checksum,
    /// postcard rejected the bytes (an overlong varint, a bool or option byte above 1, ...).
    Malformed,
    /// The bytes parse but a value is not allowed: an unknown message or enum tag, a mapping
    /// with `ratio == 0` or `frac_bits > 63`, more than [`super::EVENT_BATCH_MAX`] events.
    InvalidValue,
    /// A complete message is followed by bytes before the checksum.
    TrailingBytes,
    /// The frame is longer than [`MAX_FRAME_SIZE`]; the receiver dropped it up to the next
    /// delimiter.
    FrameTooLong,
}

impl DecodeError {
    fn from_postcard(e: postcard::Error) -> Self {
        match e {
            postcard::Error::DeserializeUnexpectedEnd => Self::Truncated,
            // serde's own "invalid value": an unknown variant tag, or a type's validation
            // (KvmTscMapping::try_new, heapless capacity) said no.
            postcard::Error::SerdeDeCustom => Self::InvalidValue,
            _ => Self::Malformed,
        }
    }
}

/// Why a message could not be encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum EncodeError {
    /// The output buffer is too small; [`MAX_FRAME_SIZE`] always suffices for a frame and
    /// [`MAX_BODY_SIZE`] for an unframed body.
    BufferTooSmall,
}

/// Encodes `msg` as an unframed body (postcard bytes and their checksum, no COBS) into `buf`;
/// returns the used prefix.
///
/// # Errors
/// [`EncodeError::BufferTooSmall`] if `buf` cannot hold the body.
pub fn encode<'a>(msg: &Message, buf: &'a mut [u8]) -> Result<&'a mut [u8], EncodeError> {
    let len = postcard::to_slice(msg, buf)
        .map_err(|_| EncodeError::BufferTooSmall)?
        .len();
    let (payload, tail) = buf.split_at_mut(len);
    let (crc, crc_len) = checksum_of(payload.first(), payload);
    tail.get_mut(..crc_len)
        .ok_or(EncodeError::BufferTooSmall)?
        .copy_from_slice(crc.get(..crc_len).unwrap_or_default());
    buf.get_mut(..len + crc_len)
        .ok_or(EncodeError::BufferTooSmall)
}

/// The checksum of `payload` that the postcard tag `tag` calls for, big-endian in the first
/// `len` bytes of the array; returns it and `len`. The tag is passed on its own because a
/// (corrupt) body may hold a tag and no payload.
fn checksum_of(tag: Option<&u8>, payload: &[u8]) -> ([u8; 4], usize) {
    let crc_len = checksum_len(tag);
    let mut crc = [0u8; 4];
    match crc_len {
        1 => crc[0] = CRC8.checksum(payload),
        4 => crc = CRC32.checksum(payload).to_be_bytes(),
        _ => crc[..2].copy_from_slice(&CRC16.checksum(payload).to_be_bytes()),
    }
    (crc, crc_len)
}

/// Encodes `msg` as one frame (COBS body plus the `0x00` delimiter) into `buf`; returns the
/// used prefix, ready to send.
///
/// # Errors
/// [`EncodeError::BufferTooSmall`] if `buf` cannot hold the frame.
pub fn encode_frame<'a>(msg: &Message, buf: &'a mut [u8]) -> Result<&'a mut [u8], EncodeError> {
    let mut body = [0u8; MAX_BODY_SIZE];
    let body = encode(msg, &mut body)?;
    let len = cobs::try_encode(body, buf).map_err(|_| EncodeError::BufferTooSmall)?;
    *buf.get_mut(len).ok_or(EncodeError::BufferTooSmall)? = 0;
    buf.get_mut(..=len).ok_or(EncodeError::BufferTooSmall)
}

/// Splits an unframed body into its payload after checking the checksum the tag calls for.
fn checked_payload(body: &[u8]) -> Result<&[u8], DecodeError> {
    let crc_len = checksum_len(body.first());
    let split = body
        .len()
        .checked_sub(crc_len)
        .ok_or(DecodeError::Truncated)?;
    let (payload, crc) = body.split_at(split);
    let ok = match *crc {
        [c] => CRC8.checksum(payload) == c,
        [hi, lo] => CRC16.checksum(payload) == u16::from_be_bytes([hi, lo]),
        [a, b, c, d] => CRC32.checksum(payload) == u32::from_be_bytes([a, b, c, d]),
        _ => false,
    };
    if ok {
        Ok(payload)
    } else {
        Err(DecodeError::Checksum)
    }
}

/// The checked decoder for an unframed body (postcard bytes and their checksum, no COBS): the
/// checksum first, then a strict postcard decode of exactly the bytes before it.
///
/// # Errors
/// Any [`DecodeError`] but `BadCobs` and `FrameTooLong`; never panics.
pub fn decode(body: &[u8]) -> Result<Message, DecodeError> {
    let payload = checked_payload(body)?;
    match postcard::take_from_bytes::<Message>(payload) {
        Ok((msg, [])) => Ok(msg),
        Ok(_) => Err(DecodeError::TrailingBytes),
        Err(e) => Err(DecodeError::from_postcard(e)),
    }
}

/// The checked decoder for one COBS frame, with or without its trailing `0x00`: undoes COBS in
/// place (the buffer is scratch afterwards, and decoding stops at the first `0x00`), then
/// [`decode`].
///
/// # Errors
/// Any [`DecodeError`]; a frame longer than [`MAX_FRAME_SIZE`] (delimiter included) is
/// `FrameTooLong` exactly as in [`FrameReceiver`]. Never panics.
pub fn decode_frame(frame: &mut [u8]) -> Result<Message, DecodeError> {
    let body_len = frame.iter().position(|&b| b == 0).unwrap_or(frame.len());
    if body_len + 1 > MAX_FRAME_SIZE {
        return Err(DecodeError::FrameTooLong);
    }
    let len = match cobs::decode_in_place(frame) {
        Ok(len) => len,
        Err(cobs::DecodeError::EmptyFrame) => return Err(DecodeError::Truncated),
        Err(_) => return Err(DecodeError::BadCobs),
    };
    decode(frame.get(..len).ok_or(DecodeError::BadCobs)?)
}

/// Fuzzing support: rewrites the checksum of one frame (its COBS bytes, without the delimiter)
/// to match its body, so a fuzzer that mutates frames still reaches postcard and what lies
/// behind it. Returns the resealed frame with its delimiter, or `None` if `frame` is not valid
/// COBS, too long, or too short to hold a checksum.
#[cfg(feature = "sim")]
#[must_use]
pub fn reseal_frame<'a>(frame: &[u8], out: &'a mut [u8; MAX_FRAME_SIZE]) -> Option<&'a [u8]> {
    let mut scratch = [0u8; MAX_FRAME_SIZE];
    let scratch = scratch.get_mut(..frame.len())?;
    scratch.copy_from_slice(frame);
    let n = cobs::decode_in_place(scratch).ok()?;
    let body = scratch.get_mut(..n)?;
    let tag = body.first().copied();
    let (payload, crc) = body.split_at_mut(n.checked_sub(checksum_len(tag.as_ref()))?);
    let (sum, len) = checksum_of(tag.as_ref(), payload);
    crc.copy_from_slice(sum.get(..len)?);
    let len = cobs::try_encode(body, out).ok()?;
    *out.get_mut(len)? = 0;
    out.get(..=len)
}

/// Fuzzing support: [`reseal_frame`] over a whole stream. Calls `emit` with the pieces of the
/// new stream in order: each `0x00`-delimited frame resealed, or as it was if it cannot be,
/// and the delimiters.
#[cfg(feature = "sim")]
pub fn reseal_stream(stream: &[u8], mut emit: impl FnMut(&[u8])) {
    let mut out = [0u8; MAX_FRAME_SIZE];
    let mut frames = stream.split(|&b| b == 0).peekable();
    while let Some(frame) = frames.next() {
        let last = frames.peek().is_none();
        match reseal_frame(frame, &mut out) {
            // A resealed frame carries its own delimiter; the last piece had none.
            Some(sealed) if !last => emit(sealed),
            Some(sealed) => emit(sealed.split_last().map_or(sealed, |(_, body)| body)),
            None => {
                emit(frame);
                if !last {
                    emit(&[0]);
                }
            }
        }
    }
}

/// The result of one [`FrameReceiver::feed`] call.
// The message is returned by value: without a heap there is nothing to box it into, and it is
// moved once, to the caller.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq, Eq)]
pub enum Feed<'a> {
    /// Every input byte was taken; no frame completed.
    Consumed,
    /// A frame completed and decoded. Feed `rest` next.
    Message {
        /// The decoded message.
        msg: Message,
        /// Input after the frame's delimiter, not yet looked at.
        rest: &'a [u8],
    },
    /// A frame completed but did not decode, or overflowed. The receiver is already resynced;
    /// feed `rest` next.
    Error {
        /// What was wrong.
        error: DecodeError,
        /// Input not yet looked at.
        rest: &'a [u8],
    },
}

/// Reassembles frames from a byte stream in any chunking (UART, vsock) in a fixed buffer of
/// [`MAX_FRAME_SIZE`] bytes, and decodes each through [`decode_frame`].
///
/// It skips empty frames and, after an overlong frame, drops bytes up to the next delimiter
/// instead of decoding the frame's tail as a new frame.
#[derive(Clone)]
pub struct FrameReceiver {
    buf: [u8; MAX_FRAME_SIZE],
    /// Bytes of the current frame in `buf` (delimiter not yet seen).
    len: usize,
    /// Set after an overflow until the next delimiter.
    discarding: bool,
}

impl core::fmt::Debug for FrameReceiver {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        // The buffer's contents are scratch; its fill level is `len`.
        f.debug_struct("FrameReceiver")
            .field("pending", &self.len)
            .field("discarding", &self.discarding)
            .finish_non_exhaustive()
    }
}

impl Default for FrameReceiver {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReceiver {
    /// An empty receiver.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            buf: [0; MAX_FRAME_SIZE],
            len: 0,
            discarding: false,
        }
    }

    /// Feeds received bytes; returns at the first completed frame (with the unread rest) or
    /// once all input is taken. Call again with `rest` until [`Feed::Consumed`].
    pub fn feed<'a>(&mut self, input: &'a [u8]) -> Feed<'a> {
        let mut input = input;
        if self.discarding {
            match input.iter().position(|&b| b == 0) {
                Some(i) => {
                    self.discarding = false;
                    input = input.get(i + 1..).unwrap_or_default();
                }
                None => return Feed::Consumed,
            }
        }
        if self.len == 0 {
            // Skip empty frames (delimiters with nothing before them).
            let start = input.iter().position(|&b| b != 0).unwrap_or(input.len());
            input = input.get(start..).unwrap_or_default();
        }
        let (bytes, rest) = match input.iter().position(|&b| b == 0) {
            Some(i) => (
                input.get(..i).unwrap_or_default(),
                Some(input.get(i + 1..).unwrap_or_default()),
            ),
            None => (input, None),
        };
        let end = self.len + bytes.len();
        // The delimiter must fit too: a frame is at most MAX_FRAME_SIZE bytes with it.
        let slot = if end < MAX_FRAME_SIZE {
            self.buf.get_mut(self.len..end)
        } else {
            None
        };
        let Some(slot) = slot else {
            self.len = 0;
            // Without a delimiter in this chunk, the frame goes on in the next one.
            self.discarding = rest.is_none();
            return Feed::Error {
                error: DecodeError::FrameTooLong,
                rest: rest.unwrap_or_default(),
            };
        };
        slot.copy_from_slice(bytes);
        self.len = end;
        let Some(rest) = rest else {
            return Feed::Consumed;
        };
        let result = match self.buf.get_mut(..end) {
            Some(frame) => decode_frame(frame),
            None => Err(DecodeError::FrameTooLong),
        };
        self.len = 0;
        match result {
            Ok(msg) => Feed::Message { msg, rest },
            Err(error) => Feed::Error { error, rest },
        }
    }

    /// [`FrameReceiver::feed`] for a link that carries console text between its frames (a
    /// UART shared with a console, whose sender writes a `0x00` before each frame as well as
    /// the frame's own trailing one). Every non-empty `0x00`-delimited run that does not
    /// decode is text: its bytes go to `text` in order, and the run's end is a
    /// [`Feed::Error`] with the decode error. A run too long for any frame is
    /// [`DecodeError::FrameTooLong`] at its end; its bytes go to `text` as they arrive, so a
    /// text run of any length costs no more than the frame buffer. Delimiters are not text.
    ///
    /// The run is decoded from a copy on the stack ([`MAX_FRAME_SIZE`] bytes), so its bytes
    /// survive a failed decode; the decode itself is [`decode_frame`], as in `feed`. Use one
    /// of `feed` and `feed_text` on a receiver, not both: after an overlong run `feed` drops
    /// bytes where this streams them.
    pub fn feed_text<'a>(&mut self, input: &'a [u8], text: &mut dyn FnMut(&[u8])) -> Feed<'a> {
        let mut input = input;
        loop {
            let (bytes, rest) = match input.iter().position(|&b| b == 0) {
                Some(i) => (
                    input.get(..i).unwrap_or_default(),
                    Some(input.get(i + 1..).unwrap_or_default()),
                ),
                None => (input, None),
            };
            if self.discarding {
                // The run already outgrew every frame: text up to its delimiter.
                if !bytes.is_empty() {
                    text(bytes);
                }
            } else {
                let end = self.len + bytes.len();
                // The delimiter must fit too, as in `feed`.
                let slot = if end < MAX_FRAME_SIZE {
                    self.buf.get_mut(self.len..end)
                } else {
                    None
                };
                match slot {
                    Some(slot) => {
                        slot.copy_from_slice(bytes);
                        self.len = end;
                    }
                    None => {
                        text(self.buf.get(..self.len).unwrap_or_default());
                        text(bytes);
                        self.len = 0;
                        self.discarding = true;
                    }
                }
            }
            let Some(rest) = rest else {
                return Feed::Consumed;
            };
            if core::mem::take(&mut self.discarding) {
                return Feed::Error {
                    error: DecodeError::FrameTooLong,
                    rest,
                };
            }
            let len = core::mem::take(&mut self.len);
            let Some(run) = self.buf.get(..len).filter(|r| !r.is_empty()) else {
                // An empty run (the delimiter a sender writes before each frame, or two in a
                // row): nothing to decode, nothing to print.
                input = rest;
                continue;
            };
            let mut scratch = [0u8; MAX_FRAME_SIZE];
            let result = match scratch.get_mut(..len) {
                Some(copy) => {
                    copy.copy_from_slice(run);
                    decode_frame(copy)
                }
                None => Err(DecodeError::FrameTooLong),
            };
            return match result {
                Ok(msg) => Feed::Message { msg, rest },
                Err(error) => {
                    text(run);
                    Feed::Error { error, rest }
                }
            };
        }
    }
}

/// postcard tag of [`Message::ProbeReply`] (pinned by the golden tests).
const TAG_PROBE_REPLY: u8 = 3;
/// postcard tag of [`Message::ProbeReplyFull`] (pinned by the golden tests).
const TAG_PROBE_REPLY_FULL: u8 = 5;
/// Largest probe reply body: tag 1 + seq 1 + vcpu 5 + TSC 8 + CRC 2.
const PROBE_BODY_CAP: usize = 17;
/// Largest probe reply frame: the body + 1 COBS code + 1 delimiter.
const PROBE_FRAME_CAP: usize = PROBE_BODY_CAP + 2;

/// A probe reply frame encoded up to the TSC, so the agent's path from reading the TSC to
/// handing the frame to the link is a few table lookups and byte stores.
///
/// The TSC is the last field of [`super::ProbeReply`] / [`super::ProbeReplyFull`] and is
/// fixed-width, so its bytes never change the encoding of what precedes it. The CRC-16 over
/// the prefix is computed in advance and only continued over the TSC bytes in
/// [`ProbeReplyFrame::finish`]. The body is under 254 bytes, so COBS needs one code byte per
/// zero and nothing else. Output is byte-identical to [`encode_frame`] (tested for arbitrary
/// values).
#[derive(Clone)]
pub struct ProbeReplyFrame {
    buf: [u8; PROBE_FRAME_CAP],
    /// Length, open COBS code index and code after the prefix: `finish` restarts from here.
    prefix_len: usize,
    prefix_code_idx: usize,
    prefix_code: u8,
    /// The CRC-16 over the prefix (tag, seq, vcpu), continued over the TSC in `finish`.
    prefix_crc: Digest<'static, u16>,
    /// 4 for the compact reply, 8 for the full one.
    tsc_bytes: usize,
    /// The sequence number (also in the prefix), for a clock that tags its read with it.
    seq: u8,
}

impl core::fmt::Debug for ProbeReplyFrame {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        // The CRC digest has no Debug; the prefix bytes show what it covers.
        f.debug_struct("ProbeReplyFrame")
            .field("prefix", &self.buf.get(..self.prefix_len))
            .field("tsc_bytes", &self.tsc_bytes)
            .finish_non_exhaustive()
    }
}

impl ProbeReplyFrame {
    /// Prepares a compact [`Message::ProbeReply`] (low 32 bits of the TSC).
    #[must_use]
    pub fn compact(seq: u8, vcpu: u32) -> Self {
        Self::prepare(TAG_PROBE_REPLY, seq, vcpu, 4)
    }

    /// Prepares a full-width [`Message::ProbeReplyFull`].
    #[must_use]
    pub fn full(seq: u8, vcpu: u32) -> Self {
        Self::prepare(TAG_PROBE_REPLY_FULL, seq, vcpu, 8)
    }

    /// The sequence number the reply answers.
    #[must_use]
    pub const fn seq(&self) -> u8 {
        self.seq
    }

    fn prepare(tag: u8, seq: u8, vcpu: u32, tsc_bytes: usize) -> Self {
        let mut buf = [0; PROBE_FRAME_CAP];
        let mut enc = CobsSmall {
            buf: &mut buf,
            len: 1,
            code_idx: 0,
            code: 1,
        };
        let mut prefix_crc = CRC16.digest();
        let mut push = |b: u8| {
            enc.push(b);
            prefix_crc.update(&[b]);
        };
        push(tag);
        push(seq);
        // postcard's varint: 7 bits per byte, low first, high bit = more.
        let mut v = vcpu;
        loop {
            // Masked to 7 bits, so the cast keeps every bit.
            #[allow(clippy::cast_possible_truncation)]
            let low = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                push(low);
                break;
            }
            push(low | 0x80);
        }
        let (prefix_len, prefix_code_idx, prefix_code) = (enc.len, enc.code_idx, enc.code);
        Self {
            buf,
            prefix_len,
            prefix_code_idx,
            prefix_code,
            prefix_crc,
            tsc_bytes,
            seq,
        }
    }

    /// Appends the TSC (its low 4 or all 8 bytes, little-endian) and the CRC-16, closes the
    /// COBS block and appends the delimiter; returns the frame to send. May be called again
    /// with a newer reading (it restarts from the prepared prefix).
    #[inline]
    pub fn finish(&mut self, tsc: GuestTicks) -> &[u8] {
        let bytes = tsc.0.to_le_bytes();
        let tsc_part = bytes.get(..self.tsc_bytes).unwrap_or_default();
        let mut crc = self.prefix_crc.clone();
        crc.update(tsc_part);
        let crc = crc.finalize().to_be_bytes();
        let mut enc = CobsSmall {
            buf: &mut self.buf,
            len: self.prefix_len,
            code_idx: self.prefix_code_idx,
            code: self.prefix_code,
        };
        for &b in tsc_part.iter().chain(&crc) {
            enc.push(b);
        }
        enc.put(enc.code_idx, enc.code);
        enc.put(enc.len, 0);
        let len = enc.len + 1;
        self.buf.get(..len).unwrap_or_default()
    }
}

/// A COBS encoder for bodies shorter than 254 bytes (no 0xFF blocks), writing into a fixed
/// array; out-of-range writes are dropped instead of panicking (they cannot happen for the
/// probe replies, whose size is bounded by `PROBE_FRAME_CAP`).
struct CobsSmall<'a> {
    buf: &'a mut [u8; PROBE_FRAME_CAP],
    len: usize,
    code_idx: usize,
    code: u8,
}

impl CobsSmall<'_> {
    #[inline]
    fn put(&mut self, i: usize, b: u8) {
        if let Some(slot) = self.buf.get_mut(i) {
            *slot = b;
        }
    }

    #[inline]
    fn push(&mut self, b: u8) {
        if b == 0 {
            self.put(self.code_idx, self.code);
            self.code_idx = self.len;
            self.code = 1;
        } else {
            self.put(self.len, b);
            self.code = self.code.saturating_add(1);
        }
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::message::{ProbeReply, ProbeReplyFull};
    use crate::proto::testutil::{arb_message, body_of, cobs_frame};
    use proptest::collection::vec as pvec;
    use proptest::prelude::*;
    use std::vec::Vec;

    fn frame_of(msg: &Message) -> Vec<u8> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        encode_frame(msg, &mut buf).unwrap().to_vec()
    }

    /// Feeds `chunks` in order, collecting every result.
    fn feed_all(rx: &mut FrameReceiver, chunks: &[&[u8]]) -> Vec<Result<Message, DecodeError>> {
        let mut out = Vec::new();
        for chunk in chunks {
            let mut input: &[u8] = chunk;
            loop {
                match rx.feed(input) {
                    Feed::Consumed => break,
                    Feed::Message { msg, rest } => {
                        out.push(Ok(msg));
                        input = rest;
                    }
                    Feed::Error { error, rest } => {
                        out.push(Err(error));
                        input = rest;
                    }
                }
            }
        }
        out
    }

    /// Feeds `chunks` in order through [`FrameReceiver::feed_text`]: the messages and the
    /// text, and how many runs ended as text.
    fn feed_text_all(chunks: &[&[u8]]) -> (Vec<Message>, Vec<u8>, usize) {
        let mut rx = FrameReceiver::new();
        let (mut msgs, mut text, mut runs) = (Vec::new(), Vec::new(), 0);
        for chunk in chunks {
            let mut input: &[u8] = chunk;
            loop {
                match rx.feed_text(input, &mut |t| text.extend_from_slice(t)) {
                    Feed::Consumed => break,
                    Feed::Message { msg, rest } => {
                        msgs.push(msg);
                        input = rest;
                    }
                    Feed::Error { rest, .. } => {
                        runs += 1;
                        input = rest;
                    }
                }
            }
        }
        (msgs, text, runs)
    }

    /// Cuts `stream` at the (sorted) points `cuts` picks.
    fn chunked<'s>(stream: &'s [u8], cuts: &[prop::sample::Index]) -> Vec<&'s [u8]> {
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
        points.sort_unstable();
        let mut chunks = Vec::new();
        let mut start = 0;
        for p in points {
            chunks.push(&stream[start..p]);
            start = p;
        }
        chunks.push(&stream[start..]);
        chunks
    }

    #[test]
    fn text_between_delimited_frames_comes_out_and_frames_still_decode() {
        let probe = frame_of(&Message::Probe { seq: 7 });
        let mut stream = b"boot: hello\r\n".to_vec();
        stream.push(0);
        stream.extend_from_slice(&probe);
        stream.extend_from_slice(b"tick 1\n");
        // A text run longer than any frame, then a frame right behind it.
        let long: Vec<u8> = b"abcdefghijklmnopqrstuvwxyz"
            .iter()
            .copied()
            .cycle()
            .take(3 * MAX_FRAME_SIZE)
            .collect();
        stream.extend_from_slice(&long);
        stream.push(0);
        stream.extend_from_slice(&probe);
        for cuts in [1, 7, 256, stream.len()] {
            let chunks: Vec<&[u8]> = stream.chunks(cuts).collect();
            let (msgs, text, runs) = feed_text_all(&chunks);
            assert_eq!(msgs, [Message::Probe { seq: 7 }, Message::Probe { seq: 7 }]);
            let mut want = b"boot: hello\r\ntick 1\n".to_vec();
            want.extend_from_slice(&long);
            assert_eq!(text, want, "chunks of {cuts}");
            assert_eq!(runs, 2);
        }
        // A plain receiver gets the same messages (the leading delimiter is an empty frame).
        let mut rx = FrameReceiver::new();
        let got = feed_all(&mut rx, &[&stream]);
        assert_eq!(got.iter().filter(|r| r.is_ok()).count(), 2);
    }

    #[test]
    fn max_sizes_are_consistent() {
        // The largest message is a full event batch of extreme values; it must fit.
        let rec = crate::proto::EventRecord {
            delta: i64::MIN,
            id: u16::MAX,
            payload: heapless::Vec::from_slice(&[0xff; crate::proto::EVENT_PAYLOAD_MAX]).unwrap(),
        };
        let mut batch =
            crate::proto::EventBatch::new(u32::MAX, crate::proto::EventClock::Host, u64::MAX);
        batch.dropped = u64::MAX;
        batch.first = u64::MAX;
        batch.remaining = u32::MAX;
        batch.last = true;
        for _ in 0..crate::proto::EVENT_BATCH_MAX {
            batch.records.push(rec.clone()).unwrap();
        }
        let worst = Message::Events(batch);
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let bare = encode(&worst, &mut buf).unwrap().len();
        assert!(bare <= MAX_BODY_SIZE, "{bare} > {MAX_BODY_SIZE}");
        let framed = encode_frame(&worst, &mut buf).unwrap().len();
        assert!(framed <= MAX_FRAME_SIZE, "{framed} > {MAX_FRAME_SIZE}");
        std::println!("largest body {bare} B, frame {framed} B; buffers {MAX_FRAME_SIZE} B");
        assert_eq!(MAX_BODY_SIZE, MAX_MESSAGE_SIZE + 4);
        assert_eq!(
            MAX_FRAME_SIZE,
            MAX_BODY_SIZE + MAX_BODY_SIZE.div_ceil(254) + 1
        );
        assert_eq!(cobs_max_len(0), 1);
    }

    #[test]
    fn decode_rejects_invalid_mapping() {
        let zero_ratio: &[u8] = &[0x06, 0x01, 0xcf, 0x0f, 0x00, 0x30];
        let frac_64: &[u8] = &[0x06, 0x01, 0xcf, 0x0f, 0x01, 0x40];
        let mut ok = zero_ratio.to_vec();
        ok[4] = 0x01;
        assert!(
            decode(&body_of(&ok)).is_ok(),
            "the fixture is otherwise valid"
        );
        for payload in [zero_ratio, frac_64] {
            let body = body_of(payload);
            assert_eq!(decode(&body), Err(DecodeError::InvalidValue));
            let frame = &cobs_frame(&body);
            assert_eq!(
                decode_frame(&mut frame.clone()),
                Err(DecodeError::InvalidValue)
            );
            let mut rx = FrameReceiver::new();
            assert_eq!(
                feed_all(&mut rx, &[frame]),
                [Err(DecodeError::InvalidValue)]
            );
        }
    }

    #[test]
    fn decode_rejects_too_many_events() {
        // Events batch (vcpu 0, dropped 0, no overwrite, first 0, remaining 0, last, guest
        // clock, base 0) announcing EVENT_BATCH_MAX + 1 records of (delta 0, header 2: id 1,
        // no payload).
        let mut bare = std::vec![
            0x0b,
            0,
            0,
            0,
            0,
            0,
            1,
            0,
            0,
            u8::try_from(crate::proto::EVENT_BATCH_MAX + 1).unwrap()
        ];
        for _ in 0..=crate::proto::EVENT_BATCH_MAX {
            bare.extend_from_slice(&[0, 2]);
        }
        assert_eq!(decode(&body_of(&bare)), Err(DecodeError::InvalidValue));
        // The same batch with EVENT_BATCH_MAX records is valid: the count alone was refused.
        bare[9] -= 1;
        bare.truncate(bare.len() - 2);
        assert!(decode(&body_of(&bare)).is_ok());
    }

    #[test]
    fn decode_rejects_non_canonical_records() {
        // A one-record batch (vcpu 0, dropped 0, no overwrite, first 0, remaining 0, last,
        // guest clock, base 0) whose record (delta 0) ends in `tail`.
        let batch = |tail: &[u8]| {
            let mut bare = std::vec![0x0b, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0];
            bare.extend_from_slice(tail);
            body_of(&bare)
        };
        let one = |id, payload: &[u8]| {
            let mut b = crate::proto::EventBatch::new(0, crate::proto::EventClock::Guest, 0);
            b.last = true;
            assert!(b.push(0, 0, id, payload));
            Ok(Message::Events(b))
        };
        // The fixtures are otherwise valid: header 2 is id 1, header 3 id 1 with a payload.
        assert_eq!(decode(&batch(&[0x02])), one(1, &[]));
        assert_eq!(decode(&batch(&[0x03, 0x01, 0xaa])), one(1, &[0xaa]));
        // The widest id, with and without a payload: 3 header bytes.
        assert_eq!(decode(&batch(&[0xfe, 0xff, 0x07])), one(u16::MAX, &[]));
        assert_eq!(
            decode(&batch(&[0xff, 0xff, 0x07, 0x01, 0x05])),
            one(u16::MAX, &[5])
        );
        // A payload announced with length 0 (the payload-less form is the only one).
        assert_eq!(
            decode(&batch(&[0x03, 0x00])),
            Err(DecodeError::InvalidValue)
        );
        // An id above u16::MAX (header 2^17).
        assert_eq!(
            decode(&batch(&[0x80, 0x80, 0x08])),
            Err(DecodeError::InvalidValue)
        );
        // A payload longer than EVENT_PAYLOAD_MAX.
        let mut long = std::vec![0x03, 17];
        long.extend_from_slice(&[0xaa; 17]);
        assert_eq!(decode(&batch(&long)), Err(DecodeError::InvalidValue));
        // A header varint that overflows a u32, and a record cut short.
        assert_eq!(
            decode(&batch(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x01])),
            Err(DecodeError::Malformed)
        );
        assert_eq!(
            decode(&batch(&[0x03, 0x02, 0xaa])),
            Err(DecodeError::Truncated)
        );
    }

    #[test]
    fn a_full_batch_of_payload_less_events_costs_under_4_bytes_each() {
        // 64 records 2600 ticks apart (a million events per second at 2.6 GHz) with ids
        // below 64, guest TSC near 2^45: 2 bytes of delta and 1 of header per record, and
        // 22 bytes of tag, counters, flags, base, count, CRC-32, COBS and delimiter per batch
        // (214 B, counted by hand from the layout in `EventRecord`'s docs).
        let base = (1u64 << 45) + 12_345;
        let mut b = crate::proto::EventBatch::new(1, crate::proto::EventClock::Guest, base);
        let mut prev = base;
        for id in 0..crate::proto::EVENT_BATCH_MAX {
            assert!(b.push(prev, prev + 2600, u16::try_from(id).unwrap(), &[]));
            prev += 2600;
        }
        let frame = frame_of(&Message::Events(b)).len();
        assert_eq!(frame, 214);
        assert!(frame <= 4 * crate::proto::EVENT_BATCH_MAX);
    }

    #[test]
    fn decode_error_kinds() {
        assert_eq!(decode(&[]), Err(DecodeError::Truncated));
        assert_eq!(decode(&[0x0c]), Err(DecodeError::Truncated));
        assert_eq!(decode(&body_of(&[2])), Err(DecodeError::Truncated));
        assert_eq!(decode(&body_of(&[99])), Err(DecodeError::InvalidValue));
        // A varint longer than a u32 allows (EventsRequest's `max`).
        assert_eq!(
            decode(&body_of(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01])),
            Err(DecodeError::Malformed)
        );
        // Any flipped bit in the payload or the checksum.
        let good = body_of(&[0x0a, 0x08]);
        assert_eq!(decode(&good), Ok(Message::EventsRequest { max: 8 }));
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&bad).is_err(), "bit {bit}");
        }
        // A complete message followed by a spare byte, under a valid checksum.
        assert_eq!(
            decode(&body_of(&[0x0a, 0x08, 0x00])),
            Err(DecodeError::TrailingBytes)
        );
        assert_eq!(
            decode(&body_of(&[2, 7, 7])),
            Err(DecodeError::TrailingBytes)
        );
        // The compact probe with a CRC-16 (the other messages' checksum) is not a probe.
        let mut wrong = std::vec![2, 7];
        wrong.extend_from_slice(&CRC16.checksum(&[2, 7]).to_be_bytes());
        assert!(decode(&wrong).is_err());
        // A COBS code byte pointing past the end of the frame.
        assert_eq!(decode_frame(&mut [5, 1, 0]), Err(DecodeError::BadCobs));
        let mut long = [1u8; MAX_FRAME_SIZE];
        assert_eq!(decode_frame(&mut long), Err(DecodeError::FrameTooLong));
    }

    #[test]
    fn receiver_skips_empty_frames_and_resyncs_after_garbage() {
        let probe = frame_of(&Message::Probe { seq: 7 });
        let mut stream = Vec::new();
        stream.extend_from_slice(&[0, 0]);
        stream.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 0]);
        stream.extend_from_slice(&probe);
        let mut rx = FrameReceiver::new();
        let got = feed_all(&mut rx, &[&stream]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].is_err());
        assert_eq!(got[1], Ok(Message::Probe { seq: 7 }));
    }

    #[test]
    fn receiver_drops_overlong_frame_up_to_delimiter() {
        let probe = frame_of(&Message::Probe { seq: 9 });
        // An overlong run whose tail, alone, would be a valid probe frame body: the receiver
        // must not decode that tail.
        let mut long = [0x01u8; MAX_FRAME_SIZE + 10];
        let n = long.len();
        long[n - 3..].copy_from_slice(&probe[..3]);
        for split in [1, 50, MAX_FRAME_SIZE - 1, MAX_FRAME_SIZE, long.len()] {
            let mut rx = FrameReceiver::new();
            let (a, b) = long.split_at(split);
            let got = feed_all(&mut rx, &[a, b, &[0], &probe]);
            assert_eq!(
                got,
                [
                    Err(DecodeError::FrameTooLong),
                    Ok(Message::Probe { seq: 9 })
                ],
                "split {split}"
            );
        }
    }

    #[test]
    fn probe_reply_frame_matches_postcard() {
        let mut f = ProbeReplyFrame::compact(200, 3);
        let reply = Message::ProbeReply(ProbeReply {
            seq: 200,
            vcpu: 3,
            tsc_low32: 0x0012_0034,
        });
        assert_eq!(
            f.finish(GuestTicks(0x2000_0012_0034)),
            &frame_of(&reply)[..]
        );
        // Finishing again with another reading restarts from the prefix.
        let reply2 = Message::ProbeReply(ProbeReply {
            seq: 200,
            vcpu: 3,
            tsc_low32: 0xffff_ffff,
        });
        assert_eq!(f.finish(GuestTicks(0xffff_ffff)), &frame_of(&reply2)[..]);
    }

    /// The fuzzing helper makes a frame with a broken checksum decode, and leaves good frames
    /// and what is not COBS as they were.
    #[cfg(feature = "sim")]
    #[test]
    fn reseal_repairs_only_the_checksum() {
        let good = frame_of(&Message::EventsRequest { max: 8 });
        let mut broken = good.clone();
        let n = broken.len();
        broken[n - 2] ^= 0x40;
        assert!(decode_frame(&mut broken.clone()).is_err());
        let mut out = [0u8; MAX_FRAME_SIZE];
        assert_eq!(reseal_frame(&broken[..n - 1], &mut out), Some(&good[..]));
        let probe = frame_of(&Message::Probe { seq: 3 });
        let mut stream = Vec::new();
        stream.extend_from_slice(&broken);
        stream.extend_from_slice(&[0, 5, 1]);
        stream.push(0);
        stream.extend_from_slice(&probe[..probe.len() - 1]);
        let mut resealed = Vec::new();
        reseal_stream(&stream, |piece| resealed.extend_from_slice(piece));
        let mut want = good.clone();
        want.extend_from_slice(&[0, 5, 1, 0]);
        want.extend_from_slice(&probe[..probe.len() - 1]);
        assert_eq!(resealed, want);
    }

    /// Regression (found by the `decode`, `agent` and `session` fuzz targets): a body that is
    /// only the compact probe's tag has its one checksum byte and an empty payload; resealing
    /// it took the empty payload's (CRC-16) length and panicked in `copy_from_slice`.
    #[cfg(feature = "sim")]
    #[test]
    fn reseal_survives_a_tag_without_payload() {
        // The fuzzer's input after its control byte: a one-byte frame, then COBS of [2].
        let stream = [0x89, 0x00, 0x02, 0x02];
        let mut resealed = Vec::new();
        reseal_stream(&stream, |piece| resealed.extend_from_slice(piece));
        let mut out = [0u8; MAX_FRAME_SIZE];
        let sealed = reseal_frame(&[0x02, 0x02], &mut out).expect("valid COBS");
        // The body's one byte became the CRC-8 of the empty payload.
        assert_eq!(sealed, cobs_frame(&[CRC8.checksum(&[])]));
    }

    proptest! {
        #[test]
        fn roundtrip_bare_and_framed(msg in arb_message()) {
            let mut buf = [0u8; MAX_BODY_SIZE];
            let bare = encode(&msg, &mut buf).unwrap();
            prop_assert!(bare.len() <= MAX_BODY_SIZE);
            prop_assert_eq!(decode(bare), Ok(msg.clone()));
            let mut f = frame_of(&msg);
            prop_assert!(f.len() <= MAX_FRAME_SIZE);
            prop_assert_eq!(f.iter().filter(|&&b| b == 0).count(), 1);
            prop_assert_eq!(f.last(), Some(&0));
            prop_assert_eq!(decode_frame(&mut f), Ok(msg));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in pvec(any::<u8>(), 0..400)) {
            let _ = decode(&bytes);
            let mut copy = bytes.clone();
            let _ = decode_frame(&mut copy);
            let mut rx = FrameReceiver::new();
            let _ = feed_all(&mut rx, &[&bytes]);
        }

        /// The stream receiver agrees with decode_frame on any single frame body: same
        /// message, or an error from both.
        #[test]
        fn receiver_agrees_with_decode_frame(body in pvec(1u8..=255, 1..200)) {
            let mut frame = body.clone();
            frame.push(0);
            let direct = decode_frame(&mut frame.clone());
            let mut rx = FrameReceiver::new();
            let got = feed_all(&mut rx, &[&frame]);
            prop_assert_eq!(got.len(), 1);
            match (&got[0], &direct) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                _ => prop_assert!(false, "receiver {:?} vs decode_frame {:?}", got[0], direct),
            }
        }

        /// Any chunking of a stream of frames yields the same messages in order.
        #[test]
        fn receiver_any_chunking(
            msgs in pvec(arb_message(), 1..6),
            cuts in pvec(any::<prop::sample::Index>(), 0..12),
        ) {
            let mut stream = Vec::new();
            for m in &msgs {
                stream.extend_from_slice(&frame_of(m));
            }
            let mut points: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
            points.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut start = 0;
            for p in points {
                chunks.push(&stream[start..p]);
                start = p;
            }
            chunks.push(&stream[start..]);
            let mut rx = FrameReceiver::new();
            let got = feed_all(&mut rx, &chunks);
            let want: Vec<Result<Message, DecodeError>> = msgs.into_iter().map(Ok).collect();
            prop_assert_eq!(got, want);
        }

        /// Console text (any bytes but NUL) and frames interleaved at random on one link, in
        /// any chunking, with the shared-UART wire rule (a delimiter before every frame): every
        /// frame decodes, in order, and the text comes out byte for byte; no text run is ever
        /// taken for a frame.
        #[test]
        fn text_and_frames_interleaved_lose_nothing(
            parts in pvec(prop_oneof![
                arb_message().prop_map(Ok),
                pvec(1u8..=255, 0..600).prop_map(Err),
            ], 1..12),
            cuts in pvec(any::<prop::sample::Index>(), 0..24),
        ) {
            let mut stream = Vec::new();
            let (mut want_msgs, mut want_text) = (Vec::new(), Vec::new());
            for p in &parts {
                match p {
                    Ok(m) => {
                        stream.push(0);
                        stream.extend_from_slice(&frame_of(m));
                        want_msgs.push(m.clone());
                    }
                    Err(t) => {
                        stream.extend_from_slice(t);
                        want_text.extend_from_slice(t);
                    }
                }
            }
            // The next frame's leading delimiter ends the text after the last one.
            stream.push(0);
            let (msgs, text, _) = feed_text_all(&chunked(&stream, &cuts));
            prop_assert_eq!(msgs, want_msgs);
            prop_assert_eq!(text, want_text);
        }

        /// Whatever bytes arrive, `feed_text` never panics, never holds more than its buffer,
        /// and hands out every byte that is neither a delimiter nor part of a message.
        #[test]
        fn feed_text_accounts_for_every_byte(
            bytes in pvec(any::<u8>(), 0..3000),
            cuts in pvec(any::<prop::sample::Index>(), 0..12),
        ) {
            let mut stream = bytes.clone();
            stream.push(0);
            let (msgs, text, _) = feed_text_all(&chunked(&stream, &cuts));
            let zeros = stream.iter().filter(|&&b| b == 0).count();
            let framed: usize = msgs.iter().map(|m| frame_of(m).len() - 1).sum();
            prop_assert_eq!(text.len() + framed + zeros, stream.len());
        }

        /// The late-TSC encoder is byte-identical to encode_frame for any values.
        #[test]
        fn probe_reply_frame_equals_encode_frame(seq: u8, vcpu: u32, tsc: u64) {
            let low = u32::try_from(tsc & 0xffff_ffff).unwrap();
            let compact = Message::ProbeReply(ProbeReply { seq, vcpu, tsc_low32: low });
            let mut f = ProbeReplyFrame::compact(seq, vcpu);
            prop_assert_eq!(f.finish(GuestTicks(tsc)), &frame_of(&compact)[..]);
            let full = Message::ProbeReplyFull(ProbeReplyFull { seq, vcpu, tsc });
            let mut f = ProbeReplyFrame::full(seq, vcpu);
            prop_assert_eq!(f.finish(GuestTicks(tsc)), &frame_of(&full)[..]);
        }
    }
}
