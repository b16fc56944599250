//! The `vmtsync` command line: argument definitions, dispatch, errors and exit codes.
//!
//! Exit codes (also in `--help`):
//! - 0: success; also when stdout is a closed pipe (`vmtsync … | head`).
//! - 1: a runtime error: I/O, malformed debugfs contents, a VM exited while being read.
//! - 2: bad command-line usage.
//! - 3: the environment is missing something: debugfs not mounted, not root, no tracefs.
//! - 4: no VM or vCPU matches `--vm` / `--vcpu`.
//! - 5: bad input data (`convert`: a bad line or a value outside the mapping's range;
//!   `tsc compose`: mappings that cannot be composed).
//! - 6: refused: the vCPU runs a nested guest (`guest_mode` 1) and `--nested-l2` was not given.
//! - 7: `probe`: the guest agent could not be reached, or stopped answering mid-session (the
//!   VM exited or was killed, the agent restarted, or it speaks another protocol version).
//!
//! `convert --sync`: a sync file with no segment for `--vcpu` exits 4; a malformed sync file
//! or input line exits 5.

use std::ffi::CString;
use std::io::{self, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;
use vmtsync_core::mapping::KvmTscMapping;

use crate::compose::{self, ComposeError, MappingArg};
use crate::convert::{self, ConvertError, ConvertOptions, Direction, Rounding};
use crate::debugfs::{DEBUGFS_MOUNTPOINT, DEFAULT_KVM_DEBUGFS, DebugfsError, KvmDebugfs};
use crate::probe::{self, ConnectError, ProbeArgs, ProbeError};
use crate::procinfo::{DEFAULT_PROC_ROOT, ProcFs};
use crate::scan::{self, ScanError, Scanner, VmSelector};
use crate::syncfile::{self, SyncFileError};
use crate::trace_events::{self, Subscription, TraceError};
use crate::watch::{self, WatchError, WatchOptions};

const EXIT_CODES: &str = "\
Exit codes:
  0  success (also when stdout is a closed pipe)
  1  runtime error (I/O, malformed debugfs contents, VM exited while being read)
  2  bad command-line usage
  3  environment: debugfs not mounted, not root, no tracefs
  4  no VM or vCPU matches --vm / --vcpu (convert --sync: no segment for --vcpu)
  5  bad input data (convert: bad line, value out of range or malformed sync file;
     compose: cannot compose)
  6  refused: the vCPU runs a nested guest (guest_mode=1) and --nested-l2 was not given
  7  probe: the guest agent could not be reached or stopped answering (VM gone, agent
     restarted, protocol version mismatch)
  130  probe: interrupted by SIGINT (143: by SIGTERM) before it measured anything; in
     continuous mode a signal instead ends the run after the current round";

/// vmtsync: exact host<->guest TSC mappings from KVM, for putting VM trace events on the host
/// timeline.
#[derive(Debug, Parser)]
#[command(name = "vmtsync", bin_name = "vmtsync", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List VMs and each vCPU's exact TSC mapping from KVM debugfs (or watch it change).
    ///
    /// For each vCPU: guest_tsc = tsc_offset + (host_tsc * tsc_scaling_ratio) >> tsc_frac_bits,
    /// true at some host TSC in [host_tsc_before, host_tsc_after]. vCPU numbers are the VMM's
    /// vCPU ids (debugfs `vcpuN`), not guest CPU indexes. A vCPU with guest_mode=1 runs a
    /// nested guest: its values are the combined L0->L2 mapping, not its VM's. A host without
    /// TSC scaling has no tsc-scaling-ratio files: the vCPU then shows ratio 1, frac bits 0
    /// (identity, scaling_present=false), which `tsc compose` accepts with any other side.
    ///
    /// JSON (--json, schema 1): {"schema":1,"vms":[{"pid","fd","name","vcpus":[{"vcpu",
    /// "tsc_offset","tsc_scaling_ratio","tsc_frac_bits","scaling_present","guest_mode",
    /// "thread_pid","host_tsc_before","host_tsc_after"}]}]}.
    #[command(after_help = EXIT_CODES)]
    Kvm(KvmArgs),
    /// Convert TSC values read from stdin, one decimal per line (guest -> host by default).
    ///
    /// The mapping is given (--offset [--ratio --frac-bits]) or read from debugfs
    /// (--vm --vcpu). Streams with constant memory; the first bad line stops it with its line
    /// number unless --skip-bad.
    #[command(after_help = EXIT_CODES)]
    Convert(ConvertArgs),
    /// Measure a guest's TSC offset (and drift) with ping-pong probes against the vmtsync guest
    /// agent, with guaranteed bounds and trace-cmd's estimate on the same samples.
    ///
    /// JSON (--json, schema 1): one object per round with schema, vcpu, offset_ticks, bound_lo,
    /// bound_hi, model, at_host_tsc, drift_ppb(_lo/_hi), rtt_*_ticks, probes, sent,
    /// lost_probes, bad_frames, stale_replies, tracecmd_fastest_rtt_offset, tsc_khz.
    #[command(after_help = EXIT_CODES)]
    Probe(ProbeArgs),
    /// TSC mapping arithmetic.
    #[command(subcommand)]
    Tsc(TscCommand),
}

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

