//! The `vmtsync` command line: argument definitions, dispatch, errors and exit codes.
//!
//! One module per command ([`kvm`], [`convert`], [`plot`], [`probe`], [`record`], [`tsc`],
//! [`validate`], [`attach`] for `trace-cmd attach`), the top-level parser and
//! dispatch ([`command`]), the shared error type and exit codes ([`exit`]), SIGINT/SIGTERM
//! handling (`signals`), the debugfs/`/proc` source flags shared by every command that reads
//! them ([`source`]) and the vocabulary every command's flags follow (`vocabulary`).
//!
//! Exit codes (also in `--help`):
//! - 0: success; also when stdout is a closed pipe (`vmtsync … | head`).
//! - 1: a runtime error: I/O, malformed debugfs contents, a VM exited while being read.
//! - 2: bad command-line usage.
//! - 3: the environment is missing something: debugfs not mounted, not root, no tracefs.
//! - 4: no VM or vCPU matches `--vm` / `--vcpu`.
//! - 5: bad input data (`convert`: a bad line or a value outside the mapping's range;
//!   `tsc compose`: mappings that cannot be composed; `trace-cmd attach`: a malformed or
//!   truncated trace.dat).
//! - 6: refused: the vCPU runs a nested guest (`guest_mode` 1) and `--nested-l2` was not given;
//!   `trace-cmd attach`: the TIME_SHIFT would be off by more than `--max-error` ticks;
//!   `export perf`: perf cannot express the mapping.
//! - 7: `probe`: the guest agent could not be reached, or stopped answering mid-session (the
//!   VM exited or was killed, the agent restarted, or it speaks another protocol version).
//! - 8: `probe --anchor kvm-pio`: exit anchoring is not possible here (no tracefs or
//!   `kvm_pio`, not root, the VM not in debugfs, not a serial chardev address) or no probe's
//!   exits were found (docs/anchor.md).
//!
//! - 9: `validate`: the sync file put at least one event on the wrong side of its exit.
//!
//! `validate`: inputs it cannot use (no kvm_pio, no workload events, malformed traces) exit
//! 5; no event it could check exits 2.
//!
//! `plot`: an unreadable sync file exits 5 (1 for I/O), one without segments 4.
//!
//! `convert --sync`: a sync file with no segment for `--vcpu` exits 4; a malformed sync file
//! or input line exits 5.

pub mod attach;
pub mod command;
pub mod convert;
pub mod exit;
pub mod export;
pub mod export_ctf;
pub mod export_perf;
pub mod export_perfetto;
pub mod host_copy;
pub mod kvm;
pub mod mapping;
mod number;
pub mod plot;
pub mod probe;
pub mod record;
mod signals;
pub mod source;
pub mod spans;
pub mod tsc;
pub mod validate;
mod vocabulary;

pub use command::{Cli, Command, main, run};
pub use convert::ConvertArgs;
pub use exit::CliError;
pub use kvm::KvmArgs;
pub use source::SourceArgs;
pub use tsc::{ComposeArgs, TscCommand};
