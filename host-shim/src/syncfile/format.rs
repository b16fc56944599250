//! The schema-1 line shapes: the header, a segment, and their `"type"` tags, with the
//! vocabulary a segment is written in ([`AnchorKind`], [`OffsetModel`]) that the probe, record
//! and validate share.

use serde::{Deserialize, Serialize};
use vmtsync_core::timeline::Segment;
use vmtsync_core::{GuestTicks, HostTicks};

/// Which stamps a probe's bracket came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnchorKind {
    /// `lfence; rdtsc` in this process around the system calls (or a test VMM's own stamps).
    #[default]
    InProcess,
    /// `kvm:kvm_pio` exits of the UART data port (request delimiter `in`, first reply `out`).
    KvmPioUart,
    /// `kvm:kvm_pio` exits of the agent's sync port (`in` before, `out` of the seq after the
    /// TSC read).
    KvmPioSyncPort,
    /// `kvm:kvm_pio` exits of a guest's sync beacons read from its memory (`in` before,
    /// `out` of the seq after the clock read; docs/memory-reader.md).
    KvmPioBeacon,
    /// A kind this version does not know (a sync file from a newer writer stays readable).
    #[serde(other)]
    Unknown,
}

impl AnchorKind {
    /// The name used in reports and sync files.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::InProcess => "in-process",
            Self::KvmPioUart => "kvm-pio-uart",
            Self::KvmPioSyncPort => "kvm-pio-sync-port",
            Self::KvmPioBeacon => "kvm-pio-beacon",
            Self::Unknown => "unknown",
        }
    }
}

/// Which model the guaranteed offset bounds come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffsetModel {
    /// One constant offset at exactly identity rate. Only in sync files written before
    /// probe schema 2: such bounds miss the truth under drift, and nothing writes them now.
    Offset,
    /// Any constant rate within the limits that fits every sample (convex-hull bounds).
    Drift,
}

/// The sync file schema this crate writes and reads.
pub const SYNC_SCHEMA: u32 = 1;

/// The first line of a sync file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncHeader {
    /// Always [`SYNC_SCHEMA`] for files this crate writes.
    pub schema: u32,
    /// The writer, e.g. `vmtsync 0.1.0`.
    pub tool: String,
    /// The host clock the `host_*` values are in (`x86-tsc`).
    pub host_clock: String,
    /// When the file was created (seconds since the Unix epoch).
    pub created_unix_s: u64,
    /// Where the samples came from (the `--connect` address).
    #[serde(default)]
    pub source: String,
}

impl SyncHeader {
    /// The header this crate writes for samples from `source`, created now.
    #[must_use]
    pub fn now(source: String) -> Self {
        Self {
            schema: SYNC_SCHEMA,
            tool: format!("vmtsync {}", env!("CARGO_PKG_VERSION")),
            host_clock: "x86-tsc".to_owned(),
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            source,
        }
    }
}

/// One re-sync round of one vCPU (see the module docs for every field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncSegment {
    /// The vCPU.
    pub vcpu: u32,
    /// Round number within the run.
    pub round: u64,
    /// First guest tick this segment applies to.
    pub guest_start: u64,
    /// Host tick of the anchor.
    pub host_anchor: u64,
    /// Guest tick of the anchor (`host_anchor + offset`).
    pub guest_anchor: u64,
    /// Offset at the anchor, centre of the bounds.
    pub offset: i64,
    /// Guaranteed lower bound of the offset at the anchor.
    pub offset_lo: i64,
    /// Guaranteed upper bound of the offset at the anchor.
    pub offset_hi: i64,
    /// The drift used for conversion, ppb.
    pub drift_ppb: i64,
    /// Guaranteed lower drift bound, ppb, if bounded.
    pub drift_ppb_lo: Option<i64>,
    /// Guaranteed upper drift bound, ppb, if bounded.
    pub drift_ppb_hi: Option<i64>,
    /// Which model the bounds come from.
    pub model: OffsetModel,
    /// Samples in the round.
    pub probes: u32,
    /// Fastest round trip of the round, host ticks.
    pub rtt_min_ticks: u64,
    /// Host TSC of the round's first send.
    pub host_first: u64,
    /// Host TSC of the round's last receive.
    pub host_last: u64,
    /// A new estimate starts here (the previous rounds' relation no longer fits).
    #[serde(rename = "break")]
    pub is_break: bool,
    /// Where the round's host brackets came from (docs/anchor.md); files written before this
    /// field existed read as `in-process`, which is what they used.
    #[serde(default)]
    pub anchor: AnchorKind,
}

impl SyncSegment {
    /// This segment as a `vmtsync_core::timeline` segment: the line through
    /// `(guest_anchor, host_anchor)` with `1e9 / (1e9 + drift_ppb)` host ticks per guest tick,
    /// used from `guest_start` on. A zero drift is an exact offset; otherwise the slope is
    /// rounded down by less than 2^-62 relative ([`vmtsync_core::timeline::Slope::try_from_ratio_floor`]), so a
    /// result is at most one tick below the exact floor for host values below 2^62.
    ///
    /// `None` if the rate is not positive or `guest_start` maps outside the host range.
    #[must_use]
    pub fn to_timeline_segment(&self) -> Option<Segment> {
        let start = GuestTicks(self.guest_start);
        if self.drift_ppb == 0 {
            return Segment::try_offset(start, self.offset.checked_neg()?);
        }
        let den = u64::try_from(1_000_000_000_i64.checked_add(self.drift_ppb)?).ok()?;
        Segment::try_from_anchor_ratio(
            start,
            GuestTicks(self.guest_anchor),
            HostTicks(self.host_anchor),
            1_000_000_000,
            den,
        )
    }
}

/// The on-disk line shapes, tagged by `"type"`.
#[derive(Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub(super) enum Tagged {
    Header(SyncHeader),
    Segment(SyncSegment),
}

#[cfg(test)]
pub(crate) mod samples {
    //! A header, segments and files for the tests of this wing and the sync wing.

    use super::*;

    pub(crate) fn header() -> SyncHeader {
        SyncHeader {
            schema: SYNC_SCHEMA,
            tool: "vmtsync test".into(),
            host_clock: "x86-tsc".into(),
            created_unix_s: 1_796_000_000,
            source: "tcp:127.0.0.1:1".into(),
        }
    }

    pub(crate) fn seg(
        vcpu: u32,
        round: u64,
        host_anchor: u64,
        offset: i64,
        drift_ppb: i64,
    ) -> SyncSegment {
        let guest_anchor = host_anchor.checked_add_signed(offset).unwrap();
        SyncSegment {
            vcpu,
            round,
            guest_start: guest_anchor - 1000,
            host_anchor,
            guest_anchor,
            offset,
            offset_lo: offset - 10,
            offset_hi: offset + 10,
            drift_ppb,
            drift_ppb_lo: Some(drift_ppb - 5),
            drift_ppb_hi: None,
            model: OffsetModel::Drift,
            probes: 64,
            rtt_min_ticks: 3000,
            host_first: host_anchor - 1000,
            host_last: host_anchor + 1000,
            is_break: round == 0,
            anchor: AnchorKind::InProcess,
        }
    }

    /// A file of `segs` (lines numbered from 2, after the header).
    pub(crate) fn file(segs: &[SyncSegment]) -> crate::syncfile::SyncFile {
        crate::syncfile::SyncFile {
            header: header(),
            segments: segs.to_vec(),
            lines: (2..).take(segs.len()).collect(),
            cut: None,
        }
    }
}
