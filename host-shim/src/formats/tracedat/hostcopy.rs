//! A copy of a host trace.dat with a GUEST option (and a TRACEID if it has none), so that
//! `trace-cmd report -i host.dat -i guest.dat` knows which host threads run the guest's vCPUs.
//!
//! The input is never modified. The copy is written to a temporary file beside the output,
//! re-read and checked, synced, and renamed onto the output (`copy_with_options`, which
//! `vmtsync trace-cmd attach` also uses to add a TIME_SHIFT to a guest trace).
//!
//! The cheapest correct edit per version (details in `docs/trace-dat.md`):
//! - **v7**: the file is copied byte for byte (`copy_file_range`), then a new options section
//!   (TRACEID, GUEST, DONE 0) and a strings section naming it are appended at the end, and the
//!   last DONE option's "next section" field is patched to point at the new section. Sections
//!   stay contiguous; compressed sections (what `trace-cmd extract` writes) are not touched.
//! - **v6**: options precede the CPU data, so the new options are inserted before the options'
//!   end marker and everything after it moves. To keep every page aligned it moves by a whole
//!   number of pages (zero padding grows in front of the first data), and every absolute data
//!   offset (the top CPU table, instance BUFFER options and their tables) is patched.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::consts::{PAGE_SIZE, option};
use super::error::TraceDatError;
use super::reader::{self, Layout};
use super::writer::Strings;
use crate::atomic_file::AtomicFile;

/// The guest a host trace is annotated with (the GUEST option, trace-cmd's layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestInfo {
    /// The guest's name as `trace-cmd report` shows it.
    pub name: String,
    /// The guest trace's TRACEID (trace-cmd matches it against the guest file's).
    pub trace_id: u64,
    /// `(guest CPU, host thread PID)` per vCPU; guest CPUs must be `0..len` (trace-cmd rejects
    /// a CPU number at or above the count).
    pub vcpu_pids: Vec<(u32, u32)>,
}

/// What [`copy_host_trace`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCopySummary {
    /// The output file.
    pub path: PathBuf,
    /// The input's file version.
    pub version: u32,
    /// The host trace's TRACEID in the copy (for the guest file's TIME_SHIFT `peer_trace_id`).
    pub host_trace_id: u64,
    /// Whether a TRACEID option was added.
    pub added_trace_id: bool,
    /// Length of the copy.
    pub bytes: u64,
}

/// Copies the host trace `input` to `output` with a GUEST option for `guest`.
///
/// The copy's TRACEID is the input's if it has one and `trace_id` is `None` or equal to it;
/// otherwise a TRACEID option with `trace_id` (or, if `None`, a random id) is added, which
/// trace-cmd reads in place of an earlier one.
///
/// # Errors
/// `Parse` if the input is damaged or truncated, `Unsupported` for a compressed options section
/// or an unusual v6 layout, `Verify` if the copy does not read back, `Io` otherwise.
pub fn copy_host_trace(
    input: &Path,
    output: &Path,
    guest: &GuestInfo,
    trace_id: Option<u64>,
) -> Result<HostCopySummary, TraceDatError> {
    copy_host_trace_with(input, output, guest, trace_id, None)
}

