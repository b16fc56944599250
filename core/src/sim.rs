//! Seeded, deterministic simulation of a host/guest clock pair and the probe link between them
//! (feature `sim`; also compiled for the crate's own tests).
//!
//! Everything is integer math with a 10-line PRNG (SplitMix64), so a seed reproduces a run
//! bit for bit on any machine, and the ground truth (offset, rate) is known exactly. The host
//! TSC is the simulation's true time; the guest TSC is `floor(offset + host · num / den)`,
//! which covers KVM scaling (`num / den = ratio / 2^frac`) and oscillator drift
//! (`num / den = (1e9 + ppb) / 1e9`) alike and rounds down like KVM's `>> frac`.

use crate::estimate::ProbeSample;
use crate::{GuestTicks, HostTicks};

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, passes BigCrush, trivially seedable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole future is determined by `seed`.
    #[must_use]
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (Lemire's multiply-high; bias below 2^-64·n), 0 if `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        let wide = (u128::from(self.next_u64()) * u128::from(n)) >> 64;
        // wide < n <= u64::MAX.
        #[allow(clippy::cast_possible_truncation)]
        let v = wide as u64;
        v
    }

    /// `true` with probability `ppm / 1_000_000`.
    pub fn chance_ppm(&mut self, ppm: u32) -> bool {
        self.below(1_000_000) < u64::from(ppm)
    }
}

/// The median of `v` (the upper middle element for an even length), reordering `v` in place
/// without allocating; `None` if `v` is empty. The one median helper of tests and benches.
pub fn median(v: &mut [u64]) -> Option<u64> {
    let mid = v.len() / 2;
    if v.is_empty() {
        return None;
    }
    Some(*v.select_nth_unstable(mid).1)
}

/// A one-way delay distribution in host ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delay {
    /// Always the same delay.
    Constant(u64),
    /// Uniform over `min..=max` (`min` if `max < min`).
    Uniform {
        /// Smallest delay.
        min: u64,
        /// Largest delay, inclusive.
        max: u64,
    },
    /// `min` plus an approximately exponential excess with the given mean: a geometric
    /// integer part (leading zeros of a random word, at most 64) plus a uniform fraction.
    /// Its tail is long, like queueing and scheduling delays: the excess is capped at
    /// `mean · 2/3 · (64 + 65535/65536)`, about 43× the mean.
    Exponential {
        /// The floor every delay includes (propagation, fixed processing).
        min: u64,
        /// Mean of the excess over `min`.
        mean: u64,
    },
}

impl Delay {
    /// Draws one delay.
    pub fn sample(&self, rng: &mut SplitMix64) -> u64 {
        match *self {
            Self::Constant(d) => d,
            Self::Uniform { min, max } => {
                let span = max.saturating_sub(min);
                match span.checked_add(1) {
                    Some(n) => min + rng.below(n),
                    None => rng.next_u64(),
                }
            }
            Self::Exponential { min, mean } => {
                // lz is geometric with mean ~1, the fraction uniform with mean 1/2: scale the
                // sum (mean 3/2) by 2/3 to get the requested mean.
                let lz = u128::from(rng.next_u64().leading_zeros());
                let frac = u128::from(rng.next_u64() >> 48);
                let units = (lz << 16) + frac;
                let excess = u128::from(mean) * 2 * units / (3 << 16);
                min.saturating_add(u64::try_from(excess).unwrap_or(u64::MAX))
            }
        }
    }
}

/// The probe link: delays each way, rare large outliers, and the gap between probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// From the host's send reading to the guest's TSC reading.
    pub forward: Delay,
    /// From the guest's TSC reading to the host's receive reading.
    pub backward: Delay,
    /// Per direction, the chance in parts per million that `outlier` is added (preemption,
    /// a vCPU descheduled, an interrupt storm).
    pub outlier_ppm: u32,
    /// The extra delay of an outlier.
    pub outlier: Delay,
    /// Host time between one probe's receive and the next probe's send.
    pub gap: Delay,
}

impl Link {
    /// The exit-stamped shape: a long forward leg (1.5–2.5 k ticks), the reply leaving right
    /// after the read (0–60 ticks), 50–250 k ticks between probes, no outliers. Tight and
    /// asymmetric: the case where assuming rate 1 under drift breaks a bound.
    #[must_use]
    pub const fn tight_asymmetric() -> Self {
        Self {
            forward: Delay::Uniform {
                min: 1_500,
                max: 2_500,
            },
            backward: Delay::Uniform { min: 0, max: 60 },
            outlier_ppm: 0,
            outlier: Delay::Constant(0),
            gap: Delay::Uniform {
                min: 50_000,
                max: 250_000,
            },
        }
    }

