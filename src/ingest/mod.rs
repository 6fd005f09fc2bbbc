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
use crate::store::{EnqueueOutcome, Store, StoreError, DEAD_LETTER_PAGE, REPLAY_PAGE};
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

/// Ingest settings. The defaults bound what one request can make the process
/// hold (see docs/architecture.md, "Ingest under hostile input").
#[derive(Clone, Debug)]
pub struct Config {
    /// Largest payload of one event, in bytes (its JSON without insignificant
    /// whitespace).
    pub max_payload_bytes: usize,
    /// Largest request body of an event or a batch, in bytes.
    pub max_body_bytes: usize,
    /// Most events in one batch.
    pub max_batch_items: usize,
    pub backlog: BacklogLimits,
    /// How long a Redis call may take before the answer is 503.
    pub redis_timeout: Duration,
    /// How long routing tables and endpoint lists are cached.
    pub cache_ttl: Duration,
    /// Limits on endpoint definitions.
    pub endpoints: EndpointLimits,
    /// Time a client has to send a request's headers (and, on a kept-alive
    /// connection, the next request's) before the connection is closed.
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's whole body; past it the answer
    /// is 408.
    pub body_read_timeout: Duration,
    /// Most connections open at once; past it, new connections wait in the
    /// listen backlog until one closes.
    pub max_connections: usize,
}

/// Limits on a tenant's endpoint definitions, each refusal a 400 naming the
/// field and the limit.
#[derive(Clone, Debug)]
pub struct EndpointLimits {
    /// Endpoints one tenant may have (so also the widest fan-out of one event).
    pub per_tenant: usize,
    /// Longest endpoint URL, in bytes.
    pub url_bytes: usize,
    /// Most entries in an endpoint's `eventTypes`.
    pub event_types: usize,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        Self {
            per_tenant: 16,
            url_bytes: 2048,
            event_types: 64,
        }
    }
}

/// Longest event type, in bytes (an event's `eventType`, an endpoint's
/// `eventTypes` entries).
pub const MAX_EVENT_TYPE_BYTES: usize = 128;
/// Largest body of an endpoint definition (PUT), in bytes.
pub const MAX_ENDPOINT_BODY_BYTES: usize = 64 * 1024;
/// Longest error message, in bytes: messages quote what the client sent
/// (field names, tenant ids, endpoint names), and a client sends a lot.
const MAX_MESSAGE_BYTES: usize = 512;
/// A batch's envelopes go to Redis in slices of about this many payload
/// bytes (or [`crate::store::ENQUEUE_CHUNK`] envelopes), so that only one
/// slice's payloads are held as parsed JSON at a time.
const SEND_SLICE_BYTES: usize = 1024 * 1024;

