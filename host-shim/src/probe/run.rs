//! One `vmtsync probe` run: the options, connecting, the hello, one round or continuous mode,
//! the report.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use vmtsync_core::estimate::EstimateError;

use super::anchor::{self, AnchorMode, AnchorOptions};
use super::console::ConsoleLog;
use super::continuous::{self, ContinuousOptions};
use super::error::ProbeError;
use super::log::ProbeLog;
use super::progress::Progress;
use super::report::ProbeSummary;
use super::session::ProbeSession;
use crate::link::ConnectOptions;
use crate::link::addr::ProbeAddr;
use crate::link::connect::{self};
use crate::link::transport::StampedTransport;

/// Default number of probes per round.
pub const DEFAULT_PROBES: u32 = 64;

/// Everything `vmtsync probe` needs; build with [`ProbeOptions::new`] and adjust fields.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// Where the agent is.
    pub addr: ProbeAddr,
    /// Probes per round (`--probes`, default 64).
    pub probes: u32,
    /// Pause between probes (`--interval-ms`, default 0: back to back).
    pub interval: Duration,
    /// The longest wait for any reply (`--timeout-ms`, default 2 s).
    pub timeout: Duration,
    /// The longest wait to connect, retries included (default 10 s).
    pub connect_timeout: Duration,
    /// Print the schema-2 JSON object instead of text (`--json`).
    pub json: bool,
    /// Which vCPUs to sync (`--vcpu N`, `--all-vcpus`; default the agent's own).
    pub vcpus: VcpuChoice,
    /// Show progress on stderr when it is a terminal.
    pub progress: bool,
    /// Continuous mode (`--continuous --out FILE`), or one round.
    pub continuous: Option<ContinuousOptions>,
    /// Set from another thread or a signal handler (e.g. the CLI's `static STOP`): ends
    /// continuous mode after the current round, and otherwise abandons the connect, hello or
    /// round within about 20 ms with [`ProbeError::Interrupted`].
    pub stop: Option<&'static AtomicBool>,
    /// End the agent when done (`--shutdown`): send `Shutdown` and wait for `Exiting`. Off by
    /// default: probing must not stop the guest being traced; the agent then serves the next
    /// session's hello.
    pub shutdown: bool,
    /// Exit anchoring (`--anchor`; off by default here, `auto` in the CLI).
    pub anchor: AnchorOptions,
    /// Append every probe that gives a sample to this file (`--probe-log`, for `vmtsync
    /// validate --probe-log`).
    pub probe_log: Option<PathBuf>,
    /// Append the guest's console text to this file (`--console`, [`super::console`]).
    pub console: Option<PathBuf>,
}

impl ProbeOptions {
    /// Defaults: 64 back-to-back probes, 2 s reply timeout, 10 s connect timeout, text
    /// output, progress on a terminal, one round.
    #[must_use]
    pub fn new(addr: ProbeAddr) -> Self {
        Self {
            addr,
            probes: DEFAULT_PROBES,
            interval: Duration::ZERO,
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            json: false,
            vcpus: VcpuChoice::Agent,
            progress: true,
            continuous: None,
            stop: None,
            shutdown: false,
            anchor: AnchorOptions::default(),
            probe_log: None,
            console: None,
        }
    }
}

