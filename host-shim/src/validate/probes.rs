//! Probes: every exchange of a probe log (`--probe-log`, [`ProbeExchange`]) paired with its
//! own exits in the host trace by the live anchor's matcher, its guest TSC converted with the
//! sync file and checked against the bracket those exits give (docs/validate.md, "Probes").
//!
//! The agent reads its TSC after the `in` that completed its reading of the request and
//! before the reply's first `out` (on the sync port: after its `in`, before its `out` of the
//! sequence number), so the true host time of the read lies in `[h(lower exit),
//! h(upper exit)]`, with the ends chosen so that no other access can move them past the read
//! (docs/anchor.md, "The bracket argument"): the same bracket the session uses when it is
//! exit-anchored, found again here in a trace the sync code never read. Pairing is [`match_uart`] / [`match_sync_port`] inside the in-process stamps the log
//! kept: byte by byte, never guessed; an exchange whose exits are not all there is counted.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use super::report::{
    LinesEnd, ProbeReport, ProbeViolation, SegmentWorst, ValidateError, Verdict, each_line,
    quantiles, signed,
};
use crate::exits::{PioExit, match_sync_port, match_uart};
use crate::probe::log::{PROBE_LOG_SCHEMA, ProbeExchange, ProbePath};
use crate::sync::{covering, host_bounds};
use crate::syncfile::SyncSegment;

/// The 16550's register block: the data port and the seven after it (the matcher uses only
/// the accesses among them that reach the data port).
const UART_PORTS: u16 = 8;

/// Ports below the data port from which a 2- or 4-byte access still reaches it (the live
/// anchor traces them too).
const REACH: u16 = 3;

/// Checks exchanges one at a time against one host trace's exits (sorted by time) and one
/// sync file: memory grows by two lags per probe, not by the log's lines.
#[derive(Debug)]
pub struct ProbeChecker<'a> {
    exits: &'a [PioExit],
    segments: BTreeMap<u32, Vec<SyncSegment>>,
    report: ProbeReport,
    lags: [Vec<i64>; 2],
    worst: BTreeMap<(u32, u64), SegmentWorst>,
}

impl<'a> ProbeChecker<'a> {
    /// A checker of `exits` (every traced port exit the probes may have made, in time order)
    /// converting with `segments`.
    #[must_use]
    pub fn new(exits: &'a [PioExit], segments: &[SyncSegment]) -> Self {
        let mut by_vcpu: BTreeMap<u32, Vec<SyncSegment>> = BTreeMap::new();
        for s in segments {
            by_vcpu.entry(s.vcpu).or_default().push(*s);
        }
        Self {
            exits,
            segments: by_vcpu,
            report: ProbeReport::default(),
            lags: [Vec::new(), Vec::new()],
            worst: BTreeMap::new(),
        }
    }

    /// Pairs `e` with its exits and checks it.
    pub fn check(&mut self, e: &ProbeExchange) {
        self.report.logged += 1;
        let within = e.within();
        // Only the exits inside the in-process stamps can be this exchange's, and only those
        // the live anchor would have seen (its trace filter: the path's ports), so the
        // bracket is the one it would have built.
        let from = self.exits.partition_point(|x| x.ts < within.send.0);
        let to = self.exits.partition_point(|x| x.ts <= within.recv.0);
        let ports = ports_of(e);
        let near: Vec<PioExit> = self
            .exits
            .get(from..to.max(from))
            .unwrap_or_default()
            .iter()
            .filter(|x| ports.contains(&x.pio.port))
            .copied()
            .collect();
        let bracket = match e.path {
            ProbePath::Uart => {
                match_uart(&near, e.port, &e.request, &e.reply, within).map(|b| b.stamps())
            }
            ProbePath::SyncPort => match_sync_port(&near, e.port, e.seq, within),
        };
        let Ok(bracket) = bracket else {
            self.report.unpaired += 1;
            return;
        };
        let (exit_lo, exit_hi) = (bracket.send.0, bracket.recv.0);
        let converted = self
            .segments
            .get(&e.vcpu)
            .and_then(|mine| covering(mine, e.guest_tsc))
            .and_then(|s| Some((*s, host_bounds(s, e.guest_tsc)?)));
        let Some((seg, (host, lo, hi))) = converted else {
            self.report.unconverted += 1;
            return;
        };
        let r = &mut self.report;
        r.checked += 1;
        let (after_in, before_out) = (signed(host, exit_lo), signed(exit_hi, host));
        self.lags[0].push(after_in);
        self.lags[1].push(before_out);
        let verdict = Verdict::of((host, lo, hi), Some(exit_lo), Some(exit_hi));
        let w = self
            .worst
            .entry((e.vcpu, seg.round))
            .or_insert(SegmentWorst::of(e.vcpu, &seg));
        verdict.count(
            w,
            after_in.min(before_out),
            [&mut r.violations, &mut r.bound_violations],
            &mut r.first_violations,
            || ProbeViolation {
                vcpu: e.vcpu,
                seq: e.seq,
                path: e.path,
                check: verdict.check(e.guest_tsc, (host, lo, hi), [exit_lo, exit_hi], seg.round),
            },
        );
    }

