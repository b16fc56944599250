//! One vsock stream connection, driven directly on virtio-drivers' `VirtIOSocket`.
//!
//! virtio-drivers' `VsockConnectionManager` would do, but it keeps the peer's credit private,
//! so a caller cannot wait for credit *before* reading the TSC for a probe reply, and it carries
//! multi-connection bookkeeping the agent never uses. [`OneStream`] tracks one connection: it
//! mirrors the peer's credit from every packet header (`buf_alloc`, `fwd_cnt`, virtio spec
//! 5.10.6.3 "Flow control") so [`Stream::can_send`] is exact, buffers received bytes, answers
//! credit requests, and either connects to the host ([`OneStream::connect`]) or accepts one
//! host connection ([`OneStream::accept`]); any other connection request is reset.

use virtio_drivers::device::socket::{
    ConnectionInfo, DisconnectReason, VirtIOSocket, VsockAddr, VsockEvent, VsockEventType,
};
use virtio_drivers::transport::Transport as VirtioTransport;
use virtio_drivers::{Error, Hal};
use vmtsync_core::arch::Tsc;

use crate::vsock::{HOST_CID, LOCAL_PORT, Stream, StreamError, VsockError, stream_error};

/// Size of each receive buffer the device fills (header + body), so the largest body.
pub const RX_BUFFER_SIZE: usize = 512;
/// Receive space the agent grants the peer (`buf_alloc`): bytes it can hold unread.
const RX_CAPACITY_U32: u32 = 1024;
/// [`RX_CAPACITY_U32`] as a length (lossless: u32 fits usize on x86_64).
const RX_CAPACITY: usize = RX_CAPACITY_U32 as usize;
const _: () = assert!(RX_CAPACITY >= 2 * RX_BUFFER_SIZE);
/// Bytes read since the peer last heard our `fwd_cnt` after which a credit update is sent.
/// Every packet the agent sends carries `fwd_cnt`, so with one reply per request this only
/// matters if the host sends many requests without waiting for replies.
const CREDIT_UPDATE_THRESHOLD: u32 = RX_CAPACITY_U32 / 2;

/// One stream connection with the host: from [`LOCAL_PORT`] to a host port
/// ([`OneStream::connect`]), or from a host port to a local one ([`OneStream::accept`]).
pub struct OneStream<H: Hal, T: VirtioTransport> {
    sock: VirtIOSocket<H, T, RX_BUFFER_SIZE>,
    info: ConnectionInfo,
    /// The peer's receive space and consumed count, from the last packet it sent.
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Body bytes sent on this connection.
    tx_cnt: u32,
    /// Body bytes read out of `rx` since the last packet we sent.
    unreported: u32,
    rx: RxBuf,
    connected: bool,
    closed: bool,
    /// While accepting: the local port a host connection request may arrive on.
    listen_port: Option<u32>,
}

