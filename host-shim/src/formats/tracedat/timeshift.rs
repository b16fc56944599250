//! Our sync segments → trace-cmd's TIME_SHIFT option, with the worst-case error of what
//! trace-cmd 3.1.6's reader will compute from it.
//!
//! **Sign conventions.** A [`SyncSegment`] is ours: from host tick `start` on, the vCPU's TSC is
//! `guest = offset + ((host * ratio) >> frac_bits)` ([`KvmTscMapping`], `offset = guest - host`
//! for an identity rate, KVM's `tsc-offset`). trace-cmd stores the other direction: a sample
//! `(time, offset, scaling, fraction)` with `time` in guest ticks means
//! `host = ((guest * scaling) >> fraction) + offset` (lib/trace-cmd/trace-input.c
//! `timestamp_correction_calc`), so an identity segment becomes `offset = -our_offset`.
//!
//! **What the 3.1.6 reader does** (`timestamp_host_sync`, modelled by [`trace_cmd_host_time`]):
//! one sample → `ts + offset`, scaling ignored; two → the pair (0, 1) for every `ts`; more →
//! `ts <= time[0]` uses (0, 1), `ts >= time[last]` uses (last-1, last), else the `mid` with
//! `time[mid] <= ts < time[mid+1]` and (mid, mid+1). Step mode (flags 0) takes the *first*
//! sample of the pair, so after the last sample it would use the second-to-last one: in step mode
//! we therefore append a sentinel copy of the last sample at `time = i64::MAX`. Samples with equal
//! times are deduplicated in an unspecified order, so guest start times must strictly increase.
//!
//! **Exactness.** Step, identity rate: trace-cmd computes `ts - our_offset` modulo 2^64, which is
//! exactly [`KvmTscMapping::try_host_from_guest_ceil`]: error 0. Step, other rates: the reader
//! multiplies `ts * scaling` in **64 bits** and scales the *guest* value, so the best it can do is
//! a fixed-point line whose `fraction` is limited by `ts_max * scaling < 2^64`; [`plan_cpu`]
//! picks the best such line over the trace's guest range and bounds its error against the exact
//! inverse (usually far above one tick for segments longer than a few milliseconds: pre-convert
//! then). Interpolate mode (flags 1): each segment is a point `(guest start, host start)` and the
//! reader draws lines between neighbouring points (extrapolating past both ends); its integer
//! division rounds half up for positive numerators and toward zero for negative ones, within
//! one tick of the ceiling of the exact line, provided no 64-bit product overflows (checked).

use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::timeline::{Segment, Slope};
use vmtsync_core::{GuestTicks, HostTicks};

use super::consts::TSYNC_FLAG_INTERPOLATE;

/// One of our sync segments: from host tick `start` on (up to the next segment's start), the
/// vCPU's TSC relates to the host's by `map` (`guest = offset + ((host * ratio) >> frac_bits)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncSegment {
    /// First host tick the mapping holds for.
    pub start: HostTicks,
    /// The relation from `start` on (our sign: `offset = guest - host` for an identity rate).
    pub map: KvmTscMapping,
}

impl SyncSegment {
    /// An identity-rate segment: `guest = host + guest_minus_host` from host tick `start` on.
    #[must_use]
    pub const fn offset_only(start: HostTicks, guest_minus_host: i64) -> Self {
        Self {
            start,
            map: KvmTscMapping::offset_only(guest_minus_host),
        }
    }

    /// The same relation as a `vmtsync_core` timeline segment (what sync files hold), where
    /// TIME_SHIFT can carry it without changing which events it covers:
    /// - a KVM segment keeps its mapping; its host start is the first host tick of its guest
    ///   start, which must map forward to that same guest start;
    /// - a linear segment with slope exactly 1 and no fractional host start is an offset.
    ///
    /// `None` otherwise (a drifting slope: pre-convert, or write it as interpolation points),
    /// and when the offset does not fit an `i64`.
    #[must_use]
    pub fn try_from_timeline(seg: &Segment) -> Option<Self> {
        let g0 = seg.start();
        if let Some(map) = seg.kvm() {
            let start = map.try_host_from_guest_ceil(g0)?;
            return (map.try_guest_from_host(start)? == g0).then_some(Self { start, map });
        }
        if seg.slope() != Slope::ONE || seg.host_frac_at_start() != 0 {
            return None;
        }
        let base = seg.host_at_start();
        let off = i64::try_from(i128::from(g0.0) - i128::from(base.0)).ok()?;
        Some(Self::offset_only(base, off))
    }
}

