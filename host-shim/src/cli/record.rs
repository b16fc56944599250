//! `vmtsync record`: the command's glue; the work is in [`crate::record`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::exit::CliError;
use super::number::hex_or_decimal;
use super::signals::{install_stop_handler, stop_flag};
use crate::formats::tracedat::FileVersion;
use crate::link::ProbeAddr;
use crate::probe::anchor::AnchorMode;
use crate::probe::{DEFAULT_PROBES, ProbeOptions, Progress};
use crate::record::{self, EndReason, OutputOptions, RecordFormat, RecordOptions, RecordSummary};

/// `vmtsync record` flags: the two front ends' own flags (each refused with the other, never
/// silently ignored), then the flags both take.
#[derive(Debug, Args)]
pub struct RecordArgs {
    /// The protocol front end (`--connect`).
    #[command(flatten)]
    pub protocol: ProtocolArgs,
    /// The memory front end (`--from-memory`).
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// The output file (written beside it and renamed into place when complete).
    #[arg(long, value_name = "PATH")]
    pub out: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = FormatArg::TraceCmd)]
    pub format: FormatArg,
    /// Stop after N events.
    #[arg(long, value_name = "N")]
    pub events: Option<u64>,
    /// Stop after SECS seconds (with --events: whichever comes first).
    #[arg(long = "duration-s", alias = "duration", value_name = "SECS")]
    pub duration: Option<f64>,
    /// trace.dat version (trace-cmd 3.x writes 7).
    #[arg(long, value_name = "6|7", default_value_t = 7, value_parser = clap::value_parser!(u8).range(6..=7))]
    pub file_version: u8,
    /// No progress line on stderr.
    #[arg(long)]
    pub no_progress: bool,
    /// The host trace to pair with the guest's (`--host-trace`, `--host-out`).
    #[command(flatten)]
    pub host: super::host_copy::HostCopyArgs,
    /// The VM (PID, PID-FD or name) whose vCPU thread goes into the GUEST option, and whose
    /// vCPU threads' exits anchor the sync rounds (default for --anchor: the only VM).
    #[arg(long, value_name = "PID|NAME")]
    pub vm: Option<crate::kvm::scan::VmSelector>,
    /// tracefs, for --anchor and --from-memory's beacons (default: /sys/kernel/tracing, then
    /// /sys/kernel/debug/tracing).
    #[arg(long, value_name = "DIR")]
    pub tracefs: Option<PathBuf>,
    /// Also append every sync round's segment to this sync file (created with a header if
    /// missing), for `vmtsync validate` and `vmtsync plot` (--from-memory: the segments its
    /// events were placed by, written when it ends).
    #[arg(long, value_name = "SYNCFILE")]
    pub sync_out: Option<PathBuf>,
    /// Debugfs and /proc (for --vm).
    #[command(flatten)]
    pub source: super::source::SourceArgs,
    /// How span records' function addresses are named.
    #[command(flatten)]
    pub names: super::spans::SpanArgs,
}

