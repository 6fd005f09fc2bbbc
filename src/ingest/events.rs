//! Posting events: one (`POST /v1/events`) or a batch (`POST /v1/events:batch`),
//! each event planned into its envelopes (fan-out included) and sent to Redis
//! in bounded slices.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;

use super::auth::Caller;
use super::config::SEND_SLICE_BYTES;
use super::error::ApiError;
use super::tenants::{check_endpoint_name, check_event_type};
use super::wire::{
    body, parse, Accepted, BatchResult, ErrorBody, EventAccepted, EventIn, ItemResult,
};
use super::Ingest;
use crate::envelope::{Envelope, MAX_ID_BYTES};
use crate::routing::QueueId;
use crate::store::{EnqueueOutcome, StoreError};

impl Ingest {
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
pub(super) fn compact_len(raw: &str) -> usize {
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

fn status_name(o: &EnqueueOutcome) -> &'static str {
    match o {
        EnqueueOutcome::Queued { .. } => "queued",
        EnqueueOutcome::Held { .. } => "held",
        EnqueueOutcome::Duplicate => "duplicate",
        EnqueueOutcome::Moved(_) => "moved",
        EnqueueOutcome::Full { .. } => "backlog_full",
        EnqueueOutcome::Stale { .. } => "stale",
        EnqueueOutcome::Shaped { .. } => "shaped",
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
        (status = 429, description = "The tenant's backlog is at its limit, or the tenant is shaped at ingest (code `shaped`); see Retry-After", body = ErrorBody),
        (status = 503, description = "Redis is slow or down; retry", body = ErrorBody),
    ),
    security(("api_key" = [])))]
#[tracing::instrument(name = "ingest_event", level = "debug", skip_all, fields(caller = %who.name))]
pub(super) async fn post_event(
    State(ingest): State<Ingest>,
    Caller(who): Caller,
    b: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<EventAccepted>), ApiError> {
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
        if let Ok((_, EnqueueOutcome::Shaped { retry_after })) = &s.result {
            ingest.shaped(&tenant, count as u64);
            return Err(ApiError::shaped(&tenant, *retry_after));
        }
        if let Ok((q, EnqueueOutcome::Full { depth })) = &s.result {
            ingest.count("backlog_full", count as u64);
            let limit = limit.unwrap_or(0);
            let after = ingest.retry_after(*q, &tenant, *depth, limit).await;
            return Err(ApiError::backlog_full(&tenant, *depth, limit, after));
        }
    }
    for s in sent {
        let (q, outcome) = s.result.map_err(ApiError::from)?;
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
        let tenants: Vec<&str> = envs.iter().map(|e| e.tenant.as_str()).collect();
        let results = match self.ingest.tier_updates(&tenants).await {
            Ok(tiers) => {
                self.ingest
                    .redis(self.ingest.inner.producer.send_batch(&envs, |t| {
                        crate::store::TenantTerms {
                            backlog_limit: backlog.for_tenant(t),
                            tier: tiers.get(t).cloned().unwrap_or_default(),
                        }
                    }))
                    .await
            }
            Err(e) => Err(e),
        };
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
pub(super) fn batch_items(b: &[u8], ndjson: bool, max: usize) -> Result<Vec<&[u8]>, ApiError> {
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
#[tracing::instrument(name = "ingest_batch", level = "debug", skip_all, fields(caller = %who.name))]
pub(super) async fn post_batch(
    State(ingest): State<Ingest>,
    Caller(who): Caller,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<BatchResult>, ApiError> {
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
            Ok((_, EnqueueOutcome::Shaped { retry_after })) => {
                ingest.shaped(&s.tenant, 1);
                let e = ApiError::shaped(&s.tenant, retry_after);
                item.status = 429;
                item.retry_after = e.retry_after;
                item.error = Some(e.body);
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
            Err(e) => {
                let e = ApiError::from_store(e, &format!("items[{i}]"));
                item.status = e.status.as_u16();
                item.error = Some(e.body);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_len_is_the_compact_encoding_without_escapes() {
        let raw = "{ \"a\" : [ 1 , 2 ] ,\n \"b c\" : \"x y\\\" z\" }";
        let v: serde_json::Value = serde_json::from_str(raw).unwrap();
        assert_eq!(compact_len(raw), serde_json::to_vec(&v).unwrap().len());
    }
}
