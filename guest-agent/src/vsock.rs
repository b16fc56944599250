//! The virtio-vsock link: the probe protocol over a vsock stream between the agent and the host.
//!
//! Layers, bottom up:
//!
//! - [`open_pci`]: finds the virtio socket device on PCI bus 0 (QEMU `vhost-user-vsock-pci`,
//!   modern device id 0x1053), places its BARs ([`crate::pci`]), builds virtio-drivers'
//!   `PciTransport`. [`open_mmio`] does the same for virtio-mmio windows named on the command
//!   line (QEMU `microvm` with `vhost-user-vsock-device`).
//! - [`OneStream`](crate::vsock_stream::OneStream): virtio-drivers' `VirtIOSocket` driven for
//!   one stream connection, to host CID 2 on the given port or accepted from the host, with a
//!   deadline. With vhost-device-vsock a guest connection to port P arrives on the host as a
//!   connection to the Unix socket `<uds-path>_P`; the host reaches a listening guest through
//!   `<uds-path>` and `CONNECT P`.
//! - [`Stream`]: what the link needs from a connection (read, credit, send, pump the device),
//!   so the link's logic is tested on the host against a fake.
//! - [`VsockLink`]: the agent's `vmtsync_core::agent::Link` over a [`Stream`]: it buffers
//!   frames until the agent's flush point (one packet for a whole drain answer, up to
//!   [`TX_BUFFER`]); a packet waits, pumping the device, until the peer has granted credit for
//!   all of it (virtio-drivers refuses a send with `InsufficientBufferSpaceInPeer` until a
//!   credit update arrives), up to a TSC deadline.
//!
//! Everything runs in ring 3 (natively on the project's nested KVM): PCI configuration through
//! ports with IOPL 3, the BARs and virtqueues through the user-accessible identity map.

use alloc::vec::Vec;
use core::ptr::NonNull;

use virtio_drivers::device::socket::{SocketError, VMADDR_CID_HOST};
use virtio_drivers::transport::mmio::{MmioTransport, VirtIOHeader};
use virtio_drivers::transport::pci::bus::{ConfigurationAccess, DeviceFunction, PciRoot};
use virtio_drivers::transport::pci::{PciTransport, VirtioPciError, virtio_device_type};
use virtio_drivers::transport::{
    DeviceStatus, DeviceType, InterruptStatus, Transport as VirtioTransport,
};
use virtio_drivers::{Error, Hal, PhysAddr};
use vmtsync_core::agent::{Link, LinkError};
use vmtsync_core::arch::Tsc;
use vmtsync_core::arch::x86_64::NativeTsc;
use vmtsync_core::proto::Transport;

use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::options::VirtioMmio;
use crate::pci::{AssignedBar, BarError, MmioWindow, assign_memory_bars};

/// The host's CID (virtio spec 5.10.4: `VMADDR_CID_HOST`).
pub const HOST_CID: u64 = VMADDR_CID_HOST;
/// The agent's own port for its connection to the host.
pub const LOCAL_PORT: u32 = 49_152;
/// isa-debug-exit code when the vsock transport cannot be set up (QEMU status 0xf9).
pub const SETUP_FAILED_EXIT_CODE: u8 = 0x7c;

/// Why the vsock transport could not be set up.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VsockError {
    /// No virtio socket device on PCI bus 0 or the named virtio-mmio windows (is
    /// `-device vhost-user-vsock-pci` / `vhost-user-vsock-device` there?).
    NoDevice,
    /// Its BARs could not be placed.
    Bars(BarError),
    /// virtio-drivers rejected the PCI device.
    Pci(VirtioPciError),
    /// The socket device failed.
    Device(Error),
    /// The host reset the connection (nothing listening on the port).
    Refused,
    /// No answer to the connection request before the deadline.
    Timeout,
}

