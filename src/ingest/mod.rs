//! `lanekeeper ingest`: the HTTP front door producers call.
//!
//! Everything goes through the data plane's enqueue ([`Producer`]): routing
//! with MOVED answers followed, paused tenants' envelopes held (and accepted),
//! envelope ids as idempotency keys, and each tenant's backlog limit checked
//! inside the enqueue script, so a whale past its limit gets 429 while every
//! other tenant's posts go on. The OpenAPI document is generated from the
//! handlers and types below (utoipa), so it cannot drift from them.

pub mod auth;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, OpenApi, ToSchema};

use crate::endpoint::Endpoint;
use crate::envelope::{Envelope, MAX_ID_BYTES};
use crate::producer::Producer;
use crate::routing::QueueId;
use crate::store::{EnqueueOutcome, Store, StoreError};
use crate::telemetry::{EnvelopeLabels, IngestMetrics, RequestLabels, RouteLabels};

use auth::{Keys, Principal};

/// Per-tenant backlog limits: a default, and overrides for named tenants.
#[derive(Clone, Debug, Default)]
pub struct BacklogLimits {
    /// `None`: no limit.
    pub default: Option<u64>,
    pub overrides: HashMap<String, u64>,
}

impl BacklogLimits {
    pub fn for_tenant(&self, tenant: &str) -> Option<u64> {
        self.overrides
            .get(tenant)
            .copied()
            .or(self.default)
            .filter(|l| *l > 0)
    }

    /// Parse an override `tenant=limit`.
    pub fn parse_override(s: &str) -> Result<(String, u64), String> {
        let (t, l) = s
            .rsplit_once('=')
            .ok_or_else(|| format!("{s:?}: expected tenant=limit"))?;
        crate::envelope::validate_tenant(t).map_err(|e| format!("{s:?}: {e}"))?;
        let l = l
            .parse()
            .map_err(|_| format!("{s:?}: the limit must be a whole number"))?;
        Ok((t.to_string(), l))
    }
}