impl Default for Config {
    fn default() -> Self {
        Self {
            max_payload_bytes: 256 * 1024,
            max_body_bytes: 16 * 1024 * 1024,
            max_batch_items: 10_000,
            backlog: BacklogLimits::default(),
            redis_timeout: Duration::from_secs(2),
            cache_ttl: Duration::from_secs(1),
            endpoints: EndpointLimits::default(),
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1024,
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
            Ok(Err(StoreError::Invalid(e))) => {
                Err(ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason))
            }
            Ok(Err(StoreError::InvalidEndpoint(e))) => {
                Err(ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason))
            }
            Ok(Err(e @ StoreError::InvalidCursor)) => Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                "cursor",
                e.to_string(),
            )),
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
        crate::envelope::validate_tenant(tenant)
            .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "tenant", e.reason))?;
        Ok(who)
    }

    /// The envelopes one event becomes: one for the endpoint named (or
    /// `default`), or, for an event type without an endpoint, one per enabled
    /// endpoint of the tenant whose filter takes the type. The envelopes come
    /// back with a `null` payload; [`Planned::materialize`] fills it in when
    /// it is its turn to be sent, so that a fan-out does not hold one parsed
    /// copy of the payload per endpoint at once.
    async fn plan(&self, ev: EventIn, field: &str) -> Result<Planned, ApiError> {
        let f = |name: &str| {
            if field.is_empty() {
                name.to_string()
            } else {
                format!("{field}.{name}")
            }
        };
        crate::envelope::validate_tenant(&ev.tenant)
            .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, &f("tenant"), e.reason))?;
        let max = self.inner.config.max_payload_bytes;
        if ev.payload.get().len() > max {
            let size = compact_len(ev.payload.get());
            if size > max {
                return Err(ApiError::field(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &f("payload"),
                    format!("is {size} bytes; the limit is {max}"),
                ));
            }
        }
        if let Some(name) = &ev.endpoint {
            check_endpoint_name(name)
                .map_err(|r| ApiError::field(StatusCode::BAD_REQUEST, &f("endpoint"), r))?;
        }
        if let Some(t) = &ev.event_type {
            check_event_type(t)
                .map_err(|r| ApiError::field(StatusCode::BAD_REQUEST, &f("eventType"), r))?;
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
                let limit = self.inner.config.endpoints.per_tenant;
                if names.len() > limit {
                    return Err(ApiError::field(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &f("eventType"),
                        format!(
                            "fans out to {} endpoints; the limit is {limit} endpoints per tenant",
                            names.len()
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
        for endpoint in targets {
            out.push(Envelope {
                id: if fan_out {
                    format!("{id}.{endpoint}")
                } else {
                    id.clone()
                },
                tenant: ev.tenant.clone(),
                endpoint: Some(endpoint),
                event_type: ev.event_type.clone(),
                payload: serde_json::Value::Null,
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
        Ok(Planned {
            envelopes: out,
            payload: ev.payload,
        })
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
    /// The tenant whose webhook this is: `^[A-Za-z0-9][A-Za-z0-9._:-]*$`, at
    /// most 128 bytes.
    #[schema(
        pattern = "^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        max_length = 128,
        min_length = 1
    )]
    pub tenant: String,
    /// The tenant's endpoint, by name. Without it, an `eventType` fans out to
    /// every enabled endpoint that takes the type; with neither, the endpoint
    /// named `default` gets it.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Event type, e.g. `user.password_reset`.
    #[serde(default)]
    pub event_type: Option<String>,
    /// The webhook body (kept as posted until it is sent, so that a large
    /// payload is never held as a parsed tree longer than its turn).
    #[schema(value_type = Object)]
    pub payload: Box<serde_json::value::RawValue>,
    /// Idempotency key: the same id twice is stored once. Generated when absent.
    #[serde(default)]
    pub id: Option<String>,
}

/// The envelopes of one event, payload still as posted.
struct Planned {
    envelopes: Vec<Envelope>,
    payload: Box<serde_json::value::RawValue>,
}

impl Planned {
    /// The envelopes with their payload parsed, one at a time.
    fn materialize(self) -> impl Iterator<Item = (Envelope, usize)> {
        let Planned { envelopes, payload } = self;
        let len = payload.get().len();
        envelopes.into_iter().map(move |mut e| {
            // The raw text was parsed once already (as a RawValue), so this
            // cannot fail but for the nesting limit, which both parsers share.
            e.payload = serde_json::from_str(payload.get()).unwrap_or(serde_json::Value::Null);
            (e, len)
        })
    }
}

/// Length of the JSON text `raw` without insignificant whitespace (what a
/// compact re-encoding would be, up to string escapes), without parsing it.
fn compact_len(raw: &str) -> usize {
    let (mut n, mut in_string, mut escaped) = (0, false, false);
    for b in raw.bytes() {
        if in_string {
            n += 1;
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            n += 1;
            in_string = b == b'"';
        }
    }
    n
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

/// One page of a tenant's dead letters, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLettersOut {
    pub items: Vec<DeadLetterOut>,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
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
    /// Dead letters per page (default 100, at most 1000).
    pub limit: Option<usize>,
    /// Where to continue: the `nextCursor` of the page before (absent: the oldest).
    pub cursor: Option<String>,
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
                field: field.map(|f| clip(f, MAX_MESSAGE_BYTES)),
                message: clip(message.into(), MAX_MESSAGE_BYTES),
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

/// `s` cut to at most `max` bytes (at a character boundary), marked when cut.
fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
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
    drop(b);
    if !who.may_act_for(&ev.tenant) {
        return Err(ApiError::forbidden(&who, &ev.tenant, Some("tenant".into())));
    }
    let planned = ingest.plan(ev, "").await?;
    let tenant = planned.envelopes[0].tenant.clone();
    let count = planned.envelopes.len();
    let limit = ingest.inner.config.backlog.for_tenant(&tenant);
    let mut slices = Slices::new(&ingest);
    let mut sent = Vec::with_capacity(count);
    for (env, len) in planned.materialize() {
        sent.extend(slices.push(0, env, len).await?);
    }
    sent.extend(slices.flush().await?);
    let mut accepted = Vec::new();
    let mut queue = String::new();
    for s in &sent {
        if let Ok((q, EnqueueOutcome::Full { depth })) = &s.result {
            ingest.count("backlog_full", count as u64);
            let limit = limit.unwrap_or(0);
            let after = ingest.retry_after(*q, &tenant, *depth, limit).await;
            return Err(ApiError::backlog_full(&tenant, *depth, limit, after));
        }
    }
    for s in sent {
        let (q, outcome) = s.result.map_err(|e| match e {
            StoreError::Invalid(e) => ApiError::field(StatusCode::BAD_REQUEST, e.field, e.reason),
            e => ApiError::unavailable(format!("redis: {e}")),
        })?;
        queue = q.to_string();
        ingest.count(status_name(&outcome), 1);
        accepted.push(Accepted {
            id: s.id,
            endpoint: s.endpoint,
            queue: q.to_string(),
            status: status_name(&outcome).into(),
        });
    }
    let id = if accepted.len() == 1 {
        accepted[0].id.clone()
    } else {
        accepted[0]
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

/// One envelope's answer from Redis, its payload already dropped.
struct Sent {
    /// The batch item it came from.
    owner: usize,
    id: String,
    endpoint: String,
    tenant: String,
    result: Result<(QueueId, EnqueueOutcome), StoreError>,
}

/// Envelopes on their way to Redis in slices of about [`SEND_SLICE_BYTES`]
/// payload bytes: a request's parsed payloads are dropped slice by slice, so
/// the memory one request holds is its body plus one slice, however many
/// events or endpoints it has.
struct Slices<'a> {
    ingest: &'a Ingest,
    pending: Vec<Envelope>,
    owners: Vec<usize>,
    bytes: usize,
    /// Whether any slice went to Redis yet.
    sent_any: bool,
}

impl<'a> Slices<'a> {
    fn new(ingest: &'a Ingest) -> Self {
        Self {
            ingest,
            pending: Vec::new(),
            owners: Vec::new(),
            bytes: 0,
            sent_any: false,
        }
    }

    /// Add `env` (of item `owner`, `len` payload bytes); sends the slice
    /// before it first when `env` would make the slice too large.
    async fn push(
        &mut self,
        owner: usize,
        env: Envelope,
        len: usize,
    ) -> Result<Vec<Sent>, ApiError> {
        let full = !self.pending.is_empty()
            && (self.bytes + len > SEND_SLICE_BYTES
                || self.pending.len() >= crate::store::ENQUEUE_CHUNK);
        let done = if full {
            self.flush().await?
        } else {
            Vec::new()
        };
        self.bytes += len;
        self.pending.push(env);
        self.owners.push(owner);
        Ok(done)
    }

    /// Send what is pending.
    async fn flush(&mut self) -> Result<Vec<Sent>, ApiError> {
        if self.pending.is_empty() {
            return Ok(Vec::new());
        }
        let envs = std::mem::take(&mut self.pending);
        let owners = std::mem::take(&mut self.owners);
        self.bytes = 0;
        let backlog = &self.ingest.inner.config.backlog;
        let results = self
            .ingest
            .redis(
                self.ingest
                    .inner
                    .producer
                    .send_batch(&envs, |t| backlog.for_tenant(t)),
            )
            .await;
        let results = match results {
            Ok(r) => r,
            Err(e) => {
                // Put them back, so that their items can be answered.
                self.pending = envs;
                self.owners = owners;
                return Err(e);
            }
        };
        self.sent_any = true;
        Ok(envs
            .into_iter()
            .zip(owners)
            .zip(results)
            .map(|((e, owner), result)| Sent {
                owner,
                endpoint: e.endpoint_name().to_string(),
                id: e.id,
                tenant: e.tenant,
                result,
            })
            .collect())
    }
}

/// The items of a batch body, as slices of it, without parsing them: a JSON
/// array's elements, or NDJSON's non-blank lines. Stops at the first item
/// past `max` (413), so that an oversized batch costs no more than a full one.
fn batch_items(b: &[u8], ndjson: bool, max: usize) -> Result<Vec<&[u8]>, ApiError> {
    let too_many = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            Some("body".into()),
            format!("body: more than {max} events; a batch takes at most {max}"),
        )
    };
    if ndjson {
        let mut out = Vec::new();
        for line in b.split(|c| *c == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if out.len() == max {
                return Err(too_many());
            }
            out.push(line);
        }
        return Ok(out);
    }
    struct Bounded(usize);
    const TOO_MANY: &str = "lanekeeper: too many batch items";
    impl<'de> serde::de::DeserializeSeed<'de> for Bounded {
        type Value = Vec<&'de serde_json::value::RawValue>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
    }
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<&'de serde_json::value::RawValue>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON array of events")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(item) = seq.next_element::<&'de serde_json::value::RawValue>()? {
                if out.len() == self.0 {
                    return Err(serde::de::Error::custom(TOO_MANY));
                }
                out.push(item);
            }
            Ok(out)
        }
    }
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(b);
    let items = Bounded(max)
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| {
            if e.to_string().starts_with(TOO_MANY) {
                too_many()
            } else if e.is_syntax() || e.is_eof() {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "malformed_json",
                    None,
                    format!("malformed JSON: {e}"),
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_field",
                    Some("body".into()),
                    format!("body: must be a JSON array of events ({e})"),
                )
            }
        })?;
    Ok(items.into_iter().map(|v| v.get().as_bytes()).collect())
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
    // Only the items' places are found first (and their count checked);
    // each is parsed in its turn, so one bad item is its own 400.
    let raw = batch_items(&b, ndjson, ingest.inner.config.max_batch_items)?;
    let mut items: Vec<ItemResult> = (0..raw.len())
        .map(|index| ItemResult {
            index,
            status: 202,
            envelopes: vec![],
            error: None,
            retry_after: None,
        })
        .collect();
    let mut slices = Slices::new(&ingest);
    let mut retry: HashMap<String, u64> = HashMap::new();
    let mut outage: Option<(usize, ApiError)> = None;
    'items: for (i, line) in raw.iter().enumerate() {
        let at = format!("items[{i}]");
        let planned = match parse::<EventIn>(line) {
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
            Ok(ev) => ingest.plan(ev, &at).await,
        };
        match planned {
            Ok(planned) => {
                for (env, len) in planned.materialize() {
                    match slices.push(i, env, len).await {
                        Ok(done) => settle(&ingest, &mut items, &mut retry, done).await,
                        Err(e) => {
                            outage = Some((i, e));
                            break 'items;
                        }
                    }
                }
            }
            Err(e) if e.status == StatusCode::SERVICE_UNAVAILABLE => {
                outage = Some((i, e));
                break;
            }
            Err(e) => {
                ingest.count("invalid", 1);
                items[i].status = e.status.as_u16();
                items[i].error = Some(e.body);
            }
        }
    }
    if outage.is_none() {
        match slices.flush().await {
            Ok(done) => settle(&ingest, &mut items, &mut retry, done).await,
            Err(e) => outage = Some((raw.len(), e)),
        }
    }
    if let Some((from, e)) = outage {
        // Nothing stored yet: the whole batch is a 503, to retry as it is.
        if !slices.sent_any {
            return Err(e);
        }
        // Some items were stored: answer each of the others with the 503
        // it would have had alone.
        let unsent: std::collections::BTreeSet<usize> = slices
            .owners
            .iter()
            .copied()
            .chain(from..raw.len())
            .collect();
        for i in unsent {
            items[i].status = 503;
            items[i].error = Some(e.body.clone());
        }
    }
    let accepted = items.iter().filter(|i| i.status == 202).count();
    Ok(Json(BatchResult {
        accepted,
        rejected: items.len() - accepted,
        items,
    }))
}

