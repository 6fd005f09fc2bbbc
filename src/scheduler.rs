//! The fairness policy, as pure code. The Lua scripts in `store` embody it
//! inside Redis; this module turns a ShardSet's spec into the per-queue
//! settings they read, and computes retry delays.
//!
//! Deficit round robin priced in worker-seconds: the tenants with queued work
//! form a ring; the head tenant is served while its credit is positive, each
//! lease charging its recent mean delivery time, and each ack settling the
//! difference with the time the delivery really took. When its credit runs
//! out it earns `quantum x weight` and goes to the tail. A tenant whose lane
//! empties leaves the ring and keeps no credit (debt stays). A tenant at its
//! in-flight cap is parked off the ring until a slot frees, so it is not
//! rescanned. Each lease is O(1) amortized in the number of active tenants
//! (the only loop is over tenants whose credit is spent, about
//! `estimate / quantum` skips per turn, independent of how many tenants are
//! active).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::crd::{Ordering, ShardSetSpec};

/// What every lease, ack and nack script of one queue reads.
#[derive(Clone, Debug, PartialEq)]
pub struct QueuePolicy {
    /// Credit per turn for weight 1, in worker-seconds.
    pub quantum_seconds: f64,
    /// In-flight cap per tenant (1 under `PerTenant` ordering).
    pub max_in_flight: u32,
    /// Strict per-tenant order.
    pub ordered: bool,
    pub default_weight: f64,
    /// Per-tenant weights (tier weights already resolved by the caller).
    pub weights: BTreeMap<String, f64>,
    /// Estimate charged for a tenant with no delivery measured yet.
    pub initial_estimate_seconds: f64,
    /// Attempts before an envelope is dead-lettered.
    pub max_attempts: u32,
    /// How long an envelope id is remembered for idempotency.
    pub idempotency_window: Duration,
    /// Circuit breaker, per tenant endpoint, shared by the queue's workers.
    pub breaker: BreakerPolicy,
    /// Dead-letter retention, per tenant.
    pub dead_letters: DeadLetterPolicy,
}

/// How many dead letters a tenant keeps in a queue, and for how long.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterPolicy {
    pub max_per_tenant: u64,
    pub max_age: Duration,
}

impl Default for DeadLetterPolicy {
    fn default() -> Self {
        Self {
            max_per_tenant: 100_000,
            max_age: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// When an endpoint's breaker opens and how long it stays open.
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerPolicy {
    /// Failure ratio over `window` at or above which it opens.
    pub failure_ratio: f64,
    /// Fewest requests in `window` before the ratio counts.
    pub min_requests: u32,
    pub window: Duration,
    /// Open this long before one probe goes out.
    pub open_for: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            failure_ratio: 0.5,
            min_requests: 20,
            window: Duration::from_secs(60),
            open_for: Duration::from_secs(30),
        }
    }
}

impl Default for QueuePolicy {
    fn default() -> Self {
        Self {
            quantum_seconds: 2.0,
            max_in_flight: 8,
            ordered: false,
            default_weight: 1.0,
            weights: BTreeMap::new(),
            initial_estimate_seconds: 1.0,
            max_attempts: 10,
            idempotency_window: Duration::from_secs(24 * 3600),
            breaker: BreakerPolicy::default(),
            dead_letters: DeadLetterPolicy::default(),
        }
    }
}

impl QueuePolicy {
    /// The policy a ShardSet asks for.
    pub fn from_spec(spec: &ShardSetSpec) -> Self {
        let s = &spec.scheduler;
        let ordered = s.ordering == Ordering::PerTenant;
        Self {
            quantum_seconds: s.quantum_seconds,
            max_in_flight: s.max_in_flight_per_tenant.max(1) as u32,
            ordered,
            default_weight: s.default_weight,
            weights: s
                .weights
                .iter()
                .map(|w| (w.tenant.clone(), w.weight))
                .collect(),
            max_attempts: spec.delivery.max_attempts.max(1) as u32,
            breaker: BreakerPolicy {
                failure_ratio: spec.delivery.breaker.failure_ratio,
                min_requests: spec.delivery.breaker.min_requests.max(1) as u32,
                window: spec.delivery.breaker.window.into(),
                open_for: spec.delivery.breaker.open_for.into(),
            },
            dead_letters: DeadLetterPolicy {
                max_per_tenant: spec.delivery.dead_letters.max_per_tenant.max(1) as u64,
                max_age: spec.delivery.dead_letters.max_age.into(),
            },
            ..Self::default()
        }
    }

    /// The cap in force: 1 under strict per-tenant order.
    pub fn effective_cap(&self) -> u32 {
        if self.ordered {
            1
        } else {
            self.max_in_flight.max(1)
        }
    }
}

/// Delay before retry number `attempt` (1 for the first retry): exponential
/// from `initial`, capped at `max`, with "equal jitter" (half fixed, half
/// random) so a burst of failures does not retry in lockstep. `unit` is a
/// random number in [0, 1).
pub fn retry_delay(attempt: u32, initial: Duration, max: Duration, unit: f64) -> Duration {
    let exp = initial.as_secs_f64() * 2f64.powi(attempt.saturating_sub(1).min(62) as i32);
    let capped = exp.min(max.as_secs_f64());
    Duration::from_secs_f64(capped / 2.0 + capped / 2.0 * unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let i = Duration::from_secs(1);
        let m = Duration::from_secs(60);
        assert_eq!(retry_delay(1, i, m, 1.0), Duration::from_secs(1));
        assert_eq!(retry_delay(1, i, m, 0.0), Duration::from_millis(500));
        assert_eq!(retry_delay(4, i, m, 1.0), Duration::from_secs(8));
        assert_eq!(retry_delay(30, i, m, 1.0), Duration::from_secs(60));
        assert_eq!(retry_delay(30, i, m, 0.0), Duration::from_secs(30));
    }

    #[test]
    fn per_tenant_ordering_means_cap_one() {
        let p = QueuePolicy {
            ordered: true,
            max_in_flight: 8,
            ..Default::default()
        };
        assert_eq!(p.effective_cap(), 1);
    }
}