/// [`copy_host_trace`], and with `tsc2nsec` a TSC2NSEC option when the input has none (a
/// host trace on `x86-tsc` then shows seconds, as the guest file written with the same
/// values does; an input recorded with `--tsc2nsec` keeps its own).
///
/// # Errors
/// As [`copy_host_trace`].
pub fn copy_host_trace_with(
    input: &Path,
    output: &Path,
    guest: &GuestInfo,
    trace_id: Option<u64>,
    tsc2nsec: Option<super::Tsc2Nsec>,
) -> Result<HostCopySummary, TraceDatError> {
    if guest
        .vcpu_pids
        .iter()
        .any(|&(cpu, _)| cpu as usize >= guest.vcpu_pids.len())
    {
        return Err(TraceDatError::Unsupported {
            path: output.to_path_buf(),
            reason: "GUEST vCPU numbers must be 0..count (trace-cmd drops the option otherwise)"
                .into(),
        });
    }
    let layout = reader::read_layout(input)?;
    let existing = layout.trace_id();
    let (host_trace_id, add_id) = match (existing, trace_id) {
        (Some(e), None) => (e, false),
        (Some(e), Some(t)) if e == t => (e, false),
        (_, Some(t)) => (t, true),
        (None, None) => (random_id(), true),
    };
    let mut opts = Vec::new();
    if add_id {
        put(&mut opts, option::TRACEID, &host_trace_id.to_le_bytes());
    }
    put(&mut opts, option::GUEST, &guest_option(guest));
    let add_tsc2nsec = tsc2nsec.filter(|_| layout.tsc2nsec().is_none());
    if let Some(t) = add_tsc2nsec {
        let mut b = Vec::with_capacity(16);
        b.extend_from_slice(&t.mult.to_le_bytes());
        b.extend_from_slice(&t.shift.to_le_bytes());
        b.extend_from_slice(&t.offset.to_le_bytes());
        put(&mut opts, option::TSC2NSEC, &b);
    }
    let bytes = copy_with_options(input, output, &layout, &opts, |path, l| {
        let bad = |reason: &str| TraceDatError::Verify {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        if l.trace_id() != Some(host_trace_id) {
            return Err(bad("TRACEID does not read back"));
        }
        let want = guest_option(guest);
        if l.options_with(option::GUEST).last().map(|o| &o.data) != Some(&want) {
            return Err(bad("GUEST option does not read back"));
        }
        if add_tsc2nsec.is_some() && l.tsc2nsec() != add_tsc2nsec {
            return Err(bad("TSC2NSEC option does not read back"));
        }
        Ok(())
    })?;
    Ok(HostCopySummary {
        path: output.to_path_buf(),
        version: layout.version,
        host_trace_id,
        added_trace_id: add_id,
        bytes,
    })
}

/// Refuses an output that is the input (inputs are never modified).
pub(super) fn refuse_same_file(input: &Path, output: &Path) -> Result<(), TraceDatError> {
    match (input.canonicalize(), output.canonicalize()) {
        (Ok(a), Ok(b)) if a == b => Err(TraceDatError::Unsupported {
            path: output.to_path_buf(),
            reason: "the output is the input: inputs are never modified, name another output"
                .into(),
        }),
        _ => Ok(()),
    }
}

/// Writes a copy of `input` (whose layout is `layout`) with the encoded options `opts` (no
/// DONE) added, the cheapest correct way for its version (module docs), to a temporary file
/// beside `output`; re-reads it (buffers, option count, then `check`), syncs it and renames it
/// onto `output`. Returns the copy's length. The input is only read.
///
/// # Errors
/// As the readers; `Verify` if the copy does not read back as intended; `Io` otherwise.
pub(super) fn copy_with_options(
    input: &Path,
    output: &Path,
    layout: &Layout,
    opts: &[u8],
    check: impl FnOnce(&Path, &Layout) -> Result<(), TraceDatError>,
) -> Result<u64, TraceDatError> {
    refuse_same_file(input, output)?;
    let tmp = AtomicFile::new(output)
        .map_err(TraceDatError::io("create a temporary file beside", output))?;
    let tmp_path = tmp.path().to_path_buf();
    let io = |what| TraceDatError::io(what, &tmp_path);
    let mut src = File::open(input).map_err(TraceDatError::io("open", input))?;
    let out = tmp.as_file();
    let job = CopyJob {
        layout,
        src: &mut src,
        out,
        opts,
        out_path: &tmp_path,
    };
    let expect = match layout.version {
        7 => job.append_v7()?,
        _ => job.insert_v6()?,
    };
    out.sync_all().map_err(io("sync"))?;
    let l = verify_copy(&tmp_path, &expect)?;
    check(&tmp_path, &l)?;
    tmp.commit().map_err(|e| TraceDatError::Io {
        what: "rename the copy onto",
        path: output.to_path_buf(),
        source: e,
    })?;
    Ok(l.file_len)
}

/// What the copy must look like: the input's buffers with data moved by `shift` bytes.
struct Expect {
    buffers: Vec<Vec<(u64, u64)>>,
    options: usize,
}

/// What both ways of writing the copy work from: the input's layout and file, the copy being
/// written and its path, and the encoded options to add (no DONE).
struct CopyJob<'a> {
    layout: &'a Layout,
    src: &'a mut File,
    out: &'a File,
    opts: &'a [u8],
    out_path: &'a Path,
}