/// Record Redis's answers in the batch items they belong to.
async fn settle(
    ingest: &Ingest,
    items: &mut [ItemResult],
    retry: &mut HashMap<String, u64>,
    done: Vec<Sent>,
) {
    let backlog = &ingest.inner.config.backlog;
    for s in done {
        let i = s.owner;
        let item = &mut items[i];
        match s.result {
            Ok((q, EnqueueOutcome::Full { depth })) => {
                ingest.count("backlog_full", 1);
                let limit = backlog.for_tenant(&s.tenant).unwrap_or(0);
                let after = match retry.get(&s.tenant) {
                    Some(after) => *after,
                    None => {
                        let after = ingest.retry_after(q, &s.tenant, depth, limit).await;
                        retry.insert(s.tenant.clone(), after);
                        after
                    }
                };
                let e = ApiError::backlog_full(&s.tenant, depth, limit, after);
                item.status = 429;
                item.error = Some(e.body);
                item.retry_after = Some(after);
            }
            Ok((q, outcome)) => {
                ingest.count(status_name(&outcome), 1);
                item.envelopes.push(Accepted {
                    id: s.id,
                    endpoint: s.endpoint,
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
}

/// Create or replace an endpoint.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/endpoints/{endpoint}", request_body = EndpointIn,
    params(("tenant" = String, Path), ("endpoint" = String, Path)),
    responses((status = 200, description = "Stored; `secret` shows the signing secret once", body = EndpointOut),
        (status = 400, description = "Malformed JSON, unknown or invalid field, or a field over its limit", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 408, description = "The body did not arrive in time", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 422, description = "The tenant has as many endpoints as it may have", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn put_endpoint(
    State(ingest): State<Ingest>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<EndpointOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    validate_endpoint_name(&name)?;
    let b = body(b, MAX_ENDPOINT_BODY_BYTES)?;
    let spec: EndpointIn = parse(&b)?;
    drop(b);
    let limits = &ingest.inner.config.endpoints;
    let too_long = |field: &str, len: usize, limit: usize, what: &str| {
        ApiError::field(
            StatusCode::BAD_REQUEST,
            field,
            format!("is {len} {what}; the limit is {limit}"),
        )
    };
    if spec.url.len() > limits.url_bytes {
        return Err(too_long("url", spec.url.len(), limits.url_bytes, "bytes"));
    }
    if spec.event_types.len() > limits.event_types {
        return Err(too_long(
            "eventTypes",
            spec.event_types.len(),
            limits.event_types,
            "entries",
        ));
    }
    for (i, t) in spec.event_types.iter().enumerate() {
        check_event_type(t).map_err(|r| {
            ApiError::field(StatusCode::BAD_REQUEST, &format!("eventTypes[{i}]"), r)
        })?;
    }
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
    // The count check and the write, one PUT at a time in this process.
    let _writing = ingest.inner.endpoint_writes.lock().await;
    let existing = ingest.redis(ingest.store().endpoints(&tenant)).await?;
    if !existing.contains_key(&name) && existing.len() >= limits.per_tenant {
        return Err(ApiError::field(
            StatusCode::UNPROCESSABLE_ENTITY,
            "endpoint",
            format!(
                "tenant {tenant:?} has {} endpoints; the limit is {} endpoints per tenant",
                existing.len(),
                limits.per_tenant
            ),
        ));
    }
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
    check_endpoint_name(name).map_err(|r| ApiError::field(StatusCode::BAD_REQUEST, "endpoint", r))
}

/// What is wrong with an endpoint name, if anything.
fn check_endpoint_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?}: use 1 to 64 letters, digits, '-', '_' or '.'",
            clip(name.to_string(), 80)
        ))
    }
}

/// What is wrong with an event type, if anything.
fn check_event_type(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("must not be empty".into());
    }
    if t.len() > MAX_EVENT_TYPE_BYTES {
        return Err(format!(
            "is {} bytes; the limit is {MAX_EVENT_TYPE_BYTES}",
            t.len()
        ));
    }
    if let Some(c) = t.chars().find(|c| c.is_control()) {
        return Err(format!("contains the control character {c:?}"));
    }
    Ok(())
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

/// List a tenant's dead letters, oldest first, a page at a time.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/dead-letters",
    params(("tenant" = String, Path), DeadQuery),
    responses((status = 200, body = DeadLettersOut), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn list_dead(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Query(query): Query<DeadQuery>,
    headers: HeaderMap,
) -> Result<Json<DeadLettersOut>, ApiError> {
    ingest.authorize(&headers, &tenant)?;
    let limit = query.limit.unwrap_or(100).clamp(1, DEAD_LETTER_PAGE);
    let queues = tenant_queues(&ingest, &tenant).await?;
    // A cursor is "<queue>@<position in that queue's letters>": the queues
    // are read one after the other.
    let (mut index, mut after) = (0, None);
    if let Some(c) = &query.cursor {
        let bad = || {
            ApiError::field(
                StatusCode::BAD_REQUEST,
                "cursor",
                "is not a cursor this listing gave (use nextCursor from the page before)",
            )
        };
        let (q, pos) = c.split_once('@').ok_or_else(bad)?;
        index = queues
            .iter()
            .position(|x| x.to_string() == q)
            .ok_or_else(bad)?;
        after = (pos != "-").then(|| pos.to_string());
    }
    let mut out = DeadLettersOut {
        items: Vec::new(),
        next_cursor: None,
    };
    while index < queues.len() && out.items.len() < limit {
        let q = queues[index];
        let page = ingest
            .redis(ingest.store().dead_letters(
                q,
                &tenant,
                after.as_deref(),
                limit - out.items.len(),
            ))
            .await?;
        for d in page.letters {
            out.items.push(DeadLetterOut {
                id: d.id,
                queue: q.to_string(),
                attempts: d.attempts,
                cause: d.cause,
                at: d.at,
                envelope: d.envelope,
            });
        }
        match page.next {
            Some(next) => {
                out.next_cursor = Some(format!("{q}@{next}"));
                break;
            }
            None if index + 1 < queues.len() => {
                index += 1;
                after = None;
                out.next_cursor = Some(format!("{}@-", queues[index]));
            }
            None => {
                out.next_cursor = None;
                index += 1;
            }
        }
    }
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
        // In pages, each bounded and under the Redis timeout of its own.
        let mut after: Option<String> = None;
        while let Ok(page) = ingest
            .redis(ingest.store().replay_dead_page(
                q,
                &tenant,
                after.as_deref(),
                REPLAY_PAGE,
                &req.ids,
            ))
            .await?
        {
            replayed += page.replayed;
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
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
    modifiers(&SecurityAddon, &CommonResponses)
)]
pub struct ApiDoc;

/// Answers every operation can give, added to each one's responses unless
/// it documents them itself: 400 (an invalid tenant in the path, a bad query),
/// 401, 503, and for operations with a body 408 and 413. So a client (and
/// schemathesis) can rely on the listed codes being all there are.
struct CommonResponses;

impl utoipa::Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let error = |description: &str| {
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(Ref::from_schema_name("ErrorBody")))
                            .build(),
                    )
                    .build(),
            )
        };
        for item in openapi.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                let with_body = op.request_body.is_some();
                let mut common = vec![
                    (
                        "400",
                        "Invalid input: a field, the tenant in the path, or the query",
                    ),
                    ("401", "Missing or unknown api key"),
                    ("503", "Redis is slow or down; retry"),
                ];
                if with_body {
                    common.push((
                        "408",
                        "The body did not arrive within the body read timeout",
                    ));
                    common.push(("413", "Body over the limit"));
                }
                for (code, description) in common {
                    op.responses
                        .responses
                        .entry(code.to_string())
                        .or_insert_with(|| error(description));
                }
            }
        }
    }
}

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
    let counted = metrics.clone();
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
            ingest.clone(),
            read_body,
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
        // Outermost, so that it sees unmatched paths too.
        .layer(axum::middleware::from_fn_with_state(counted, record))
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

