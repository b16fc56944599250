//! The KVM pvclock ABI (kvmclock): the per-vCPU time page, its seqlock read, and its
//! fixed-point TSC→ns scale.
//!
//! The hypervisor publishes, per vCPU, a 32-byte [`PvclockVcpuTimeInfo`]: at guest TSC
//! `tsc_timestamp` the clock read `system_time` ns, and it advances `mul / 2^32` ns per
//! `2^-tsc_shift` ticks. It rewrites the page at arbitrary moments under a version seqlock
//! (odd = write in progress). [`try_read`] and [`try_read_with_tsc`] implement the guest side
//! of that seqlock over any [`PvclockSource`]; the real source is
//! [`crate::arch::PvclockPage`], tests use plain structs or atomics.
//!
//! The arithmetic is bit-identical to Linux (`pvclock_scale_delta` in
//! arch/x86/include/asm/pvclock.h, `pvclock_tsc_khz` in arch/x86/kernel/pvclock.c) wherever
//! Linux's result is meaningful; where Linux silently wraps (TSC before `tsc_timestamp`, a
//! left shift that loses bits, a sum past `u64::MAX`) the `try_` functions here return `None`.

use core::hint::spin_loop;
use core::sync::atomic::{Ordering, fence};

pub use crate::arch::kvm_abi::{
    PVCLOCK_GUEST_STOPPED, PVCLOCK_TSC_STABLE_BIT, PvclockVcpuTimeInfo,
};
use crate::arch::{PvclockPage, Tsc};
use crate::units::{GuestTicks, Nanos};

/// Default bound on seqlock attempts in [`try_read`] / [`try_read_with_tsc`].
///
/// KVM rewrites a vCPU's page while that vCPU is outside guest mode, so a reader on its own
/// vCPU retries only when a VM exit with a clock update lands inside its few-instruction read
/// window; a reader of another vCPU's page may see an odd version for the length of one
/// update. A thousand failures in a row therefore mean the page is not being written the way
/// the ABI says (a stuck odd version: a wrong pointer, or a writer that died mid-update), and
/// the reader reports [`PvclockError::Contended`] instead of spinning forever.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 1000;

impl PvclockVcpuTimeInfo {
    /// A page holding `fields` at `version` (for fakes and simulations; the hypervisor
    /// writes the real one).
    #[must_use]
    pub const fn new(version: u32, fields: PvclockFields) -> Self {
        Self {
            version,
            pad0: 0,
            tsc_timestamp: fields.tsc_timestamp.0,
            system_time: fields.system_time.0,
            tsc_to_system_mul: fields.scale.mul,
            tsc_shift: fields.scale.shift,
            flags: fields.flags.0,
            pad: [0; 2],
        }
    }

    /// The payload fields, typed.
    #[must_use]
    pub const fn fields(&self) -> PvclockFields {
        PvclockFields {
            tsc_timestamp: GuestTicks(self.tsc_timestamp),
            system_time: Nanos(self.system_time),
            scale: PvclockScale {
                mul: self.tsc_to_system_mul,
                shift: self.tsc_shift,
            },
            flags: PvclockFlags(self.flags),
        }
    }
}

/// The pvclock TSC→ns scale: `ns = ((delta shifted by shift) * mul) >> 32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockScale {
    /// `tsc_to_system_mul`: a 0.32 fixed-point multiplier.
    pub mul: u32,
    /// `tsc_shift`: shift left by this much if positive, right by `-shift` if negative.
    pub shift: i8,
}

