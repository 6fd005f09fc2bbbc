//! The fairness policy, as pure code. The Lua scripts in `store` embody it
//! inside Redis; this module holds the per-queue settings they read (the
//! operator fills them from a ShardSet's spec: `QueuePolicy::from_spec`).
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
    /// Per-tenant weights; a tenant's own weight wins over its tier's.
    pub weights: BTreeMap<String, f64>,
    /// Per-tenant in-flight caps, over `max_in_flight` (not under strict
    /// order, where every tenant's cap is 1).
    pub caps: BTreeMap<String, u32>,
    /// Per-tier weights, for tenants whose tier (`tr`, set at enqueue from
    /// the set's tier assignments) is listed; any other tenant gets
    /// `default_weight`.
    pub tier_weights: BTreeMap<String, f64>,
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
    /// The longest pause a receiver's `Retry-After` may put on its endpoint
    /// (`delivery.maxRetryAfter`).
    pub max_retry_after: Duration,
    /// Delivery rate limits (token buckets checked at lease time).
    pub rate_limits: RateLimits,
    /// A tenant idle this long in a queue has its state there swept
    /// (`scheduler.sweepIdleTenantsAfter`); `None`: never.
    pub sweep_idle_after: Option<Duration>,
    /// What the fairness and the in-flight cap isolate (`spec.isolation`).
    pub isolation: Isolation,
    /// Under [`Isolation::Endpoint`], the in-flight cap of each of a
    /// tenant's endpoints (`scheduler.maxInFlightPerEndpoint`), never above
    /// the tenant's own cap; `None`: half the tenant's cap, rounded up. 1
    /// under `PerTenant` ordering.
    pub max_in_flight_per_endpoint: Option<u32>,
}

/// What a queue's scheduler isolates from what.
///
/// - `Tenant`: tenants are served by deficit round robin in worker-seconds,
///   each with one FIFO lane and one in-flight cap. A tenant's slow
///   endpoint can fill its cap and hold back its fast ones. Order: per
///   tenant (strict with `PerTenant` ordering).
/// - `Endpoint`: tenants are still served by deficit round robin between
///   them (a tenant's share does not grow with its number of endpoints);
///   inside a tenant, each endpoint has its own FIFO lane and its own
///   in-flight cap, and the tenant's endpoints share its turns by
///   worker-seconds (start-time fair queuing). Order: per (tenant,
///   endpoint).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    #[default]
    Tenant,
    Endpoint,
}

/// A delivery rate limit: token buckets, one for the tenant and one for
/// each of its endpoints, refilled continuously. A rate of 0 leaves that
/// half unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct RateLimit {
    /// Deliveries per second the tenant may start (0: unlimited).
    pub per_second: f64,
    /// Deliveries the tenant may start at once after a quiet spell.
    pub burst: f64,
    /// Deliveries per second to each one of the tenant's endpoints (0: unlimited).
    pub endpoint_per_second: f64,
    pub endpoint_burst: f64,
}

impl RateLimit {
    /// Whether either half limits anything.
    pub fn is_limited(&self) -> bool {
        self.per_second > 0.0 || self.endpoint_per_second > 0.0
    }

    /// A burst as the scripts use it: at least one token (a bucket smaller
    /// than one delivery would never let one through), and when unset, one
    /// second's worth.
    pub fn effective_burst(rate: f64, burst: f64) -> f64 {
        if rate <= 0.0 {
            0.0
        } else if burst >= 1.0 {
            burst
        } else {
            rate.ceil().max(1.0)
        }
    }

    /// The form the scripts parse: `rate,burst,erate,eburst` (bursts resolved).
    pub fn encode(&self, sep: char) -> String {
        let b = Self::effective_burst(self.per_second, self.burst);
        let eb = Self::effective_burst(self.endpoint_per_second, self.endpoint_burst);
        format!(
            "{}{sep}{}{sep}{}{sep}{}",
            self.per_second.max(0.0),
            b,
            self.endpoint_per_second.max(0.0),
            eb
        )
    }
}

