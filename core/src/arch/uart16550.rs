//! A polled 16550 UART as an [`agent::Link`](crate::agent::Link) that shares the wire with
//! console text.
//!
//! [`Uart16550`] drives the UART through [`PortIo`] (real: [`NativePorts`]; tests:
//! [`super::FakePorts`], which logs every access). Interrupts stay off; receive is a poll of
//! LSR's data-ready bit, so nothing ever blocks on the host.
//!
//! # Frames and console text on one UART
//!
//! [`Link::send`] writes a `0x00` delimiter before every frame as well as the frame's own
//! trailing one, so any bytes written between frames (console text through
//! [`core::fmt::Write`]) form their own run between two delimiters and never merge into a
//! frame. The host splits the byte stream on `0x00`: a run that decodes (COBS, CRC, postcard)
//! is a message, every other non-empty run is console text; the leading delimiter adds only an
//! empty run, which receivers skip. Console text must therefore not contain NUL bytes (a NUL
//! only splits the text in two), and it must not be written while a frame is being sent: a
//! frame with text inside fails its CRC, the host drops it and asks again. One vCPU that
//! writes text between polls of its agent never does that; text from an interrupt handler or
//! another vCPU needs a lock around both.

use core::fmt;

use super::{NativePorts, PortIo};
use crate::agent::{Link, LinkError};
use crate::proto::Transport;

/// Register offsets from the base port and their bits, from the National Semiconductor
/// PC16550D data sheet ("PC16550D Universal Asynchronous Receiver/Transmitter with FIFOs",
/// Table II "Summary of Registers", and its register descriptions).
pub mod regs {
    /// Receiver Buffer Register (read, DLAB = 0): the next received byte.
    pub const RBR: u16 = 0;
    /// Transmitter Holding Register (write, DLAB = 0): the byte to send.
    pub const THR: u16 = 0;
    /// Divisor Latch LSB (DLAB = 1).
    pub const DLL: u16 = 0;
    /// Interrupt Enable Register (DLAB = 0); 0 disables every interrupt.
    pub const IER: u16 = 1;
    /// Divisor Latch MSB (DLAB = 1).
    pub const DLM: u16 = 1;
    /// FIFO Control Register (write).
    pub const FCR: u16 = 2;
    /// Line Control Register.
    pub const LCR: u16 = 3;
    /// MODEM Control Register.
    pub const MCR: u16 = 4;
    /// Line Status Register.
    pub const LSR: u16 = 5;

    /// LSR bit 0, Data Ready: a received byte waits in RBR or the receiver FIFO.
    pub const LSR_DR: u8 = 1 << 0;
    /// LSR bit 5, Transmitter Holding Register Empty (in FIFO mode: the transmitter FIFO is
    /// empty): THR can take a byte.
    pub const LSR_THRE: u8 = 1 << 5;
    /// LSR bit 6, Transmitter Empty: THR (or the FIFO) and the shift register are empty.
    pub const LSR_TEMT: u8 = 1 << 6;
    /// LCR bit 7, Divisor Latch Access Bit: offsets 0 and 1 address the divisor latch.
    pub const LCR_DLAB: u8 = 1 << 7;
    /// LCR bits 0–1 = 11 (8 data bits), bit 2 = 0 (1 stop bit), bit 3 = 0 (no parity): 8N1.
    pub const LCR_8N1: u8 = 0x03;
    /// FCR bit 0 (FIFO enable), bit 1 (clear the receiver FIFO), bit 2 (clear the transmitter
    /// FIFO); trigger level bits 6–7 = 00 (1 byte), irrelevant with interrupts off.
    pub const FCR_ENABLE_CLEAR: u8 = 0x07;
    /// MCR bit 0 (DTR) and bit 1 (RTS) asserted.
    pub const MCR_DTR_RTS: u8 = 0x03;
    /// The divisor latch value for 115200 baud from the PC's 1.8432 MHz clock
    /// (1.8432 MHz / (16 × 115200) = 1).
    pub const DIVISOR_115200: u16 = 1;
}

/// The order of a byte's write to THR and the wait for THRE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum TxOrder {
    /// Write the byte, then wait until THRE is set (the default).
    ///
    /// THR is empty whenever a write begins ([`Uart16550::init`] establishes it, every write
    /// of this order keeps it), so the first byte of a frame leaves with the caller's next
    /// instruction: between a probe's TSC read and the exit the host trusts as its upper
    /// bound (the `out` of the reply's first byte) there are no other exits.
    #[default]
    WriteThenWait,
    /// Wait until THRE is set, then write the byte: an ordinary console `putc`.
    ///
    /// Each frame then starts with LSR reads (VM exits) between the probe's TSC read and its
    /// first `out`. The host's anchoring never relies on their absence (see the
    /// [`Link`] contract), so this is as sound; the upper bound of a probe's bracket only
    /// comes later, by the status polls.
    WaitThenWrite,
}

/// A polled 16550 UART at an I/O port base: a [`Link`] (frames out, non-blocking receive),
/// [`core::fmt::Write`] for console text on the same wire, and the raw byte operations a
/// kernel's own console needs.
///
/// Copies share the device: a kernel hands one to its agent as the link and keeps one for its
/// console (see the module docs for when text may be written).
///
/// Line errors (overrun, parity, framing, break: LSR bits 1–4) are not reported: a damaged
/// request fails its CRC, the agent answers it with an error and the host asks again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Uart16550<P = NativePorts> {
    ports: P,
    base: u16,
    tx: TxOrder,
}

