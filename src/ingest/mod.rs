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
//! extractors), `events`, `tenants`, `api`, `metrics`, `serve`.

mod api;
pub mod auth;
mod config;
mod error;
mod events;
mod metrics;
mod serve;
mod tenants;
mod wire;

pub use api::{router, ApiDoc, ROUTES};
pub use config::{
    BacklogLimits, Config, EndpointLimits, MAX_ENDPOINT_BODY_BYTES, MAX_EVENT_TYPE_BYTES,
    MAX_REPLAY_BODY_BYTES,
};
pub use error::ApiError;
pub use metrics::route_label;
pub use serve::serve;
pub use wire::{
    Accepted, BatchResult, DeadLetterOut, DeadLettersOut, DeadQuery, EndpointIn, EndpointOut,
    ErrorBody, EventAccepted, EventIn, ItemResult, ReplayIn, ReplayOut, StatsOut, StatsQuery,
};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::endpoint::Endpoint;
use crate::producer::Producer;
use crate::store::{Store, StoreError};
use crate::telemetry::{EnvelopeLabels, IngestMetrics};

use auth::Keys;

/// Shared state of the handlers.
#[derive(Clone)]
pub struct Ingest {
    inner: Arc<Inner>,
}

/// Tenant -> (when read, its endpoints).
type EndpointCache = HashMap<String, (Instant, Arc<BTreeMap<String, Endpoint>>)>;

struct Inner {
    producer: Producer,
    keys: Keys,
    config: Config,
    metrics: IngestMetrics,
    endpoints: Mutex<EndpointCache>,
    /// Endpoint writes of this process, one at a time, so that the count
    /// check and the write of one PUT are not interleaved with another's.
    endpoint_writes: tokio::sync::Mutex<()>,
    /// When the Redis eviction policy was last read, and what was wrong with it.
    eviction: Mutex<Option<(Instant, Option<String>)>>,
}

impl Ingest {
    pub fn new(store: Store, keys: Keys, config: Config, metrics: IngestMetrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                producer: Producer::new(store, config.cache_ttl),
                keys,
                config,
                metrics,
                endpoints: Mutex::default(),
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
        match tokio::time::timeout(self.inner.config.redis_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(r) => r.map_err(ApiError::from),
            Err(_) => Err(ApiError::unavailable(format!(
                "redis did not answer within {:?}",
                self.inner.config.redis_timeout
            ))),
        }
    }

    /// A tenant's endpoints, cached briefly (writes through this process
    /// refresh the cache at once; other replicas see them within the TTL).
    async fn endpoints(&self, tenant: &str) -> Result<Arc<BTreeMap<String, Endpoint>>, ApiError> {
        if let Some((at, eps)) = self.cache().get(tenant) {
            if at.elapsed() < self.inner.config.cache_ttl {
                return Ok(eps.clone());
            }
        }
        let eps = Arc::new(self.redis(self.store().endpoints(tenant)).await?);
        self.cache()
            .insert(tenant.to_string(), (Instant::now(), eps.clone()));
        Ok(eps)
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, EndpointCache> {
        self.inner
            .endpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