/// Ingest settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Largest payload of one event, in bytes (JSON as posted).
    pub max_payload_bytes: usize,
    /// Largest request body (a batch), in bytes.
    pub max_body_bytes: usize,
    /// Most events in one batch.
    pub max_batch_items: usize,
    pub backlog: BacklogLimits,
    /// How long a Redis call may take before the answer is 503.
    pub redis_timeout: Duration,
    /// How long routing tables and endpoint lists are cached.
    pub cache_ttl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_payload_bytes: 256 * 1024,
            max_body_bytes: 64 * 1024 * 1024,
            max_batch_items: 10_000,
            backlog: BacklogLimits::default(),
            redis_timeout: Duration::from_secs(2),
            cache_ttl: Duration::from_secs(1),
        }
    }
}

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
            Ok(Err(StoreError::Invalid(e))) => {
                Err(ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason))
            }
            Ok(Err(StoreError::InvalidEndpoint(e))) => {
                Err(ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason))
            }
            Ok(Err(e @ StoreError::RoutingMissing(_))) => Err(ApiError::unavailable(e.to_string())),
            Ok(Err(e)) => Err(ApiError::unavailable(format!("redis: {e}"))),
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

    fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| ApiError::unauthorized("missing Authorization: Bearer <api key>"))?;
        let key = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::unauthorized("Authorization must be Bearer <api key>"))?;
        self.inner
            .keys
            .current()
            .lookup(key.trim())
            .cloned()
            .ok_or_else(|| ApiError::unauthorized("unknown api key"))
    }

    fn authorize(&self, headers: &HeaderMap, tenant: &str) -> Result<Principal, ApiError> {
        let who = self.authenticate(headers)?;
        if !who.may_act_for(tenant) {
            return Err(ApiError::forbidden(&who, tenant, None));
        }
        Ok(who)
    }

    /// The envelopes one event becomes: one for the endpoint named (or
    /// `default`), or, for an event type without an endpoint, one per enabled
    /// endpoint of the tenant whose filter takes the type.
    /// `raw_len` is the size of the event's JSON as posted: a payload is
    /// measured exactly only when the whole event is over the limit.
    async fn envelopes(
        &self,
        ev: EventIn,
        raw_len: usize,
        field: &str,
    ) -> Result<Vec<Envelope>, ApiError> {
        let f = |name: &str| {
            if field.is_empty() {
                name.to_string()
            } else {
                format!("{field}.{name}")
            }
        };
        crate::envelope::validate_tenant(&ev.tenant)
            .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, &f("tenant"), e.reason))?;
        let size = if raw_len > self.inner.config.max_payload_bytes {
            serde_json::to_vec(&ev.payload)
                .map(|v| v.len())
                .unwrap_or(0)
        } else {
            0
        };
        if size > self.inner.config.max_payload_bytes {
            return Err(ApiError::field(
                StatusCode::PAYLOAD_TOO_LARGE,
                &f("payload"),
                format!(
                    "is {size} bytes; the limit is {}",
                    self.inner.config.max_payload_bytes
                ),
            ));
        }
        let id = match ev.id {
            Some(id) => id,
            None => Envelope::new_id(),
        };
        let endpoints = self.endpoints(&ev.tenant).await?;
        let targets: Vec<String> = match (&ev.endpoint, &ev.event_type) {
            (Some(name), _) => {
                if !endpoints.contains_key(name) {
                    return Err(ApiError::field(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &f("endpoint"),
                        format!("tenant {:?} has no endpoint {name:?}", ev.tenant),
                    ));
                }
                vec![name.clone()]
            }
            (None, Some(t)) => {
                let names: Vec<String> = endpoints
                    .iter()
                    .filter(|(_, e)| e.enabled && e.wants(Some(t)))
                    .map(|(n, _)| n.clone())
                    .collect();
                if names.is_empty() {
                    return Err(ApiError::field(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &f("eventType"),
                        format!(
                            "no enabled endpoint of tenant {:?} takes event type {t:?}",
                            ev.tenant
                        ),
                    ));
                }
                names
            }
            (None, None) => {
                let name = crate::envelope::DEFAULT_ENDPOINT;
                if !endpoints.contains_key(name) {
                    return Err(ApiError::field(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &f("endpoint"),
                        format!(
                            "not given, and tenant {:?} has no endpoint named {name:?}; name one, or give an eventType to fan out",
                            ev.tenant
                        ),
                    ));
                }
                vec![name.to_string()]
            }
        };
        // Fan-out ids derive from the event's, so a retried post is still a duplicate.
        let fan_out = ev.endpoint.is_none() && ev.event_type.is_some();
        let mut out: Vec<Envelope> = Vec::with_capacity(targets.len());
        let last = targets.len() - 1;
        let mut payload = Some(ev.payload);
        for (i, endpoint) in targets.into_iter().enumerate() {
            out.push(Envelope {
                id: if fan_out {
                    format!("{id}.{endpoint}")
                } else {
                    id.clone()
                },
                tenant: ev.tenant.clone(),
                endpoint: Some(endpoint),
                event_type: ev.event_type.clone(),
                // the last envelope takes the payload; the others copy it
                payload: if i == last {
                    payload.take().unwrap_or_default()
                } else {
                    payload.clone().unwrap_or_default()
                },
            });
        }
        for e in &out {
            if e.id.len() > MAX_ID_BYTES {
                return Err(ApiError::field(
                    StatusCode::BAD_REQUEST,
                    &f("id"),
                    format!(
                        "with the endpoint suffix it is {} bytes; the limit is {MAX_ID_BYTES}",
                        e.id.len()
                    ),
                ));
            }
            e.validate().map_err(|err| {
                ApiError::field(StatusCode::BAD_REQUEST, &f(err.field), err.reason)
            })?;
        }
        Ok(out)
    }

    /// Seconds until `tenant` has likely drained below its limit, from its
    /// recent drain rate.
    async fn retry_after(&self, q: QueueId, tenant: &str, depth: u64, limit: u64) -> u64 {
        let activity = tokio::time::timeout(
            self.inner.config.redis_timeout,
            self.store()
                .tenant_activity(q, tenant, Duration::from_secs(60)),
        )
        .await;
        match activity {
            Ok(Ok(a)) if a.drain_rate() > 0.0 => {
                let excess = depth.saturating_sub(limit) + 1;
                ((excess as f64 / a.drain_rate()).ceil() as u64).clamp(1, 3600)
            }
            // Not draining at all over the last minute: look again in a minute.
            _ => 60,
        }
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

// ---- wire types ----------------------------------------------------------

/// One event, as a producer posts it.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EventIn {
    /// The tenant whose webhook this is (at most 256 bytes, no control characters).
    pub tenant: String,
    /// The tenant's endpoint, by name. Without it, an `eventType` fans out to
    /// every enabled endpoint that takes the type; with neither, the endpoint
    /// named `default` gets it.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Event type, e.g. `user.password_reset`.
    #[serde(default)]
    pub event_type: Option<String>,
    /// The webhook body.
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    /// Idempotency key: the same id twice is stored once. Generated when absent.
    #[serde(default)]
    pub id: Option<String>,
}

