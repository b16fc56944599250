//! `vmtsync probe`: its flags ([`ProbeArgs`]) and the command's glue; the work is in
//! [`crate::probe`] ([`ProbeArgs::to_options`], then [`probe::run_probe`]).

use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Duration;

use super::exit::CliError;
use super::number::hex_or_decimal;
use super::signals::{install_stop_handler, stop_flag};
use super::source::{SourceArgs, mount_if_asked};
use crate::kvm::scan::VmSelector;
use crate::link::addr::ProbeAddr;
use crate::probe::anchor::{AnchorMode, AnchorOptions};
use crate::probe::continuous::ContinuousOptions;
use crate::probe::{self, DEFAULT_PROBES, ProbeOptions, VcpuChoice};

/// `vmtsync probe`: measure a guest's TSC offset and drift against the vmtsync agent, with
/// guaranteed bounds and trace-cmd's estimate on the same samples.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct ProbeArgs {
    /// Where the agent listens: unix:PATH (e.g. a QEMU serial chardev socket), unix-listen:PATH
    /// (accept the guest's connection, e.g. vhost-device-vsock's UDS_PATH_PORT),
    /// vsock-uds:PATH:PORT (vhost-device-vsock's host side), vsock:CID:PORT (AF_VSOCK) or
    /// tcp:HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    pub connect: ProbeAddr,
    /// Probes per round.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PROBES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub probes: u32,
    /// Pause between two probes, in milliseconds (0: back to back).
    #[arg(
        long = "interval-ms",
        alias = "interval",
        value_name = "MS",
        default_value_t = 0
    )]
    pub interval: u64,
    /// The longest wait for any reply from the agent, in milliseconds.
    #[arg(long = "timeout-ms", alias = "timeout", value_name = "MS", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// The longest wait to connect (retries included), in milliseconds.
    #[arg(
        long = "connect-timeout-ms",
        alias = "connect-timeout",
        value_name = "MS",
        default_value_t = 10_000
    )]
    pub connect_timeout: u64,
    /// Re-sync periodically and append one segment per round to the sync file given by --out
    /// (JSON Lines, schema 1); runs until --rounds or Ctrl-C.
    #[arg(long, requires = "out")]
    pub continuous: bool,
    /// The sync file continuous mode appends to (created with a header if missing).
    #[arg(long, value_name = "SYNCFILE", requires = "continuous")]
    pub out: Option<PathBuf>,
    /// Time between the starts of two continuous-mode rounds, in milliseconds.
    #[arg(
        long = "resync-ms",
        alias = "resync",
        value_name = "MS",
        default_value_t = 1000,
        requires = "continuous"
    )]
    pub resync: u64,
    /// Stop continuous mode after this many rounds.
    #[arg(long, value_name = "N", requires = "continuous")]
    pub rounds: Option<u64>,
    /// Print one JSON object per round (schema 2: schema, vcpu, offset_ticks, bound_lo,
    /// bound_hi, model, rate1_lo, rate1_hi, drift_ppb, rtt_min_ticks, probes,
    /// tracecmd_fastest_rtt_offset, ...).
    #[arg(long)]
    pub json: bool,
    /// Sync vCPU N (its APIC id, KVM's `vcpuN`), its TSC read on that vCPU, instead of the
    /// vCPU the agent runs on (docs/smp.md).
    #[arg(long, value_name = "N", conflicts_with = "all_vcpus")]
    pub vcpu: Option<u32>,
    /// Sync every vCPU the agent serves, one round each (one JSON object per vCPU); with
    /// `--continuous`, every vCPU in each round, one segment per vCPU.
    #[arg(long)]
    pub all_vcpus: bool,
    /// End the agent afterwards (it sends `Exiting` and, when booted with `exit=N`, ends
    /// its VM through isa-debug-exit). Without it the agent keeps serving for later sessions.
    #[arg(long)]
    pub shutdown: bool,
    /// Never draw the progress line (it is only drawn when stderr is a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// Where each probe's host bracket comes from: kvm-pio takes it from the host kernel's
    /// kvm:kvm_pio stamps of the guest's own port exits, the UART's on a serial chardev
    /// (unix:PATH), the agent's sync port on other transports (needs root, tracefs and the
    /// VM in KVM debugfs; fails with exit code 8 otherwise); auto does so when --vm
    /// names the VM and it can (saying why not on stderr); none stamps in this process
    /// (docs/anchor.md). The tightest bracket on every vCPU needs only --vm: the bundled
    /// agent's default boot has its sync port on at 0x2400 and its loop in ring 0.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = AnchorMode::Auto)]
    pub anchor: AnchorMode,
    /// The VM the agent runs in, for --anchor (PID, PID-FD or name; --anchor kvm-pio without
    /// it: the only VM in debugfs).
    #[arg(long, value_name = "PID|NAME")]
    pub vm: Option<VmSelector>,
    /// tracefs, for --anchor (default: /sys/kernel/tracing, then /sys/kernel/debug/tracing).
    #[arg(long, value_name = "DIR")]
    pub tracefs: Option<PathBuf>,
    /// The agent's sync port (agent boot option syncport=N, on by default at 0x2400), for
    /// --anchor: every transport's probes are bracketed there; on a serial chardev (unix:PATH)
    /// only when the agent's hello announces a sync port, else on the UART's own exits.
    #[arg(long, value_name = "PORT", default_value = "0x2400", value_parser = parse_port)]
    pub sync_port: u16,
    /// KVM debugfs and /proc, for --anchor.
    #[command(flatten)]
    pub source: SourceArgs,
    /// Append every probe that gave a sample to this file (JSON Lines: vCPU, sequence number,
    /// guest TSC, frames, in-process stamps), so `vmtsync validate --probe-log` can check the
    /// sync against the probes' own kvm_pio exits in a host trace (docs/validate.md).
    #[arg(long, value_name = "FILE")]
    pub probe_log: Option<PathBuf>,
    /// Append the guest's console text to this file, byte for byte: the bytes it prints on
    /// the UART between frames (a guest sharing one UART writes a 0x00 before each frame and
    /// after it; every run that does not decode is text). Without it the text is counted
    /// and dropped.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
}