/// How trace-cmd moves between samples (TIME_SHIFT `flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShiftMode {
    /// Each segment holds until the next one starts (flags 0, what trace-cmd's KVM sync writes).
    Step,
    /// Segments are points; the offset is interpolated linearly between neighbouring points and
    /// extrapolated past the ends (flags 1, what trace-cmd's PTP sync writes). Identity rates only.
    Interpolate,
}

/// The TIME_SHIFT content: one segment list per trace CPU (vCPU), sorted by start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeShift {
    /// The host trace's TRACEID (trace-cmd 3.1.6 stores it but never checks it).
    pub peer_trace_id: u64,
    /// Step or interpolate, for all CPUs (the option has one flags word).
    pub mode: ShiftMode,
    /// `cpus[c]` are vCPU `c`'s segments; there must be one list per trace CPU.
    pub cpus: Vec<Vec<SyncSegment>>,
}

/// One trace-cmd TIME_SHIFT sample, in trace-cmd's convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceCmdSample {
    /// Guest tick from which the sample applies.
    pub time: i64,
    /// Added after scaling: `host = ((guest * scaling) >> fraction) + offset`.
    pub offset: i64,
    /// Multiplier of the guest tick (64-bit product in the reader).
    pub scaling: i64,
    /// Right shift after the multiplication.
    pub fraction: i64,
}

impl TraceCmdSample {
    /// The exact sample of an identity-rate mapping from guest tick `time` on: trace-cmd adds
    /// the opposite of KVM's offset, unscaled.
    fn identity(time: i64, map: KvmTscMapping) -> Self {
        Self {
            time,
            offset: map.offset().wrapping_neg(),
            scaling: 1,
            fraction: 0,
        }
    }
}

/// Why segments cannot become a TIME_SHIFT trace-cmd reads correctly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimeShiftError {
    /// The number of segment lists differs from the number of trace CPUs.
    #[error(
        "TIME_SHIFT has segments for {got} CPUs but the trace has {cpus}: give one list per vCPU (trace-cmd leaves the others uncorrected silently)"
    )]
    CpuCount {
        /// Trace CPUs.
        cpus: usize,
        /// Segment lists given.
        got: usize,
    },
    /// A CPU has no segment.
    #[error("vCPU {cpu} has no sync segment: sync it at least once or leave TIME_SHIFT out")]
    NoSegments {
        /// The CPU.
        cpu: usize,
    },
    /// A segment's start has no guest tick (the forward mapping overflows).
    #[error("vCPU {cpu} segment {index}: its host start has no guest tick")]
    StartOutOfRange {
        /// The CPU.
        cpu: usize,
        /// The segment.
        index: usize,
    },
    /// Guest start times do not strictly increase (trace-cmd would drop one in unspecified order).
    #[error(
        "vCPU {cpu} segment {index} does not start after the previous one in guest time: merge or drop it"
    )]
    NotIncreasing {
        /// The CPU.
        cpu: usize,
        /// The segment.
        index: usize,
    },
    /// A guest timestamp or start at or above 2^63 - 1 (trace-cmd keeps times as signed 64-bit).
    #[error("vCPU {cpu}: guest tick {tick} is beyond trace-cmd's signed 64-bit times")]
    TickTooLarge {
        /// The CPU.
        cpu: usize,
        /// The tick.
        tick: u64,
    },
    /// Interpolation needs identity rates (the reader would scale the guest value).
    #[error(
        "vCPU {cpu} segment {index} has a non-identity rate: interpolate mode takes identity-rate points (express a drift as more points)"
    )]
    InterpolateNeedsIdentity {
        /// The CPU.
        cpu: usize,
        /// The segment.
        index: usize,
    },
    /// A value the reader computes over the trace's range does not fit its 64-bit arithmetic.
    #[error(
        "vCPU {cpu} segment {index}: trace-cmd's 64-bit arithmetic overflows over the trace's time range: add sync points or pre-convert the timestamps"
    )]
    Overflow {
        /// The CPU.
        cpu: usize,
        /// The segment.
        index: usize,
    },
    /// The error bound exceeds what the caller accepts.
    #[error(
        "vCPU {cpu}: trace-cmd would be off by up to {bound} ticks (limit {limit}): pre-convert the timestamps to host ticks instead"
    )]
    AboveLimit {
        /// The CPU.
        cpu: usize,
        /// The worst-case error in ticks.
        bound: u64,
        /// The caller's limit.
        limit: u64,
    },
}

