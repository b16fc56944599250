//! `vmtsync convert`: TSC values on stdin through a given, debugfs or sync-file mapping.

use std::io::{self, BufReader, BufWriter, Write};

use clap::Args;
use vmtsync_core::mapping::KvmTscMapping;

use super::exit::CliError;
use super::mapping::MappingArgs;
use super::source::{find_vcpu, not_nested, single_vm, vm_name};
use crate::exact_convert::{self, ConvertOptions, Direction, Rounding};
use crate::syncfile::SyncFile;

/// `vmtsync convert`.
#[derive(Debug, Args)]
#[command(
    mut_arg("vm", |a| a.requires("vcpu")),
    mut_arg("vcpu", |a| a.conflicts_with("offset")),
    mut_arg("sync", |a| a.conflicts_with_all(["to", "round", "nested_l2"])),
)]
pub struct ConvertArgs {
    /// The mapping: --offset, --vm with --vcpu, or --sync with --vcpu (which places guest
    /// TSC values on the host TSC as `record` places its events: `crate::sync::convert`).
    #[command(flatten)]
    pub mapping: MappingArgs,
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
fn convert_mapping(a: &MappingArgs) -> Result<KvmTscMapping, CliError> {
    if let Some(m) = a.fixed()? {
        return Ok(m);
    }
    let (Some(sel), Some(vcpu)) = (a.vm.as_ref(), a.vcpu) else {
        // clap enforces one of the two forms.
        return Err(CliError::Output(io::Error::other(
            "give --offset or --vm with --vcpu",
        )));
    };
    let vm = &single_vm(&a.source, sel)?;
    let vm_name = vm_name(vm);
    let v = not_nested(vm, find_vcpu(vm, vcpu)?, a.nested_l2)?;
    // The debugfs parser already rejected ratio 0 and frac bits above 63.
    v.mapping()
        .map_err(|e| CliError::Output(io::Error::other(format!("VM {vm_name} vcpu{vcpu}: {e}"))))
}

pub(super) fn run_convert(a: &ConvertArgs) -> Result<(), CliError> {
    if let (Some(path), Some(vcpu)) = (a.mapping.sync.as_deref(), a.mapping.vcpu) {
        let stdin = io::stdin();
        let mut input = BufReader::with_capacity(64 * 1024, stdin.lock());
        let mut output = BufWriter::with_capacity(64 * 1024, io::stdout().lock());
        // A file being written (or left by a killed writer) may end in an incomplete line: the
        // reader cuts it, and the user hears how much was cut.
        let sync = SyncFile::read(path)?;
        if let Some(cut) = sync.cut {
            eprintln!("vmtsync: warning: {}: {cut}", path.display());
        }
        let stats =
            crate::sync::convert_with_sync(&sync, vcpu, &mut input, &mut output, a.skip_bad)?;
        if stats.skipped > 0 {
            eprintln!(
                "vmtsync: converted {} values, skipped {} bad lines",
                stats.converted, stats.skipped
            );
        }
        return Ok(());
    }
    let mapping = convert_mapping(&a.mapping)?;
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
