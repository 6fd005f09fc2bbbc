//! The tenant handlers under `/v1/tenants/{tenant}/`: endpoint definitions
//! (put, get, list, delete), dead letters (list, replay) and stats.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;

use super::auth::Tenant;
use super::config::{MAX_ENDPOINT_BODY_BYTES, MAX_EVENT_TYPE_BYTES};
use super::error::ApiError;
use super::wire::{
    body, parse, DeadLetterOut, DeadLettersOut, DeadQuery, EndpointIn, EndpointOut, ErrorBody,
    ReplayIn, ReplayOut, StatsOut, StatsQuery,
};
use super::Ingest;
use crate::endpoint::Endpoint;
use crate::routing::QueueId;
use crate::store::{StoreError, DEAD_LETTER_PAGE, REPLAY_PAGE};

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
pub(super) async fn put_endpoint(
    State(ingest): State<Ingest>,
    Path((_, name)): Path<(String, String)>,
    Tenant { name: tenant, .. }: Tenant,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<EndpointOut>, ApiError> {
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
    ingest.forget_endpoints(&tenant);
    Ok(Json(EndpointOut::new(&name, &endpoint, Some(secret))))
}

/// Read an endpoint (its secret is not shown).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/endpoints/{endpoint}",
    params(("tenant" = String, Path), ("endpoint" = String, Path)),
    responses((status = 200, body = EndpointOut), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn get_endpoint(
    State(ingest): State<Ingest>,
    Path((_, name)): Path<(String, String)>,
    Tenant { name: tenant, .. }: Tenant,
) -> Result<Json<EndpointOut>, ApiError> {
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
pub(super) async fn list_endpoints(
    State(ingest): State<Ingest>,
    Tenant { name: tenant, .. }: Tenant,
) -> Result<Json<Vec<EndpointOut>>, ApiError> {
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
pub(super) async fn delete_endpoint(
    State(ingest): State<Ingest>,
    Path((_, name)): Path<(String, String)>,
    Tenant { name: tenant, .. }: Tenant,
) -> Result<StatusCode, ApiError> {
    let existed = ingest
        .redis(ingest.store().delete_endpoint(&tenant, &name))
        .await?;
    ingest.forget_endpoints(&tenant);
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
pub(super) fn check_endpoint_name(name: &str) -> Result<(), String> {
    crate::endpoint::check_name(name)
}

/// What is wrong with an event type, if anything.
pub(super) fn check_event_type(t: &str) -> Result<(), String> {
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
        return Err(StoreError::RoutingMissing(ingest.store().set().clone()).into());
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
pub(super) async fn list_dead(
    State(ingest): State<Ingest>,
    Query(query): Query<DeadQuery>,
    Tenant { name: tenant, .. }: Tenant,
) -> Result<Json<DeadLettersOut>, ApiError> {
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
pub(super) async fn replay_dead(
    State(ingest): State<Ingest>,
    Tenant { name: tenant, .. }: Tenant,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<ReplayOut>, ApiError> {
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
pub(super) async fn stats(
    State(ingest): State<Ingest>,
    Query(query): Query<StatsQuery>,
    Tenant { name: tenant, .. }: Tenant,
) -> Result<Json<StatsOut>, ApiError> {
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
        user_paused: a.state.user_paused,
        delivered: a.delivered,
        failed: a.failed,
        oldest_wait_ms: a.oldest_wait().map(|d| d.as_millis() as u64),
        capacity_share: a.capacity_share(),
        drain_rate: a.drain_rate(),
        window_s: window.as_secs(),
    }))
}
