//! The probe protocol.
