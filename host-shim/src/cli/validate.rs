//! `vmtsync validate`: the command's glue; the check is in [`crate::validate`].

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::PathBuf;

use clap::Args;

use super::exit::CliError;
use super::number::hex_or_decimal;
use crate::validate::{
    EventRule, LagStats, Numbering, ProbeReport, Side, ValidateOptions, ValidateReport, validate,
    workload_rules,
};
use crate::validate::{ExitCheck, SegmentWorst};

/// `vmtsync validate` flags.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("checked").required(true).multiple(true).args(["guest_trace", "probe_log"]))]
#[command(group = clap::ArgGroup::new("rules").multiple(true).args(["port", "before", "after"]))]
pub struct ValidateArgs {
    /// The sync file whose conversion is checked (`vmtsync probe --continuous --out`, or
    /// `vmtsync record --sync-out`). Without it, the conversion `vmtsync record --format
    /// jsonl` wrote beside each event (host_tsc, host_lo, host_hi) is checked.
    #[arg(long, value_name = "SYNCFILE")]
    pub sync: Option<PathBuf>,
    /// The host's trace.dat (`trace-cmd extract` of a tracefs instance with clock x86-tsc and
    /// `kvm:kvm_pio` enabled for the workload's port, and for the probes' ports with
    /// --probe-log, while they ran), compressed or not.
    #[arg(long, value_name = "HOST.dat")]
    pub host_trace: PathBuf,
    /// The guest's recording from `vmtsync record`: its trace.dat (raw guest TSC; needs
    /// --sync) or its JSON Lines (--format jsonl; any guest rate), holding events recorded
    /// next to port I/O, named by --before/--after (or --port for the bundled agent).
    #[arg(
        long = "from",
        alias = "guest-trace",
        value_name = "GUEST.dat|GUEST.jsonl",
        requires = "rules"
    )]
    pub guest_trace: Option<PathBuf>,
    /// The bundled agent's workload port (agent option workload=RATE,COUNT,PORT): the same as
    /// --before 0x100:PORT --after 0x101:PORT.
    #[arg(long, value_name = "PORT", value_parser = parse_port, requires = "guest_trace")]
    pub port: Option<u16>,
    /// Event ID is recorded before the guest's next port I/O on PORT, an `out` of the low
    /// byte of the step number the event carries (its payload's first bytes, little-endian;
    /// without a payload, its order among the ID's events): its host time must not be after
    /// that exit. Repeatable; ID and PORT decimal or 0x hex (docs/validate.md).
    #[arg(long, value_name = "ID:PORT", value_parser = parse_before, requires = "guest_trace")]
    pub before: Vec<EventRule>,
    /// Event ID is recorded after the guest's previous port I/O on PORT: the `in` right
    /// after its step's `out` when there is one, else that `out`: its host time must not be
    /// before that exit. Repeatable, as --before.
    #[arg(long, value_name = "ID:PORT", value_parser = parse_after, requires = "guest_trace")]
    pub after: Vec<EventRule>,
    /// A probe log (`vmtsync probe|record --probe-log`): each probe is paired with its own
    /// kvm_pio exits in the host trace (UART bytes or sync port), its guest TSC converted
    /// with the sync file and checked against them.
    #[arg(long, value_name = "FILE", requires = "sync")]
    pub probe_log: Option<PathBuf>,
    /// The host thread of a vCPU, as VCPU=PID (repeatable); needed only when the host trace
    /// has no GUEST option and several threads did I/O on the port. When threads are known
    /// (here or from the GUEST option), probes are paired with their exits only.
    #[arg(long = "thread", value_name = "VCPU=PID", value_parser = parse_thread)]
    pub threads: Vec<(u32, u32)>,
    /// The host trace began before the VM's workload did (tracing on before boot): its k-th
    /// out on the port is step k, so pairing takes nothing from the sync file. Without it, the
    /// step nearest the first event's converted time anchors the numbering (right while the
    /// sync is off by less than 128 event periods).
    #[arg(long)]
    pub from_boot: bool,
    /// How events are placed with the sync file, as `vmtsync record --placement` does:
    /// two-sided (the round before and the round after, record's default) or one-sided.
    #[arg(long, value_enum, value_name = "HOW", default_value_t = super::record::PlacementArg::TwoSided)]
    pub placement: super::record::PlacementArg,
    /// Print the report as one JSON object (schema 4, see docs/validate.md).
    #[arg(long)]
    pub json: bool,
}

fn parse_port(s: &str) -> Result<u16, String> {
    hex_or_decimal::<u16>(s)
        .map_err(|e| format!("{s:?} is not a port (0..=65535, decimal or 0x hex): {e}"))
}

