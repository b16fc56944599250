//! Newtypes that carry units, so a host tick can never be passed where a guest tick belongs.
//!
//! All three are plain `u64` underneath and encode on the wire exactly as a `u64` (postcard
//! varint). Arithmetic between them lives in [`crate::mapping`], where every operation names
//! how it rounds and returns `None` on overflow.

use serde::{Deserialize, Serialize};

macro_rules! tick_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
            postcard::experimental::max_size::MaxSize,
        )]
        #[cfg_attr(feature = "defmt", derive(defmt::Format))]
        #[repr(transparent)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The raw count.
            #[inline]
            #[must_use]
            pub const fn get(self) -> u64 {
                self.0
            }

            /// Signed distance `self - earlier`, or `None` if it does not fit an `i64`.
            #[inline]
            #[must_use]
            pub const fn try_signed_since(self, earlier: Self) -> Option<i64> {
                let d = (self.0 as i128) - (earlier.0 as i128);
                if d > i64::MAX as i128 || d < i64::MIN as i128 {
                    None
                } else {
                    #[allow(clippy::cast_possible_truncation)]
                    Some(d as i64)
                }
            }
        }

        impl From<u64> for $name {
            #[inline]
            fn from(v: u64) -> Self {
                Self(v)
            }
        }

        impl From<$name> for u64 {
            #[inline]
            fn from(v: $name) -> u64 {
                v.0
            }
        }
    };
}

tick_newtype!(
    /// A reading of the host's TSC (the host trace clock `x86-tsc`).
    HostTicks
);
tick_newtype!(
    /// A reading of a guest vCPU's TSC, as the guest sees it (after KVM offset and scaling).
    GuestTicks
);
tick_newtype!(
    /// Nanoseconds (e.g. kvmclock / pvclock system time, perf time).
    Nanos
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_since_bounds() {
        assert_eq!(HostTicks(10).try_signed_since(HostTicks(3)), Some(7));
        assert_eq!(HostTicks(3).try_signed_since(HostTicks(10)), Some(-7));
        assert_eq!(HostTicks(u64::MAX).try_signed_since(HostTicks(0)), None);
        assert_eq!(HostTicks(0).try_signed_since(HostTicks(u64::MAX)), None);
        assert_eq!(
            GuestTicks(1 << 63).try_signed_since(GuestTicks(1)),
            Some(i64::MAX)
        );
    }
}
