//! `vmtsync trace-cmd attach`: a Linux guest's trace.dat (trace-cmd, `x86-tsc` clock) copied
//! with a TIME_SHIFT that puts its events on the host's timeline, from a given mapping, a sync
//! file or the live KVM mapping of every vCPU; optionally a copy of the host's trace with the
//! GUEST option. The work is in [`crate::formats::tracedat::attach`]; the choices are in
//! `docs/attach.md`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::exit::CliError;
use super::host_copy::HostCopyArgs;
use super::mapping::MappingArgs;
use super::source::{find_vcpu, not_nested, single_vm, vm_name};
use crate::formats::tracedat::plan::{AttachMapping, AttachPlan, plan};
use crate::formats::tracedat::timeshift::TimeShiftError;
use crate::formats::tracedat::{
    self, GuestInfo, Layout, ShiftMode, TimeShift, TraceDatError, cpu_time_ranges, read_layout,
    trace_cpus,
};
use crate::syncfile::{SyncFile, SyncTimeline};

/// `vmtsync trace-cmd …`.
#[derive(Debug, Subcommand)]
pub enum TraceCmdCommand {
    /// Write a copy of a guest's trace.dat with a TIME_SHIFT onto the host's TSC timeline
    /// (what trace-cmd's own guest sync writes), from a given mapping (--offset), a sync file
    /// (--sync --vcpu) or the live KVM mapping of every vCPU (--vm).
    ///
    /// The guest trace must use the x86-tsc clock (raw guest TSC). v6 and v7 files, compressed
    /// or not; v7 gets a new options section linked from the last one (nothing is
    /// recompressed), v6 gets the option inserted before its data. The input is never
    /// modified: the copy is written beside --out, re-read, verified and renamed.
    /// Guest CPU N is taken to run on vCPU N (debugfs vcpuN). With a rate other than the
    /// host's, trace-cmd's 64-bit arithmetic is approximate: the worst-case error over the
    /// file's events is computed and above --max-error ticks the copy is refused (exit 6).
    /// trace-cmd 3.1.6 applies TIME_SHIFT to the file's top buffer only (events in instance
    /// buffers keep guest time; attach warns).
    #[command(after_help = super::exit::EXIT_CODES)]
    Attach(AttachArgs),
}

/// `vmtsync trace-cmd attach`.
#[derive(Debug, Args)]
#[command(mut_arg("vcpu", |a| a.requires("sync")))]
#[command(mut_arg("host_trace", |a| a.alias("host")))]
pub struct AttachArgs {
    /// The guest's trace.dat (trace-cmd record/extract in the guest, x86-tsc clock).
    #[arg(long = "from", alias = "guest", value_name = "GUEST.dat")]
    pub guest: PathBuf,
    /// The copy to write (replaced atomically if it exists; never the input).
    #[arg(long = "out", alias = "output", value_name = "OUT.dat")]
    pub output: PathBuf,
    /// The mapping: --offset, --sync with --vcpu (its segments become the TIME_SHIFT samples
    /// of every guest CPU), or --vm (every vCPU's mapping). trace-cmd stores the opposite
    /// sign of the offset; this is converted.
    #[command(flatten)]
    pub mapping: MappingArgs,
    /// With --sync: write the segments as points that trace-cmd interpolates between (its
    /// PTP convention, flags=1) instead of steps (each offset holds until the next segment,
    /// flags=0, exact). Needed for segments with a non-zero drift.
    #[arg(long, requires = "sync")]
    pub interpolate: bool,
    /// The host trace to pair with the guest's (`--host-trace`, old spelling `--host`;
    /// `--host-out`); the vCPU threads come from --vm or --vcpu-pid.
    #[command(flatten)]
    pub host: HostCopyArgs,
    /// With --host-trace but without --vm: guest CPU N runs on host thread PID (repeat per CPU).
    #[arg(long, value_name = "N=PID", requires = "host_trace", conflicts_with = "vm",
          value_parser = parse_cpu_pid)]
    pub vcpu_pid: Vec<(u32, u32)>,
    /// The guest's name in the GUEST option (default: the VM's name, else the guest file's).
    #[arg(long, value_name = "NAME", requires = "host_trace")]
    pub guest_name: Option<String>,
    /// The largest worst-case error in ticks accepted from trace-cmd's 64-bit arithmetic.
    #[arg(long, value_name = "TICKS", default_value_t = 1)]
    pub max_error: u64,
}