impl VsockError {
    /// A short description for the log. Deliberately not `Debug`: formatting the nested
    /// virtio-drivers errors costs kilobytes of `.text` in an agent meant to stay small.
    #[must_use]
    pub fn describe(&self) -> &'static str {
        match self {
            Self::NoDevice => "no virtio socket device found",
            Self::Bars(BarError::WindowFull { .. }) => "BARs do not fit the MMIO window",
            Self::Bars(_) => "a BAR does not decode or fit below 4 GiB",
            Self::Pci(_) => "virtio-drivers rejected the PCI device",
            Self::Device(Error::DmaError) => "out of DMA memory (heap too small)",
            Self::Device(Error::NotReady) => "device not ready",
            Self::Device(Error::SocketDeviceError(_)) => "socket protocol error",
            Self::Device(_) => "virtio device error",
            Self::Refused => "connection refused (nothing listens on the host port)",
            Self::Timeout => "no answer to the connection request",
        }
    }
}

/// The socket device's transport: PCI (q35) or virtio-mmio (microvm), plus a settling pause
/// after the driver sets DRIVER_OK.
///
/// virtio-drivers' own `SomeTransport` would do for the choice, but it also carries its pKVM
/// variant, whose code (hypercalls, never executed here, but `vmcall` livelocks the project's
/// nested KVM) would be linked into the agent.
///
/// The pause: with QEMU's vhost-user devices and vhost-device-vsock 0.3, a queue notification
/// sent right after DRIVER_OK, while QEMU is still handing the queues to the backend, is
/// sometimes lost (seen about once in ten boots with five VMs sharing two CPUs). virtio-drivers
/// notifies the receive queue once at initialisation and then waits for used buffers without
/// notifying again, so a lost notification hangs the device for good: the backend believes it
/// has no receive buffers, or the driver spins on a send forever. Waiting before the first
/// notification closes that window.
#[derive(Debug)]
pub struct VsockTransport {
    inner: AnyTransport,
    settle_cycles: u64,
}

#[derive(Debug)]
enum AnyTransport {
    Pci(PciTransport),
    Mmio(MmioTransport<'static>),
}

impl VsockTransport {
    /// A PCI transport that pauses `settle_cycles` TSC cycles after DRIVER_OK.
    pub fn pci(t: PciTransport, settle_cycles: u64) -> Self {
        Self {
            inner: AnyTransport::Pci(t),
            settle_cycles,
        }
    }