/// Connects to `opts.addr`, sets up exit anchoring as `opts.anchor` says (notes on stderr)
/// and runs [`run_probe_on`].
///
/// # Errors
/// [`ProbeError`]; [`ProbeError::Anchor`] when `--anchor kvm-pio` cannot be done, or no
/// exchange's exits were found.
pub fn run_probe(opts: &ProbeOptions, out: &mut dyn Write) -> Result<ProbeSummary, ProbeError> {
    let note = &mut |m: &str| eprintln!("vmtsync: probe: {m}");
    let setup = anchor::prepare(&opts.addr, &opts.anchor, opts.connect_timeout, note)?;
    let transport = connect::connect_until_stopped(
        &opts.addr,
        &ConnectOptions {
            connect_timeout: opts.connect_timeout,
            io_timeout: opts.timeout,
        },
        opts.stop,
    )?;
    let mut t = setup.wrap(transport);
    let r = run_probe_on(&mut t, opts, out);
    if let Some(why) = t.gave_up() {
        note(&format!(
            "not exit-anchored: the agent's first exchange was not among the VM's UART exits ({}); host stamps were taken in this process",
            why.describe()
        ));
    }
    match r {
        Err(ProbeError::Estimate(EstimateError::NoSamples))
            if opts.anchor.mode == AnchorMode::KvmPio && t.stats().matched == 0 =>
        {
            let how = match anchor::matcher_for(&opts.addr, &opts.anchor) {
                crate::exits::Matcher::Uart { port } => format!("the UART at {port:#x}"),
                crate::exits::Matcher::SyncPort { port } => {
                    format!("the sync port {port:#x} (boot the agent with syncport={port:#x})")
                }
            };
            let a = t.stats();
            Err(ProbeError::Anchor(format!(
                "no probe's exits were found among the kvm_pio events of the VM's threads on {how} (dropped: {} without the request's reads, {} without the reply's writes, {} with the reply before the request, {} while kvm_pio events were lost or unread, {} without frames): is the agent in that VM (--vm)?",
                a.no_request, a.no_reply, a.disordered, a.trace_lost, a.no_frames
            )))
        }
        r => r,
    }
}

/// [`run_probe_vcpus_on`], returning the (last) round's summary of the last vCPU.
///
/// # Errors
/// [`ProbeError`]; in continuous mode, `Estimate(NoSamples)` if no round produced a sample.
pub fn run_probe_on<T: StampedTransport>(
    transport: T,
    opts: &ProbeOptions,
    out: &mut dyn Write,
) -> Result<ProbeSummary, ProbeError> {
    last_of(run_probe_vcpus_on(transport, opts, out)?)
}

fn last_of(mut all: Vec<ProbeSummary>) -> Result<ProbeSummary, ProbeError> {
    all.pop()
        .ok_or(ProbeError::Internal("a probe run synced no vCPU"))
}

/// Runs hello, then for each vCPU of `opts.vcpus` one round of `opts.probes` (printing its
/// report: one JSON object per vCPU under `--json`), or continuous mode (one vCPU); then
/// shuts the session down. Returns each vCPU's (last) round's summary.
///
/// # Errors
/// [`ProbeError`]; [`ProbeError::UnknownVcpu`] for a vCPU the agent does not serve; in
/// continuous mode, `Estimate(NoSamples)` if no round produced a sample.
pub fn run_probe_vcpus_on<T: StampedTransport>(
    transport: T,
    opts: &ProbeOptions,
    out: &mut dyn Write,
) -> Result<Vec<ProbeSummary>, ProbeError> {
    let mut progress = Progress::stderr_if_terminal(opts.progress);
    let console = opts
        .console
        .as_deref()
        .map(ConsoleLog::create)
        .transpose()?;
    let mut session =
        ProbeSession::hello_until_stopped(transport, opts.timeout, opts.stop, console)?;
    if let Some(path) = &opts.probe_log {
        session.log_probes(ProbeLog::create(path, &opts.addr, &opts.anchor)?);
    }
    let result = vcpus_of(&mut session, opts.vcpus).and_then(|vcpus| {
        if let Some(cont) = &opts.continuous {
            let c = continuous::run(&mut session, opts, cont, &vcpus, out, &mut progress)?;
            return c.last_or_why(opts.stopped()).map(|last| vec![last]);
        }
        let mut all = Vec::with_capacity(vcpus.len());
        for v in vcpus {
            session.select_vcpu(v)?;
            all.push(one_round(&mut session, opts, out, &mut progress)?);
        }
        Ok(all)
    });
    if opts.shutdown {
        session.shutdown();
    }
    result
}

