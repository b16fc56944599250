//! The CLI's vocabulary: one long name per concept across every command, checked against the
//! whole parser (every command and subcommand, every argument).
//!
//! | concept                          | name                     | old spellings (hidden aliases) |
//! |----------------------------------|--------------------------|--------------------------------|
//! | the file or directory written    | `--out`                  | `--output` (trace-cmd attach)  |
//! | a copy of the host trace written | `--host-out`             | `--host-output`                |
//! | the sync file written            | `--sync-out`             |                                |
//! | the host's trace.dat read        | `--host-trace`           | `--host` (trace-cmd attach)    |
//! | the guest's recording read       | `--from`                 | `--guest-trace` (validate), `--guest` (attach) |
//! | the sync file read               | `--sync`                 | `plot SYNCFILE` (positional)   |
//! | a duration                       | its unit last: `-ms`, `-s` | `--interval`, `--timeout`, `--connect-timeout`, `--resync`, `--duration` |
//! | where KVM debugfs and /proc are  | `--debugfs-root`, `--mount-debugfs`, `--proc-root` (`SourceArgs`, on every command with `--vm`) | |
//!
//! The old spellings keep working as hidden aliases so scripts and older docs still run;
//! `--help` shows only the vocabulary's names.

#[cfg(test)]
mod tests {
    use clap::{Arg, Command, CommandFactory};

    use crate::cli::Cli;

    /// Names that must never be an argument's primary long name, with the vocabulary's name
    /// for the same concept. Each may live on only as a hidden alias.
    const SYNONYMS: &[(&str, &str)] = &[
        ("output", "out"),
        ("host-output", "host-out"),
        ("host", "host-trace"),
        ("guest", "from"),
        ("guest-trace", "from"),
        ("input", "from"),
        ("in", "from"),
        ("sync-file", "sync"),
        ("syncfile", "sync"),
        ("interval", "interval-ms"),
        ("timeout", "timeout-ms"),
        ("connect-timeout", "connect-timeout-ms"),
        ("resync", "resync-ms"),
        ("poll", "poll-ms"),
        ("duration", "duration-s"),
        ("debugfs", "debugfs-root"),
        ("proc", "proc-root"),
    ];

    /// A word no long name may contain (as a `-`-separated word), with the vocabulary's word.
    const FORBIDDEN_WORDS: &[(&str, &str)] = &[("output", "out"), ("input", "from")];

    /// Value names that say an argument holds one concept, and the long names allowed for it.
    const CONCEPTS: &[(&str, &[&str])] = &[
        // The sync file: read with --sync, written with --out (probe --continuous) or --sync-out.
        ("SYNCFILE", &["sync", "out", "sync-out"]),
        // The host's trace.dat, read.
        ("HOST.dat", &["host-trace"]),
        // A recording or guest trace, read.
        ("IN", &["from"]),
        ("GUEST.dat", &["from"]),
        ("GUEST.dat|GUEST.jsonl", &["from"]),
        // A copy of the host's trace, written.
        ("HOST_OUT.dat", &["host-out"]),
        ("OUT.dat", &["out", "host-out"]),
        // The VM, as every command that reads debugfs names it.
        ("PID|NAME", &["vm"]),
    ];

    /// Duration units: the value name and the suffix the long name must end with.
    const UNITS: &[(&str, &str)] = &[("MS", "-ms"), ("SECS", "-s")];

    /// Arguments whose help speaks of time but which are not durations in a clock unit, and
    /// why they carry no unit suffix.
    const NOT_DURATIONS: &[(&str, &str)] = &[
        // An error bound in TSC ticks of trace-cmd's arithmetic, not a span of time: its
        // value name TICKS says the unit.
        ("max-error", "TICKS"),
        // A TSC offset in ticks (guest - host), not a duration: its value name says the unit.
        ("truth", "TICKS"),
    ];

    /// Positional arguments allowed: the VMM's command line after `--` (it cannot be a flag),
    /// and plot's old positional SYNCFILE (hidden, `--sync` is its name).
    const POSITIONALS: &[&str] = &["vmm", "sync_file"];

    /// The shared VM-source flags (`SourceArgs`), on every command that reads KVM debugfs.
    const SOURCE_FLAGS: &[&str] = &["debugfs-root", "mount-debugfs", "proc-root"];