impl PvclockScale {
    /// Converts a TSC delta to ns exactly like Linux's `pvclock_scale_delta`: shift (right
    /// shifts drop bits, rounding down), then the 96-bit product `>> 32` (rounding down).
    ///
    /// `None` when a left shift would push set bits out of 64 bits, where Linux wraps. The
    /// product itself always fits: `(2^64 - 1) * (2^32 - 1) >> 32 < 2^64`.
    #[must_use]
    pub fn try_scale_floor(self, delta: u64) -> Option<u64> {
        let amount = u32::from(self.shift.unsigned_abs());
        let shifted = if self.shift >= 0 {
            // `checked_shl` only rejects amounts >= 64; lost bits are checked by shifting back.
            match delta.checked_shl(amount) {
                Some(s) if s >> amount == delta => s,
                _ if delta == 0 => 0,
                _ => return None,
            }
        } else {
            // Shifting right by 64 or more leaves nothing (C would call it undefined).
            delta.checked_shr(amount).unwrap_or(0)
        };
        u64::try_from((u128::from(shifted) * u128::from(self.mul)) >> 32).ok()
    }

    /// The TSC frequency in kHz this scale implies, exactly like Linux's `pvclock_tsc_khz`:
    /// `(10^6 << 32) / mul` rounded down, then shifted opposite to `shift` (a right shift
    /// rounds down again).
    ///
    /// `None` when `mul` is 0 (an unpublished page) or the left shift overflows 64 bits.
    #[must_use]
    pub fn try_tsc_khz_floor(self) -> Option<u64> {
        if self.mul == 0 {
            return None;
        }
        let khz = (1_000_000_u64 << 32) / u64::from(self.mul);
        let amount = u32::from(self.shift.unsigned_abs());
        if self.shift < 0 {
            match khz.checked_shl(amount) {
                Some(s) if s >> amount == khz => Some(s),
                _ => None,
            }
        } else {
            Some(khz.checked_shr(amount).unwrap_or(0))
        }
    }

    /// The scale KVM publishes for a TSC of `tsc_hz` ticks per second, computed like KVM's
    /// `kvm_get_time_scale(NSEC_PER_SEC, tsc_hz, ...)` (arch/x86/kvm/x86.c): normalise the
    /// two rates until `tsc_hz / 2 < 10^9 * 2^-shift <= tsc_hz`-ish with both in 32 bits,
    /// then `mul = (scaled << 32) / base` rounded down.
    ///
    /// For fakes and simulations that need realistic pages. `None` when `tsc_hz` is 0.
    #[must_use]
    pub fn for_tsc_hz(tsc_hz: u64) -> Option<Self> {
        const NSEC_PER_SEC: u64 = 1_000_000_000;
        const HIGH: u64 = 0xffff_ffff_0000_0000;
        if tsc_hz == 0 {
            return None;
        }
        let mut shift: i32 = 0;
        let mut base = tsc_hz;
        let mut scaled = NSEC_PER_SEC;
        while base > scaled * 2 || base & HIGH != 0 {
            base >>= 1;
            shift -= 1;
        }
        // `base` now fits 32 bits and is non-zero (it only shrank while above 2 * 10^9).
        let mut base32 = u32::try_from(base).ok()?;
        while u64::from(base32) <= scaled || scaled & HIGH != 0 {
            if scaled & HIGH != 0 || base32 & 0x8000_0000 != 0 {
                scaled >>= 1;
            } else {
                base32 <<= 1;
            }
            shift += 1;
        }
        // Here `scaled < base32 < 2^32`, so the quotient is below 2^32.
        let mul = u32::try_from((scaled << 32) / u64::from(base32)).ok()?;
        Some(Self {
            mul,
            shift: i8::try_from(shift).ok()?,
        })
    }
}

/// The pvclock flags byte.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockFlags(pub u8);

impl PvclockFlags {
    /// Whether [`PVCLOCK_TSC_STABLE_BIT`] is set: readings are monotonic across vCPUs.
    #[must_use]
    pub const fn tsc_stable(self) -> bool {
        self.0 & PVCLOCK_TSC_STABLE_BIT != 0
    }

    /// Whether [`PVCLOCK_GUEST_STOPPED`] is set: the host paused the guest.
    #[must_use]
    pub const fn guest_stopped(self) -> bool {
        self.0 & PVCLOCK_GUEST_STOPPED != 0
    }
}