    /// Symmetric constant delays, no outliers: the easiest case.
    #[must_use]
    pub const fn constant(each_way: u64, gap: u64) -> Self {
        Self {
            forward: Delay::Constant(each_way),
            backward: Delay::Constant(each_way),
            outlier_ppm: 0,
            outlier: Delay::Constant(0),
            gap: Delay::Constant(gap),
        }
    }
}

/// The true guest clock: `guest = floor(offset + host · rate_num / rate_den)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestClock {
    /// Guest reading at host 0 (`guest - host` when the rate is 1).
    pub offset: i64,
    /// Rate numerator (guest ticks).
    pub rate_num: u64,
    /// Rate denominator (host ticks), non-zero.
    pub rate_den: u64,
}

impl GuestClock {
    /// Same rate as the host: the offset is constant.
    #[must_use]
    pub const fn constant(offset: i64) -> Self {
        Self {
            offset,
            rate_num: 1,
            rate_den: 1,
        }
    }

    /// A guest oscillator `ppb` parts per billion fast (negative: slow); `None` if the rate
    /// would not be positive.
    #[must_use]
    pub fn with_drift_ppb(offset: i64, ppb: i64) -> Option<Self> {
        let num = u64::try_from(ppb.checked_add(1_000_000_000)?).ok()?;
        (num > 0).then_some(Self {
            offset,
            rate_num: num,
            rate_den: 1_000_000_000,
        })
    }

    /// KVM TSC scaling `ratio / 2^frac_bits`; `None` for `frac_bits > 63` or a zero ratio.
    #[must_use]
    pub fn with_kvm_scaling(offset: i64, ratio: u64, frac_bits: u32) -> Option<Self> {
        let den = 1_u64.checked_shl(frac_bits)?;
        (ratio > 0).then_some(Self {
            offset,
            rate_num: ratio,
            rate_den: den,
        })
    }

    /// The guest TSC at host time `host`, or `None` outside `u64` or for a zero denominator.
    #[must_use]
    pub fn guest_at(&self, host: HostTicks) -> Option<GuestTicks> {
        let scaled = u128::from(host.0).checked_mul(u128::from(self.rate_num))?;
        let scaled = i128::try_from(scaled.checked_div(u128::from(self.rate_den))?).ok()?;
        let g = scaled.checked_add(i128::from(self.offset))?;
        u64::try_from(g).ok().map(GuestTicks)
    }

    /// Whether the real-valued true offset `guest - host` at `host` lies in `[min, max]`;
    /// `None` if the exact check overflows `i128`.
    #[must_use]
    pub fn offset_within(&self, host: HostTicks, min: i64, max: i64) -> Option<bool> {
        // truth = offset + host·(num - den)/den; compare truth·den against bound·den.
        let den = i128::from(self.rate_den);
        let excess = i128::from(self.rate_num) - den;
        let truth = i128::from(self.offset)
            .checked_mul(den)?
            .checked_add(i128::from(host.0).checked_mul(excess)?)?;
        let lo = i128::from(min).checked_mul(den)?;
        let hi = i128::from(max).checked_mul(den)?;
        Some(lo <= truth && truth <= hi)
    }

    /// Whether the true drift `(num/den - 1)·1e9` ppb lies in `[min, max]`; `None` on overflow.
    #[must_use]
    pub fn drift_ppb_within(&self, min: i64, max: i64) -> Option<bool> {
        let den = i128::from(self.rate_den);
        let truth = (i128::from(self.rate_num) - den).checked_mul(1_000_000_000)?;
        Some(
            i128::from(min).checked_mul(den)? <= truth
                && truth <= i128::from(max).checked_mul(den)?,
        )
    }
}

/// A simulated host probing one guest vCPU over a [`Link`].
#[derive(Clone, Debug)]
pub struct Sim {
    rng: SplitMix64,
    /// The true guest clock; change it between probes to simulate a step or a rate change.
    pub clock: GuestClock,
    /// The link model; may also be changed between probes.
    pub link: Link,
    now: u64,
    vcpu: u32,
}