/// One CPU's samples and their worst-case error over that CPU's guest time range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuPlan {
    /// The samples, sentinel included in step mode.
    pub samples: Vec<TraceCmdSample>,
    /// Worst case of `|trace-cmd's host time - exact host time|` in ticks over the range, where
    /// exact is [`KvmTscMapping::try_host_from_guest_ceil`] of the covering segment (step) or
    /// the ceiling of the line through the neighbouring points (interpolate).
    pub max_error: u64,
}

/// trace-cmd 3.1.6's host time for guest tick `ts` from one CPU's samples (sorted, distinct
/// times), with its 64-bit wrapping arithmetic: a model of `timestamp_host_sync`, used by the
/// tests as the expected output of `trace-cmd report -t`. `None` for no samples.
#[must_use]
pub fn trace_cmd_host_time(samples: &[TraceCmdSample], flags: u32, ts: u64) -> Option<u64> {
    let (min, max) = match samples.len() {
        0 => return None,
        1 => return Some(ts.wrapping_add(samples[0].offset.cast_unsigned())),
        n => {
            let j = pair_index(samples, ts);
            debug_assert!(j + 1 < n);
            (samples[j], samples[j + 1])
        }
    };
    let tscor = if flags & TSYNC_FLAG_INTERPOLATE != 0 {
        let delta = max.time.wrapping_sub(min.time);
        let off = ts
            .cast_signed()
            .wrapping_sub(min.time)
            .wrapping_mul(max.offset.wrapping_sub(min.offset));
        min.offset
            .wrapping_add(off.wrapping_add(delta / 2).checked_div(delta).unwrap_or(0))
    } else {
        min.offset
    };
    #[allow(clippy::cast_sign_loss)]
    let scaled = ts.wrapping_mul(min.scaling as u64) >> (min.fraction as u64 & 63);
    Some(scaled.wrapping_add(tscor.cast_unsigned()))
}

/// The first sample of the pair the reader uses for `ts` (`samples.len() >= 2`).
fn pair_index(samples: &[TraceCmdSample], ts: u64) -> usize {
    let n = samples.len();
    if n == 2 {
        return 0;
    }
    // Compared as unsigned, like C compares `unsigned long long` with `long long`.
    let t = |i: usize| samples[i].time.cast_unsigned();
    if ts <= t(0) {
        0
    } else if ts >= t(n - 1) {
        n - 2
    } else {
        // The last index with time <= ts (the reader's binary search ends there).
        samples.partition_point(|s| s.time.cast_unsigned() <= ts) - 1
    }
}

/// The samples for one CPU and their error bound over the guest range `range` (`None`: the CPU
/// has no events, so no bound is needed and 0 is reported).
///
/// # Errors
/// See [`TimeShiftError`]; `cpu` only labels the error.
pub fn plan_cpu(
    cpu: usize,
    segments: &[SyncSegment],
    mode: ShiftMode,
    range: Option<(u64, u64)>,
) -> Result<CpuPlan, TimeShiftError> {
    if segments.is_empty() {
        return Err(TimeShiftError::NoSegments { cpu });
    }
    if let Some((_, hi)) = range
        && hi >= i64::MAX.cast_unsigned()
    {
        return Err(TimeShiftError::TickTooLarge { cpu, tick: hi });
    }
    let mut starts = Vec::with_capacity(segments.len());
    for (index, s) in segments.iter().enumerate() {
        let g = s
            .map
            .try_guest_from_host(s.start)
            .ok_or(TimeShiftError::StartOutOfRange { cpu, index })?
            .0;
        let g = i64::try_from(g)
            .ok()
            .filter(|&g| g < i64::MAX)
            .ok_or(TimeShiftError::TickTooLarge { cpu, tick: g })?;
        if starts.last().is_some_and(|&p| g <= p) {
            return Err(TimeShiftError::NotIncreasing { cpu, index });
        }
        starts.push(g);
    }
    let plan = CpuSegments {
        cpu,
        segments,
        starts: &starts,
        range,
    };
    match mode {
        ShiftMode::Step => plan.step(),
        ShiftMode::Interpolate => plan.interpolate(),
    }
}