/// The flags of the protocol front end: a guest agent over a link. `--from-memory` refuses
/// every one of them.
#[derive(Debug, Args)]
#[group(id = "protocol", multiple = true)]
pub struct ProtocolArgs {
    /// Where the agent is: unix:PATH, unix-listen:PATH, vsock-uds:PATH:PORT, vsock:CID:PORT,
    /// tcp:HOST:PORT.
    #[arg(long, value_name = "ADDR", required_unless_present = "from_memory")]
    pub connect: Option<ProbeAddr>,
    /// Milliseconds between the starts of two sync rounds.
    #[arg(
        long = "resync-ms",
        alias = "resync",
        value_name = "MS",
        default_value_t = 1000
    )]
    pub resync: u64,
    /// Probes per sync round.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PROBES, value_parser = clap::value_parser!(u32).range(1..))]
    pub probes: u32,
    /// The longest wait for any reply, in milliseconds.
    #[arg(long = "timeout-ms", alias = "timeout", value_name = "MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// End the agent when done (send Shutdown); by default it keeps serving.
    #[arg(long)]
    pub shutdown: bool,
    /// Where each sync probe's host bracket comes from, as for `vmtsync probe`: kvm-pio takes
    /// it from the host kernel's kvm:kvm_pio stamps of the guest's port exits, the agent's sync
    /// port (0x2400) when its hello announces one, else its UART's (exit code 8 if it cannot);
    /// auto does so when it can and says why not; none stamps in this process. With --vm and
    /// the bundled agent's default boot (sync port on, loop in ring 0) every vCPU's rounds get
    /// the tightest bracket.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = AnchorMode::Auto)]
    pub anchor: AnchorMode,
    /// Append every sync probe that gave a sample to this file (JSON Lines), so `vmtsync
    /// validate --probe-log` can check the sync against the probes' own kvm_pio exits.
    #[arg(long, value_name = "FILE")]
    pub probe_log: Option<PathBuf>,
    /// Append the guest's console text to this file, byte for byte: the bytes it prints on
    /// the UART between frames (a guest sharing one UART writes a 0x00 before each frame and
    /// after it; every run that does not decode is text). Without it the text is counted
    /// and dropped.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    /// How an event's guaranteed host interval is found: two-sided intersects the sync round
    /// before the event and the one after it under the drift bounds of every round since the
    /// last break (docs/record.md, "Placing an event"); one-sided uses the round before alone,
    /// with the drift bounds known at that round (the placement of earlier versions, kept for
    /// comparison).
    #[arg(long, value_enum, value_name = "HOW", default_value_t = PlacementArg::TwoSided)]
    pub placement: PlacementArg,
}

/// The flags of the memory front end: each needs `--from-memory`.
#[derive(Debug, Args)]
#[group(id = "memory", multiple = true, conflicts_with = "protocol")]
pub struct MemoryArgs {
    /// Read the guest's recorder straight out of the VM's memory (--vm names the VM, or
    /// `-- VMM ARGS…` starts it; root): no link and no agent protocol. Each event's host time
    /// comes from KVM's per-vCPU mapping in debugfs, exactly, when the recorder says it holds
    /// the raw TSC (docs/record.md, "Recording from guest memory").
    #[arg(long)]
    pub from_memory: bool,
    /// With --from-memory: the header is at this host virtual address in the VMM (hex
    /// 0x... or decimal) instead of being searched for.
    #[arg(long, value_name = "HOSTVA", requires = "from_memory", conflicts_with = "elf", value_parser = parse_addr)]
    pub addr: Option<u64>,
    /// With --from-memory: the header is at this guest-physical address (hex 0x... or
    /// decimal), as firmware that puts its ring at a fixed address knows it; vmtsync waits for
    /// the guest to publish it there.
    #[arg(long, value_name = "GPA", requires = "from_memory", conflicts_with_all = ["addr", "elf"], value_parser = parse_addr)]
    pub guest_phys: Option<u64>,
    /// With --from-memory: trace this I/O port's kvm_pio exits from the start, before the
    /// recorder's header (which must name the same port) is found, so that beacons the
    /// guest emits early are traced too; with `-- VMM…` every beacon, the first included,
    /// gets a bracket.
    #[arg(long, value_name = "PORT", requires = "from_memory", value_parser = parse_port)]
    pub beacon_port: Option<u16>,
    /// With --from-memory, after `--`: the VMM's command line (QEMU). vmtsync starts it
    /// paused (adding -S and a private QMP socket), arms its reader, resumes it, records until
    /// a stop condition or the VMM's exit, then ends it (QMP quit, then SIGKILL). Instead of
    /// --vm.
    #[arg(
        last = true,
        value_name = "VMM",
        requires = "from_memory",
        conflicts_with = "vm"
    )]
    pub vmm: Vec<String>,
    /// With --from-memory: the guest image whose symbol --symbol names the header (a 32-bit
    /// or 64-bit ELF file).
    #[arg(
        long,
        value_name = "FILE",
        requires = "from_memory",
        requires = "elf_name"
    )]
    pub elf: Option<PathBuf>,
    /// With --elf: the symbol of the recorder's header.
    #[arg(
        long,
        value_name = "NAME",
        requires = "elf",
        group = "elf_name",
        conflicts_with = "pointer"
    )]
    pub symbol: Option<String>,
    /// With --elf: a pointer variable that holds the header's guest-physical address (a
    /// recorder the guest allocates at run time; 4 or 8 bytes by the image's class). vmtsync
    /// waits until it is set and a valid header sits where it points.
    #[arg(long, value_name = "NAME", requires = "elf", group = "elf_name")]
    pub pointer: Option<String>,
    /// With --from-memory: take the recorder header's word that every record holds the
    /// vCPU's raw TSC, and place each event at KVM's exact mapping with width 0. Without
    /// it the guaranteed intervals come from the guest's sync beacons, bracketed by the
    /// host's own kvm_pio exits (docs/record.md, "Recording from guest memory").
    #[arg(long, requires = "from_memory")]
    pub trust_raw_tsc: bool,
    /// With --from-memory: milliseconds between two drain rounds that found nothing.
    #[arg(long, value_name = "MS", default_value_t = 2, requires = "from_memory")]
    pub poll_ms: u64,
}

