use std::path::Path;

use vmtsync_core::HostTicks;
use vmtsync_core::mapping::KvmTscMapping;

use super::*;
use crate::formats::tracedat::reader::{Event, for_each_event, read_layout, verify_file};
use crate::formats::tracedat::timeshift::{ShiftMode, SyncSegment, TimeShiftError};

/// A seeded xorshift, so a failing case can be replayed from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `(cpu, ts, id, payload)` in push order.
type Pushed = Vec<(u32, u64, u32, Vec<u8>)>;

fn synth(seed: u64, n: usize, cpus: u32) -> Pushed {
    let mut r = Rng(seed | 1);
    let mut ts = vec![1_000_000u64; cpus as usize];
    (0..n)
        .map(|i| {
            let cpu = u32::try_from(r.next() % u64::from(cpus)).unwrap();
            // Mostly small gaps, some needing a time extend, a few beyond 59 bits' reach.
            let gap = match r.next() % 1000 {
                0 => 1 << 60,
                1..=20 => (1 << 27) + r.next() % (1 << 40),
                21..=40 => 0,
                _ => r.next() % 5000,
            };
            let t = &mut ts[cpu as usize];
            *t = t.saturating_add(gap).min(1 << 62);
            let len = usize::try_from(r.next() % 17).unwrap() * usize::from(i % 3 != 0);
            let payload: Vec<u8> = (0..len).map(|_| r.next().to_le_bytes()[0]).collect();
            (cpu, *t, u32::try_from(i).unwrap(), payload)
        })
        .collect()
}

/// The options of a `cpus`-CPU file of `version` whose TRACEID is `trace_id`.
fn options(version: FileVersion, cpus: u32, trace_id: u64) -> WriterOptions {
    WriterOptions {
        version,
        ..WriterOptions::new(cpus, trace_id)
    }
}

fn write(path: &Path, version: FileVersion, cpus: u32, events: &Pushed) -> Summary {
    let mut w = TraceDatWriter::create(path, options(version, cpus, 42)).unwrap();
    for (cpu, ts, id, p) in events {
        w.push(*cpu, *ts, *id, p).unwrap();
    }
    let s = w.finish(None).unwrap();
    s.verify().unwrap();
    s
}

fn read_back(path: &Path) -> Pushed {
    let layout = read_layout(path).unwrap();
    let mut got = Vec::new();
    for_each_event(path, &layout, 0, |e: &Event| {
        got.push((e.cpu, e.ts, e.id, e.payload[..usize::from(e.len)].to_vec()));
    })
    .unwrap();
    got
}

#[test]
fn every_event_reads_back_exactly_in_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    for (seed, version) in [(7, FileVersion::V7), (8, FileVersion::V6)] {
        let events = synth(seed, 60_000, 3);
        let path = dir.path().join(format!("t{seed}.dat"));
        let s = write(&path, version, 3, &events);
        assert_eq!(s.events.iter().sum::<u64>(), 60_000, "seed {seed}");
        // The reader returns CPU by CPU; the writer keeps each CPU's order.
        let mut want = events.clone();
        want.sort_by_key(|e| e.0);
        assert_eq!(read_back(&path), want, "seed {seed}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), s.bytes);
    }
}

/// Runs pushed with `push_padded_while` (consecutive events of one CPU at once) write the
/// same pages as `push` of each event: the files differ only in what `finish` stamps (none
/// here past the data), so their bytes are equal. A run stops at the first event its
/// predicate refuses or that is before the CPU's last, and the rest is pushed again.
#[test]
fn pushing_padded_runs_writes_what_pushing_each_event_writes() {
    let dir = tempfile::tempdir().unwrap();
    let events = synth(11, 60_000, 3);
    let one = dir.path().join("one.dat");
    write(&one, FileVersion::V7, 3, &events);
    let runs = dir.path().join("runs.dat");
    let mut w = TraceDatWriter::create(&runs, WriterOptions::new(3, 42)).unwrap();
    for run in events.chunk_by(|a, b| a.0 == b.0) {
        let padded: Vec<Padded> = run
            .iter()
            .map(|(_, ts, id, p)| {
                let mut b = [0; MAX_PAYLOAD];
                b[..p.len()].copy_from_slice(p);
                Padded {
                    ts: *ts,
                    id: *id,
                    len: p.len(),
                    payload: b,
                }
            })
            .collect();
        // Every 7th event is refused once, then pushed on its own.
        let mut rest = &padded[..];
        let mut refuse = true;
        while !rest.is_empty() {
            let (n, res) =
                w.push_padded_while(run[0].0, rest, |e| (!refuse || e.ts % 7 != 0).then_some(*e));
            res.unwrap();
            rest = &rest[n..];
            refuse = n > 0;
        }
        // Behind the CPU's last event: nothing written.
        if let Some(last) = padded.last().filter(|e| e.ts > 0) {
            let early = Padded {
                ts: last.ts - 1,
                ..*last
            };
            assert_eq!(w.push_padded_while(run[0].0, &[early], |e| Some(*e)).0, 0);
        }
    }
    w.finish(None).unwrap().verify().unwrap();
    crate::atomic_file::assert_output_mode(&runs);
    assert_eq!(std::fs::read(&runs).unwrap(), std::fs::read(&one).unwrap());
}