/// A decimal or 0x-hex number of type `T`.
fn number<T: TryFrom<u64>>(s: &str) -> Option<T> {
    T::try_from(hex_or_decimal::<u64>(s).ok()?).ok()
}

/// `ID:PORT` as a rule for `side`.
fn parse_rule(s: &str, side: Side) -> Result<EventRule, String> {
    let (id, port) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected ID:PORT (e.g. 0x100:0x3f0)"))?;
    Ok(EventRule {
        id: number(id).ok_or_else(|| format!("{s:?}: event id {id:?} is not 0..=65535"))?,
        port: number(port).ok_or_else(|| format!("{s:?}: port {port:?} is not 0..=65535"))?,
        side,
    })
}

fn parse_before(s: &str) -> Result<EventRule, String> {
    parse_rule(s, Side::BeforeOut)
}

fn parse_after(s: &str) -> Result<EventRule, String> {
    parse_rule(s, Side::AfterIn)
}

fn parse_thread(s: &str) -> Result<(u32, u32), String> {
    let (v, p) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected VCPU=PID"))?;
    let n = |x: &str| x.parse::<u32>().map_err(|e| format!("{s:?}: {e}"));
    Ok((n(v)?, n(p)?))
}

/// `vmtsync validate`: prints the report; any violation is [`CliError::Violations`].
///
/// # Errors
/// [`CliError::Validate`] when the inputs cannot be checked, [`CliError::Violations`] when
/// they were and failed.
pub fn run_validate_cmd(args: &ValidateArgs) -> Result<(), CliError> {
    let mut rules: Vec<EventRule> = args
        .port
        .map(workload_rules)
        .into_iter()
        .flatten()
        .collect();
    rules.extend(args.before.iter().chain(&args.after));
    rules.sort_unstable();
    rules.dedup();
    let opts = ValidateOptions {
        sync: args.sync.clone(),
        host_trace: args.host_trace.clone(),
        guest_trace: args.guest_trace.clone(),
        rules,
        probe_log: args.probe_log.clone(),
        threads: args.threads.iter().copied().collect::<BTreeMap<_, _>>(),
        placement: args.placement.into(),
        numbering: if args.from_boot {
            Numbering::FromBoot
        } else {
            Numbering::Nearest
        },
    };
    let report = validate(&opts)?;
    let mut out = io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &report).map_err(io::Error::from)?;
        writeln!(out)?;
    } else {
        print_text(&mut out, &report)?;
    }
    out.flush()?;
    let probes = report.probes.as_ref();
    let violations = report.violations + probes.map_or(0, |p| p.violations);
    if violations > 0 {
        return Err(CliError::Violations(violations));
    }
    if args.guest_trace.is_some() && report.checked == 0 {
        return Err(CliError::Usage(
            "no event could be checked: no exit of the host trace matches a guest event (is it the same run, the right port in --port/--before/--after, the right thread?)".into(),
        ));
    }
    if probes.is_some_and(|p| p.checked == 0) {
        return Err(CliError::Usage(
            "no probe could be checked: none of the log's probes has its exits in the host trace (was kvm_pio of the UART or the sync port recorded during the session, in the same VM?)".into(),
        ));
    }
    Ok(())
}

fn print_text(out: &mut impl Write, r: &ValidateReport) -> io::Result<()> {
    if r.probes.is_none() || r.checked + r.unmatched_events + r.unconverted_events > 0 {
        print_events(out, r)?;
    }
    if let Some(p) = &r.probes {
        print_probes(out, p)?;
    }
    Ok(())
}