/// `--placement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlacementArg {
    /// The round before and the round after, under the epoch's newest drift bounds.
    TwoSided,
    /// The round before alone (earlier versions' placement).
    OneSided,
}

impl From<PlacementArg> for crate::sync::Placement {
    fn from(a: PlacementArg) -> Self {
        match a {
            PlacementArg::TwoSided => Self::TwoSided,
            PlacementArg::OneSided => Self::OneSided,
        }
    }
}

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// trace-cmd's trace.dat.
    TraceCmd,
    /// One JSON object per event.
    Jsonl,
    /// A Perfetto protobuf trace on the host's CLOCK_BOOTTIME (open it in ui.perfetto.dev).
    Perfetto,
    /// A CTF 1.8 trace directory (babeltrace2), on the host's TSC.
    Ctf,
}

impl RecordArgs {
    /// The output and stop options these flags ask for, the same for both front ends.
    fn output(&self) -> OutputOptions {
        OutputOptions {
            out: self.out.clone(),
            format: match self.format {
                FormatArg::TraceCmd => RecordFormat::TraceCmd,
                FormatArg::Jsonl => RecordFormat::Jsonl,
                FormatArg::Perfetto => RecordFormat::Perfetto,
                FormatArg::Ctf => RecordFormat::Ctf,
            },
            file_version: if self.file_version == 6 {
                FileVersion::V6
            } else {
                FileVersion::V7
            },
            events: self.events,
            duration: self
                .duration
                .filter(|d| d.is_finite() && *d >= 0.0)
                .map(Duration::from_secs_f64),
            sync_out: self.sync_out.clone(),
        }
    }

    /// The options these flags ask for (the protocol front end: `--connect`).
    #[must_use]
    pub fn to_options(
        &self,
        connect: ProbeAddr,
        stop: Option<&'static std::sync::atomic::AtomicBool>,
    ) -> RecordOptions {
        let mut probe = ProbeOptions::new(connect);
        probe.probes = self.protocol.probes;
        probe.timeout = Duration::from_millis(self.protocol.timeout);
        probe.stop = stop;
        probe.shutdown = self.protocol.shutdown;
        probe.progress = !self.no_progress;
        probe.probe_log = self.protocol.probe_log.clone();
        probe.console = self.protocol.console.clone();
        probe.anchor = self.source.anchor_options(
            self.protocol.anchor,
            self.vm.as_ref(),
            self.tracefs.as_ref(),
        );
        RecordOptions {
            probe,
            output: self.output(),
            resync: Duration::from_millis(self.protocol.resync.max(1)),
            drain_max: crate::record::DRAIN_MAX,
            placement: self.protocol.placement.into(),
            spans: crate::spans::SpanConfig::default(),
        }
    }
}

