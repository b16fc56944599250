//! `kvm_pio` in a private tracefs instance, read from `trace_pipe_raw` as it comes.

use std::collections::VecDeque;
use std::path::Path;

use super::{AnchorStats, EVENT, MAX_EXITS, PioExit};
use crate::ftrace::format::KvmPioLayout;
use crate::ftrace::{Instance, RawPipes, TraceError, find_tracefs};

/// `kvm_pio` in a private instance, filtered to some vCPU threads and ports, read as it comes.
#[derive(Debug)]
pub struct PioTrace {
    /// Declared before `instance`: the pipes close first, so the instance can be removed.
    pipes: RawPipes,
    layout: KvmPioLayout,
    threads: Vec<u32>,
    exits: VecDeque<PioExit>,
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
        instance.set_filter(EVENT, &filter(threads, ports))?;
        instance.enable(EVENT)?;
        let pipes = RawPipes::open(&instance)?;
        Ok(Self {
            pipes,
            layout,
            threads: threads.to_vec(),
            exits: VecDeque::new(),
            instance,
        })
    }

    /// The instance directory (removed when this is dropped).
    #[must_use]
    pub fn instance_path(&self) -> &Path {
        self.instance.path()
    }

    /// Reads every exit that is ready into the window of kept exits (time-ordered).
    ///
    /// # Errors
    /// Read errors of `trace_pipe_raw`.
    pub fn poll(&mut self, stats: &mut AnchorStats) -> Result<(), TraceError> {
        let mut fresh = Vec::new();
        let (layout, threads) = (&self.layout, &self.threads);
        let st = self.pipes.drain(|_, ts, rec| {
            // The kernel filter already selects; checking again keeps a wrong filter (or a
            // kernel that ignored it) from matching another thread's bytes.
            if let Some(pio) = layout.decode(rec)
                && threads.contains(&pio.pid)
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
            if self.exits.len() >= MAX_EXITS {
                self.exits.pop_front();
                stats.exits_overflowed += 1;
            }
            self.exits.push_back(e);
        }
        Ok(())
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
    fn the_filter_names_ports_and_threads() {
        assert_eq!(filter(&[], &[0x3f8]), "(port == 0x3f8)");
        assert_eq!(
            filter(&[12, 13], &[0x3f8, 0x510]),
            "(port == 0x3f8 || port == 0x510) && (common_pid == 12 || common_pid == 13)"
        );
    }
}
