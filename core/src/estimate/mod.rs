//! Estimators.