/// Where one envelope went.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    pub id: String,
    pub endpoint: String,
    /// The queue: `shard-NN` or `lane-N`.
    pub queue: String,
    /// `queued`; `held` (the tenant is moving; delivered after the move, in
    /// order); or `duplicate` (this id was stored before).
    pub status: String,
}

/// The answer to one event: the envelope it became, or one per endpoint
/// for a fan-out.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventAccepted {
    /// The event's id (fan-out envelopes carry it with `.<endpoint>` added).
    pub id: String,
    pub queue: String,
    pub envelopes: Vec<Accepted>,
}

/// One item's result in a batch.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ItemResult {
    pub index: usize,
    /// The HTTP status this item would have had alone: 202, 400, 403, 413,
    /// 422, 429 or 503.
    pub status: u16,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub envelopes: Vec<Accepted>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// For 429: seconds after which the tenant has likely drained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// The answer to a batch: one result per item, in order.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchResult {
    pub accepted: usize,
    pub rejected: usize,
    pub items: Vec<ItemResult>,
}

/// An endpoint definition, as put.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointIn {
    /// `https://` (or `http://`) URL that receives the POSTs.
    pub url: String,
    /// Signing secret in `whsec_` form. Generated when absent, and shown
    /// once, in this answer.
    #[serde(default)]
    pub secret: Option<String>,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Event types this endpoint takes in a fan-out; empty means all.
    #[serde(default)]
    pub event_types: Vec<String>,
}

fn yes() -> bool {
    true
}

/// An endpoint as stored. Secrets are never shown again after they are set.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointOut {
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub event_types: Vec<String>,
    /// Signing secrets in force (two during a rotation).
    pub secrets: usize,
    /// The secret, only in the answer to the PUT that set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

impl EndpointOut {
    fn new(name: &str, e: &Endpoint, secret: Option<String>) -> Self {
        Self {
            name: name.to_string(),
            url: e.url.clone(),
            enabled: e.enabled,
            event_types: e.event_types.clone(),
            secrets: e.secrets.len(),
            secret,
        }
    }
}

/// A dead letter.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterOut {
    pub id: String,
    pub queue: String,
    pub attempts: u32,
    pub cause: String,
    /// When it was dead-lettered, ms since the epoch.
    pub at: u64,
    /// The envelope as stored (JSON), empty when its record was missing.
    pub envelope: String,
}

/// Which dead letters to replay.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayIn {
    /// Ids to replay; absent or empty: all of the tenant's.
    #[serde(default)]
    pub ids: Vec<String>,
}

/// What a replay did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplayOut {
    /// Dead letters put back on the tenant's lane.
    pub replayed: u64,
}

/// A tenant's state in its queue.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatsOut {
    pub tenant: String,
    pub queue: String,
    /// Envelopes queued, held, waiting to retry or in flight.
    pub depth: u64,
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    pub held: u64,
    pub paused: bool,
    pub delivered: u64,
    pub failed: u64,
    /// How long the oldest queued envelope has waited, ms.
    pub oldest_wait_ms: Option<u64>,
    /// Share of the queue's worker-seconds over the window, 0 to 1.
    pub capacity_share: f64,
    /// Deliveries per second over the window.
    pub drain_rate: f64,
    pub window_s: u64,
}

/// Query of the stats call.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct StatsQuery {
    /// Window in seconds for shares and rates (default 60, at most 7200).
    pub window: Option<u64>,
}

/// Query of the dead-letter list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeadQuery {
    /// Most recent dead letters to scan (default 100, at most 10000).
    pub limit: Option<usize>,
}

