//! `vmtsync spans`: a recording's spans (phases and function calls) summed up; the pairing is
//! in [`crate::spans`]. [`SpanArgs`] are the naming flags every command that writes spans
//! shares.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::exit::CliError;
use super::number::hex_or_decimal;
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
    /// Draw the spans over host time as an SVG picture (lanes per vCPU, kind and depth; open
    /// spans hatched to the edge).
    #[arg(long, value_name = "FILE.svg")]
    pub svg: Option<PathBuf>,
    /// With --svg: the host trace.dat of the same run (`record --host-trace`, x86-tsc clock),
    /// whose `kvm_pio` exits inside the recording's time are drawn as ticks, one per exit.
    #[arg(long, value_name = "HOST.dat", requires = "svg")]
    pub host_trace: Option<PathBuf>,
    /// With --host-trace: only the exits of these I/O ports (repeatable; hex with 0x).
    #[arg(long, value_name = "PORT", requires = "host_trace", value_parser = parse_port)]
    pub port: Vec<u16>,
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
    if let Some(svg) = &a.svg {
        draw_picture(a, svg, &report, tsc_hz)?;
    }
    Ok(())
}

/// `--port`: decimal or `0x` hex.
fn parse_port(s: &str) -> Result<u16, String> {
    hex_or_decimal::<u16>(s).map_err(|e| format!("{s:?}: {e}"))
}

/// `--svg`: the report's spans and the host trace's exits inside the recording's time.
fn draw_picture(
    a: &SpansArgs,
    svg: &std::path::Path,
    report: &SpanReport,
    tsc_hz: u64,
) -> Result<(), CliError> {
    let mut exits = Vec::new();
    if let (Some(host), Some(first), Some(last)) =
        (&a.host_trace, report.first_tsc, report.last_tsc)
    {
        let keep = |p: u16| a.port.is_empty() || a.port.contains(&p);
        let (pio, _) = crate::validate::input::host_exits(host, keep)?;
        exits = pio
            .iter()
            .filter(|e| (first..=last).contains(&e.ts))
            .map(|e| (e.ts, format!("{:#x}", e.pio.port)))
            .collect();
    }
    let title = format!(
        "spans of {}",
        a.from.file_name().map_or_else(
            || a.from.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        )
    );
    let text = crate::spans::svg::draw(&report.picture, &exits, &title, tsc_hz)
        .map_err(|e| CliError::Usage(format!("--svg: {e}")))?;
    write_atomically(svg, |w| w.write_all(text.as_bytes())).map_err(|source| {
        formats::ExportError::Write {
            path: svg.to_owned(),
            source,
        }
    })?;
    eprintln!(
        "vmtsync: wrote {}: {} spans, {} host exits",
        svg.display(),
        report.picture.len(),
        exits.len()
    );
    Ok(())
}
