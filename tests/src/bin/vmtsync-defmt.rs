//! `vmtsync-defmt`: prints the guest agent's COM2 defmt log, decoded against its ELF.
//!
//! Usage: `vmtsync-defmt ELF (FILE [--follow] | -)`
//!
//! - `FILE`: decode the bytes in FILE (e.g. QEMU's COM2 `file` chardev) and exit.
//! - `FILE --follow`: keep decoding FILE as it grows, until this program's stdin reaches EOF
//!   (the caller closes it once the guest has ended), then decode the rest and exit.
//!   `cargo xtask run-agent` runs it this way next to QEMU.
//! - `-`: decode stdin as it arrives, until EOF.
//!
//! Lines go to stdout as `<tsc> <level> <message>`, each as soon as its frame is complete.
//! Exit codes: 0 done; 1 the ELF has no usable defmt table or a read failed; 2 usage errors.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use vmtsync_tests::vmm::defmt_log::DefmtLog;

const USAGE: &str = "usage: vmtsync-defmt ELF (FILE [--follow] | -)";

/// How often `--follow` looks at the file.
const FOLLOW_PERIOD: Duration = Duration::from_millis(20);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (elf, source, follow) = match args.as_slice() {
        [elf, src] => (PathBuf::from(elf), src.clone(), false),
        [elf, src, f] if f == "--follow" && src != "-" => (PathBuf::from(elf), src.clone(), true),
        [h] if h == "-h" || h == "--help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("vmtsync-defmt: {USAGE}");
            return ExitCode::from(2);
        }
    };
    let decoder = match DefmtLog::from_elf_path(&elf) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("vmtsync-defmt: {}: {e}", elf.display());
            return ExitCode::FAILURE;
        }
    };
    let mut printer = Printer {
        decoder,
        bytes: Vec::new(),
        printed: 0,
    };
    let r = if source == "-" {
        printer.stdin()
    } else {
        printer.file(Path::new(&source), follow)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        // A closed stdout (`| head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmtsync-defmt: {source}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The stream so far and how many of its decoded lines are already printed.
struct Printer {
    decoder: DefmtLog,
    bytes: Vec<u8>,
    printed: usize,
}

impl Printer {
    /// Appends `more` and prints the lines completed by it. Decoding a longer stream only
    /// appends lines, so the first `printed` lines are the ones already out.
    fn feed(&mut self, more: &[u8]) -> std::io::Result<()> {
        if more.is_empty() {
            return Ok(());
        }
        self.bytes.extend_from_slice(more);
        let lines = self.decoder.decode(&self.bytes).lines;
        let mut out = std::io::stdout().lock();
        for l in lines.iter().skip(self.printed) {
            writeln!(out, "{l}")?;
        }
        self.printed = lines.len().max(self.printed);
        out.flush()
    }

    fn stdin(&mut self) -> std::io::Result<()> {
        let mut buf = [0u8; 4096];
        let mut input = std::io::stdin().lock();
        loop {
            match input.read(&mut buf)? {
                0 => return Ok(()),
                n => self.feed(&buf[..n])?,
            }
        }
    }

    fn file(&mut self, path: &Path, follow: bool) -> std::io::Result<()> {
        let mut f = std::fs::File::open(path)?;
        let mut chunk = Vec::new();
        if !follow {
            f.read_to_end(&mut chunk)?;
            return self.feed(&chunk);
        }
        // stdin EOF (or an error) means the guest has ended: one last read, then stop.
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::stdin().lock().read_to_end(&mut sink);
            flag.store(true, Ordering::SeqCst);
        });
        loop {
            let last = done.load(Ordering::SeqCst);
            chunk.clear();
            f.read_to_end(&mut chunk)?;
            self.feed(&chunk)?;
            if last {
                return Ok(());
            }
            std::thread::sleep(FOLLOW_PERIOD);
        }
    }
}
