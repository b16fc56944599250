//! `vmtsync-probe-bench`: our bounded offset estimator against trace-cmd's fastest-RTT
//! estimator, on the same real probe samples, on this machine's KVM (`cargo xtask bench-probe`).
//!
//! The guest agent answers `K` sessions of `N` compact probes each, through
//!
//! - the built-in VMM's COM1 (ring-3 agent, `ring=3 syncport=off`), bracketed three ways (see
//!   [`builtin`]): by the VM exits around the reply's first byte (`exit-tight`), by the exits
//!   of the request's last read and the reply's first write (`exit-loose`), and by this
//!   thread's own TSC reads around queueing and receiving the whole reply (`host-thread`) or
//!   its first byte (`host-thread-first`);
//! - QEMU's COM1 on a stdio chardev, bracketed by `rdtsc` around `write()` and the `read()`
//!   that completed the reply (`…/stdio`) or returned its first bytes (`…/stdio-first`), and,
//!   on the same probes, by the host kernel's `kvm:kvm_pio` stamps of the vCPU's COM1 exits
//!   (`…/kvm-pio`, what `vmtsync probe --anchor kvm-pio` uses), see [`qemu`]; then, in two
//!   more VMs booted with `syncport=0x2400`, by the agent's sync-port exits around its TSC
//!   read with its loop in ring 3 (`…/sync-port`) and in ring 0 (`…/sync-port-ring0`);
//! - virtio-vsock (QEMU q35, vhost-device-vsock), bracketed around the socket calls
//!   (`vsock/stream`) and, on the same probes, by the agent's sync-port exits
//!   (`vsock/sync-port`), see [`vsock`];
//! - the built-in VMM again with the agent's software skew (`skew=OFFSET,RATIO,FRAC`), so the
//!   truth is a non-identity line (`skew/…`);
//! - virtio-vsock under QEMU microvm (vhost-device-vsock), with the skew, where one-way delays
//!   vary from probe to probe (see [`vsock`]): sessions of trace-cmd's own 339 probes
//!   (`vsock/339`: every estimator on all of them, trace-cmd's histogram at its default) and
//!   the first `N` probes of each (`vsock/N`: our default round on the same samples).
//!
//! Truth: each VM's KVM mapping read from debugfs right after its ready beacon, composed with
//! the skew the agent was told to apply (`vmtsync_tests::truth`; by default `Skew::pick`, an
//! offset derived from the host TSC at the time and a rate of 1.0001). KVM's nested
//! composition is exact when KVM's mapping has offset 0 and ratio 1 and within a few ticks of
//! the agent's sequential arithmetic otherwise. Nothing assumes this host's guest TSC == host
//! TSC (docs/host-quirks.md). Every path is driven by vmtsync's own `ProbeSession` (hello,
//! compact probes unwrapped in their window, shutdown) over a rig transport that records every
//! stamp of each exchange (`vmtsync_tests::vmm::client`). Each session's samples go to what `vmtsync probe` reports
//! as guaranteed ("ours": `DriftEstimator::offset_bounds_at_within` the session's rate limits,
//! interval and centre), `DriftEstimator::estimate` (rate and offset bounds) and
//! `trace_cmd_fastest`; the table reports
//! median |error| over sessions, their ratio, interval widths, whether every interval contained
//! the truth, probe bracket widths and the bytes each probe put on the wire. The last line is
//! one JSON object (schema `vmtsync-probe-bench/1`, documented in [`report`]).
//!
//! Usage: `vmtsync-probe-bench [--sessions K] [--probes N] [--machine microvm|q35] [--no-qemu] [--no-vsock]
//! [--no-skew] [--skew OFFSET,RATIO,FRAC]`, or `vmtsync-probe-bench --record`: instead of the
//! probe rows, `vmtsync record` under each boot configuration of [`record`] (event and round
//! widths, errors against the truth), ending in one JSON line (schema
//! `vmtsync-probe-bench-record/1`).
//!
//! Exit codes: 0 when every guaranteed interval contained the truth; 3 when one did not (a
//! soundness bug: the table says where); 2 on usage errors; 1 when the benchmark could not run.

mod builtin;
mod qemu;
mod record;
mod report;
mod stats;
mod vsock;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync::exits::{COM1_DATA, DEFAULT_SYNC_PORT, Matcher};
use vmtsync::link::StampedTransport;
use vmtsync::probe::ProbeSession;
use vmtsync_core::estimate::{ProbeSample, TRACE_CMD_PTP_SYNC_LOOP};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::proto::Message;
use vmtsync_core::{GuestTicks, HostTicks};
use vmtsync_tests::truth::{GuestTruth, Skew};
use vmtsync_tests::vmm::agent_elf;
use vmtsync_tests::vmm::qemu::{Machine, have_qemu};
use vmtsync_tests::{have_kvm, is_ci};

