//! `vmtsync kvm`: list VMs and their vCPUs' exact TSC mappings, or watch them change.

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::exit::CliError;
use super::signals::{install_stop_handler, stop_flag};
use super::source::{SourceArgs, scanner};
use crate::ftrace::find_tracefs;
use crate::ftrace::tsc_offset::{self, Subscription};
use crate::kvm::scan::{self, VmSelector};
use crate::kvm::watch::{self, WatchError, WatchOptions};

/// `vmtsync kvm`.
#[derive(Debug, Args)]
pub struct KvmArgs {
    /// Debugfs and /proc locations.
    #[command(flatten)]
    pub source: SourceArgs,
    /// Only this VM: a PID, `PID-FD` (one VM of a process), or a name (QEMU -name or process name).
    #[arg(long, value_name = "PID|NAME")]
    pub vm: Option<VmSelector>,
    /// Print one JSON object (schema 1) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Keep polling and print one JSON line per change (VM added/gone, vCPU added/removed/changed).
    /// With --vm, exits 0 once the selected VMs are gone.
    #[arg(long)]
    pub watch: bool,
    /// Poll interval in milliseconds for --watch.
    #[arg(long = "interval-ms", alias = "interval", value_name = "MS", default_value_t = 100, requires = "watch",
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub interval: u64,
    /// Also subscribe to the kvm:kvm_write_tsc_offset tracepoint (a private tracefs instance),
    /// so no offset write between two polls is missed.
    #[arg(long, requires = "watch")]
    pub trace_events: bool,
    /// tracefs directory for --trace-events (default: /sys/kernel/tracing, then
    /// /sys/kernel/debug/tracing).
    #[arg(long, value_name = "DIR", requires = "trace_events")]
    pub tracefs: Option<PathBuf>,
}

pub(super) fn run_kvm(a: &KvmArgs) -> Result<(), CliError> {
    let sc = scanner(&a.source)?;
    let stdout = io::stdout();
    if a.watch {
        let trace = if a.trace_events {
            let root =
                find_tracefs(a.tracefs.as_deref(), tsc_offset::EVENT).map_err(WatchError::from)?;
            let sub = Subscription::start(&root).map_err(WatchError::from)?;
            if !sub.tsc_clock() {
                eprintln!(
                    "vmtsync: warning: could not set the trace clock to x86-tsc: tracepoint timestamps are not host TSC"
                );
            }
            Some(sub)
        } else {
            None
        };
        install_stop_handler();
        let opts = WatchOptions {
            interval: Duration::from_millis(a.interval),
            selector: a.vm.as_ref(),
            trace,
            stop: stop_flag(),
        };
        watch::watch(&sc, opts, &mut stdout.lock())?;
        return Ok(());
    }
    let report = sc.scan(a.vm.as_ref())?;
    for w in scan::warnings(&report) {
        eprintln!("vmtsync: warning: {w}");
    }
    let mut out = BufWriter::new(stdout.lock());
    if a.json {
        serde_json::to_writer(&mut out, &report).map_err(io::Error::from)?;
        out.write_all(b"\n")?;
    } else {
        scan::write_table(&report, &mut out)?;
    }
    out.flush()?;
    Ok(())
}
