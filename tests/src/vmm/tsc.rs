//! The host TSC as the VMM reads it at VM exits.

/// Reads the host TSC with `lfence; rdtsc`, so the read is ordered after the ioctl return that
/// reported the exit. RDTSCP is avoided for symmetry with the guest (DESIGN.md §4).
#[must_use]
#[inline]
pub fn host_tsc() -> u64 {
    // SAFETY: lfence and rdtsc are available on every x86_64 CPU and have no memory effects;
    // user-mode rdtsc is allowed (CR4.TSD is clear on Linux hosts).
    unsafe {
        core::arch::x86_64::_mm_lfence();
        core::arch::x86_64::_rdtsc()
    }
}