/// The first CPU's pages written on the caller's thread (`write_here`, its data synced in the
/// background) make the same file as on a writing thread: over more than one sync's worth
/// of pages, with a second, spilled CPU.
#[test]
fn pages_written_here_make_the_file_a_writing_thread_makes() {
    let dir = tempfile::tempdir().unwrap();
    // About 40 MB on CPU 0, past `SYNC_EVERY`.
    let mut events = synth(17, 1_500_000, 1);
    events.extend(synth(19, 1000, 2).into_iter().filter(|e| e.0 == 1));
    let bg = dir.path().join("bg.dat");
    write(&bg, FileVersion::V7, 2, &events);
    assert!(std::fs::metadata(&bg).unwrap().len() > crate::atomic_file::SYNC_EVERY as u64);
    let here = dir.path().join("here.dat");
    let mut w = TraceDatWriter::create(
        &here,
        WriterOptions {
            write_here: true,
            ..options(FileVersion::V7, 2, 42)
        },
    )
    .unwrap();
    for (cpu, ts, id, p) in &events {
        w.push(*cpu, *ts, *id, p).unwrap();
    }
    w.finish(None).unwrap().verify().unwrap();
    assert!(std::fs::read(&here).unwrap() == std::fs::read(&bg).unwrap());
}

#[test]
fn a_cpu_without_events_and_an_empty_trace_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V6, FileVersion::V7] {
        let path = dir.path().join("e.dat");
        let s = write(&path, version, 2, &vec![(1, 5, 1, vec![])]);
        assert_eq!(s.events, vec![0, 1]);
        assert_eq!(s.ranges, vec![None, Some((5, 5))]);
        let s = write(&path, version, 1, &Vec::new());
        assert_eq!(s.pages, vec![0]);
        verify_file(&path).unwrap();
    }
}

#[test]
fn refusals_write_nothing_and_leave_the_writer_usable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.dat");
    assert!(matches!(
        TraceDatWriter::create(&path, WriterOptions::new(0, 1)),
        Err(TraceDatError::NoCpus)
    ));
    let mut w = TraceDatWriter::create(&path, WriterOptions::new(2, 1)).unwrap();
    w.push(0, 100, 1, &[]).unwrap();
    assert!(matches!(
        w.push(0, 99, 2, &[]),
        Err(TraceDatError::NotMonotonic {
            cpu: 0,
            ts: 99,
            last: 100
        })
    ));
    assert!(matches!(
        w.push(2, 100, 2, &[]),
        Err(TraceDatError::CpuOutOfRange { cpu: 2, cpus: 2 })
    ));
    assert!(matches!(
        w.push(1, 100, 2, &[0; 17]),
        Err(TraceDatError::PayloadTooLong { len: 17, max: 16 })
    ));
    // Equal timestamps are fine; the other CPU has its own clock order.
    w.push(0, 100, 3, &[]).unwrap();
    w.push(1, 5, 4, &[]).unwrap();
    let s = w.finish(None).unwrap();
    assert_eq!(s.events, vec![2, 1]);
    s.verify().unwrap();
}

