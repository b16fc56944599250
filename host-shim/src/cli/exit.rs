//! The error every command reports, and its mapping to the documented exit codes.

use std::io;

use thiserror::Error;
use vmtsync_core::estimate::EstimateError;

use super::signals::stop_signal;
use crate::compose::ComposeError;
use crate::exact_convert::ConvertError;
use crate::ftrace::TraceError;
use crate::kvm::debugfs::{DEBUGFS_MOUNTPOINT, DebugfsError};
use crate::kvm::scan::ScanError;
use crate::kvm::watch::WatchError;
use crate::link::ConnectError;
use crate::probe::ProbeError;
use crate::syncfile::SyncFileError;

/// The exit codes, for `--help` (also in the [module docs](crate::cli)).
pub(super) const EXIT_CODES: &str = "\
Exit codes:
  0  success (also when stdout is a closed pipe)
  1  runtime error (I/O, malformed debugfs contents, VM exited while being read)
  2  bad command-line usage
  3  environment: debugfs not mounted, not root, no tracefs
  4  no VM or vCPU matches --vm / --vcpu (convert --sync: no segment for --vcpu;
     plot: no segment at all)
  5  bad input data (convert: bad line, value out of range or malformed sync file
     (also plot); compose: cannot compose; trace-cmd attach: malformed or truncated
     trace.dat; export: a malformed or unsupported recording; validate: inputs it cannot
     use)
  6  refused: the vCPU runs a nested guest (guest_mode=1) and --nested-l2 was not given;
     trace-cmd attach: the TIME_SHIFT would be off by more than --max-error ticks;
     export perf: perf cannot express the mapping
  7  probe: the guest agent could not be reached or stopped answering (VM gone, agent
     restarted, protocol version mismatch)
  8  probe --anchor kvm-pio: exit anchoring is not possible here (no tracefs or kvm_pio,
     not root, VM not found in debugfs, not a serial chardev) or no probe's exits were found
  9  validate: at least one event converted to the wrong side of its exit
  10 record --from-memory: events were read but none could be placed on the host
     timeline (no bracketed beacon, and KVM's mapping cannot place them)
  130  probe: interrupted by SIGINT (143: by SIGTERM) before it measured anything; in
     continuous mode a signal instead ends the run after the current round";

/// Every error the command line reports, with its exit code.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CliError {
    /// From `kvm` scans.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// From watch mode.
    #[error(transparent)]
    Watch(#[from] WatchError),
    /// From `convert`.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// From `tsc compose`.
    #[error(transparent)]
    Compose(#[from] ComposeError),
    /// From `probe`.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// From `record`.
    #[error(transparent)]
    Record(#[from] crate::record::RecordError),
    /// From `export perfetto` (and `record --format perfetto`'s writer).
    #[error(transparent)]
    Perfetto(#[from] crate::formats::perfetto::PerfettoError),
    /// From `export`.
    #[error(transparent)]
    Export(#[from] crate::formats::ExportError),
    /// Bad flag values clap cannot check.
    #[error("{0}")]
    Usage(String),
    /// From `convert --sync`.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
    /// From `validate`: the inputs could not be checked.
    #[error(transparent)]
    Validate(#[from] crate::validate::ValidateError),
    /// From `validate`: the check ran and found violations.
    #[error("{0} events converted to the wrong side of their exits (see the report above)")]
    Violations(u64),
    /// From `plot`.
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
    /// `--symbols`: the image cannot be read or is not ELF.
    #[error("--symbols {}: {source}", path.display())]
    Symbols {
        /// The image.
        path: std::path::PathBuf,
        /// Why.
        source: crate::guestmem::elf::ElfError,
    },
    /// `--vcpu` names no vCPU of the VM.
    #[error("VM {vm} has no vcpu{vcpu}; its vCPUs are: {available}")]
    NoVcpu {
        /// The VM (`pid-fd`).
        vm: String,
        /// The requested id.
        vcpu: u32,
        /// The ids that exist.
        available: String,
    },
    /// `--vm` matched several VMs where one is needed.
    #[error("--vm {selector} matches {count} VMs ({list}): give one as PID-FD")]
    Ambiguous {
        /// The selector.
        selector: String,
        /// How many matched.
        count: usize,
        /// Their `pid-fd`.
        list: String,
    },
    /// The vCPU runs a nested guest.
    #[error(
        "VM {vm} vcpu{vcpu} is running a nested guest (guest_mode=1): debugfs holds the combined L0->L2 mapping, not this VM's; pass --nested-l2 if the input is L2 timestamps, or retry when the vCPU is back in L1"
    )]
    Nested {
        /// The VM (`pid-fd`).
        vm: String,
        /// The vCPU id.
        vcpu: u32,
    },
    /// `--mount-debugfs` without root.
    #[error("--mount-debugfs needs root (run as root, e.g. with sudo)")]
    NotRoot,
    /// The mount call failed.
    #[error("mount -t debugfs none {DEBUGFS_MOUNTPOINT} failed: {0}")]
    Mount(io::Error),
    /// Writing output.
    #[error("writing output: {0}")]
    Output(#[from] io::Error),
    /// From `trace-cmd attach` (reading or writing a trace.dat).
    #[error(transparent)]
    TraceDat(#[from] crate::formats::tracedat::TraceDatError),
    /// `trace-cmd attach`: trace-cmd's 64-bit TIME_SHIFT arithmetic would be too coarse.
    #[error(
        "guest CPU {cpu}: trace-cmd's 64-bit TIME_SHIFT arithmetic would be off by up to {bound} ticks for this trace's events (limit {limit}): pass --max-error {bound} to accept that, or pre-convert the timestamps"
    )]
    ShiftTooCoarse {
        /// The guest CPU.
        cpu: usize,
        /// The worst-case error in ticks.
        bound: u64,
        /// The accepted limit.
        limit: u64,
    },
    /// `export perf`: perf's arguments cannot express the mapping (the explanation says why
    /// and what error the closest ones would make).
    #[error("{0}")]
    NotExpressible(String),
}

impl CliError {
    /// The process exit code for this error (see the module docs).
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        let debugfs = |e: &DebugfsError| match e {
            DebugfsError::NotMounted { .. }
            | DebugfsError::NoKvmDir { .. }
            | DebugfsError::PermissionDenied { .. } => 3,
            _ => 1,
        };
        let scan = |e: &ScanError| match e {
            ScanError::Debugfs(d) => debugfs(d),
            ScanError::NoMatch { .. } => 4,
        };
        match self {
            Self::Scan(e) | Self::Watch(WatchError::Scan(e)) => scan(e),
            Self::Watch(WatchError::Trace(TraceError::NoTracefs { .. })) => 3,
            Self::Watch(_) | Self::Output(_) => 1,
            Self::Convert(ConvertError::Io(_)) => 1,
            Self::Convert(_) | Self::Compose(_) => 5,
            Self::NoVcpu { .. } | Self::Ambiguous { .. } => 4,
            Self::Nested { .. } => 6,
            Self::NotRoot | Self::Mount(_) => 3,
            Self::Probe(e) => probe_exit_code(e),
            Self::Record(crate::record::RecordError::Probe(e)) => probe_exit_code(e),
            // Every probe lost: the agent stopped answering (7); samples that contradict each
            // other are a runtime error (1).
            Self::Record(
                crate::record::RecordError::NoSync(EstimateError::NoSamples)
                | crate::record::RecordError::NoEvents,
            ) => 7,
            Self::Record(crate::record::RecordError::Unplaced { .. }) => 10,
            Self::Record(_) => 1,
            Self::Perfetto(e) => perfetto_exit_code(e),
            Self::Usage(_) => 2,
            Self::Export(
                crate::formats::ExportError::Io { .. }
                | crate::formats::ExportError::Write { .. }
                | crate::formats::ExportError::TraceDat(
                    crate::formats::tracedat::TraceDatError::Io { .. },
                ),
            ) => 1,
            Self::Export(_) => 5,
            Self::SyncFile(e) => sync_exit_code(e),
            Self::Plot(crate::plot::PlotError::SyncFile(e)) => sync_exit_code(e),
            Self::Plot(crate::plot::PlotError::Empty) => 4,
            Self::Plot(_) => 1,
            Self::Symbols {
                source: crate::guestmem::elf::ElfError::Read { .. },
                ..
            } => 1,
            Self::Symbols { .. } => 5,
            Self::Validate(crate::validate::ValidateError::SyncFile(e)) => sync_exit_code(e),
            Self::Validate(crate::validate::ValidateError::TraceDat(
                crate::formats::tracedat::TraceDatError::Io { .. },
            )) => 1,
            Self::Validate(crate::validate::ValidateError::Threads { .. }) => 2,
            Self::Validate(_) => 5,
            Self::Violations(_) => 9,
            Self::TraceDat(e) => trace_dat_exit_code(e),
            Self::ShiftTooCoarse { .. } | Self::NotExpressible(_) => 6,
        }
    }

    /// True if this is a write to a closed pipe, which is not an error for a filter.
    #[must_use]
    pub fn is_broken_pipe(&self) -> bool {
        let io = match self {
            Self::Probe(e) => return e.is_broken_pipe(),
            Self::SyncFile(e) => return e.is_broken_pipe(),
            Self::Output(e)
            | Self::Convert(ConvertError::Io(e))
            | Self::Watch(WatchError::Output(e)) => e,
            _ => return false,
        };
        io.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Exit code of a `probe` failure: 7 when the agent is unreachable or stopped answering,
/// 3 when vsock is unsupported here, 5 for a sync file that cannot be appended to, else 1.
fn probe_exit_code(e: &ProbeError) -> u8 {
    match e {
        // The shell convention for death by a signal: 128 + its number.
        ProbeError::Interrupted | ProbeError::Connect(ConnectError::Interrupted(_)) => {
            128 + u8::try_from(stop_signal()).unwrap_or(2)
        }
        ProbeError::Connect(ConnectError::Unsupported) => 3,
        ProbeError::Connect(_)
        | ProbeError::Timeout { .. }
        | ProbeError::Transport { .. }
        | ProbeError::VersionMismatch { .. }
        | ProbeError::AgentNotReady
        | ProbeError::AgentExited => 7,
        ProbeError::SyncFile(s) => sync_exit_code(s),
        ProbeError::Anchor(_) => 8,
        _ => 1,
    }
}

/// Exit code of a Perfetto export failure: 5 for input that cannot be read or mapped (a
/// malformed recording, one from another boot), else 1.
fn perfetto_exit_code(e: &crate::formats::perfetto::PerfettoError) -> u8 {
    use crate::formats::ExportError;
    use crate::formats::perfetto::PerfettoError;
    match e {
        PerfettoError::Input(ExportError::Io { .. } | ExportError::Write { .. })
        | PerfettoError::Io { .. }
        | PerfettoError::Clock(_) => 1,
        PerfettoError::Input(_)
        | PerfettoError::NotThisBoot { .. }
        | PerfettoError::TooManyVcpus { .. } => 5,
        PerfettoError::HostMachineId => 2,
    }
}

/// Exit code of a trace.dat failure: 1 for I/O and a copy that does not verify, 6 for a
/// TIME_SHIFT above the error limit, else 5 (a malformed, truncated or unsupported input, a
/// mapping TIME_SHIFT cannot hold).
fn trace_dat_exit_code(e: &crate::formats::tracedat::TraceDatError) -> u8 {
    use crate::formats::tracedat::{TimeShiftError, TraceDatError};
    match e {
        TraceDatError::Io { .. } | TraceDatError::Verify { .. } => 1,
        TraceDatError::TimeShift(TimeShiftError::AboveLimit { .. }) => 6,
        _ => 5,
    }
}

/// Exit code of a sync-file failure: 4 for a vCPU without segments, 1 for I/O, else 5.
fn sync_exit_code(e: &SyncFileError) -> u8 {
    match e {
        SyncFileError::NoSegments { .. } => 4,
        SyncFileError::Io { .. } | SyncFileError::Output(_) => 1,
        _ => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        let nm = CliError::Scan(ScanError::Debugfs(DebugfsError::NotMounted {
            root: "/x".into(),
        }));
        assert_eq!(nm.exit_code(), 3);
        let nomatch = CliError::Scan(ScanError::NoMatch {
            selector: "a".into(),
            available: "none".into(),
        });
        assert_eq!(nomatch.exit_code(), 4);
        assert_eq!(
            CliError::Nested {
                vm: "1-2".into(),
                vcpu: 0
            }
            .exit_code(),
            6
        );
        let bp = CliError::Output(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(bp.is_broken_pipe());
        assert!(!nm.is_broken_pipe());
        let gone = CliError::Probe(ProbeError::Transport {
            what: "a probe reply",
            source: crate::link::TransportError::Closed,
        });
        assert_eq!(gone.exit_code(), 7);
        assert!(!gone.is_broken_pipe());
        // No signal has arrived in this test process: SIGINT's 128 + 2.
        assert_eq!(CliError::Probe(ProbeError::Interrupted).exit_code(), 130);
        assert_eq!(
            CliError::Probe(ProbeError::Connect(ConnectError::Interrupted("x".into()))).exit_code(),
            130
        );
        let probe_pipe = CliError::Probe(ProbeError::Output(io::Error::from(
            io::ErrorKind::BrokenPipe,
        )));
        assert!(probe_pipe.is_broken_pipe());
        let no_seg = CliError::SyncFile(SyncFileError::NoSegments {
            vcpu: 3,
            present: vec![0],
        });
        assert_eq!(no_seg.exit_code(), 4);
        assert_eq!(CliError::SyncFile(SyncFileError::NoHeader).exit_code(), 5);
        let sync_pipe = CliError::SyncFile(SyncFileError::Output(io::Error::from(
            io::ErrorKind::BrokenPipe,
        )));
        assert!(sync_pipe.is_broken_pipe());
        assert_eq!(CliError::Violations(3).exit_code(), 9);
        assert_eq!(
            CliError::Validate(crate::validate::ValidateError::NoKvmPio("h".into())).exit_code(),
            5
        );
        assert_eq!(CliError::Plot(crate::plot::PlotError::Empty).exit_code(), 4);
        // A recording that never synced: 7 only when every probe was lost, and the message
        // says "lost" only then.
        let lost = CliError::Record(crate::record::RecordError::NoSync(EstimateError::NoSamples));
        let contradict = CliError::Record(crate::record::RecordError::NoSync(
            EstimateError::SegmentBreak,
        ));
        assert_eq!((lost.exit_code(), contradict.exit_code()), (7, 1));
        assert!(
            lost.to_string()
                .contains("every probe of the round was lost")
        );
        assert!(
            !contradict.to_string().contains("every probe"),
            "{contradict}"
        );
        assert!(
            contradict.to_string().contains("contradict"),
            "{contradict}"
        );
    }
}
