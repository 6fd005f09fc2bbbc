//! The pure rules of lanekeeper, shared by the data plane, the operator and
//! the simulator: no I/O, no Kubernetes types.
//!
//! - [`queue`]: what each queue's scripts read (fair scheduling, caps,
//!   retries, breaker, dead-letter retention).
//! - [`backoff`]: the one capped exponential backoff, and the worker's
//!   jittered retry delay.
//! - [`attribution`]: the worker-seconds window, its buckets and the
//!   per-tenant figures read from them.
//! - [`promotion`]: which tenants deserve a dedicated lane, with hysteresis.
//! - [`tiers`]: tier names and the `<tenant> <tier>` assignment lines.
//! - [`shaping`]: which hot tenants without a lane ingest shapes, and to
//!   what rate.

pub mod attribution;
pub mod backoff;
pub mod promotion;
pub mod queue;
pub mod shaping;
pub mod tiers;

pub use attribution::TenantStats;
pub use backoff::{capped_backoff, retry_delay};
pub use queue::*;