/// Every error answer.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ErrorBody {
    /// Machine-readable: invalid_field, malformed_json, payload_too_large,
    /// unauthorized, forbidden, not_found, backlog_full, unavailable.
    pub code: String,
    /// The field at fault, as a path (`tenant`, `payload`, `items[3].tenant`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub message: String,
}

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        code: &str,
        field: Option<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            body: ErrorBody {
                code: code.into(),
                field,
                message: message.into(),
            },
            retry_after: None,
        }
    }

    fn field(status: StatusCode, field: &str, reason: impl Into<String>) -> Self {
        let code = match status {
            StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
            _ => "invalid_field",
        };
        let reason = reason.into();
        Self::new(
            status,
            code,
            Some(field.to_string()),
            format!("{field}: {reason}"),
        )
    }

    fn forbidden(who: &Principal, tenant: &str, field: Option<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            field,
            format!("api key {:?} may not act for tenant {tenant:?}", who.name),
        )
    }

    fn unauthorized(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", None, message)
    }

    fn unavailable(message: String) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            None,
            message,
        );
        e.retry_after = Some(1);
        e
    }

    fn backlog_full(tenant: &str, depth: u64, limit: u64, retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "backlog_full",
            Some("tenant".into()),
            format!(
                "tenant {tenant:?} has {depth} envelopes waiting; its backlog limit is {limit}"
            ),
        );
        e.retry_after = Some(retry_after);
        e
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body)).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Parse a JSON body, naming the field at fault.
fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                None,
                format!("malformed JSON: {inner}"),
            );
        }
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            Some(field.clone()),
            format!("{field}: {inner}"),
        )
    })
}

fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                Some("body".into()),
                format!("body: larger than the limit of {limit} bytes"),
            )
        } else {
            ApiError::new(e.status(), "bad_request", None, e.body_text())
        }
    })
}

fn status_name(o: &EnqueueOutcome) -> &'static str {
    match o {
        EnqueueOutcome::Queued { .. } => "queued",
        EnqueueOutcome::Held { .. } => "held",
        EnqueueOutcome::Duplicate => "duplicate",
        EnqueueOutcome::Moved(_) => "moved",
        EnqueueOutcome::Full { .. } => "backlog_full",
        EnqueueOutcome::Stale { .. } => "stale",
    }
}

// ---- handlers ------------------------------------------------------------

/// Post one event.
#[utoipa::path(post, path = "/v1/events", request_body = EventIn,
    responses(
        (status = 202, description = "Stored (or held while the tenant moves, or a duplicate)", body = EventAccepted),
        (status = 400, description = "Malformed JSON, unknown or invalid field", body = ErrorBody),
        (status = 401, description = "Missing or unknown api key", body = ErrorBody),
        (status = 403, description = "The key may not act for this tenant", body = ErrorBody),
        (status = 413, description = "Payload over the size limit", body = ErrorBody),
        (status = 422, description = "Unknown endpoint, or no endpoint takes the event type", body = ErrorBody),
        (status = 429, description = "The tenant's backlog is at its limit; see Retry-After", body = ErrorBody),
        (status = 503, description = "Redis is slow or down; retry", body = ErrorBody),
    ),
    security(("api_key" = [])))]
async fn post_event(
    State(ingest): State<Ingest>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<EventAccepted>), ApiError> {
    let who = ingest.authenticate(&headers)?;
    let b = body(b, ingest.inner.config.max_body_bytes)?;
    let ev: EventIn = parse(&b)?;
    if !who.may_act_for(&ev.tenant) {
        return Err(ApiError::forbidden(&who, &ev.tenant, Some("tenant".into())));
    }
    let envs = ingest.envelopes(ev, b.len(), "").await?;
    let tenant = envs[0].tenant.clone();
    let limit = ingest.inner.config.backlog.for_tenant(&tenant);
    let results = ingest
        .redis(ingest.inner.producer.send_batch(&envs, |_| limit))
        .await?;
    let mut accepted = Vec::new();
    let mut queue = String::new();
    for (env, r) in envs.iter().zip(results) {
        let (q, outcome) = r.map_err(|e| match e {
            StoreError::Invalid(e) => ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason),
            e => ApiError::unavailable(format!("redis: {e}")),
        })?;
        if let EnqueueOutcome::Full { depth } = outcome {
            ingest.count("backlog_full", envs.len() as u64);
            let limit = limit.unwrap_or(0);
            let after = ingest.retry_after(q, &tenant, depth, limit).await;
            return Err(ApiError::backlog_full(&tenant, depth, limit, after));
        }
        queue = q.to_string();
        ingest.count(status_name(&outcome), 1);
        accepted.push(Accepted {
            id: env.id.clone(),
            endpoint: env.endpoint_name().to_string(),
            queue: q.to_string(),
            status: status_name(&outcome).into(),
        });
    }
    let id = if envs.len() == 1 {
        envs[0].id.clone()
    } else {
        envs[0]
            .id
            .rsplit_once('.')
            .map(|(id, _)| id.to_string())
            .unwrap_or_default()
    };
    Ok((
        StatusCode::ACCEPTED,
        Json(EventAccepted {
            id,
            queue,
            envelopes: accepted,
        }),
    ))
}

