//! The placement stage both front ends share: every vCPU's segments (from sync rounds or
//! from KVM's own mapping), the counters of a recording, and an event's host interval.

use vmtsync_core::estimate::EstimateError;

use super::ledger::Ledger;
use super::spool::{self, Spool};
use crate::formats::jsonl::{EVENT_SCHEMA, Line};
use crate::formats::perfetto::clock::ClockSnapshot;
use crate::guestmem::GuestRecord;
use crate::sync::{self, Cumulative, Placement};
use crate::syncfile::{SyncSegment, SyncWriter};

/// One event on its way to the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Placed<'a> {
    pub(super) vcpu: u32,
    pub(super) id: u16,
    pub(super) guest: u64,
    pub(super) payload: &'a [u8],
    pub(super) host: u64,
    pub(super) lo: u64,
    pub(super) hi: u64,
    pub(super) round: u64,
    /// `vcpu` is a boot key ([`boot_key`]): the output shows its boot and ring apart.
    pub(super) keyed: bool,
}

/// A memory recording's placement key of ring `ring` in guest boot `boot`: each boot's rings
/// are vCPUs of their own for placement (a reset restarts the guest's clock and KVM may give
/// it another offset, so no boot's segments may place another boot's records).
pub(super) fn boot_key(boot: u32, ring: u32) -> u32 {
    (boot << 16) | (ring & 0xFFFF)
}

/// The (boot, ring) of a key made by [`boot_key`].
pub(super) fn split_key(key: u32) -> (u32, u32) {
    (key >> 16, key & 0xFFFF)
}

impl<'a> Placed<'a> {
    /// Record `r` of a memory recording's vCPU key `key` ([`boot_key`]) at host tick `host`
    /// with width 0, placed by segment round `round`.
    pub(super) fn exact(r: &'a GuestRecord, key: u32, host: u64, round: u64) -> Self {
        Self {
            vcpu: key,
            keyed: true,
            id: r.id,
            guest: r.tsc,
            payload: r.payload(),
            host,
            lo: host,
            hi: host,
            round,
        }
    }

    /// The event as a JSON Lines line.
    pub(super) fn line(&self) -> Line {
        let (boot, vcpu) = if self.keyed {
            let (b, r) = split_key(self.vcpu);
            (Some(b), r)
        } else {
            (None, self.vcpu)
        };
        Line {
            schema: EVENT_SCHEMA,
            vcpu,
            boot,
            id: self.id,
            guest_tsc: self.guest,
            host_tsc: self.host,
            host_lo: self.lo,
            host_hi: self.hi,
            payload: crate::formats::Payload::new(self.payload).unwrap_or_default(),
            round: self.round,
        }
    }

    /// The guest boot the event comes from (a memory recording followed across resets; 0
    /// otherwise).
    pub(super) fn boot(&self) -> u32 {
        if self.keyed {
            split_key(self.vcpu).0
        } else {
            0
        }
    }

    /// The event as the exporters see it (everything known).
    pub(super) fn export(&self) -> crate::formats::ExportEvent {
        export_event(
            self.vcpu,
            self.keyed,
            self.id,
            (self.guest, self.host, self.lo, self.hi),
            crate::formats::Payload::new(self.payload).unwrap_or_default(),
        )
    }
}

/// An event as the exporters see it, everything known: of vCPU `key` (with `keyed`, a
/// memory recording's [`boot_key`], whose boots share their ring's vCPU stream), its guest
/// tick, host tick and guaranteed interval's ends, and its payload.
#[inline]
pub(super) fn export_event(
    key: u32,
    keyed: bool,
    id: u16,
    (guest, host, lo, hi): (u64, u64, u64, u64),
    payload: crate::formats::Payload,
) -> crate::formats::ExportEvent {
    crate::formats::ExportEvent {
        vcpu: if keyed { split_key(key).1 } else { key },
        id,
        guest_tsc: Some(guest),
        host_tsc: host,
        bound: Some(crate::formats::Bound { lo, hi }),
        payload,
    }
}

/// One vCPU's part of a recording: its segments (its own clock's), its cumulative estimate,
/// and its event queue's counters (the agent counts each vCPU's `first` indices on their own).
pub(super) struct VcpuSync {
    pub(super) vcpu: u32,
    pub(super) segments: Vec<SyncSegment>,
    /// A raw-TSC guest's mappings from KVM's debugfs (width 0), when `segments` are the
    /// beacons': an event's point is its exact host time whenever that lies inside the
    /// interval the beacons guarantee.
    pub(super) exact: Vec<SyncSegment>,
    pub(super) cumulative: Cumulative,
    /// What its batches' indices and counters say was lost, and where.
    pub(super) ledger: Ledger,
}