    /// A virtio-mmio transport that pauses `settle_cycles` TSC cycles after DRIVER_OK.
    pub fn mmio(t: MmioTransport<'static>, settle_cycles: u64) -> Self {
        Self {
            inner: AnyTransport::Mmio(t),
            settle_cycles,
        }
    }
}

/// Forwards a `Transport` method to whichever transport is inside.
macro_rules! forward {
    ($self:ident, $t:ident => $e:expr) => {
        match &mut $self.inner {
            AnyTransport::Pci($t) => $e,
            AnyTransport::Mmio($t) => $e,
        }
    };
}

/// Like [`forward!`] for `&self` methods.
macro_rules! forward_ref {
    ($self:ident, $t:ident => $e:expr) => {
        match &$self.inner {
            AnyTransport::Pci($t) => $e,
            AnyTransport::Mmio($t) => $e,
        }
    };
}

impl VirtioTransport for VsockTransport {
    fn device_type(&self) -> DeviceType {
        forward_ref!(self, t => t.device_type())
    }
    fn read_device_features(&mut self) -> u64 {
        forward!(self, t => t.read_device_features())
    }
    fn write_driver_features(&mut self, driver_features: u64) {
        forward!(self, t => t.write_driver_features(driver_features));
    }
    fn max_queue_size(&mut self, queue: u16) -> u32 {
        forward!(self, t => t.max_queue_size(queue))
    }
    fn notify(&mut self, queue: u16) {
        forward!(self, t => t.notify(queue));
    }
    fn get_status(&self) -> DeviceStatus {
        forward_ref!(self, t => t.get_status())
    }
    fn set_status(&mut self, status: DeviceStatus) {
        forward!(self, t => t.set_status(status));
        if status.contains(DeviceStatus::DRIVER_OK) {
            let tsc = NativeTsc::lfence_rdtsc();
            let t0 = tsc.read_ordered();
            while tsc.read_ordered().wrapping_sub(t0) < self.settle_cycles {
                core::hint::spin_loop();
            }
        }
    }
    fn set_guest_page_size(&mut self, guest_page_size: u32) {
        forward!(self, t => t.set_guest_page_size(guest_page_size));
    }
    fn requires_legacy_layout(&self) -> bool {
        forward_ref!(self, t => t.requires_legacy_layout())
    }
    fn queue_set(
        &mut self,
        queue: u16,
        size: u32,
        descriptors: PhysAddr,
        driver_area: PhysAddr,
        device_area: PhysAddr,
    ) {
        forward!(self, t => t.queue_set(queue, size, descriptors, driver_area, device_area));
    }
    fn queue_unset(&mut self, queue: u16) {
        forward!(self, t => t.queue_unset(queue));
    }
    fn queue_used(&mut self, queue: u16) -> bool {
        forward!(self, t => t.queue_used(queue))
    }
    fn ack_interrupt(&mut self) -> InterruptStatus {
        forward!(self, t => t.ack_interrupt())
    }
    fn read_config_generation(&self) -> u32 {
        forward_ref!(self, t => t.read_config_generation())
    }
    fn read_config_space<T: FromBytes + IntoBytes>(
        &self,
        offset: usize,
    ) -> virtio_drivers::Result<T> {
        forward_ref!(self, t => t.read_config_space(offset))
    }
    fn write_config_space<T: IntoBytes + Immutable>(
        &mut self,
        offset: usize,
        value: T,
    ) -> virtio_drivers::Result<()> {
        forward!(self, t => t.write_config_space(offset, value))
    }
}

/// The end of the agent's identity map (boot.rs maps the first 4 GiB).
const IDENTITY_MAP_END: u64 = 1 << 32;

/// The first of `devices` (virtio-mmio windows from the command line) that holds a virtio
/// socket device, as a transport. Windows outside the identity map, or without a valid
/// virtio-mmio header, are skipped.
///
/// # Errors
/// [`VsockError::NoDevice`] when none holds a socket device.
pub fn open_mmio(devices: &[Option<VirtioMmio>]) -> Result<MmioTransport<'static>, VsockError> {
    devices
        .iter()
        .flatten()
        .filter(|d| {
            d.base != 0
                && d.base
                    .checked_add(d.size)
                    .is_some_and(|e| e <= IDENTITY_MAP_END)
        })
        .find_map(|d| {
            let header = NonNull::new(usize::try_from(d.base).ok()? as *mut VirtIOHeader)?;
            let size = usize::try_from(d.size).ok()?;
            // SAFETY: the window is inside the identity map (checked above), so it is mapped
            // (user-accessible, like all of it); QEMU put a virtio-mmio register block there
            // when it named it on the command line, and nothing else in the agent touches it.
            let t = unsafe { MmioTransport::new(header, size) }.ok()?;
            (t.device_type() == DeviceType::Socket).then_some(t)
        })
        .ok_or(VsockError::NoDevice)
}

/// Finds the virtio socket device on bus 0 of `root`.
pub fn find_socket<C: ConfigurationAccess>(root: &PciRoot<C>) -> Option<DeviceFunction> {
    root.enumerate_bus(0)
        .find(|(_, info)| virtio_device_type(info) == Some(DeviceType::Socket))
        .map(|(df, _)| df)
}

/// Finds the virtio socket device, places its unassigned memory BARs in `window` (reporting
/// each to `placed`), and builds its PCI transport.
///
/// # Errors
/// [`VsockError::NoDevice`], [`VsockError::Bars`] or [`VsockError::Pci`].
pub fn open_pci<H: Hal, C: ConfigurationAccess>(
    cam: C,
    window: &mut MmioWindow,
    placed: impl FnMut(AssignedBar),
) -> Result<(PciTransport, DeviceFunction), VsockError> {
    let mut root = PciRoot::new(cam);
    let df = find_socket(&root).ok_or(VsockError::NoDevice)?;
    assign_memory_bars(&mut root, df, window, placed).map_err(VsockError::Bars)?;
    let t = PciTransport::new::<H, C>(&mut root, df).map_err(VsockError::Pci)?;
    Ok((t, df))
}

/// Why a [`Stream`] operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamError {
    /// The peer has not granted enough credit yet: pump and retry.
    NoCredit,
    /// The connection is gone (reset or shut down by the peer).
    Closed,
    /// The device reported an error.
    Device,
}