/// The methods metrics name; any other is counted as `other`, so that no
/// client can grow the label set.
const METHODS: [&str; 7] = ["get", "post", "put", "delete", "patch", "head", "options"];

/// The `route` label of a request: a known method (else `other`) and the
/// matched route template (else `unmatched`): at most 8 x (routes + 1) values.
pub fn route_label(method: &axum::http::Method, matched: Option<&str>) -> String {
    let m = method.as_str();
    let method = METHODS
        .iter()
        .find(|k| k.eq_ignore_ascii_case(m))
        .copied()
        .unwrap_or("other");
    format!("{method} {}", matched.unwrap_or("unmatched"))
}

/// Count every API request by route template and status, and time it.
async fn record(
    State(metrics): State<IngestMetrics>,
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = route_label(req.method(), matched.as_ref().map(|m| m.as_str()));
    let started = Instant::now();
    let res = next.run(req).await;
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

/// Read and drop a refused request's body (at most 64 MiB, within
/// `timeout`, at most 10 s) while its answer goes out, then let the
/// connection close: a client still sending would otherwise meet a reset
/// before it reads the answer (a lingering close). Nothing of it is kept.
fn discard(body: axum::body::Body, timeout: Duration) {
    use http_body_util::BodyExt;
    tokio::spawn(async move {
        let mut body = http_body_util::Limited::new(body, 64 * 1024 * 1024);
        let _ = tokio::time::timeout(timeout.min(Duration::from_secs(10)), async {
            while let Some(Ok(_)) = body.frame().await {}
        })
        .await;
    });
}

/// Largest body of a dead-letter replay, in bytes (10,000 ids of the
/// longest kind fit).
pub const MAX_REPLAY_BODY_BYTES: usize = 2 * 1024 * 1024;

/// Authenticate, then read the request's body before the handler runs,
/// within the route's size limit and the body read timeout: a client
/// without a known key is refused before any of its body is read, and one
/// that sends its body a byte at a time gets 408 instead of holding the
/// request open.
async fn read_body(
    State(ingest): State<Ingest>,
    matched: Option<axum::extract::MatchedPath>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use http_body_util::BodyExt;
    let config = &ingest.inner.config;
    if let Err(e) = ingest.authenticate(req.headers()) {
        let mut r = e.into_response();
        let (parts, body) = req.into_parts();
        if parts.headers.contains_key(header::CONTENT_LENGTH)
            || parts.headers.contains_key(header::TRANSFER_ENCODING)
        {
            // Its body is not kept: the connection cannot carry another request.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            discard(body, config.body_read_timeout);
        }
        return r;
    }
    let limit = match matched.as_ref().map(|m| m.as_str()) {
        Some("/v1/tenants/{tenant}/endpoints/{endpoint}") => MAX_ENDPOINT_BODY_BYTES,
        Some("/v1/tenants/{tenant}/dead-letters:replay") => {
            MAX_REPLAY_BODY_BYTES.min(config.max_body_bytes)
        }
        _ => config.max_body_bytes,
    };
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        let mut r = ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            Some("body".into()),
            format!("body: larger than the limit of {limit} bytes"),
        )
        .into_response();
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        r
    };
    if declared.is_some_and(|n| n > limit as u64) {
        discard(body, config.body_read_timeout);
        return too_large();
    }
    let collect = http_body_util::Limited::new(body, limit).collect();
    let bytes = match tokio::time::timeout(config.body_read_timeout, collect).await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
        Ok(Err(e)) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                Some("body".into()),
                format!("body: could not be read: {e}"),
            )
            .into_response()
        }
        Err(_) => {
            let mut r = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                Some("body".into()),
                format!("body: not received within {:?}", config.body_read_timeout),
            )
            .into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// Serve the API on `addr` until `shutdown` resolves; in-flight requests