impl<H: Hal, T: VirtioTransport> core::fmt::Debug for OneStream<H, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("OneStream")
            .field("guest_cid", &self.sock.guest_cid())
            .field("peer", &self.info.dst)
            .field("connected", &self.connected)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl<H: Hal, T: VirtioTransport> OneStream<H, T> {
    /// Initialises the socket device on `transport`, for a stream to host CID 2, port `port`
    /// ([`OneStream::connect`]) or from the host ([`OneStream::accept`]).
    ///
    /// # Errors
    /// [`VsockError::Device`] when the device does not initialise.
    pub fn new(transport: T, port: u32) -> Result<Self, VsockError> {
        let sock = VirtIOSocket::new(transport).map_err(VsockError::Device)?;
        Ok(Self {
            sock,
            info: Self::fresh_info(port),
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            unreported: 0,
            rx: RxBuf::new(),
            connected: false,
            closed: false,
            listen_port: None,
        })
    }

    fn fresh_info(port: u32) -> ConnectionInfo {
        let mut info = ConnectionInfo::new(
            VsockAddr {
                cid: HOST_CID,
                port,
            },
            LOCAL_PORT,
        );
        info.buf_alloc = RX_CAPACITY_U32;
        info
    }

    /// The CID the device assigned to this guest.
    pub fn guest_cid(&self) -> u64 {
        self.sock.guest_cid()
    }

    /// The peer's port: the one connected to, or the host's (ephemeral) one after an accept.
    pub fn peer_port(&self) -> u32 {
        self.info.dst.port
    }

    /// Forgets the previous connection's state and starts over with `info`.
    fn reset(&mut self, mut info: ConnectionInfo) {
        info.buf_alloc = RX_CAPACITY_U32;
        self.info = info;
        (
            self.peer_buf_alloc,
            self.peer_fwd_cnt,
            self.tx_cnt,
            self.unreported,
        ) = (0, 0, 0, 0);
        self.rx.clear();
        (self.connected, self.closed, self.listen_port) = (false, false, None);
    }

    /// Waits at most `timeout_cycles` of `clock` for a host connection to local port `port`
    /// (with vhost-device-vsock: the host connects to `<uds-path>` and writes
    /// `CONNECT <port>`), and accepts the first one. Requests to other ports are reset.
    ///
    /// # Errors
    /// [`VsockError::Device`] or [`VsockError::Timeout`].
    pub fn accept<C: Tsc>(
        &mut self,
        port: u32,
        clock: &C,
        timeout_cycles: u64,
    ) -> Result<(), VsockError> {
        self.reset(ConnectionInfo::new(VsockAddr::default(), port));
        self.listen_port = Some(port);
        let start = clock.read_ordered();
        while !self.connected {
            self.poll_device().map_err(VsockError::Device)?;
            if clock.read_ordered().wrapping_sub(start) > timeout_cycles {
                self.listen_port = None;
                return Err(VsockError::Timeout);
            }
        }
        Ok(())
    }

    /// Sends a connection request and waits at most `timeout_cycles` of `clock` for the answer.
    /// After [`VsockError::Refused`] or [`VsockError::Timeout`] it may be called again.
    ///
    /// # Errors
    /// [`VsockError::Device`], [`VsockError::Refused`] (the host reset the request: nothing
    /// listens on the port yet) or [`VsockError::Timeout`].
    pub fn connect<C: Tsc>(&mut self, clock: &C, timeout_cycles: u64) -> Result<(), VsockError> {
        self.reset(Self::fresh_info(self.info.dst.port));
        self.sock.connect(&self.info).map_err(VsockError::Device)?;
        let start = clock.read_ordered();
        loop {
            self.poll_device().map_err(VsockError::Device)?;
            if self.connected {
                return Ok(());
            }
            if self.closed {
                return Err(VsockError::Refused);
            }
            if clock.read_ordered().wrapping_sub(start) > timeout_cycles {
                let _ = self.sock.force_close(&self.info);
                return Err(VsockError::Timeout);
            }
        }
    }

    /// Credit the peer has granted us: `buf_alloc - (tx_cnt - fwd_cnt)` (spec 5.10.6.3).
    fn peer_free(&self) -> u32 {
        peer_credit(self.peer_buf_alloc, self.tx_cnt, self.peer_fwd_cnt)
    }

    fn is_ours(&self, ev: &VsockEvent) -> bool {
        ev.matches_connection(&self.info, self.sock.guest_cid())
    }

    /// Handles at most one device event. Skipped while `rx` could not take a whole body.
    fn poll_device(&mut self) -> Result<(), Error> {
        if !self.rx.make_room(RX_BUFFER_SIZE) {
            return Ok(());
        }
        let guest_cid = self.sock.guest_cid();
        let (info, rx) = (&mut self.info, &mut self.rx);
        let (peer_buf_alloc, peer_fwd_cnt) = (&mut self.peer_buf_alloc, &mut self.peer_fwd_cnt);
        let event = self.sock.poll(|ev, body| {
            if ev.matches_connection(info, guest_cid) {
                info.update_for_event(&ev);
                *peer_buf_alloc = ev.buffer_status.buffer_allocation;
                *peer_fwd_cnt = ev.buffer_status.forward_count;
                if let VsockEventType::Received { .. } = ev.event_type {
                    // A body never exceeds RX_BUFFER_SIZE, and that much room was made.
                    if !rx.push(body) {
                        return Err(Error::IoError);
                    }
                }
            }
            Ok(Some(ev))
        })?;
        let Some(ev) = event else {
            return Ok(());
        };
        if !self.is_ours(&ev) {
            if ev.event_type == VsockEventType::ConnectionRequest {
                let request = ConnectionInfo::new(ev.source, ev.destination.port);
                if self.listen_port == Some(ev.destination.port)
                    && ev.destination.cid == self.sock.guest_cid()
                {
                    self.reset(request);
                    self.info.update_for_event(&ev);
                    self.peer_buf_alloc = ev.buffer_status.buffer_allocation;
                    self.peer_fwd_cnt = ev.buffer_status.forward_count;
                    self.sock.accept(&self.info)?;
                    self.connected = true;
                } else {
                    self.sock.force_close(&request)?;
                }
            }
            return Ok(());
        }
        match ev.event_type {
            VsockEventType::Connected => self.connected = true,
            VsockEventType::Disconnected { reason } => {
                self.closed = true;
                if reason == DisconnectReason::Shutdown {
                    self.sock.force_close(&self.info)?;
                }
            }
            VsockEventType::CreditRequest => {
                self.sock.credit_update(&self.info)?;
                self.unreported = 0;
            }
            VsockEventType::ConnectionRequest
            | VsockEventType::Received { .. }
            | VsockEventType::CreditUpdate => {}
        }
        Ok(())
    }
}