/// A connected byte stream, as [`VsockLink`] uses it.
pub trait Stream {
    /// Copies bytes already received into `buf`; `Ok(0)` when there are none. Never blocks.
    ///
    /// # Errors
    /// [`StreamError::Closed`] once the connection is gone and drained.
    fn read(&mut self, buf: &mut [u8]) -> Result<usize, StreamError>;
    /// Whether the peer has granted credit for a `len`-byte packet body right now.
    fn can_send(&self, len: usize) -> bool;
    /// Sends `bytes` as one packet, or refuses with [`StreamError::NoCredit`].
    ///
    /// # Errors
    /// [`StreamError`].
    fn send(&mut self, bytes: &[u8]) -> Result<(), StreamError>;
    /// Handles at most one pending device event (received data, a credit update, a reset).
    ///
    /// # Errors
    /// [`StreamError::Device`].
    fn pump(&mut self) -> Result<(), StreamError>;
}

/// Maps a virtio-drivers error to what the link does about it.
pub(crate) fn stream_error(e: Error) -> StreamError {
    match e {
        Error::SocketDeviceError(SocketError::InsufficientBufferSpaceInPeer) => {
            StreamError::NoCredit
        }
        Error::SocketDeviceError(SocketError::NotConnected | SocketError::PeerSocketShutdown) => {
            StreamError::Closed
        }
        _ => StreamError::Device,
    }
}

/// Counters of a [`VsockLink`], for the agent's log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Sends that had to wait for peer credit.
    pub credit_waits: u32,
    /// Sends refused (no credit before the deadline, or a stream error).
    pub refused_sends: u32,
    /// Stream errors seen while receiving or pumping.
    pub errors: u32,
    /// Packets sent (each holds one frame or many).
    pub packets: u32,
    /// The connection has closed.
    pub closed: bool,
}

/// Bytes a [`VsockLink`] holds back until [`Link::flush`]: one packet carries this much at
/// most. A drain answer of many event batches then costs one device round trip per 16 KiB
/// instead of one per batch: virtio-drivers' send waits until the device has used the packet,
/// so the number of packets, not their size, bounds the agent's event rate (docs/vsock.md).
/// vhost-device-vsock grants 64 KiB of credit, so a full buffer never waits for credit there.
pub const TX_BUFFER: usize = 16 * 1024;

/// The agent's [`Link`] over a vsock [`Stream`].
///
/// Frames are buffered ([`TX_BUFFER`] bytes, taken from the heap once; without that memory
/// every frame is its own packet) and leave as one packet at [`Link::flush`], or when the next
/// frame does not fit. A packet waits, pumping the device, until the peer has granted credit
/// for all of it (virtio-drivers refuses a send with `InsufficientBufferSpaceInPeer` until a
/// credit update arrives), for at most the send deadline; then it is refused with
/// [`LinkError::WouldBlock`] and its frames are dropped. A probe reply that waited still
/// carries a TSC read inside the host's bracket, only less tightly; the vhost backend grants
/// ample credit, so this is rare.
#[derive(Debug)]
pub struct VsockLink<S, C> {
    stream: S,
    clock: C,
    send_timeout_cycles: u64,
    stats: LinkStats,
    /// Frames held back; its capacity (allocated once) is the most one packet carries.
    tx: Vec<u8>,
}

impl<S: Stream, C: Tsc> VsockLink<S, C> {
    /// A link on `stream` whose sends give up after `send_timeout_cycles` of `clock` without
    /// peer credit, buffering up to [`TX_BUFFER`] bytes per packet.
    pub fn new(stream: S, clock: C, send_timeout_cycles: u64) -> Self {
        Self::with_buffer(stream, clock, send_timeout_cycles, TX_BUFFER)
    }

