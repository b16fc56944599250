//! The host TSC as the VMM reads it at VM exits.

/// Reads the host TSC with `lfence; rdtsc`, so the read is ordered after the ioctl return that
/// reported the exit. RDTSCP is avoided for symmetry with the guest (see docs/host-quirks.md).
#[must_use]
#[inline]
pub fn host_tsc() -> u64 {
    vmtsync_core::arch::x86_64::lfence_rdtsc()
}
