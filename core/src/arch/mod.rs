//! Hardware access: the TSC, CPUID, port I/O, the pvclock page, MSRs and hypercalls, and the
//! ready-made guest pieces built on them.
//!
//! This is the only module of the crate that may contain `unsafe` (every block carries a
//! `// SAFETY:` line). Everything above it talks to hardware through small traits, [`Tsc`],
//! [`Cpuid`] and [`PortIo`], plus [`crate::pvclock::PvclockSource`] for the pvclock page, so
//! that the logic runs on the host against the fakes in this module ([`FakeTsc`],
//! [`FakeCpuid`], [`FakePorts`]) and the real implementations stay a few lines long:
//!
//! - [`x86_64`] (only on `target_arch = "x86_64"`): ordered TSC reads (`lfence; rdtsc`, or
//!   `rdtscp` only where CPUID says it exists), native CPUID, native port I/O
//!   ([`NativePorts`]), the guest's own [`x86_64::NativeClock`], pvclock registration by
//!   `wrmsr` (feature `ring0`) and `KVM_HC_CLOCK_PAIRING` (feature `clock-pairing`).
//! - [`Tsc`] (`tsc.rs`): the ordered TSC read.
//! - [`cpuid`]: the [`Cpuid`] trait and decoding of the CPUID leaves this crate needs.
//! - [`PortIo`] (`port.rs`): byte-wide port I/O, and [`NativePorts`], the real one.
//! - [`kvm_abi`]: KVM ABI constants and structures (CPUID signature and feature bits, MSRs,
//!   hypercalls, the pvclock page layout [`kvm_abi::PvclockVcpuTimeInfo`]).
//! - [`PvclockPage`]: volatile reads of a pvclock page the hypervisor writes.
//! - [`nonce_from`] (`nonce.rs`): the recorder header's boot nonce from RDRAND or the TSC
//!   (on real hardware [`x86_64::boot_nonce`]).
//!
//! The ready-made pieces a unikernel embeds instead of writing its own, so they implement the
//! [`crate::agent`] traits:
//!
//! - [`uart16550`]: a polled 16550 as an [`crate::agent::Link`] that shares the wire with
//!   console text ([`core::fmt::Write`]).
//! - [`clock`]: [`clock::TscClock`], the [`crate::agent::AgentClock`] over an ordered TSC
//!   (on real hardware [`x86_64::NativeClock`]).
//!
//! Apart from those two, this module depends only on [`crate::units`]: `pvclock` builds on it
//! (its seqlock reader implements [`crate::pvclock::PvclockSource`] for [`PvclockPage`]).
#![allow(unsafe_code)]

pub mod clock;
pub mod cpuid;
mod fake;
pub mod kvm_abi;
mod nonce;
mod page;
mod port;
mod tsc;
pub mod uart16550;
#[cfg(target_arch = "x86_64")]
pub mod x86_64;

pub use cpuid::{Cpuid, CpuidResult};
pub use fake::{
    CpuidEntry, FAKE_PORTS_LOG, FAKE_UART_BUFFER, FakeCpuid, FakePorts, FakeTsc, PortAccess,
};
pub use nonce::nonce_from;
pub use page::PvclockPage;
pub use port::{NativePorts, PortIo};
pub use tsc::Tsc;