/// The guest ticks of `range` that the reader serves from pair/segment `j` of `n`, whose own
/// start is `starts[j]`: `(-inf, starts[1])` for the first, `[starts[j], starts[j+1])` in the
/// middle, `[starts[n-1], +inf)` for the last.
fn covered(starts: &[i64], j: usize, range: (u64, u64)) -> Option<(u64, u64)> {
    let (mut lo, mut hi) = range;
    if j > 0 {
        lo = lo.max(starts[j].cast_unsigned());
    }
    if let Some(&next) = starts.get(j + 1) {
        hi = hi.min(next.cast_unsigned().checked_sub(1)?);
    }
    (lo <= hi).then_some((lo, hi))
}

/// One CPU's segments and where each starts in guest ticks (increasing), with the guest time
/// range its events span: what both ways of writing its samples work from.
#[derive(Clone, Copy)]
struct CpuSegments<'a> {
    cpu: usize,
    segments: &'a [SyncSegment],
    starts: &'a [i64],
    range: Option<(u64, u64)>,
}

impl CpuSegments<'_> {
    /// Steps: each segment's offset holds from its start to the next one's (flags=0).
    fn step(self) -> Result<CpuPlan, TimeShiftError> {
        let mut samples = Vec::with_capacity(self.segments.len() + 1);
        let mut max_error = 0;
        for (index, (s, &time)) in self.segments.iter().zip(self.starts).enumerate() {
            let part = self.range.and_then(|r| covered(self.starts, index, r));
            let sample = if s.map.is_identity_ratio() {
                TraceCmdSample::identity(time, s.map)
            } else {
                // Without events in range there is nothing to fit: any range gives a valid line.
                let (lo, hi) = part.unwrap_or((time.cast_unsigned(), time.cast_unsigned()));
                let fit = fit_scaled(s.map, lo, hi).ok_or(TimeShiftError::Overflow {
                    cpu: self.cpu,
                    index,
                })?;
                if part.is_some() {
                    max_error = max_error.max(fit.bound);
                }
                TraceCmdSample {
                    time,
                    offset: fit.offset,
                    scaling: fit.scaling,
                    fraction: i64::from(fit.fraction),
                }
            };
            samples.push(sample);
        }
        let mut sentinel = *samples.last().unwrap_or(&samples[0]);
        sentinel.time = i64::MAX;
        samples.push(sentinel);
        Ok(CpuPlan { samples, max_error })
    }

    /// Points trace-cmd interpolates between (flags=1): identity-ratio segments only.
    fn interpolate(self) -> Result<CpuPlan, TimeShiftError> {
        let mut samples = Vec::with_capacity(self.segments.len());
        for (index, (s, &time)) in self.segments.iter().zip(self.starts).enumerate() {
            if !s.map.is_identity_ratio() {
                return Err(TimeShiftError::InterpolateNeedsIdentity {
                    cpu: self.cpu,
                    index,
                });
            }
            samples.push(TraceCmdSample::identity(time, s.map));
        }
        let mut max_error = 0;
        if let (Some(range), true) = (self.range, samples.len() >= 2) {
            // Pair j serves the guest ticks between its points (and beyond, at the ends).
            let pair_starts = &self.starts[..self.starts.len() - 1];
            for j in 0..pair_starts.len() {
                let Some((lo, hi)) = covered(pair_starts, j, range) else {
                    continue;
                };
                let (a, b) = (samples[j], samples[j + 1]);
                let d_off = i128::from(b.offset) - i128::from(a.offset);
                let delta = i128::from(b.time) - i128::from(a.time);
                let ok = [lo, hi].iter().all(|&g| {
                    let x = (i128::from(g) - i128::from(a.time)) * d_off;
                    let q = (x + delta / 2) / delta;
                    let fits = |v: i128| i64::try_from(v).is_ok();
                    let host = i128::from(g) + i128::from(a.offset) + q;
                    fits(d_off)
                        && fits(x)
                        && fits(x + delta / 2)
                        && (0..=i128::from(u64::MAX)).contains(&host)
                });
                if !ok {
                    return Err(TimeShiftError::Overflow {
                        cpu: self.cpu,
                        index: j,
                    });
                }
                if d_off != 0 {
                    max_error = 1;
                }
            }
        }
        Ok(CpuPlan { samples, max_error })
    }
}

/// trace-cmd's best fixed-point line for a non-identity mapping over `[lo, hi]`.
struct ScaledFit {
    scaling: i64,
    fraction: u32,
    offset: i64,
    bound: u64,
}