impl Uart16550 {
    /// COM1, at I/O port 0x3f8 (the PC standard; QEMU's `microvm` and `q35` put a 16550
    /// there).
    // SAFETY: ports 0x3f8..0x400 are COM1's on every PC-compatible machine: a 16550 or
    // nothing, whose I/O has no effect on memory. Without a device, reads float high (THRE
    // and DR read set, so neither waiting nor receiving hangs) and writes go nowhere.
    pub const COM1: Self = Self::with_ports(unsafe { NativePorts::new() }, 0x3f8);

    /// COM2, at I/O port 0x2f8 (the PC standard).
    // SAFETY: as for COM1: 0x2f8..0x300 are COM2's ports, a 16550 or nothing.
    pub const COM2: Self = Self::with_ports(unsafe { NativePorts::new() }, 0x2f8);

    /// A 16550 at `base` driven by real port I/O, writing in [`TxOrder::WriteThenWait`].
    ///
    /// # Safety
    ///
    /// Ports `base..base + 8` must be a 16550 UART (or nothing) that this program owns: the
    /// conditions of [`NativePorts::new`] for those eight ports.
    #[must_use]
    pub const unsafe fn new(base: u16) -> Self {
        // SAFETY: the caller vouches for `base..base + 8`, the only ports a Uart16550 uses.
        Self::with_ports(unsafe { NativePorts::new() }, base)
    }
}

impl<P> Uart16550<P> {
    /// A 16550 at `base` reached through `ports`, writing in [`TxOrder::WriteThenWait`].
    #[must_use]
    pub const fn with_ports(ports: P, base: u16) -> Self {
        Self {
            ports,
            base,
            tx: TxOrder::WriteThenWait,
        }
    }

    /// The order each byte is written in.
    #[must_use]
    pub const fn tx_order(&self) -> TxOrder {
        self.tx
    }

    /// The I/O port base.
    #[must_use]
    pub const fn base(&self) -> u16 {
        self.base
    }

    /// The port I/O it goes through (e.g. a test's fake).
    #[must_use]
    pub const fn ports(&self) -> &P {
        &self.ports
    }
}

impl<P: Copy> Uart16550<P> {
    /// The same UART writing in `order` (`const`, so a `static` can hold it: port handles are
    /// `Copy`).
    #[must_use]
    pub const fn with_tx_order(mut self, order: TxOrder) -> Self {
        self.tx = order;
        self
    }
}

impl<P: PortIo> Uart16550<P> {
    /// Programs 115200 8N1 with FIFOs on and interrupts off, then waits until THR is empty
    /// (the state [`TxOrder::WriteThenWait`] relies on). The baud rate means nothing to a
    /// virtual UART, but a hardware-faithful setup leaves any model in a known state. Call it
    /// once, before the first write.
    pub fn init(&self) {
        use regs::{
            DIVISOR_115200, DLL, DLM, FCR, FCR_ENABLE_CLEAR, IER, LCR, LCR_8N1, LCR_DLAB, MCR,
            MCR_DTR_RTS,
        };
        let [lo, hi] = DIVISOR_115200.to_le_bytes();
        self.out(IER, 0);
        self.out(LCR, LCR_DLAB);
        self.out(DLL, lo);
        self.out(DLM, hi);
        self.out(LCR, LCR_8N1);
        self.out(FCR, FCR_ENABLE_CLEAR);
        self.out(MCR, MCR_DTR_RTS);
        self.wait_thr_empty();
    }

    /// The next received byte, if one is waiting: one LSR read, and one RBR read when DR is
    /// set. Never waits.
    #[inline]
    pub fn try_read(&self) -> Option<u8> {
        if self.ports.inb(self.base + regs::LSR) & regs::LSR_DR != 0 {
            Some(self.ports.inb(self.base + regs::RBR))
        } else {
            None
        }
    }

    /// Waits until THR can take a byte (LSR reads until THRE is set).
    #[inline]
    pub fn wait_thr_empty(&self) {
        while self.ports.inb(self.base + regs::LSR) & regs::LSR_THRE == 0 {}
    }

    /// Writes one byte in the configured [`TxOrder`].
    #[inline]
    pub fn write_byte(&self, b: u8) {
        match self.tx {
            TxOrder::WriteThenWait => {
                self.out(regs::THR, b);
                self.wait_thr_empty();
            }
            TxOrder::WaitThenWrite => {
                self.wait_thr_empty();
                self.out(regs::THR, b);
            }
        }
    }

    /// Writes every byte of `bytes` in the configured [`TxOrder`].
    pub fn write_bytes(&self, bytes: &[u8]) {
        for &b in bytes {
            self.write_byte(b);
        }
    }

    #[inline]
    fn out(&self, reg: u16, value: u8) {
        self.ports.outb(self.base + reg, value);
    }
}

/// Frames go out whole: `send` writes the leading `0x00` delimiter, then the frame (which ends
/// in its own), byte by byte in the configured [`TxOrder`]; it never refuses one. The wait for
/// THRE between bytes lasts as long as the device takes to accept a byte (a character time on
/// hardware; on a virtual UART, until the VMM's backend takes it), never on the host's
/// answer. `recv` takes what the receiver holds, up to `buf.len()`, and returns 0 at once when
/// nothing waits.
impl<P: PortIo> Link for Uart16550<P> {
    #[inline]
    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        // The leading delimiter ends any console text written since the last frame.
        self.write_byte(0);
        self.write_bytes(frame);
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut n = 0;
        for slot in buf.iter_mut() {
            let Some(b) = self.try_read() else { break };
            *slot = b;
            n += 1;
        }
        Ok(n)
    }

    fn transport(&self) -> Transport {
        Transport::Uart16550
    }
}

/// Console text, written byte for byte in the configured [`TxOrder`] between frames (see the
/// module docs: no NUL bytes, never while a frame is being sent).
impl<P: PortIo> fmt::Write for Uart16550<P> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.write_bytes(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests;
