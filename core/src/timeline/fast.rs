//! The batch kernels behind [`super::Cursor::try_convert_slice_floor`].
//!
//! A kernel converts the longest prefix of a slice whose ticks all lie in the current
//! segment's *fast range* (`0 <= tick - start <= span`, where `span` was computed so that the
//! result cannot overflow), and returns its length; the cursor handles the element that stops
//! it on the checked path. Inside the range every operation is exact, so the kernels use
//! wrapping arithmetic and contain no checks beyond the range test.
//!
//! Two shapes keep the loop short:
//!
//! - **Q64.64** (slope shift ≤ 64, i.e. every slope ≥ 1/4, which includes every real clock
//!   pair): `mul / 2^shift` is rewritten exactly as `k + f / 2^64`, so the result is
//!   `base + d·k + hi64(d·f + frac)`: one 64×64→128 multiply, an add with carry, a 64-bit
//!   multiply, two adds — no variable 128-bit shift (`shrd`/`shr`/`cmov`).
//! - **general** (shift > 64): `base + ((d·mul + frac) >> shift)`.
//!
//! Both test the range for eight ticks at a time (one branch per chunk, which the compiler may
//! turn into a single vector compare), then convert the chunk branch-free; the tail and the
//! chunk that leaves the range go one tick at a time.
//!
//! A KVM segment runs the same kernels with a correction step appended (see the `exact_inverse` module);
//! the linear kernels are instantiated with a no-op correction, so they pay nothing for it.

use super::segment::Segment;

/// Ticks tested and converted per chunk.
const LANES: usize = 8;

/// Converts the longest prefix of `ticks` with `0 <= tick - segment.start <= span` on a linear
/// segment's line and returns its length. `span` must not exceed the segment's own
/// overflow-free span. (A KVM segment goes through `exact_inverse::convert_run`, which runs
/// [`convert_run_with`] with its correction.)
pub(super) fn convert_run(segment: &Segment, span: u64, ticks: &mut [u64]) -> usize {
    convert_run_with(segment, span, ticks, |_, host| host)
}

/// [`convert_run`] on the segment's line, then `fix(d, host)` on each result, where `d` is
/// `tick - start` and `host` the line's value there.
#[inline(always)]
pub(super) fn convert_run_with(
    segment: &Segment,
    span: u64,
    ticks: &mut [u64],
    fix: impl Fn(u64, u64) -> u64,
) -> usize {
    let start = segment.start;
    let base = segment.base;
    let slope = segment.slope;
    let span = span.min(segment.fast_span);
    if let Some(up) = 64u32.checked_sub(slope.shift()) {
        // mul / 2^shift = (mul << up) / 2^64 = k + f / 2^64 exactly; frac < 2^shift, so
        // frac << up < 2^64. The truncating casts below split a u128 into its halves.
        let wide = u128::from(slope.mul()) << up;
        #[allow(clippy::cast_possible_truncation)] // The high half of a u128 (mul < 2^63).
        let k = (wide >> 64) as u64;
        #[allow(clippy::cast_possible_truncation)] // The low half of a u128, on purpose.
        let f = wide as u64;
        let frac = u128::from(u64::try_from(segment.frac << up).unwrap_or(0));
        run(ticks, start, span, |d| {
            let low = u128::from(d) * u128::from(f) + frac;
            #[allow(clippy::cast_possible_truncation)] // The high half of a u128.
            let hi = (low >> 64) as u64;
            fix(d, base.wrapping_add(d.wrapping_mul(k)).wrapping_add(hi))
        })
    } else {
        let mul = u128::from(slope.mul());
        let shift = slope.shift();
        let frac = segment.frac;
        run(ticks, start, span, |d| {
            // d <= span keeps the result below 2^64 - base.
            #[allow(clippy::cast_possible_truncation)]
            let whole = ((u128::from(d) * mul + frac) >> shift) as u64;
            fix(d, base.wrapping_add(whole))
        })
    }
}

/// The range-checked loop shared by both kernels: `map` receives `tick - start`.
#[inline(always)]
fn run(ticks: &mut [u64], start: u64, span: u64, map: impl Fn(u64) -> u64) -> usize {
    let mut done = 0usize;
    while let Some(chunk) = ticks
        .get_mut(done..)
        .and_then(|rest| rest.first_chunk_mut::<LANES>())
    {
        // A tick below `start` wraps to a huge distance: one compare checks both ends.
        let inside = chunk
            .iter()
            .fold(true, |ok, &t| ok & (t.wrapping_sub(start) <= span));
        if !inside {
            break;
        }
        for t in chunk.iter_mut() {
            *t = map(t.wrapping_sub(start));
        }
        done += LANES;
    }
    for t in ticks.get_mut(done..).unwrap_or_default() {
        let d = t.wrapping_sub(start);
        if d > span {
            break;
        }
        *t = map(d);
        done += 1;
    }
    done
}
