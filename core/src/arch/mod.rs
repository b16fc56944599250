//! Hardware access: the TSC, CPUID, the pvclock page, MSRs and hypercalls.
//!
//! This is the only module of the crate that may contain `unsafe` (every block carries a
//! `// SAFETY:` line). Everything above it talks to hardware through two small traits,
//! [`Tsc`] and [`Cpuid`], plus [`crate::pvclock::PvclockSource`] for the pvclock page, so
//! that the logic runs on the host against the fakes in this module ([`FakeTsc`],
//! [`FakeCpuid`]) and the real implementations stay a few lines long:
//!
//! - [`x86_64`] (only on `target_arch = "x86_64"`): ordered TSC reads (`lfence; rdtsc`, or
//!   `rdtscp` only where CPUID says it exists), native CPUID, pvclock registration by `wrmsr`
//!   (feature `ring0`) and `KVM_HC_CLOCK_PAIRING` (feature `clock-pairing`).
//! - [`cpuid`]: decoding of the CPUID leaves this crate needs, over any [`Cpuid`].
//! - [`kvm`]: KVM ABI constants (CPUID signature and feature bits, MSRs, hypercalls).
//! - [`PvclockPage`]: volatile reads of a pvclock page the hypervisor writes.
#![allow(unsafe_code)]

pub mod cpuid;
mod fake;
pub mod kvm;
mod page;
#[cfg(target_arch = "x86_64")]
pub mod x86_64;

pub use fake::{CpuidEntry, FakeCpuid, FakeTsc};
pub use page::PvclockPage;

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

/// The four registers one CPUID query returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct CpuidResult {
    /// EAX after `cpuid`.
    pub eax: u32,
    /// EBX after `cpuid`.
    pub ebx: u32,
    /// ECX after `cpuid`.
    pub ecx: u32,
    /// EDX after `cpuid`.
    pub edx: u32,
}

/// A CPUID instruction, real or faked, so feature detection can be tested on any host.
pub trait Cpuid {
    /// Executes CPUID with EAX = `leaf` and ECX = `subleaf`.
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult;
}

impl<C: Cpuid + ?Sized> Cpuid for &C {
    #[inline]
    fn cpuid(&self, leaf: u32, subleaf: u32) -> CpuidResult {
        (**self).cpuid(leaf, subleaf)
    }
}