/// Which limit a tenant gets: its own entry, else its tier's, else the default.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RateLimits {
    pub default: Option<RateLimit>,
    pub tiers: BTreeMap<String, RateLimit>,
    pub tenants: BTreeMap<String, RateLimit>,
}

impl RateLimits {
    /// The limit that applies to `tenant` in `tier` (pure: the scripts make
    /// the same choice from the queue's policy and `P:limits`).
    pub fn resolve(&self, tenant: &str, tier: Option<&str>) -> Option<RateLimit> {
        self.tenants
            .get(tenant)
            .or_else(|| tier.and_then(|t| self.tiers.get(t)))
            .or(self.default.as_ref())
            .copied()
            .filter(RateLimit::is_limited)
    }
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
            caps: BTreeMap::new(),
            tier_weights: BTreeMap::new(),
            initial_estimate_seconds: 1.0,
            max_attempts: 10,
            idempotency_window: Duration::from_secs(24 * 3600),
            breaker: BreakerPolicy::default(),
            dead_letters: DeadLetterPolicy::default(),
            max_retry_after: Duration::from_secs(600),
            rate_limits: RateLimits::default(),
            sweep_idle_after: Some(Duration::from_secs(24 * 3600)),
            isolation: Isolation::Tenant,
            max_in_flight_per_endpoint: None,
        }
    }
}

impl QueuePolicy {
    /// The cap in force: 1 under strict per-tenant order.
    pub fn effective_cap(&self) -> u32 {
        if self.ordered {
            1
        } else {
            self.max_in_flight.max(1)
        }
    }

    /// A tenant's weight: its own wins over its tier's, then the default (a
    /// tier without a weight gets the default). The scripts' `weight` in
    /// `common.lua` makes the same choice.
    pub fn weight(&self, tenant: &str, tier: Option<&str>) -> f64 {
        self.weights
            .get(tenant)
            .or_else(|| tier.and_then(|t| self.tier_weights.get(t)))
            .copied()
            .unwrap_or(self.default_weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_tenant_ordering_means_cap_one() {
        let p = QueuePolicy {
            ordered: true,
            max_in_flight: 8,
            ..Default::default()
        };
        assert_eq!(p.effective_cap(), 1);
    }

    fn limit(rate: f64) -> RateLimit {
        RateLimit {
            per_second: rate,
            ..Default::default()
        }
    }

    #[test]
    fn a_tenants_limit_wins_over_its_tiers_and_the_default() {
        let l = RateLimits {
            default: Some(limit(1.0)),
            tiers: [("gold".to_string(), limit(10.0))].into(),
            tenants: [("vip".to_string(), limit(100.0))].into(),
        };
        assert_eq!(l.resolve("vip", Some("gold")), Some(limit(100.0)));
        assert_eq!(l.resolve("a", Some("gold")), Some(limit(10.0)));
        assert_eq!(l.resolve("a", Some("silver")), Some(limit(1.0)));
        assert_eq!(l.resolve("a", None), Some(limit(1.0)));
        assert_eq!(RateLimits::default().resolve("a", None), None);
        // an entry of zeros means unlimited, not "fall back"
        let open = RateLimits {
            default: Some(limit(1.0)),
            tenants: [("vip".to_string(), limit(0.0))].into(),
            ..Default::default()
        };
        assert_eq!(open.resolve("vip", None), None);
    }

    #[test]
    fn bursts_are_at_least_one_token() {
        assert_eq!(RateLimit::effective_burst(0.5, 0.0), 1.0);
        assert_eq!(RateLimit::effective_burst(50.0, 0.0), 50.0);
        assert_eq!(RateLimit::effective_burst(2.5, 0.0), 3.0);
        assert_eq!(RateLimit::effective_burst(50.0, 5.0), 5.0);
        assert_eq!(RateLimit::effective_burst(0.0, 5.0), 0.0);
        let l = RateLimit {
            per_second: 50.0,
            burst: 0.0,
            endpoint_per_second: 2.0,
            endpoint_burst: 4.0,
        };
        assert_eq!(l.encode(','), "50,50,2,4");
    }
}
