//! Reading an instance's ring buffers as binary pages: `per_cpu/cpuN/trace_pipe_raw`.
//!
//! Each `read(2)` of a `trace_pipe_raw` returns one ring-buffer page (16-byte header, then
//! events) and consumes it; a page the kernel is still writing comes back partially (its
//! `commit` says how much), so events are readable as soon as they are committed. The pages
//! have the layout trace.dat stores, and are walked by the same code
//! ([`crate::formats::tracedat::page::walk_records`]). Files are opened non-blocking: a drain reads what
//! is there and returns, at most [`MAX_PAGES_PER_DRAIN`] pages, so a flood of events cannot
//! keep the caller from its own deadline.

use std::fs::File;
use std::io::Read;

use super::instance::{Instance, TraceError, nothing_to_read_now};
use crate::formats::tracedat::page::walk_records;

/// The most pages one [`RawPipes::drain`] reads over all CPUs (1 MiB of 4 KiB pages).
pub const MAX_PAGES_PER_DRAIN: usize = 256;

/// The read buffer: one read returns at most one ring-buffer page (a kernel page, 4 KiB on
/// x86-64, unless `buffer_subbuf_size_kb` was raised); a page larger than this would be read in
/// pieces that do not walk, so the buffer covers every sub-buffer size up to 64 KiB.
const MAX_PAGE_BYTES: usize = 64 << 10;

/// What one drain saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrainStats {
    /// Pages read.
    pub pages: u64,
    /// Records handed to the callback.
    pub records: u64,
    /// Pages that did not walk (damaged; their records up to the damage were passed on).
    pub bad_pages: u64,
    /// Pages whose header flags events the kernel dropped before we read them (buffer full).
    pub lost_flagged: u64,
    /// Whether [`MAX_PAGES_PER_DRAIN`] stopped the drain with pages left.
    pub capped: bool,
}

/// The `missed events` flag in a page's `commit` word (`RB_MISSED_EVENTS`,
/// kernel/trace/ring_buffer.c).
const RB_MISSED_EVENTS: u64 = 1 << 31;

/// Every CPU's `trace_pipe_raw` of one instance.
#[derive(Debug)]
pub struct RawPipes {
    cpus: Vec<(u32, File)>,
    page: Vec<u8>,
}

impl RawPipes {
    /// Opens `per_cpu/cpuN/trace_pipe_raw` for every CPU directory of `instance`.
    ///
    /// # Errors
    /// [`TraceError::Io`] if the CPU directories cannot be listed or a pipe cannot be opened.
    pub fn open(instance: &Instance) -> Result<Self, TraceError> {
        let per_cpu = instance.path().join("per_cpu");
        let rd = std::fs::read_dir(&per_cpu).map_err(super::instance::io_err("list", &per_cpu))?;
        let mut cpus = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(cpu) = name
                .to_str()
                .and_then(|n| n.strip_prefix("cpu"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let f = instance.open_nonblocking(&format!("per_cpu/cpu{cpu}/trace_pipe_raw"))?;
            cpus.push((cpu, f));
        }
        cpus.sort_by_key(|(c, _)| *c);
        Ok(Self {
            cpus,
            page: vec![0; MAX_PAGE_BYTES],
        })
    }

    /// Reads every page that is ready on every CPU (at most [`MAX_PAGES_PER_DRAIN`] in all)
    /// and calls `f(cpu, timestamp, record)` for each record, CPU by CPU, in page order.
    ///
    /// # Errors
    /// [`TraceError::Io`] for a read error other than "nothing ready".
    pub fn drain(&mut self, mut f: impl FnMut(u32, u64, &[u8])) -> Result<DrainStats, TraceError> {
        let mut st = DrainStats::default();
        for (cpu, file) in &mut self.cpus {
            loop {
                if st.pages >= MAX_PAGES_PER_DRAIN as u64 {
                    st.capped = true;
                    return Ok(st);
                }
                let n = match file.read(&mut self.page) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if nothing_to_read_now(&e) => break,
                    Err(source) => {
                        return Err(TraceError::Io {
                            action: "read",
                            path: format!("per_cpu/cpu{cpu}/trace_pipe_raw").into(),
                            source,
                        });
                    }
                };
                st.pages += 1;
                st.lost_flagged += u64::from(page_flags_missed(&self.page[..n]));
                let c = *cpu;
                match walk_records(&self.page[..n], |ts, _, rec| {
                    f(c, ts, rec);
                    true
                }) {
                    Ok(k) => st.records += k,
                    Err(_) => st.bad_pages += 1,
                }
            }
        }
        Ok(st)
    }
}

/// Whether a page's header says events were lost before it.
fn page_flags_missed(page: &[u8]) -> bool {
    page.get(8..16)
        .and_then(|b| b.try_into().ok())
        .is_some_and(|b: [u8; 8]| u64::from_le_bytes(b) & RB_MISSED_EVENTS != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_missed_events_flag_is_read_from_commit() {
        let mut page = vec![0u8; 64];
        assert!(!page_flags_missed(&page));
        page[8..16].copy_from_slice(&(RB_MISSED_EVENTS | 16).to_le_bytes());
        assert!(page_flags_missed(&page));
        assert!(!page_flags_missed(&page[..10]));
    }
}