impl CopyJob<'_> {
    /// v7: the input copied whole, then a new options section linked from its last one.
    fn append_v7(self) -> Result<Expect, TraceDatError> {
        let mut out = self.out;
        let io = |what| TraceDatError::io(what, self.out_path);
        let copied = std::io::copy(self.src, &mut out).map_err(io("copy the host trace into"))?;
        if copied != self.layout.file_len {
            return Err(TraceDatError::Verify {
                path: self.out_path.to_path_buf(),
                reason: format!("copied {copied} bytes of {}", self.layout.file_len),
            });
        }
        let mut strings = Strings {
            bytes: Vec::new(),
            base: self.layout.strings_size,
        };
        let mut b = Vec::new();
        let mut body = self.opts.to_vec();
        put(&mut body, option::DONE, &0u64.to_le_bytes());
        strings.section_header(&mut b, option::DONE, "options", body.len() as u64);
        b.extend_from_slice(&body);
        let strings_id = strings.id("strings");
        let sbody = strings.bytes.clone();
        b.extend_from_slice(&option::STRINGS.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&strings_id.to_le_bytes());
        b.extend_from_slice(&(sbody.len() as u64).to_le_bytes());
        b.extend_from_slice(&sbody);
        out.write_all(&b).map_err(io("write"))?;
        out.write_all_at(&self.layout.file_len.to_le_bytes(), self.layout.options_end)
            .map_err(io("write"))?;
        Ok(Expect {
            buffers: tables(self.layout, 0),
            options: self.layout.options.len() + count_options(self.opts),
        })
    }

    /// v6: the options inserted before the data, which moves by whole pages.
    fn insert_v6(self) -> Result<Expect, TraceDatError> {
        let mut out = self.out;
        let io = |what| TraceDatError::io(what, self.out_path);
        let unsupported = |reason: &str| TraceDatError::Unsupported {
            path: self.out_path.to_path_buf(),
            reason: format!("{reason}: convert it with `trace-cmd convert --file-version 7` first"),
        };
        let (Some(fly_end), true) = (self.layout.flyrecord_end, self.layout.options_end > 0) else {
            return Err(unsupported("v6 file without options and flyrecord data"));
        };
        let ps = u64::from(self.layout.page_size);
        // Every absolute offset must point past the top table, where the shift is whole pages.
        let data_offsets: Vec<u64> = self
            .layout
            .buffers
            .iter()
            .flat_map(|b| b.cpus.iter().filter(|c| c.size > 0).map(|c| c.offset))
            .collect();
        let instance_at: Vec<u64> = self
            .layout
            .options_with(option::BUFFER)
            .map(|o| u64::from_le_bytes(o.data[..8].try_into().unwrap_or([0; 8])))
            .collect();
        if data_offsets
            .iter()
            .chain(&instance_at)
            .any(|&o| o < fly_end)
        {
            return Err(unsupported("v6 data before the end of the top CPU table"));
        }
        let ins = self.opts.len() as u64;
        let shift = ins.next_multiple_of(ps);
        // prefix | new options | end marker, "flyrecord", table, clock | padding | the rest.
        let copy = |out: &mut &File, from: u64, len: u64| -> Result<(), TraceDatError> {
            let mut part = self
                .src
                .try_clone()
                .map_err(io("read the host trace for"))?;
            std::io::Seek::seek(&mut part, std::io::SeekFrom::Start(from))
                .map_err(io("read the host trace for"))?;
            let n =
                std::io::copy(&mut part.take(len), out).map_err(io("copy the host trace into"))?;
            if n == len {
                Ok(())
            } else {
                Err(TraceDatError::Verify {
                    path: self.out_path.to_path_buf(),
                    reason: format!("copied {n} of {len} bytes at {from}"),
                })
            }
        };
        copy(&mut out, 0, self.layout.options_end)?;
        out.write_all(self.opts).map_err(io("write"))?;
        copy(
            &mut out,
            self.layout.options_end,
            fly_end - self.layout.options_end,
        )?;
        out.write_all(&vec![0; usize::try_from(shift - ins).unwrap_or(0)])
            .map_err(io("write"))?;
        copy(&mut out, fly_end, self.layout.file_len - fly_end)?;
        // Patch the top table (moved by `ins`), the BUFFER options (not moved) and the instance
        // tables (moved by `shift`).
        let fly = self.layout.flyrecord.unwrap_or(0);
        let patch_table = |out: &mut &File, table_at: u64, cpus: &[reader::CpuData]| {
            for (i, c) in cpus.iter().enumerate() {
                let at = table_at + 16 * i as u64;
                let off = if c.size > 0 || c.offset >= fly_end {
                    c.offset + shift
                } else {
                    c.offset
                };
                out.write_all_at(&off.to_le_bytes(), at)
                    .map_err(TraceDatError::io("write", self.out_path))?;
            }
            Ok::<_, TraceDatError>(())
        };
        if let Some(top) = self.layout.buffers.first() {
            patch_table(&mut out, fly + ins + 10, &top.cpus)?;
        }
        for (o, &at) in self.layout.options_with(option::BUFFER).zip(&instance_at) {
            out.write_all_at(&(at + shift).to_le_bytes(), o.offset)
                .map_err(io("write"))?;
        }
        for (b, &at) in self.layout.buffers.iter().skip(1).zip(&instance_at) {
            patch_table(&mut out, at + shift + 10, &b.cpus)?;
        }
        Ok(Expect {
            buffers: tables(self.layout, shift),
            options: self.layout.options.len() + count_options(self.opts),
        })
    }
}
fn tables(layout: &Layout, shift: u64) -> Vec<Vec<(u64, u64)>> {
    layout
        .buffers
        .iter()
        .map(|b| {
            b.cpus
                .iter()
                .map(|c| (if c.size > 0 { c.offset + shift } else { 0 }, c.size))
                .collect()
        })
        .collect()
}

