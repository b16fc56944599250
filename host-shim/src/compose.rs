//! `vmtsync tsc compose`: the nested L0→L2 mapping from the L0→L1 and L1→L2 mappings, exactly
//! as KVM computes it (`kvm_calc_nested_tsc_offset` / `kvm_calc_nested_tsc_multiplier`).

use std::str::FromStr;

use serde::Serialize;
use thiserror::Error;
use vmtsync_core::mapping::KvmTscMapping;

use crate::kvm::scan::SCHEMA_VERSION;

/// A mapping given on the command line as `OFFSET,RATIO,FRAC`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingArg(pub KvmTscMapping);

/// Why an `OFFSET,RATIO,FRAC` argument or a composition was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ComposeError {
    /// The argument is not three comma-separated numbers.
    #[error("expected OFFSET,RATIO,FRAC (e.g. -1000,281474976710656,48), found \"{0}\"")]
    Syntax(String),
    /// A field is out of range.
    #[error("{field} \"{value}\" is not valid: {why}")]
    Field {
        /// Which field.
        field: &'static str,
        /// Its text.
        value: String,
        /// What it must be.
        why: &'static str,
    },
    /// The mappings use different fraction bits, or the result does not fit.
    #[error(
        "cannot compose: {0} (both levels must use the same fraction bits, as on one CPU vendor, and the result must fit 64 bits)"
    )]
    Compose(String),
}

impl FromStr for MappingArg {
    type Err = ComposeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut it = s.split(',');
        let (Some(o), Some(r), Some(f), None) = (it.next(), it.next(), it.next(), it.next()) else {
            return Err(ComposeError::Syntax(s.to_owned()));
        };
        let field = |field, value: &str, why| ComposeError::Field {
            field,
            value: value.to_owned(),
            why,
        };
        let offset = o
            .trim()
            .parse::<i64>()
            .map_err(|_| field("OFFSET", o, "a signed 64-bit decimal"))?;
        let ratio = r
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&r| r != 0)
            .ok_or_else(|| field("RATIO", r, "a non-zero unsigned 64-bit decimal"))?;
        let frac_bits = f
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&f| f < 64)
            .ok_or_else(|| field("FRAC", f, "fraction bits from 0 to 63"))?;
        // Both invariants were checked above with field-specific messages.
        KvmTscMapping::try_new(offset, ratio, frac_bits)
            .map(Self)
            .map_err(|e| ComposeError::Syntax(format!("{s}: {e}")))
    }
}

/// The JSON of `vmtsync tsc compose --json`, field names as in `vmtsync kvm --json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ComposedJson {
    /// Always [`SCHEMA_VERSION`].
    pub schema: u32,
    /// L0→L2 offset.
    pub tsc_offset: i64,
    /// L0→L2 multiplier.
    pub tsc_scaling_ratio: u64,
    /// Fraction bits.
    pub tsc_frac_bits: u32,
}

/// True when `m` does not scale (`ratio == 1 << frac_bits`), whatever its fraction bits.
fn is_identity_ratio(m: &KvmTscMapping) -> bool {
    m.frac_bits() < 64 && m.ratio() == 1u64 << m.frac_bits()
}

/// `m` with its identity ratio written in `frac_bits` fraction bits (`1 << frac_bits`), so a
/// no-scaling reading (`vmtsync kvm` prints ratio 1, frac bits 0 when the host has no TSC
/// scaling) composes with a scaled one. `m` unchanged if it scales.
fn identity_in(m: &KvmTscMapping, frac_bits: u32) -> KvmTscMapping {
    if is_identity_ratio(m) && frac_bits < 64 {
        KvmTscMapping::try_new(m.offset(), 1u64 << frac_bits, frac_bits).unwrap_or(*m)
    } else {
        *m
    }
}

