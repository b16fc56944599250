//! SeaBIOS, traced: its source from Debian's `seabios` source package (fetched once into the
//! project cache), built with its own Makefile, stock or patched with vmtsync's C recorder
//! (`tests/firmware/seabios/`: `vmtsync.patch` and the glue `vmtsync_seabios.c`), and what the
//! tests and the demo need to know about the traced build (where its ring is, its event ids,
//! its phases, the counts it prints). [`crate::qemu::command_firmware`] boots a build.
//!
//! The source is fetched without touching the machine's apt configuration: a private apt
//! directory (its own source list, package lists and cache) with one `deb-src` entry for the
//! Debian archive the machine already uses, then `apt-get source --download-only` and
//! `dpkg-source -x --skip-patches`. No third-party source goes into the repository.
//!
//! A build is cached by a hash of its inputs (the source's version, and for the traced build
//! the patch, the glue and the recorder's two C files), so it runs again only when one changes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::LaunchError;
use crate::prereq::run_captured;

/// The Debian release whose `seabios` source package is built (SeaBIOS 1.16.2 in bookworm).
pub const SUITE: &str = "bookworm";
/// The archive used when the machine's own apt sources name no Debian archive.
pub const DEFAULT_ARCHIVE: &str = "http://deb.debian.org/debian";
/// The archive's signing keys (Debian's `debian-archive-keyring` package).
pub const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Guest-physical address of the traced build's recorder block (its header; e820 reserves
/// [`RING_RESERVED`] bytes from here). Must match `vmtsync_seabios.c`.
pub const RING_GPA: u64 = 0x0100_0000;
/// Bytes the traced build reserves at [`RING_GPA`] ([`Variant::Traced`]; see
/// [`Variant::ring_reserved`] for the others).
pub const RING_RESERVED: u64 = 0x1_0000;
/// Bytes the function-tracing builds reserve at [`RING_GPA`]: a flight ring of
/// [`FUNCTIONS_CAPACITY`] records, its handle and the glue's state.
pub const FUNCTIONS_RESERVED: u64 = 0x21_0000;
/// Records in the function-tracing builds' flight ring.
pub const FUNCTIONS_CAPACITY: u64 = 65536;
/// The traced build's beacon port (no device on `-M pc` decodes it; docs/firmware.md).
pub const BEACON_PORT: u16 = 0x2400;
/// The guest RAM the firmware is booted with (the ring at 16 MiB needs at least 17).
pub const MEMORY_MIB: u32 = 128;
/// The event id of a POST phase's begin (payload: the phase's name): vmtsync's span begin,
/// `vmtsync_core::recorder::SPAN_BEGIN_ID`. Each phase's begin follows the end of the one
/// before.
pub const PHASE_BEGIN: u16 = 0xFF01;
/// The event id of a POST phase's end (payload: its name): `SPAN_END_ID`. The last phase ends
/// at the first boot attempt.
pub const PHASE_END: u16 = 0xFF02;
/// The event id of a boot attempt (payload: the attempt's number, 4 bytes little-endian).
pub const BOOT_EVENT: u16 = 2;
/// The event ids recorded right before and right after each write to fw_cfg's selector port
/// (payload: the write's step number, 8 bytes little-endian; docs/firmware.md).
pub const FW_CFG_CTL_EVENTS: (u16, u16) = (3, 4);
/// The same around each write to fw_cfg's DMA address (its low half, the write that starts a
/// transfer).
pub const FW_CFG_DMA_EVENTS: (u16, u16) = (5, 6);
/// fw_cfg's selector port on `-M pc`.
pub const FW_CFG_CTL_PORT: u16 = 0x510;
/// fw_cfg's DMA address register, low half (the DMA block is 0x514-0x51b; SeaBIOS writes only
/// this half, which starts the transfer).
pub const FW_CFG_DMA_PORT: u16 = 0x518;
/// The POST phases the patch records, in the order SeaBIOS reaches them.
pub const PHASES: &[&str] = &[
    "post",
    "dopost",
    "interface",
    "platform",
    "vgarom",
    "devices",
    "optionrom",
    "bootmenu",
    "prepareboot",
    "startboot",
];
/// The start of the line the traced build prints on its debug console at each boot attempt:
/// `vmtsync: boot attempt N produced P refused R` (its ring's own counts, beacons included).
pub const COUNTS_LINE: &str = "vmtsync: boot attempt ";
/// The line SeaBIOS prints before each boot attempt with a device (stock and traced alike).
pub const BOOTING_LINE: &str = "Booting from ";
/// The line SeaBIOS prints where it moves its init code: `Relocating init from 0xL to 0xR
/// (size N)`. The function-tracing builds record the same move (a relocation record).
pub const RELOC_LINE: &str = "Relocating init from ";
/// The function [`Variant::Hung`] stops in (for ever, interrupts off), and the POST phase it
/// is in then.
pub const HUNG_IN: (&str, &str) = ("ps2port_setup", "devices");