/// `vmtsync record`: SIGINT/SIGTERM end the recording cleanly (everything received is
/// written; exit 0).
pub(super) fn run_record_cmd(a: &RecordArgs) -> Result<(), CliError> {
    if a.duration.is_some_and(|d| !d.is_finite() || d < 0.0) {
        return Err(CliError::Usage(
            "--duration-s must be a non-negative number of seconds".into(),
        ));
    }
    if a.host.host_trace.is_some() && a.format != FormatArg::TraceCmd {
        return Err(CliError::Usage(
            "--host-trace pairs a host trace with a trace-cmd format recording".into(),
        ));
    }
    if a.host.host_trace.is_some() && a.vm.is_none() && a.memory.vmm.is_empty() {
        return Err(CliError::Usage(
            "--host-trace needs the VM: --vm, or with --from-memory the VMM's command line \
             after `--`"
                .into(),
        ));
    }
    // The VM's vCPU threads, read before recording so a wrong --vm fails at once.
    let host = match (a.host.paths(), &a.vm) {
        (Some((input, output)), Some(sel)) => {
            let vm = super::source::single_vm(&a.source, sel)?;
            Some((input, output, vm))
        }
        _ => None,
    };
    let Some(connect) = a.protocol.connect.clone() else {
        let (s, vm) = run_record_memory_cmd(a)?;
        let host = a.host.paths().map(|(input, output)| (input, output, vm));
        return host_copy(host, &s);
    };
    install_stop_handler();
    let mut opts = a.to_options(connect, Some(stop_flag()));
    opts.spans = a.names.config()?;
    let mut progress = Progress::stderr_if_terminal(opts.probe.progress);
    let s = record::run_record(&opts, &mut progress)?;
    eprintln!("{}", summary_text(&s));
    // Read again: KVM debugfs names a vCPU's thread only after its first run, which may have
    // come after the read above (a VM started with the recording). A VM gone by now keeps it.
    let host = host.map(|(input, output, vm)| {
        let again =
            a.vm.as_ref()
                .and_then(|sel| super::source::single_vm(&a.source, sel).ok());
        (input, output, again.unwrap_or(vm))
    });
    host_copy(host, &s)
}

/// `--host-trace IN --host-out OUT`: a copy of the host trace with the GUEST option for the
/// recording `s` (and the TSC2NSEC option the guest file carries), for trace-cmd's merged
/// report.
fn host_copy(
    host: Option<(PathBuf, PathBuf, crate::kvm::scan::VmReport)>,
    s: &RecordSummary,
) -> Result<(), CliError> {
    if let Some((input, output, vm)) = host {
        // The guest file's CPU N is the N-th vCPU recorded (increasing vCPU order).
        let vcpu_pids = s
            .vcpus
            .iter()
            .zip(0u32..)
            .filter_map(|(v, cpu)| {
                vm.vcpus
                    .iter()
                    .find(|c| c.vcpu == *v)
                    .and_then(|c| c.thread_pid)
                    .map(|t| (cpu, t))
            })
            .collect();
        let guest = crate::formats::tracedat::GuestInfo {
            name: vm
                .name
                .clone()
                .unwrap_or_else(|| format!("{}-{}", vm.pid, vm.fd)),
            trace_id: s.trace_id,
            vcpu_pids,
        };
        let c = crate::formats::tracedat::copy_host_trace_with(
            &input,
            &output,
            &guest,
            None,
            crate::record::host_tsc2nsec(),
        )
        .map_err(crate::record::RecordError::from)?;
        eprintln!(
            "vmtsync: wrote {} (a copy of {} with the GUEST option for {}): trace-cmd report -i {} -i {}",
            c.path.display(),
            input.display(),
            guest.name,
            c.path.display(),
            s.out.display()
        );
    }
    Ok(())
}

/// A `--beacon-port` value: hex with `0x`, else decimal, 1..=0xffff.
fn parse_port(s: &str) -> Result<u16, String> {
    let v = parse_addr(s)?;
    u16::try_from(v)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{s:?} is not an I/O port (1..=0xffff)"))
}

/// A `--addr` value: hex with `0x`, else decimal.
fn parse_addr(s: &str) -> Result<u64, String> {
    hex_or_decimal::<u64>(s).map_err(|e| format!("{s:?} is not an address: {e}"))
}