/// Post many events: a JSON array, or NDJSON (`Content-Type:
/// application/x-ndjson`, one event per line). One bad item does not sink
/// the batch: each gets its own result.
#[utoipa::path(post, path = "/v1/events:batch", request_body(content = Vec<EventIn>, description = "JSON array, or NDJSON with Content-Type application/x-ndjson"),
    responses(
        (status = 200, description = "One result per item", body = BatchResult),
        (status = 400, description = "The body is not a JSON array or NDJSON", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 413, description = "Body or item count over the limit", body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("api_key" = [])))]
async fn post_batch(
    State(ingest): State<Ingest>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<BatchResult>, ApiError> {
    let who = ingest.authenticate(&headers)?;
    let b = body(b, ingest.inner.config.max_body_bytes)?;
    let ndjson = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-ndjson"));
    // Items parse one by one, so one bad item is its own 400.
    let raw: Vec<(usize, Result<EventIn, ApiError>)> = if ndjson {
        b.split(|c| *c == b'\n')
            .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
            .map(|l| (l.len(), parse(l)))
            .collect()
    } else {
        let items: Vec<Box<serde_json::value::RawValue>> = parse(&b).map_err(|mut e| {
            if e.body.code == "invalid_field" {
                e.body.message =
                    format!("body: must be a JSON array of events ({})", e.body.message);
            }
            e
        })?;
        items
            .iter()
            .map(|v| (v.get().len(), parse(v.get().as_bytes())))
            .collect()
    };
    let max = ingest.inner.config.max_batch_items;
    if raw.len() > max {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            Some("body".into()),
            format!("body: {} events; a batch takes at most {max}", raw.len()),
        ));
    }
    let mut items: Vec<ItemResult> = Vec::with_capacity(raw.len());
    let mut envs: Vec<Envelope> = Vec::new();
    let mut owner: Vec<usize> = Vec::new();
    for (i, (len, r)) in raw.into_iter().enumerate() {
        let at = format!("items[{i}]");
        let res = match r {
            Err(mut e) => {
                if let Some(f) = &e.body.field {
                    let f = format!("{at}.{f}");
                    e.body.message = e.body.message.replacen(&f[at.len() + 1..], &f, 1);
                    e.body.field = Some(f);
                }
                Err(e)
            }
            Ok(ev) if !who.may_act_for(&ev.tenant) => Err(ApiError::forbidden(
                &who,
                &ev.tenant,
                Some(format!("{at}.tenant")),
            )),
            Ok(ev) => ingest.envelopes(ev, len, &at).await,
        };
        items.push(ItemResult {
            index: i,
            status: 202,
            envelopes: vec![],
            error: None,
            retry_after: None,
        });
        match res {
            Ok(list) => {
                for e in list {
                    owner.push(i);
                    envs.push(e);
                }
            }
            Err(e) => {
                if e.status == StatusCode::SERVICE_UNAVAILABLE {
                    return Err(e);
                }
                ingest.count("invalid", 1);
                items[i].status = e.status.as_u16();
                items[i].error = Some(e.body);
            }
        }
    }
    let backlog = ingest.inner.config.backlog.clone();
    let results = ingest
        .redis(
            ingest
                .inner
                .producer
                .send_batch(&envs, |t| backlog.for_tenant(t)),
        )
        .await?;
    let mut retry: HashMap<String, u64> = HashMap::new();
    for ((env, r), i) in envs.iter().zip(results).zip(owner) {
        let item = &mut items[i];
        match r {
            Ok((q, EnqueueOutcome::Full { depth })) => {
                ingest.count("backlog_full", 1);
                let limit = backlog.for_tenant(&env.tenant).unwrap_or(0);
                let after = match retry.get(&env.tenant) {
                    Some(s) => *s,
                    None => {
                        let s = ingest.retry_after(q, &env.tenant, depth, limit).await;
                        retry.insert(env.tenant.clone(), s);
                        s
                    }
                };
                let e = ApiError::backlog_full(&env.tenant, depth, limit, after);
                item.status = 429;
                item.error = Some(e.body);
                item.retry_after = Some(after);
            }
            Ok((q, outcome)) => {
                ingest.count(status_name(&outcome), 1);
                item.envelopes.push(Accepted {
                    id: env.id.clone(),
                    endpoint: env.endpoint_name().to_string(),
                    queue: q.to_string(),
                    status: status_name(&outcome).into(),
                });
            }
            Err(StoreError::Invalid(e)) => {
                item.status = 400;
                item.error = Some(
                    ApiError::field(
                        StatusCode::BAD_REQUEST,
                        &format!("items[{i}].{}", e.field),
                        e.reason,
                    )
                    .body,
                );
            }
            Err(e) => {
                item.status = 503;
                item.error = Some(ApiError::unavailable(format!("redis: {e}")).body);
            }
        }
    }
    let accepted = items.iter().filter(|i| i.status == 202).count();
    Ok(Json(BatchResult {
        accepted,
        rejected: items.len() - accepted,
        items,
    }))
}