fn count_options(opts: &[u8]) -> usize {
    let mut n = 0;
    let mut at = 0;
    while at + 6 <= opts.len() {
        let size = u32::from_le_bytes(opts[at + 2..at + 6].try_into().unwrap_or([0; 4]));
        at += 6 + size as usize;
        n += 1;
    }
    n
}

fn verify_copy(path: &Path, expect: &Expect) -> Result<Layout, TraceDatError> {
    let bad = |reason: String| TraceDatError::Verify {
        path: path.to_path_buf(),
        reason,
    };
    let l = reader::read_layout(path)?;
    if l.options.len() != expect.options {
        return Err(bad(format!(
            "{} options, expected {}",
            l.options.len(),
            expect.options
        )));
    }
    let got = tables(&l, 0);
    if got != expect.buffers {
        return Err(bad(format!(
            "buffers {got:?}, expected {:?}",
            expect.buffers
        )));
    }
    Ok(l)
}

/// GUEST: `name\0, u64 guest trace id, u32 count, {u32 guest cpu, u32 host pid}…`.
fn guest_option(g: &GuestInfo) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(g.name.as_bytes());
    b.push(0);
    b.extend_from_slice(&g.trace_id.to_le_bytes());
    b.extend_from_slice(
        &u32::try_from(g.vcpu_pids.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    for &(cpu, pid) in &g.vcpu_pids {
        b.extend_from_slice(&cpu.to_le_bytes());
        b.extend_from_slice(&pid.to_le_bytes());
    }
    b
}

pub(super) fn put(b: &mut Vec<u8>, id: u16, data: &[u8]) {
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_le_bytes());
    b.extend_from_slice(data);
}

/// A fresh id from the standard library's per-process random hash keys (no crate needed for
/// one 64-bit value).
pub(super) fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

// Pages are only ever moved by whole pages.
const _: () = assert!(PAGE_SIZE.is_power_of_two());

#[cfg(test)]
mod tests;