/// `vmtsync record --from-memory`: the VM's VMM memory is read, no link (see
/// [`record::run_record_memory`]).
/// Returns the summary and the VM's report, read after the recording when the VM is still
/// there (a VMM started paused names its vCPU threads only once they ran).
fn run_record_memory_cmd(
    a: &RecordArgs,
) -> Result<(RecordSummary, crate::kvm::scan::VmReport), CliError> {
    use crate::guestmem::{Location, pointer_guest_physical_in, symbol_guest_physical_in};
    use crate::kvm::scan::VmSelector;
    // `-- VMM…`: started here, paused, and ended here whatever happens (the value's drop).
    let mut vmm = if a.memory.vmm.is_empty() {
        None
    } else {
        Some(
            record::launch::Vmm::spawn_paused(&a.memory.vmm)
                .map_err(|e| CliError::Usage(e.to_string()))?,
        )
    };
    let launched = vmm.as_ref().map(|v| VmSelector::Pid(v.pid()));
    let Some(sel) = a.vm.as_ref().or(launched.as_ref()) else {
        return Err(CliError::Usage(
            "--from-memory needs --vm, or the VMM's command line after `--`".into(),
        ));
    };
    let vm = super::source::single_vm(&a.source, sel)?;
    let vm_dir = super::source::scanner(&a.source)?
        .select(Some(sel))?
        .into_iter()
        .map(|(d, _)| d)
        .find(|d| d.id == vm.id())
        .ok_or_else(|| CliError::Usage(format!("the VM {sel} exited")))?;
    let elf_error = |elf: &PathBuf, e| CliError::Usage(format!("--elf {}: {e}", elf.display()));
    let location = match (a.memory.guest_phys, a.memory.addr, &a.memory.elf) {
        (Some(gpa), _, _) => Location::GuestPhysical(gpa),
        (None, Some(addr), _) => Location::HostAddress(addr),
        (None, None, Some(elf)) => match (&a.memory.symbol, &a.memory.pointer) {
            (Some(sym), _) => Location::GuestPhysical(
                symbol_guest_physical_in(elf, sym).map_err(|e| elf_error(elf, e))?,
            ),
            (None, Some(ptr)) => {
                let (gpa, width) =
                    pointer_guest_physical_in(elf, ptr).map_err(|e| elf_error(elf, e))?;
                Location::Pointer { gpa, width }
            }
            (None, None) => {
                return Err(CliError::Usage(
                    "--elf needs --symbol (the header) or --pointer (a variable holding its \
                     address)"
                        .into(),
                ));
            }
        },
        _ => Location::Scan,
    };
    install_stop_handler();
    let opts = record::MemoryOptions {
        vm: vm_dir,
        proc_root: a.source.proc_root.clone(),
        location,
        output: a.output(),
        poll: Duration::from_millis(a.memory.poll_ms),
        trust_raw_tsc: a.memory.trust_raw_tsc,
        find_timeout: Duration::from_secs(30),
        stop: Some(stop_flag()),
        beacon_port: a.memory.beacon_port,
        paused: vmm.as_ref().map(record::launch::Vmm::resume),
        tracefs: a.tracefs.clone(),
        spans: a.names.config()?,
    };
    let mut progress = Progress::stderr_if_terminal(!a.no_progress);
    let result = record::run_record_memory(&opts, &mut progress);
    let vm = super::source::single_vm(&a.source, sel).unwrap_or(vm);
    if let Some(v) = vmm.as_mut() {
        match v.finish() {
            Some(status) => eprintln!("vmtsync: the VMM (PID {}) ended: {status}", v.pid()),
            None => eprintln!("vmtsync: the VMM (PID {}) was killed", v.pid()),
        }
    }
    let (s, m) = result?;
    eprintln!("{}", summary_text(&s));
    eprintln!("{}", memory_text(&s, &m));
    for (i, c) in m.boots.iter().enumerate() {
        eprintln!(
            "vmtsync: boot {i} (nonce {:#x}, {} ring(s)): {} records read ({} events, {} \
             beacons), {} overwritten, {} refused, {} corrupt",
            c.nonce,
            c.rings,
            c.records,
            c.records - c.beacons,
            c.beacons,
            c.overwritten,
            c.refused,
            c.corrupt
        );
    }
    let b = &m.beacon_stats;
    if let Some(d) = &b.first_disagreement {
        eprintln!(
            "vmtsync: warning: KVM's mapping and the beacons disagree at {} beacon(s): the \
             records do not hold the raw TSC as the header says (first: {d}){}",
            b.disagree,
            if opts.trust_raw_tsc {
                "; --trust-raw-tsc placed them by the mapping anyway"
            } else {
                "; each event's point is the beacons' then"
            }
        );
    }
    if m.unverified > 0 {
        eprintln!(
            "vmtsync: note: {} event(s) of vCPUs that no bracketed beacon covers (their beacons \
             came before the reader could bracket them) were placed by KVM's mapping alone: \
             exact if the header's raw-TSC claim holds, which no beacon checked",
            m.unverified
        );
    }
    if opts.trust_raw_tsc && s.vcpus.len() > 1 {
        eprintln!("{}", ring_claim_text(m.ring_claimed));
    }
    if m.early_placed > 0 || m.spilled > 0 {
        eprintln!(
            "vmtsync: note: {} event(s) were placed before the sync round after them was known \
             (the events waiting for it reached their bound): their intervals rest on the \
             rounds before them, wider but still guaranteed; {} waited on disk at most for \
             their vCPU's first round",
            m.early_placed, m.spilled
        );
    }
    if let Some(why) = &b.broken {
        eprintln!("vmtsync: warning: beacons stopped being bracketed: {why}");
    }
    Ok((s, vm))
}

