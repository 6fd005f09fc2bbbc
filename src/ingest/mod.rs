//! `lanekeeper ingest`: the HTTP front door producers call.
//!
//! Everything goes through the data plane's enqueue ([`Producer`]): routing
//! with MOVED answers followed, paused tenants' envelopes held (and accepted),
//! envelope ids as idempotency keys, and each tenant's backlog limit checked
//! inside the enqueue script, so a whale past its limit gets 429 while every
//! other tenant's posts go on. The OpenAPI document is generated from the
//! handlers and types (utoipa), and the router from the same operation list
//! (`api`), so neither can drift from them.
//!
//! This file holds the handlers' shared state ([`Ingest`]) and re-exports;
//! each job has its file: `config`, `wire`, `error`, `auth` (keys and the
//! extractors), `events`, `tenants`, `tiers` (the admin tier assignments),
//! `api`, `metrics`, `serve`.

mod admin;
mod api;
pub mod auth;
mod config;
mod error;
mod events;
mod metrics;
mod serve;
mod tenants;
mod tiers;
mod wire;

pub use api::{router, ApiDoc, ROUTES};
pub use config::{
    BacklogLimits, Config, EndpointLimits, MAX_ENDPOINT_BODY_BYTES, MAX_EVENT_TYPE_BYTES,
    MAX_REPLAY_BODY_BYTES, MAX_TIERS_BODY_BYTES, MAX_TIER_ASSIGNMENTS,
};
pub use error::ApiError;
pub use metrics::route_label;
pub use serve::serve;
pub use wire::{
    Accepted, BatchResult, DeadLetterOut, DeadLettersOut, DeadQuery, EndpointIn, EndpointOut,
    ErrorBody, EventAccepted, EventIn, ItemResult, ReplayIn, ReplayOut, StatsOut, StatsQuery,
    TierIn, TierOut, TiersOut,
};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::endpoint::Endpoint;
use crate::producer::Producer;
use crate::store::{Store, StoreError, TtlCache};
use crate::telemetry::{EnvelopeLabels, IngestMetrics};

use auth::Keys;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct Ingest {
    inner: Arc<Inner>,
}

/// Tenant -> its endpoints, reused for `cache_ttl`.
type EndpointCache = TtlCache<String, Arc<BTreeMap<String, Endpoint>>>;

/// Tenants whose endpoints one ingest process remembers at most.
const ENDPOINT_CACHE_CAPACITY: usize = 65_536;

/// Tenant -> its tier in force (None: no tier), reused for `cache_ttl`.
type TierCache = TtlCache<String, Option<Arc<str>>>;

struct Inner {
    producer: Producer,
    keys: Keys,
    config: Config,
    metrics: IngestMetrics,
    endpoints: EndpointCache,
    tiers: TierCache,
    /// Endpoint writes of this process, one at a time, so that the count
    /// check and the write of one PUT are not interleaved with another's.
    endpoint_writes: tokio::sync::Mutex<()>,
    /// When the Redis eviction policy was last read, and what was wrong with it.
    eviction: Mutex<Option<(Instant, Option<String>)>>,
}

impl Ingest {
    pub fn new(store: Store, keys: Keys, config: Config, metrics: IngestMetrics) -> Self {
        let endpoints = EndpointCache::new(config.cache_ttl, ENDPOINT_CACHE_CAPACITY);
        let tiers = TierCache::new(config.cache_ttl, ENDPOINT_CACHE_CAPACITY);
        Self {
            inner: Arc::new(Inner {
                producer: Producer::new(store, config.cache_ttl),
                keys,
                config,
                metrics,
                endpoints,
                tiers,
                endpoint_writes: tokio::sync::Mutex::new(()),
                eviction: Mutex::default(),
            }),
        }
    }

    fn store(&self) -> &Store {
        self.inner.producer.store()
    }

    /// A Redis call with the configured timeout: a slow or absent Redis is a
    /// quick 503, never a hung client.
    async fn redis<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, ApiError> {
        self.redis_within(self.inner.config.redis_timeout, f).await
    }

    /// [`Ingest::redis`] for work of many Redis calls (an admin purge or
    /// replay in bounded steps): the whole of it within `timeout`.
    async fn redis_within<T>(
        &self,
        timeout: std::time::Duration,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, ApiError> {
        match tokio::time::timeout(timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(r) => r.map_err(ApiError::from),
            Err(_) => Err(ApiError::unavailable(format!(
                "redis did not answer within {timeout:?}"
            ))),
        }
    }

    /// A tenant's endpoints, cached briefly (writes through this process
    /// refresh the cache at once; other replicas see them within the TTL).
    async fn endpoints(&self, tenant: &str) -> Result<Arc<BTreeMap<String, Endpoint>>, ApiError> {
        let load = async { Ok(Arc::new(self.redis(self.store().endpoints(tenant)).await?)) };
        self.inner
            .endpoints
            .get_or_load(tenant.to_string(), load)
            .await
    }

    /// Forget a tenant's cached endpoints (this process just changed them).
    fn forget_endpoints(&self, tenant: &str) {
        self.inner.endpoints.remove(&tenant.to_string());
    }

    /// The tier update each of `tenants` takes to its queue: its tier in
    /// force (the admin API's, else the ConfigMap's) or none, cached briefly
    /// (admin writes through this process refresh the cache at once; other
    /// replicas see them within the TTL). Uncached tenants cost one round
    /// trip together.
    async fn tier_updates(
        &self,
        tenants: &[&str],
    ) -> Result<std::collections::HashMap<String, crate::store::TierUpdate>, ApiError> {
        use crate::store::TierUpdate;
        let cache = &self.inner.tiers;
        let mut out = std::collections::HashMap::with_capacity(tenants.len());
        let mut missing: Vec<&str> = Vec::new();
        for t in tenants {
            if out.contains_key(*t) || missing.contains(t) {
                continue;
            }
            match cache.get(&t.to_string()) {
                Some(tier) => {
                    out.insert(t.to_string(), tier_update(tier));
                }
                None => missing.push(t),
            }
        }
        if !missing.is_empty() {
            let found = self.redis(self.store().tenant_tiers(&missing)).await?;
            for (t, tier) in missing.into_iter().zip(found) {
                let tier: Option<Arc<str>> = tier.map(Arc::from);
                cache.insert(t.to_string(), tier.clone());
                out.insert(t.to_string(), tier_update(tier));
            }
        }
        return Ok(out);

        fn tier_update(tier: Option<Arc<str>>) -> TierUpdate {
            match tier {
                Some(t) => TierUpdate::Set(t),
                None => TierUpdate::Clear,
            }
        }
    }

    /// Forget a tenant's cached tier (this process just changed it).
    fn forget_tier(&self, tenant: &str) {
        self.inner.tiers.remove(&tenant.to_string());
    }

    /// Count `n` envelopes refused because `tenant` is shaped: the
    /// `shaped` outcome and the per-tenant counter (its label set capped).
    fn shaped(&self, tenant: &str, n: u64) {
        self.count("shaped", n);
        let m = &self.inner.metrics;
        m.shaped
            .get_or_create(&crate::telemetry::IngestTenantLabels {
                tenant: m.tenant_label(tenant),
            })
            .inc_by(n);
    }

    fn count(&self, outcome: &str, n: u64) {
        self.inner
            .metrics
            .envelopes
            .get_or_create(&EnvelopeLabels {
                outcome: outcome.to_string(),
            })
            .inc_by(n);
    }
}