impl Sim {
    /// A simulation starting at host time `start`, fully determined by `seed`.
    #[must_use]
    pub const fn new(
        seed: u64,
        start: HostTicks,
        clock: GuestClock,
        link: Link,
        vcpu: u32,
    ) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            clock,
            link,
            now: start.0,
            vcpu,
        }
    }

    /// The current host time (the last probe's receive time, or the start).
    #[must_use]
    pub const fn now(&self) -> HostTicks {
        HostTicks(self.now)
    }

    /// Mutable access to the generator, for drawing test parameters from the same seed.
    pub fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }

    fn one_way(&mut self, base: Delay) -> u64 {
        let d = base.sample(&mut self.rng);
        if self.rng.chance_ppm(self.link.outlier_ppm) {
            d.saturating_add(self.link.outlier.sample(&mut self.rng))
        } else {
            d
        }
    }

    /// Runs one probe: gap, send, forward delay, guest reading, backward delay, receive.
    /// `None` if host or guest time would leave `u64`.
    pub fn probe(&mut self) -> Option<ProbeSample> {
        let gap = self.link.gap.sample(&mut self.rng);
        let send = self.now.checked_add(gap)?;
        let fwd = self.one_way(self.link.forward);
        let read_at = send.checked_add(fwd)?;
        let back = self.one_way(self.link.backward);
        let recv = read_at.checked_add(back)?;
        let guest = self.clock.guest_at(HostTicks(read_at))?;
        self.now = recv;
        Some(ProbeSample {
            host_send: HostTicks(send),
            guest,
            host_recv: HostTicks(recv),
            vcpu: self.vcpu,
        })
    }

    /// Fills `out` with consecutive probes; `None` (with `out` partly filled) if time runs out.
    pub fn fill(&mut self, out: &mut [ProbeSample]) -> Option<()> {
        for slot in out {
            *slot = self.probe()?;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_deterministic_and_known() {
        // Reference values of SplitMix64 seeded with 0 (Vigna's splitmix64.c).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_eq!(a.below(0), 0);
        assert!((0..1000).all(|_| a.below(7) < 7));
    }

    #[test]
    fn delays_stay_in_range_and_have_the_mean() {
        let mut r = SplitMix64::new(7);
        let u = Delay::Uniform { min: 10, max: 20 };
        assert!(
            (0..1000)
                .map(|_| u.sample(&mut r))
                .all(|d| (10..=20).contains(&d))
        );
        assert_eq!(Delay::Uniform { min: 5, max: 1 }.sample(&mut r), 5);
        let e = Delay::Exponential {
            min: 100,
            mean: 1_000,
        };
        let n = 20_000_u64;
        let sum: u64 = (0..n).map(|_| e.sample(&mut r)).sum();
        let mean = sum / n;
        assert!((1_050..=1_150).contains(&mean), "mean {mean}");
        assert!((0..1000).all(|_| e.sample(&mut r) >= 100));
    }

    #[test]
    fn guest_clock_math() {
        let c = GuestClock::constant(-5);
        assert_eq!(c.guest_at(HostTicks(10)), Some(GuestTicks(5)));
        assert_eq!(c.guest_at(HostTicks(4)), None);
        let d = GuestClock::with_drift_ppb(0, 50_000).unwrap();
        assert_eq!(
            d.guest_at(HostTicks(1_000_000_000)),
            Some(GuestTicks(1_000_050_000))
        );
        assert_eq!(d.guest_at(HostTicks(19_999)), Some(GuestTicks(19_999)));
        assert_eq!(d.guest_at(HostTicks(20_000)), Some(GuestTicks(20_001)));
        assert_eq!(d.offset_within(HostTicks(1_000_000), 50, 50), Some(true));
        assert_eq!(d.offset_within(HostTicks(1_000_001), 50, 50), Some(false));
        assert_eq!(d.drift_ppb_within(50_000, 50_000), Some(true));
        assert_eq!(d.drift_ppb_within(49_000, 49_999), Some(false));
        assert_eq!(GuestClock::with_drift_ppb(0, -1_000_000_000), None);
        let k = GuestClock::with_kvm_scaling(0, 3 << 47, 48).unwrap();
        assert_eq!(k.guest_at(HostTicks(1_000)), Some(GuestTicks(1_500)));
        assert_eq!(GuestClock::with_kvm_scaling(0, 1, 64), None);
    }

    #[test]
    fn probes_bracket_the_reading() {
        let link = Link {
            forward: Delay::Exponential {
                min: 300,
                mean: 200,
            },
            backward: Delay::Uniform { min: 100, max: 900 },
            outlier_ppm: 100_000,
            outlier: Delay::Uniform {
                min: 10_000,
                max: 100_000,
            },
            gap: Delay::Constant(1_000),
        };
        let mut sim = Sim::new(3, HostTicks(1 << 40), GuestClock::constant(12_345), link, 2);
        let mut buf = [ProbeSample::default(); 200];
        assert_eq!(sim.fill(&mut buf), Some(()));
        let mut prev = 0;
        for s in &buf {
            assert!(s.host_send.0 >= prev + 1_000);
            assert!(s.host_send.0 + 300 <= s.host_recv.0 - 100);
            let off = i128::from(s.guest.0);
            assert!(off - i128::from(s.host_recv.0) <= 12_345);
            assert!(off - i128::from(s.host_send.0) >= 12_345);
            assert_eq!(s.vcpu, 2);
            prev = s.host_recv.0;
        }
        assert_eq!(sim.now(), HostTicks(prev));
        let mut again = Sim::new(3, HostTicks(1 << 40), GuestClock::constant(12_345), link, 2);
        assert_eq!(again.probe(), Some(buf[0]));
        let mut end = Sim::new(
            3,
            HostTicks(u64::MAX - 10),
            GuestClock::constant(0),
            link,
            0,
        );
        assert_eq!(end.probe(), None);
    }
}