fn print_events(out: &mut impl Write, r: &ValidateReport) -> io::Result<()> {
    let rules: Vec<String> = r
        .rules
        .iter()
        .map(|x| match x.side {
            Side::BeforeOut => format!("{:#x} before the next out on {:#x}", x.id, x.port),
            Side::AfterIn => format!("{:#x} after the previous exit on {:#x}", x.id, x.port),
        })
        .collect();
    writeln!(
        out,
        "rules: {}; converted {}",
        rules.join(", "),
        match r.conversion {
            crate::validate::Conversion::SyncFile => "with the sync file",
            crate::validate::Conversion::Recorded => "as record converted them (no sync file)",
        }
    )?;
    writeln!(
        out,
        "checked {} events against their kvm_pio exits ({} before an out, {} after an in): {} violations ({} with a false guaranteed bound)",
        r.checked, r.before_out, r.after_in, r.violations, r.bound_violations
    )?;
    writeln!(
        out,
        "not checked: {} events without their exits in the host trace, {} outside every segment; {} exits not in an out/in step",
        r.unmatched_events, r.unconverted_events, r.unpaired_exits
    )?;
    print_lags(
        out,
        "lag to the own exit, events",
        [
            ("before an out", r.lag_before_out),
            ("after an in", r.lag_after_in),
        ],
    )?;
    if let Some(w) = &r.widths {
        let ratio =
            |m: Option<u64>| m.map_or("-".into(), |m| format!("{}.{:03}x", m / 1000, m % 1000));
        writeln!(
            out,
            "event intervals ({} events, placed {}): median {} max {} ticks; rounds: median {} max {}; ratio median {} max {}",
            w.events,
            match r.placement {
                Some(crate::validate::PlacementName::TwoSided) => "two-sided",
                Some(crate::validate::PlacementName::OneSided) => "one-sided",
                None => "as recorded",
            },
            w.event_median,
            w.event_max,
            w.round_median.map_or("-".into(), |x| x.to_string()),
            w.round_max.map_or("-".into(), |x| x.to_string()),
            ratio(w.median_ratio_milli),
            ratio(w.max_ratio_milli),
        )?;
    }
    let listed = r.first_violations.iter().map(|v| {
        let who = format!("vcpu {} seq {} {:?}", v.vcpu, v.seq, v.side);
        (who, v.check)
    });
    print_worst(out, "events", &r.segments, listed)
}

/// One line per lag distribution that has values: `{lead} {what} (ticks; …): min … max`.
fn print_lags<const N: usize>(
    out: &mut impl Write,
    lead: &str,
    lags: [(&str, Option<LagStats>); N],
) -> io::Result<()> {
    for (what, l) in lags {
        if let Some(l) = l {
            writeln!(
                out,
                "{lead} {what} (ticks; negative: the wrong side): min {} p1 {} median {} p99 {} max {}",
                l.min, l.p1, l.median, l.p99, l.max
            )?;
        }
    }
    Ok(())
}

/// The end of a check's section (events or probes), where it is worst: the per-segment table
/// (`what` names the column of things converted through each), then one line per listed
/// violation, `violation: {who}: ` and its conversion against its exits ([`against_exits`]).
fn print_worst<X: Into<Option<u64>>>(
    out: &mut impl Write,
    what: &str,
    segments: &[SegmentWorst],
    violations: impl IntoIterator<Item = (String, ExitCheck<X>)>,
) -> io::Result<()> {
    writeln!(
        out,
        "vcpu  round  {what:>6}  worst_lag  violations  wrong_side  offset_width"
    )?;
    for s in segments {
        writeln!(
            out,
            "{:>4}  {:>5}  {:>6}  {:>9}  {:>10}  {:>10}  {:>12}",
            s.vcpu, s.round, s.events, s.worst_lag, s.violations, s.wrong_side, s.width
        )?;
    }
    for (who, check) in violations {
        writeln!(out, "violation: {who}: {}", against_exits(check))?;
    }
    Ok(())
}

/// The end of a violation's line, after what it names (an event or a probe): its guest TSC
/// converted to `host` (with its guaranteed interval) against the exits that bracket it (`-`:
/// none on that side), the segment's round, and whether the guaranteed bound itself is false.
fn against_exits<X: Into<Option<u64>>>(c: ExitCheck<X>) -> String {
    let [exit_lo, exit_hi] =
        [c.exit_lo, c.exit_hi].map(|x| x.into().map_or("-".into(), |x| x.to_string()));
    let (guest_tsc, host, lo, hi, round) = (c.guest_tsc, c.host_tsc, c.host_lo, c.host_hi, c.round);
    format!(
        "guest {guest_tsc} -> host {host} (guaranteed [{lo}, {hi}]) vs exits [{exit_lo}, {exit_hi}] (segment round {round}){}",
        if c.bound_false {
            ", guaranteed bound false"
        } else {
            ""
        }
    )
}

