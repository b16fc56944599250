//! The byte link the protocol server talks over, and its UART implementation.

use crate::uart::Uart;

/// A byte-oriented, polled link to the host.
///
/// Sending is split in two so the time-critical probe path can be: wait until the link can
/// take a byte, read the TSC, send. [`Link::send_now`] must put its first byte on the wire
/// without waiting again.
pub trait Link {
    /// The next received byte, if one is waiting. Never blocks.
    fn try_recv(&mut self) -> Option<u8>;
    /// Waits until one byte can be sent immediately.
    fn wait_ready(&mut self);
    /// Sends `bytes`; the first without waiting (call [`Link::wait_ready`] first), the rest
    /// waiting for room as needed.
    fn send_now(&mut self, bytes: &[u8]);
    /// What this link is, for the `Capabilities` reply. Defaults to the UART, the agent's
    /// first link.
    fn transport(&self) -> vmtsync_core::proto::Transport {
        vmtsync_core::proto::Transport::Uart16550
    }
}

impl Link for Uart {
    #[inline(always)]
    fn try_recv(&mut self) -> Option<u8> {
        Uart::try_read(*self)
    }

    #[inline(always)]
    fn wait_ready(&mut self) {
        self.wait_thr_empty();
    }

    #[inline(always)]
    fn send_now(&mut self, bytes: &[u8]) {
        if let Some((&first, rest)) = bytes.split_first() {
            self.write_unchecked(first);
            self.write_all(rest);
        }
    }
}
