//! The COM1 UART as a `vmtsync_core::agent::Link`.

use vmtsync_core::agent::{Link, LinkError};
use vmtsync_core::proto::Transport;

use crate::options::TxOrder;
use crate::uart::Uart;

/// A polled 16550 carrying protocol frames.
///
/// With [`TxOrder::WriteThenWait`] (the default), the transmit holding register is empty
/// whenever [`Link::send`] is entered: each byte is followed by a wait for THRE instead of
/// preceded by one, so the first byte of a frame leaves with no VM exit between the agent's
/// TSC read and that byte's `out`, which keeps the host's bracket narrow. The host does not
/// rely on it (docs/anchor.md, "The bracket argument"): [`TxOrder::WaitThenWrite`] polls LSR
/// before every byte instead, like a console putc (`uarttx=wait-then-write`, the test build
/// whose brackets must still hold its TSC read).
#[derive(Debug)]
pub struct UartLink {
    uart: Uart,
    order: TxOrder,
}

impl UartLink {
    /// Takes over an initialised UART and waits until it can transmit (the invariant).
    #[must_use]
    pub fn new(uart: Uart, order: TxOrder) -> Self {
        uart.wait_thr_empty();
        Self { uart, order }
    }
}

impl Link for UartLink {
    #[inline]
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        match self.order {
            TxOrder::WriteThenWait => {
                for &b in frame {
                    self.uart.write_unchecked(b);
                    self.uart.wait_thr_empty();
                }
            }
            TxOrder::WaitThenWrite => self.uart.write_all(frame),
        }
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut n = 0;
        for slot in buf.iter_mut() {
            match self.uart.try_read() {
                Some(b) => {
                    *slot = b;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        Transport::Uart16550
    }
}
