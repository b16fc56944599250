//! `kvm_pio` in a private tracefs instance, read from `trace_pipe_raw` as it comes.

use std::collections::VecDeque;
use std::path::Path;

use super::{AnchorStats, EVENT, MAX_EXITS, PioExit};
use crate::ftrace::format::KvmPioLayout;
use crate::ftrace::{Instance, RawPipes, TraceError, find_tracefs};

/// The threads of one process, whenever each was created: a thread id is checked in `/proc`
/// once.
#[derive(Debug)]
struct Threads {
    task_dir: std::path::PathBuf,
    known: std::collections::HashMap<u32, bool>,
}

impl Threads {
    fn keeps(&mut self, tid: u32) -> bool {
        // Bounded: a thread id is looked up once; the map is cleared if a host runs through
        // many (foreign threads on the port are only filtered out).
        if self.known.len() >= 1 << 16 {
            self.known.clear();
        }
        let task_dir = &self.task_dir;
        *self
            .known
            .entry(tid)
            .or_insert_with(|| task_dir.join(tid.to_string()).exists())
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
    /// points), clock `x86-tsc`, `kvm_pio` filtered to `ports`, opens every CPU's
    /// `trace_pipe_raw`, and keeps the exits of every thread of process `pid` (its tasks under
    /// `proc_root`), also of those it creates or first runs later: a VMM's vCPU thread may run
    /// for the first time after the trace started.
    ///
    /// # Errors
    /// [`TraceError`]; [`TraceError::is_unavailable`] tells "not here" (no tracefs, no event,
    /// not root) from a fault. A clock that cannot be set to `x86-tsc` is refused: its
    /// stamps would not be host TSC readings.
    pub fn start_process(
        tracefs: Option<&Path>,
        proc_root: &Path,
        pid: u32,
        ports: &[u16],
    ) -> Result<Self, TraceError> {
        let threads = Threads {
            task_dir: proc_root.join(pid.to_string()).join("task"),
            known: std::collections::HashMap::new(),
        };
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
        instance.set_filter(EVENT, &filter(ports))?;
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
            // The kernel filter names only the ports: another process's exits on them (another
            // VM's UART) are dropped here.
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

/// The kernel filter: the ports (the threads are checked here, as each is seen).
#[must_use]
pub fn filter(ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(|p| format!("port == {p:#x}")).collect();
    format!("({})", ports.join(" || "))
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
    fn the_filter_names_the_ports() {
        assert_eq!(filter(&[0x3f8]), "(port == 0x3f8)");
        assert_eq!(filter(&[0x3f8, 0x510]), "(port == 0x3f8 || port == 0x510)");
    }
}