/// finish first. Returns the bound address and the server task.
///
/// HTTP/1.1 only, with the limits of [`Config`]: headers must arrive within
/// `header_read_timeout` (an idle kept-alive connection is closed after it
/// too), at most `max_connections` are open at once, and a connection's
/// buffered headers are capped at 64 KiB.
pub async fn serve(
    addr: SocketAddr,
    ingest: Ingest,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let config = ingest.inner.config.clone();
    let app = router(ingest);
    let task = tokio::spawn(accept_loop(listener, app, config, shutdown));
    Ok((bound, task))
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let slots = Arc::new(tokio::sync::Semaphore::new(config.max_connections.max(1)));
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    // Every connection task holds a clone; recv() returns None once all are gone.
    let (alive_tx, mut alive_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(64 * 1024);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait, then go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let mut closing = closing_rx.clone();
        let alive = alive_tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _alive = alive;
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = closing.wait_for(|c| *c) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drop(alive_tx);
    let _ = alive_rx.recv().await;
    Ok(())
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

    /// The request parsers over arbitrary bytes (and over mutations of valid
    /// bodies, to get past the first byte): they never panic, never return
    /// more than the item limit, and every error is a 4xx whose message is
    /// bounded. Bounded in time: LANEKEEPER_FUZZ_CASES cases (default 20,000; about 3 s).
    #[test]
    fn request_parsers_hold_up_under_raw_bytes() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config as PConfig, TestRunner};
        let cases = std::env::var("LANEKEEPER_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        let seeds: Vec<&[u8]> = vec![
            br#"{"tenant":"acme","payload":{"a":[1,2,{"b":null}]},"id":"x","eventType":"t"}"#,
            br#"[{"tenant":"a","payload":1},{"tenant":"b","payload":"x","endpoint":"e"}]"#,
            b"{\"tenant\":\"a\",\"payload\":{}}\n\n{\"tenant\":\"b\",\"payload\":[]}\n",
            br#"{"url":"https://x.example/h","eventTypes":["a","b"],"enabled":false}"#,
        ];
        let bytes = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            (
                proptest::sample::select(seeds),
                proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8)
            )
                .prop_map(|(seed, edits)| {
                    let mut b = seed.to_vec();
                    for (at, byte, op) in edits {
                        let i = at % (b.len() + 1);
                        match op {
                            0 => b.insert(i, byte),
                            1 if i < b.len() => b[i] = byte,
                            _ if i < b.len() => {
                                b.remove(i);
                            }
                            _ => {}
                        }
                    }
                    b
                }),
        ];
        let mut runner = TestRunner::new(PConfig {
            cases,
            failure_persistence: None,
            ..PConfig::default()
        });
        runner
            .run(&(bytes, 1usize..8, any::<bool>()), |(b, max, ndjson)| {
                let check = |e: &ApiError| {
                    prop_assert!(e.status.is_client_error(), "{e:?}");
                    prop_assert!(e.body.message.len() <= MAX_MESSAGE_BYTES, "{e:?}");
                    Ok(())
                };
                match batch_items(&b, ndjson, max) {
                    Ok(items) => {
                        prop_assert!(items.len() <= max);
                        for item in items {
                            if !ndjson {
                                prop_assert!(
                                    serde_json::from_slice::<serde::de::IgnoredAny>(item).is_ok()
                                );
                            }
                            if let Err(e) = parse::<EventIn>(item) {
                                check(&e)?;
                            }
                        }
                    }
                    Err(e) => check(&e)?,
                }
                match parse::<EventIn>(&b) {
                    Ok(ev) => {
                        let n = compact_len(ev.payload.get());
                        let v: serde_json::Value = serde_json::from_str(ev.payload.get()).unwrap();
                        // equal up to string escapes, which re-encoding may shorten
                        prop_assert!(n >= serde_json::to_vec(&v).unwrap().len());
                    }
                    Err(e) => check(&e)?,
                }
                if let Err(e) = parse::<EndpointIn>(&b) {
                    check(&e)?;
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn compact_len_is_the_compact_encoding_without_escapes() {
        let raw = "{ \"a\" : [ 1 , 2 ] ,\n \"b c\" : \"x y\\\" z\" }";
        let v: serde_json::Value = serde_json::from_str(raw).unwrap();
        assert_eq!(compact_len(raw), serde_json::to_vec(&v).unwrap().len());
    }

    #[test]
    fn route_labels_are_bounded() {
        use axum::http::Method;
        let odd = Method::from_bytes(b"M17571").unwrap();
        assert_eq!(route_label(&odd, Some("/v1/events")), "other /v1/events");
        assert_eq!(route_label(&Method::GET, None), "get unmatched");
        assert_eq!(
            route_label(&Method::POST, Some("/v1/events:batch")),
            "post /v1/events:batch"
        );
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
