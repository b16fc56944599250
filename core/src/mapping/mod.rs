//! Exact KVM TSC mapping math: the forward relation, its inverse, nested composition, and
//! ticks→nanoseconds in perf's form. Pure integer code: no floats, no heap, no panics.
//!
//! # The relation
//!
//! KVM gives each vCPU a TSC derived from the host's (arch/x86/kvm/x86.c `kvm_scale_tsc`,
//! `kvm_read_l1_tsc`):
//!
//! ```text
//! guest = offset + ((host * ratio) >> frac_bits)        (mod 2^64)
//! ```
//!
//! `ratio` is a fixed-point number with `frac_bits` fraction bits (48 on Intel VMX, 32 on AMD
//! SVM); the default `1 << frac_bits` means "same rate". The product is 128 bits wide and the
//! shift floors. The offset is added modulo 2^64, as the hardware does, so a negative offset
//! is just its two's-complement `u64`. [`KvmTscMapping`] holds the three values as KVM's
//! debugfs shows them (`tsc-offset`, `tsc-scaling-ratio`, `tsc-scaling-ratio-frac-bits`).
//!
//! # Sign conventions
//!
//! KVM's `tsc-offset` is added to the *scaled host* value, so for identity scaling it is
//! `guest - host`: a guest booted after the host has a negative offset. trace-cmd stores the
//! opposite sign (`-tsc_offset`, "host - guest") in its TIME_SHIFT samples; converting to its
//! format is the exporter's job, not this module's. All conversions here go in terms of
//! [`HostTicks`](crate::HostTicks) and [`GuestTicks`](crate::GuestTicks), so the direction is
//! in the types.
//!
//! # Rounding, function by function
//!
//! - [`KvmTscMapping::try_guest_from_host`]: exact KVM result (floor of the scaled product,
//!   wrapping offset); `None` if the scaled value exceeds `u64`.
//! - [`KvmTscMapping::try_host_from_guest_ceil`] / [`_floor`](KvmTscMapping::try_host_from_guest_floor):
//!   the first / last host tick whose guest image is at or after / at or before the guest tick,
//!   judged on `s = (guest - offset) mod 2^64`. Exact inverses on the image of the forward map;
//!   for `ratio >= 1 << frac_bits` host→guest→host is the identity.
//! - [`KvmTscMapping::try_compose_nested`]: bit for bit the kernel's nested offset (signed
//!   multiply truncating toward zero) and multiplier (floor); its distance from applying the
//!   two mappings in turn is bounded by [`KvmTscMapping::try_nested_deviation_bound`].
//! - [`PerfTimeConv::try_nanos_from_ticks`]: floor, like perf. Its inverses
//!   [`_ceil`](PerfTimeConv::try_ticks_from_nanos_ceil) and
//!   [`_floor`](PerfTimeConv::try_ticks_from_nanos_floor) follow the same first/last rule.
//!
//! # Why trace-cmd's reader is wrong for scaled guests
//!
//! trace-cmd converts a guest timestamp with `ts = (ts * scaling) >> frac` in plain 64-bit
//! arithmetic and then subtracts the offset (libtracecmd `timestamp_correction_calc`). That is
//! wrong three ways: it applies the *forward* scale to a *guest* value where the inverse
//! `((guest - offset) << frac) / ratio` is needed; it scales before removing the offset,
//! although the offset is in guest units; and `ts * scaling` with `scaling` near 2^48 wraps
//! 64 bits for any `ts` above 2^16 ticks (microseconds of uptime). It only works because the
//! recorder normalizes default ratios to `scaling = 1, frac = 0`. This module never computes a
//! product in 64 bits.

mod error;
mod nested;
mod perf;
mod relation;
#[cfg(test)]
mod test_support;

pub use error::MappingError;
pub use nested::NestedDeviation;
pub use perf::{MAX_PERF_SHIFT, PerfTimeConv, clocks_calc_mult_shift};
pub use relation::{FRAC_BITS_SVM, FRAC_BITS_VMX, KvmTscMapping, MAX_FRAC_BITS};
