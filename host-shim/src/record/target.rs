//! What a recording writes and when it stops ([`OutputOptions`], the same for both front ends),
//! what the output stage writes ([`Target`]), and the host TSC's TSC2NSEC every trace.dat of a
//! recording carries: shared by the writers of `write.rs` and the streams of `stream.rs`.

use std::path::PathBuf;
use std::time::Duration;

use super::{RecordFormat, RecordOptions};
use crate::formats::tracedat::{self, FileVersion};

/// The output and stop options both front ends take (`--out`, `--format`, `--file-version`,
/// `--events`, `--duration-s`, `--sync-out`): a part of [`RecordOptions`] and of
/// [`super::MemoryOptions`].
#[derive(Clone, Debug)]
pub struct OutputOptions {
    /// The output file.
    pub out: PathBuf,
    /// Its format.
    pub format: RecordFormat,
    /// trace.dat version.
    pub file_version: FileVersion,
    /// Stop after this many events.
    pub events: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// A sync file for the segments the events were placed by (`--sync-out`), so the
    /// conversion the output used can be checked (`vmtsync validate`) or drawn (`plot`): the
    /// protocol front end appends each round's segment as it is made, the memory front end
    /// writes its segments when it ends (see `memory/mode.rs`).
    pub sync_out: Option<PathBuf>,
}

/// What the output stage writes, whichever front end fed it.
#[derive(Clone, Debug)]
pub(super) struct Target {
    /// The output file (or CTF directory).
    pub(super) out: PathBuf,
    /// Its format.
    pub(super) format: RecordFormat,
    /// trace.dat version.
    pub(super) file_version: FileVersion,
    /// Where the events came from, as the outputs name it (the agent's address, or the VMM
    /// whose memory was read); it also seeds the trace.dat TRACEID.
    pub(super) source: String,
    /// How span records are named (symbols, relocations) in the outputs that show spans.
    pub(super) spans: crate::spans::SpanConfig,
}

impl Target {
    /// The protocol front end's target: named after the agent's address.
    pub(super) fn of(opts: &RecordOptions) -> Self {
        Self {
            out: opts.output.out.clone(),
            format: opts.output.format,
            file_version: opts.output.file_version,
            source: opts.probe.addr.to_string(),
            spans: opts.spans.clone(),
        }
    }

    /// A test's target: `out` in `format` (trace.dat v7), source "test", no span names.
    #[cfg(test)]
    pub(super) fn test(out: &std::path::Path, format: RecordFormat) -> Self {
        Self {
            out: out.to_path_buf(),
            format,
            file_version: FileVersion::V7,
            source: "test".into(),
            spans: crate::spans::SpanConfig::default(),
        }
    }
}

/// The TSC2NSEC option of the host's TSC frequency ([`crate::formats::ctf::host_tsc_hz`]):
/// written into the guest trace.dat and into the host trace's copy, so trace-cmd shows both
/// in seconds on the host's clock (docs/record.md). Read once per process, so both files of a
/// recording carry the same values; `None` when the frequency is unknown (ticks then).
pub fn host_tsc2nsec() -> Option<tracedat::Tsc2Nsec> {
    static T: std::sync::OnceLock<Option<tracedat::Tsc2Nsec>> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        crate::formats::ctf::host_tsc_hz()
            .ok()
            .and_then(tracedat::Tsc2Nsec::for_hz)
    })
}