/// Create or replace an endpoint.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/endpoints/{endpoint}", request_body = EndpointIn,
    params(("tenant" = String, Path), ("endpoint" = String, Path)),
    responses((status = 200, description = "Stored; `secret` shows the signing secret once", body = EndpointOut),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn put_endpoint(
    State(ingest): State<Ingest>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<EndpointOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    crate::envelope::validate_tenant(&tenant)
        .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "tenant", e.reason))?;
    validate_endpoint_name(&name)?;
    let b = body(b, ingest.inner.config.max_body_bytes)?;
    let spec: EndpointIn = parse(&b)?;
    let secret = spec
        .secret
        .clone()
        .unwrap_or_else(crate::signing::Secret::generate);
    let endpoint = Endpoint {
        url: spec.url,
        secrets: vec![secret.clone()],
        enabled: spec.enabled,
        event_types: spec.event_types,
    };
    endpoint.validate().map_err(|e| {
        let field = if e.field == "secrets" {
            "secret"
        } else {
            e.field
        };
        ApiError::field(StatusCode::BAD_REQUEST, field, e.reason)
    })?;
    ingest
        .redis(ingest.store().put_endpoint(&tenant, &name, &endpoint))
        .await?;
    ingest.cache().remove(&tenant);
    Ok(Json(EndpointOut::new(&name, &endpoint, Some(secret))))
}

/// Read an endpoint (its secret is not shown).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/endpoints/{endpoint}",
    params(("tenant" = String, Path), ("endpoint" = String, Path)),
    responses((status = 200, body = EndpointOut), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn get_endpoint(
    State(ingest): State<Ingest>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<EndpointOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    match ingest
        .redis(ingest.store().endpoint(&tenant, &name))
        .await?
    {
        Some(e) => Ok(Json(EndpointOut::new(&name, &e, None))),
        None => Err(not_found(&tenant, &name)),
    }
}

/// List a tenant's endpoints.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/endpoints",
    params(("tenant" = String, Path)),
    responses((status = 200, body = Vec<EndpointOut>), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn list_endpoints(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Vec<EndpointOut>>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let list = ingest.redis(ingest.store().endpoints(&tenant)).await?;
    Ok(Json(
        list.iter()
            .map(|(n, e)| EndpointOut::new(n, e, None))
            .collect(),
    ))
}

/// Delete an endpoint.
#[utoipa::path(delete, path = "/v1/tenants/{tenant}/endpoints/{endpoint}",
    params(("tenant" = String, Path), ("endpoint" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn delete_endpoint(
    State(ingest): State<Ingest>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let existed = ingest
        .redis(ingest.store().delete_endpoint(&tenant, &name))
        .await?;
    ingest.cache().remove(&tenant);
    if existed {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_found(&tenant, &name))
    }
}

fn not_found(tenant: &str, name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        Some("endpoint".into()),
        format!("tenant {tenant:?} has no endpoint {name:?}"),
    )
}

fn validate_endpoint_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            "endpoint",
            format!("{name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"),
        ))
    }
}

/// The queues a tenant's dead letters may be in: where it is routed now,
/// and its hash shard if that differs (after a move back, or a pin).
async fn tenant_queues(ingest: &Ingest, tenant: &str) -> Result<Vec<QueueId>, ApiError> {
    let table = ingest.redis(ingest.store().routing()).await?;
    if !table.present() {
        return Err(ApiError::unavailable(
            StoreError::RoutingMissing(ingest.store().set().clone()).to_string(),
        ));
    }
    let now = table.route(tenant);
    let shard = crate::routing::hash_shard(tenant, table.shards);
    Ok(if now == shard {
        vec![now]
    } else {
        vec![now, shard]
    })
}