/// Which SeaBIOS to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Debian's source as it is (Debian's own patches not applied), default config.
    Stock,
    /// The same source with `tests/firmware/seabios/vmtsync.patch` and the C recorder: POST
    /// phases as spans, boot attempts, fw_cfg writes, beacons; a stop-when-full ring of 1024.
    Traced,
    /// [`Variant::Traced`] plus `vmtsync-functions.patch`: all of SeaBIOS's 32-bit flat code
    /// (but the recorder, its glue, headers, `stacks.c` and `resume.c`) built with
    /// `-finstrument-functions`, recording every function's entry and exit from the first
    /// phase to the first boot attempt, and the relocation of its init code; a flight ring of
    /// [`FUNCTIONS_CAPACITY`] records.
    Functions,
    /// [`Variant::Functions`] plus `vmtsync-hung.patch`: POST stops for ever in
    /// [`HUNG_IN`]'s function, during device setup.
    Hung,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Stock => "stock",
            Self::Traced => "traced",
            Self::Functions => "functions",
            Self::Hung => "hung",
        }
    }

    /// The patches applied to SeaBIOS's source, in order.
    fn patches(self) -> &'static [&'static str] {
        match self {
            Self::Stock => &[],
            Self::Traced => &["vmtsync.patch"],
            Self::Functions => &["vmtsync.patch", "vmtsync-functions.patch"],
            Self::Hung => &[
                "vmtsync.patch",
                "vmtsync-functions.patch",
                "vmtsync-hung.patch",
            ],
        }
    }

    /// Bytes the build reserves at [`RING_GPA`] (0 for [`Variant::Stock`]).
    #[must_use]
    pub const fn ring_reserved(self) -> u64 {
        match self {
            Self::Stock => 0,
            Self::Traced => RING_RESERVED,
            Self::Functions | Self::Hung => FUNCTIONS_RESERVED,
        }
    }
}

/// The project cache's SeaBIOS directory: `$HOME/.cache/vmtsync/seabios`.
#[must_use]
pub fn cache_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/vmtsync/seabios")
}

/// The extracted source tree.
fn source_dir() -> PathBuf {
    cache_dir().join("source")
}

/// `tests/firmware/seabios/`: the patch and the glue.
#[must_use]
pub fn patch_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../firmware/seabios")
}

/// The recorder's C files copied into SeaBIOS's `src/` with the glue.
fn recorder_files() -> [PathBuf; 2] {
    let capi = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../capi");
    [capi.join("include/vmtsync.h"), capi.join("src/vmtsync.c")]
}

/// True when the SeaBIOS source is in the cache (`cargo xtask setup` fetches it).
#[must_use]
pub fn have_source() -> bool {
    source_dir().join(".version").is_file() && source_dir().join("Makefile").is_file()
}

/// The tools a build needs, each with the Debian package that has it.
const BUILD_TOOLS: &[(&str, &str)] = &[
    ("make", "make"),
    ("gcc", "gcc"),
    ("python3", "python3"),
    ("patch", "patch"),
];

