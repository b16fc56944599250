//! Fakes of the hardware traits, for host tests of everything above `arch` (and for anyone
//! embedding the core who wants to test their own glue). No heap: the CPUID table is a
//! borrowed slice, the port log and the UART model's buffers are fixed-size.

use core::cell::{Cell, RefCell};
use core::sync::atomic::{AtomicU64, Ordering};

use heapless::{Deque, Vec};

use super::uart16550::regs;
use super::{Cpuid, CpuidResult, PortIo, Tsc};

/// A TSC that returns a settable counter and then advances it by a fixed step per read, so
/// tests get strictly increasing, fully predictable readings.
///
/// Atomic inside so one instance can be shared with a concurrent thread (`&FakeTsc: Send`).
#[derive(Debug, Default)]
pub struct FakeTsc {
    now: AtomicU64,
    step: u64,
}

impl FakeTsc {
    /// A counter at `start` that advances by `step` after every read (`step = 0`: frozen).
    #[must_use]
    pub const fn new(start: u64, step: u64) -> Self {
        Self {
            now: AtomicU64::new(start),
            step,
        }
    }

    /// Sets the value the next read returns.
    pub fn set(&self, value: u64) {
        self.now.store(value, Ordering::Relaxed);
    }

    /// Moves the counter forward by `delta` (wrapping, as a real 64-bit TSC would).
    pub fn advance(&self, delta: u64) {
        self.now.fetch_add(delta, Ordering::Relaxed);
    }

    /// The value the next read returns, without advancing.
    #[must_use]
    pub fn peek(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }
}

impl Tsc for FakeTsc {
    fn read_ordered(&self) -> u64 {
        self.now.fetch_add(self.step, Ordering::Relaxed)
    }
}

/// One row of a [`FakeCpuid`] table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuidEntry {
    /// EAX input.
    pub leaf: u32,
    /// ECX input.
    pub subleaf: u32,
    /// What CPUID returns for that input.
    pub result: CpuidResult,
}

impl CpuidEntry {
    /// A row answering `(leaf, subleaf)` with `result`.
    #[must_use]
    pub const fn new(leaf: u32, subleaf: u32, result: CpuidResult) -> Self {
        Self {
            leaf,
            subleaf,
            result,
        }
    }
}

/// A CPUID answered from a table; leaves not in the table read as all zeros (what KVM does
/// for leaves missing from `KVM_SET_CPUID2`, docs/host-quirks.md).
#[derive(Clone, Copy, Debug)]
pub struct FakeCpuid<'a> {
    entries: &'a [CpuidEntry],
}

impl<'a> FakeCpuid<'a> {
    /// A CPUID answering from `entries` (first match wins).
    #[must_use]
    pub const fn new(entries: &'a [CpuidEntry]) -> Self {
        Self { entries }
    }
}

impl Cpuid for FakeCpuid<'_> {
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult {
        self.entries
            .iter()
            .find(|e| e.leaf == leaf && e.subleaf == subleaf)
            .map(|e| e.result)
            .unwrap_or_default()
    }
}

/// One event a [`FakePorts`] saw, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortAccess {
    /// An `in` from `port` that returned `value`.
    In {
        /// The port read.
        port: u16,
        /// What the read returned.
        value: u8,
    },
    /// An `out` of `value` to `port`.
    Out {
        /// The port written.
        port: u16,
        /// The byte written.
        value: u8,
    },
    /// A marker the test placed with [`FakePorts::mark`], e.g. where a clock read the TSC.
    Mark(u32),
}

/// How many [`PortAccess`]es a [`FakePorts`] logs; later ones are only counted
/// ([`FakePorts::unlogged`]).
pub const FAKE_PORTS_LOG: usize = 4096;

/// Bytes the fake UART holds in each direction.
pub const FAKE_UART_BUFFER: usize = 4096;

/// Port I/O that logs every access in order and models one polled 16550 UART (the registers
/// [`super::uart16550::Uart16550`] uses), so tests can check a driver's exact access sequence,
/// which is what the host's exit anchoring sees.
///
/// The UART model: writes to THR (with LCR's DLAB clear) are transmitted and clear THRE for
/// the next [`FakePorts::tx_busy_reads`] reads of LSR, after which THRE (and TEMT) read set
/// again; a write to THR while THRE reads clear is counted ([`FakePorts::busy_writes`]). LSR's
/// DR is set while received bytes ([`FakePorts::push_rx`]) are waiting; each read of RBR takes
/// one. Every port outside the UART reads `0xff` (a floating ISA bus) and ignores writes.
///
/// Interior mutability (`Cell`, `RefCell`): [`PortIo`] takes `&self`. Not `Sync`; share it
/// with a driver by reference (`&FakePorts` is a [`PortIo`] too).
#[derive(Debug)]
pub struct FakePorts {
    log: RefCell<Vec<PortAccess, FAKE_PORTS_LOG>>,
    unlogged: Cell<u32>,
    uart: Option<u16>,
    busy_reads: Cell<u32>,
    thr_busy: Cell<u32>,
    busy_writes: Cell<u32>,
    lcr: Cell<u8>,
    rx: RefCell<Deque<u8, FAKE_UART_BUFFER>>,
    tx: RefCell<Vec<u8, FAKE_UART_BUFFER>>,
}