/// Fits `host ≈ ((g * s) >> f) + c` to the exact inverse of `map` on `[lo, hi]` and bounds the
/// error. `s = round(2^(f + frac_bits) / ratio)` with the largest `f` for which `hi * s` fits the
/// reader's u64 product; `c` centres the error. The bound: with `a(g) = g s / 2^f + c` and
/// `e(g) = (g - offset) 2^frac_bits / ratio` (both exact lines, `D = a - e` linear), trace-cmd
/// computes `floor(a)`, the exact inverse is `ceil(e)`, and `floor(a) - ceil(e)` lies in
/// `{floor(D) - 1, floor(D)}`; `floor(D)` is evaluated exactly at both ends (a linear `D` takes
/// its extremes there). `None` if no line avoids the reader's overflow over the range.
fn fit_scaled(map: KvmTscMapping, lo: u64, hi: u64) -> Option<ScaledFit> {
    let r = u128::from(map.ratio());
    let k = map.frac_bits();
    let (s, f) = (0..=62u32).rev().find_map(|f| {
        let s = ((1u128 << (f + k)) + r / 2) / r;
        (s > 0 && s <= i64::MAX as u128 && u128::from(hi) * s <= u128::from(u64::MAX))
            .then_some((s, f))
    })?;
    // The exact inverse must not wrap inside the range (KVM's offset addition is modular).
    let s_lo = lo.wrapping_sub(map.offset().cast_unsigned());
    let s_hi = hi.wrapping_sub(map.offset().cast_unsigned());
    if s_lo > s_hi {
        return None;
    }
    let floor_d = |g: u64, sg: u64| -> Option<i128> {
        let prod = u128::from(g) * s;
        let a_int = i128::try_from(prod >> f).ok()?;
        let a_rem = prod & ((1u128 << f) - 1);
        let num = u128::from(sg) << k;
        let e_q = i128::try_from(num / r).ok()?;
        let e_rem = num % r;
        let borrow = i128::from(a_rem * r < e_rem << f);
        a_int.checked_sub(e_q)?.checked_sub(borrow)
    };
    let (f_lo, f_hi) = (floor_d(lo, s_lo)?, floor_d(hi, s_hi)?);
    let (fmin, fmax) = (f_lo.min(f_hi), f_lo.max(f_hi));
    // A - E ranges over [fmin + c - 1, fmax + c]; centre it on 0.
    let c = -(fmin - 1 + fmax).div_euclid(2);
    let bound = (fmax + c).unsigned_abs().max((fmin + c - 1).unsigned_abs());
    let offset = i64::try_from(c).ok()?;
    // The reader's result must stay a valid host tick over the range.
    let a = |g: u64| i128::try_from((u128::from(g) * s) >> f).ok().map(|v| v + c);
    let range_ok = a(lo)? >= 0 && a(hi)? <= i128::from(u64::MAX);
    range_ok.then_some(ScaledFit {
        scaling: i64::try_from(s).ok()?,
        fraction: f,
        offset,
        bound: u64::try_from(bound).ok()?,
    })
}

