//! `kvm_pio` in a private tracefs instance, read from `trace_pipe_raw` as it comes.

use std::collections::VecDeque;
use std::path::Path;

use super::{AnchorStats, EVENT, MAX_EXITS, PioExit};
use crate::ftrace::format::KvmPioLayout;
use crate::ftrace::{Instance, RawPipes, TraceError, find_tracefs};

/// Whose exits a [`PioTrace`] keeps.
#[derive(Debug)]
enum Threads {
    /// These threads (the kernel filter names them too).
    Listed(Vec<u32>),
    /// Every thread of one process, whenever it was created (checked in `/proc`, each
    /// thread id once).
    Of {
        task_dir: std::path::PathBuf,
        known: std::collections::HashMap<u32, bool>,
    },
}

impl Threads {
    fn keeps(&mut self, tid: u32) -> bool {
        match self {
            Self::Listed(t) => t.contains(&tid),
            Self::Of { task_dir, known } => {
                // Bounded: a thread id is looked up once; the map is cleared if a host runs
                // through many (foreign threads on the port are only filtered out).
                if known.len() >= 1 << 16 {
                    known.clear();
                }
                *known
                    .entry(tid)
                    .or_insert_with(|| task_dir.join(tid.to_string()).exists())
            }
        }
    }
}

/// `kvm_pio` in a private instance, filtered to some vCPU threads and ports, read as it comes.
#[derive(Debug)]
pub struct PioTrace {
    /// Declared before `instance`: the pipes close first, so the instance can be removed.
    pipes: RawPipes,
    layout: KvmPioLayout,
    threads: Threads,
    exits: VecDeque<PioExit>,
    /// The latest stamp of an exit dropped because more than [`MAX_EXITS`] waited.
    dropped_until: Option<u64>,
    instance: Instance,
}

impl PioTrace {
    /// Creates the instance (`vmtsync-anchor-<pid>`) under `tracefs` (or the standard mount
    /// points), clock `x86-tsc`, `kvm_pio` filtered to `threads` and `ports`, and opens every
    /// CPU's `trace_pipe_raw`.
    ///
    /// # Errors
    /// [`TraceError`]; [`TraceError::is_unavailable`] tells "not here" (no tracefs, no event,
    /// not root) from a fault. A clock that cannot be set to `x86-tsc` is refused: its
    /// stamps would not be host TSC readings.
    pub fn start(
        tracefs: Option<&Path>,
        threads: &[u32],
        ports: &[u16],
    ) -> Result<Self, TraceError> {
        Self::start_with(tracefs, Threads::Listed(threads.to_vec()), threads, ports)
    }

    /// [`PioTrace::start`] for every thread of process `pid` (its tasks under `proc_root`),
    /// also those it creates later: the kernel filter names only the ports.
    ///
    /// # Errors
    /// As [`PioTrace::start`].
    pub fn start_process(
        tracefs: Option<&Path>,
        proc_root: &Path,
        pid: u32,
        ports: &[u16],
    ) -> Result<Self, TraceError> {
        let threads = Threads::Of {
            task_dir: proc_root.join(pid.to_string()).join("task"),
            known: std::collections::HashMap::new(),
        };
        Self::start_with(tracefs, threads, &[], ports)
    }

