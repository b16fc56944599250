//! A 16550 UART register model, just enough for a polling guest, and the host-side endpoint of
//! COM1.
//!
//! Registers (PC16550D data sheet): RBR/THR at +0 (divisor latch low when LCR.DLAB), IER at +1
//! (divisor high when DLAB), IIR/FCR +2, LCR +3, MCR +4, LSR +5, MSR +6, SCR +7. The model
//! transmits instantly, so LSR always reports THRE|TEMT, and DR while host bytes are queued.
//! Every byte is stamped with the host TSC at the VM exit that moved it, which is the tightest
//! host-side time there is for a probe carried by port I/O.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

const LSR_DR: u8 = 0x01;
const LSR_THRE: u8 = 0x20;
const LSR_TEMT: u8 = 0x40;
const LCR_DLAB: u8 = 0x80;
/// IIR value "no interrupt pending" with FIFOs enabled.
const IIR_NO_INT_FIFO: u8 = 0xc1;
/// MSR value with CTS, DSR and DCD asserted, so a guest waiting on modem lines proceeds.
const MSR_LINES_UP: u8 = 0xb0;

/// One byte that crossed the UART, with the host TSC (`lfence; rdtsc`) taken in the VMM at the
/// VM exit that moved it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SerialByte {
    /// The byte.
    pub byte: u8,
    /// Host TSC at the exit: for guest→host bytes the THR write, for host→guest bytes the RBR
    /// read that handed the byte to the guest.
    pub host_tsc: u64,
    /// Host TSC at the vCPU's previous VM exit (of any kind; 0 for the first). Any guest
    /// instruction between the two exits, such as a TSC read right before a THR write, ran
    /// inside `[prev_exit_host_tsc, host_tsc]`.
    pub prev_exit_host_tsc: u64,
}

/// The host TSC of the current VM exit and of the one before it, taken by the vCPU loop right
/// after `KVM_RUN` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ExitStamp {
    /// This exit.
    pub(crate) now: u64,
    /// The previous exit (0 before the first).
    pub(crate) prev: u64,
}

impl ExitStamp {
    fn byte(self, byte: u8) -> SerialByte {
        SerialByte {
            byte,
            host_tsc: self.now,
            prev_exit_host_tsc: self.prev,
        }
    }
}

/// Where a UART's transmitted bytes go.
#[derive(Debug)]
pub(crate) enum TxSink {
    /// To the host endpoint, timestamped.
    Channel(Sender<SerialByte>),
    /// Appended to a shared log buffer.
    Log(Arc<Mutex<Vec<u8>>>),
}

/// The guest-visible state of one 16550.
#[derive(Debug)]
pub(crate) struct Uart16550 {
    lcr: u8,
    ier: u8,
    mcr: u8,
    scr: u8,
    divisor: [u8; 2],
    /// Host→guest bytes not yet read by the guest; `None` for a UART with no input.
    rx: Option<Arc<Mutex<VecDeque<u8>>>>,
    /// Bytes the guest has read, stamped at the RBR read.
    delivered: Option<Sender<SerialByte>>,
    tx: TxSink,
}

impl Uart16550 {
    /// A UART with the given input queue, delivery log, and output sink.
    pub(crate) fn new(
        rx: Option<Arc<Mutex<VecDeque<u8>>>>,
        delivered: Option<Sender<SerialByte>>,
        tx: TxSink,
    ) -> Self {
        Self {
            lcr: 0x03,
            ier: 0,
            mcr: 0,
            scr: 0,
            divisor: [1, 0],
            rx,
            delivered,
            tx,
        }
    }

    fn rx_ready(&self) -> bool {
        self.rx.as_ref().is_some_and(|q| !lock(q).is_empty())
    }

    /// Handles a guest `in` from register `offset` (0..=7) at the exit stamped `at`.
    pub(crate) fn read(&mut self, offset: u16, at: ExitStamp) -> u8 {
        let dlab = self.lcr & LCR_DLAB != 0;
        match offset {
            0 if dlab => self.divisor[0],
            0 => {
                let b = self.rx.as_ref().and_then(|q| lock(q).pop_front());
                match b {
                    Some(byte) => {
                        if let Some(d) = &self.delivered {
                            // The host endpoint may be gone; the guest does not care.
                            let _ = d.send(at.byte(byte));
                        }
                        byte
                    }
                    None => 0,
                }
            }
            1 if dlab => self.divisor[1],
            1 => self.ier,
            2 => IIR_NO_INT_FIFO,
            3 => self.lcr,
            4 => self.mcr,
            5 => LSR_THRE | LSR_TEMT | if self.rx_ready() { LSR_DR } else { 0 },
            6 => MSR_LINES_UP,
            7 => self.scr,
            _ => 0xff,
        }
    }