    /// The report.
    #[must_use]
    pub fn finish(mut self) -> ProbeReport {
        let [after_in, before_out] = self.lags;
        self.report.lag_after_in = quantiles(after_in);
        self.report.lag_before_out = quantiles(before_out);
        self.report.segments = self.worst.into_values().collect();
        self.report
    }
}

/// Reads a probe log line by line (each at most the sync file's line bound), handing every
/// exchange to `each`; returns the bytes after the last newline (a torn last line, not read).
///
/// # Errors
/// [`ValidateError::ProbeLine`] naming the line and what is wrong with it (not JSON, a field
/// missing or of the wrong type, another schema, too long), [`ValidateError::ProbeLogIo`].
pub fn read_probe_log(
    path: &Path,
    mut each: impl FnMut(&ProbeExchange),
) -> Result<u64, ValidateError> {
    let io = |source| ValidateError::ProbeLogIo {
        path: path.to_owned(),
        source,
    };
    let mut input = BufReader::new(File::open(path).map_err(io)?);
    read_exchanges(path.to_owned(), &mut input, &mut each)
}

fn read_exchanges(
    path: PathBuf,
    input: &mut impl BufRead,
    each: &mut impl FnMut(&ProbeExchange),
) -> Result<u64, ValidateError> {
    let bad = |line: u64, why: String| ValidateError::ProbeLine {
        path: path.clone(),
        line,
        why,
    };
    let io = |source| ValidateError::ProbeLogIo {
        path: path.clone(),
        source,
    };
    let (end, n) = each_line(input, io, |n, line| {
        let e: ProbeExchange = serde_json::from_slice(line).map_err(|e| bad(n, e.to_string()))?;
        if e.schema != PROBE_LOG_SCHEMA {
            return Err(bad(
                n,
                format!(
                    "schema {} (this vmtsync reads schema {PROBE_LOG_SCHEMA})",
                    e.schema
                ),
            ));
        }
        each(&e);
        Ok(())
    })?;
    match end {
        LinesEnd::Eof => Ok(0),
        // A run killed in the middle of a write: the whole lines before it stand.
        LinesEnd::Partial { bytes } => Ok(bytes),
        LinesEnd::TooLong => Err(bad(
            n,
            "longer than any probe exchange (is this a probe log?)".into(),
        )),
    }
}

