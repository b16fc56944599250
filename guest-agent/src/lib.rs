//! Hardware-facing building blocks of the vmtsync guest agent beyond what `vmtsync-core`
//! ships ready-made (its `arch::uart16550::Uart16550` carries the protocol on COM1 and the
//! log on COM2, its `arch::x86_64::NativeClock` is the guest clock): per-message guest events
//! (`events=N`), the software TSC skew over any `AgentClock`, isa-debug-exit and the
//! privilege level, the PVH `hvm_start_info`, boot-option parsing, and the virtio-vsock
//! transport (PCI setup, heap and DMA `Hal`, a vsock `Link`). The bootable ELF
//! (`src/main.rs`) runs `vmtsync_core::agent::Agent` over them; another unikernel can embed
//! them the same way.
//!
//! `no_std`; built for the host only for its unit tests
//! (`cargo test --target x86_64-unknown-linux-gnu`).
#![cfg_attr(not(test), no_std)]

extern crate alloc;

pub mod clock;
pub mod console;
pub mod events;
pub mod heap;
pub mod options;
pub mod pci;
pub mod port;
pub mod pvh;
pub mod tsc;
pub mod vsock;
pub mod vsock_stream;