/// Whether everything a SeaBIOS build needs is here: the cached source and its tools. `Err`
/// says what is missing and how to get it.
///
/// # Errors
/// [`LaunchError::Missing`] naming what is missing.
pub fn build_ready() -> Result<(), LaunchError> {
    if !have_source() {
        return Err(LaunchError::Missing(format!(
            "no SeaBIOS source in {} (cargo xtask setup fetches it)",
            cache_dir().display()
        )));
    }
    for (tool, package) in BUILD_TOOLS {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        if !found {
            return Err(LaunchError::Missing(format!(
                "`{tool}` is missing (apt-get install {package}, or cargo xtask setup)"
            )));
        }
    }
    Ok(())
}

/// The Debian archive URI the machine's apt already uses: the first `URIs:` (deb822) or
/// `deb URI` (one-line) entry ending in `/debian` under `/etc/apt`, else [`DEFAULT_ARCHIVE`].
#[must_use]
pub fn machine_archive() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "sources" || e == "list"))
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .find_map(|text| archive_in(&text))
        .unwrap_or_else(|| DEFAULT_ARCHIVE.to_owned())
}

/// The first Debian archive URI in one apt source file (deb822 or one-line format).
fn archive_in(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            let words: Vec<&str> = if let Some(uris) = l.strip_prefix("URIs:") {
                uris.split_whitespace().collect()
            } else if l.starts_with("deb ") || l.starts_with("deb-src ") {
                // `deb [options] URI suite components`: the first word with a scheme.
                l.split_whitespace()
                    .filter(|w| w.contains("://"))
                    .take(1)
                    .collect()
            } else {
                Vec::new()
            };
            words.into_iter().map(str::to_owned).collect::<Vec<_>>()
        })
        .find(|u| u.trim_end_matches('/').ends_with("/debian"))
        .map(|u| u.trim_end_matches('/').to_owned())
}

/// The private apt directory's one source file: `deb-src` of `archive`, [`SUITE`], main.
#[must_use]
pub fn deb_src_entry(archive: &str) -> String {
    format!(
        "Types: deb-src\nURIs: {archive}\nSuites: {SUITE}\nComponents: main\nSigned-By: {KEYRING}\n"
    )
}

/// apt-get with the private directory `apt` as its whole configuration of sources, lists and
/// cache (the machine's own is neither read nor changed).
fn private_apt(apt: &Path) -> Command {
    let mut c = Command::new("apt-get");
    c.arg("-o")
        .arg("Dir::Etc::sourcelist=/dev/null")
        .arg("-o")
        .arg(format!(
            "Dir::Etc::sourceparts={}",
            apt.join("etc").display()
        ))
        .arg("-o")
        .arg(format!("Dir::State::Lists={}", apt.join("lists").display()))
        .arg("-o")
        .arg(format!("Dir::Cache={}", apt.join("cache").display()))
        // The download lands in this process's own directory: no `_apt` sandbox user needed.
        .args(["-o", "APT::Sandbox::User=root", "-qq"])
        .current_dir(apt);
    c
}

fn io_err(what: &str, path: &Path, e: &std::io::Error) -> LaunchError {
    LaunchError::Missing(format!("{what} {}: {e}", path.display()))
}

