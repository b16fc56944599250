//! `vmtsync tsc …`: TSC mapping arithmetic (`tsc compose`).

use std::io::{self, Write};

use clap::{Args, Subcommand};

use super::exit::{CliError, EXIT_CODES};
use crate::compose::{self, MappingArg};

/// `vmtsync tsc …`.
#[derive(Debug, Subcommand)]
pub enum TscCommand {
    /// Compose the L0->L1 and L1->L2 mappings into the nested L0->L2 one, as KVM does.
    ///
    /// offset_02 = trunc(offset_01 * ratio_12 / 2^frac) + offset_12 (mod 2^64),
    /// ratio_02 = floor(ratio_01 * ratio_12 / 2^frac) (kvm_calc_nested_tsc_offset /
    /// _multiplier). Both levels must use the same frac bits, except that a level that does
    /// not scale (ratio 1<<frac, e.g. 1,0 from a host without TSC scaling) takes the other's.
    #[command(after_help = EXIT_CODES)]
    Compose(ComposeArgs),
}

/// `vmtsync tsc compose`.
#[derive(Debug, Args)]
pub struct ComposeArgs {
    /// The L0->L1 mapping as OFFSET,RATIO,FRAC (e.g. -1000,281474976710656,48).
    #[arg(long, value_name = "OFFSET,RATIO,FRAC", allow_hyphen_values = true)]
    pub l1: MappingArg,
    /// The L1->L2 mapping as OFFSET,RATIO,FRAC.
    #[arg(long, value_name = "OFFSET,RATIO,FRAC", allow_hyphen_values = true)]
    pub l2: MappingArg,
    /// Print {"schema":1,"tsc_offset","tsc_scaling_ratio","tsc_frac_bits"}.
    #[arg(long)]
    pub json: bool,
}

/// Runs a `vmtsync tsc` subcommand.
pub(super) fn run_tsc(c: &TscCommand) -> Result<(), CliError> {
    match c {
        TscCommand::Compose(a) => run_compose(a),
    }
}

fn run_compose(a: &ComposeArgs) -> Result<(), CliError> {
    let m = compose::compose(&a.l1.0, &a.l2.0)?;
    let mut out = io::stdout().lock();
    if a.json {
        serde_json::to_writer(&mut out, &compose::to_json(&m)).map_err(io::Error::from)?;
        out.write_all(b"\n")?;
    } else {
        writeln!(
            out,
            "L0->L2: tsc_offset {} tsc_scaling_ratio {} tsc_frac_bits {}",
            m.offset(),
            m.ratio(),
            m.frac_bits()
        )?;
    }
    out.flush()?;
    Ok(())
}