/// List a tenant's dead letters, newest last.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/dead-letters",
    params(("tenant" = String, Path), DeadQuery),
    responses((status = 200, body = Vec<DeadLetterOut>), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn list_dead(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Query(query): Query<DeadQuery>,
    headers: HeaderMap,
) -> Result<Json<Vec<DeadLetterOut>>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let limit = query.limit.unwrap_or(100).clamp(1, 10_000);
    let mut out = Vec::new();
    for q in tenant_queues(&ingest, &tenant).await? {
        for d in ingest.redis(ingest.store().dead_letters(q, limit)).await? {
            if d.tenant == tenant {
                out.push(DeadLetterOut {
                    id: d.id,
                    queue: q.to_string(),
                    attempts: d.attempts,
                    cause: d.cause,
                    at: d.at,
                    envelope: d.envelope,
                });
            }
        }
    }
    out.sort_by_key(|d| d.at);
    Ok(Json(out))
}

/// Put dead letters back on the tenant's lane, by id or all.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/dead-letters:replay", request_body = ReplayIn,
    params(("tenant" = String, Path)),
    responses((status = 200, body = ReplayOut), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn replay_dead(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<ReplayOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let b = body(b, ingest.inner.config.max_body_bytes)?;
    let req: ReplayIn = if b.iter().all(u8::is_ascii_whitespace) {
        ReplayIn::default()
    } else {
        parse(&b)?
    };
    let mut replayed = 0;
    for q in tenant_queues(&ingest, &tenant).await? {
        // A tenant that moved away from q answers MOVED; its letters there
        // stay until it is routed back.
        if let Ok(n) = ingest
            .redis(ingest.store().replay_dead(q, &tenant, &req.ids, 10_000))
            .await?
        {
            replayed += n;
        }
    }
    Ok(Json(ReplayOut { replayed }))
}

/// A tenant's depth, wait, and share of its queue.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/stats",
    params(("tenant" = String, Path), StatsQuery),
    responses((status = 200, body = StatsOut), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn stats(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Query(query): Query<StatsQuery>,
    headers: HeaderMap,
) -> Result<Json<StatsOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let window = Duration::from_secs(query.window.unwrap_or(60).clamp(10, 7200));
    let q = ingest.redis(ingest.inner.producer.route(&tenant)).await?;
    let a = ingest
        .redis(ingest.store().tenant_activity(q, &tenant, window))
        .await?;
    Ok(Json(StatsOut {
        tenant,
        queue: q.to_string(),
        depth: a.state.depth,
        queued: a.state.queued,
        in_flight: a.state.in_flight,
        delayed: a.state.delayed,
        held: a.state.held,
        paused: a.state.paused,
        delivered: a.delivered,
        failed: a.failed,
        oldest_wait_ms: a.oldest_wait().map(|d| d.as_millis() as u64),
        capacity_share: a.capacity_share(),
        drain_rate: a.drain_rate(),
        window_s: window.as_secs(),
    }))
}

#[derive(OpenApi)]
#[openapi(
    info(title = "lanekeeper ingest", description = "Post webhooks for delivery, fairly across tenants."),
    paths(post_event, post_batch, put_endpoint, get_endpoint, list_endpoints, delete_endpoint, list_dead, replay_dead, stats),
    modifiers(&SecurityAddon)
)]
pub struct ApiDoc;

struct SecurityAddon;

impl utoipa::Modify for SecurityAddon {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                "api_key",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
    }
}

/// The routes the API serves, as `(method, path)`; the OpenAPI test checks
/// that the document lists exactly these.
pub const ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/events"),
    ("post", "/v1/events:batch"),
    ("get", "/v1/tenants/{tenant}/endpoints"),
    ("put", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
    ("get", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
    ("delete", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
    ("get", "/v1/tenants/{tenant}/dead-letters"),
    ("post", "/v1/tenants/{tenant}/dead-letters:replay"),
    ("get", "/v1/tenants/{tenant}/stats"),
];

/// The API, with `/metrics`, `/healthz` and `/readyz` (ready while Redis answers).
pub fn router(ingest: Ingest) -> Router {
    let metrics = ingest.inner.metrics.clone();
    let body_limit = ingest.inner.config.max_body_bytes;
    let api = Router::new()
        .route("/v1/events", post(post_event))
        .route("/v1/events:batch", post(post_batch))
        .route("/v1/tenants/{tenant}/endpoints", get(list_endpoints))
        .route(
            "/v1/tenants/{tenant}/endpoints/{endpoint}",
            put(put_endpoint).get(get_endpoint).delete(delete_endpoint),
        )
        .route("/v1/tenants/{tenant}/dead-letters", get(list_dead))
        .route(
            "/v1/tenants/{tenant}/dead-letters:replay",
            post(replay_dead),
        )
        .route("/v1/tenants/{tenant}/stats", get(stats))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            metrics.clone(),
            record,
        ));
    Router::new()
        .merge(api)
        .route(
            "/v1/openapi.json",
            get(|| async { Json(ApiDoc::openapi()) }),
        )
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        crate::telemetry::Encode::encode(&m),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(ingest)
}

