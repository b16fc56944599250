//! Where the guest agent listens: the `ADDR` of `vmtsync probe --connect ADDR`.
//!
//! Five forms, each a scheme and its parts separated by `:` (the last `:` for the parts that
//! end in a number, so paths may contain colons):
//!
//! | form | what it reaches |
//! |---|---|
//! | `unix:PATH` | a Unix stream socket someone else listens on: QEMU `-chardev socket,path=PATH,server=on` behind a serial port |
//! | `unix-listen:PATH` | we listen on `PATH` and accept one connection: vhost-device-vsock's guest-initiated side, where a guest connect to port P arrives on `<uds-path>_P` |
//! | `vsock-uds:PATH:PORT` | vhost-device-vsock's host→guest side: connect to `PATH`, write `CONNECT PORT\n`, read `OK …\n` |
//! | `vsock:CID:PORT` | AF_VSOCK, on hosts with `/dev/vhost-vsock` |
//! | `tcp:HOST:PORT` | TCP (QEMU `-chardev socket,host=…,port=…,server=on`, or a test agent) |
//!
//! The AF_VSOCK socket address is built here ([`vsock_sockaddr`]) so that its layout can be
//! tested without opening a socket.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

/// A parsed `--connect` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeAddr {
    /// Connect to a listening Unix stream socket.
    Unix(PathBuf),
    /// Listen on a Unix socket path and accept one connection (the guest connects).
    UnixListen(PathBuf),
    /// vhost-device-vsock's host side: a Unix socket plus the `CONNECT <port>` handshake.
    VsockUds {
        /// The `--uds-path` vhost-device-vsock was started with.
        path: PathBuf,
        /// The guest's vsock port.
        port: u32,
    },
    /// A kernel AF_VSOCK socket.
    Vsock {
        /// The guest's context id (3 or more for guests).
        cid: u32,
        /// The guest's vsock port.
        port: u32,
    },
    /// A TCP socket, `HOST` being a name or an address (IPv6 in brackets).
    Tcp {
        /// Host name or address, as given (brackets of an IPv6 literal removed).
        host: String,
        /// TCP port.
        port: u16,
    },
}

/// Why an `ADDR` string did not parse. Each message shows the accepted forms.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AddrError {
    /// The scheme before the first `:` is not one we know.
    #[error(
        "unknown address \"{0}\": use unix:PATH, unix-listen:PATH, vsock-uds:PATH:PORT, vsock:CID:PORT or tcp:HOST:PORT"
    )]
    UnknownScheme(String),
    /// A part is missing or empty.
    #[error("address \"{addr}\": missing {part} (expected {form})")]
    Missing {
        /// The whole address.
        addr: String,
        /// Which part.
        part: &'static str,
        /// The expected form.
        form: &'static str,
    },
    /// A number did not parse or is out of range.
    #[error("address \"{addr}\": {part} \"{value}\" is not a number in 0..={max}")]
    BadNumber {
        /// The whole address.
        addr: String,
        /// Which part.
        part: &'static str,
        /// What was given.
        value: String,
        /// The largest allowed value.
        max: u64,
    },
}

impl ProbeAddr {
    /// Parses `unix:PATH`, `unix-listen:PATH`, `vsock-uds:PATH:PORT`, `vsock:CID:PORT` or
    /// `tcp:HOST:PORT`.
    ///
    /// # Errors
    /// [`AddrError`] naming the part that is wrong.
    pub fn parse(s: &str) -> Result<Self, AddrError> {
        let (scheme, rest) = s
            .split_once(':')
            .ok_or_else(|| AddrError::UnknownScheme(s.to_owned()))?;
        let missing = |part, form| AddrError::Missing {
            addr: s.to_owned(),
            part,
            form,
        };
        match scheme {
            "unix" | "unix-listen" => {
                if rest.is_empty() {
                    return Err(missing("PATH", "unix:PATH"));
                }
                let path = PathBuf::from(rest);
                Ok(if scheme == "unix" {
                    Self::Unix(path)
                } else {
                    Self::UnixListen(path)
                })
            }
            "vsock-uds" => {
                let form = "vsock-uds:PATH:PORT";
                let (path, port) = rest.rsplit_once(':').ok_or(missing("PORT", form))?;
                if path.is_empty() {
                    return Err(missing("PATH", form));
                }
                Ok(Self::VsockUds {
                    path: PathBuf::from(path),
                    port: number(s, "PORT", port, u32::MAX.into())?,
                })
            }
            "vsock" => {
                let form = "vsock:CID:PORT";
                let (cid, port) = rest.split_once(':').ok_or(missing("PORT", form))?;
                Ok(Self::Vsock {
                    cid: number(s, "CID", cid, u32::MAX.into())?,
                    port: number(s, "PORT", port, u32::MAX.into())?,
                })
            }
            "tcp" => {
                let form = "tcp:HOST:PORT";
                let (host, port) = rest.rsplit_once(':').ok_or(missing("PORT", form))?;
                let host = host
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .unwrap_or(host);
                if host.is_empty() {
                    return Err(missing("HOST", form));
                }
                Ok(Self::Tcp {
                    host: host.to_owned(),
                    port: number(s, "PORT", port, u16::MAX.into())?,
                })
            }
            _ => Err(AddrError::UnknownScheme(s.to_owned())),
        }
    }
}

