//! Attach planning: which TIME_SHIFT samples put a guest trace's CPUs on the host timeline,
//! from one fixed mapping, each vCPU's KVM mapping, or a sync file (as steps, or as points
//! that trace-cmd interpolates between). `vmtsync trace-cmd attach` gathers the mapping and
//! hands the plan to [`super::attach_time_shift`].

use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::{GuestTicks, HostTicks};

use super::timeshift::{ShiftMode, SyncSegment};
use crate::syncfile::SyncTimeline;

/// Where a guest trace's guest-to-host mapping comes from.
#[derive(Debug)]
pub enum AttachMapping<'a> {
    /// One mapping for every guest CPU (`--offset`, `--ratio`, `--frac-bits`).
    Fixed(KvmTscMapping),
    /// Guest CPU `c` runs with `maps[c]` (`--vm`: each vCPU's KVM mapping).
    PerCpu(Vec<KvmTscMapping>),
    /// A sync file's timeline of one vCPU, for every guest CPU.
    Sync {
        /// The timeline.
        timeline: &'a SyncTimeline,
        /// Points that trace-cmd interpolates between instead of steps.
        interpolate: bool,
    },
}

/// The TIME_SHIFT to write: its mode and one segment list per guest CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachPlan {
    /// Steps or interpolation.
    pub mode: ShiftMode,
    /// Per guest CPU, its segments.
    pub cpus: Vec<Vec<SyncSegment>>,
    /// With interpolated points: how far the lines between them depart from the sync file's
    /// own per-segment conversion over the trace, in ticks.
    pub deviation: Option<u64>,
}

/// The plan for a guest trace of `cpus` CPUs whose raw time ranges are `ranges`.
///
/// # Errors
/// Why the mapping cannot be written (a drifting sync segment as a step, a guest tick with no
/// host tick in the sync file, `PerCpu` with fewer mappings than CPUs), in words.
pub fn plan(
    m: &AttachMapping<'_>,
    cpus: usize,
    ranges: &[Option<(u64, u64)>],
) -> Result<AttachPlan, String> {
    let first = |c: usize| ranges.get(c).copied().flatten().map(|r| r.0);
    let single = |c: usize, map: KvmTscMapping| {
        vec![SyncSegment {
            start: start_for(map, first(c)),
            map,
        }]
    };
    match m {
        AttachMapping::Fixed(map) => Ok(AttachPlan {
            mode: ShiftMode::Step,
            cpus: (0..cpus).map(|c| single(c, *map)).collect(),
            deviation: None,
        }),
        AttachMapping::PerCpu(maps) => {
            if maps.len() < cpus {
                return Err(format!(
                    "{} mappings for a trace of {cpus} CPUs",
                    maps.len()
                ));
            }
            Ok(AttachPlan {
                mode: ShiftMode::Step,
                cpus: maps
                    .iter()
                    .take(cpus)
                    .enumerate()
                    .map(|(c, &map)| single(c, map))
                    .collect(),
                deviation: None,
            })
        }
        AttachMapping::Sync {
            timeline,
            interpolate: true,
        } => {
            let first = ranges.iter().flatten().map(|r| r.0).min();
            let last = ranges.iter().flatten().map(|r| r.1).max();
            let (segs, deviation) = sync_points(timeline, first, last)?;
            Ok(AttachPlan {
                mode: ShiftMode::Interpolate,
                cpus: vec![segs; cpus],
                deviation: Some(deviation),
            })
        }
        AttachMapping::Sync {
            timeline,
            interpolate: false,
        } => Ok(AttachPlan {
            mode: ShiftMode::Step,
            cpus: vec![sync_steps(timeline)?; cpus],
            deviation: None,
        }),
    }
}

/// The host tick a single-mapping segment starts at: where the CPU's first event falls, else
/// where guest tick 0 falls, else host tick 0 (any start works for one segment: trace-cmd uses
/// the same pair of samples for every timestamp).
fn start_for(map: KvmTscMapping, first: Option<u64>) -> HostTicks {
    first
        .and_then(|g| map.try_host_from_guest_ceil(GuestTicks(g)))
        .or_else(|| map.try_host_from_guest_ceil(GuestTicks(0)))
        .unwrap_or(HostTicks(0))
}

/// Step samples: each sync segment's offset from its first host tick on. Exact for
/// constant-offset segments; a drifting one cannot be a step (the reader would scale the
/// guest value in 64 bits), so it is refused with the way out.
fn sync_steps(tl: &SyncTimeline) -> Result<Vec<SyncSegment>, String> {
    tl.records()
        .iter()
        .map(|r| {
            r.to_timeline_segment()
                .as_ref()
                .and_then(SyncSegment::try_from_timeline)
                .ok_or_else(|| {
                    format!(
                        "sync segment of round {} drifts ({} ppb): a step TIME_SHIFT cannot carry a rate; pass --interpolate (points at each segment start) or pre-convert",
                        r.round, r.drift_ppb
                    )
                })
        })
        .collect()
}

