//! The Rust side's names for keys of a queue. The scripts name the same keys
//! in `lua/common.lua` (the key layout at its top is the reference); the few
//! that Rust reads directly are built here, in one place, and tests use them
//! too.

/// The record of a tenant's envelope: `P:e:<#tenant>:<tenant>:<id>`. The
/// tenant is part of the name, so two tenants' ids never meet.
pub fn envelope(prefix: &str, tenant: &str, id: &str) -> String {
    format!("{prefix}:e:{}:{tenant}:{id}", tenant.len())
}

/// A tenant's dead letters (a stream, oldest first).
pub fn dead_letters(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:dl:{tenant}")
}

/// The count of dead letters the queue's retention bound dropped.
pub fn dead_letters_dropped(prefix: &str) -> String {
    format!("{prefix}:dlx")
}

/// A tenant's idempotency claims of one period.
pub fn claims(prefix: &str, period: u64, tenant: &str) -> String {
    format!("{prefix}:ids:{period}:{tenant}")
}