/// How often `/readyz` reads the Redis eviction policy again.
const EVICTION_CHECK: Duration = Duration::from_secs(10);

/// Ready while Redis answers and keeps every key: under an evicting
/// `maxmemory-policy` an accepted envelope (or its idempotency record) may
/// be dropped, so this instance takes no traffic until the policy is fixed.
async fn ready(State(ingest): State<Ingest>) -> Result<&'static str, ApiError> {
    ingest.redis(ingest.store().ping()).await?;
    let cached = ingest
        .inner
        .eviction
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .filter(|(at, _)| at.elapsed() < EVICTION_CHECK);
    let problem = match cached {
        Some((_, problem)) => problem,
        None => {
            // A Redis that cannot tell (neither CONFIG GET nor INFO) is not
            // held against readiness: PING answered.
            let problem = match ingest.redis(ingest.store().redis_settings()).await {
                Ok(all) => all.iter().find_map(|s| s.eviction_problem()),
                Err(_) => None,
            };
            *ingest
                .inner
                .eviction
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), problem.clone()));
            problem
        }
    };
    match problem {
        Some(p) => Err(ApiError::unavailable(format!("not ready: {p}"))),
        None => Ok("ok"),
    }
}

/// Count every API request by route template and status, and time it.
async fn record(
    State(metrics): State<IngestMetrics>,
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = matched
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().as_str().to_lowercase();
    let started = Instant::now();
    let res = next.run(req).await;
    let route = format!("{method} {route}");
    metrics
        .request_duration
        .get_or_create(&RouteLabels {
            route: route.clone(),
        })
        .observe(started.elapsed().as_secs_f64());
    metrics
        .requests
        .get_or_create(&RequestLabels {
            route,
            code: res.status().as_u16().to_string(),
        })
        .inc();
    res
}

/// Serve the API on `addr` until `shutdown` resolves; in-flight requests
/// finish first. Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    ingest: Ingest,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(ingest);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_lists_exactly_the_routes_served() {
        let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let mut listed: Vec<(String, String)> = doc["paths"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(path, ops)| {
                ops.as_object()
                    .unwrap()
                    .keys()
                    .map(move |m| (m.clone(), path.clone()))
            })
            .collect();
        listed.sort();
        let mut want: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        want.sort();
        assert_eq!(listed, want);
    }

    #[test]
    fn unknown_and_invalid_fields_are_named() {
        let e = parse::<EventIn>(br#"{"tenant":"a","payload":{},"colour":1}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.body.message.contains("unknown field `colour`"), "{e:?}");
        let e = parse::<EventIn>(br#"{"tenant":5,"payload":{}}"#).unwrap_err();
        assert_eq!(e.body.field.as_deref(), Some("tenant"), "{e:?}");
        let e = parse::<EventIn>(br#"{"tenant":"a","payload":{}"#).unwrap_err();
        assert_eq!(e.body.code, "malformed_json", "{e:?}");
        let e = parse::<EventIn>(br#"{"payload":{}}"#).unwrap_err();
        assert!(e.body.message.contains("missing field `tenant`"), "{e:?}");
    }

    #[test]
    fn backlog_limits_take_overrides_first() {
        let mut l = BacklogLimits {
            default: Some(100),
            ..Default::default()
        };
        let (t, n) = BacklogLimits::parse_override("whale=5").unwrap();
        l.overrides.insert(t, n);
        assert_eq!(l.for_tenant("whale"), Some(5));
        assert_eq!(l.for_tenant("small"), Some(100));
        assert!(BacklogLimits::parse_override("whale").is_err());
        assert!(BacklogLimits::parse_override("whale=x").is_err());
    }
}