impl<H: Hal, T: VirtioTransport> Stream for OneStream<H, T> {
    fn read(&mut self, buf: &mut [u8]) -> Result<usize, StreamError> {
        if self.rx.is_empty() && self.closed {
            return Err(StreamError::Closed);
        }
        let n = self.rx.drain(buf);
        self.info.done_forwarding(n);
        // n <= RX_CAPACITY, so the conversion cannot fail.
        let n32 = u32::try_from(n).unwrap_or(u32::MAX);
        self.unreported = self.unreported.wrapping_add(n32);
        if self.unreported >= CREDIT_UPDATE_THRESHOLD {
            self.sock.credit_update(&self.info).map_err(stream_error)?;
            self.unreported = 0;
        }
        Ok(n)
    }

    fn can_send(&self, len: usize) -> bool {
        u32::try_from(len).is_ok_and(|l| self.peer_free() >= l)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), StreamError> {
        if self.closed {
            return Err(StreamError::Closed);
        }
        let len = u32::try_from(bytes.len()).map_err(|_| StreamError::Device)?;
        self.sock
            .send(bytes, &mut self.info)
            .map_err(stream_error)?;
        self.tx_cnt = self.tx_cnt.wrapping_add(len);
        // The packet header carried our fwd_cnt.
        self.unreported = 0;
        Ok(())
    }

    fn pump(&mut self) -> Result<(), StreamError> {
        self.poll_device().map_err(stream_error)
    }
}

/// The credit a peer has granted: `buf_alloc - (tx_cnt - fwd_cnt)`, in the spec's wrapping
/// 32-bit counters (virtio 1.2, 5.10.6.3).
#[must_use]
pub fn peer_credit(buf_alloc: u32, tx_cnt: u32, fwd_cnt: u32) -> u32 {
    buf_alloc.wrapping_sub(tx_cnt.wrapping_sub(fwd_cnt))
}

/// Received bytes not yet read: a linear buffer that is compacted when a whole receive
/// buffer's worth of room is needed at its end.
#[derive(Debug)]
struct RxBuf {
    bytes: [u8; RX_CAPACITY],
    start: usize,
    end: usize,
}

impl RxBuf {
    const fn new() -> Self {
        Self {
            bytes: [0; RX_CAPACITY],
            start: 0,
            end: 0,
        }
    }

    fn clear(&mut self) {
        (self.start, self.end) = (0, 0);
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Makes `n` bytes of room at the end, moving the unread bytes to the front if needed;
    /// false when there is not that much free space in all.
    fn make_room(&mut self, n: usize) -> bool {
        if RX_CAPACITY - (self.end - self.start) < n {
            return false;
        }
        if self.end + n > RX_CAPACITY {
            self.bytes.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        true
    }

    /// Appends `body` if it fits at the end (see [`RxBuf::make_room`]).
    fn push(&mut self, body: &[u8]) -> bool {
        let Some(dst) = self.bytes.get_mut(self.end..self.end + body.len()) else {
            return false;
        };
        dst.copy_from_slice(body);
        self.end += body.len();
        true
    }

    /// Moves up to `out.len()` unread bytes into `out`; returns how many.
    fn drain(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.bytes[self.start..self.start + n]);
        self.start += n;
        if self.start == self.end {
            self.clear();
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_follows_the_wrapping_counters() {
        assert_eq!(peer_credit(1024, 0, 0), 1024);
        assert_eq!(peer_credit(1024, 1000, 400), 424);
        assert_eq!(peer_credit(1024, 1024, 0), 0);
        // tx_cnt wrapped past u32::MAX, fwd_cnt not yet.
        assert_eq!(peer_credit(4096, 10, u32::MAX - 9), 4096 - 20);
        assert_eq!(peer_credit(0, 0, 0), 0);
    }

    #[test]
    fn rx_buffer_keeps_order_across_compaction_and_refuses_overflow() {
        let mut rx = RxBuf::new();
        let mut out = [0u8; RX_CAPACITY];
        let mut next = 0u8;
        let mut expect = 0u8;
        for round in 0..50 {
            while rx.make_room(RX_BUFFER_SIZE) {
                let body: Vec<u8> = (0..300)
                    .map(|_| {
                        next = next.wrapping_add(1);
                        next
                    })
                    .collect();
                assert!(rx.push(&body));
            }
            // Read a varying amount, then check the stream is contiguous.
            let n = rx.drain(&mut out[..100 + round * 7]);
            for &b in &out[..n] {
                expect = expect.wrapping_add(1);
                assert_eq!(b, expect, "round {round}");
            }
        }
        let mut full = RxBuf::new();
        assert!(full.push(&[1; RX_CAPACITY]));
        assert!(!full.make_room(1));
        assert!(!full.push(&[1]));
        assert_eq!(full.drain(&mut out), RX_CAPACITY);
        assert!(full.is_empty());
    }
}