    /// Handles a guest `out` of `v` to register `offset` (0..=7) at the exit stamped `at`.
    pub(crate) fn write(&mut self, offset: u16, v: u8, at: ExitStamp) {
        let dlab = self.lcr & LCR_DLAB != 0;
        match offset {
            0 if dlab => self.divisor[0] = v,
            0 => match &self.tx {
                TxSink::Channel(s) => {
                    let _ = s.send(at.byte(v));
                }
                TxSink::Log(buf) => lock(buf).push(v),
            },
            1 if dlab => self.divisor[1] = v,
            1 => self.ier = v,
            // FCR bit 1 clears the receive FIFO, as on real hardware.
            2 if v & 0x02 != 0 => {
                if let Some(q) = &self.rx {
                    lock(q).clear();
                }
            }
            3 => self.lcr = v,
            4 => self.mcr = v,
            7 => self.scr = v,
            _ => {}
        }
    }
}

/// Locks `m`, ignoring poisoning: the protected data (byte queues) stays consistent even if a
/// holder panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The host end of COM1: queue bytes for the guest, receive what it wrote, and see when it
/// read what was sent. All times are host TSC values taken at VM exits.
#[derive(Debug)]
pub struct SerialHost {
    pub(crate) to_guest: Arc<Mutex<VecDeque<u8>>>,
    pub(crate) from_guest: Receiver<SerialByte>,
    pub(crate) delivered: Receiver<SerialByte>,
}

impl SerialHost {
    /// Queues `bytes` for the guest. They become visible (LSR.DR) at the guest's next LSR read.
    pub fn send(&self, bytes: &[u8]) {
        lock(&self.to_guest).extend(bytes.iter().copied());
    }

    /// The next byte the guest transmitted, waiting at most `timeout`.
    #[must_use]
    pub fn recv_timeout(&self, timeout: Duration) -> Option<SerialByte> {
        self.from_guest.recv_timeout(timeout).ok()
    }

    /// Bytes the guest transmitted up to and including the next `\n`, waiting at most `timeout`
    /// in total. `None` if the line did not complete in time or the VM is gone.
    #[must_use]
    pub fn recv_line(&self, timeout: Duration) -> Option<Vec<SerialByte>> {
        let deadline = Instant::now() + timeout;
        let mut line = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.from_guest.recv_timeout(left) {
                Ok(b) => {
                    line.push(b);
                    if b.byte == b'\n' {
                        return Some(line);
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// The next host→guest byte the guest read, with the host TSC at that RBR read, waiting at
    /// most `timeout`.
    #[must_use]
    pub fn delivered_timeout(&self, timeout: Duration) -> Option<SerialByte> {
        self.delivered.recv_timeout(timeout).ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;

    const AT: ExitStamp = ExitStamp { now: 20, prev: 10 };

    fn com1() -> (Uart16550, SerialHost) {
        let q = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, from_guest) = channel();
        let (dtx, delivered) = channel();
        let uart = Uart16550::new(Some(q.clone()), Some(dtx), TxSink::Channel(tx));
        let host = SerialHost {
            to_guest: q,
            from_guest,
            delivered,
        };
        (uart, host)
    }

    #[test]
    fn lsr_reports_data_ready_only_while_bytes_are_queued() {
        let (mut u, h) = com1();
        assert_eq!(u.read(5, AT), LSR_THRE | LSR_TEMT);
        h.send(b"ab");
        assert_eq!(u.read(5, AT), LSR_THRE | LSR_TEMT | LSR_DR);
        assert_eq!(u.read(0, AT), b'a');
        assert_eq!(u.read(0, AT), b'b');
        assert_eq!(u.read(5, AT) & LSR_DR, 0);
        let d1 = h.delivered_timeout(Duration::ZERO).expect("first delivery");
        let d2 = h
            .delivered_timeout(Duration::ZERO)
            .expect("second delivery");
        assert_eq!((d1.byte, d2.byte), (b'a', b'b'));
        assert_eq!((d1.host_tsc, d1.prev_exit_host_tsc), (20, 10));
    }

    #[test]
    fn divisor_latch_writes_are_not_transmitted() {
        let (mut u, h) = com1();
        u.write(3, 0x80, AT);
        u.write(0, 0x01, AT);
        u.write(1, 0x00, AT);
        assert_eq!(u.read(0, AT), 0x01);
        u.write(3, 0x03, AT);
        u.write(0, b'x', AT);
        let b = h
            .recv_timeout(Duration::ZERO)
            .expect("one byte transmitted");
        assert_eq!(b.byte, b'x');
        assert!(h.recv_timeout(Duration::ZERO).is_none());
    }

    #[test]
    fn fifo_reset_drops_pending_input_and_lines_collect() {
        let (mut u, h) = com1();
        h.send(b"zz");
        u.write(2, 0x07, AT);
        assert_eq!(u.read(5, AT) & LSR_DR, 0);
        for &b in b"hi\n" {
            u.write(0, b, AT);
        }
        let line = h.recv_line(Duration::ZERO).expect("a full line");
        assert_eq!(line.iter().map(|b| b.byte).collect::<Vec<_>>(), b"hi\n");
    }

    #[test]
    fn log_sink_collects_text() {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let mut u = Uart16550::new(None, None, TxSink::Log(buf.clone()));
        for &b in b"ok" {
            u.write(0, b, AT);
        }
        assert_eq!(u.read(5, AT) & LSR_DR, 0);
        assert_eq!(lock(&buf).as_slice(), b"ok");
    }
}
