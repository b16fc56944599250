//! `--probe-log FILE`: every probe exchange a session turned into a sample, one JSON object
//! per line, so `vmtsync validate --probe-log` can check the sync file against the host
//! kernel's exits of the very probes it was made from (docs/validate.md, "Probes").
//!
//! A probe's guest TSC is known only to the live session; the log keeps it with what pairing
//! it with its exits later needs: the vCPU, the sequence number, the request and reply frames
//! as they were on the wire (re-encoded through the one encoder, which is canonical), the
//! in-process stamps around the exchange (the window the exits must lie in) and which exits
//! bracket the TSC read (the UART's bytes or the agent's sync port). Nothing of the anchored
//! bracket is written: `validate` finds it again in its own host trace.
//!
//! The file is opened for appending and each object is one `write(2)`, so a killed run leaves
//! whole lines (and at worst one torn last line, which the reader reports). Its size grows with
//! the probes the host asks for (about 220 bytes a probe), not with anything a guest sends.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vmtsync_core::estimate::ProbeSample;
use vmtsync_core::proto::{MAX_FRAME_SIZE, Message, encode_frame};

use super::ProbeError;
use super::anchor::{AnchorOptions, matcher_for};
use crate::exits::Matcher;
use crate::link::addr::ProbeAddr;
use crate::link::transport::FrameStamps;
use crate::syncfile::AnchorKind;

/// The schema of a probe log line.
pub const PROBE_LOG_SCHEMA: u32 = 1;

/// Which exits bracket a probe's TSC read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbePath {
    /// The request's `in`s and the reply's `out`s on a UART data port
    /// ([`crate::exits::match_uart`]).
    Uart,
    /// The agent's sync-port `in` and `out` of the sequence number
    /// ([`crate::exits::match_sync_port`]).
    SyncPort,
}

/// One probe exchange that gave a sample (a line of the probe log).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeExchange {
    /// Always [`PROBE_LOG_SCHEMA`].
    pub schema: u32,
    /// The vCPU whose TSC was read.
    pub vcpu: u32,
    /// The probe's sequence number.
    pub seq: u8,
    /// The guest TSC the agent replied (unwrapped when the reply was compact).
    pub guest_tsc: u64,
    /// Which exits bracket the read.
    pub path: ProbePath,
    /// The port of those exits (the UART data port, or the sync port).
    pub port: u16,
    /// The request frame, delimiter included.
    #[serde(with = "hex::serde")]
    pub request: Vec<u8>,
    /// The reply frame, delimiter included.
    #[serde(with = "hex::serde")]
    pub reply: Vec<u8>,
    /// The host TSC in this process right before the request was written.
    pub host_send: u64,
    /// The host TSC in this process right after the reply was read.
    pub host_recv: u64,
    /// Where the session's sample took its bracket from.
    pub anchor: AnchorKind,
}

impl ProbeExchange {
    /// The in-process stamps: every exit of the exchange lies between them.
    #[must_use]
    pub const fn within(&self) -> FrameStamps {
        FrameStamps {
            send: vmtsync_core::HostTicks(self.host_send),
            recv: vmtsync_core::HostTicks(self.host_recv),
        }
    }
}

/// The append-only writer of a probe log.
#[derive(Debug)]
pub struct ProbeLog {
    file: File,
    path: PathBuf,
    /// The path of a session not anchored (or anchoring given up): the address says which.
    default: Matcher,
    uart_port: u16,
    sync_port: u16,
    line: Vec<u8>,
}

impl ProbeLog {
    /// Opens `path` for appending (created if missing) for a session on `addr` anchored as
    /// `anchor` says: the exits of its probes are the UART's on a serial chardev, the sync
    /// port's elsewhere ([`matcher_for`]), and whichever anchoring used while it did.
    ///
    /// # Errors
    /// [`ProbeError::ProbeLog`].
    pub fn create(
        path: &Path,
        addr: &ProbeAddr,
        anchor: &AnchorOptions,
    ) -> Result<Self, ProbeError> {
        let (file, path) = super::console::open_append(path, |path, source| {
            ProbeError::ProbeLog { path, source }
        })?;
        Ok(Self {
            file,
            path,
            default: matcher_for(addr, anchor),
            uart_port: anchor.port,
            sync_port: anchor.sync_port,
            line: Vec::with_capacity(512),
        })
    }

    /// The path and port of an exchange the transport stamped as `anchor` says.
    fn path_of(&self, anchor: AnchorKind) -> (ProbePath, u16) {
        match (anchor, self.default) {
            (AnchorKind::KvmPioUart, _) => (ProbePath::Uart, self.uart_port),
            (AnchorKind::KvmPioSyncPort, _) => (ProbePath::SyncPort, self.sync_port),
            (_, Matcher::Uart { port }) => (ProbePath::Uart, port),
            (_, Matcher::SyncPort { port }) => (ProbePath::SyncPort, port),
        }
    }