/// Where to read KVM debugfs and /proc.
#[derive(Debug, Args)]
pub struct SourceArgs {
    /// KVM debugfs directory (holds one `<pid>-<fd>` directory per VM).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_KVM_DEBUGFS)]
    pub debugfs_root: PathBuf,
    /// Mount debugfs at /sys/kernel/debug first if it is not mounted (needs root).
    #[arg(long)]
    pub mount_debugfs: bool,
    /// The proc filesystem used to name VMs (for tests with fixture trees).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PROC_ROOT, hide = true)]
    pub proc_root: PathBuf,
}

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
    #[arg(long, value_name = "MS", default_value_t = 100, requires = "watch",
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
    /// From `convert --sync`.
    #[error(transparent)]
    SyncFile(#[from] SyncFileError),
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
            Self::SyncFile(e) => sync_exit_code(e),
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
            128 + u8::try_from(STOP_SIGNAL.load(Ordering::Relaxed)).unwrap_or(2)
        }
        ProbeError::Connect(ConnectError::Unsupported) => 3,
        ProbeError::Connect(_)
        | ProbeError::Timeout { .. }
        | ProbeError::Transport { .. }
        | ProbeError::VersionMismatch { .. }
        | ProbeError::AgentNotReady
        | ProbeError::AgentExited => 7,
        ProbeError::SyncFile(s) => sync_exit_code(s),
        _ => 1,
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

/// Set by SIGINT/SIGTERM so watch mode ends cleanly (and removes its tracefs instance).
static STOP: AtomicBool = AtomicBool::new(false);

/// The signal that raised [`STOP`] (SIGINT = 2 until one arrives), for the exit code.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(libc::SIGINT);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::Relaxed);
    STOP.store(true, Ordering::Relaxed);
}

fn install_stop_handler() {
    let handler = on_stop_signal as extern "C" fn(libc::c_int);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

/// Parses the process arguments, runs the command and maps the outcome to an exit code;
/// errors go to stderr as `vmtsync: …`.
#[must_use]
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmtsync: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Runs a parsed command line against the real stdin/stdout/stderr.
///
/// # Errors
/// Any [`CliError`].
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Kvm(a) => run_kvm(&a),
        Command::Convert(a) => run_convert(&a),
        Command::Probe(a) => run_probe_cmd(&a),
        Command::Tsc(TscCommand::Compose(a)) => run_compose(&a),
    }
}

fn scanner(src: &SourceArgs) -> Result<Scanner, CliError> {
    if src.mount_debugfs {
        mount_debugfs_if_needed(&src.debugfs_root)?;
    }
    let debugfs = KvmDebugfs::open(&src.debugfs_root).map_err(ScanError::from)?;
    Ok(Scanner {
        debugfs,
        proc: ProcFs::new(&src.proc_root),
    })
}

/// Mounts debugfs at the standard mount point unless `root` already exists.
fn mount_debugfs_if_needed(root: &Path) -> Result<(), CliError> {
    if root.exists() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(CliError::NotRoot);
    }
    let c = |s: &str| CString::new(s).map_err(|e| CliError::Mount(io::Error::other(e)));
    let (src, target, fstype) = (c("none")?, c(DEBUGFS_MOUNTPOINT)?, c("debugfs")?);
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; data is null.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(CliError::Mount(io::Error::last_os_error()));
    }
    Ok(())
}

