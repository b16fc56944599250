//! The [`Tsc`] trait: ordered time-stamp-counter readings, real (`x86_64`) or faked.

/// A source of ordered time-stamp-counter readings.
///
/// "Ordered" means the read does not execute before earlier instructions have completed
/// (`lfence; rdtsc` or `rdtscp`), so a reading taken after an I/O or a memory read is really
/// later than it. Sync probes depend on that: an early TSC read would shrink a measured round
/// trip below its true length and break the error bound.
pub trait Tsc {
    /// Reads the counter, ordered after all earlier instructions.
    fn read_ordered(&self) -> u64;
}

impl<T: Tsc + ?Sized> Tsc for &T {
    #[inline]
    fn read_ordered(&self) -> u64 {
        (**self).read_ordered()
    }
}
