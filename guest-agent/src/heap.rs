//! Memory for the virtio transport: the heap region behind the agent's global allocator
//! (virtio-drivers' socket driver needs `alloc`), and [`IdentityHal`], the virtio-drivers
//! `Hal` for the agent's identity-mapped address space.
//!
//! The region lives in the linker script's NOLOAD `.heap` section: it is never zeroed at boot
//! (zeroing in emulated ring-0 code costs ~0.5 M cycles per 4 KiB here, see
//! docs/host-quirks.md), and [`IdentityHal::dma_alloc`] zeroes only what it hands out, in
//! ring 3 at native speed.
//! The allocator itself is declared by the binary (`#[global_allocator]`), so a unikernel that
//! embeds this library keeps its own.

use core::alloc::Layout;
use core::mem::MaybeUninit;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, Ordering};

use virtio_drivers::{BufferDirection, Hal, PAGE_SIZE, PhysAddr};

/// Size of the heap region. The vsock driver needs about 30 KiB (three virtqueues of two pages
/// each, eight 512-byte receive buffers, and a short-lived indirect descriptor list per send;
/// the agent logs the figure); the rest is headroom.
pub const HEAP_SIZE: usize = 128 * 1024;

#[repr(C, align(4096))]
struct Region(MaybeUninit<[u8; HEAP_SIZE]>);

// `link_section` only on the bare-metal target: the host unit tests use an ordinary static.
#[cfg_attr(target_os = "none", unsafe(link_section = ".heap"))]
static mut REGION: Region = Region(MaybeUninit::uninit());
static REGION_TAKEN: AtomicBool = AtomicBool::new(false);

/// The heap region, page-aligned and uninitialised; `None` after the first call, so there is
/// only ever one `&mut` to it.
pub fn take_region() -> Option<&'static mut [MaybeUninit<u8>]> {
    if REGION_TAKEN.swap(true, Ordering::AcqRel) {
        return None;
    }
    // `Region` is `repr(C)` around the bytes, so its address is theirs.
    let bytes: *mut MaybeUninit<u8> = (&raw mut REGION).cast();
    // SAFETY: `bytes` points to HEAP_SIZE bytes of the static, MaybeUninit<u8> needs no
    // initialisation, and the flag above lets exactly one caller through, so this is the only
    // reference to REGION for the rest of the program.
    Some(unsafe { core::slice::from_raw_parts_mut(bytes, HEAP_SIZE) })
}

/// virtio-drivers' `Hal` for an identity-mapped guest (virtual address == guest-physical
/// address, boot.rs's page tables), without an IOMMU or memory encryption: DMA buffers come
/// from the global allocator, page-aligned and zeroed; sharing a buffer is handing out its
/// address.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityHal;

fn dma_layout(pages: usize) -> Option<Layout> {
    let size = pages.checked_mul(PAGE_SIZE)?;
    Layout::from_size_align(size, PAGE_SIZE).ok()
}

/// The physical address of `ptr` under the identity map.
fn phys(ptr: *const u8) -> PhysAddr {
    // usize is 64 bits on x86_64, so this is lossless.
    ptr as usize as PhysAddr
}

// SAFETY: dma_alloc returns fresh, zeroed, page-aligned memory from the global allocator that no
// one else references until dma_dealloc; under the identity map its address is also what the
// device must use. mmio_phys_to_virt returns the BAR address itself, which boot.rs maps.
unsafe impl Hal for IdentityHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        let Some(layout) = dma_layout(pages).filter(|l| l.size() > 0) else {
            return (0, NonNull::dangling());
        };
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc::alloc::alloc_zeroed(layout) };
        match NonNull::new(p) {
            Some(nn) => (phys(p), nn),
            // virtio-drivers reports paddr 0 as DmaError.
            None => (0, NonNull::dangling()),
        }
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, vaddr: NonNull<u8>, pages: usize) -> i32 {
        let Some(layout) = dma_layout(pages) else {
            return -1;
        };
        // SAFETY: the caller passes back what dma_alloc returned for the same `pages`, so
        // `vaddr` came from alloc_zeroed with this layout.
        unsafe { alloc::alloc::dealloc(vaddr.as_ptr(), layout) };
        0
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        let addr = usize::try_from(paddr).unwrap_or(0);
        // virtio-drivers only passes BAR addresses it checked to be non-zero.
        NonNull::new(addr as *mut u8).expect("MMIO BAR at physical address 0")
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> PhysAddr {
        phys(buffer.as_ptr().cast::<u8>())
    }

    unsafe fn unshare(_paddr: PhysAddr, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dma_is_page_aligned_zeroed_and_identity_addressed() {
        let (pa, va) = IdentityHal::dma_alloc(3, BufferDirection::Both);
        assert_ne!(pa, 0);
        assert_eq!(pa, phys(va.as_ptr()));
        assert_eq!(pa % 4096, 0);
        // SAFETY: dma_alloc returned 3 readable pages at `va`.
        let bytes = unsafe { core::slice::from_raw_parts(va.as_ptr(), 3 * PAGE_SIZE) };
        assert!(bytes.iter().all(|&b| b == 0));
        // SAFETY: passing back exactly what dma_alloc returned.
        assert_eq!(unsafe { IdentityHal::dma_dealloc(pa, va, 3) }, 0);
    }

    #[test]
    fn zero_or_overflowing_page_counts_are_refused() {
        assert_eq!(IdentityHal::dma_alloc(0, BufferDirection::Both).0, 0);
        assert_eq!(
            IdentityHal::dma_alloc(usize::MAX, BufferDirection::Both).0,
            0
        );
    }

    #[test]
    fn share_hands_out_the_address_and_the_region_is_taken_once() {
        let mut buf = [1u8; 16];
        let nn = NonNull::from(&mut buf[..]);
        // SAFETY: `buf` is a valid, non-empty buffer no one else touches.
        let pa = unsafe { IdentityHal::share(nn, BufferDirection::DriverToDevice) };
        assert_eq!(pa, phys(buf.as_ptr()));
        let r = take_region().expect("first take");
        assert_eq!(r.len(), HEAP_SIZE);
        assert_eq!(r.as_ptr() as usize % 4096, 0);
        assert!(take_region().is_none());
    }
}