/// The vCPUs `choice` names, checked against the agent's list.
fn vcpus_of<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    choice: VcpuChoice,
) -> Result<Vec<u32>, ProbeError> {
    match choice {
        VcpuChoice::Agent => Ok(vec![session.info().vcpu]),
        VcpuChoice::All => session.vcpus(),
        VcpuChoice::One(v) => {
            let online = session.vcpus()?;
            if online.contains(&v) {
                Ok(vec![v])
            } else {
                Err(ProbeError::UnknownVcpu { vcpu: v, online })
            }
        }
    }
}

fn one_round<T: StampedTransport>(
    session: &mut ProbeSession<T>,
    opts: &ProbeOptions,
    out: &mut dyn Write,
    progress: &mut Progress,
) -> Result<ProbeSummary, ProbeError> {
    let samples = session.probe_round(opts.probes, opts.interval, progress)?;
    let summary = match ProbeSummary::from_samples(session.info(), &samples, session.stats()) {
        Ok(s) => s,
        Err(why) => {
            // Under --json stdout still says what became of the round, in the schema.
            if opts.json {
                ProbeSummary::write_json_refusal(
                    out,
                    session.selected_vcpu(),
                    samples.len(),
                    session.stats(),
                    why,
                )
                .map_err(ProbeError::Output)?;
            }
            return Err(why.into());
        }
    };
    if opts.json {
        summary.write_json(out)
    } else {
        writeln!(out, "vmtsync probe {}", opts.addr).and_then(|()| summary.write_text(out))
    }
    .map_err(ProbeError::Output)?;
    Ok(summary)
}