impl std::str::FromStr for ProbeAddr {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for ProbeAddr {
    /// The address in the form [`ProbeAddr::parse`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
            Self::UnixListen(p) => write!(f, "unix-listen:{}", p.display()),
            Self::VsockUds { path, port } => write!(f, "vsock-uds:{}:{port}", path.display()),
            Self::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Self::Tcp { host, port } if host.contains(':') => write!(f, "tcp:[{host}]:{port}"),
            Self::Tcp { host, port } => write!(f, "tcp:{host}:{port}"),
        }
    }
}

/// Parses a decimal number no larger than `max` (and no larger than `T` holds).
fn number<T: TryFrom<u64>>(
    addr: &str,
    part: &'static str,
    v: &str,
    max: u64,
) -> Result<T, AddrError> {
    let bad = || AddrError::BadNumber {
        addr: addr.to_owned(),
        part,
        value: v.to_owned(),
        max,
    };
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = v.parse().map_err(|_| bad())?;
    if n > max {
        return Err(bad());
    }
    T::try_from(n).map_err(|_| bad())
}

/// The AF_VSOCK address `cid:port` for `connect(2)` (`struct sockaddr_vm`, built by the
/// `vsock` crate).
///
/// Pure data: building it opens nothing, which is why tests can check it on machines where
/// AF_VSOCK must not be touched.
#[must_use]
pub fn vsock_sockaddr(cid: u32, port: u32) -> vsock::VsockAddr {
    vsock::VsockAddr::new(cid, port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form_and_prints_it_back() {
        let cases = [
            (
                "unix:/tmp/qemu.sock",
                ProbeAddr::Unix("/tmp/qemu.sock".into()),
            ),
            (
                "unix-listen:/tmp/v.sock_1234",
                ProbeAddr::UnixListen("/tmp/v.sock_1234".into()),
            ),
            (
                "vsock-uds:/tmp/a:b/v.sock:5000",
                ProbeAddr::VsockUds {
                    path: "/tmp/a:b/v.sock".into(),
                    port: 5000,
                },
            ),
            ("vsock:3:1234", ProbeAddr::Vsock { cid: 3, port: 1234 }),
            (
                "tcp:127.0.0.1:4444",
                ProbeAddr::Tcp {
                    host: "127.0.0.1".into(),
                    port: 4444,
                },
            ),
            (
                "tcp:[::1]:4444",
                ProbeAddr::Tcp {
                    host: "::1".into(),
                    port: 4444,
                },
            ),
        ];
        for (s, want) in cases {
            let got = ProbeAddr::parse(s).unwrap();
            assert_eq!(got, want, "{s}");
            assert_eq!(got.to_string(), s);
            assert_eq!(s.parse::<ProbeAddr>().unwrap(), want);
        }
    }

    #[test]
    fn rejects_bad_addresses_with_the_part_named() {
        for s in ["serial:/dev/ttyS0", "nocolon"] {
            assert!(
                matches!(ProbeAddr::parse(s), Err(AddrError::UnknownScheme(_))),
                "{s}"
            );
        }
        // Each address, whether its error is a missing part (else a bad number), and the part.
        for (s, missing, want) in [
            ("unix:", true, "PATH"),
            ("vsock-uds:/tmp/v.sock", true, "PORT"),
            ("vsock-uds:/tmp/v.sock:x", false, "PORT"),
            ("vsock-uds::5", true, "PATH"),
            ("vsock:3", true, "PORT"),
            ("vsock:-1:5", false, "CID"),
            ("vsock:3:4294967296", false, "PORT"),
            ("tcp::80", true, "HOST"),
            ("tcp:host:+80", false, "PORT"),
        ] {
            let part = match ProbeAddr::parse(s) {
                Err(AddrError::Missing { part, .. }) if missing => part,
                Err(AddrError::BadNumber { part, .. }) if !missing => part,
                other => panic!("{s}: {other:?}"),
            };
            assert_eq!(part, want, "{s}");
        }
        assert!(matches!(
            ProbeAddr::parse("tcp:localhost:65536"),
            Err(AddrError::BadNumber {
                part: "PORT",
                max: 65535,
                ..
            })
        ));
        let msg = ProbeAddr::parse("x:y").unwrap_err().to_string();
        assert!(msg.contains("vsock-uds:PATH:PORT"), "{msg}");
    }

    #[test]
    fn vsock_sockaddr_matches_the_uapi_header() {
        use vsock::SockaddrLike;
        let sa = vsock_sockaddr(3, 0x1234_5678);
        let raw: &libc::sockaddr_vm = sa.as_ref();
        assert_eq!(i32::from(raw.svm_family), libc::AF_VSOCK);
        assert_eq!(raw.svm_reserved1, 0);
        assert_eq!((raw.svm_port, raw.svm_cid), (0x1234_5678, 3));
        assert_eq!(raw.svm_zero, [0; 4]);
        assert_eq!((sa.cid(), sa.port()), (3, 0x1234_5678));
        // struct sockaddr_vm is 16 bytes: family u16, reserved u16, port u32, cid u32, zero[4].
        assert_eq!(sa.len(), 16);
    }
}
