//! AF_VSOCK streams (`vsock:CID:PORT`), for hosts with `/dev/vhost-vsock`, on the rust-vmm
//! `vsock` crate (no `unsafe` here). Tests never open one (docs/probe.md).
//!
//! The crate connects without a caller-set connect timeout, so one attempt waits at most the
//! kernel's default for AF_VSOCK (`VSOCK_DEFAULT_CONNECT_TIMEOUT`, 2 s) before failing with
//! `ETIMEDOUT`, which the connect loop retries: the connect deadline is kept to within that.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::addr::vsock_sockaddr;
use super::transport::SocketStream;

/// A connected AF_VSOCK stream socket (std has none).
#[derive(Debug)]
pub struct VsockStream(vsock::VsockStream);

impl VsockStream {
    /// Connects to `cid:port` (retrying a connect interrupted by a signal).
    ///
    /// # Errors
    /// The failing system call's error.
    pub fn connect(cid: u32, port: u32) -> io::Result<Self> {
        loop {
            match vsock::VsockStream::connect(&vsock_sockaddr(cid, port)) {
                Ok(s) => return Ok(Self(s)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl SocketStream for VsockStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.0.set_write_timeout(t)
    }
}
