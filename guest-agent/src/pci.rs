//! PCI for the virtio transport: configuration space through the legacy x86 ports
//! 0xCF8/0xCFC, and memory-BAR assignment.
//!
//! virtio-drivers ships no port-I/O configuration access, so [`PortCam`] implements its
//! `ConfigurationAccess`. Its `PciTransport` also needs memory BARs that firmware has already
//! placed; qboot (the fast firmware on q35, see docs/qemu.md) leaves them at 0, so
//! [`assign_memory_bars`] sizes each unassigned memory BAR and places it in an [`MmioWindow`],
//! then turns on memory decoding and bus mastering.
//!
//! Everything here is port I/O or pure arithmetic, so it runs in ring 3 with IOPL 3 (natively
//! on the project's nested KVM, where ring 0 is emulated).

use core::arch::asm;

use virtio_drivers::transport::pci::bus::{
    BarInfo, Command, ConfigurationAccess, DeviceFunction, MemoryBarType, PciRoot,
};

/// The configuration-address port (PCI Local Bus spec 3.0, §3.2.2.3.2, "Configuration
/// Mechanism #1").
pub const CONFIG_ADDRESS: u16 = 0xcf8;
/// The configuration-data port (same section).
pub const CONFIG_DATA: u16 = 0xcfc;
/// Bit 31 of CONFIG_ADDRESS: enable the configuration cycle.
const CONFIG_ENABLE: u32 = 1 << 31;

/// Where the agent places BARs by default: 0xE000_0000 up to the IOAPIC at 0xFEC0_0000.
///
/// On QEMU q35 below-4 GiB RAM ends at 2 GiB at most (and at the guest's size when smaller), the
/// MMCONFIG window is 0xB000_0000..0xC000_0000, and everything from there to the IOAPIC not
/// claimed otherwise is routed to PCI; SeaBIOS uses the same range for 32-bit BARs. The agent's
/// identity map covers it (boot.rs maps 4 GiB, user-accessible).
pub const DEFAULT_MMIO_WINDOW: MmioWindow = MmioWindow::new(0xe000_0000, 0xfec0_0000);

/// Configuration mechanism #1 on ports 0xCF8/0xCFC.
///
/// The port pair is one global device: callers must not interleave accesses from several
/// threads (the agent is single-threaded, and never takes interrupts).
#[derive(Debug, Clone, Copy, Default)]
pub struct PortCam;

/// The CONFIG_ADDRESS value selecting dword `register_offset` of `df` (low two bits dropped).
#[must_use]
pub fn config_address(df: DeviceFunction, register_offset: u8) -> u32 {
    CONFIG_ENABLE
        | (u32::from(df.bus) << 16)
        | (u32::from(df.device & 0x1f) << 11)
        | (u32::from(df.function & 0x7) << 8)
        | u32::from(register_offset & 0xfc)
}

fn outl(port: u16, v: u32) {
    // SAFETY: port output has no effect on Rust-visible memory; CONFIG_ADDRESS/CONFIG_DATA only
    // select and write PCI configuration registers.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags));
    }
}

fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: port input has no memory effects; CONFIG_DATA reads a configuration register.
    unsafe {
        asm!("in eax, dx", out("eax") v, in("dx") port, options(nomem, nostack, preserves_flags));
    }
    v
}

impl ConfigurationAccess for PortCam {
    fn read_word(&self, df: DeviceFunction, register_offset: u8) -> u32 {
        outl(CONFIG_ADDRESS, config_address(df, register_offset));
        inl(CONFIG_DATA)
    }

    fn write_word(&mut self, df: DeviceFunction, register_offset: u8, data: u32) {
        outl(CONFIG_ADDRESS, config_address(df, register_offset));
        outl(CONFIG_DATA, data);
    }

    unsafe fn unsafe_clone(&self) -> Self {
        Self
    }
}

/// A bump allocator of guest-physical MMIO space for BARs: each BAR is naturally aligned (a
/// BAR's size is a power of two and its address must be a multiple of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmioWindow {
    next: u64,
    end: u64,
}

