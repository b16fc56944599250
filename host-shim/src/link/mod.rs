//! The link wing: the byte stream between the host and the guest agent, and how it is opened.
//!
//! - [`addr`]: the `--connect ADDR` forms and the AF_VSOCK socket address.
//! - [`options`]: the link's vocabulary: [`ConnectOptions`], [`ConnectError`], and the retry
//!   (backoff, one deadline, the stop flag) that every opener shares.
//! - `sockets` (Unix, TCP), [`vhost_uds`] (vhost-device-vsock's `CONNECT` handshake, also used
//!   by the test rigs) and [`vsock`] (AF_VSOCK through the rust-vmm `vsock` crate): the openers.
//! - [`connect`]: opening an address, the dispatch over the openers.
//! - [`transport`]: [`StampedTransport`], the byte stream that stamps with the host TSC, and
//!   its socket implementation; the test VMM's COM1 implements the trait with its VM-exit
//!   stamps (`vmtsync_tests::vmm::client`).

pub mod addr;
pub mod connect;
pub mod options;
mod sockets;
pub mod transport;
pub mod vhost_uds;
pub mod vsock;

pub use addr::{AddrError, ProbeAddr};
pub use options::{ConnectError, ConnectOptions};
pub use transport::{FrameStamps, Received, StampedTransport, StreamTransport, TransportError};
