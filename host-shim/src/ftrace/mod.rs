//! Reading ftrace events: record layouts from the kernel's own format descriptions.
//!
//! - [`format`]: an event's `format` text (tracefs or a trace.dat's event-format section) and
//!   the typed `kvm:kvm_pio` record that exit anchoring and validation read.

pub mod format;