/// Interpolation points: the sync file's exact conversion at each segment's first guest tick,
/// plus one at the trace's last guest tick on the last segment's line, so that trace-cmd's
/// extrapolation past the last start follows that segment's rate. Also returns how far the
/// lines between the points depart from the sync file's own per-segment conversion over
/// `[first, last]`, in ticks: both are linear between two points, so the largest difference
/// is at an end of each stretch (where it is evaluated exactly, floors on both sides).
fn sync_points(
    tl: &SyncTimeline,
    first: Option<u64>,
    last: Option<u64>,
) -> Result<(Vec<SyncSegment>, u64), String> {
    let host_of = |g: u64| {
        tl.try_host_from_guest_floor(GuestTicks(g))
            .map(|h| h.0)
            .ok_or_else(|| format!("guest tick {g} has no host tick in the sync file"))
    };
    let point = |g: u64| {
        let h = host_of(g)?;
        let off = i64::try_from(i128::from(g) - i128::from(h))
            .map_err(|_| format!("guest tick {g}: offset beyond 64 bits"))?;
        Ok::<_, String>((g, h, SyncSegment::offset_only(HostTicks(h), off)))
    };
    let mut pts = tl
        .records()
        .iter()
        .map(|r| point(r.guest_start))
        .collect::<Result<Vec<_>, _>>()?;
    let last_start = pts.last().map_or(0, |p| p.0);
    if let Some(g) = last.filter(|&g| g > last_start) {
        pts.push(point(g)?);
    }
    // The line through neighbouring points (the first pair also serves before the first
    // point), floored, against the sync file's floor.
    let mut deviation = 0u64;
    for w in pts.windows(2) {
        let ((ga, ha, _), (gb, hb, _)) = (w[0], w[1]);
        let mut ends = vec![gb - 1];
        if w[0].0 == pts[0].0
            && let Some(f) = first.filter(|&f| f < ga)
        {
            ends.push(f);
        }
        for g in ends {
            let num = (i128::from(g) - i128::from(ga)) * (i128::from(hb) - i128::from(ha));
            let line = i128::from(ha) + num.div_euclid(i128::from(gb) - i128::from(ga));
            let d = (line - i128::from(host_of(g)?)).unsigned_abs();
            deviation = deviation.max(u64::try_from(d).unwrap_or(u64::MAX));
        }
    }
    Ok((pts.into_iter().map(|p| p.2).collect(), deviation))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syncfile::SyncFile;

    /// A sync file of vCPU 0 with constant-offset segments `(guest start, offset)`.
    fn sync(segs: &[(u64, i64)]) -> SyncTimeline {
        let mut t = String::from(
            "{\"type\":\"header\",\"schema\":1,\"tool\":\"t\",\"host_clock\":\"x86-tsc\",\"created_unix_s\":1}\n",
        );
        for (r, &(g, o)) in segs.iter().enumerate() {
            let h = g.checked_add_signed(-o).unwrap();
            t.push_str(&format!(
                "{{\"type\":\"segment\",\"vcpu\":0,\"round\":{r},\"guest_start\":{g},\"host_anchor\":{h},\"guest_anchor\":{g},\"offset\":{o},\"offset_lo\":{o},\"offset_hi\":{o},\"drift_ppb\":0,\"drift_ppb_lo\":0,\"drift_ppb_hi\":0,\"model\":\"drift\",\"probes\":1,\"rtt_min_ticks\":1,\"host_first\":{h},\"host_last\":{h},\"break\":false}}\n"
            ));
        }
        SyncFile::parse(t.as_bytes()).unwrap().timeline(0).unwrap()
    }

    #[test]
    fn sync_steps_are_the_offsets_and_points_report_their_departure() {
        let tl = sync(&[(1000, 0), (2000, -100), (3000, 50)]);
        let steps = sync_steps(&tl).unwrap();
        assert_eq!(
            steps,
            [
                SyncSegment::offset_only(HostTicks(1000), 0),
                SyncSegment::offset_only(HostTicks(2100), -100),
                SyncSegment::offset_only(HostTicks(2950), 50),
            ]
        );
        let (pts, dev) = sync_points(&tl, Some(500), Some(4000)).unwrap();
        // The three starts and the last tick on the last segment.
        assert_eq!(pts.len(), 4);
        assert_eq!(pts[3], SyncSegment::offset_only(HostTicks(3950), 50));
        // Worst at 2999: the line from (2000, 2100) to (3000, 2950) gives 2949, the sync
        // file's second segment 3099.
        assert_eq!(dev, 150);
    }

    #[test]
    fn a_single_segment_starts_where_the_first_event_falls() {
        let m = KvmTscMapping::offset_only(-1000);
        assert_eq!(start_for(m, Some(5000)), HostTicks(6000));
        assert_eq!(start_for(m, None), HostTicks(1000));
        // Guest ahead of the host: guest 0 is before host 0, modulo 2^64 as KVM adds, and
        // maps back to guest 0 (what the TIME_SHIFT sample's time becomes).
        let m = KvmTscMapping::offset_only(1000);
        let s = start_for(m, None);
        assert_eq!(m.try_guest_from_host(s), Some(GuestTicks(0)));
    }
}