#[test]
fn cpus_added_while_streaming_are_in_the_file_with_their_events_and_the_uname() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V6, FileVersion::V7] {
        let path = dir.path().join("added.dat");
        let mut w = TraceDatWriter::create(&path, options(version, 1, 9)).unwrap();
        w.push(0, 10, 1, &[1]).unwrap();
        assert_eq!(w.add_cpu().unwrap(), 1);
        w.push(1, 5, 2, &[2, 2]).unwrap();
        w.push(0, 11, 3, &[]).unwrap();
        assert_eq!(w.add_cpu().unwrap(), 2);
        w.push(2, 1, 4, &[]).unwrap();
        w.set_uname("three CPUs".into());
        let s = w.finish(None).unwrap();
        assert_eq!(s.events, vec![2, 1, 1], "{version:?}");
        s.verify().unwrap();
        let layout = read_layout(&path).unwrap();
        assert_eq!(layout.buffers[0].cpus.len(), 3, "{version:?}");
        let uname: Vec<&[u8]> = layout
            .options_with(crate::formats::tracedat::consts::option::UNAME)
            .map(|o| o.data.as_slice())
            .collect();
        assert_eq!(uname, [b"three CPUs\0".as_slice()], "{version:?}");
        let got = read_back(&path);
        assert_eq!(
            got.iter().map(|e| (e.0, e.1, e.2)).collect::<Vec<_>>(),
            [(0, 10, 1), (0, 11, 3), (1, 5, 2), (2, 1, 4)],
            "{version:?}"
        );
    }
}

#[test]
fn a_time_shift_above_the_limit_leaves_no_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.dat");
    let mut w = TraceDatWriter::create(&path, WriterOptions::new(1, 1)).unwrap();
    let g0 = 2_300_000_000_000;
    w.push(0, g0, 1, &[]).unwrap();
    w.push(0, g0 + 10_000_000_000, 2, &[]).unwrap();
    let ratio = (1u64 << 48) + (1u64 << 48) / 10_000;
    let map = KvmTscMapping::try_new(0, ratio, 48).unwrap();
    let shift = TimeShift {
        peer_trace_id: 9,
        mode: ShiftMode::Step,
        cpus: vec![vec![SyncSegment {
            start: HostTicks(2_000_000_000_000),
            map,
        }]],
    };
    let bound = w.shift_error(&shift).unwrap()[0];
    assert!(bound > 1);
    match w.finish(Some(&shift)) {
        Err(TraceDatError::TimeShift(TimeShiftError::AboveLimit {
            cpu: 0, limit: 1, ..
        })) => {}
        other => panic!("{other:?}"),
    }
    // Neither the target nor a temporary file remains.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn every_truncation_is_detected_with_an_offset_inside_the_file() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V7, FileVersion::V6] {
        let path = dir.path().join("full.dat");
        let events = synth(11, 400, 3);
        let shift = TimeShift {
            peer_trace_id: 1,
            mode: ShiftMode::Step,
            cpus: vec![vec![SyncSegment::offset_only(HostTicks(0), 10)]; 3],
        };
        let mut w = TraceDatWriter::create(&path, options(version, 3, 5)).unwrap();
        for (cpu, ts, id, p) in &events {
            w.push(*cpu, *ts, *id, p).unwrap();
        }
        w.finish(Some(&shift)).unwrap().verify().unwrap();
        let full = std::fs::read(&path).unwrap();
        let cut = dir.path().join("cut.dat");
        std::fs::write(&cut, &full).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&cut).unwrap();
        // Shrinking one file in place visits every length without rewriting it each time.
        for len in (0..full.len()).rev() {
            f.set_len(len as u64).unwrap();
            match verify_file(&cut) {
                Err(TraceDatError::Parse { offset, .. }) => {
                    assert!(
                        offset <= len as u64,
                        "{version:?} cut at {len}: offset {offset}"
                    );
                }
                other => panic!("{version:?} cut at {len} of {}: {other:?}", full.len()),
            }
        }
        verify_file(&path).unwrap();
    }
}

#[test]
fn tsc2nsec_is_written_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    for version in [FileVersion::V6, FileVersion::V7] {
        let path = dir.path().join("n.dat");
        let mut opts = options(version, 1, 3);
        let t = Tsc2Nsec {
            mult: 6_462_042,
            shift: 24,
            offset: 0,
        };
        opts.tsc2nsec = Some(t);
        let mut w = TraceDatWriter::create(&path, opts).unwrap();
        w.push(0, 2_600_000_000, 1, &[]).unwrap();
        w.finish(None).unwrap();
        assert_eq!(read_layout(&path).unwrap().tsc2nsec(), Some(t));
    }
}
