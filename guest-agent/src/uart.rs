//! A polled 16550 UART: no interrupts, no FIFO tuning beyond enabling it.
//!
//! Register offsets and bits are from the National Semiconductor PC16550D data sheet:
//! THR/RBR at +0, IER +1, FCR +2, LCR +3, MCR +4, LSR +5; LSR bit 0 = data ready (DR),
//! bit 5 = THR empty (THRE); LCR bit 7 = divisor latch access (DLAB).

use crate::port::{inb, outb};

const THR: u16 = 0;
const IER: u16 = 1;
const FCR: u16 = 2;
const LCR: u16 = 3;
const MCR: u16 = 4;
const LSR: u16 = 5;
const LSR_DR: u8 = 0x01;
const LSR_THRE: u8 = 0x20;

/// One 16550 UART at an I/O port base.
#[derive(Debug, Clone, Copy)]
pub struct Uart {
    base: u16,
}

/// COM1: the probe protocol.
pub const COM1: Uart = Uart { base: 0x3f8 };
/// COM2: the defmt log (binary frames, decoded on the host; see the binary's `logger.rs`).
pub const COM2: Uart = Uart { base: 0x2f8 };

impl Uart {
    /// Programs 115200 8N1, FIFOs on, interrupts off. Baud rate means nothing to a virtual UART
    /// but real-hardware-faithful setup keeps QEMU's model in a known state.
    pub fn init(self) {
        outb(self.base + IER, 0x00);
        outb(self.base + LCR, 0x80);
        outb(self.base + THR, 0x01);
        outb(self.base + IER, 0x00);
        outb(self.base + LCR, 0x03);
        outb(self.base + FCR, 0x07);
        outb(self.base + MCR, 0x03);
    }

    /// Returns the next received byte, if one is waiting.
    #[inline(always)]
    pub fn try_read(self) -> Option<u8> {
        if inb(self.base + LSR) & LSR_DR != 0 {
            Some(inb(self.base + THR))
        } else {
            None
        }
    }

    /// Waits for a received byte.
    #[inline(always)]
    pub fn read(self) -> u8 {
        loop {
            if let Some(b) = self.try_read() {
                return b;
            }
        }
    }

    /// Waits until the transmit holding register can take a byte.
    #[inline(always)]
    pub fn wait_thr_empty(self) {
        while inb(self.base + LSR) & LSR_THRE == 0 {}
    }

    /// Writes `b` without checking THRE. Call [`Uart::wait_thr_empty`] first; this split keeps
    /// the time-critical path (read TSC, send) a few instructions long.
    #[inline(always)]
    pub fn write_unchecked(self, b: u8) {
        outb(self.base + THR, b);
    }

    /// Writes one byte, waiting for room first.
    #[inline(always)]
    pub fn write(self, b: u8) {
        self.wait_thr_empty();
        self.write_unchecked(b);
    }

    /// Writes all of `bytes`.
    pub fn write_all(self, bytes: &[u8]) {
        for &b in bytes {
            self.write(b);
        }
    }
}

impl core::fmt::Write for Uart {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        self.write_all(s.as_bytes());
        Ok(())
    }
}
