//! `vmtsync spans`: a recording's spans (phases and function calls) summed up; the pairing is
//! in [`crate::spans`]. [`SpanArgs`] are the naming flags every command that writes spans
//! shares.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::exit::CliError;
use crate::atomic_file::write_atomically;
use crate::formats::{self, ctf};
use crate::spans::report::{ReportOptions, SpanReport, collect};
use crate::spans::{Reloc, SpanConfig, Symbols, parse_reloc};

/// How a guest's function addresses are named: shared by every command that writes spans.
#[derive(Debug, Clone, Default, Args)]
pub struct SpanArgs {
    /// The guest's ELF image (32- or 64-bit, not stripped): function addresses in span
    /// records are named by its function symbols.
    #[arg(long, value_name = "IMAGE")]
    pub symbols: Option<PathBuf>,
    /// Code linked at LINK runs at RUNTIME, LEN bytes (repeatable; hex with 0x). The guest
    /// can say the same with a relocation record; a later relocation wins where they overlap.
    #[arg(long, value_name = "LINK:RUNTIME:LEN", value_parser = parse_reloc)]
    pub reloc: Vec<Reloc>,
}

impl SpanArgs {
    /// The tracker's configuration: the image's symbols read now.
    ///
    /// # Errors
    /// [`CliError::Symbols`] when the image cannot be read or is not ELF.
    pub fn config(&self) -> Result<SpanConfig, CliError> {
        let symbols = match &self.symbols {
            Some(p) => Some(Arc::new(Symbols::from_elf_file(p).map_err(|source| {
                CliError::Symbols {
                    path: p.clone(),
                    source,
                }
            })?)),
            None => None,
        };
        Ok(SpanConfig {
            symbols,
            relocs: self.reloc.clone(),
        })
    }
}

/// `vmtsync spans` flags.
#[derive(Debug, Args)]
pub struct SpansArgs {
    /// The recording: JSON Lines (`record --format jsonl`: spans with guaranteed intervals)
    /// or a trace.dat from `vmtsync record`.
    #[arg(long, value_name = "IN")]
    pub from: PathBuf,
    #[command(flatten)]
    pub names: SpanArgs,
    /// How many of the longest spans to list.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,
    /// How many of the last spans closed before the end to list.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub last: usize,
    /// Write every span as a JSON line (vcpu, kind, name, addr, depth, state, begin and end
    /// with host_tsc, lo, hi, guest_tsc) to this file.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The host TSC frequency in Hz for times and durations (default: the kernel's, or
    /// CPUID's).
    #[arg(long, value_name = "HZ", value_parser = clap::value_parser!(u64).range(1..))]
    pub tsc_hz: Option<u64>,
}

/// Runs `vmtsync spans`: the report on stdout, what it read on stderr.
///
/// # Errors
/// [`CliError`]: unreadable or malformed input (5), unreadable image (5), output (1).
pub fn run_spans_cmd(a: &SpansArgs) -> Result<(), CliError> {
    let cfg = a.names.config()?;
    let tsc_hz = match a.tsc_hz {
        Some(h) => h,
        None => ctf::host_tsc_hz()?,
    };
    let opts = ReportOptions {
        top: a.top,
        last: a.last,
    };
    let mut source = formats::open(&a.from)?;
    let source = std::iter::from_fn(move || {
        let e = source.next()?;
        Some(e.map(|e| (e, source.boot())))
    });
    let report: SpanReport = match &a.out {
        Some(path) => {
            // The input's errors keep their own exit code; only the file's become `Write`.
            let mut outcome = None;
            let written = write_atomically(path, |mut w| {
                let r = collect(source, &cfg, opts, Some((&mut w, path)));
                let failed = r.is_err();
                outcome = Some(r);
                if failed {
                    return Err(std::io::Error::other("the recording could not be read"));
                }
                Ok(())
            });
            match outcome {
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(r)) => {
                    written.map_err(|source| formats::ExportError::Write {
                        path: path.clone(),
                        source,
                    })?;
                    r
                }
                None => {
                    return Err(formats::ExportError::Write {
                        path: path.clone(),
                        source: written
                            .err()
                            .unwrap_or_else(|| std::io::Error::other("not written")),
                    }
                    .into());
                }
            }
        }
        None => collect(source, &cfg, opts, None)?,
    };
    print!("{}", report.render(tsc_hz));
    Ok(())
}