/// The ports whose exits the exchanges of a log may have made: the UART's register block
/// from its data port, or the sync port.
#[must_use]
pub fn ports_of(e: &ProbeExchange) -> std::ops::RangeInclusive<u16> {
    match e.path {
        ProbePath::Uart => e.port.saturating_sub(REACH)..=e.port.saturating_add(UART_PORTS - 1),
        ProbePath::SyncPort => e.port..=e.port,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exits::COM1_DATA;
    use crate::ftrace::format::{KvmPio, PioDirection};
    use crate::syncfile::AnchorKind;
    use crate::validate::report::MAX_LISTED;
    use crate::validate::testutil::segment_at;

    const OFFSET: i64 = 7_000_000_000;
    const PID: u32 = 99;

    fn exit(ts: u64, port: u16, direction: PioDirection, val: u8) -> PioExit {
        PioExit {
            ts,
            pio: KvmPio {
                pid: PID,
                direction,
                port,
                size: 1,
                count: 1,
                val: u32::from(val),
            },
        }
    }

    /// A UART probe at host time `t`: the request read 1,000..1,020 after `t`, the TSC read at
    /// `t + 1_500`, the reply written from `t + 2_000`; and its log line.
    fn uart_probe(t: u64, seq: u8) -> (Vec<PioExit>, ProbeExchange) {
        let request = vec![3, seq, 2, 0];
        let reply = vec![4, seq, 9, 9, 0];
        let mut exits: Vec<PioExit> = request
            .iter()
            .zip(0..)
            .map(|(&b, i)| exit(t + 1_000 + 10 * i, COM1_DATA, PioDirection::In, b))
            .collect();
        exits.extend(
            reply
                .iter()
                .zip(0..)
                .map(|(&b, i)| exit(t + 2_000 + 10 * i, COM1_DATA, PioDirection::Out, b)),
        );
        let e = ProbeExchange {
            schema: 1,
            vcpu: 0,
            seq,
            guest_tsc: (t + 1_500).checked_add_signed(OFFSET).unwrap(),
            path: ProbePath::Uart,
            port: COM1_DATA,
            request,
            reply,
            host_send: t,
            host_recv: t + 5_000,
            anchor: AnchorKind::KvmPioUart,
        };
        (exits, e)
    }

    fn segment(offset: i64, half: i64) -> SyncSegment {
        segment_at(1_000_000, offset, half, 5_000)
    }

    fn run(n: u64, seg: SyncSegment, keep: impl Fn(usize) -> bool) -> ProbeReport {
        let mut exits = Vec::new();
        let mut log = Vec::new();
        for i in 0..n {
            let (x, e) = uart_probe(1_000_000 + 10_000 * i, (i & 0xff) as u8);
            exits.extend(x);
            log.push(e);
        }
        let exits: Vec<PioExit> = exits
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| keep(i))
            .map(|(_, x)| x)
            .collect();
        let mut c = ProbeChecker::new(&exits, &[seg]);
        for e in &log {
            c.check(e);
        }
        c.finish()
    }

    #[test]
    fn the_true_offset_passes_with_the_probes_own_legs_as_lags() {
        let r = run(300, segment(OFFSET, 400), |_| true);
        assert_eq!(
            (r.logged, r.checked, r.violations, r.unpaired),
            (300, 300, 0, 0)
        );
        // The read is 1,500 after the send: 470 after the delimiter's `in`, 500 before the
        // reply's first `out`.
        assert_eq!(r.lag_after_in.unwrap().min, 470);
        assert_eq!(r.lag_before_out.unwrap().max, 500);
        assert_eq!(r.segments[0].worst_lag, 470);
    }

    #[test]
    fn a_shift_by_one_bracket_width_is_caught_either_way_and_false_bounds_are_flagged() {
        // The bracket: the delimiter's `in` at +1,030 to the reply's first `out` at +2,000.
        let width = 970;
        for by in [width, -width] {
            let r = run(300, segment(OFFSET + by, 100), |_| true);
            assert_eq!((r.violations, r.bound_violations), (300, 300), "{by}");
            assert_eq!(r.first_violations.len(), MAX_LISTED);
            assert!(r.first_violations.iter().all(|v| v.check.bound_false));
        }
        // An estimate off the bracket whose guaranteed interval still holds it.
        let r = run(10, segment(OFFSET + width, 2 * width), |_| true);
        assert_eq!((r.violations, r.bound_violations), (10, 0));
    }

    #[test]
    fn a_probe_whose_exits_are_missing_is_counted_never_guessed() {
        // Every ninth exit lost: a probe missing any of its nine bytes is not checked.
        let r = run(90, segment(OFFSET, 400), |i| i % 9 != 4);
        assert_eq!((r.checked, r.unpaired), (0, 90));
        // Exits of the wrong values (another probe's frames) are not this probe's.
        let (exits, mut e) = uart_probe(1_000_000, 5);
        e.reply[1] = 6;
        let mut c = ProbeChecker::new(&exits, &[segment(OFFSET, 400)]);
        c.check(&e);
        // And one no segment of its vCPU converts.
        e.reply[1] = 5;
        e.vcpu = 1;
        c.check(&e);
        let r = c.finish();
        assert_eq!((r.checked, r.unpaired, r.unconverted), (0, 1, 1));
    }

    #[test]
    fn only_the_paths_own_ports_make_the_bracket() {
        // A workload exit of the same thread after the delimiter: the live anchor never saw
        // it (its trace holds the UART's ports), so it does not move the bracket here either.
        let (mut exits, e) = uart_probe(1_000_000, 3);
        let mut other = exit(1_001_400, 0x3f0, PioDirection::Out, 3);
        other.pio.pid = PID;
        exits.push(other);
        exits.sort_by_key(|x| x.ts);
        let mut c = ProbeChecker::new(&exits, &[segment(OFFSET, 400)]);
        c.check(&e);
        assert_eq!(c.finish().lag_after_in.unwrap().min, 470);
    }

    #[test]
    fn sync_port_probes_pair_by_their_sequence_number() {
        const SYNC: u16 = 0x2400;
        let e = ProbeExchange {
            schema: 1,
            vcpu: 0,
            seq: 7,
            guest_tsc: 1_500_u64.checked_add_signed(OFFSET).unwrap(),
            path: ProbePath::SyncPort,
            port: SYNC,
            request: vec![],
            reply: vec![],
            host_send: 1_000,
            host_recv: 3_000,
            anchor: AnchorKind::InProcess,
        };
        let exits = [
            exit(1_400, SYNC, PioDirection::In, 0xff),
            exit(1_600, SYNC, PioDirection::Out, 7),
        ];
        let mut c = ProbeChecker::new(&exits, &[segment(OFFSET, 50)]);
        c.check(&e);
        let r = c.finish();
        assert_eq!((r.checked, r.violations), (1, 0));
        assert_eq!(r.lag_after_in.unwrap().min, 100);
    }

    fn parse(text: &[u8]) -> Result<(Vec<ProbeExchange>, u64), ValidateError> {
        let mut got = Vec::new();
        let cut = read_exchanges(
            "log".into(),
            &mut std::io::BufReader::new(text),
            &mut |e: &ProbeExchange| got.push(e.clone()),
        )?;
        Ok((got, cut))
    }

    fn line_err(text: &[u8]) -> (u64, String) {
        match parse(text) {
            Err(ValidateError::ProbeLine { line, why, .. }) => (line, why),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_log_round_trips_and_bad_lines_are_named() {
        let (_, e) = uart_probe(5, 9);
        let mut text = serde_json::to_vec(&e).unwrap();
        text.push(b'\n');
        let good = text.clone();
        assert_eq!(parse(&good).unwrap(), (vec![e.clone()], 0));
        // A torn last line (a killed run): the whole lines stand, the cut is counted.
        text.extend_from_slice(&good[..20]);
        assert_eq!(parse(&text).unwrap(), (vec![e.clone()], 20));
        // Cut short inside a line that still ends in a newline: not JSON.
        let mut t = good.clone();
        t.extend_from_slice(&good[..40]);
        t.push(b'\n');
        let (line, why) = line_err(&t);
        assert_eq!(line, 2);
        assert!(why.contains("EOF"), "{why}");
        // Wrong types: a string for a number, a number out of range, bad hex, a field missing.
        for (from, to, says) in [
            ("\"seq\":9", "\"seq\":\"9\"", "invalid type"),
            ("\"seq\":9", "\"seq\":900", "invalid value"),
            ("\"request\":\"03", "\"request\":\"zz", "Invalid character"),
            ("\"guest_tsc\":", "\"guest\":", "missing field `guest_tsc`"),
            (
                "\"path\":\"uart\"",
                "\"path\":\"floppy\"",
                "unknown variant",
            ),
        ] {
            let t = String::from_utf8(good.clone()).unwrap();
            assert!(t.contains(from), "{from}");
            let (line, why) = line_err(t.replacen(from, to, 1).as_bytes());
            assert_eq!(line, 1);
            assert!(why.contains(says), "{from}: {why}");
        }
        let t =
            String::from_utf8(good.clone())
                .unwrap()
                .replacen("\"schema\":1", "\"schema\":2", 1);
        assert!(line_err(t.as_bytes()).1.contains("schema 2"));
        // A huge line is refused without being held: the reader keeps at most its bound.
        let mut huge = b"{\"request\":\"".to_vec();
        huge.resize(1 << 20, b'0');
        huge.extend_from_slice(b"\"}\n");
        let (line, why) = line_err(&huge);
        assert_eq!(line, 1);
        assert!(why.contains("longer"), "{why}");
        assert!(matches!(
            parse(b"not json\n"),
            Err(ValidateError::ProbeLine { line: 1, .. })
        ));
        assert_eq!(parse(b"").unwrap(), (vec![], 0));
    }
}