impl VcpuSync {
    /// The segments a trace.dat's timestamps follow: KVM's exact mappings when the points
    /// come from them, else the sync segments.
    pub(super) fn time_segments(&self) -> &[SyncSegment] {
        if self.exact.is_empty() {
            &self.segments
        } else {
            &self.exact
        }
    }

    pub(super) fn new(vcpu: u32) -> Self {
        Self {
            vcpu,
            segments: Vec::new(),
            exact: Vec::new(),
            cumulative: Cumulative::new(),
            ledger: Ledger::default(),
        }
    }
}

/// The state of a recording.
pub(super) struct State {
    /// `--sync-out`: every segment is appended as it is made.
    pub(super) sync_out: Option<SyncWriter>,
    /// Every vCPU synced, in increasing order.
    pub(super) vcpus: Vec<VcpuSync>,
    pub(super) round: u64,
    pub(super) breaks: u64,
    pub(super) events: u64,
    pub(super) host_stamped: u64,
    pub(super) unplaceable: u64,
    /// Events the agent sent that never arrived (gaps in the batches' `first` index).
    pub(super) lost: u64,
    /// Records received twice (skipped).
    pub(super) replayed: u64,
    /// Drains that failed and were asked again.
    pub(super) failed_drains: u64,
    /// Interval widths, for the summary's min/median/max, in constant memory.
    pub(super) widths: Widths,
    /// Host TSC/BOOTTIME snapshots, one per sync round (for the Perfetto output).
    pub(super) clocks: Vec<ClockSnapshot>,
    /// Why the last vCPU round whose samples gave no estimate refused them.
    pub(super) refused: Option<EstimateError>,
    /// Events of a vCPU with no beacon segment placed by KVM's mapping alone (width 0, not
    /// verified by any bracketed beacon): counted by [`State::final_widths`].
    pub(super) unverified: u64,
    /// `--placement`.
    pub(super) placement: Placement,
    /// A memory recording: every vCPU here is a [`boot_key`].
    pub(super) keyed: bool,
}

/// Event interval widths in constant memory: the exact minimum and maximum, and an evenly
/// spaced sample for the median (every `stride`-th width; when the sample fills up, every
/// other one is dropped and the stride doubles).
#[derive(Debug, Default)]
pub(super) struct Widths {
    pub(super) min: Option<u64>,
    pub(super) max: u64,
    pub(super) sample: Vec<u64>,
    pub(super) stride: u64,
    pub(super) seen: u64,
}

/// The sample's capacity.
pub(super) const WIDTH_SAMPLE: usize = 1 << 16;

impl Widths {
    pub(super) fn push(&mut self, w: u64) {
        self.min = Some(self.min.map_or(w, |m| m.min(w)));
        self.max = self.max.max(w);
        let stride = self.stride.max(1);
        if self.seen.is_multiple_of(stride) {
            if self.sample.len() == WIDTH_SAMPLE {
                self.halve(stride);
            }
            if self.seen.is_multiple_of(self.stride.max(1)) {
                self.sample.push(w);
            }
        }
        self.seen += 1;
    }

    /// `n` widths `w` at once: what `n` calls of [`Self::push`] do, the sampled ones added
    /// to the sample together up to its capacity (one step per halving, not per sample).
    pub(super) fn push_n(&mut self, w: u64, mut n: u64) {
        if n == 0 {
            return;
        }
        self.min = Some(self.min.map_or(w, |m| m.min(w)));
        self.max = self.max.max(w);
        while n > 0 {
            let stride = self.stride.max(1);
            // The widths before the next sampled position only count.
            let next = self.seen.next_multiple_of(stride);
            if next - self.seen >= n {
                self.seen += n;
                return;
            }
            n -= next - self.seen;
            self.seen = next;
            if self.sample.len() == WIDTH_SAMPLE {
                self.halve(stride);
                if !self.seen.is_multiple_of(self.stride) {
                    // As `push`: this position was sampled at the old stride only.
                    self.seen += 1;
                    n -= 1;
                    continue;
                }
            }
            // `seen` is a sampled position: it and the ones every stride after it, below
            // `seen + n`, as many as the sample has room for.
            let stride = self.stride.max(1);
            let room = (WIDTH_SAMPLE - self.sample.len()) as u64;
            let k = n.div_ceil(stride).min(room);
            self.sample
                .resize(self.sample.len() + usize::try_from(k).unwrap_or(0), w);
            let advance = ((k - 1) * stride + 1).min(n);
            self.seen += advance;
            n -= advance;
        }
    }