fn run_kvm(a: &KvmArgs) -> Result<(), CliError> {
    let sc = scanner(&a.source)?;
    let stdout = io::stdout();
    if a.watch {
        let trace = if a.trace_events {
            let root =
                trace_events::find_tracefs(a.tracefs.as_deref()).map_err(WatchError::from)?;
            let sub = Subscription::start(&root).map_err(WatchError::from)?;
            if !sub.tsc_clock {
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
            stop: &STOP,
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
    let report = scanner(&a.source)?.scan(Some(sel))?;
    let [vm] = report.vms.as_slice() else {
        return Err(CliError::Ambiguous {
            selector: sel.to_string(),
            count: report.vms.len(),
            list: report
                .vms
                .iter()
                .map(|v| format!("{}-{}", v.pid, v.fd))
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
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

fn run_convert(a: &ConvertArgs) -> Result<(), CliError> {
    if let (Some(path), Some(vcpu)) = (a.sync.as_deref(), a.vcpu) {
        let stdin = io::stdin();
        let mut input = BufReader::with_capacity(64 * 1024, stdin.lock());
        let mut output = BufWriter::with_capacity(64 * 1024, io::stdout().lock());
        let stats = syncfile::convert_sync_file(path, vcpu, &mut input, &mut output, a.skip_bad)?;
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
    let stats = convert::convert_stream(&mut input, &mut output, &mut warn, &opts)?;
    if stats.skipped > 0 {
        writeln!(
            warn,
            "vmtsync: converted {} values, skipped {} bad lines",
            stats.converted, stats.skipped
        )?;
    }
    Ok(())
}

/// `vmtsync probe`: SIGINT/SIGTERM end continuous mode after the current round, and abandon
/// anything else (connect, hello, a round) with exit code 130/143.
fn run_probe_cmd(a: &ProbeArgs) -> Result<(), CliError> {
    install_stop_handler();
    let opts = a.to_options(Some(&STOP));
    let mut out = io::stdout().lock();
    probe::run_probe(&opts, &mut out)?;
    out.flush()?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_contract_forms() {
        let p = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        assert!(p(&["vmtsync", "kvm", "--json", "--vm", "123"]).is_ok());
        assert!(
            p(&[
                "vmtsync",
                "kvm",
                "--watch",
                "--interval",
                "50",
                "--trace-events"
            ])
            .is_ok()
        );
        assert!(
            p(&["vmtsync", "kvm", "--interval", "50"]).is_err(),
            "--interval needs --watch"
        );
        assert!(p(&["vmtsync", "convert", "--offset", "-5"]).is_ok());
        assert!(
            p(&[
                "vmtsync",
                "convert",
                "--offset",
                "-5",
                "--ratio",
                "3",
                "--frac-bits",
                "1",
                "--to",
                "guest"
            ])
            .is_ok()
        );
        assert!(
            p(&["vmtsync", "convert", "--offset", "1", "--ratio", "3"]).is_err(),
            "ratio needs frac bits"
        );
        assert!(p(&["vmtsync", "convert", "--vm", "web", "--vcpu", "2"]).is_ok());
        assert!(
            p(&["vmtsync", "convert", "--vm", "web"]).is_err(),
            "--vm needs --vcpu"
        );
        assert!(p(&["vmtsync", "convert"]).is_err(), "a mapping is required");
        assert!(
            p(&[
                "vmtsync", "convert", "--offset", "1", "--vm", "1", "--vcpu", "0"
            ])
            .is_err()
        );
        assert!(
            p(&[
                "vmtsync", "tsc", "compose", "--l1", "-5,1,0", "--l2", "7,1,0", "--json"
            ])
            .is_ok()
        );
        assert!(p(&["vmtsync", "convert", "--sync", "s.jsonl", "--vcpu", "0"]).is_ok());
        assert!(
            p(&["vmtsync", "convert", "--sync", "s.jsonl"]).is_err(),
            "--sync needs --vcpu"
        );
        for extra in [&["--offset", "5"][..], &["--vm", "1"], &["--to", "guest"]] {
            let mut args = vec!["vmtsync", "convert", "--sync", "s", "--vcpu", "0"];
            args.extend_from_slice(extra);
            assert!(p(&args).is_err(), "--sync conflicts with {extra:?}");
        }
        assert!(
            p(&["vmtsync", "convert", "--offset", "5", "--vcpu", "0"]).is_err(),
            "--vcpu is meaningless with --offset"
        );
        assert!(
            p(&[
                "vmtsync",
                "probe",
                "--connect",
                "unix:/tmp/x.sock",
                "--json",
                "--probes",
                "10",
                "--timeout",
                "500"
            ])
            .is_ok()
        );
        assert!(p(&["vmtsync", "probe"]).is_err(), "--connect is required");
    }

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
            source: probe::TransportError::Closed,
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
    }
}