/// Makes sure the SeaBIOS source is in the cache, fetching Debian's `seabios` source package
/// when it is missing (a private apt directory, `apt-get source --download-only`,
/// `dpkg-source -x --skip-patches`). Returns the source tree.
///
/// # Errors
/// apt-get or dpkg-source failing, with their output's tail.
pub fn ensure_source() -> Result<PathBuf, LaunchError> {
    let src = source_dir();
    if have_source() {
        return Ok(src);
    }
    let apt = cache_dir().join("apt");
    // A fresh private directory each time: nothing half-done is reused.
    let _ = std::fs::remove_dir_all(&apt);
    for d in ["etc", "lists/partial", "cache/archives/partial"] {
        std::fs::create_dir_all(apt.join(d)).map_err(|e| io_err("creating", &apt.join(d), &e))?;
    }
    let entry = apt.join("etc/vmtsync-debian-src.sources");
    std::fs::write(&entry, deb_src_entry(&machine_archive()))
        .map_err(|e| io_err("writing", &entry, &e))?;
    eprintln!(
        "fetching Debian's seabios source package ({SUITE}) into {}",
        apt.display()
    );
    run_captured(private_apt(&apt).arg("update"))?;
    run_captured(private_apt(&apt).args(["source", "--download-only", "seabios"]))?;
    let dsc = std::fs::read_dir(&apt)
        .map_err(|e| io_err("reading", &apt, &e))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "dsc"))
        .ok_or_else(|| LaunchError::Missing(format!("no .dsc in {}", apt.display())))?;
    let tmp = cache_dir().join("source.tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    run_captured(
        Command::new("dpkg-source")
            .args(["-x", "--skip-patches"])
            .arg(&dsc)
            .arg(&tmp),
    )?;
    let _ = std::fs::remove_dir_all(&src);
    std::fs::rename(&tmp, &src).map_err(|e| io_err("renaming to", &src, &e))?;
    // The downloads are not needed once extracted (nor the tarball dpkg-source leaves beside
    // the tree).
    let _ = std::fs::remove_dir_all(&apt);
    if let Ok(dir) = std::fs::read_dir(cache_dir()) {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().contains(".orig.tar.") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(src)
}

/// FNV-1a, 64-bit: a stable hash of the build's inputs for the cache key (not a security
/// check: the inputs are this repository's own files).
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The hash of `variant`'s inputs: the source's version and, for a traced build, its
/// patches, the glue and the recorder's C files (each with its length, so no two inputs run
/// together).
fn inputs_hash(variant: Variant) -> Result<u64, LaunchError> {
    let version_file = source_dir().join(".version");
    let version = std::fs::read(&version_file).map_err(|e| io_err("reading", &version_file, &e))?;
    let mut files: Vec<PathBuf> = variant
        .patches()
        .iter()
        .map(|p| patch_dir().join(p))
        .collect();
    if variant != Variant::Stock {
        files.push(patch_dir().join("vmtsync_seabios.c"));
        files.extend(recorder_files());
    }
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, variant.name().as_bytes());
    h = fnv1a(h, &version);
    for f in files {
        let bytes = std::fs::read(&f).map_err(|e| io_err("reading", &f, &e))?;
        h = fnv1a(h, &(bytes.len() as u64).to_le_bytes());
        h = fnv1a(h, &bytes);
    }
    Ok(h)
}

/// Where `variant`'s build goes, by its inputs' hash.
///
/// # Errors
/// A missing source or input file.
pub fn build_dir(variant: Variant) -> Result<PathBuf, LaunchError> {
    Ok(cache_dir().join(format!(
        "build-{}-{:016x}",
        variant.name(),
        inputs_hash(variant)?
    )))
}

/// Copies `from` to `to` (a file).
fn copy(from: &Path, to: &Path) -> Result<(), LaunchError> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| io_err("copying to", to, &e))
}