/// Composes L0→L1 with L1→L2. A side that does not scale (ratio `1 << frac`, including the
/// `1,0` of a host without TSC scaling) is first rewritten to the other side's fraction bits,
/// which does not change the mapping it denotes.
///
/// # Errors
/// [`ComposeError::Compose`] when both sides scale with different fraction bits, or the result
/// overflows.
pub fn compose(l01: &KvmTscMapping, l12: &KvmTscMapping) -> Result<KvmTscMapping, ComposeError> {
    let (l01, l12) = match (is_identity_ratio(l01), is_identity_ratio(l12)) {
        // Two identities: keep the finer fraction bits (the scaling-capable host's).
        (true, true) => {
            let f = l01.frac_bits().max(l12.frac_bits());
            (&identity_in(l01, f), &identity_in(l12, f))
        }
        (true, false) => (&identity_in(l01, l12.frac_bits()), l12),
        (false, true) => (l01, &identity_in(l12, l01.frac_bits())),
        (false, false) => (l01, l12),
    };
    if l01.frac_bits() != l12.frac_bits() {
        return Err(ComposeError::Compose(format!(
            "frac bits differ ({} vs {})",
            l01.frac_bits(),
            l12.frac_bits()
        )));
    }
    KvmTscMapping::try_compose_nested(l01, l12)
        .ok_or_else(|| ComposeError::Compose("the result overflows".to_owned()))
}

/// The JSON form of a composed mapping.
#[must_use]
pub fn to_json(m: &KvmTscMapping) -> ComposedJson {
    ComposedJson {
        schema: SCHEMA_VERSION,
        tsc_offset: m.offset(),
        tsc_scaling_ratio: m.ratio(),
        tsc_frac_bits: m.frac_bits(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_args() {
        let m = "-5,281474976710656,48".parse::<MappingArg>().unwrap().0;
        assert_eq!((m.offset(), m.ratio(), m.frac_bits()), (-5, 1 << 48, 48));
        assert_eq!(
            "1,2".parse::<MappingArg>(),
            Err(ComposeError::Syntax("1,2".into()))
        );
        assert!(matches!(
            "1,0,48".parse::<MappingArg>(),
            Err(ComposeError::Field { field: "RATIO", .. })
        ));
        assert!(matches!(
            "1,1,64".parse::<MappingArg>(),
            Err(ComposeError::Field { field: "FRAC", .. })
        ));
        assert!(matches!(
            "x,1,0".parse::<MappingArg>(),
            Err(ComposeError::Field {
                field: "OFFSET",
                ..
            })
        ));
    }

    #[test]
    fn different_frac_bits_refused() {
        let a = KvmTscMapping::try_new(0, 3 << 47, 48).unwrap();
        let b = KvmTscMapping::try_new(0, 3 << 31, 32).unwrap();
        assert!(matches!(compose(&a, &b), Err(ComposeError::Compose(_))));
    }

    #[test]
    fn no_scaling_side_takes_the_other_sides_frac_bits() {
        // `tsc compose --l1 -1000,1,0 --l2 5,281474976710656,48` (was "frac bits differ").
        let l1 = KvmTscMapping::try_new(-1000, 1, 0).unwrap();
        let l2 = KvmTscMapping::try_new(5, 1 << 48, 48).unwrap();
        let c = compose(&l1, &l2).unwrap();
        assert_eq!((c.offset(), c.ratio(), c.frac_bits()), (-995, 1 << 48, 48));
        // Either side, and with a real scaling ratio: host 1000 → L1 = 1000*1.5 + 10 = 1510,
        // L2 = 1510 - 10 = 1500.
        let l1 = KvmTscMapping::try_new(10, 3 << 47, 48).unwrap();
        let l2 = KvmTscMapping::try_new(-10, 1, 0).unwrap();
        let c = compose(&l1, &l2).unwrap();
        assert_eq!((c.offset(), c.ratio(), c.frac_bits()), (0, 3 << 47, 48));
        // Both identities with different bits compose too (to the finer bits).
        let c = compose(&KvmTscMapping::IDENTITY_VMX, &KvmTscMapping::IDENTITY_SVM).unwrap();
        assert_eq!((c.offset(), c.ratio(), c.frac_bits()), (0, 1 << 48, 48));
    }
}
