//! The mapping flags `convert` and `trace-cmd attach` share: a fixed KVM mapping, a VM's
//! debugfs entry, or a sync file. Each command adds its own constraints with `mut_arg`.

use std::path::PathBuf;

use clap::Args;
use vmtsync_core::mapping::{KvmTscMapping, MappingError};

use super::source::SourceArgs;
use crate::compose::ComposeError;
use crate::kvm::scan::VmSelector;

/// Where the guest-to-host TSC mapping comes from.
#[derive(Debug, Args)]
pub struct MappingArgs {
    /// The guest's TSC offset, our sign: guest = offset + (host * ratio >> frac) (KVM's
    /// tsc-offset).
    #[arg(
        long,
        value_name = "O",
        allow_negative_numbers = true,
        required_unless_present_any = ["vm", "sync"],
        conflicts_with_all = ["vm", "sync"]
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
    /// Read the mapping from this VM's KVM debugfs entry (PID, PID-FD or name).
    #[arg(long, value_name = "PID|NAME")]
    pub vm: Option<VmSelector>,
    /// The vCPU id (debugfs `vcpuN`, or the sync file's `vcpu`) whose mapping to use.
    #[arg(long, value_name = "N")]
    pub vcpu: Option<u32>,
    /// A sync file written by `vmtsync probe --continuous --out FILE` (or `vmtsync record`):
    /// its segments for --vcpu, one per probe round.
    #[arg(
        long,
        value_name = "SYNCFILE",
        requires = "vcpu",
        conflicts_with_all = ["offset", "vm"]
    )]
    pub sync: Option<PathBuf>,
    /// Accept vCPUs in guest mode: their debugfs values are then the L0->L2 mapping, and the
    /// timestamps must be L2's.
    #[arg(long, requires = "vm")]
    pub nested_l2: bool,
    /// Debugfs and /proc locations (with --vm).
    #[command(flatten)]
    pub source: SourceArgs,
}

impl MappingArgs {
    /// The mapping `--offset` (with `--ratio`/`--frac-bits`) gives, if it was given.
    ///
    /// # Errors
    /// A ratio of 0 or more than 63 fraction bits (clap's ranges refuse both first).
    pub fn fixed(&self) -> Result<Option<KvmTscMapping>, ComposeError> {
        let Some(offset) = self.offset else {
            return Ok(None);
        };
        match (self.ratio, self.frac_bits) {
            (Some(r), Some(f)) => {
                KvmTscMapping::try_new(offset, r, f)
                    .map(Some)
                    .map_err(|e| ComposeError::Field {
                        field: "--ratio/--frac-bits",
                        value: format!("{r}/{f}"),
                        why: if matches!(e, MappingError::ZeroRatio) {
                            "the ratio must be non-zero"
                        } else {
                            "frac bits must be at most 63"
                        },
                    })
            }
            _ => Ok(Some(KvmTscMapping::offset_only(offset))),
        }
    }
}