/// The payload of a pvclock page (everything but the version), typed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockFields {
    /// Guest TSC at which `system_time` holds.
    pub tsc_timestamp: GuestTicks,
    /// Guest clock at `tsc_timestamp`.
    pub system_time: Nanos,
    /// TSC→ns scale.
    pub scale: PvclockScale,
    /// Flag bits.
    pub flags: PvclockFlags,
}

impl PvclockFields {
    /// The guest clock at guest TSC `tsc`: `system_time + scale(tsc - tsc_timestamp)`, as
    /// Linux's `__pvclock_read_cycles` computes it (each step rounds down).
    ///
    /// `None` when `tsc < tsc_timestamp` (Linux would wrap to a huge delta), when the shift
    /// overflows, or when the sum passes `u64::MAX`.
    #[must_use]
    pub fn try_ns_at_floor(&self, tsc: GuestTicks) -> Option<Nanos> {
        let delta = tsc.0.checked_sub(self.tsc_timestamp.0)?;
        let offset = self.scale.try_scale_floor(delta)?;
        self.system_time.0.checked_add(offset).map(Nanos)
    }
}

/// Something that holds a pvclock page: the real page (volatile reads) or a test double.
///
/// Implementations read the current memory each call, with no caching and no consistency
/// between calls: consistency is [`try_read`]'s job, through the version.
pub trait PvclockSource {
    /// Reads the `version` word.
    fn version(&self) -> u32;
    /// Reads the payload fields; they may be torn if the page is being written.
    fn fields(&self) -> PvclockFields;
}

impl<S: PvclockSource + ?Sized> PvclockSource for &S {
    #[inline]
    fn version(&self) -> u32 {
        (**self).version()
    }
    #[inline]
    fn fields(&self) -> PvclockFields {
        (**self).fields()
    }
}

/// The real page: volatile reads of what the hypervisor writes (no consistency between calls;
/// [`try_read`] provides it).
impl PvclockSource for PvclockPage<'_> {
    #[inline]
    fn version(&self) -> u32 {
        self.read_version()
    }
    #[inline]
    fn fields(&self) -> PvclockFields {
        self.read_payload().fields()
    }
}

/// A plain in-memory page never changes while borrowed, so it is its own consistent source.
impl PvclockSource for PvclockVcpuTimeInfo {
    fn version(&self) -> u32 {
        self.version
    }
    fn fields(&self) -> PvclockFields {
        PvclockVcpuTimeInfo::fields(self)
    }
}

/// Why a seqlock read produced no value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum PvclockError {
    /// Every allowed attempt saw an odd or changing version (see [`DEFAULT_MAX_ATTEMPTS`]).
    Contended,
    /// The version read 0 twice: the hypervisor never published the page (not registered).
    Unpublished,
}

/// A consistent snapshot of a pvclock page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockRead {
    /// The (even) version the fields belong to.
    pub version: u32,
    /// How many attempts the seqlock needed (1 = no retry); worth reporting as a health signal.
    pub attempts: u32,
    /// The fields, all from that version.
    pub fields: PvclockFields,
}

/// A consistent pvclock snapshot together with a TSC read inside the same seqlock section,
/// so the page cannot have been updated between the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PvclockSample {
    /// The snapshot.
    pub read: PvclockRead,
    /// The guest TSC, read (ordered) between the two version checks.
    pub tsc: GuestTicks,
}

impl PvclockSample {
    /// The guest clock at the sampled TSC, like Linux's `pvclock_clocksource_read` without
    /// its cross-vCPU monotonicity clamp; see [`PvclockFields::try_ns_at_floor`].
    #[must_use]
    pub fn try_ns_floor(&self) -> Option<Nanos> {
        self.read.fields.try_ns_at_floor(self.tsc)
    }
}

