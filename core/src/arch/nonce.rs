//! Boot nonces: the value a guest publishes in its recorder header so that a reader of guest
//! memory can tell one boot (or one publication) from the next.
//!
//! The nonce needs to differ between boots, not to be secret: a reader compares it with the
//! one it saw before. RDRAND is the best source where CPUID offers it; otherwise the TSC read
//! at publication, put through a mixing function so that two boots whose TSCs differ in a few
//! low bits still get unrelated nonces.

/// A non-zero nonce from an optional hardware random value and a TSC reading: the random
/// value when there is one, else the mixed TSC. Zero (which the header reserves for "none")
/// never comes out.
#[must_use]
pub const fn nonce_from(random: Option<u64>, tsc: u64) -> u64 {
    let n = match random {
        // The hardware value is mixed with the TSC too, so a broken RDRAND that always
        // returns the same value (some AMD parts returned all ones) still varies per boot.
        Some(r) => mix(r ^ mix(tsc)),
        None => mix(tsc),
    };
    if n == 0 { 1 } else { n }
}

/// SplitMix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014): a bijection on `u64` in which every input bit affects every
/// output bit.
const fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_are_never_zero_and_follow_their_inputs() {
        // The input whose mix is zero must still give a non-zero nonce.
        let mut seen = [0u64; 64];
        for (i, s) in seen.iter_mut().enumerate() {
            *s = nonce_from(None, i as u64);
            assert_ne!(*s, 0);
        }
        // Neighbouring TSC values give distinct nonces (mix is a bijection).
        for (i, a) in seen.iter().enumerate() {
            assert!(seen[i + 1..].iter().all(|b| b != a));
        }
        assert_ne!(nonce_from(Some(7), 1), nonce_from(Some(7), 2));
        assert_ne!(nonce_from(Some(7), 1), nonce_from(None, 1));
    }
}
