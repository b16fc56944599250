//! Volatile access to a pvclock page that the hypervisor writes behind the compiler's back.

use core::marker::PhantomData;
use core::ptr::{self, NonNull};

use super::kvm_abi::PvclockVcpuTimeInfo;

/// A pvclock page in guest memory, read field by field with volatile loads.
///
/// The hypervisor rewrites the page at any time (from the guest's point of view), so the
/// compiler must neither cache nor merge reads of it: every read is `read_volatile`.
/// Consistency across fields is not this type's job; [`crate::pvclock::try_read`] provides it
/// with the version seqlock.
#[derive(Debug, Clone, Copy)]
pub struct PvclockPage<'a> {
    ptr: NonNull<PvclockVcpuTimeInfo>,
    _page: PhantomData<&'a PvclockVcpuTimeInfo>,
}

// SAFETY: the page is only read (volatile, by value) through this handle; reads from several
// threads or vCPUs at once are fine, and `new`'s contract makes the memory valid for `'a`.
unsafe impl Send for PvclockPage<'_> {}
// SAFETY: as for `Send`: `&PvclockPage` only allows volatile reads.
unsafe impl Sync for PvclockPage<'_> {}

impl<'a> PvclockPage<'a> {
    /// Wraps the page at `ptr`; `None` if it is null or not 8-byte aligned. KVM itself only
    /// asks for 4 (Documentation/virt/kvm/x86/msr.rst), but the Rust struct holds `u64`s that
    /// are read whole, and an 8-aligned 32-byte struct never straddles a page boundary.
    ///
    /// # Safety
    ///
    /// For all of `'a`, `ptr` must point to 32 bytes of memory that are valid for reads and
    /// that nothing in this program writes except through volatile or atomic stores (the
    /// hypervisor writing it is the point). Typically it is a `static` registered with
    /// `arch::x86_64::register_pvclock` (feature `ring0`).
    #[must_use]
    pub unsafe fn new(ptr: *const PvclockVcpuTimeInfo) -> Option<Self> {
        let ptr = NonNull::new(ptr.cast_mut())?;
        if !ptr.as_ptr().is_aligned() {
            return None;
        }
        Some(Self {
            ptr,
            _page: PhantomData,
        })
    }
}

impl PvclockPage<'_> {
    /// Reads the `version` word (odd while the hypervisor writes the page).
    #[inline]
    #[must_use]
    pub fn read_version(&self) -> u32 {
        let p = self.ptr.as_ptr();
        // SAFETY: `new`'s contract: `p` is aligned and valid for reads for `'a`; the field
        // projection stays inside the 32-byte struct and creates no reference.
        unsafe { ptr::read_volatile(&raw const (*p).version) }
    }

    /// Reads the payload fields, each once (they may be torn if the page is being written).
    /// The version is not read here, the seqlock reads it around this call: it is 0 in the
    /// result, as are the padding fields.
    #[inline]
    #[must_use]
    pub fn read_payload(&self) -> PvclockVcpuTimeInfo {
        let p = self.ptr.as_ptr();
        // SAFETY: as in `read_version`: aligned, valid for reads, raw field projections only.
        unsafe {
            PvclockVcpuTimeInfo {
                tsc_timestamp: ptr::read_volatile(&raw const (*p).tsc_timestamp),
                system_time: ptr::read_volatile(&raw const (*p).system_time),
                tsc_to_system_mul: ptr::read_volatile(&raw const (*p).tsc_to_system_mul),
                tsc_shift: ptr::read_volatile(&raw const (*p).tsc_shift),
                flags: ptr::read_volatile(&raw const (*p).flags),
                ..PvclockVcpuTimeInfo::default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // Test only: the seqlock reader one layer up, over the real page.
    use crate::pvclock::{DEFAULT_MAX_ATTEMPTS, PvclockScale, PvclockSource, try_read};

    #[test]
    fn reads_through_pointer() {
        let info = PvclockVcpuTimeInfo {
            version: 4,
            tsc_timestamp: 1000,
            system_time: 77,
            tsc_to_system_mul: 0x8000_0000,
            tsc_shift: -1,
            flags: 3,
            ..PvclockVcpuTimeInfo::default()
        };
        // SAFETY: `info` outlives `page` and is not written while `page` exists.
        let page = unsafe { PvclockPage::new(&raw const info) }.expect("aligned, non-null");
        assert_eq!(page.read_version(), 4);
        assert_eq!(
            page.read_payload(),
            PvclockVcpuTimeInfo { version: 0, ..info }
        );
        assert_eq!(page.fields(), info.fields());
        let r = try_read(&page, DEFAULT_MAX_ATTEMPTS).expect("stable page");
        assert_eq!(r.version, 4);
        assert_eq!(
            r.fields.scale,
            PvclockScale {
                mul: 0x8000_0000,
                shift: -1
            }
        );
        assert!(r.fields.flags.tsc_stable() && r.fields.flags.guest_stopped());
    }

    #[test]
    fn rejects_null_and_misaligned() {
        // SAFETY: a null pointer is rejected before any read.
        assert!(unsafe { PvclockPage::new(ptr::null()) }.is_none());
        let buf = [0u64; 5];
        let misaligned = buf
            .as_ptr()
            .cast::<u8>()
            .wrapping_add(1)
            .cast::<PvclockVcpuTimeInfo>();
        // SAFETY: a misaligned pointer is rejected before any read.
        assert!(unsafe { PvclockPage::new(misaligned) }.is_none());
    }
}