    fn start_with(
        tracefs: Option<&Path>,
        threads: Threads,
        filter_threads: &[u32],
        ports: &[u16],
    ) -> Result<Self, TraceError> {
        let root = find_tracefs(tracefs, EVENT)?;
        let mut instance = Instance::create(&root, "anchor")?;
        if !instance.tsc_clock() {
            let clock = instance.path().join("trace_clock");
            return Err(TraceError::Io {
                action: "set x86-tsc in",
                path: clock,
                source: std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the kernel offers no x86-tsc trace clock",
                ),
            });
        }
        let layout =
            KvmPioLayout::new(&instance.format(EVENT)?).map_err(|source| TraceError::Format {
                path: instance.path().join("events").join(EVENT).join("format"),
                source,
            })?;
        instance.set_filter(EVENT, &filter(filter_threads, ports))?;
        instance.enable(EVENT)?;
        let pipes = RawPipes::open(&instance)?;
        Ok(Self {
            pipes,
            layout,
            threads,
            exits: VecDeque::new(),
            dropped_until: None,
            instance,
        })
    }

    /// The instance directory (removed when this is dropped).
    #[must_use]
    pub fn instance_path(&self) -> &Path {
        self.instance.path()
    }

    /// Reads every exit that is ready into the window of kept exits, kept in time order: an
    /// exit read late (its CPU's buffer was read before it was committed) goes where its
    /// stamp puts it, before exits of other CPUs read earlier.
    ///
    /// # Errors
    /// Read errors of `trace_pipe_raw`.
    pub fn poll(&mut self, stats: &mut AnchorStats) -> Result<(), TraceError> {
        let mut fresh = Vec::new();
        let (layout, threads) = (&self.layout, &mut self.threads);
        let st = self.pipes.drain(|_, ts, rec| {
            // The kernel filter already selects; checking again keeps a wrong filter (or a
            // kernel that ignored it) from matching another thread's bytes.
            if let Some(pio) = layout.decode(rec)
                && threads.keeps(pio.pid)
            {
                fresh.push(PioExit { ts, pio });
            }
        })?;
        stats.damaged_pages += st.bad_pages + st.lost_flagged;
        // Pages left for the next drain may hold this exchange's own exits.
        stats.drains_capped += u64::from(st.capped);
        // Per-CPU buffers are each in order; a thread that migrated interleaves them. The
        // x86-tsc clock is the same on every CPU, so time order is the order of the exits.
        fresh.sort_by_key(|e| e.ts);
        for e in fresh {
            if self.exits.len() >= MAX_EXITS
                && let Some(old) = self.exits.pop_front()
            {
                stats.exits_overflowed += 1;
                self.dropped_until = Some(self.dropped_until.map_or(old.ts, |d| d.max(old.ts)));
            }
            insert_in_order(&mut self.exits, e);
        }
        Ok(())
    }

    /// The latest stamp of an exit dropped because more than [`MAX_EXITS`] waited (a bracket
    /// that needs exits at or before it cannot be made).
    #[must_use]
    pub const fn dropped_until(&self) -> Option<u64> {
        self.dropped_until
    }

    /// Forgets exits before `ts` (an exchange that started at `ts` cannot use them).
    pub fn forget_before(&mut self, ts: u64) {
        while self.exits.front().is_some_and(|e| e.ts < ts) {
            self.exits.pop_front();
        }
    }

    /// The kept exits, oldest first.
    pub fn exits(&mut self) -> &[PioExit] {
        self.exits.make_contiguous()
    }
}

/// Puts `e` into `exits` (in stamp order) where its stamp goes: usually at the back; a late
/// exit of another CPU goes back to its place, after exits of the same stamp.
fn insert_in_order(exits: &mut VecDeque<PioExit>, e: PioExit) {
    let at = exits.partition_point(|k| k.ts <= e.ts);
    exits.insert(at, e);
}

/// The kernel filter: the ports, and the threads (an empty thread list filters by port only).
#[must_use]
pub fn filter(threads: &[u32], ports: &[u16]) -> String {
    let any = |terms: Vec<String>| format!("({})", terms.join(" || "));
    let ports = any(ports.iter().map(|p| format!("port == {p:#x}")).collect());
    if threads.is_empty() {
        ports
    } else {
        let t = any(threads
            .iter()
            .map(|t| format!("common_pid == {t}"))
            .collect());
        format!("{ports} && {t}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_read_late_goes_back_to_its_place_in_stamp_order() {
        use crate::ftrace::format::{KvmPio, PioDirection};
        let at = |ts| PioExit {
            ts,
            pio: KvmPio {
                pid: 1,
                direction: PioDirection::In,
                port: 0x2400,
                size: 1,
                count: 1,
                val: 0,
            },
        };
        let mut q = VecDeque::new();
        for ts in [10, 20, 40, 15, 50, 20, 5] {
            insert_in_order(&mut q, at(ts));
        }
        let stamps: Vec<u64> = q.iter().map(|e| e.ts).collect();
        assert_eq!(stamps, [5, 10, 15, 20, 20, 40, 50]);
    }

    #[test]
    fn the_filter_names_ports_and_threads() {
        assert_eq!(filter(&[], &[0x3f8]), "(port == 0x3f8)");
        assert_eq!(
            filter(&[12, 13], &[0x3f8, 0x510]),
            "(port == 0x3f8 || port == 0x510) && (common_pid == 12 || common_pid == 13)"
        );
    }
}