    /// Every other sampled width dropped, the stride doubled (the sample was full).
    fn halve(&mut self, stride: u64) {
        let mut keep = false;
        self.sample.retain(|_| {
            keep = !keep;
            keep
        });
        self.stride = stride * 2;
    }

    /// (min, median of the sample, max), `None` without widths.
    pub(super) fn summary(&self) -> Option<(u64, u64, u64)> {
        let mut s = self.sample.clone();
        s.sort_unstable();
        Some((self.min?, *s.get(s.len() / 2)?, self.max))
    }
}

impl State {
    /// A recording of `vcpus` with no segment yet.
    pub(super) fn new(vcpus: &[u32], sync_out: Option<SyncWriter>, placement: Placement) -> Self {
        Self {
            sync_out,
            vcpus: vcpus.iter().map(|&v| VcpuSync::new(v)).collect(),
            round: 0,
            breaks: 0,
            events: 0,
            host_stamped: 0,
            unplaceable: 0,
            lost: 0,
            replayed: 0,
            failed_drains: 0,
            widths: Widths::default(),
            clocks: Vec::new(),
            refused: None,
            unverified: 0,
            placement,
            keyed: false,
        }
    }

    /// Segments made so far, every vCPU's.
    pub(super) fn segments(&self) -> u64 {
        self.vcpus.iter().map(|v| v.segments.len() as u64).sum()
    }

    /// Where `vcpu` stands in [`State::vcpus`].
    pub(super) fn index_of(&self, vcpu: u32) -> Option<usize> {
        self.vcpus.iter().position(|v| v.vcpu == vcpu)
    }

    /// Guest tick `g` of `vcpu` on the host timeline: (placed, lo, hi) with the recording's
    /// placement ([`State::place_as`]).
    #[cfg(test)]
    pub(super) fn place(&self, vcpu: u32, g: u64) -> Option<(u64, u64, u64)> {
        self.place_as(vcpu, g, self.placement)
            .map(|p| (p.host, p.lo, p.hi))
    }

    /// Guest tick `g` of `vcpu` on the host timeline with placement `how`, through the vCPU's
    /// segment that covers it; `None` without one (the vCPU never synced) or outside `u64`.
    pub(super) fn place_as(&self, vcpu: u32, g: u64, how: Placement) -> Option<sync::Place> {
        let v = self.vcpus.get(self.index_of(vcpu)?)?;
        sync::place_with_exact(&v.segments, &v.exact, g, how)
    }

