//! Where the guest TSC can be at a probe, given an earlier verified reading: the window that
//! makes a compact reply's low 32 bits unambiguous, and that a full reply must fall into.
//!
//! A reading is a host bracket and the guest TSC read inside it: the guest read `guest` at some
//! host time in `[send, recv]`. A later probe bracketed by `[send', recv']` read the guest TSC
//! `host_elapsed` host ticks later, with `send' - recv <= host_elapsed <= recv' - send`. The
//! guest TSC advanced `rate · host_elapsed` for a rate in [`RATE_MIN`, `RATE_MAX`], so
//!
//! ```text
//! guest + RATE_MIN·(send' - recv)  <=  guest'  <=  guest + RATE_MAX·(recv' - send)
//! ```
//!
//! (for non-negative elapsed times; the bounds are rounded outward). The rate bounds are an
//! assumption about the guest: 1/2 to 2 covers every TSC scaling a VM is given in practice
//! (KVM's `tsc-khz` on another host's frequency, software skews of the agent) with a wide
//! margin. A full reply outside its window proves the assumption (or the guest) wrong; the
//! session then rejects the reply and forgets the reference rather than trusting either side.
//!
//! A stall (a descheduled vCPU, a paused guest, a debugger) widens the window by about
//! `RATE_MAX - RATE_MIN` times its length: past about 2^32 / 1.5 ticks (1 s at 3 GHz) the low
//! 32 bits no longer name one value, and the probe is lost instead of guessed.

use vmtsync_core::proto::try_unwrap_tsc_low32_in;
use vmtsync_core::{GuestTicks, HostTicks};

use crate::sync::{RATE_MAX, RATE_MIN};

/// A verified guest TSC reading and the host bracket it was read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reference {
    /// Host stamp not later than the guest's read.
    pub send: HostTicks,
    /// Host stamp not earlier than the guest's read.
    pub recv: HostTicks,
    /// The full guest TSC read.
    pub guest: GuestTicks,
}

/// An inclusive range of guest TSC values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Smallest possible value.
    pub lo: GuestTicks,
    /// Largest possible value.
    pub hi: GuestTicks,
}

impl Window {
    /// Whether `g` lies in the window.
    #[must_use]
    pub fn contains(self, g: GuestTicks) -> bool {
        self.lo <= g && g <= self.hi
    }

    /// The unique value in the window with these low 32 bits, if exactly one exists.
    #[must_use]
    pub fn unwrap_low32(self, low32: u32) -> Option<GuestTicks> {
        try_unwrap_tsc_low32_in(self.lo, self.hi, low32)
    }

    /// Whether the window holds at most 2^32 values, so any low 32 bits name at most one.
    #[must_use]
    pub const fn is_unambiguous(self) -> bool {
        self.hi.0.saturating_sub(self.lo.0) <= u32::MAX as u64
    }
}

/// `ticks · num / den` rounded down (`ceil` false) or up, in `i128` (exact for `u64` inputs).
fn scale(ticks: u64, (num, den): (u64, u64), ceil: bool) -> i128 {
    let p = i128::from(ticks) * i128::from(num);
    let d = i128::from(den.max(1));
    if ceil { (p + d - 1) / d } else { p / d }
}

impl Reference {
    /// The guest TSC values possible at a later read bracketed by `[send, recv]` (see the
    /// module docs), clamped to `u64`; `None` if the clamped window is empty.
    #[must_use]
    pub fn window(&self, send: HostTicks, recv: HostTicks) -> Option<Window> {
        // Least guest advance: at least `send - self.recv` host ticks passed, at the slowest
        // rate (if the brackets overlap, the later read may come first: at the fastest rate
        // backwards).
        let lo_elapsed = match send.0.checked_sub(self.recv.0) {
            Some(h) => scale(h, RATE_MIN, false),
            None => -scale(self.recv.0 - send.0, RATE_MAX, true),
        };
        // Most guest advance: at most `recv - self.send` host ticks, at the fastest rate.
        let hi_elapsed = match recv.0.checked_sub(self.send.0) {
            Some(h) => scale(h, RATE_MAX, true),
            None => -scale(self.send.0 - recv.0, RATE_MIN, false),
        };
        let clamp =
            |v: i128| GuestTicks(u64::try_from(v.clamp(0, i128::from(u64::MAX))).unwrap_or(0));
        let g = i128::from(self.guest.0);
        let (lo, hi) = (clamp(g + lo_elapsed), clamp(g + hi_elapsed));
        (lo <= hi).then_some(Window { lo, hi })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn window_scales_elapsed_host_time_by_the_rate_bounds() {
        let r = Reference {
            send: HostTicks(1_000),
            recv: HostTicks(1_100),
            guest: GuestTicks(50_000),
        };
        let w = r.window(HostTicks(2_100), HostTicks(2_300)).unwrap();
        // At least 1000 host ticks at rate 1/2, at most 1300 at rate 2.
        assert_eq!(
            w,
            Window {
                lo: GuestTicks(50_500),
                hi: GuestTicks(52_600)
            }
        );
        assert!(w.is_unambiguous());
        // A 1.2 s stall at 3 GHz: 3.6e9 ticks at rates 1/2..2 span more than 2^32.
        let w = r
            .window(HostTicks(2_100), HostTicks(3_600_002_100))
            .unwrap();
        assert!(!w.is_unambiguous());
    }

    proptest! {
        /// For any true rate in the bounds and any read times inside both brackets, the
        /// window contains the later reading.
        #[test]
        fn window_contains_every_reading_the_rate_bounds_allow(
            t0 in 0u64..(1 << 50), a in 0u64..1_000_000, gap in 0u64..(1 << 34),
            b in 0u64..1_000_000, c in 0u64..1_000_000, d in 0u64..1_000_000,
            num in 1u64..=4, den in 1u64..=2, g0 in 0u64..(1 << 60),
        ) {
            // rate num/den within [1/2, 2].
            prop_assume!(num <= 2 * den && 2 * num >= den);
            let (send0, read0, recv0) = (t0, t0 + a, t0 + a + b);
            let (send1, read1) = (recv0 + gap, recv0 + gap + c);
            let recv1 = read1 + d;
            let g1 = g0 + (read1 - read0) * num / den;
            let r = Reference { send: HostTicks(send0), recv: HostTicks(recv0), guest: GuestTicks(g0) };
            let w = r.window(HostTicks(send1), HostTicks(recv1)).unwrap();
            prop_assert!(w.contains(GuestTicks(g1)), "{w:?} {g1}");
            if w.is_unambiguous() {
                #[allow(clippy::cast_possible_truncation)]
                let low = g1 as u32;
                prop_assert_eq!(w.unwrap_low32(low), Some(GuestTicks(g1)));
            }
        }
    }
}