use report::Report;
use stats::{Row, Truth, evaluate};

/// The longest any single wait (boot, reply) may take.
pub const STEP: Duration = Duration::from_secs(20);

const USAGE: &str = "\
usage: vmtsync-probe-bench [--sessions K] [--probes N] [--machine microvm|q35] [--no-qemu]
                           [--no-skew] [--skew OFFSET,RATIO,FRAC] [--no-vsock]
                           [--vsock-probes M]
  --sessions K      sessions per path (default 30); each is a hello and N probes
  --probes N        compact probes per session (default 64)
  --machine M       QEMU machine: microvm (default) or q35 (with qboot)
  --no-qemu         skip the QEMU stdio path
  --no-skew         skip the software-skew path
  --skew O,R,F      agent skew: guest = O + ((tsc * R) >> F) (default: offset derived
                    from the host TSC now, rate 281503124208327/2^48 = 1.0001)
  --no-vsock        skip both virtio-vsock paths (vhost-device-vsock): the sync-port path
                    (QEMU q35) and the estimator comparison (QEMU microvm)
  --record         instead of the probe rows: `vmtsync record` (the CLI binary next to this
                    one) under each boot configuration, event and round interval widths and
                    errors against the truth, one JSON line (vmtsync-probe-bench-record/1)
  --vsock-probes M  probes per vsock session (default 339, trace-cmd's PTP_SYNC_LOOP); the
                    vsock rows are all M probes and the first N of each session";

/// A rig transport that records every host stamp of its last exchange.
pub trait Recorded: StampedTransport {
    /// The stamps it records per exchange.
    type Stamps: Copy;
    /// The last exchange's stamps, request bytes and reply bytes.
    fn last(&self) -> (Self::Stamps, usize, usize);
}

/// One probe: the guest TSC the session verified and the link's stamps.
#[derive(Debug, Clone, Copy)]
pub struct Probe<S> {
    /// The full guest TSC the agent reported (unwrapped by the session).
    pub guest: u64,
    /// Host TSC stamps around it.
    pub stamps: S,
    /// Request bytes on the wire.
    pub sent: usize,
    /// Reply bytes on the wire.
    pub received: usize,
}

/// One session: a hello, then probes.
#[derive(Debug, Clone)]
pub struct Session<S> {
    /// The TSC frequency the agent reported in its capabilities.
    pub tsc_khz: Option<u32>,
    /// The agent's vCPU.
    pub vcpu: u32,
    /// The probes in order.
    pub probes: Vec<Probe<S>>,
}

impl<S: Copy> Session<S> {
    /// The session's samples under the bracket `pick(stamps) = (host_send, host_recv)`.
    pub fn samples(&self, pick: impl Fn(&S) -> (u64, u64)) -> Vec<ProbeSample> {
        self.probes
            .iter()
            .map(|p| {
                let (send, recv) = pick(&p.stamps);
                ProbeSample {
                    host_send: HostTicks(send),
                    guest: GuestTicks(p.guest),
                    host_recv: HostTicks(recv),
                    vcpu: self.vcpu,
                }
            })
            .collect()
    }
}

/// Runs `sessions` vmtsync probe sessions of a hello and `probes` probes each over
/// `transport` (back to back, so every probe after the hello is compact), then shuts the agent
/// down. A lost probe (a reply the session could not verify) is asked again, up to as many
/// times as the session has probes; more fails the run.
///
/// # Errors
/// The session's errors, lost probes, a shutdown not answered with `Exiting`.
pub fn run_sessions<T: Recorded>(
    transport: &mut T,
    sessions: usize,
    probes: usize,
) -> Result<Vec<Session<T::Stamps>>> {
    let mut out = Vec::with_capacity(sessions);
    for k in 0..sessions {
        let mut session = ProbeSession::hello(&mut *transport, STEP)?;
        let mut got = Vec::with_capacity(probes);
        let mut lost = 0;
        while got.len() < probes {
            // A reply the session could not verify (late beyond the unwrap window on a loaded
            // host) is no sample: ask again, but not forever.
            let Some(sample) = session.probe()? else {
                lost += 1;
                if lost > probes {
                    bail!(
                        "session {k}: {lost} probes lost for {} samples: {:?}",
                        got.len(),
                        session.stats()
                    );
                }
                eprintln!(
                    "session {k}: a probe was lost, asking again: {:?}",
                    session.stats()
                );
                continue;
            };
            let (stamps, sent, received) = session.transport().last();
            got.push(Probe {
                guest: sample.guest.0,
                stamps,
                sent,
                received,
            });
        }
        out.push(Session {
            tsc_khz: session.info().tsc_khz,
            vcpu: session.info().vcpu,
            probes: got,
        });
        if k + 1 == sessions {
            let (bye, _) = session.request(&Message::Shutdown)?;
            if bye != Message::Exiting {
                bail!("shutdown answered with {bye:?}");
            }
        }
    }
    Ok(out)
}

/// Evaluates every session under one bracket and aggregates a row.
fn row<S: Copy>(
    name: &str,
    sessions: &[Session<S>],
    truth: Truth,
    pick: impl Fn(&S) -> (u64, u64) + Copy,
) -> Result<Row> {
    let probes = sessions.first().map_or(0, |s| s.probes.len());
    let evals = sessions
        .iter()
        .map(|s| evaluate(&s.samples(pick), truth).map_err(|e| anyhow::anyhow!("{name}: {e:?}")))
        .collect::<Result<Vec<_>>>()?;
    Ok(Row::aggregate(name, probes, truth, &evals))
}

/// The median over sessions of the fewest leading probes whose guaranteed interval is at most
/// twice as wide as the whole session's: how few probes this bracket needs.
fn probes_to_2x<S: Copy>(
    sessions: &[Session<S>],
    truth: Truth,
    pick: impl Fn(&S) -> (u64, u64) + Copy,
) -> Result<Option<u64>> {
    let mut needed = Vec::with_capacity(sessions.len());
    for s in sessions {
        let samples = s.samples(pick);
        let width = |n: usize| -> Result<Option<u64>> {
            Ok(evaluate(&samples[..n], truth)
                .map_err(|e| anyhow::anyhow!("{e:?}"))?
                .ours_width)
        };
        let Some(full) = width(samples.len())? else {
            continue;
        };
        for n in 1..=samples.len() {
            if width(n)?.is_some_and(|w| w <= full.saturating_mul(2)) {
                needed.push(n as u64);
                break;
            }
        }
    }
    Ok(stats::median(&needed))
}

/// The per-probe request and reply sizes seen, as `(min, max)` each.
fn wire_bytes<S>(sessions: &[Session<S>]) -> ((usize, usize), (usize, usize)) {
    let all = sessions.iter().flat_map(|s| s.probes.iter());
    let (mut req, mut rep) = ((usize::MAX, 0), (usize::MAX, 0));
    for p in all {
        req = (req.0.min(p.sent), req.1.max(p.sent));
        rep = (rep.0.min(p.received), rep.1.max(p.received));
    }
    (req, rep)
}

/// Parsed command line.
#[derive(Debug, Clone)]
struct Args {
    sessions: usize,
    probes: usize,
    machine: Machine,
    qemu: bool,
    skew: Option<SkewArg>,
    /// Probes per vsock session; `None` skips the path.
    vsock: Option<usize>,
    /// `--record`: the record comparison instead of the probe rows.
    record: bool,
}

/// Which skew the skewed path's agent applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SkewArg {
    /// [`Skew::pick`]: derived from the host TSC when the path runs (the default).
    Pick,
    /// `--skew O,R,F`.
    Given(Skew),
}

