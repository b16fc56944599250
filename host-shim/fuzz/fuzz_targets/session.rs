//! The host's receive path: a guest byte stream, in a chunking chosen by the input, through
//! `ProbeSession` (hello, probes, shutdown) exactly as `vmtsync probe` runs it. A panic is a
//! crash, and so is a sample the session should never return: one whose host stamps are out of
//! order or whose vCPU is not the one the agent announced.
//!
//! Input: the first byte picks the chunk size (low 6 bits) and, with its top bit set, has every
//! frame's checksum rewritten to match (`reseal_stream`), so mutations get past the CRC into
//! the session's logic; the rest is what the "guest" sends. The transport never blocks: once
//! the stream is used up it reports the connection closed.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use vmtsync::link::transport::host_tsc_now;
use vmtsync::link::{Received, StampedTransport, TransportError};
use vmtsync::probe::ProbeSession;
use vmtsync_core::HostTicks;
use vmtsync_core::proto::{MAX_FRAME_SIZE, reseal_stream};

/// The most probes one input drives (each needs its reply in the stream anyway).
const MAX_PROBES: usize = 64;

/// Replays the guest's bytes in fixed chunks; counts what the host sends.
struct Scripted<'a> {
    chunks: std::slice::Chunks<'a, u8>,
    sent_frames: usize,
}

impl StampedTransport for Scripted<'_> {
    fn send(&mut self, frame: &[u8]) -> Result<HostTicks, TransportError> {
        assert!(
            frame.len() <= MAX_FRAME_SIZE,
            "the host sent an overlong frame"
        );
        self.sent_frames += 1;
        Ok(host_tsc_now())
    }

    fn recv(&mut self, buf: &mut [u8], _deadline: Instant) -> Result<Received, TransportError> {
        let chunk = self.chunks.next().ok_or(TransportError::Closed)?;
        let len = chunk.len().min(buf.len());
        buf[..len].copy_from_slice(&chunk[..len]);
        Ok(Received {
            len,
            stamp: host_tsc_now(),
        })
    }
}

fuzz_target!(|data: &[u8]| {
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
    let transport = Scripted {
        chunks: stream.chunks(chunk),
        sent_frames: 0,
    };
    let Ok(mut session) = ProbeSession::hello(transport, Duration::from_secs(1)) else {
        return;
    };
    let vcpu = session.info().vcpu;
    for _ in 0..MAX_PROBES {
        match session.probe() {
            Ok(Some(s)) => {
                assert!(s.host_send <= s.host_recv, "stamps out of order: {s:?}");
                assert_eq!(s.vcpu, vcpu, "a sample of another vCPU");
            }
            Ok(None) => {}
            Err(_) => break,
        }
    }
    let _ = session.shutdown();
});
