//! The software TSC skew the agent can apply to every value it reports.
//!
//! The TSC itself is read with `vmtsync_core::arch::x86_64::NativeTsc::lfence_rdtsc()`: never
//! RDTSCP, which is not exposed to guests on the project's machines and kills the VM when
//! executed (see docs/host-quirks.md); `lfence` keeps the read after the UART read that
//! delivered the probe.

/// A software skew applied to every TSC value the agent reports, in KVM's own form:
/// `reported = offset + ((tsc * ratio) >> frac_bits)` (wrapping add, 128-bit product). It lets
/// tests exercise non-zero offsets and scaling end to end on machines where KVM refuses to
/// set them (see docs/host-quirks.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skew {
    /// Added (wrapping) after scaling, like KVM's `tsc_offset`.
    pub offset: u64,
    /// Fixed-point multiplier with `frac_bits` fractional bits.
    pub ratio: u64,
    /// Fractional bits of `ratio` (at most 63).
    pub frac_bits: u32,
}

impl Skew {
    /// The identity skew: offset 0, ratio 1.0.
    pub const IDENTITY: Self = Self {
        offset: 0,
        ratio: 1,
        frac_bits: 0,
    };

    /// Applies the skew to a raw TSC value. The scaled value is truncated to 64 bits (KVM keeps
    /// the low 64 bits of the shifted product too).
    #[must_use]
    pub fn apply(self, tsc: u64) -> u64 {
        let scaled = (u128::from(tsc) * u128::from(self.ratio)) >> self.frac_bits;
        // Truncation is KVM's own behaviour for the guest TSC (kvm_scale_tsc returns u64).
        #[allow(clippy::cast_possible_truncation)]
        let scaled = scaled as u64;
        scaled.wrapping_add(self.offset)
    }
}

/// A TSC whose every reading goes through a [`Skew`]: what the agent's clock reports and what
/// its event recorder stamps with, so probes and events live on the same (skewed) guest clock.
#[derive(Clone, Copy, Debug)]
pub struct SkewedTsc<T> {
    /// The raw counter.
    pub tsc: T,
    /// The skew applied to each reading.
    pub skew: Skew,
}

impl<T: vmtsync_core::arch::Tsc> vmtsync_core::arch::Tsc for SkewedTsc<T> {
    #[inline]
    fn read_ordered(&self) -> u64 {
        self.skew.apply(self.tsc.read_ordered())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_skew_changes_nothing() {
        for t in [0, 1, 1 << 40, u64::MAX] {
            assert_eq!(Skew::IDENTITY.apply(t), t);
        }
    }

    #[test]
    fn skew_matches_kvm_formula_against_u128_reference() {
        // A small deterministic LCG: no dependencies in the agent crate.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            x
        };
        for _ in 0..10_000 {
            let s = Skew {
                offset: next(),
                ratio: next() >> (next() % 64),
                frac_bits: u32::try_from(next() % 64).expect("below 64"),
            };
            let t = next() >> (next() % 64);
            let reference = ((u128::from(t) * u128::from(s.ratio)) >> s.frac_bits)
                .wrapping_add(u128::from(s.offset))
                % (1u128 << 64);
            assert_eq!(u128::from(s.apply(t)), reference, "{s:?} tsc {t}");
        }
    }
}