impl Default for FakePorts {
    fn default() -> Self {
        Self::new()
    }
}

impl FakePorts {
    /// Ports with no device behind them: every `in` reads `0xff`. Every access is logged.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            log: RefCell::new(Vec::new()),
            unlogged: Cell::new(0),
            uart: None,
            busy_reads: Cell::new(0),
            thr_busy: Cell::new(0),
            busy_writes: Cell::new(0),
            lcr: Cell::new(0),
            rx: RefCell::new(Deque::new()),
            tx: RefCell::new(Vec::new()),
        }
    }

    /// Ports with a 16550 at `base` (its eight registers `base..base + 8`) whose transmitter
    /// is always ready (THRE never reads clear) until [`FakePorts::set_tx_busy_reads`].
    #[must_use]
    pub const fn with_uart(base: u16) -> Self {
        let mut p = Self::new();
        p.uart = Some(base);
        p
    }

    /// After each transmitted byte, THRE reads clear for the next `reads` LSR reads (the
    /// time the UART takes to send it, counted in status polls).
    pub fn set_tx_busy_reads(&self, reads: u32) {
        self.busy_reads.set(reads);
    }

    /// The LSR reads THRE stays clear after each transmitted byte.
    #[must_use]
    pub fn tx_busy_reads(&self) -> u32 {
        self.busy_reads.get()
    }

    /// Queues bytes for the UART to receive; all or nothing. Returns `false` if they do not
    /// fit (or there is no UART).
    pub fn push_rx(&self, bytes: &[u8]) -> bool {
        let mut rx = self.rx.borrow_mut();
        if self.uart.is_none() || rx.capacity() - rx.len() < bytes.len() {
            return false;
        }
        for &b in bytes {
            // Capacity was checked above.
            let _ = rx.push_back(b);
        }
        true
    }

    /// Received bytes the driver has not read yet.
    #[must_use]
    pub fn rx_len(&self) -> usize {
        self.rx.borrow().len()
    }

    /// Every byte transmitted so far (bytes past [`FAKE_UART_BUFFER`] are dropped).
    #[must_use]
    pub fn tx(&self) -> Vec<u8, FAKE_UART_BUFFER> {
        self.tx.borrow().clone()
    }

    /// Forgets the transmitted bytes.
    pub fn clear_tx(&self) {
        self.tx.borrow_mut().clear();
    }

    /// Writes to THR made while THRE read clear.
    #[must_use]
    pub fn busy_writes(&self) -> u32 {
        self.busy_writes.get()
    }

    /// Records a marker between accesses (e.g. "the TSC was read here").
    pub fn mark(&self, tag: u32) {
        self.push(PortAccess::Mark(tag));
    }

    /// The accesses and markers so far, in order.
    #[must_use]
    pub fn accesses(&self) -> Vec<PortAccess, FAKE_PORTS_LOG> {
        self.log.borrow().clone()
    }

    /// Forgets the logged accesses (the UART's state stays).
    pub fn clear_log(&self) {
        self.log.borrow_mut().clear();
        self.unlogged.set(0);
    }

    /// Accesses that did not fit the log.
    #[must_use]
    pub fn unlogged(&self) -> u32 {
        self.unlogged.get()
    }

    fn push(&self, a: PortAccess) {
        if self.log.borrow_mut().push(a).is_err() {
            self.unlogged.set(self.unlogged.get().saturating_add(1));
        }
    }

    /// The UART register `port` addresses, if it is one.
    fn uart_reg(&self, port: u16) -> Option<u16> {
        let base = self.uart?;
        port.checked_sub(base).filter(|&r| r < 8)
    }

    fn dlab(&self) -> bool {
        self.lcr.get() & regs::LCR_DLAB != 0
    }

    fn read_reg(&self, reg: u16) -> u8 {
        match reg {
            regs::RBR if !self.dlab() => self.rx.borrow_mut().pop_front().unwrap_or(0),
            regs::LCR => self.lcr.get(),
            regs::LSR => {
                let mut lsr = 0;
                if !self.rx.borrow().is_empty() {
                    lsr |= regs::LSR_DR;
                }
                match self.thr_busy.get() {
                    0 => lsr |= regs::LSR_THRE | regs::LSR_TEMT,
                    n => self.thr_busy.set(n - 1),
                }
                lsr
            }
            _ => 0,
        }
    }

    fn write_reg(&self, reg: u16, value: u8) {
        match reg {
            regs::THR if !self.dlab() => {
                if self.thr_busy.get() != 0 {
                    self.busy_writes
                        .set(self.busy_writes.get().saturating_add(1));
                }
                let _ = self.tx.borrow_mut().push(value);
                self.thr_busy.set(self.busy_reads.get());
            }
            regs::LCR => self.lcr.set(value),
            _ => {}
        }
    }
}