/// Reads a consistent snapshot of `src` with the version seqlock, trying at most
/// `max_attempts` times (usually [`DEFAULT_MAX_ATTEMPTS`]; 0 fails at once).
///
/// Per attempt: `v = version`; if odd, a write is in progress: retry. Acquire fence, read
/// the fields, acquire fence, and accept them only if `version` still equals `v`. The fences
/// order the field loads between the two version loads (on x86 they only stop the compiler,
/// like Linux's `virt_rmb()`; under the Rust memory model they pair with a writer's release
/// fence after its odd-version store and its release store of the even version).
///
/// # Errors
///
/// [`PvclockError::Contended`] after `max_attempts` failed attempts;
/// [`PvclockError::Unpublished`] for a stable version 0.
pub fn try_read<S: PvclockSource + ?Sized>(
    src: &S,
    max_attempts: u32,
) -> Result<PvclockRead, PvclockError> {
    read_section(src, max_attempts, || ()).map(|(read, ())| read)
}

/// Like [`try_read`], and also reads `tsc` inside the seqlock section, so the returned TSC and
/// fields belong together: [`PvclockSample::try_ns_floor`] then gives the guest clock "now".
///
/// # Errors
///
/// As [`try_read`].
pub fn try_read_with_tsc<S: PvclockSource + ?Sized, T: Tsc + ?Sized>(
    src: &S,
    tsc: &T,
    max_attempts: u32,
) -> Result<PvclockSample, PvclockError> {
    read_section(src, max_attempts, || GuestTicks(tsc.read_ordered()))
        .map(|(read, tsc)| PvclockSample { read, tsc })
}