/// The bench's truth line for a mapping.
fn bench_truth(m: KvmTscMapping) -> Truth {
    Truth {
        offset: m.offset().cast_unsigned(),
        ratio: m.ratio(),
        frac: m.frac_bits(),
    }
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut a = Args {
        sessions: 30,
        probes: 64,
        machine: Machine::Microvm,
        qemu: true,
        skew: Some(SkewArg::Pick),
        vsock: Some(TRACE_CMD_PTP_SYNC_LOOP),
        record: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--sessions" => a.sessions = value()?.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--probes" => a.probes = value()?.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--machine" => {
                a.machine = match value()?.as_str() {
                    "microvm" => Machine::Microvm,
                    "q35" => Machine::Q35,
                    m => return Err(format!("unknown machine {m}")),
                }
            }
            "--no-qemu" => a.qemu = false,
            "--no-skew" => a.skew = None,
            "--no-vsock" => a.vsock = None,
            "--record" => a.record = true,
            "--vsock-probes" => {
                a.vsock = Some(value()?.parse().map_err(|e| format!("{flag}: {e}"))?);
            }
            "--skew" => {
                a.skew = Some(SkewArg::Given(
                    Skew::parse(value()?).ok_or("bad --skew value")?,
                ));
            }
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    if a.sessions == 0 || a.probes < 2 || a.probes > 65_536 {
        return Err("need --sessions >= 1 and 2 <= --probes <= 65536".into());
    }
    if a.vsock.is_some_and(|m| m < a.probes || m > 65_536) {
        return Err("need --probes <= --vsock-probes <= 65536".into());
    }
    Ok(a)
}

