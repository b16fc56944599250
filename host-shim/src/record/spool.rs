//! Events waiting for the trace.dat or Perfetto trace: fixed 32-byte records (guest TSC, id,
//! payload length, vCPU, payload) in an anonymous temporary file, so
//! memory stays constant however long the recording runs.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};

/// One spooled event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Spooled {
    pub(super) vcpu: u32,
    pub(super) guest: u64,
    pub(super) id: u16,
    len: u8,
    data: [u8; 16],
}

impl Spooled {
    /// An event of vCPU `vcpu` at guest tick `guest` (payloads are at most 16 bytes: the
    /// protocol's limit; a longer one is cut, as [`Spool::push`] cuts it).
    pub(super) fn new(vcpu: u32, guest: u64, id: u16, payload: &[u8]) -> Self {
        let n = payload.len().min(16);
        let mut data = [0u8; 16];
        data[..n].copy_from_slice(&payload[..n]);
        Self {
            vcpu,
            guest,
            id,
            len: u8::try_from(n).unwrap_or(16),
            data,
        }
    }

    pub(super) fn payload(&self) -> &[u8] {
        self.data.get(..usize::from(self.len)).unwrap_or(&self.data)
    }
}

const RECORD: usize = 32;

/// The spool file.
pub(super) struct Spool {
    out: BufWriter<File>,
}

impl Spool {
    pub(super) fn new() -> io::Result<Self> {
        Ok(Self {
            out: BufWriter::with_capacity(256 * 1024, tempfile::tempfile()?),
        })
    }

    /// Appends an event (payloads are at most 16 bytes: the protocol's limit).
    pub(super) fn push(
        &mut self,
        vcpu: u32,
        guest: u64,
        id: u16,
        payload: &[u8],
    ) -> io::Result<()> {
        let mut rec = [0u8; RECORD];
        rec[..8].copy_from_slice(&guest.to_le_bytes());
        rec[8..10].copy_from_slice(&id.to_le_bytes());
        let n = payload.len().min(16);
        rec[10] = u8::try_from(n).unwrap_or(16);
        rec[12..16].copy_from_slice(&vcpu.to_le_bytes());
        rec[16..16 + n].copy_from_slice(&payload[..n]);
        self.out.write_all(&rec)
    }

    /// Every event, in the order pushed (again from the start at every call).
    pub(super) fn iter(&mut self) -> io::Result<impl Iterator<Item = io::Result<Spooled>> + use<>> {
        self.iter_from(0)
    }

    /// The events from the `first`-th on (counted from 0 in the order pushed): the ones
    /// waiting for the next sync round, while the rest stay on disk.
    pub(super) fn iter_from(
        &mut self,
        first: u64,
    ) -> io::Result<impl Iterator<Item = io::Result<Spooled>> + use<>> {
        self.out.flush()?;
        let mut f = self.out.get_ref().try_clone()?;
        f.seek(SeekFrom::Start(first.saturating_mul(RECORD as u64)))?;
        let mut r = BufReader::with_capacity(256 * 1024, f);
        Ok(std::iter::from_fn(move || {
            let mut rec = [0u8; RECORD];
            match r.read_exact(&mut rec) {
                Ok(()) => {
                    let mut g = [0u8; 8];
                    g.copy_from_slice(&rec[..8]);
                    let mut data = [0u8; 16];
                    data.copy_from_slice(&rec[16..32]);
                    Some(Ok(Spooled {
                        vcpu: u32::from_le_bytes([rec[12], rec[13], rec[14], rec[15]]),
                        guest: u64::from_le_bytes(g),
                        id: u16::from_le_bytes([rec[8], rec[9]]),
                        len: rec[10].min(16),
                        data,
                    }))
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => None,
                Err(e) => Some(Err(e)),
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_back_in_order_with_their_payloads() {
        let mut s = Spool::new().unwrap();
        for i in 0..10_000u64 {
            let p = i.to_le_bytes();
            s.push(
                u32::try_from(i % 5).unwrap(),
                i * 3,
                u16::try_from(i % 7).unwrap(),
                &p[..usize::try_from(i % 9).unwrap()],
            )
            .unwrap();
        }
        let got: Vec<Spooled> = s.iter().unwrap().map(Result::unwrap).collect();
        assert_eq!(got.len(), 10_000);
        // A second pass reads the same from the start, and one from an index reads the rest.
        assert_eq!(s.iter().unwrap().count(), 10_000);
        let tail: Vec<Spooled> = s.iter_from(9_990).unwrap().map(Result::unwrap).collect();
        assert_eq!(tail, got[9_990..]);
        for (i, r) in (0u64..).zip(&got) {
            assert_eq!((r.guest, u64::from(r.id)), (i * 3, i % 7));
            assert_eq!(u64::from(r.vcpu), i % 5);
            assert_eq!(
                r.payload(),
                &i.to_le_bytes()[..usize::try_from(i % 9).unwrap()]
            );
        }
    }
}