/// The TIME_SHIFT option body (see `docs/trace-dat.md`) and each CPU's error bound.
///
/// `ranges[c]` is CPU `c`'s guest time range (`None` without events). Fails if any CPU's bound
/// exceeds `limit` ticks.
///
/// # Errors
/// See [`TimeShiftError`].
pub fn encode(
    shift: &TimeShift,
    ranges: &[Option<(u64, u64)>],
    limit: u64,
) -> Result<(Vec<u8>, Vec<u64>), TimeShiftError> {
    if shift.cpus.len() != ranges.len() {
        return Err(TimeShiftError::CpuCount {
            cpus: ranges.len(),
            got: shift.cpus.len(),
        });
    }
    let mut plans = Vec::with_capacity(ranges.len());
    for (cpu, (segs, &range)) in shift.cpus.iter().zip(ranges).enumerate() {
        let plan = plan_cpu(cpu, segs, shift.mode, range)?;
        if plan.max_error > limit {
            return Err(TimeShiftError::AboveLimit {
                cpu,
                bound: plan.max_error,
                limit,
            });
        }
        plans.push(plan);
    }
    let flags = match shift.mode {
        ShiftMode::Step => 0,
        ShiftMode::Interpolate => TSYNC_FLAG_INTERPOLATE,
    };
    let mut out = Vec::new();
    out.extend_from_slice(&shift.peer_trace_id.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&u32::try_from(plans.len()).unwrap_or(u32::MAX).to_le_bytes());
    for p in &plans {
        out.extend_from_slice(
            &u32::try_from(p.samples.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        for field in [
            |s: &TraceCmdSample| s.time,
            |s: &TraceCmdSample| s.offset,
            |s: &TraceCmdSample| s.scaling,
        ] {
            for s in &p.samples {
                out.extend_from_slice(&field(s).to_le_bytes());
            }
        }
    }
    for p in &plans {
        for s in &p.samples {
            out.extend_from_slice(&s.fraction.to_le_bytes());
        }
    }
    Ok((out, plans.into_iter().map(|p| p.max_error).collect()))
}

/// A TIME_SHIFT option body read back: the inverse of [`encode`]'s layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedShift {
    /// The peer (host) trace's TRACEID.
    pub peer_trace_id: u64,
    /// The flags word ([`TSYNC_FLAG_INTERPOLATE`] or 0).
    pub flags: u32,
    /// Each trace CPU's samples, in file order, for [`trace_cmd_host_time`].
    pub cpus: Vec<Vec<TraceCmdSample>>,
}

/// Reads a TIME_SHIFT option body. Every count is checked against the body's length before
/// anything is allocated, so a damaged option cannot make this allocate more than the body.
///
/// # Errors
/// What is wrong and the byte offset inside the body where it was found.
pub fn decode(body: &[u8]) -> Result<DecodedShift, (usize, &'static str)> {
    let u32_at = |at: usize| -> Result<u32, (usize, &'static str)> {
        body.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or((at, "TIME_SHIFT ends inside a 32-bit field"))
    };
    let i64_at = |at: usize| -> Result<i64, (usize, &'static str)> {
        body.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(i64::from_le_bytes)
            .ok_or((at, "TIME_SHIFT ends inside a 64-bit field"))
    };
    let peer_trace_id = i64_at(0)?.cast_unsigned();
    let flags = u32_at(8)?;
    let ncpus = u32_at(12)? as usize;
    // Each CPU takes at least its 4-byte count.
    if ncpus > body.len() / 4 {
        return Err((12, "TIME_SHIFT CPU count exceeds the option's size"));
    }
    let mut at = 16;
    let mut cpus = Vec::with_capacity(ncpus);
    for _ in 0..ncpus {
        let n = u32_at(at)? as usize;
        // Each sample takes 32 bytes (time, offset, scaling, fraction).
        if n > (body.len() - at) / 32 {
            return Err((at, "TIME_SHIFT sample count exceeds the option's size"));
        }
        at += 4;
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            samples.push(TraceCmdSample {
                time: i64_at(at + 8 * i)?,
                offset: i64_at(at + 8 * (n + i))?,
                scaling: i64_at(at + 8 * (2 * n + i))?,
                fraction: 0,
            });
        }
        at += 24 * n;
        cpus.push(samples);
    }
    for samples in &mut cpus {
        for s in samples.iter_mut() {
            s.fraction = i64_at(at)?;
            at += 8;
        }
    }
    Ok(DecodedShift {
        peer_trace_id,
        flags,
        cpus,
    })
}

/// The exact host tick of guest tick `g` under one CPU's segments, as [`plan_cpu`] bounds it:
/// step mode → the covering segment's [`KvmTscMapping::try_host_from_guest_ceil`]; interpolate
/// mode → the ceiling of the line through the neighbouring points. For tests and callers that
/// want to check trace-cmd's output. `None` without segments or outside `u64`.
#[must_use]
pub fn exact_host_time(segments: &[SyncSegment], mode: ShiftMode, g: u64) -> Option<u64> {
    let starts: Vec<u64> = segments
        .iter()
        .map(|s| s.map.try_guest_from_host(s.start).map(|t| t.0))
        .collect::<Option<_>>()?;
    let j = starts.partition_point(|&t| t <= g).saturating_sub(1);
    match mode {
        ShiftMode::Step => segments
            .get(j)?
            .map
            .try_host_from_guest_ceil(GuestTicks(g))
            .map(|h| h.0),
        ShiftMode::Interpolate => {
            if segments.len() == 1 {
                return segments[0]
                    .map
                    .try_host_from_guest_ceil(GuestTicks(g))
                    .map(|h| h.0);
            }
            let j = j.min(segments.len() - 2);
            let (ga, gb) = (i128::from(starts[j]), i128::from(starts[j + 1]));
            let (ha, hb) = (
                i128::from(segments[j].start.0),
                i128::from(segments[j + 1].start.0),
            );
            let num = (i128::from(g) - ga) * (hb - ha);
            let den = gb - ga;
            let q = num.div_euclid(den) + i128::from(num.rem_euclid(den) != 0);
            u64::try_from(ha + q).ok()
        }
    }
}

#[cfg(test)]
mod tests;
