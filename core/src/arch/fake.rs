//! Fakes of the hardware traits, for host tests of everything above `arch` (and for anyone
//! embedding the core who wants to test their own glue). No heap: the CPUID table is a
//! borrowed slice.

use core::sync::atomic::{AtomicU64, Ordering};

use super::{Cpuid, CpuidResult, Tsc};

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

#[cfg(test)]
mod tests {
    use super::*;

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

/// A defmt global logger for this crate's own host unit tests: with `--features defmt` and a
/// `DEFMT_LOG` level that keeps some log calls, the test binary references defmt's logger
/// symbols, which only a final firmware image normally provides. It discards every frame.
/// It lives here because implementing `defmt::Logger` takes `unsafe`.
#[cfg(all(test, feature = "defmt"))]
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
