//! Probes through QEMU's COM1 on a stdio chardev: the path an external host tool has.
//!
//! The host reads its TSC (`lfence; rdtsc`) right before the `write()` of the request frame and
//! right after the `read()` that completed the reply frame, in one thread with no channel in
//! between. The guest's TSC read certainly lies between: the request cannot reach the guest
//! before it is written, and the reply cannot be read before the guest wrote it.
//!
//! It also keeps the stamp right after the first `read()` that returned reply bytes: the agent
//! reads its TSC before it writes the reply's first byte, so that stamp is an equally honest
//! upper bound, and a tighter one (the rest of the frame's per-byte UART exits stay out).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmtsync_core::mapping::KvmTscMapping;
use vmtsync_core::proto::{Feed, FrameReceiver, MAX_FRAME_SIZE, Message, encode_frame};
use vmtsync_tests::ChildGuard;
use vmtsync_tests::vmm::qemu::{self, Machine, debug_exit_status};
use vmtsync_tests::vmm::tsc::host_tsc;

use crate::{Exchanged, ProbeLink, STEP, Session, run_sessions};

/// The isa-debug-exit code the agent is told to use, checked at the end of the run.
const EXIT_CODE: u8 = 9;

/// The host stamps of one exchange over stdio (host TSC ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StdioStamps {
    /// Right before `write()` of the request.
    pub send: u64,
    /// Right after the `read()` that completed the reply frame.
    pub recv: u64,
    /// Right after the first `read()` that returned reply bytes.
    pub first_recv: u64,
}

/// QEMU's stdio as a [`ProbeLink`]. Bytes read past a frame's end stay in `pending`.
struct QemuStdio {
    stdin: ChildStdin,
    stdout: ChildStdout,
    rx: FrameReceiver,
    pending: Vec<u8>,
}

impl QemuStdio {
    /// Reads what is available (at least one byte), waiting at most until `end`.
    fn read_some(&mut self, end: Instant) -> Result<Vec<u8>> {
        let left = end.saturating_duration_since(Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let mut pfd = libc::pollfd {
            fd: self.stdout.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if n <= 0 {
            bail!("no reply from the agent within {STEP:?}");
        }
        let mut buf = [0u8; 256];
        let got = self
            .stdout
            .read(&mut buf)
            .context("reading QEMU's stdout")?;
        if got == 0 {
            bail!("QEMU closed COM1 (exited?)");
        }
        Ok(buf[..got].to_vec())
    }

    /// Feeds bytes until a frame completes; returns it, the bytes it took, and the stamps taken
    /// right after the first read of its bytes and after the read that completed it. Call it
    /// with nothing pending, so that every byte read is the reply's.
    fn next_frame(&mut self, end: Instant) -> Result<(Message, usize, u64, u64)> {
        let mut used = 0;
        let mut stamp = 0;
        let mut first = None;
        loop {
            while !self.pending.is_empty() {
                let b = self.pending.remove(0);
                used += 1;
                match self.rx.feed(&[b]) {
                    Feed::Consumed => {}
                    Feed::Message { msg, .. } => {
                        return Ok((msg, used, first.unwrap_or(stamp), stamp));
                    }
                    Feed::Error { error, .. } => bail!("bad frame from the agent: {error:?}"),
                }
            }
            let bytes = self.read_some(end)?;
            stamp = host_tsc();
            first.get_or_insert(stamp);
            self.pending.extend_from_slice(&bytes);
        }
    }
}

impl ProbeLink for QemuStdio {
    type Stamps = StdioStamps;

    fn exchange(&mut self, msg: &Message) -> Result<Exchanged<StdioStamps>> {
        if !self.pending.is_empty() {
            bail!("{} unexpected bytes from the agent", self.pending.len());
        }
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let frame = encode_frame(msg, &mut buf).map_err(|e| anyhow::anyhow!("encode: {e:?}"))?;
        let sent = frame.len();
        let send = host_tsc();
        self.stdin.write_all(frame).context("writing to QEMU")?;
        let (reply, received, first_recv, recv) = self.next_frame(Instant::now() + STEP)?;
        Ok(Exchanged {
            reply,
            sent,
            received,
            stamps: StdioStamps {
                send,
                recv,
                first_recv,
            },
        })
    }
}

/// Boots the agent under QEMU `machine` with COM1 on stdio, runs `sessions` sessions of
/// `probes` probes, shuts it down and checks QEMU's exit status.
///
/// # Errors
/// Start, protocol or shutdown failures, with the agent's COM2 log attached.
pub fn run(
    elf: &Path,
    machine: Machine,
    sessions: usize,
    probes: usize,
) -> Result<(Vec<Session<StdioStamps>>, KvmTscMapping)> {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("vmtsync-probe-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("temp dir")?;
    let com2 = dir.join("com2.log");
    let com2_text = || vmtsync_tests::vmm::defmt_log::decode_file_text(elf, &com2);
    let append = format!("transport=uart exit={EXIT_CODE}");
    let child = qemu::command(machine, elf, &append, &com2)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let mut guard = ChildGuard::new(child);
    let mut link = QemuStdio {
        stdin: guard.child().stdin.take().context("QEMU stdin")?,
        stdout: guard.child().stdout.take().context("QEMU stdout")?,
        rx: FrameReceiver::new(),
        pending: Vec::new(),
    };
    // The ready beacon is a lone 0x00; anything before it is not protocol.
    let end = Instant::now() + STEP;
    loop {
        let bytes = link
            .read_some(end)
            .with_context(|| format!("waiting for the ready beacon; COM2 log:\n{}", com2_text()))?;
        if let Some(i) = bytes.iter().position(|&b| b == 0) {
            link.pending.extend_from_slice(&bytes[i + 1..]);
            break;
        }
    }
    // After the beacon QEMU's VM exists: the truth's KVM side is its mapping in debugfs.
    let kvm = vmtsync_tests::truth::truth_mapping(guard.pid(), 0)
        .context("reading the VM's TSC mapping from KVM debugfs")?;
    let out = run_sessions(&mut link, sessions, probes)
        .with_context(|| format!("COM2 log:\n{}", com2_text()))?;
    let bye = link.exchange(&Message::Shutdown)?;
    if bye.reply != Message::Exiting {
        bail!("shutdown answered with {:?}", bye.reply);
    }
    let end = Instant::now() + STEP;
    let status = loop {
        if let Some(s) = guard.child().try_wait().context("waiting for QEMU")? {
            break s;
        }
        if Instant::now() > end {
            bail!("QEMU did not exit after shutdown");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if status.code() != Some(debug_exit_status(EXIT_CODE)) {
        bail!("QEMU exited with {status}; COM2 log:\n{}", com2_text());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((out, kvm))
}