    /// As [`VsockLink::new`] with a `buffer`-byte packet buffer (0: every frame is a packet).
    /// If the heap cannot give that much, the link sends every frame at once.
    pub fn with_buffer(stream: S, clock: C, send_timeout_cycles: u64, buffer: usize) -> Self {
        let mut tx = Vec::new();
        // No panic on a full heap: an unbuffered link still works, only with more packets.
        let _ = tx.try_reserve_exact(buffer);
        Self {
            stream,
            clock,
            send_timeout_cycles,
            stats: LinkStats::default(),
            tx,
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// The stream (tests inspect it).
    pub fn stream_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// Takes the stream back (to reconnect after the peer closed it).
    pub fn into_stream(self) -> S {
        self.stream
    }

    fn note(&mut self, e: StreamError) -> LinkError {
        match e {
            StreamError::Closed => {
                self.stats.closed = true;
                LinkError::Closed
            }
            StreamError::NoCredit => LinkError::WouldBlock,
            StreamError::Device => {
                self.stats.errors = self.stats.errors.wrapping_add(1);
                LinkError::Io
            }
        }
    }

    fn refuse(&mut self, e: StreamError) -> LinkError {
        self.stats.refused_sends = self.stats.refused_sends.wrapping_add(1);
        self.note(e)
    }

    /// Sends `bytes` as one packet once the peer has credit for it (see the type's docs).
    fn send_packet(&mut self, bytes: &[u8]) -> Result<(), LinkError> {
        if !self.stream.can_send(bytes.len()) {
            self.stats.credit_waits = self.stats.credit_waits.wrapping_add(1);
            let since = self.clock.read_ordered();
            while !self.stream.can_send(bytes.len()) {
                if self.clock.read_ordered().wrapping_sub(since) > self.send_timeout_cycles {
                    return Err(self.refuse(StreamError::NoCredit));
                }
                if let Err(e) = self.stream.pump() {
                    return Err(self.refuse(e));
                }
            }
        }
        self.stream.send(bytes).map_err(|e| self.refuse(e))?;
        self.stats.packets = self.stats.packets.wrapping_add(1);
        Ok(())
    }
}

impl<S: Stream, C: Tsc> Link for VsockLink<S, C> {
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        if self.tx.capacity() - self.tx.len() < frame.len() {
            self.flush()?;
        }
        if frame.len() > self.tx.capacity() {
            // Larger than the whole buffer (or no buffer): its own packet.
            return self.send_packet(frame);
        }
        // Fits the capacity reserved in `new`: no reallocation.
        self.tx.extend_from_slice(frame);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), LinkError> {
        if self.tx.is_empty() {
            return Ok(());
        }
        let mut tx = core::mem::take(&mut self.tx);
        let sent = self.send_packet(&tx);
        // Sent or refused, these frames are done with (see `Link::flush`).
        tx.clear();
        self.tx = tx;
        sent
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let n = match self.stream.read(buf) {
            Ok(0) => {
                self.stream.pump().map_err(|e| self.note(e))?;
                self.stream.read(buf)
            }
            other => other,
        };
        n.map_err(|e| self.note(e))
    }

    fn transport(&self) -> Transport {
        Transport::VirtioVsock
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::vec::Vec;

    use vmtsync_core::agent::fake::FakeClock;
    use vmtsync_core::agent::{Agent, AgentState};
    use vmtsync_core::arch::FakeTsc;
    use vmtsync_core::proto::{
        Features, Feed, FrameReceiver, Hello, MAX_FRAME_SIZE, Message, PROTOCOL_VERSION,
        encode_frame,
    };

    use super::*;

    /// A stream fed from chunks (each becomes readable after one pump, like a device event),
    /// granting credit after `credit_after_pumps` pumps.
    #[derive(Debug, Default)]
    struct FakeStream {
        arriving: VecDeque<Vec<u8>>,
        readable: VecDeque<u8>,
        sent: Vec<Vec<u8>>,
        pumps: u32,
        credit_after_pumps: u32,
        closed: bool,
    }

    impl Stream for FakeStream {
        fn read(&mut self, buf: &mut [u8]) -> Result<usize, StreamError> {
            if self.readable.is_empty() && self.closed {
                return Err(StreamError::Closed);
            }
            let n = buf.len().min(self.readable.len());
            for (d, s) in buf.iter_mut().zip(self.readable.drain(..n)) {
                *d = s;
            }
            Ok(n)
        }
        fn can_send(&self, _len: usize) -> bool {
            self.pumps >= self.credit_after_pumps
        }
        fn send(&mut self, bytes: &[u8]) -> Result<(), StreamError> {
            if self.closed {
                return Err(StreamError::Closed);
            }
            if !self.can_send(bytes.len()) {
                return Err(StreamError::NoCredit);
            }
            self.sent.push(bytes.to_vec());
            Ok(())
        }
        fn pump(&mut self) -> Result<(), StreamError> {
            self.pumps += 1;
            if let Some(c) = self.arriving.pop_front() {
                self.readable.extend(c);
            }
            Ok(())
        }
    }

    fn link(s: FakeStream) -> VsockLink<FakeStream, FakeTsc> {
        VsockLink::new(s, FakeTsc::new(0, 10), 1_000)
    }

    #[test]
    fn bytes_arrive_in_order_across_chunks_and_reads() {
        let mut s = FakeStream::default();
        s.arriving.push_back((0u8..200).collect());
        s.arriving.push_back(vec![7, 8]);
        let mut l = link(s);
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        for _ in 0..100 {
            let n = l.recv(&mut buf).expect("open stream");
            got.extend_from_slice(&buf[..n]);
        }
        let mut want: Vec<u8> = (0u8..200).collect();
        want.extend([7, 8]);
        assert_eq!(got, want);
        assert_eq!(l.recv(&mut buf), Ok(0));
        assert_eq!(l.stats(), LinkStats::default());
    }

    #[test]
    fn a_send_without_credit_pumps_until_credit_arrives() {
        let mut l = link(FakeStream {
            credit_after_pumps: 5,
            ..FakeStream::default()
        });
        assert_eq!(l.send(b"abc"), Ok(()));
        assert!(l.stream_mut().sent.is_empty(), "held until the flush");
        assert_eq!(l.flush(), Ok(()));
        assert_eq!(l.stream_mut().sent, vec![b"abc".to_vec()]);
        assert_eq!(l.stream_mut().pumps, 5);
        assert_eq!(l.stats().credit_waits, 1);
        assert_eq!(l.send(b"d").and_then(|()| l.flush()), Ok(()));
        assert_eq!(l.stats().credit_waits, 1, "no wait once credit is there");
        assert_eq!(l.stats().packets, 2);
        assert_eq!(l.stats().refused_sends, 0);
    }

    #[test]
    fn a_send_that_never_gets_credit_is_refused_at_the_deadline() {
        let mut l = link(FakeStream {
            credit_after_pumps: u32::MAX,
            ..FakeStream::default()
        });
        assert_eq!(l.send(b"abc"), Ok(()));
        assert_eq!(l.flush(), Err(LinkError::WouldBlock));
        assert!(l.stream_mut().sent.is_empty());
        // The refused frames are dropped, not sent by a later flush.
        assert_eq!(l.flush(), Ok(()));
        // The clock advances 10 per read and the deadline is 1000 cycles.
        let pumps = l.stream_mut().pumps;
        assert!((99..=101).contains(&pumps), "{pumps} pumps");
        assert_eq!(l.stats().refused_sends, 1);
        assert_eq!(l.stats().credit_waits, 1);
    }

    #[test]
    fn a_closed_stream_is_reported_not_retried() {
        let mut l = link(FakeStream {
            closed: true,
            ..FakeStream::default()
        });
        let mut buf = [0u8; 8];
        assert_eq!(l.recv(&mut buf), Err(LinkError::Closed));
        assert_eq!(
            l.send(b"x").and_then(|()| l.flush()),
            Err(LinkError::Closed)
        );
        let st = l.stats();
        assert!(st.closed);
        assert_eq!((st.refused_sends, st.errors), (1, 0));
        assert_eq!(l.stream_mut().pumps, 0);
    }

    #[test]
    fn frames_coalesce_up_to_the_buffer_and_oversized_ones_go_alone() {
        let mut l = VsockLink::with_buffer(FakeStream::default(), FakeTsc::new(0, 10), 1_000, 10);
        for f in [&b"abcd"[..], b"efgh"] {
            assert_eq!(l.send(f), Ok(()));
        }
        assert!(l.stream_mut().sent.is_empty());
        // Does not fit behind the first eight bytes: they leave first, in order.
        assert_eq!(l.send(b"ijk"), Ok(()));
        assert_eq!(l.stream_mut().sent, vec![b"abcdefgh".to_vec()]);
        // Larger than the buffer: what is held goes first, then the frame as its own packet.
        assert_eq!(l.send(b"0123456789ab"), Ok(()));
        assert_eq!(l.flush(), Ok(()));
        assert_eq!(
            l.stream_mut().sent,
            vec![
                b"abcdefgh".to_vec(),
                b"ijk".to_vec(),
                b"0123456789ab".to_vec()
            ]
        );
        assert_eq!(l.stats().packets, 3);
        // Without a buffer every frame is a packet at once.
        let mut l = VsockLink::with_buffer(FakeStream::default(), FakeTsc::new(0, 10), 1_000, 0);
        assert_eq!(l.send(b"x"), Ok(()));
        assert_eq!(l.stream_mut().sent, vec![b"x".to_vec()]);
    }

    /// A drain answer of many batches leaves in a few packets, each a whole number of frames,
    /// and the host's receiver decodes every batch from their concatenation.
    #[test]
    fn a_drain_answer_of_many_batches_leaves_in_few_packets() {
        use vmtsync_core::recorder::Ring;
        let ring: &'static Ring<4096> = std::boxed::Box::leak(std::boxed::Box::new(Ring::new()));
        let tsc = FakeTsc::new(1 << 40, 2_600);
        for i in 0..4_000u32 {
            assert!(
                ring.view()
                    .record(&tsc, 7, &u64::from(i).to_le_bytes())
                    .is_ok()
            );
        }
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let mut s = FakeStream::default();
        for m in [
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: Features::EVENTS,
            }),
            Message::EventsRequest { max: 4_000 },
        ] {
            s.arriving
                .push_back(encode_frame(&m, &mut buf).expect("encodes").to_vec());
        }
        let mut agent = Agent::with_events(link(s), FakeClock::new(100, 1, 0), ring);
        for _ in 0..10 {
            agent.poll().expect("polls");
        }
        assert_eq!(ring.view().len(), 0, "all sent");
        let sent = core::mem::take(&mut agent.link_mut().stream_mut().sent);
        let bytes: usize = sent.iter().map(Vec::len).sum();
        // Capabilities, then 63 batches of ~64 × 14 bytes in packets of at most TX_BUFFER.
        assert!(
            sent.iter()
                .all(|p| p.len() <= TX_BUFFER && p.last() == Some(&0))
        );
        assert!(
            sent.len() <= 1 + bytes.div_ceil(TX_BUFFER - MAX_FRAME_SIZE),
            "{} packets",
            sent.len()
        );
        let mut rx = FrameReceiver::new();
        let mut records = 0;
        for pkt in &sent {
            let mut input = &pkt[..];
            loop {
                match rx.feed(input) {
                    Feed::Message { msg, rest } => {
                        if let Message::Events(b) = msg {
                            records += b.records.len();
                        }
                        input = rest;
                    }
                    Feed::Consumed => break,
                    Feed::Error { error, .. } => panic!("{error:?}"),
                }
            }
        }
        assert_eq!(records, 4_000);
    }