/// The seqlock loop; `inside` runs between the two version checks of each attempt.
fn read_section<S: PvclockSource + ?Sized, R>(
    src: &S,
    max_attempts: u32,
    mut inside: impl FnMut() -> R,
) -> Result<(PvclockRead, R), PvclockError> {
    let mut attempts = 0;
    while attempts < max_attempts {
        attempts += 1;
        let version = src.version();
        if version & 1 == 1 {
            trace!(
                "pvclock: version {=u32} odd, attempt {=u32}",
                version, attempts
            );
            spin_loop();
            continue;
        }
        fence(Ordering::Acquire);
        let fields = src.fields();
        let extra = inside();
        fence(Ordering::Acquire);
        let again = src.version();
        if again != version {
            trace!(
                "pvclock: version {=u32} -> {=u32}, attempt {=u32}",
                version, again, attempts
            );
            spin_loop();
            continue;
        }
        if version == 0 {
            warn!("pvclock: page not published (version 0)");
            return Err(PvclockError::Unpublished);
        }
        return Ok((
            PvclockRead {
                version,
                attempts,
                fields,
            },
            extra,
        ));
    }
    warn!(
        "pvclock: no consistent read in {=u32} attempts",
        max_attempts
    );
    Err(PvclockError::Contended)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::FakeTsc;
    use core::cell::Cell;
    use core::sync::atomic::{AtomicBool, AtomicI8, AtomicU8, AtomicU32, AtomicU64};
    use proptest::prelude::*;

    /// A page with realistic content: a 2.5 GHz TSC as KVM would publish it.
    fn page(version: u32) -> PvclockVcpuTimeInfo {
        let scale = PvclockScale::for_tsc_hz(2_500_000_000).expect("non-zero rate");
        PvclockVcpuTimeInfo::new(
            version,
            PvclockFields {
                tsc_timestamp: GuestTicks(1_000_000),
                system_time: Nanos(5_000_000_000),
                scale,
                flags: PvclockFlags(PVCLOCK_TSC_STABLE_BIT),
            },
        )
    }

    #[test]
    fn struct_round_trips_and_flags() {
        let p = page(2);
        assert_eq!(PvclockVcpuTimeInfo::new(2, p.fields()), p);
        assert!(p.fields().flags.tsc_stable());
        assert!(!p.fields().flags.guest_stopped());
        assert!(PvclockFlags(PVCLOCK_GUEST_STOPPED).guest_stopped());
        assert!(!PvclockFlags(PVCLOCK_GUEST_STOPPED).tsc_stable());
    }

    /// Known values: KVM's scale for 2.5 GHz is shift -1, mul 0xCCCC_CCCC (0.8 * 2^32 at
    /// 2^31 ticks): 2.5e9 ticks are 10^9 ns up to the rounding of mul.
    #[test]
    fn kvm_scale_for_2_5_ghz() {
        let s = PvclockScale::for_tsc_hz(2_500_000_000).expect("non-zero rate");
        assert_eq!(
            s,
            PvclockScale {
                mul: 0xCCCC_CCCC,
                shift: -1
            }
        );
        assert_eq!(s.try_tsc_khz_floor(), Some(2_500_000));
        assert_eq!(s.try_scale_floor(2_500_000_000), Some(999_999_999));
        assert_eq!(PvclockScale::for_tsc_hz(0), None);
    }

    #[test]
    fn ns_at_tsc() {
        let f = page(2).fields();
        assert_eq!(
            f.try_ns_at_floor(GuestTicks(1_000_000)),
            Some(Nanos(5_000_000_000))
        );
        // 2500 ticks at 2.5 GHz: 1 µs, minus the rounding of mul.
        assert_eq!(
            f.try_ns_at_floor(GuestTicks(1_002_500)),
            Some(Nanos(5_000_000_999))
        );
        // Before tsc_timestamp: Linux would wrap, we refuse.
        assert_eq!(f.try_ns_at_floor(GuestTicks(999_999)), None);
    }

    #[test]
    fn scale_edges() {
        let one = PvclockScale {
            mul: u32::MAX,
            shift: 0,
        };
        assert_eq!(one.try_scale_floor(u64::MAX), Some(u64::MAX - (1 << 32)));
        let left = PvclockScale {
            mul: 1 << 31,
            shift: 1,
        };
        assert_eq!(left.try_scale_floor(1 << 62), Some(1 << 62));
        assert_eq!(left.try_scale_floor(1 << 63), None);
        let huge = PvclockScale { mul: 1, shift: 100 };
        assert_eq!(huge.try_scale_floor(0), Some(0));
        assert_eq!(huge.try_scale_floor(1), None);
        let tiny = PvclockScale {
            mul: u32::MAX,
            shift: -100,
        };
        assert_eq!(tiny.try_scale_floor(u64::MAX), Some(0));
        assert_eq!(PvclockScale { mul: 0, shift: 0 }.try_tsc_khz_floor(), None);
        assert_eq!(
            PvclockScale {
                mul: 1,
                shift: -100
            }
            .try_tsc_khz_floor(),
            None
        );
        assert_eq!(
            PvclockScale { mul: 1, shift: 100 }.try_tsc_khz_floor(),
            Some(0)
        );
    }

    /// Naive u128 reference for `pvclock_scale_delta`; `None` when the shift loses bits.
    fn ref_scale(delta: u64, mul: u32, shift: i8) -> Option<u64> {
        let d = u128::from(delta);
        let shifted = if shift >= 0 {
            let s = d << u32::from(shift.unsigned_abs()).min(100);
            if s > u128::from(u64::MAX) {
                return None;
            }
            s
        } else {
            d >> u32::from(shift.unsigned_abs()).min(127)
        };
        u64::try_from((shifted * u128::from(mul)) >> 32).ok()
    }

    proptest! {
        #[test]
        fn scale_matches_u128_reference(delta: u64, mul: u32, shift in -70i8..70) {
            let s = PvclockScale { mul, shift };
            prop_assert_eq!(s.try_scale_floor(delta), ref_scale(delta, mul, shift));
        }

        #[test]
        fn ns_matches_u128_reference(ts: u64, dt: u64, st: u64, mul: u32, shift in -40i8..40) {
            let f = PvclockFields {
                tsc_timestamp: GuestTicks(ts),
                system_time: Nanos(st),
                scale: PvclockScale { mul, shift },
                flags: PvclockFlags(0),
            };
            let tsc = u128::from(ts) + u128::from(dt);
            let expect = u64::try_from(tsc).ok().and_then(|t| {
                let off = ref_scale(t - ts, mul, shift)?;
                u64::try_from(u128::from(st) + u128::from(off)).ok()
            });
            let got = u64::try_from(tsc).ok().and_then(|t| f.try_ns_at_floor(GuestTicks(t)));
            prop_assert_eq!(got.map(|n| n.0), expect);
        }

        #[test]
        fn tsc_khz_matches_u128_reference(mul: u32, shift in -70i8..70) {
            let expect = if mul == 0 {
                None
            } else {
                let khz = (1_000_000_u128 << 32) / u128::from(mul);
                let amount = u32::from(shift.unsigned_abs());
                let v = if shift < 0 { khz << amount.min(100) } else { khz >> amount.min(127) };
                u64::try_from(v).ok()
            };
            prop_assert_eq!(PvclockScale { mul, shift }.try_tsc_khz_floor(), expect);
        }

        /// KVM's scale for a rate, read back by Linux's formula, gives the rate to within
        /// `2^-shift` kHz (the floor division happens before the left shift), and one second
        /// of ticks converts to one second of ns within 2 ns.
        #[test]
        fn kvm_scale_round_trips(hz in 1_000_000u64..20_000_000_000) {
            let s = PvclockScale::for_tsc_hz(hz).expect("non-zero rate");
            let khz = s.try_tsc_khz_floor().expect("valid scale");
            let slack = 1u64 << s.shift.min(0).unsigned_abs();
            prop_assert!(khz.abs_diff(hz / 1000) <= slack, "hz {} -> {:?} -> {} kHz", hz, s, khz);
            let ns = s.try_scale_floor(hz).expect("no overflow");
            prop_assert!(ns.abs_diff(1_000_000_000) <= 2, "hz {} -> {:?} -> {} ns", hz, s, ns);
        }
    }

    /// A source that plays back a script of version reads and a sequence of field sets, to
    /// drive the seqlock through exact interleavings.
    struct Scripted<'a> {
        versions: &'a [u32],
        fields: &'a [PvclockFields],
        v_at: Cell<usize>,
        f_at: Cell<usize>,
    }

    impl<'a> Scripted<'a> {
        fn new(versions: &'a [u32], fields: &'a [PvclockFields]) -> Self {
            Self {
                versions,
                fields,
                v_at: Cell::new(0),
                f_at: Cell::new(0),
            }
        }
    }

    impl PvclockSource for Scripted<'_> {
        fn version(&self) -> u32 {
            let i = self.v_at.get();
            self.v_at.set(i + 1);
            // Past the end, the last entry repeats.
            self.versions[i.min(self.versions.len() - 1)]
        }
        fn fields(&self) -> PvclockFields {
            let i = self.f_at.get();
            self.f_at.set(i + 1);
            self.fields[i.min(self.fields.len() - 1)]
        }
    }

    fn fields_n(n: u64) -> PvclockFields {
        PvclockFields {
            tsc_timestamp: GuestTicks(n),
            system_time: Nanos(n * 10),
            ..Default::default()
        }
    }

    #[test]
    fn retries_on_odd_then_changed_version() {
        // Attempt 1: odd. Attempt 2: 4 then 6 (torn: fields_n(1) discarded). Attempt 3: 6, 6.
        let versions = [3, 4, 6, 6, 6];
        let fields = [fields_n(1), fields_n(2)];
        let src = Scripted::new(&versions, &fields);
        let tsc = FakeTsc::new(500, 1);
        let s = try_read_with_tsc(&src, &tsc, 10).expect("third attempt is consistent");
        assert_eq!(s.read.version, 6);
        assert_eq!(s.read.attempts, 3);
        assert_eq!(s.read.fields, fields_n(2));
        // The TSC was read once per attempt that reached the section: attempts 2 and 3.
        assert_eq!(s.tsc, GuestTicks(501));
        assert_eq!(tsc.peek(), 502);
    }

    #[test]
    fn bounded_retries_then_error() {
        let one = [fields_n(1)];
        let src = Scripted::new(&[7], &one);
        assert_eq!(try_read(&src, 25), Err(PvclockError::Contended));
        assert_eq!(src.v_at.get(), 25, "exactly max_attempts version reads");
        assert_eq!(src.f_at.get(), 0, "odd versions never read fields");
        assert_eq!(try_read(&page(2), 0), Err(PvclockError::Contended));
        // Always changing: even versions that never repeat.
        let changing: [u32; 8] = [2, 4, 6, 8, 10, 12, 14, 16];
        let src = Scripted::new(&changing, &one);
        assert_eq!(try_read(&src, 4), Err(PvclockError::Contended));
    }

    #[test]
    fn unpublished_page() {
        assert_eq!(
            try_read(&PvclockVcpuTimeInfo::default(), 10),
            Err(PvclockError::Unpublished)
        );
        let r = try_read(&page(2), DEFAULT_MAX_ATTEMPTS).expect("plain page is stable");
        assert_eq!((r.version, r.attempts), (2, 1));
        // End to end: 1 µs of a 2.5 GHz TSC after tsc_timestamp.
        let tsc = FakeTsc::new(1_002_500, 0);
        let s = try_read_with_tsc(&page(2), &tsc, DEFAULT_MAX_ATTEMPTS).expect("stable");
        assert_eq!(s.try_ns_floor(), Some(Nanos(5_000_000_999)));
    }

    /// The concurrent test's page: every field an atomic, written one by one like KVM does.
    #[derive(Default)]
    struct AtomicPage {
        version: AtomicU32,
        tsc_timestamp: AtomicU64,
        system_time: AtomicU64,
        mul: AtomicU32,
        shift: AtomicI8,
        flags: AtomicU8,
    }

    /// Fields derived from one counter, so a mix of two updates is detectable.
    fn derived(n: u32) -> PvclockFields {
        PvclockFields {
            tsc_timestamp: GuestTicks(u64::from(n) * 1000),
            system_time: Nanos((u64::from(n) << 20) | 7),
            scale: PvclockScale {
                mul: n.rotate_left(13) ^ 0xdead_beef,
                shift: i8::try_from(n % 16).expect("< 16") - 8,
            },
            flags: PvclockFlags(u8::try_from(n % 4).expect("< 4")),
        }
    }

    impl AtomicPage {
        /// The writer side of the seqlock, as KVM does it: odd version, fields, even version.
        fn publish(&self, n: u32) {
            let v = self.version.load(Ordering::Relaxed);
            self.version.store(v.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            let f = derived(n);
            // Spins between the stores widen the window in which a reader could tear.
            self.tsc_timestamp
                .store(f.tsc_timestamp.0, Ordering::Relaxed);
            spin_loop();
            self.system_time.store(f.system_time.0, Ordering::Relaxed);
            spin_loop();
            self.mul.store(f.scale.mul, Ordering::Relaxed);
            self.shift.store(f.scale.shift, Ordering::Relaxed);
            spin_loop();
            self.flags.store(f.flags.0, Ordering::Relaxed);
            self.version.store(v.wrapping_add(2), Ordering::Release);
        }
    }

    impl PvclockSource for AtomicPage {
        fn version(&self) -> u32 {
            self.version.load(Ordering::Relaxed)
        }
        fn fields(&self) -> PvclockFields {
            PvclockFields {
                tsc_timestamp: GuestTicks(self.tsc_timestamp.load(Ordering::Relaxed)),
                system_time: Nanos(self.system_time.load(Ordering::Relaxed)),
                scale: PvclockScale {
                    mul: self.mul.load(Ordering::Relaxed),
                    shift: self.shift.load(Ordering::Relaxed),
                },
                flags: PvclockFlags(self.flags.load(Ordering::Relaxed)),
            }
        }
    }

    /// What one concurrent round observed.
    #[derive(Default)]
    struct Observed {
        /// Seqlock reads that succeeded (each checked to be exactly one update's fields).
        ok: u64,
        /// Successful seqlock reads that needed more than one attempt.
        retried: u64,
        /// Seqlock reads that gave up with `Contended`.
        contended: u64,
        /// Naive reads (no seqlock) that mixed two updates.
        naive_torn: u64,
    }

    /// A writer thread publishes updates 1..=`updates` while this thread reads: every
    /// successful read is exactly one update's fields, matching its version. A naive reader
    /// without the seqlock runs too, to show tearing was possible at all. `publish(n)` is the
    /// (n + 1)-th update, so its version is `2 * (n + 1)`.
    fn concurrent_round(updates: u32) -> Observed {
        let page = AtomicPage::default();
        page.publish(0);
        let done = AtomicBool::new(false);
        let mut seen = Observed::default();
        std::thread::scope(|s| {
            s.spawn(|| {
                for n in 1..=updates {
                    page.publish(n);
                    // A gap between updates, as a real hypervisor leaves; without it the
                    // version is odd most of the time and reads mostly exhaust their attempts.
                    for _ in 0..32 {
                        spin_loop();
                    }
                }
                done.store(true, Ordering::Release);
            });
            let tsc = FakeTsc::new(0, 1);
            while !done.load(Ordering::Acquire) {
                match try_read_with_tsc(&page, &tsc, DEFAULT_MAX_ATTEMPTS) {
                    Ok(s) => {
                        let n = s.read.version / 2 - 1;
                        assert_eq!(s.read.version % 2, 0);
                        assert_eq!(
                            s.read.fields,
                            derived(n),
                            "torn read at version {}",
                            s.read.version
                        );
                        seen.ok += 1;
                        seen.retried += u64::from(s.read.attempts > 1);
                    }
                    Err(e) => {
                        assert_eq!(e, PvclockError::Contended);
                        seen.contended += 1;
                    }
                }
                let raw = page.fields();
                let n = u32::try_from(raw.tsc_timestamp.0 / 1000).unwrap_or(0);
                seen.naive_torn += u64::from(raw != derived(n));
            }
        });
        let last = try_read(&page, DEFAULT_MAX_ATTEMPTS).expect("writer finished");
        assert_eq!(last.version, 2 * (updates + 1));
        assert_eq!(last.fields, derived(updates));
        seen
    }

    /// Rounds of [`concurrent_round`] until the test has shown what it claims: reads that
    /// succeeded, reads that met a writer (retried or gave up), and naive reads that tore, so
    /// the "never tears" result is not vacuous. A quiet machine may need more than one round for
    /// the two threads to overlap; the bound keeps a machine where they never do from looping.
    #[test]
    fn concurrent_writer_never_tears() {
        const UPDATES: u32 = 200_000;
        const MAX_ROUNDS: u32 = 40;
        let mut total = Observed::default();
        let mut rounds = 0;
        while rounds < MAX_ROUNDS
            && (total.ok == 0 || total.retried + total.contended == 0 || total.naive_torn == 0)
        {
            let seen = concurrent_round(UPDATES);
            total.ok += seen.ok;
            total.retried += seen.retried;
            total.contended += seen.contended;
            total.naive_torn += seen.naive_torn;
            rounds += 1;
        }
        let Observed {
            ok,
            retried,
            contended,
            naive_torn,
        } = total;
        std::println!(
            "{rounds} round(s): seqlock reads ok {ok} (retried {retried}), contended {contended}; naive torn {naive_torn}"
        );
        assert!(ok > 0, "no seqlock read succeeded in {rounds} rounds");
        assert!(
            retried + contended > 0,
            "no seqlock read met the writer in {rounds} rounds: the test checked no contention"
        );
        assert!(
            naive_torn > 0,
            "the naive reader never tore in {rounds} rounds: tearing was not shown possible"
        );
    }
}