impl PortIo for FakePorts {
    fn inb(&self, port: u16) -> u8 {
        let value = self.uart_reg(port).map_or(0xff, |r| self.read_reg(r));
        self.push(PortAccess::In { port, value });
        value
    }

    fn outb(&self, port: u16, value: u8) {
        if let Some(r) = self.uart_reg(port) {
            self.write_reg(r, value);
        }
        self.push(PortAccess::Out { port, value });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_ports_log_and_model_a_uart() {
        let p = FakePorts::with_uart(0x3f8);
        p.set_tx_busy_reads(1);
        assert_eq!(p.inb(0x80), 0xff, "no device: a floating bus");
        p.outb(0x3f8, b'a');
        assert_eq!(p.inb(0x3fd) & regs::LSR_THRE, 0, "busy for one read");
        assert_eq!(p.inb(0x3fd) & regs::LSR_THRE, regs::LSR_THRE);
        p.outb(0x3f8, b'b');
        p.outb(0x3f8, b'c');
        assert_eq!(p.busy_writes(), 1, "'c' was written while THRE was clear");
        p.outb(0x3fb, regs::LCR_DLAB);
        p.outb(0x3f8, 1);
        p.outb(0x3fb, 0x03);
        assert_eq!(
            p.tx().as_slice(),
            b"abc",
            "a divisor-latch write is not sent"
        );
        assert!(p.push_rx(&[7]));
        p.mark(9);
        assert_eq!(p.inb(0x3fd) & regs::LSR_DR, regs::LSR_DR);
        assert_eq!(p.inb(0x3f8), 7);
        assert_eq!(p.inb(0x3fd) & regs::LSR_DR, 0);
        assert_eq!(p.rx_len(), 0);
        let log = p.accesses();
        assert_eq!(log.len(), 13);
        assert_eq!(
            log[0],
            PortAccess::In {
                port: 0x80,
                value: 0xff
            }
        );
        assert_eq!(
            log[1],
            PortAccess::Out {
                port: 0x3f8,
                value: b'a'
            }
        );
        assert_eq!(log[9], PortAccess::Mark(9));
        assert_eq!(
            log[11],
            PortAccess::In {
                port: 0x3f8,
                value: 7
            }
        );
        assert!(
            !FakePorts::new().push_rx(&[1]),
            "no UART, nothing to receive"
        );
        p.clear_log();
        assert!(p.accesses().is_empty());
        assert_eq!(p.unlogged(), 0);
    }

    #[test]
    fn fake_tsc_advances_and_sets() {
        let t = FakeTsc::new(100, 7);
        assert_eq!(t.read_ordered(), 100);
        assert_eq!(t.read_ordered(), 107);
        assert_eq!(t.peek(), 114);
        t.advance(6);
        assert_eq!(t.read_ordered(), 120);
        t.set(5);
        assert_eq!(t.read_ordered(), 5);
        let frozen = FakeTsc::new(9, 0);
        assert_eq!(frozen.read_ordered(), frozen.read_ordered());
        // Through the blanket `&T` impl too.
        fn via_trait<T: Tsc>(t: T) -> u64 {
            t.read_ordered()
        }
        assert_eq!(via_trait(&frozen), 9);
    }

    #[test]
    fn fake_cpuid_table_lookup() {
        let r = CpuidResult {
            eax: 1,
            ebx: 2,
            ecx: 3,
            edx: 4,
        };
        let table = [CpuidEntry::new(7, 1, r)];
        let c = FakeCpuid::new(&table);
        assert_eq!(c.cpuid(7, 1), r);
        assert_eq!(c.cpuid(7, 0), CpuidResult::default());
        assert_eq!(c.cpuid(8, 1), CpuidResult::default());
    }
}

/// A defmt global logger that discards every frame, for host test binaries: with defmt on and
/// a `DEFMT_LOG` level that keeps some log calls, a test binary references defmt's logger
/// symbols, which only a final firmware image normally provides. This crate's own unit tests
/// (`--features defmt`) get it by themselves; a dependent crate's host tests get it with
/// feature `defmt-discard` (the guest agent's do, from a dev-dependency, so its bootable ELF,
/// which has a real logger, never links this one). It lives here because implementing
/// `defmt::Logger` takes `unsafe`, which this crate gathers in `arch`.
#[cfg(any(feature = "defmt-discard", all(test, feature = "defmt")))]
mod defmt_sink {
    #[defmt::global_logger]
    struct Discard;

    // SAFETY: all four functions do nothing, so the acquire/release pairing and the
    // single-writer requirements of `defmt::Logger` hold trivially.
    unsafe impl defmt::Logger for Discard {
        fn acquire() {}
        unsafe fn flush() {}
        unsafe fn release() {}
        unsafe fn write(_bytes: &[u8]) {}
    }

    defmt::timestamp!("{=u64}", 0);
}
