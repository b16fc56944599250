//! The sync wing: from probe samples to a guest tick's place on the host timeline, with the
//! interval that provably holds the truth (ARCHITECTURE.md, "Bounds always contain the
//! truth"; docs/record.md, "Placing an event"). Below probe, record and validate, which all
//! call it; it knows nothing of agents, links or sessions.
//!
//! - [`rate`](mod@rate): the rate limits `[1/2, 2]` every bound assumes.
//! - [`round`](mod@round): one round's samples `(host_send, guest, host_recv)` as a bounded
//!   estimate ([`Round`]).
//! - [`segment`](mod@segment): rounds since the last break as one cumulative estimate, and
//!   each round's sync segment ([`Cumulative::add_round`]).
//! - [`place`](mod@place): the one rule for a segment's line and the one for a point and its
//!   interval, one-sided or two-sided ([`place()`]).
//! - [`convert`](mod@convert): `vmtsync convert --sync`, guest ticks placed by that rule.

pub mod convert;
pub mod place;
pub mod rate;
pub mod round;
pub mod segment;

pub use convert::{SyncConvertStats, convert_sync_file, convert_with_sync};
pub use place::{Place, Placement, covering, host_bounds, place, place_with_exact};
pub use rate::{HULL_CAPACITY, RATE_LIMITS, RATE_MAX, RATE_MIN};
pub use round::{DriftSummary, Round, RttStats};
pub use segment::Cumulative;