fn parse_cpu_pid(s: &str) -> Result<(u32, u32), String> {
    let (c, p) = s.split_once('=').ok_or("expected N=PID")?;
    Ok((
        c.parse().map_err(|_| format!("bad CPU {c:?}"))?,
        p.parse().map_err(|_| format!("bad PID {p:?}"))?,
    ))
}

pub(super) fn run_trace_cmd(c: &TraceCmdCommand) -> Result<(), CliError> {
    match c {
        TraceCmdCommand::Attach(a) => run_attach(a),
    }
}

/// The VM's name and its vCPU threads `(guest CPU, host thread)`, when --vm gave them.
type VmThreads = Option<(String, Vec<(u32, u32)>)>;

/// The mapping the arguments name, and the vCPU threads when --vm gave them.
fn mapping<'a>(
    a: &AttachArgs,
    cpus: usize,
    timeline: &'a mut Option<SyncTimeline>,
) -> Result<(AttachMapping<'a>, VmThreads), CliError> {
    if let Some(map) = a.mapping.fixed()? {
        return Ok((AttachMapping::Fixed(map), None));
    }
    if let (Some(path), Some(vcpu)) = (a.mapping.sync.as_deref(), a.mapping.vcpu) {
        let sync = SyncFile::read(path)?;
        if let Some(cut) = sync.cut {
            eprintln!("vmtsync: warning: {}: {cut}", path.display());
        }
        let timeline = timeline.insert(sync.timeline(vcpu)?);
        return Ok((
            AttachMapping::Sync {
                timeline,
                interpolate: a.interpolate,
            },
            None,
        ));
    }
    let Some(sel) = a.mapping.vm.as_ref() else {
        return Err(CliError::Usage(
            "give --offset, --sync with --vcpu, or --vm".into(),
        ));
    };
    let vm = single_vm(&a.mapping.source, sel)?;
    let vm_name = vm_name(&vm);
    let mut maps = Vec::with_capacity(cpus);
    let mut pids = Vec::new();
    for c in 0..cpus {
        let cpu = u32::try_from(c).unwrap_or(u32::MAX);
        let v = not_nested(&vm, find_vcpu(&vm, cpu)?, a.mapping.nested_l2)?;
        maps.push(
            v.mapping()
                .map_err(|e| CliError::Usage(format!("VM {vm_name} vcpu{cpu}: {e}")))?,
        );
        if let Some(t) = v.thread_pid {
            pids.push((cpu, t));
        }
    }
    let name = vm.name.clone().unwrap_or(vm_name);
    Ok((AttachMapping::PerCpu(maps), Some((name, pids))))
}