fn print_probes(out: &mut impl Write, p: &ProbeReport) -> io::Result<()> {
    writeln!(
        out,
        "checked {} of {} logged probes against their own kvm_pio exits: {} violations ({} with a false guaranteed bound)",
        p.checked, p.logged, p.violations, p.bound_violations
    )?;
    writeln!(
        out,
        "not checked: {} probes without their exits in the host trace, {} outside every segment{}",
        p.unpaired,
        p.unconverted,
        if p.cut_bytes > 0 {
            format!("; {} bytes of a torn last line", p.cut_bytes)
        } else {
            String::new()
        }
    )?;
    print_lags(
        out,
        "lag of probes",
        [
            ("after the exit before the read", p.lag_after_in),
            ("before the exit after the read", p.lag_before_out),
        ],
    )?;
    let listed = p.first_violations.iter().map(|v| {
        let who = format!("probe vcpu {} seq {} ({:?})", v.vcpu, v.seq, v.path);
        (who, v.check)
    });
    print_worst(out, "probes", &p.segments, listed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::testutil::exit_check;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        v: ValidateArgs,
    }

    fn parse(args: &str) -> Result<ValidateArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("validate").chain(args.split_whitespace())).map(|c| c.v)
    }

    #[test]
    fn a_guest_trace_needs_its_rules_and_something_must_be_checked() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let a = parse("--host-trace h --from g.jsonl --before 7:0x80 --after 0x8:128").unwrap();
        assert!(a.sync.is_none());
        assert_eq!(
            (a.before, a.after),
            (
                vec![EventRule {
                    id: 7,
                    port: 0x80,
                    side: Side::BeforeOut
                }],
                vec![EventRule {
                    id: 8,
                    port: 0x80,
                    side: Side::AfterIn
                }]
            )
        );
        assert!(
            parse("--host-trace h --probe-log p").is_err(),
            "probes need the sync file"
        );
        assert!(
            parse("--host-trace h --before 7:0x80 --probe-log p --sync s").is_err(),
            "a rule for no guest trace"
        );
        let base = "--sync s --host-trace h";
        let a = parse(&format!("{base} --probe-log p")).unwrap();
        assert!(a.guest_trace.is_none() && a.port.is_none());
        let a = parse(&format!("{base} --from g --port 0x3f0 --probe-log p")).unwrap();
        assert_eq!((a.port, a.probe_log.is_some()), (Some(0x3f0), true));
        assert!(parse(base).is_err(), "nothing to check");
        assert!(
            parse(&format!("{base} --from g")).is_err(),
            "no --port, --before or --after"
        );
        assert!(
            parse(&format!("{base} --port 1 --probe-log p")).is_err(),
            "a port for nothing"
        );
    }

    #[test]
    fn ports_and_threads_parse() {
        assert_eq!(parse_port("0x3f0"), Ok(0x3f0));
        assert_eq!(parse_port("1008"), Ok(1008));
        assert!(parse_port("0x10000").is_err());
        assert_eq!(parse_thread("1=4242"), Ok((1, 4242)));
        assert_eq!(
            parse_before("0x100:0x3f0"),
            Ok(EventRule {
                id: 0x100,
                port: 0x3f0,
                side: Side::BeforeOut
            })
        );
        assert!(parse_after("0x10000:1").is_err(), "an id beyond u16");
        assert!(parse_after("1:65536").is_err(), "a port beyond u16");
        assert!(parse_after("1").is_err(), "no port");
        assert!(parse_thread("1:4242").is_err());
    }

    /// A violation's line ends the same for an event (an exit may be unknown) and a probe.
    #[test]
    fn a_violation_line_shows_its_conversion_against_its_exits() {
        assert_eq!(
            against_exits(exit_check(None, Some(8), true)),
            "guest 3 -> host 4 (guaranteed [5, 6]) vs exits [-, 8] (segment round 9), guaranteed bound false"
        );
        assert_eq!(
            against_exits(exit_check(7, 8, false)),
            "guest 3 -> host 4 (guaranteed [5, 6]) vs exits [7, 8] (segment round 9)"
        );
    }

    /// An event's violation and a probe's, each on its line after what names it.
    #[test]
    fn violations_are_listed_one_line_each() {
        let probe = crate::validate::ProbeViolation {
            vcpu: 0,
            seq: 7,
            path: crate::probe::log::ProbePath::Uart,
            check: exit_check(1, 2, true),
        };
        let r = ValidateReport {
            checked: 1,
            first_violations: vec![crate::validate::Violation {
                vcpu: 1,
                seq: 2,
                side: Side::AfterIn,
                check: exit_check(None, Some(8), false),
            }],
            probes: Some(ProbeReport {
                first_violations: vec![probe],
                ..ProbeReport::default()
            }),
            ..crate::validate::check(
                &[],
                &[],
                None,
                &BTreeMap::new(),
                crate::validate::Numbering::FromBoot,
                &[],
            )
        };
        let mut out = Vec::new();
        print_text(&mut out, &r).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("violation"))
            .collect();
        assert_eq!(
            lines,
            [
                "violation: vcpu 1 seq 2 AfterIn: guest 3 -> host 4 (guaranteed [5, 6]) vs exits [-, 8] (segment round 9)",
                "violation: probe vcpu 0 seq 7 (Uart): guest 3 -> host 4 (guaranteed [5, 6]) vs exits [1, 2] (segment round 9), guaranteed bound false",
            ]
        );
    }
}