    /// Appends one exchange: probe `seq`'s `request` and `reply` as sent and received, the
    /// `sample` they gave (its vCPU and guest reading), `within` the in-process stamps.
    ///
    /// # Errors
    /// [`ProbeError::ProbeLog`]; [`ProbeError::Internal`] if a message does not encode.
    pub(crate) fn append(
        &mut self,
        seq: u8,
        request: &Message,
        reply: &Message,
        sample: &ProbeSample,
        within: FrameStamps,
        anchor: AnchorKind,
    ) -> Result<(), ProbeError> {
        let mut buf = [0u8; MAX_FRAME_SIZE];
        let mut frame = |m: &Message| {
            encode_frame(m, &mut buf)
                .map(|f| f.to_vec())
                .map_err(|_| ProbeError::Internal("encode"))
        };
        let (path, port) = self.path_of(anchor);
        let e = ProbeExchange {
            schema: PROBE_LOG_SCHEMA,
            vcpu: sample.vcpu,
            seq,
            guest_tsc: sample.guest.0,
            path,
            port,
            request: frame(request)?,
            reply: frame(reply)?,
            host_send: within.send.0,
            host_recv: within.recv.0,
            anchor,
        };
        self.line.clear();
        serde_json::to_writer(&mut self.line, &e).map_err(|e| ProbeError::ProbeLog {
            path: self.path.clone(),
            source: e.into(),
        })?;
        self.line.push(b'\n');
        // One write per line: a reader never sees half of one unless the run was killed in it.
        self.file
            .write_all(&self.line)
            .map_err(|source| ProbeError::ProbeLog {
                path: self.path.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exits::COM1_DATA;
    use crate::probe::testutil::SimTransport;
    use crate::probe::{ProbeSession, Progress};
    use crate::validate::probes::read_probe_log;
    use std::time::Duration;

    #[test]
    fn every_sample_is_logged_with_the_frames_as_they_were_on_the_wire() {
        let offset = 1 << 35;
        let mut t = SimTransport::new(offset);
        // Compact replies wrapping the low word, and a full one after the horizon.
        t.gap = 1 << 29;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("probes.jsonl");
        let mut s = ProbeSession::hello(t, Duration::from_secs(1)).unwrap();
        let addr = ProbeAddr::Unix("sim".into());
        s.log_probes(ProbeLog::create(&path, &addr, &AnchorOptions::default()).unwrap());
        let samples = s
            .probe_round(20, Duration::ZERO, &mut Progress::hidden())
            .unwrap();
        assert_eq!(samples.len(), 20);
        let t = s.into_transport();
        let mut logged = Vec::new();
        let cut = read_probe_log(&path, |e| logged.push(e.clone())).unwrap();
        assert_eq!((cut, logged.len()), (0, 20));
        // The probes are the last 20 exchanges on the wire (after the delimiter and hello).
        let wire_in = &t.wire_in[t.wire_in.len() - 20..];
        let wire_out = &t.wire_out[t.wire_out.len() - 20..];
        for (i, (e, x)) in logged.iter().zip(&samples).enumerate() {
            assert_eq!(e.request, wire_in[i], "probe {i}");
            assert_eq!(e.reply, wire_out[i], "probe {i}");
            assert_eq!((e.guest_tsc, e.vcpu), (x.guest.0, x.vcpu));
            assert_eq!((e.host_send, e.host_recv), (x.host_send.0, x.host_recv.0));
            assert!(e.host_send + offset <= e.guest_tsc && e.guest_tsc <= e.host_recv + offset);
            assert_eq!((e.path, e.port), (ProbePath::Uart, COM1_DATA));
            assert_eq!(e.anchor, AnchorKind::InProcess);
        }
        // Both kinds of reply were logged.
        assert!(
            logged
                .iter()
                .any(|e| e.reply.len() != logged[0].reply.len())
        );
        // Appending: a second session adds its lines after the first's.
        let mut s = ProbeSession::hello(SimTransport::new(offset), Duration::from_secs(1)).unwrap();
        s.log_probes(ProbeLog::create(&path, &addr, &AnchorOptions::default()).unwrap());
        s.probe_round(3, Duration::ZERO, &mut Progress::hidden())
            .unwrap();
        let mut n = 0;
        read_probe_log(&path, |_| n += 1).unwrap();
        assert_eq!(n, 23);
    }

    #[test]
    fn the_path_follows_the_anchor_in_use_and_else_the_address() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let o = AnchorOptions::default();
        let uart = ProbeLog::create(&path, &ProbeAddr::Unix("q".into()), &o).unwrap();
        assert_eq!(
            uart.path_of(AnchorKind::InProcess),
            (ProbePath::Uart, COM1_DATA)
        );
        assert_eq!(
            uart.path_of(AnchorKind::KvmPioSyncPort),
            (ProbePath::SyncPort, o.sync_port)
        );
        let tcp: ProbeAddr = "tcp:127.0.0.1:1".parse().unwrap();
        let other = ProbeLog::create(&path, &tcp, &o).unwrap();
        assert_eq!(
            other.path_of(AnchorKind::InProcess),
            (ProbePath::SyncPort, o.sync_port)
        );
        assert_eq!(
            other.path_of(AnchorKind::KvmPioUart),
            (ProbePath::Uart, COM1_DATA)
        );
        assert!(matches!(
            ProbeLog::create(&dir.path().join("no/such/dir"), &tcp, &o),
            Err(ProbeError::ProbeLog { .. })
        ));
    }
}