impl MmioWindow {
    /// The window `[start, end)`.
    #[must_use]
    pub const fn new(start: u64, end: u64) -> Self {
        Self { next: start, end }
    }

    /// Takes `size` bytes aligned to `size`; `None` when `size` is not a power of two or the
    /// window is full. Space skipped for alignment is not reused.
    pub fn try_alloc(&mut self, size: u64) -> Option<u64> {
        if !size.is_power_of_two() {
            return None;
        }
        let addr = self.next.checked_add(size - 1)? & !(size - 1);
        let end = addr.checked_add(size)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        Some(addr)
    }
}

/// Why BAR assignment failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BarError {
    /// A BAR reported an encoding virtio-drivers does not accept.
    InvalidBar,
    /// The window has no room for a BAR of this size.
    WindowFull {
        /// The BAR index.
        bar: u8,
        /// Its size in bytes.
        size: u64,
    },
    /// A 32-bit BAR got an address above 4 GiB (the window is too high).
    AddressTooHigh,
}

/// One memory BAR placed by [`assign_memory_bars`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AssignedBar {
    /// BAR index (0..6).
    pub index: u8,
    /// Guest-physical address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
}

/// Places every memory BAR of `df` that reads as address 0 into `window` (I/O BARs and BARs
/// firmware already placed are left alone), then enables memory decoding and bus mastering.
/// Calls `placed` for each BAR it assigns.
///
/// # Errors
/// [`BarError`] when a BAR does not decode or does not fit; the command register is then left
/// as it was.
pub fn assign_memory_bars<C: ConfigurationAccess>(
    root: &mut PciRoot<C>,
    df: DeviceFunction,
    window: &mut MmioWindow,
    mut placed: impl FnMut(AssignedBar),
) -> Result<(), BarError> {
    let bars = root.bars(df).map_err(|_| BarError::InvalidBar)?;
    for (index, bar) in (0u8..).zip(bars.iter()) {
        let Some(BarInfo::Memory {
            address_type,
            address: 0,
            size,
            ..
        }) = bar
        else {
            continue;
        };
        let size = *size;
        if size == 0 {
            continue;
        }
        let address = window
            .try_alloc(size)
            .ok_or(BarError::WindowFull { bar: index, size })?;
        match address_type {
            MemoryBarType::Width64 => root.set_bar_64(df, index, address),
            MemoryBarType::Width32 | MemoryBarType::Below1MiB => {
                let a = u32::try_from(address).map_err(|_| BarError::AddressTooHigh)?;
                root.set_bar_32(df, index, a);
            }
        }
        placed(AssignedBar {
            index,
            address,
            size,
        });
    }
    let (_, command) = root.get_status_command(df);
    root.set_command(df, command | Command::MEMORY_SPACE | Command::BUS_MASTER);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::rc::Rc;

    use super::*;

    /// A fake configuration space with real BAR semantics: writable address bits only (the size
    /// mask), read-only type bits, and a command register.
    #[derive(Debug, Clone, Default)]
    struct FakeCfg {
        regs: Rc<RefCell<HashMap<u8, u32>>>,
        /// Per BAR register offset: (writable mask, read-only low bits).
        bars: Rc<HashMap<u8, (u32, u32)>>,
    }

    impl ConfigurationAccess for FakeCfg {
        fn read_word(&self, _df: DeviceFunction, off: u8) -> u32 {
            self.regs.borrow().get(&off).copied().unwrap_or(0)
        }
        fn write_word(&mut self, _df: DeviceFunction, off: u8, data: u32) {
            let v = match self.bars.get(&off) {
                Some(&(mask, ro)) => (data & mask) | ro,
                None => data,
            };
            self.regs.borrow_mut().insert(off, v);
        }
        unsafe fn unsafe_clone(&self) -> Self {
            self.clone()
        }
    }

    const DF: DeviceFunction = DeviceFunction {
        bus: 0,
        device: 3,
        function: 0,
    };

    /// Like QEMU's vhost-user-vsock-pci: BAR1 32-bit 4 KiB (MSI-X), BAR4/5 64-bit prefetchable
    /// 16 KiB (the virtio structures), and BAR2 already placed by "firmware".
    fn vsock_like() -> FakeCfg {
        let mut bars = HashMap::new();
        // Unimplemented BARs are hard-wired to zero.
        for off in [0x10, 0x1c] {
            bars.insert(off, (0, 0));
        }
        bars.insert(0x14, (!0xfffu32, 0x0));
        bars.insert(0x18, (!0xfffu32, 0x0));
        bars.insert(0x20, (!0x3fffu32, 0xc));
        bars.insert(0x24, (!0u32, 0));
        let cfg = FakeCfg {
            regs: Rc::default(),
            bars: Rc::new(bars),
        };
        let mut w = cfg.clone();
        for (off, &(_, ro)) in cfg.bars.iter() {
            w.write_word(DF, *off, ro);
        }
        w.write_word(DF, 0x18, 0xd000_0000);
        w.write_word(DF, 0x04, 0x0010_0000);
        cfg
    }

    #[test]
    fn config_address_matches_mechanism_one() {
        assert_eq!(config_address(DF, 0x10), 0x8000_1810);
        let df = DeviceFunction {
            bus: 2,
            device: 31,
            function: 7,
        };
        assert_eq!(config_address(df, 0xff), 0x8002_fffc);
    }

    #[test]
    fn window_aligns_naturally_and_refuses_overflow() {
        let mut w = MmioWindow::new(0xe000_0100, 0xe001_0000);
        assert_eq!(w.try_alloc(0x1000), Some(0xe000_1000));
        assert_eq!(w.try_alloc(0x4000), Some(0xe000_4000));
        assert_eq!(w.try_alloc(0x1000), Some(0xe000_8000));
        assert_eq!(w.try_alloc(0x3000), None);
        assert_eq!(w.try_alloc(0x8000), None);
        assert_eq!(w.try_alloc(0x7000 + 0x1000), None);
        assert_eq!(w.try_alloc(0x4000), Some(0xe000_c000));
        assert_eq!(w.try_alloc(0x10), None);
        let mut top = MmioWindow::new(u64::MAX - 10, u64::MAX);
        assert_eq!(top.try_alloc(0x1000), None);
    }

    #[test]
    fn unassigned_memory_bars_are_placed_and_decoding_enabled() {
        let cfg = vsock_like();
        let mut root = PciRoot::new(cfg.clone());
        let mut w = DEFAULT_MMIO_WINDOW;
        let mut placed = Vec::new();
        assign_memory_bars(&mut root, DF, &mut w, |b| placed.push(b)).expect("assigns");
        assert_eq!(
            placed,
            vec![
                AssignedBar {
                    index: 1,
                    address: 0xe000_0000,
                    size: 0x1000
                },
                AssignedBar {
                    index: 4,
                    address: 0xe000_4000,
                    size: 0x4000
                },
            ]
        );
        let r = |off| cfg.read_word(DF, off);
        assert_eq!(r(0x14), 0xe000_0000);
        assert_eq!(r(0x18), 0xd000_0000, "firmware's BAR kept");
        assert_eq!(r(0x20), 0xe000_400c);
        assert_eq!(r(0x24), 0);
        assert_eq!(r(0x04) & 0x6, 0x6, "memory space and bus master on");
        let bars = root.bars(DF).expect("decodes");
        assert_eq!(
            bars[4].as_ref().and_then(BarInfo::memory_address_size),
            Some((0xe000_4000, 0x4000))
        );
    }

    #[test]
    fn a_full_window_is_an_error() {
        let cfg = vsock_like();
        let mut root = PciRoot::new(cfg.clone());
        let mut w = MmioWindow::new(0xe000_0000, 0xe000_2000);
        let err = assign_memory_bars(&mut root, DF, &mut w, |_| {}).expect_err("no room");
        assert_eq!(
            err,
            BarError::WindowFull {
                bar: 4,
                size: 0x4000
            }
        );
        assert_eq!(cfg.read_word(DF, 0x04) & 0x6, 0, "decoding left off");
    }
}