impl ProbeArgs {
    /// The options for [`super::run_probe`]; `stop` ends continuous mode after the current
    /// round when set (e.g. by the CLI's SIGINT handler).
    #[must_use]
    pub fn to_options(&self, stop: Option<&'static std::sync::atomic::AtomicBool>) -> ProbeOptions {
        let mut o = ProbeOptions::new(self.connect.clone());
        o.probes = self.probes;
        o.interval = Duration::from_millis(self.interval);
        o.timeout = Duration::from_millis(self.timeout);
        o.connect_timeout = Duration::from_millis(self.connect_timeout);
        o.json = self.json;
        o.vcpus = match (self.vcpu, self.all_vcpus) {
            (Some(v), _) => VcpuChoice::One(v),
            (None, true) => VcpuChoice::All,
            (None, false) => VcpuChoice::Agent,
        };
        o.progress = !self.no_progress;
        o.stop = stop;
        o.shutdown = self.shutdown;
        o.anchor = AnchorOptions {
            sync_port: self.sync_port,
            ..self
                .source
                .anchor_options(self.anchor, self.vm.as_ref(), self.tracefs.as_ref())
        };
        o.probe_log = self.probe_log.clone();
        o.console = self.console.clone();
        o.continuous = match (&self.out, self.continuous) {
            (Some(out), true) => Some(ContinuousOptions {
                out: out.clone(),
                resync: Duration::from_millis(self.resync),
                rounds: self.rounds,
            }),
            _ => None,
        };
        o
    }
}

/// A port number, decimal or `0x` hex.
/// `vmtsync probe`: SIGINT/SIGTERM end continuous mode after the current round, and abandon
/// anything else (connect, hello, a round) with exit code 130/143.
pub(super) fn run_probe_cmd(a: &ProbeArgs) -> Result<(), CliError> {
    mount_if_asked(&a.source)?;
    install_stop_handler();
    let opts = a.to_options(Some(stop_flag()));
    let mut out = io::stdout().lock();
    probe::run_probe(&opts, &mut out)?;
    out.flush()?;
    Ok(())
}

