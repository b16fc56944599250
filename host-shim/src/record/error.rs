//! Why `vmtsync record` failed: [`RecordError`] for both front ends, and [`MemoryError`] for
//! the memory front end's own failures, each kept typed so the CLI maps them to the
//! documented exit codes (a nested vCPU 6, not root or no tracefs 3, as elsewhere).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use vmtsync_core::estimate::EstimateError;

use crate::formats::tracedat;
use crate::ftrace::TraceError;
use crate::guestmem::{DrainError, FindError, MemError};
use crate::kvm::debugfs::DebugfsError;
use crate::probe::ProbeError;

use super::launch::LaunchError;

/// Why `vmtsync record` failed.
#[derive(Debug, Error)]
pub enum RecordError {
    /// The session failed (connect, hello, a probe round, a drain).
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// Writing the trace.dat failed.
    #[error(transparent)]
    TraceDat(#[from] tracedat::TraceDatError),
    /// Writing the Perfetto trace failed.
    #[error(transparent)]
    Perfetto(#[from] crate::formats::perfetto::PerfettoError),
    /// Writing the CTF trace failed.
    #[error(transparent)]
    Ctf(#[from] crate::formats::ExportError),
    /// Writing the output failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The agent records no events (its capabilities lack `EVENTS`).
    #[error(
        "the guest agent records no events (its capabilities lack EVENTS): link the vmtsync recorder into it (see vmtsync-core's recorder docs), or boot vmtsync-agent with workload= or events="
    )]
    NoEvents,
    /// No sync round produced a segment, so no event can be placed on the host timeline:
    /// `NoSamples` when every probe was lost, else why the last round's samples were refused.
    #[error(
        "no sync round produced a segment, so no event can be placed on the host timeline: {}",
        crate::probe::refusal_text(*.0)
    )]
    NoSync(EstimateError),
    /// Reading the guest's recorder out of its VMM's memory failed (`--from-memory`).
    #[error("reading the guest's recorder from memory: {0}")]
    Memory(#[from] MemoryError),
    /// Events were read but none could be placed on the host timeline (`--from-memory`):
    /// the output holds none of them.
    #[error(
        "read {read} events from the guest's recorder but could place none on the host \
         timeline, so {} holds no event: {why}",
        out.display()
    )]
    Unplaced {
        /// Events read.
        read: u64,
        /// The output written.
        out: PathBuf,
        /// Why, and what to do.
        why: String,
    },
}

impl RecordError {
    pub(super) fn io(path: &Path) -> impl FnOnce(io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Why the memory front end (`--from-memory`) could not read or place the guest's recorder.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The VMM's memory could not be opened or read (not root: open fails with EACCES).
    #[error(transparent)]
    Mem(#[from] MemError),
    /// The recorder's header could not be found.
    #[error(transparent)]
    Find(#[from] FindError),
    /// The guest did not publish its recorder in time.
    #[error("waited {waited:.1?} for the guest to publish its recorder: {source}")]
    NotPublished {
        /// How long.
        waited: Duration,
        /// What the last look found.
        source: FindError,
    },
    /// Draining the rings failed.
    #[error(transparent)]
    Drain(#[from] DrainError),
    /// The paused VMM could not be resumed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A vCPU's KVM mapping could not be read.
    #[error(transparent)]
    Debugfs(#[from] DebugfsError),
    /// The vCPU runs a nested guest: its mapping is not this VM's own.
    #[error("vCPU {vcpu} runs a nested guest: its debugfs mapping is L0->L2, not this VM's own")]
    Nested {
        /// The vCPU.
        vcpu: u32,
    },
    /// The vCPU's TSC is scaled, which exact placement does not handle.
    #[error(
        "vCPU {vcpu}'s TSC is scaled (ratio {ratio} / 2^{frac_bits}): exact mode here places \
         only guests whose TSC runs at the host's rate"
    )]
    Scaled {
        /// The vCPU.
        vcpu: u32,
        /// KVM's ratio.
        ratio: u64,
        /// Its fraction bits.
        frac_bits: u32,
    },
    /// The beacon port's `kvm_pio` trace could not be started.
    #[error(
        "{}the host's kvm_pio trace of port {port:#x} could not be started: {source}{}",
        if *needed { "beacon placement needs the host's kvm_pio trace, and " } else { "" },
        if *needed {
            " (--trust-raw-tsc places raw-TSC records by KVM's mapping without it)"
        } else {
            ""
        }
    )]
    Trace {
        /// The beacon port.
        port: u16,
        /// Whether the recording cannot place its events without it (beacon mode).
        needed: bool,
        /// Why.
        source: TraceError,
    },
    /// `--beacon-port` names another port than the recorder's header.
    #[error(
        "--beacon-port {armed:#x}, but the recorder at {addr:#x} names {} (give its port, or \
         leave the flag out)",
        if *named == 0 { "no beacon port".to_owned() } else { format!("port {named:#x}") }
    )]
    PortMismatch {
        /// The flag's port.
        armed: u16,
        /// The header's address.
        addr: u64,
        /// The header's port (0: none).
        named: u16,
    },
    /// The header's clock and beacons leave no way to place its records.
    #[error("the recorder at {addr:#x}: {why}")]
    Unplaceable {
        /// The header's address.
        addr: u64,
        /// Why.
        why: Unplaceable,
    },
    /// The guest restarted with a recorder of another clock or beacon port.
    #[error(
        "the guest restarted with a recorder at {addr:#x} of another clock or beacon port: \
         the recording of its earlier boots ends here (record the new boot on its own)"
    )]
    Restarted {
        /// The new header's address.
        addr: u64,
    },
}

/// Why a recorder's header leaves its records unplaceable in the mode asked for.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum Unplaceable {
    /// `--trust-raw-tsc` on records that do not hold the raw TSC.
    #[error(
        "--trust-raw-tsc: the header says its records do not hold the raw TSC (clock 1), so \
         KVM's mapping cannot place them"
    )]
    TrustNotRaw,
    /// Raw-TSC records with no beacons, without `--trust-raw-tsc`.
    #[error(
        "the guest emits no sync beacons (its header names no beacon port), so nothing the \
         host observes checks that its records hold the raw TSC, as the header says: pass \
         --trust-raw-tsc to place them by KVM's exact mapping on the header's word"
    )]
    RawUnchecked,
    /// Neither the raw TSC nor beacons.
    #[error(
        "its records do not hold the raw TSC (clock 1) and it emits no sync beacons: nothing \
         can place them on the host timeline"
    )]
    NoClock,
}

impl MemoryError {
    /// Whether this says the host lacks something the reader needs (root, tracefs, debugfs):
    /// exit code 3, as for every command.
    #[must_use]
    pub fn is_environment(&self) -> bool {
        let denied = |e: &MemError| {
            matches!(e, MemError::Open { source, .. }
                if source.kind() == io::ErrorKind::PermissionDenied)
        };
        match self {
            Self::Mem(e) | Self::Find(FindError::Mem(e)) => denied(e),
            Self::NotPublished {
                source: FindError::Mem(e),
                ..
            } => denied(e),
            Self::Trace { source, .. } => source.is_unavailable(),
            Self::Debugfs(
                DebugfsError::NotMounted { .. }
                | DebugfsError::NoKvmDir { .. }
                | DebugfsError::PermissionDenied { .. },
            ) => true,
            _ => false,
        }
    }
}