/// The second summary line of a memory recording: where the recorder was and what the
/// reader counted.
#[must_use]
pub fn memory_text(s: &RecordSummary, m: &record::MemorySummary) -> String {
    format!(
        "vmtsync: read the recorder at {:#x} ({} vCPU ring(s) of {} records): host time {}; {} \
         beacons ({} bracketed by kvm_pio exits, {} before the trace saw them whole, {} not \
         bracketed, {} disagree with KVM's mapping); {} overwritten, {} refused, {} corrupt, {} ambiguous across {} mapping \
         changes, {} past --events; {} drain rounds in {:.3} s, {}{}",
        m.header_addr,
        s.vcpus.len(),
        m.capacity,
        s.host_time.name(),
        m.beacons,
        m.beacon_stats.bracketed,
        m.beacon_stats.early,
        m.beacon_stats.unbracketed + m.beacon_stats.malformed,
        m.beacon_stats.disagree,
        m.overwritten,
        m.refused,
        m.corrupt,
        m.ambiguous,
        m.mapping_changes,
        m.past_limit,
        m.polls,
        m.elapsed.as_secs_f64(),
        drain_text(m),
        reread_text(m)
    )
}

/// What an exact recording of several rings rests on: the header's word that ring r is vCPU
/// r matters only for events placed while the vCPUs' mappings differed (`claimed` of them).
fn ring_claim_text(claimed: u64) -> String {
    if claimed == 0 {
        "vmtsync: every vCPU had one TSC mapping in every round: no host time depends on which \
         vCPU wrote which ring"
            .to_owned()
    } else {
        format!(
            "vmtsync: note: {claimed} event(s) were placed while the vCPUs' TSC mappings \
             differed: their host times rest on the header's word that ring r holds vCPU r's \
             records"
        )
    }
}

/// The longest wait between two reads of a ring, when there were two rounds.
fn reread_text(m: &record::MemorySummary) -> String {
    if m.longest_reread.is_zero() {
        return String::new();
    }
    format!(
        "; each ring read again within {:.1} ms at most",
        m.longest_reread.as_secs_f64() * 1e3
    )
}

/// How fast the records were read: every record read (events placed or not, and beacons:
/// counting only the events written made a late attach's rate that of its beacons) over the
/// time between the first and the last round that delivered records, in seconds to the microsecond (a short drain printed to the
/// millisecond read "0.000 s"); one such round has a read time but no rate to speak of.
fn drain_text(m: &record::MemorySummary) -> String {
    let records = m.records;
    match m.active_rounds {
        0 => "no records read".to_owned(),
        1 => format!(
            "{records} records read in one round of {:.6} s (no sustained rate)",
            m.drain.as_secs_f64()
        ),
        _ => format!(
            "records read over {:.6} s at {:.3} M records/s",
            m.drain.as_secs_f64(),
            m.rate() / 1e6
        ),
    }
}