fn parse_port(s: &str) -> Result<u16, String> {
    hex_or_decimal::<u16>(s).map_err(|e| format!("{s}: not a 16-bit port number ({e})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        probe: ProbeArgs,
    }

    fn parse(args: &[&str]) -> Result<ProbeArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("probe").chain(args.iter().copied())).map(|c| c.probe)
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_map_to_options() {
        let a = parse(&["--connect", "tcp:127.0.0.1:4444"]).unwrap();
        let o = a.to_options(None);
        assert_eq!(o.probes, 64);
        assert_eq!(o.timeout, Duration::from_secs(2));
        assert!(o.continuous.is_none() && !o.json && o.progress);
        assert_eq!(o.anchor.mode, AnchorMode::Auto);
        let a = parse(&[
            "--connect",
            "unix:/q.sock",
            "--anchor",
            "kvm-pio",
            "--vm",
            "42",
        ])
        .unwrap();
        let o = a.to_options(None);
        assert_eq!(o.anchor.mode, AnchorMode::KvmPio);
        assert_eq!(o.anchor.vm, Some(VmSelector::Pid(42)));
        assert!(parse(&["--connect", "unix:/q.sock", "--anchor", "bogus"]).is_err());
        assert_eq!(o.anchor.sync_port, 0x2400);
        let a = parse(&["--connect", "tcp:h:1", "--sync-port", "0x80"]).unwrap();
        assert_eq!(a.to_options(None).anchor.sync_port, 0x80);
        assert!(parse(&["--connect", "tcp:h:1", "--sync-port", "0x10000"]).is_err());

        let a = parse(&[
            "--connect",
            "vsock-uds:/tmp/v.sock:5000",
            "--probes",
            "339",
            "--interval-ms",
            "5",
            "--continuous",
            "--out",
            "s.jsonl",
            "--resync-ms",
            "250",
            "--rounds",
            "3",
            "--json",
            "--no-progress",
        ])
        .unwrap();
        let o = a.to_options(None);
        assert_eq!(o.probes, 339);
        assert_eq!(o.interval, Duration::from_millis(5));
        assert!(o.json && !o.progress);
        assert_eq!(
            o.continuous,
            Some(ContinuousOptions {
                out: "s.jsonl".into(),
                resync: Duration::from_millis(250),
                rounds: Some(3),
            })
        );
    }

    #[test]
    fn vcpu_flags_choose_the_vcpus() {
        let o = parse(&["--connect", "tcp:h:1"]).unwrap().to_options(None);
        assert_eq!(o.vcpus, VcpuChoice::Agent);
        let one = parse(&["--connect", "tcp:h:1", "--vcpu", "2"]).unwrap();
        assert_eq!(one.to_options(None).vcpus, VcpuChoice::One(2));
        let all = parse(&["--connect", "tcp:h:1", "--all-vcpus", "--json"]).unwrap();
        assert_eq!(all.to_options(None).vcpus, VcpuChoice::All);
        assert!(parse(&["--connect", "tcp:h:1", "--vcpu", "1", "--all-vcpus"]).is_err());
        assert!(parse(&["--connect", "tcp:h:1", "--vcpu", "-1"]).is_err());
        let continuous = [
            "--connect",
            "tcp:h:1",
            "--all-vcpus",
            "--continuous",
            "--out",
            "f",
        ];
        let c = parse(&continuous).unwrap().to_options(None);
        assert_eq!(c.vcpus, VcpuChoice::All);
        assert!(c.continuous.is_some(), "continuous mode syncs every vCPU");
    }

    #[test]
    fn bad_flag_combinations_are_refused() {
        assert!(parse(&[]).is_err(), "--connect is required");
        assert!(parse(&["--connect", "nope"]).is_err());
        assert!(parse(&["--connect", "tcp:h:1", "--probes", "0"]).is_err());
        assert!(
            parse(&["--connect", "tcp:h:1", "--continuous"]).is_err(),
            "needs --out"
        );
        assert!(
            parse(&["--connect", "tcp:h:1", "--out", "f"]).is_err(),
            "needs --continuous"
        );
        assert!(parse(&["--connect", "tcp:h:1", "--rounds", "2"]).is_err());
    }
}