/// Which vCPUs a probe run syncs (docs/smp.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VcpuChoice {
    /// The vCPU the agent runs on (it says which in its hello).
    #[default]
    Agent,
    /// This vCPU, read on that vCPU.
    One(u32),
    /// Every vCPU the agent serves, one round each, in increasing order.
    All,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::error::refusal_text;
    use crate::probe::testutil::{SimTransport, continuous_into, sim_options, tempdir};
    use crate::syncfile::SyncFile;

    /// A simulated agent on vCPU 3 that also serves vCPUs 0 and 2, each `2^36` ticks apart.
    fn smp_sim() -> SimTransport {
        let mut t = SimTransport::new(1_000);
        t.exact = true;
        let clock = t.agent.clock_mut();
        clock.peers = 0b101;
        clock.peer_offset = 1 << 36;
        t
    }

    #[test]
    fn all_vcpus_prints_one_json_object_per_vcpu_each_on_its_own_clock() {
        let mut opts = sim_options();
        opts.json = true;
        opts.vcpus = VcpuChoice::All;
        let mut out = Vec::new();
        let all = run_probe_vcpus_on(smp_sim(), &opts, &mut out).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let vcpus: Vec<u64> = lines.iter().map(|j| j["vcpu"].as_u64().unwrap()).collect();
        assert_eq!(vcpus, [0, 2, 3]);
        for (s, j) in all.iter().zip(&lines) {
            // Exact stamps: each vCPU's bounds hold its own offset (to the rounding tick).
            let truth = 1_000
                + if s.vcpu == 3 {
                    0
                } else {
                    (1 << 36) * i64::from(s.vcpu)
                };
            assert!(s.bound_lo <= truth && truth <= s.bound_hi, "{s:?}");
            assert_eq!(j["offset_ticks"], s.offset);
        }
    }

    /// Samples that contradict each other (the guest's offset steps by 2^40 ticks mid-round,
    /// as a bracket that missed its read would look) are no lost probes: the error says what
    /// happened, and `--json` still prints the round's object, with an `error` key.
    #[test]
    fn contradictory_samples_are_named_as_such_and_json_still_says_so() {
        let mut t = SimTransport::new(1_000);
        t.exact = true;
        t.step_at = Some((5, 1 << 40));
        let mut opts = sim_options();
        opts.json = true;
        let mut out = Vec::new();
        let err = run_probe_on(t, &opts, &mut out).unwrap_err();
        assert!(
            matches!(err, ProbeError::Estimate(EstimateError::SegmentBreak)),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains("contradict"), "{text}");
        assert!(!text.contains("every probe"), "{text}");
        let j: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(j["schema"], 2);
        assert_eq!(j["error"], "contradictory-samples");
        // The step's first probe lands outside the unwrap window and is lost; the others
        // are the round's samples.
        let n = |k: &str| j[k].as_u64().unwrap();
        assert_eq!((n("sent"), n("probes") + n("lost_probes")), (8, 8));
        assert!(n("probes") >= 6, "{j}");
        assert_eq!(j["message"], refusal_text(EstimateError::SegmentBreak));
    }

    #[test]
    fn the_probe_log_holds_every_vcpus_samples() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("probes.jsonl");
        let mut opts = sim_options();
        opts.vcpus = VcpuChoice::All;
        opts.probe_log = Some(log.clone());
        run_probe_vcpus_on(smp_sim(), &opts, &mut Vec::new()).unwrap();
        let mut vcpus = Vec::new();
        crate::validate::probes::read_probe_log(&log, |e| vcpus.push(e.vcpu)).unwrap();
        assert_eq!(vcpus, [[0; 8], [2; 8], [3; 8]].concat());
    }

    #[test]
    fn one_vcpu_is_checked_against_the_agents_list_and_synced_continuously() {
        let mut opts = sim_options();
        opts.vcpus = VcpuChoice::One(1);
        let err = run_probe_vcpus_on(smp_sim(), &opts, &mut Vec::new()).unwrap_err();
        assert!(
            matches!(err, ProbeError::UnknownVcpu { vcpu: 1, ref online } if online == &[0, 2, 3]),
            "{err}"
        );
        let dir = tempdir();
        let path = dir.path().join("vcpu2.jsonl");
        opts.vcpus = VcpuChoice::One(2);
        opts.continuous = continuous_into(path.clone(), Some(2));
        let last = run_probe_on(smp_sim(), &opts, &mut Vec::new()).unwrap();
        assert_eq!(last.vcpu, 2);
        let sync = SyncFile::read(&path).unwrap();
        assert_eq!(sync.segments.len(), 2);
        for seg in &sync.segments {
            assert_eq!(seg.vcpu, 2);
            assert!(seg.offset_lo <= 1_000 + (2 << 36) && 1_000 + (2 << 36) <= seg.offset_hi);
        }
    }

    #[test]
    fn all_vcpus_continuously_writes_each_vcpus_segments_on_its_own_clock() {
        let dir = tempdir();
        let path = dir.path().join("all.jsonl");
        let mut opts = sim_options();
        opts.vcpus = VcpuChoice::All;
        opts.continuous = continuous_into(path.clone(), Some(3));
        let mut out = Vec::new();
        run_probe_on(smp_sim(), &opts, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("round 2 vCPU 3: offset"), "{text}");
        let sync = SyncFile::read(&path).unwrap();
        // Three rounds of three vCPUs, in vCPU order within each round.
        let order: Vec<(u64, u32)> = sync.segments.iter().map(|g| (g.round, g.vcpu)).collect();
        let want: Vec<(u64, u32)> = (0..3).flat_map(|r| [0, 2, 3].map(|v| (r, v))).collect();
        assert_eq!(order, want);
        assert_eq!(sync.vcpus(), [0, 2, 3]);
        for seg in &sync.segments {
            let truth = 1_000
                + if seg.vcpu == 3 {
                    0
                } else {
                    (1 << 36) * i64::from(seg.vcpu)
                };
            assert!(seg.offset_lo <= truth && truth <= seg.offset_hi, "{seg:?}");
            // Each vCPU's estimate is its own: a vCPU 2^36 ticks away from the one before it
            // never breaks it.
            assert!(!seg.is_break, "{seg:?}");
        }
        // Each vCPU's timeline converts with its own offset.
        for v in [0, 2, 3] {
            assert!(sync.timeline(v).is_ok());
        }
    }
}
