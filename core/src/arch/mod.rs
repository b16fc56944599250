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
//! - [`Tsc`] (`tsc.rs`): the ordered TSC read.
//! - [`cpuid`]: the [`Cpuid`] trait and decoding of the CPUID leaves this crate needs.
//! - [`kvm_abi`]: KVM ABI constants and structures (CPUID signature and feature bits, MSRs,
//!   hypercalls, the pvclock page layout [`kvm_abi::PvclockVcpuTimeInfo`]).
//! - [`PvclockPage`]: volatile reads of a pvclock page the hypervisor writes.
//!
//! This module depends only on [`crate::units`]: `pvclock` builds on it (its seqlock reader
//! implements [`crate::pvclock::PvclockSource`] for [`PvclockPage`]), never the reverse.
#![allow(unsafe_code)]

pub mod cpuid;
mod fake;
pub mod kvm_abi;
mod page;
mod tsc;
#[cfg(target_arch = "x86_64")]
pub mod x86_64;

pub use cpuid::{Cpuid, CpuidResult};
pub use fake::{CpuidEntry, FakeCpuid, FakeTsc};
pub use page::PvclockPage;
pub use tsc::Tsc;
