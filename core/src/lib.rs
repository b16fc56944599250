//! # vmtsync-core
//!
//! Host↔guest TSC synchronization for tracing, for guests without Linux: unikernels, minimal
//! guests, firmware. `#![no_std]`, no heap, no floats.
//!
//! Layers, bottom to top (see ARCHITECTURE.md for the invariants):
//!
//! - [`units`]: newtypes that carry units (`HostTicks`, `GuestTicks`, `Nanos`).
//! - [`arch`]: the only hardware code (TSC, CPUID, MSR, hypercall), behind small traits.
//! - [`pvclock`]: the KVM pvclock ABI page and its seqlock read.
//! - [`mapping`]: exact KVM offset/scaling math, its inverse, nested composition, ticks→ns.
//! - [`proto`]: the versioned postcard + COBS probe protocol.
//! - [`estimate`]: offset and drift estimators over probe samples, with guaranteed bounds.
//! - [`timeline`]: per-vCPU piecewise-linear guest→host conversion, streaming and random access.
//! - [`recorder`]: the event recorder a unikernel links: one lock-free ring per vCPU.
//! - [`agent`]: the transport-agnostic guest agent state machine.
//! - `sim` (feature `sim`): seeded simulated clocks and link delays.
//!
//! # Embedding it in a unikernel
//!
//! Three things to write, all small: a [`agent::Link`] (send one frame whole or refuse it,
//! receive what arrived, never block — a UART, a virtio queue, shared memory), an
//! [`agent::AgentClock`] (the ordered TSC read and the vCPU id), and a loop that calls
//! [`agent::Agent::poll`] when there is time. Application code records events into a
//! `static` [`recorder::Recorder`] (`record` never blocks, allocates or panics; a full ring
//! counts what it drops), and the agent drains that vCPU's ring into the protocol when the
//! host asks. The host (`vmtsync record`) syncs the clocks over the same link and writes the
//! events into trace files. `examples/embed.rs` is the whole thing in one runnable file
//! (`cargo run -p vmtsync-core --example embed`); the bare-metal `vmtsync-agent` is the same
//! on a 16550 UART and on virtio-vsock.
#![no_std]
#![deny(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(test)]
extern crate std;

#[macro_use]
mod log;

pub mod agent;
pub mod arch;
pub mod estimate;
pub mod mapping;
pub mod proto;
pub mod pvclock;
pub mod recorder;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod timeline;
pub mod units;

pub use units::{GuestTicks, HostTicks, Nanos};
