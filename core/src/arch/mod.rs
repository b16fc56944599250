//! Hardware access. The only `unsafe` in this crate lives below this module.