/// Builds `variant` (once per change of its inputs) and returns its `out/` directory, which
/// holds `bios.bin` (the ROM image QEMU's `-bios` takes) and `rom.o` (its 32-bit ELF with
/// symbols). SeaBIOS's own Makefile and default config; gcc and python3.
///
/// # Errors
/// [`build_ready`]'s reasons, or the build's failure with its output's tail.
pub fn build(variant: Variant) -> Result<PathBuf, LaunchError> {
    // Tests in one process build at most once at a time; another process's finished build is
    // taken as it is (it is renamed into place whole).
    static LOCK: Mutex<()> = Mutex::new(());
    let _held = LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    build_ready()?;
    let dir = build_dir(variant)?;
    let out = dir.join("out");
    if out.join("bios.bin").is_file() {
        return Ok(out);
    }
    let tmp = cache_dir().join(format!(
        "{}.tmp-{}",
        dir.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    run_captured(Command::new("cp").arg("-a").arg(source_dir()).arg(&tmp))?;
    for patch in variant.patches() {
        run_captured(
            Command::new("patch")
                .args(["-p1", "--batch", "--forward", "--quiet", "-i"])
                .arg(patch_dir().join(patch))
                .current_dir(&tmp),
        )?;
    }
    if variant != Variant::Stock {
        copy(
            &patch_dir().join("vmtsync_seabios.c"),
            &tmp.join("src/vmtsync_seabios.c"),
        )?;
        for f in recorder_files() {
            copy(&f, &tmp.join("src").join(f.file_name().unwrap()))?;
        }
    }
    eprintln!("building SeaBIOS ({}) in {}", variant.name(), tmp.display());
    run_captured(Command::new("make").arg("-j2").current_dir(&tmp))?;
    if !tmp.join("out/bios.bin").is_file() {
        return Err(LaunchError::Missing(format!(
            "SeaBIOS's make wrote no out/bios.bin in {}",
            tmp.display()
        )));
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process finished the same build first: use it.
        let _ = std::fs::remove_dir_all(&tmp);
        if !out.join("bios.bin").is_file() {
            return Err(LaunchError::Missing(format!(
                "could not move the build into {}",
                dir.display()
            )));
        }
    }
    Ok(out)
}

/// One `vmtsync: boot attempt N produced P refused R` line of the traced build's debug log:
/// `(N, P, R)`.
#[must_use]
pub fn parse_counts(line: &str) -> Option<(u32, u64, u64)> {
    let rest = line.trim().strip_prefix(COUNTS_LINE)?;
    let mut w = rest.split_whitespace();
    let n = w.next()?.parse().ok()?;
    (w.next()? == "produced").then_some(())?;
    let p = w.next()?.parse().ok()?;
    (w.next()? == "refused").then_some(())?;
    let r = w.next()?.parse().ok()?;
    Some((n, p, r))
}

/// The debug log's `Relocating init from 0xL to 0xR (size N)` line: `(L, R, N)`.
#[must_use]
pub fn reloc_in(log: &str) -> Option<(u64, u64, u64)> {
    // The first whole one: a reset can cut a line short.
    log.lines().find_map(|l| {
        let mut w = l.trim().strip_prefix(RELOC_LINE)?.split_whitespace();
        let hex = |s: &str| u64::from_str_radix(s.strip_prefix("0x")?, 16).ok();
        let link = hex(w.next()?)?;
        (w.next()? == "to").then_some(())?;
        let runtime = hex(w.next()?)?;
        (w.next()? == "(size").then_some(())?;
        let len = w.next()?.strip_suffix(')')?.parse().ok()?;
        Some((link, runtime, len))
    })
}

/// Every counts line of a debug log, in order.
#[must_use]
pub fn counts_in(log: &str) -> Vec<(u32, u64, u64)> {
    log.lines().filter_map(parse_counts).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_line_parses() {
        assert_eq!(
            parse_counts("vmtsync: boot attempt 3 produced 28 refused 0"),
            Some((3, 28, 0))
        );
        assert_eq!(parse_counts("Booting from Floppy..."), None);
        assert_eq!(
            parse_counts("vmtsync: boot attempt x produced 1 refused 0"),
            None
        );
        let log = "a\nvmtsync: boot attempt 0 produced 22 refused 0\nb\n\
                   vmtsync: boot attempt 1 produced 24 refused 0\nNo bootable device.";
        assert_eq!(counts_in(log), vec![(0, 22, 0), (1, 24, 0)]);
    }

    #[test]
    fn the_relocation_line_parses() {
        let log = "x\nRelocating init from 0x000d5400 to 0x07fa9360 (size 74912)\ny";
        assert_eq!(reloc_in(log), Some((0xd5400, 0x7fa_9360, 74912)));
        assert_eq!(reloc_in("Relocating init from 0x1 to"), None);
        let cut = "Relocating init from 0x000cb4a0 to 0x06fe5880 (In resume (status=0)\n";
        assert_eq!(
            reloc_in(&format!("{cut}{log}")),
            Some((0xd5400, 0x7fa_9360, 74912))
        );
    }

    #[test]
    fn the_archive_comes_from_the_machines_sources() {
        let deb822 = "Types: deb\n# http://snapshot.debian.org/x\nURIs: http://deb.debian.org/debian\n\
                      Suites: bookworm\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n";
        assert_eq!(
            archive_in(deb822).as_deref(),
            Some("http://deb.debian.org/debian")
        );
        let one_line = "deb [arch=amd64] http://mirror.example/debian/ bookworm main\n";
        assert_eq!(
            archive_in(one_line).as_deref(),
            Some("http://mirror.example/debian")
        );
        assert_eq!(
            archive_in("deb https://packages.cloud.google.com/apt x main"),
            None
        );
        let e = deb_src_entry("http://m/debian");
        assert!(
            e.starts_with("Types: deb-src\nURIs: http://m/debian\nSuites: bookworm\n"),
            "{e}"
        );
        assert!(
            e.contains("Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"),
            "{e}"
        );
    }

    #[test]
    fn the_hash_is_fnv1a() {
        // FNV-1a 64's published test vectors.
        assert_eq!(fnv1a(0xcbf2_9ce4_8422_2325, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(0xcbf2_9ce4_8422_2325, b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn the_phases_are_the_patchs() {
        // Each phase the tests expect is one the patch records, and the patch stays small.
        let patch = std::fs::read_to_string(patch_dir().join("vmtsync.patch")).unwrap();
        for p in PHASES.iter().skip(1) {
            assert!(patch.contains(&format!("vmtsync_fw_phase(\"{p}\")")), "{p}");
        }
        let glue = std::fs::read_to_string(patch_dir().join("vmtsync_seabios.c")).unwrap();
        assert!(glue.contains(&format!("vmtsync_fw_phase(\"{}\")", PHASES[0])));
        assert!(
            glue.contains(&format!("VMTSYNC_FW_BASE {RING_GPA:#010x}u")),
            "ring address"
        );
        assert!(glue.contains(&format!("VMTSYNC_FW_BEACON_PORT {BEACON_PORT:#x}")));
        let added = |patch: &str| {
            patch
                .lines()
                .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
                .count()
        };
        let changed = added(&patch);
        assert!(
            changed <= 20,
            "the patch changes {changed} lines of SeaBIOS"
        );
        // The function-tracing and hang patches stay small too, and name what the tests and
        // docs say.
        let functions =
            std::fs::read_to_string(patch_dir().join("vmtsync-functions.patch")).unwrap();
        assert!(added(&functions) <= 6, "{functions}");
        assert!(
            functions.contains(
                "-finstrument-functions-exclude-file-list=src/vmtsync,.h,stacks.c,resume.c"
            ),
            "{functions}"
        );
        assert!(functions.contains("+    vmtsync_fw_stop();"), "{functions}");
        assert!(functions.contains("vmtsync_fw_reloc((u32)codesrc, (u32)codedest, initsize)"));
        let hung = std::fs::read_to_string(patch_dir().join("vmtsync-hung.patch")).unwrap();
        assert_eq!(added(&hung), 1, "{hung}");
        assert!(hung.contains(&format!(" {}(void)", HUNG_IN.0)), "{hung}");
        assert!(glue.contains(&format!("VMTSYNC_FW_CAPACITY {FUNCTIONS_CAPACITY}\n")));
        assert!(glue.contains(&format!("VMTSYNC_FW_SIZE {FUNCTIONS_RESERVED:#010x}u")));
        assert!(glue.contains(&format!("VMTSYNC_FW_SIZE {RING_RESERVED:#010x}u")));
    }
}