    #[test]
    fn the_core_agent_reports_vsock_and_answers_probes_one_packet_per_frame() {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let mut s = FakeStream::default();
        for m in [
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: Features::NONE,
            }),
            Message::ProbeFull { seq: 5 },
        ] {
            s.arriving
                .push_back(encode_frame(&m, &mut buf).expect("encodes").to_vec());
        }
        let mut agent: Agent<_, _> = Agent::new(link(s), FakeClock::new(100, 1, 0));
        for _ in 0..10 {
            assert_eq!(
                agent
                    .poll()
                    .map_err(|_| ())
                    .map(|p| p.state == AgentState::Exited),
                Ok(false)
            );
        }
        let sent = core::mem::take(&mut agent.link_mut().stream_mut().sent);
        assert_eq!(sent.len(), 2, "one packet per reply frame");
        let mut rx = FrameReceiver::new();
        let mut msgs = Vec::new();
        for pkt in &sent {
            let Feed::Message { msg, rest } = rx.feed(pkt) else {
                panic!("packet is not one whole frame: {pkt:?}")
            };
            assert!(rest.is_empty());
            msgs.push(msg);
        }
        let Message::Capabilities(c) = msgs[0] else {
            panic!("{msgs:?}")
        };
        assert_eq!(c.transport, Transport::VirtioVsock);
        assert!(matches!(msgs[1], Message::ProbeReplyFull(p) if p.seq == 5));
    }
}