fn run_attach(a: &AttachArgs) -> Result<(), CliError> {
    let layout: Layout = read_layout(&a.guest)?;
    let ranges = cpu_time_ranges(&a.guest, &layout)?;
    let cpus = trace_cpus(&layout, &ranges);
    let mut timeline = None;
    let (m, vm) = mapping(a, cpus, &mut timeline)?;
    let AttachPlan {
        mode,
        cpus: segs,
        deviation,
    } = plan(&m, cpus, &ranges).map_err(CliError::Usage)?;
    if let Some(deviation) = deviation {
        eprintln!(
            "vmtsync: interpolating between {} sync points: the lines between them depart from the sync file's per-segment conversion by up to {deviation} ticks over the trace (0 with no offset change; without --interpolate each segment's offset holds until the next)",
            segs.first().map_or(0, Vec::len)
        );
    }
    // trace-cmd 3.1.6 gives instance buffers a handle without the file's time sync
    // (docs/attach.md): their events keep their guest timestamps.
    let instances: Vec<&str> = layout
        .buffers
        .iter()
        .filter(|b| !b.name.is_empty() && b.cpus.iter().any(|c| c.size > 0))
        .map(|b| b.name.as_str())
        .collect();
    if !instances.is_empty() {
        eprintln!(
            "vmtsync: warning: {} has events in instance buffers ({}): trace-cmd applies TIME_SHIFT to the top buffer only, so those keep guest time",
            a.guest.display(),
            instances.join(", ")
        );
    }
    // The host's TRACEID is the TIME_SHIFT's peer id.
    let host = match a.host.paths() {
        Some((input, output)) => {
            let (vm_name, pids) = match &vm {
                Some((n, p)) => (Some(n.clone()), p.clone()),
                None => (None, a.vcpu_pid.clone()),
            };
            let name = a.guest_name.clone().or(vm_name).unwrap_or_else(|| {
                a.guest
                    .file_stem()
                    .map_or_else(|| "guest".into(), |s| s.to_string_lossy().into_owned())
            });
            // The GUEST option maps guest CPUs 0..count to threads (trace-cmd drops it
            // otherwise): checked before anything is written.
            let mut cpus_given: Vec<u32> = pids.iter().map(|p| p.0).collect();
            cpus_given.sort_unstable();
            if cpus_given.is_empty()
                || cpus_given
                    .iter()
                    .copied()
                    .ne(0..u32::try_from(cpus_given.len()).unwrap_or(0))
            {
                return Err(CliError::Usage(format!(
                    "--host-trace needs the host thread of each guest CPU 0..N once (from --vm or --vcpu-pid CPU=PID), got CPUs {cpus_given:?}"
                )));
            }
            Some((input, output, name, pids))
        }
        _ => None,
    };
    let mut shift = TimeShift {
        peer_trace_id: 0,
        mode,
        cpus: segs,
    };
    let mut host_summary = None;
    if let Some((input, output, name, pids)) = &host {
        let host_layout = read_layout(input)?;
        shift.peer_trace_id = host_layout.trace_id().unwrap_or(0);
        host_summary = Some((input, output, name, pids, host_layout));
    }
    let s = tracedat::attach_time_shift(&a.guest, &a.output, &layout, &ranges, &shift, a.max_error)
        .map_err(|e| match e {
            TraceDatError::TimeShift(TimeShiftError::AboveLimit { cpu, bound, limit }) => {
                CliError::ShiftTooCoarse { cpu, bound, limit }
            }
            e => e.into(),
        })?;
    let worst = s.max_error.iter().max().copied().unwrap_or(0);
    println!(
        "wrote {}: v{} trace{}, TIME_SHIFT ({}) for {} CPUs ({} samples), worst-case error {} ticks, guest TRACEID {:#x}{}",
        s.path.display(),
        s.version,
        s.compression.as_deref().map_or(String::new(), |c| format!(
            " ({c} sections copied as they are)"
        )),
        match mode {
            ShiftMode::Step => "step",
            ShiftMode::Interpolate => "interpolated",
        },
        s.samples.len(),
        s.samples
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("/"),
        worst,
        s.guest_trace_id,
        if s.added_trace_id { " (added)" } else { "" },
    );
    if let Some((input, output, name, pids, _)) = host_summary {
        let mut vcpu_pids = pids.clone();
        vcpu_pids.sort_unstable();
        let guest = GuestInfo {
            name: name.clone(),
            trace_id: s.guest_trace_id,
            vcpu_pids,
        };
        let c = tracedat::copy_host_trace(input, output, &guest, None)?;
        println!(
            "wrote {}: a copy of {} with the GUEST option for {} ({} vCPU threads): trace-cmd report -i {} -i {}",
            c.path.display(),
            input.display(),
            guest.name,
            guest.vcpu_pids.len(),
            c.path.display(),
            s.path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_pid_pairs_parse() {
        assert_eq!(parse_cpu_pid("1=4242"), Ok((1, 4242)));
        assert!(parse_cpu_pid("1:4242").is_err());
        assert!(parse_cpu_pid("x=1").is_err());
    }
}