/// The TSC frequency from `/proc/cpuinfo`'s first `cpu MHz` line, in kHz (fallback when the
/// agent does not report one).
fn cpuinfo_khz() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = text.lines().find(|l| l.starts_with("cpu MHz"))?;
    let (int, frac) = mhz.split(':').nth(1)?.trim().split_once('.')?;
    let frac3: String = frac.chars().chain("000".chars()).take(3).collect();
    Some(int.parse::<u64>().ok()? * 1000 + frac3.parse::<u64>().ok()?)
}

fn bench(args: &Args) -> Result<Report> {
    if !have_kvm() {
        bail!("/dev/kvm is not accessible read-write (run as root on a KVM host)");
    }
    let started = Instant::now();
    let elf = agent_elf().context("building the guest agent")?;
    eprintln!(
        "agent built in {:.1?}: {}",
        started.elapsed(),
        elf.display()
    );
    let mut rows = Vec::new();

    let t = Instant::now();
    // The ring-3 agent without a sync port: `exit-tight` rests on no exit between its TSC read
    // and its reply's first byte.
    let builtin_boot = "transport=uart ring=3 syncport=off";
    let (s, kvm) = builtin::run(&elf, builtin_boot, args.sessions, args.probes)?;
    eprintln!(
        "built-in VMM: {} sessions in {:.1?}; KVM mapping {kvm:?}",
        s.len(),
        t.elapsed()
    );
    let khz_agent = s.first().and_then(|x| x.tsc_khz);
    let wire = wire_bytes(&s);
    let id = bench_truth(kvm);
    rows.push(row("builtin/exit-tight", &s, id, |x| {
        (x.prev_exit, x.first_byte)
    })?);
    rows.push(row("builtin/exit-loose", &s, id, |x| {
        (x.request_read, x.first_byte)
    })?);
    rows.push(row("builtin/host-thread", &s, id, |x| {
        (x.thread_send, x.thread_recv)
    })?);
    rows.push(row("builtin/host-thread-first", &s, id, |x| {
        (x.thread_send, x.thread_first)
    })?);

    let mut qemu_wire = None;
    let mut anchoring = None;
    if args.qemu {
        if !have_qemu() {
            if is_ci() {
                bail!("qemu-system-x86_64 is missing (apt-get install qemu-system-x86)");
            }
            eprintln!("SKIP qemu-stdio: qemu-system-x86_64 is missing (or pass --no-qemu)");
        } else {
            let t = Instant::now();
            let uart = Matcher::Uart { port: COM1_DATA };
            // The UART bytes' own bracket: the agent's default sync port would add its two
            // exits inside it, and its default ring 0 (emulated on nested KVM) would put the
            // request's decoding, thousands of emulated instructions, inside it too.
            let (q, kvm) = qemu::run(
                &elf,
                args.machine,
                "ring=3 syncport=off",
                uart,
                args.sessions,
                args.probes,
            )?;
            eprintln!(
                "QEMU {:?}: {} sessions in {:.1?}; KVM mapping {kvm:?}",
                args.machine,
                q.len(),
                t.elapsed()
            );
            let id = bench_truth(kvm);
            qemu_wire = Some(wire_bytes(&q));
            let name = match args.machine {
                Machine::Microvm => "qemu-microvm",
                Machine::Q35 => "qemu-q35",
            };
            let stdio = format!("{name}/stdio");
            rows.push(row(&stdio, &q, id, |x| (x.pipe.send, x.pipe.recv))?);
            rows.push(row(&format!("{name}/stdio-first"), &q, id, |x| {
                (x.pipe.send, x.pipe.first_recv)
            })?);
            // What `vmtsync probe --anchor kvm-pio` uses: the `in` that completed the request
            // and the reply's first `out` (docs/anchor.md).
            let tight = |x: &qemu::Stamps| (x.exits.delimiter_in, x.exits.first_out);
            rows.push(row(&format!("{name}/kvm-pio"), &q, id, tight)?);
            anchoring = Some(stats::Anchoring {
                baseline: stdio,
                probes_to_2x: [
                    (
                        format!("{name}/stdio"),
                        probes_to_2x(&q, id, |x| (x.pipe.send, x.pipe.recv))?,
                    ),
                    (format!("{name}/kvm-pio"), probes_to_2x(&q, id, tight)?),
                ]
                .into(),
            });
            // The boot vCPU's own sync-port bracket on the same UART transport, with the
            // protocol loop in ring 3 (the default) and in ring 0, where this host's nested
            // KVM emulates the guest and its exits are cheap (docs/anchor.md).
            for (suffix, ring) in [("sync-port", 3), ("sync-port-ring0", 0)] {
                let t = Instant::now();
                let append = format!("ring={ring} syncport={DEFAULT_SYNC_PORT:#x}");
                let sync = Matcher::SyncPort {
                    port: DEFAULT_SYNC_PORT,
                };
                let (q, kvm) = qemu::run(
                    &elf,
                    args.machine,
                    &append,
                    sync,
                    args.sessions,
                    args.probes,
                )?;
                eprintln!(
                    "QEMU {:?}, {append}: {} sessions in {:.1?}; KVM mapping {kvm:?}",
                    args.machine,
                    q.len(),
                    t.elapsed()
                );
                let id = bench_truth(kvm);
                let anchored = |x: &qemu::Stamps| x.anchored;
                let row_name = format!("{name}/{suffix}");
                rows.push(row(&row_name, &q, id, anchored)?);
                if let Some(a) = &mut anchoring {
                    a.probes_to_2x
                        .push((row_name, probes_to_2x(&q, id, anchored)?));
                }
            }
        }
    }

    // The vsock transport with the sync port, the agent's loop in ring 3 (the default) and in
    // ring 0 (`ring=0`: where ring-0 code is emulated, its port exits are the cheap ones;
    // docs/anchor.md). The in-process stream row comes from the first.
    let vsock_configs = [
        ("", "vsock/sync-port", true),
        ("ring=0", "vsock/sync-port-ring0", false),
    ];
    for (append, sync_name, with_stream) in vsock_configs {
        if args.vsock.is_none() || !have_qemu() {
            break;
        }
        let t = Instant::now();
        match vsock::run_sync_port(&elf, append, args.sessions, args.probes) {
            Ok((v, kvm)) => {
                eprintln!(
                    "vsock (q35) {append}: {} sessions in {:.1?}; KVM mapping {kvm:?}",
                    v.len(),
                    t.elapsed()
                );
                let id = bench_truth(kvm);
                let stream = |x: &vsock::Stamps| (x.stream.send.0, x.stream.recv.0);
                let sync = |x: &vsock::Stamps| (x.exits.send.0, x.exits.recv.0);
                if with_stream {
                    rows.push(row("vsock/stream", &v, id, stream)?);
                }
                rows.push(row(sync_name, &v, id, sync)?);
                if let Some(a) = &mut anchoring {
                    if with_stream {
                        a.probes_to_2x
                            .push(("vsock/stream".into(), probes_to_2x(&v, id, stream)?));
                    }
                    a.probes_to_2x
                        .push((sync_name.into(), probes_to_2x(&v, id, sync)?));
                }
            }
            // The backend is built on first use and may be missing offline: the other paths
            // still count.
            Err(e) if !is_ci() => eprintln!("SKIP vsock {append}: {e:#}"),
            Err(e) => return Err(e),
        }
    }

    let mut skew_used = None;
    if let Some(arg) = args.skew {
        // The default is picked now, from the host TSC at the time, so it never wraps the
        // reported TSC (a constant such as -3e12 does on a host booted minutes ago).
        let skew = match arg {
            SkewArg::Pick => Skew::pick(),
            SkewArg::Given(s) => s,
        };
        let cmdline = format!("{builtin_boot} {}", skew.agent_option());
        let t = Instant::now();
        let (s, kvm) = builtin::run(&elf, &cmdline, args.sessions, args.probes)?;
        eprintln!(
            "built-in VMM, {cmdline}: {} sessions in {:.1?}; KVM mapping {kvm:?}",
            s.len(),
            t.elapsed()
        );
        let truth = bench_truth(
            GuestTruth::new(kvm, Some(skew))
                .composed()
                .context("composing KVM's mapping with the skew")?,
        );
        rows.push(row("skew/exit-tight", &s, truth, |x| {
            (x.prev_exit, x.first_byte)
        })?);
        rows.push(row("skew/exit-loose", &s, truth, |x| {
            (x.request_read, x.first_byte)
        })?);
        skew_used = Some(bench_truth(skew.0));
    }

    let mut vsock_wire = None;
    if let Some(m) = args.vsock {
        // The vsock path has its own skew (picked now, like the skew path's), or none with
        // --no-skew: its truth is then KVM's mapping alone.
        let skew = match args.skew {
            Some(SkewArg::Pick) => Some(Skew::pick()),
            Some(SkewArg::Given(s)) => Some(s),
            None => None,
        };
        let options = skew.map_or_else(String::new, |s| s.agent_option());
        let t = Instant::now();
        let (v, kvm) = vsock::run_plain(&elf, &options, args.sessions, m)?;
        eprintln!(
            "QEMU microvm, vsock, {options}: {} sessions of {m} probes in {:.1?}; KVM mapping \
             {kvm:?}",
            v.len(),
            t.elapsed()
        );
        let truth = bench_truth(
            GuestTruth::new(kvm, skew)
                .composed()
                .context("composing KVM's mapping with the skew")?,
        );
        vsock_wire = Some(wire_bytes(&v));
        let pick = |x: &vmtsync::link::FrameStamps| (x.send.0, x.recv.0);
        rows.push(row(&format!("vsock/{m}"), &v, truth, pick)?);
        if args.probes < m {
            let first: Vec<_> = v
                .iter()
                .map(|s| Session {
                    probes: s.probes[..args.probes].to_vec(),
                    ..s.clone()
                })
                .collect();
            rows.push(row(&format!("vsock/{}", args.probes), &first, truth, pick)?);
        }
    }

    let tsc_khz = khz_agent
        .map(u64::from)
        .or_else(cpuinfo_khz)
        .context("no TSC frequency from the agent or /proc/cpuinfo")?;
    Ok(Report {
        tsc_khz,
        tsc_khz_source: if khz_agent.is_some() {
            "agent"
        } else {
            "cpuinfo"
        },
        sessions: args.sessions,
        probes: args.probes,
        skew: skew_used,
        builtin_wire: wire,
        qemu_wire,
        vsock_wire,
        rows,
        anchoring,
        run_time: started.elapsed(),
    })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmtsync-probe-bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if args.record {
        return record::main();
    }
    match bench(&args) {
        Ok(report) => {
            print!("{}", report.table());
            println!("{}", report.json());
            let unsound = report.unsound();
            if unsound.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "vmtsync-probe-bench: a guaranteed interval missed the truth in: {}",
                    unsound.join(", ")
                );
                ExitCode::from(3)
            }
        }
        Err(e) => {
            eprintln!("vmtsync-probe-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, String> {
        parse_args(&v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_flags_and_rejects_nonsense() {
        let a = args(&[]).unwrap();
        assert_eq!((a.sessions, a.probes, a.qemu), (30, 64, true));
        assert_eq!(a.skew, Some(SkewArg::Pick));
        assert_eq!(a.vsock, Some(339));
        let a = args(&["--sessions", "3", "--probes", "8", "--no-qemu", "--no-skew"]).unwrap();
        assert_eq!((a.sessions, a.probes, a.qemu, a.skew), (3, 8, false, None));
        let a = args(&["--no-vsock"]).unwrap();
        assert_eq!(a.vsock, None);
        assert_eq!(args(&["--vsock-probes", "100"]).unwrap().vsock, Some(100));
        assert!(
            args(&["--vsock-probes", "10"]).is_err(),
            "fewer than --probes"
        );
        let a = args(&["--skew", "-5,3,1", "--machine", "q35"]).unwrap();
        assert_eq!(a.machine, Machine::Q35);
        assert_eq!(
            a.skew,
            Some(SkewArg::Given(Skew(
                KvmTscMapping::try_new(-5, 3, 1).unwrap()
            )))
        );
        assert!(args(&["--probes", "1"]).is_err());
        assert!(args(&["--sessions"]).is_err());
        assert!(args(&["--skew", "1,0,4"]).is_err());
        assert!(args(&["--bogus"]).is_err());
    }

    #[test]
    fn default_skew_is_a_hundred_ppm() {
        // (ratio - 2^48) / 2^48 in ppb, floored.
        let r = Skew::pick().0.ratio();
        let ppb = (u128::from(r - (1 << 48)) * 1_000_000_000) >> 48;
        assert_eq!(ppb, 99_999);
    }
}