/// The summary printed on stderr.
#[must_use]
pub fn summary_text(s: &RecordSummary) -> String {
    let end = match s.end {
        EndReason::Events => "the requested number of events",
        EndReason::Duration => "the duration",
        EndReason::Stopped => "a signal",
        EndReason::AgentExited => "the agent ending the session",
        EndReason::VmmExited => "the VMM exiting",
    };
    let widths = s.widths.map_or_else(
        || match s.host_time {
            record::HostTime::ExactUnverified => {
                "none (every point is KVM's mapping, not verified by a beacon)".to_owned()
            }
            _ => "no events".to_owned(),
        },
        |(lo, med, hi)| {
            // The same widths in microseconds of the host's clock, when its TSC rate is known.
            let us = record::host_tsc2nsec().map_or_else(String::new, |t| {
                let us = |w: u64| t.nanos(w) as f64 / 1e3;
                format!(" ({:.3}, {:.3}, {:.3} µs)", us(lo), us(med), us(hi))
            });
            format!("min {lo}, median {med}, max {hi} ticks{us}")
        },
    );
    // A flight recorder's overwritten records are named apart from refused events.
    let split = if s.overwritten > 0 {
        let how = match s.host_time {
            record::HostTime::Sync => "sent",
            _ => "read",
        };
        format!(
            " ({} overwritten by its flight recorder before they were {how}, {} refused by a \
             full ring)",
            s.overwritten, s.dropped
        )
    } else {
        String::new()
    };
    // Exact mode has no sync rounds: its segments are KVM's mappings, one per change seen.
    let segments = match s.host_time {
        record::HostTime::Sync => format!("{} sync segments ({} breaks)", s.segments, s.breaks),
        record::HostTime::ExactDebugfs => format!("{} KVM mapping segment(s)", s.segments),
        record::HostTime::ExactUnverified => "no beacon segment".to_owned(),
        record::HostTime::Beacons | record::HostTime::BeaconsExactPoints => {
            format!("{} beacon segments ({} breaks)", s.segments, s.breaks)
        }
    };
    let mut t = format!(
        "vmtsync: recorded {} events to {} (ended by {end}); {} dropped by the guest's \
         ring{split}; {segments}; guaranteed interval widths: {widths}",
        s.events,
        s.out.display(),
        s.dropped + s.overwritten,
    );
    if s.vcpus.len() > 1 {
        let list: Vec<String> = s.vcpus.iter().map(u32::to_string).collect();
        t.push_str(&format!(
            "; vCPUs {} synced each round (trace.dat CPU N is the N-th)",
            list.join(",")
        ));
    }
    if s.preconverted {
        t.push_str(&format!(
            "; timestamps pre-converted to host TSC (the guest TSC rate differs from the host's, \
             or its TSC stepped back, which trace-cmd's TIME_SHIFT cannot represent exactly; {} \
             raised to stay in order)",
            s.clamped
        ));
    }
    if s.clamped > 0 && !s.preconverted {
        t.push_str(&format!(
            "; {} CTF timestamps raised to their vCPU's previous one to stay in order (their host_tsc field is exact)",
            s.clamped
        ));
    }
    if s.lost + s.replayed + s.failed_drains > 0 {
        t.push_str(&format!(
            "; {} events lost in transit (sent by the agent, never received), {} received twice, {} drains asked again",
            s.lost, s.replayed, s.failed_drains
        ));
    }
    match (&s.console, s.console_bytes) {
        (Some(path), n) => t.push_str(&format!(
            "; {n} bytes of the guest's console text appended to {}",
            path.display()
        )),
        (None, 0) => {}
        (None, n) => t.push_str(&format!(
            "; {n} bytes of console text (or damaged frames) between frames, not kept (--console FILE keeps them)"
        )),
    }
    if s.host_stamped_skipped + s.unplaceable > 0 {
        t.push_str(&format!(
            "; skipped {} host-stamped and {} unplaceable events",
            s.host_stamped_skipped, s.unplaceable
        ));
    }
    t
}
