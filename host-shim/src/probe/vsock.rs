//! AF_VSOCK streams (`vsock:CID:PORT`), for hosts with `/dev/vhost-vsock`. Tests never open
//! one (docs/probe.md).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::addr::vsock_sockaddr;
use super::transport::SocketStream;

/// `SO_VM_SOCKETS_CONNECT_TIMEOUT` at level `AF_VSOCK`: include/uapi/linux/vm_sockets.h
/// defines it as `SO_VM_SOCKETS_CONNECT_TIMEOUT_OLD` (6, a `struct timeval`) on 64-bit ABIs.
const SO_VM_SOCKETS_CONNECT_TIMEOUT: libc::c_int = 6;

/// A connected AF_VSOCK stream socket (std has none). Used only on real hosts with
/// `/dev/vhost-vsock`; tests never create one (docs/probe.md).
#[derive(Debug)]
pub struct VsockStream(OwnedFd);

impl VsockStream {
    /// Connects to `cid:port`, with the kernel's vsock connect timeout set to `timeout`.
    ///
    /// # Errors
    /// The failing system call's error.
    pub fn connect(cid: u32, port: u32, timeout: Duration) -> io::Result<Self> {
        // SAFETY: socket(2) takes no pointers; a negative result is checked below.
        let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by nothing else.
        let sock = Self(unsafe { OwnedFd::from_raw_fd(fd) });
        set_timeval(
            sock.0.as_raw_fd(),
            libc::AF_VSOCK,
            SO_VM_SOCKETS_CONNECT_TIMEOUT,
            Some(timeout),
        )?;
        let sa = vsock_sockaddr(cid, port);
        // sockaddr_vm is 16 bytes; the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        loop {
            // SAFETY: `sa` is a valid sockaddr_vm that outlives the call and `len` is its size.
            let rc = unsafe {
                libc::connect(
                    sock.0.as_raw_fd(),
                    std::ptr::from_ref(&sa).cast::<libc::sockaddr>(),
                    len,
                )
            };
            if rc == 0 {
                return Ok(sock);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Sets a `struct timeval` socket option (`None` = no timeout).
fn set_timeval(
    fd: libc::c_int,
    level: libc::c_int,
    name: libc::c_int,
    t: Option<Duration>,
) -> io::Result<()> {
    let mut tv = timeval_of(t.unwrap_or_default());
    // A zero timeval means "no timeout": round a sub-microsecond wait up, like std does.
    if t.is_some() && tv.tv_sec == 0 && tv.tv_usec == 0 {
        tv.tv_usec = 1;
    }
    // timeval is 16 bytes; the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    let len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: `tv` is a valid timeval that outlives the call and `len` is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            std::ptr::from_ref(&tv).cast::<libc::c_void>(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `t` as a `struct timeval`, truncated to microseconds (saturating at `time_t::MAX` s).
fn timeval_of(t: Duration) -> libc::timeval {
    libc::timeval {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(t.subsec_micros().min(999_999).cast_signed()),
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call.
        let n = unsafe { libc::write(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl SocketStream for VsockStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeval(self.0.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, t)
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        set_timeval(self.0.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDTIMEO, t)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn timeouts_convert_to_timeval_without_opening_a_vsock() {
        let tv = timeval_of(Duration::new(3, 250_999_000));
        assert_eq!((tv.tv_sec, tv.tv_usec), (3, 250_999));
        let tv = timeval_of(Duration::from_nanos(500));
        assert_eq!((tv.tv_sec, tv.tv_usec), (0, 0));
        // set_timeval rounds that up to 1 µs so it never means "forever"; checked on a Unix
        // socket, since AF_VSOCK must not be opened here.
        let (a, _b) = UnixStream::pair().unwrap();
        set_timeval(
            a.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            Some(Duration::from_nanos(500)),
        )
        .unwrap();
        // The kernel rounds up to a jiffy; what matters is that it is a timeout, not None.
        let got = a.read_timeout().unwrap();
        assert!(matches!(got, Some(d) if !d.is_zero()), "{got:?}");
    }
}
