//! Crate-local logging shim: forwards to `defmt` with the `defmt` feature, expands to nothing
//! (arguments unevaluated) without it, so no formatting machinery is linked in.
#![allow(unused_macros)]

#[cfg(feature = "defmt")]
macro_rules! trace { ($($t:tt)*) => { defmt::trace!($($t)*) }; }
#[cfg(feature = "defmt")]
macro_rules! debug { ($($t:tt)*) => { defmt::debug!($($t)*) }; }
#[cfg(feature = "defmt")]
macro_rules! info { ($($t:tt)*) => { defmt::info!($($t)*) }; }
#[cfg(feature = "defmt")]
macro_rules! warn { ($($t:tt)*) => { defmt::warn!($($t)*) }; }

#[cfg(not(feature = "defmt"))]
macro_rules! trace {
    ($($t:tt)*) => {{}};
}
#[cfg(not(feature = "defmt"))]
macro_rules! debug {
    ($($t:tt)*) => {{}};
}
#[cfg(not(feature = "defmt"))]
macro_rules! info {
    ($($t:tt)*) => {{}};
}
#[cfg(not(feature = "defmt"))]
macro_rules! warn {
    ($($t:tt)*) => {{}};
}
