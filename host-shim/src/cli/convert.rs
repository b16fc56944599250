//! `vmtsync convert`: TSC values on stdin through a given, debugfs or sync-file mapping.

use std::io::{self, BufReader, BufWriter, Write};
use std::path::PathBuf;

use clap::Args;
use vmtsync_core::mapping::KvmTscMapping;

use super::exit::CliError;
use super::source::{SourceArgs, single_vm};
use crate::compose::ComposeError;
use crate::exact_convert::{self, ConvertOptions, Direction, Rounding};
use crate::kvm::scan::VmSelector;
use crate::syncfile::{self, SyncFile};

/// `vmtsync convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The vCPU's TSC offset (guest = offset + host * ratio >> frac).
    #[arg(
        long,
        value_name = "O",
        allow_negative_numbers = true,
        required_unless_present_any = ["vm", "sync"],
        conflicts_with = "vm"
    )]
    pub offset: Option<i64>,
    /// The scaling ratio (default: none, i.e. identity).
    #[arg(long, value_name = "R", requires = "offset", requires = "frac_bits",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub ratio: Option<u64>,
    /// Fraction bits of the ratio (48 on Intel, 32 on AMD).
    #[arg(long, value_name = "F", requires = "ratio",
          value_parser = clap::value_parser!(u32).range(0..64))]
    pub frac_bits: Option<u32>,
    /// Read the mapping from this VM's debugfs entry (PID, PID-FD or name).
    #[arg(long, value_name = "PID|NAME", requires = "vcpu")]
    pub vm: Option<VmSelector>,
    /// The vCPU id (debugfs `vcpuN`, or the sync file's `vcpu`) whose mapping to use.
    #[arg(long, value_name = "N", conflicts_with = "offset")]
    pub vcpu: Option<u32>,
    /// Convert guest TSC values to host TSC (rounded down) through a sync file written by
    /// `vmtsync probe --continuous --out FILE`: piecewise, one segment per probe round.
    #[arg(long, value_name = "SYNCFILE", requires = "vcpu",
          conflicts_with_all = ["offset", "vm", "to", "round", "nested_l2"])]
    pub sync: Option<PathBuf>,
    /// Accept a vCPU in guest mode: its debugfs values are then the L0->L2 mapping, and the
    /// input must be L2 timestamps.
    #[arg(long, requires = "vm")]
    pub nested_l2: bool,
    /// Debugfs and /proc locations (with --vm).
    #[command(flatten)]
    pub source: SourceArgs,
    /// Output clock: `host` (input is guest TSC) or `guest` (input is host TSC).
    #[arg(long, value_enum, default_value_t = Direction::Host)]
    pub to: Direction,
    /// Rounding of guest->host when the guest clock is faster than the host's.
    #[arg(long, value_enum, default_value_t = Rounding::Ceil)]
    pub round: Rounding,
    /// Report bad lines on stderr and keep going (exit 0) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad: bool,
}

/// Resolves the mapping `convert` uses, from flags or from debugfs.
fn convert_mapping(a: &ConvertArgs) -> Result<KvmTscMapping, CliError> {
    if let Some(offset) = a.offset {
        return match (a.ratio, a.frac_bits) {
            (Some(r), Some(f)) => KvmTscMapping::try_new(offset, r, f).map_err(|e| {
                ComposeError::Field {
                    field: "--ratio/--frac-bits",
                    value: format!("{r}/{f}"),
                    why: if matches!(e, vmtsync_core::mapping::MappingError::ZeroRatio) {
                        "the ratio must be non-zero"
                    } else {
                        "frac bits must be at most 63"
                    },
                }
                .into()
            }),
            _ => Ok(KvmTscMapping::offset_only(offset)),
        };
    }
    let (Some(sel), Some(vcpu)) = (a.vm.as_ref(), a.vcpu) else {
        // clap enforces one of the two forms.
        return Err(CliError::Output(io::Error::other(
            "give --offset or --vm with --vcpu",
        )));
    };
    let vm = &single_vm(&a.source, sel)?;
    let vm_name = format!("{}-{}", vm.pid, vm.fd);
    let Some(v) = vm.vcpus.iter().find(|v| v.vcpu == vcpu) else {
        return Err(CliError::NoVcpu {
            vm: vm_name,
            vcpu,
            available: vm
                .vcpus
                .iter()
                .map(|v| format!("vcpu{}", v.vcpu))
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    if v.guest_mode == Some(true) && !a.nested_l2 {
        return Err(CliError::Nested { vm: vm_name, vcpu });
    }
    // The debugfs parser already rejected ratio 0 and frac bits above 63.
    KvmTscMapping::try_new(v.tsc_offset, v.tsc_scaling_ratio, v.tsc_frac_bits)
        .map_err(|e| CliError::Output(io::Error::other(format!("VM {vm_name} vcpu{vcpu}: {e}"))))
}

pub(super) fn run_convert(a: &ConvertArgs) -> Result<(), CliError> {
    if let (Some(path), Some(vcpu)) = (a.sync.as_deref(), a.vcpu) {
        let stdin = io::stdin();
        let mut input = BufReader::with_capacity(64 * 1024, stdin.lock());
        let mut output = BufWriter::with_capacity(64 * 1024, io::stdout().lock());
        // A file being written (or left by a killed writer) may end in an incomplete line: the
        // reader cuts it, and the user hears how much was cut.
        let sync = SyncFile::read(path)?;
        if let Some(cut) = sync.cut {
            eprintln!("vmtsync: warning: {}: {cut}", path.display());
        }
        let stats = syncfile::convert_with_sync(&sync, vcpu, &mut input, &mut output, a.skip_bad)?;
        if stats.skipped > 0 {
            eprintln!(
                "vmtsync: converted {} values, skipped {} bad lines",
                stats.converted, stats.skipped
            );
        }
        return Ok(());
    }
    let mapping = convert_mapping(a)?;
    let opts = ConvertOptions {
        mapping,
        to: a.to,
        rounding: a.round,
        skip_bad: a.skip_bad,
    };
    let stdin = io::stdin();
    let mut input = BufReader::with_capacity(64 * 1024, stdin.lock());
    let mut output = BufWriter::with_capacity(64 * 1024, io::stdout().lock());
    let mut warn = io::stderr().lock();
    let stats = exact_convert::convert_stream(&mut input, &mut output, &mut warn, &opts)?;
    if stats.skipped > 0 {
        writeln!(
            warn,
            "vmtsync: converted {} values, skipped {} bad lines",
            stats.converted, stats.skipped
        )?;
    }
    Ok(())
}