    /// A spooled event placed with the rounds known now.
    pub(super) fn placed<'a>(&self, rec: &'a spool::Spooled) -> Option<Placed<'a>> {
        let p = self.place_as(rec.vcpu, rec.guest, self.placement)?;
        Some(Placed {
            vcpu: rec.vcpu,
            id: rec.id,
            guest: rec.guest,
            payload: rec.payload(),
            host: p.host,
            lo: p.lo,
            hi: p.hi,
            round: p.round,
            keyed: self.keyed,
        })
    }

    /// A spooled event placed with the rounds known now, and counted in the summary: its
    /// width, or, for a point of KVM's mapping that no beacon verified (its vCPU has no beacon
    /// segment), among the unverified (it has no guaranteed interval). `None`, counted, when
    /// no round places it (it is not written).
    pub(super) fn place_counted<'a>(&mut self, rec: &'a spool::Spooled) -> Option<Placed<'a>> {
        let Some(p) = self.placed(rec) else {
            self.unplaceable += 1;
            self.events = self.events.saturating_sub(1);
            return None;
        };
        let unverified = self
            .index_of(rec.vcpu)
            .is_some_and(|i| self.vcpus[i].segments.is_empty());
        if unverified {
            self.unverified += 1;
        } else {
            self.widths.push(p.hi - p.lo);
        }
        Some(p)
    }

    /// Two-sided placement: the summary's widths are those of the final placement, with
    /// every round known (one more pass over the spool).
    pub(super) fn final_widths(&mut self, spool: &mut Spool) {
        let Ok(recs) = spool.iter() else {
            return;
        };
        self.widths = Widths::default();
        for rec in recs {
            let Ok(rec) = rec else {
                break;
            };
            self.place_counted(&rec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_pushed_n_at_a_time_are_widths_pushed_one_by_one() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let (mut one, mut many) = (Widths::default(), Widths::default());
        // Past the sample's capacity, so the stride doubles several times.
        while one.seen < 6 * WIDTH_SAMPLE as u64 {
            // Now and then a drain round's worth at once.
            let (w, n) = (next(1000), next(5000) * (1 + 16 * u64::from(next(4) == 0)));
            for _ in 0..n {
                one.push(w);
            }
            many.push_n(w, n);
            assert_eq!(
                (one.min, one.max, one.seen, one.stride),
                (many.min, many.max, many.seen, many.stride)
            );
            assert_eq!(one.sample, many.sample);
        }
    }
    use crate::sync::{Round, convert_with_sync};
    use crate::syncfile::AnchorKind;
    use vmtsync_core::sim::{Delay, GuestClock, Link, Sim};
    use vmtsync_core::{GuestTicks, HostTicks};

    /// `record` and `convert --sync` place a guest tick by one rule: with the segments a
    /// recording made (what `--sync-out` writes), `convert --sync` prints the point `record`
    /// gives the event at that tick, inside `record`'s interval, which holds the truth. Before
    /// they shared the rule, `convert --sync` followed the covering segment's line through the
    /// core timeline; for a drifting guest that differs from `record`'s point, which the test
    /// checks so that it shows the two rules apart.
    #[test]
    fn record_and_convert_sync_place_a_tick_alike() {
        let clock = GuestClock::with_drift_ppb(5_098_309_658_643, 100_000).unwrap();
        let mut sim = Sim::new(11, HostTicks(1 << 41), clock, Link::tight_asymmetric(), 0);
        let within = sim.link.gap;
        let mut st = State::new(&[0], None, Placement::TwoSided);
        let first = sim.now().0;
        for round in 0..4 {
            // Rounds of 16 probes, half a host second apart.
            sim.link.gap = Delay::Constant(500_000_000);
            let mut samples = vec![sim.probe().unwrap()];
            sim.link.gap = within;
            samples.extend((1..16).map(|_| sim.probe().unwrap()));
            let r = Round::from_samples(&samples).unwrap();
            let v = &mut st.vcpus[0];
            let seg = v
                .cumulative
                .add_round(&r, &samples, round, AnchorKind::InProcess)
                .unwrap();
            v.segments.push(seg);
        }
        let last = sim.now().0;
        // Events from a second before the first round to a second after the last.
        let hosts: Vec<u64> = (0..400)
            .map(|i| first + (last + 2_000_000_000 - first) / 400 * i)
            .collect();
        let guests: Vec<u64> = hosts
            .iter()
            .map(|&h| clock.guest_at(HostTicks(h)).unwrap().0)
            .collect();
        let sync = crate::syncfile::samples::file(&st.vcpus[0].segments);
        let input: String = guests.iter().map(|g| format!("{g}\n")).collect();
        let mut out = Vec::new();
        convert_with_sync(&sync, 0, &mut input.as_bytes(), &mut out, false).unwrap();
        let converted: Vec<u64> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(converted.len(), guests.len());
        let old = sync.timeline(0).unwrap();
        let (mut apart, mut outside, mut most) = (0, 0, 0);
        for ((&h, &g), &c) in hosts.iter().zip(&guests).zip(&converted) {
            let (host, lo, hi) = st.place(0, g).unwrap();
            assert_eq!(c, host, "guest {g}: convert --sync {c}, record {host}");
            // The truth within the one tick of the guest counter's own rounding.
            assert!(lo <= h + 1 && h <= hi + 1, "{lo} {h} {hi}");
            assert!(lo <= host && host <= hi);
            let line = old.try_host_from_guest_floor(GuestTicks(g)).unwrap().0;
            apart += u32::from(line != host);
            outside += u32::from(!(lo..=hi).contains(&line));
            most = most.max(line.abs_diff(host));
        }
        println!(
            "{} ticks: the segment's line differed from record's point for {apart}, and left \
             record's interval for {outside}; at most {most} ticks apart",
            guests.len()
        );
        assert!(
            apart > 0,
            "the segment's line never differed from the point"
        );
    }
}
