//! The [`PortIo`] trait: byte-wide x86 port I/O, real (`x86_64::NativePorts`) or faked
//! ([`super::FakePorts`]).

/// Byte-wide x86 port I/O: `in al, dx` and `out dx, al`.
///
/// Under KVM every access is a VM exit the host can timestamp (`kvm:kvm_pio`), and the host's
/// exit anchoring reads the order of a link's or a clock's accesses. An implementation
/// therefore performs each call as exactly one access, in program order: it never merges,
/// skips, caches or reorders them.
pub trait PortIo {
    /// Reads one byte from `port`.
    fn inb(&self, port: u16) -> u8;

    /// Writes `value` to `port`.
    fn outb(&self, port: u16, value: u8);
}

impl<P: PortIo + ?Sized> PortIo for &P {
    #[inline]
    fn inb(&self, port: u16) -> u8 {
        (**self).inb(port)
    }

    #[inline]
    fn outb(&self, port: u16, value: u8) {
        (**self).outb(port, value);
    }
}

/// The CPU's own `in` and `out` instructions, through the `x86` crate (its [`PortIo`]
/// implementation exists on `target_arch = "x86_64"` only).
///
/// Creating one is `unsafe` because port I/O can do anything the device behind the port does
/// (an ISA DMA controller writes memory, port 0xcf9 resets the machine): whoever creates it
/// vouches for every port it is used on. [`super::uart16550::Uart16550::COM1`] and
/// [`super::uart16550::Uart16550::COM2`] carry one for the standard serial ports.
///
/// Privilege: the accesses need CPL 0, or IOPL 3 (what the bundled agent's ring-3 loop runs
/// with), or a TSS I/O bitmap that grants the port. Without it every access raises #GP, a
/// fault the CPU delivers, not undefined behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativePorts {
    _vouched: (),
}

impl NativePorts {
    /// Real port I/O.
    ///
    /// # Safety
    ///
    /// Every port this value, or any copy of it, is used on must be one whose I/O has no
    /// effect on memory this program uses and whose device state no other code depends on
    /// behind the user's back: a 16550 UART the caller owns, an unused port (a sync port),
    /// isa-debug-exit.
    #[must_use]
    pub const unsafe fn new() -> Self {
        Self { _vouched: () }
    }
}