    /// Every leaf command's path and arguments (built-in help and version left out).
    fn leaves() -> Vec<(String, Vec<Arg>)> {
        fn walk(c: &Command, path: &str, out: &mut Vec<(String, Vec<Arg>)>) {
            let path = if path.is_empty() {
                c.get_name().to_owned()
            } else {
                format!("{path} {}", c.get_name())
            };
            let args: Vec<Arg> = c
                .get_arguments()
                .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
                .cloned()
                .collect();
            if c.has_subcommands() {
                assert!(
                    args.is_empty(),
                    "{path}: flags on a command with subcommands"
                );
                // clap's generated `help` subcommands are not ours.
                for s in c.get_subcommands().filter(|s| s.get_name() != "help") {
                    walk(s, &path, out);
                }
            } else {
                out.push((path, args));
            }
        }
        let mut out = Vec::new();
        let mut cli = Cli::command();
        cli.build();
        walk(&cli, "", &mut out);
        out
    }

    fn help(a: &Arg) -> String {
        a.get_long_help()
            .or_else(|| a.get_help())
            .map(ToString::to_string)
            .unwrap_or_default()
    }

    fn value_name(a: &Arg) -> Option<String> {
        a.get_value_names()
            .and_then(|v| v.first())
            .map(ToString::to_string)
    }

    /// Every breach of the vocabulary, one line each.
    fn violations() -> Vec<String> {
        let mut bad = Vec::new();
        let leaves = leaves();
        assert!(
            leaves.len() >= 12,
            "the walk found only {} commands",
            leaves.len()
        );
        for (path, args) in &leaves {
            let longs: Vec<&str> = args.iter().filter_map(Arg::get_long).collect();
            for a in args {
                let id = a.get_id().as_str();
                let Some(long) = a.get_long() else {
                    if a.is_positional() && !POSITIONALS.contains(&id) {
                        bad.push(format!("{path}: positional {id}: give it a --flag"));
                    }
                    if a.is_positional() && id != "vmm" && !a.is_hide_set() {
                        bad.push(format!(
                            "{path}: positional {id} must be a hidden old spelling"
                        ));
                    }
                    continue;
                };
                if let Some((_, name)) = SYNONYMS.iter().find(|(s, _)| *s == long) {
                    bad.push(format!("{path}: --{long} is spelled --{name}"));
                }
                for (word, instead) in FORBIDDEN_WORDS {
                    if long.split('-').any(|w| w == *word) {
                        bad.push(format!("{path}: --{long}: say `{instead}`, not `{word}`"));
                    }
                }
                if let Some(v) = a.get_visible_aliases().filter(|v| !v.is_empty()) {
                    bad.push(format!("{path}: --{long} shows aliases {v:?}: hide them"));
                }
                for alias in a.get_all_aliases().unwrap_or_default() {
                    if !SYNONYMS
                        .iter()
                        .any(|(s, name)| *s == alias && *name == long)
                    {
                        bad.push(format!(
                            "{path}: --{long} has alias --{alias}, which is not one of its old spellings"
                        ));
                    }
                }
                let vn = value_name(a).unwrap_or_default();
                if let Some((_, allowed)) = CONCEPTS.iter().find(|(v, _)| *v == vn)
                    && !allowed.contains(&long)
                {
                    bad.push(format!(
                        "{path}: --{long} holds {vn}: name it one of {allowed:?}"
                    ));
                }
                check_duration(path, long, &vn, &help(a), &mut bad);
            }
            let reads_debugfs = longs.iter().any(|l| *l == "vm" || *l == "debugfs-root");
            if reads_debugfs {
                for f in SOURCE_FLAGS {
                    if !longs.contains(f) {
                        bad.push(format!(
                            "{path}: reads KVM debugfs but lacks --{f} (SourceArgs)"
                        ));
                    }
                }
            }
        }
        bad
    }

    fn check_duration(path: &str, long: &str, vn: &str, help: &str, bad: &mut Vec<String>) {
        if let Some((_, justified_unit)) = NOT_DURATIONS.iter().find(|(l, _)| *l == long) {
            if vn != *justified_unit {
                bad.push(format!(
                    "{path}: --{long} is allowed no unit suffix for value {justified_unit}, has {vn}"
                ));
            }
            return;
        }
        for (unit, suffix) in UNITS {
            if vn == *unit && !long.ends_with(suffix) {
                bad.push(format!(
                    "{path}: --{long} takes {unit}: name it --{long}{suffix}"
                ));
            }
            if long.ends_with(suffix) && vn != *unit {
                bad.push(format!(
                    "{path}: --{long} ends in {suffix}: its value name must be {unit}"
                ));
            }
        }
        let lower = help.to_lowercase();
        let speaks_of_time = ["millisecond", "seconds", "ticks"]
            .iter()
            .any(|w| lower.contains(w));
        let has_unit = UNITS.iter().any(|(_, s)| long.ends_with(s));
        let timed_value = matches!(vn, "MS" | "SECS" | "TICKS");
        if speaks_of_time && timed_value && !has_unit {
            bad.push(format!(
                "{path}: --{long} is a time ({vn}) with no unit in its name (or justify it in NOT_DURATIONS)"
            ));
        }
    }

    #[test]
    fn every_flag_follows_the_vocabulary() {
        let bad = violations();
        assert!(
            bad.is_empty(),
            "CLI vocabulary breaches:\n{}",
            bad.join("\n")
        );
    }

    /// Every old spelling parses to the same command line as the vocabulary's name.
    #[test]
    fn old_spellings_still_parse() {
        use clap::Parser;
        let parse = |line: &str| {
            Cli::try_parse_from(line.split_whitespace()).unwrap_or_else(|e| panic!("{line}: {e}"))
        };
        let same = [
            (
                "vmtsync kvm --watch --interval 50",
                "vmtsync kvm --watch --interval-ms 50",
            ),
            (
                "vmtsync probe --connect tcp:h:1 --interval 5 --timeout 7 --connect-timeout 9 \
                 --continuous --out f --resync 11",
                "vmtsync probe --connect tcp:h:1 --interval-ms 5 --timeout-ms 7 \
                 --connect-timeout-ms 9 --continuous --out f --resync-ms 11",
            ),
            (
                "vmtsync record --connect tcp:h:1 --out o --resync 5 --timeout 6 --duration 2.5 \
                 --host-trace h --host-output x",
                "vmtsync record --connect tcp:h:1 --out o --resync-ms 5 --timeout-ms 6 \
                 --duration-s 2.5 --host-trace h --host-out x",
            ),
            (
                "vmtsync validate --host-trace h --guest-trace g --port 1",
                "vmtsync validate --host-trace h --from g --port 1",
            ),
            (
                "vmtsync trace-cmd attach --guest g --output o --offset 5 --host h \
                 --host-output x --vcpu-pid 0=1",
                "vmtsync trace-cmd attach --from g --out o --offset 5 --host-trace h \
                 --host-out x --vcpu-pid 0=1",
            ),
        ];
        for (old, new) in same {
            assert_eq!(
                format!("{:?}", parse(old)),
                format!("{:?}", parse(new)),
                "{old}"
            );
        }
        let plot = |line: &str| match parse(line).command {
            crate::cli::Command::Plot(a) => (a.sync_path().to_owned(), a.out),
            c => panic!("{line}: parsed as {c:?}"),
        };
        assert_eq!(
            plot("vmtsync plot s.jsonl --out p.svg"),
            plot("vmtsync plot --sync s.jsonl --out p.svg")
        );
        assert_eq!(
            plot("vmtsync plot --sync s.jsonl --out p.svg").0,
            std::path::Path::new("s.jsonl")
        );
    }

    #[test]
    fn the_walk_sees_every_command() {
        let names: Vec<String> = leaves().into_iter().map(|(p, _)| p).collect();
        for want in [
            "vmtsync kvm",
            "vmtsync probe",
            "vmtsync record",
            "vmtsync plot",
            "vmtsync validate",
            "vmtsync trace-cmd attach",
            "vmtsync export perf",
            "vmtsync tsc compose",
            "vmtsync convert",
            "vmtsync spans",
            "vmtsync export ctf",
            "vmtsync export perfetto",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing from {names:?}"
            );
        }
    }
}
