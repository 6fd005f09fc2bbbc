//! Admin operations on one tenant under `/v1/admin/tenants/{tenant}`: pause,
//! resume, purge, replay, and show. Admin keys only. Each change is audited three ways: a
//! log line (target `lanekeeper::audit`: who, what, which tenant, outcome), the
//! counter `lanekeeper_ingest_admin_operations_total`, and an entry in the
//! set's audit trail in Redis, which `lanekeeper tenant show` and
//! `GET /v1/admin/tenants/{tenant}` list (the CLI writes the same trail).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

use super::auth::Admin;
use super::error::ApiError;
use super::wire::{
    body, parse, AdminReplayIn, AdminReplayOut, AuditOut, ErrorBody, PauseIn, PauseOut, PurgeIn,
    PurgeModeIn, PurgeOut, TenantOut,
};
use super::Ingest;
use crate::store::{PurgeMode, ReplayFilter, ReplayPlan};
use crate::telemetry::AdminOperationLabels;

/// How long one replay call works before it answers with a cursor.
pub const REPLAY_CALL_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a purge or a replay call may take in all (its Redis calls are
/// bounded steps, each within the store's own timeout).
const LONG_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The largest body of a pause or resume (a reason of 256 bytes, JSON).
const MAX_PAUSE_BODY_BYTES: usize = 4 << 10;

fn valid_tenant(tenant: &str) -> Result<(), ApiError> {
    crate::envelope::validate_tenant(tenant)
        .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "tenant", e.reason))
}

/// Pause or resume, audited.
async fn set_pause(
    ingest: Ingest,
    tenant: String,
    who: String,
    b: Result<Bytes, BytesRejection>,
    paused: bool,
) -> Result<Json<PauseOut>, ApiError> {
    valid_tenant(&tenant)?;
    let b = body(b, MAX_PAUSE_BODY_BYTES)?;
    let req: PauseIn = optional_json(&b)?;
    check_reason(&req.reason)?;
    let operation = if paused { "pause" } else { "resume" };
    let who = format!("key:{who}");
    let result = ingest
        .redis(
            ingest
                .store()
                .user_pause_audited(&tenant, paused, &who, req.reason.as_deref()),
        )
        .await;
    let done = Done {
        who: &who,
        operation,
        tenant: &tenant,
        reason: req.reason.as_deref(),
    };
    let o = done.record(&ingest, result, |o| {
        (
            if o.changed { "changed" } else { "unchanged" },
            o.queue.to_string(),
        )
    })?;
    Ok(Json(PauseOut {
        tenant,
        queue: o.queue.to_string(),
        paused: o.paused,
        changed: o.changed,
        depth: o.depth,
    }))
}

/// An admin operation that ran (the store recorded it in the audit trail).
struct Done<'a> {
    who: &'a str,
    operation: &'static str,
    tenant: &'a str,
    reason: Option<&'a str>,
}

impl Done<'_> {
    /// Count and log the operation's result: `outcome` labels it (`changed`,
    /// `unchanged`) and names its queue.
    fn record<T>(
        &self,
        ingest: &Ingest,
        result: Result<T, ApiError>,
        outcome: impl FnOnce(&T) -> (&'static str, String),
    ) -> Result<T, ApiError> {
        let (label, queue) = match &result {
            Ok(v) => outcome(v),
            Err(_) => ("failed", String::new()),
        };
        ingest
            .inner
            .metrics
            .admin_operations
            .get_or_create(&AdminOperationLabels {
                operation: self.operation.into(),
                outcome: label.into(),
            })
            .inc();
        let (who, operation, tenant) = (self.who, self.operation, self.tenant);
        match &result {
            Ok(_) => tracing::info!(target: "lanekeeper::audit", who, operation, tenant,
                outcome = label, queue, reason = self.reason.unwrap_or(""), "admin operation"),
            Err(e) => tracing::warn!(target: "lanekeeper::audit", who, operation, tenant,
                outcome = label, error = %e.body.message, "admin operation failed"),
        }
        result
    }
}

/// A request body that may be empty (then the defaults).
fn optional_json<T: serde::de::DeserializeOwned + Default>(b: &Bytes) -> Result<T, ApiError> {
    if b.iter().all(u8::is_ascii_whitespace) {
        Ok(T::default())
    } else {
        parse(b)
    }
}

fn check_reason(reason: &Option<String>) -> Result<(), ApiError> {
    match reason {
        Some(r) => crate::store::check_reason(r)
            .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "reason", e)),
        None => Ok(()),
    }
}

/// Pause a tenant's deliveries: leases skip it (deliveries in flight
/// finish) while ingest keeps accepting its events, within its backlog
/// limit. It stays paused when a lane or a reshard moves it.
#[utoipa::path(post, path = "/v1/admin/tenants/{tenant}/pause", request_body(content = PauseIn, description = "Optional: why (recorded in the audit trail)"),
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Paused (or already paused)", body = PauseOut),
        (status = 400, description = "Invalid tenant or reason", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn pause_tenant(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Admin(who): Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<PauseOut>, ApiError> {
    set_pause(ingest, tenant, who.name, b, true).await
}

/// Resume a tenant's deliveries, in its order.
#[utoipa::path(post, path = "/v1/admin/tenants/{tenant}/resume", request_body(content = PauseIn, description = "Optional: why (recorded in the audit trail)"),
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Resumed (or was not paused)", body = PauseOut),
        (status = 400, description = "Invalid tenant or reason", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn resume_tenant(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Admin(who): Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<PauseOut>, ApiError> {
    set_pause(ingest, tenant, who.name, b, false).await
}

/// Take a tenant's queued envelopes out: to its dead letters with cause
/// `purged` (`mode: deadLetter`, the default: they can be replayed) or
/// deleted (`drop`), what was queued when the call began, in bounded steps.
/// What is in flight or waiting to retry is left to finish (the answer says
/// how much). Refused 409 while a lane or a reshard moves the tenant.
#[utoipa::path(post, path = "/v1/admin/tenants/{tenant}/purge", request_body(content = PurgeIn, description = "Optional: the mode (default deadLetter) and why"),
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Purged", body = PurgeOut),
        (status = 400, description = "Invalid tenant, mode or reason", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 409, description = "The tenant is being moved between queues; try again in seconds", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn purge_tenant(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Admin(who): Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<PurgeOut>, ApiError> {
    valid_tenant(&tenant)?;
    let b = body(b, MAX_PAUSE_BODY_BYTES)?;
    let req: PurgeIn = optional_json(&b)?;
    check_reason(&req.reason)?;
    let mode = match req.mode {
        PurgeModeIn::DeadLetter => PurgeMode::DeadLetter,
        PurgeModeIn::Drop => PurgeMode::Drop,
    };
    let who = format!("key:{}", who.name);
    let result = ingest
        .redis_within(
            LONG_CALL_TIMEOUT,
            ingest
                .store()
                .purge_audited(&tenant, mode, &who, req.reason.as_deref()),
        )
        .await;
    let done = Done {
        who: &who,
        operation: "purge",
        tenant: &tenant,
        reason: req.reason.as_deref(),
    };
    let o = done.record(&ingest, result, |o| {
        (
            if o.purged > 0 { "changed" } else { "unchanged" },
            o.queue.to_string(),
        )
    })?;
    Ok(Json(PurgeOut {
        tenant,
        queue: o.queue.to_string(),
        mode: req.mode,
        purged: o.purged,
        in_flight: o.in_flight,
        delayed: o.delayed,
    }))
}

/// Put a tenant's dead letters back on its lane, oldest first, as new
/// deliveries: all, or those dead since or until a time or to one endpoint,
/// at most `maxPerSecond`. One call works for at most 10 s and answers
/// `nextCursor` when there is more: the next call passes it as `cursor`.
#[utoipa::path(post, path = "/v1/admin/tenants/{tenant}/replay", request_body(content = AdminReplayIn, description = "Optional: filters, rate, cursor and why"),
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Replayed (all, or up to the call's time)", body = AdminReplayOut),
        (status = 400, description = "Invalid tenant, filter, rate, cursor or reason", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn replay_tenant(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    Admin(who): Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<AdminReplayOut>, ApiError> {
    valid_tenant(&tenant)?;
    let b = body(b, MAX_PAUSE_BODY_BYTES)?;
    let req: AdminReplayIn = optional_json(&b)?;
    check_reason(&req.reason)?;
    if let Some(r) = req.max_per_second {
        if !(r.is_finite() && r > 0.0 && r <= 1e6) {
            return Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                "maxPerSecond",
                "must be a number above 0 and at most 1000000",
            ));
        }
    }
    if let (Some(a), Some(b)) = (req.since_ms, req.until_ms) {
        if a > b {
            return Err(ApiError::field(
                StatusCode::BAD_REQUEST,
                "untilMs",
                "is before sinceMs",
            ));
        }
    }
    let plan = ReplayPlan {
        filter: ReplayFilter {
            since_ms: req.since_ms,
            until_ms: req.until_ms,
            endpoint: req.endpoint.clone(),
        },
        max_per_second: req.max_per_second,
        budget: Some(REPLAY_CALL_BUDGET),
        after: req.cursor.clone(),
    };
    let who = format!("key:{}", who.name);
    let result = ingest
        .redis_within(
            LONG_CALL_TIMEOUT,
            ingest
                .store()
                .replay_audited(&tenant, &plan, &who, req.reason.as_deref()),
        )
        .await;
    let done = Done {
        who: &who,
        operation: "replay",
        tenant: &tenant,
        reason: req.reason.as_deref(),
    };
    let o = done.record(&ingest, result, |o| {
        (
            if o.replayed > 0 {
                "changed"
            } else {
                "unchanged"
            },
            o.queue.to_string(),
        )
    })?;
    Ok(Json(AdminReplayOut {
        tenant,
        queue: o.queue.to_string(),
        replayed: o.replayed,
        examined: o.examined,
        next_cursor: o.next,
    }))
}

/// A tenant where it lives: its queue, whether it is paused, what it holds,
/// and its latest audit entries.
#[utoipa::path(get, path = "/v1/admin/tenants/{tenant}",
    params(("tenant" = String, Path)),
    responses((status = 200, body = TenantOut), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "Not an admin key", body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn show_tenant(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    _: Admin,
) -> Result<Json<TenantOut>, ApiError> {
    valid_tenant(&tenant)?;
    let v = ingest
        .redis(ingest.store().tenant_view(&tenant, 10))
        .await?;
    Ok(Json(TenantOut {
        tenant: v.tenant,
        queue: v.queue.to_string(),
        hash_shard: v.hash_shard.to_string(),
        paused: v.state.user_paused,
        moving: v.state.paused,
        moved_to: v.state.moved_to.map(|q| q.to_string()),
        depth: v.state.depth,
        queued: v.state.queued,
        in_flight: v.state.in_flight,
        delayed: v.state.delayed,
        held: v.state.held,
        dead_letters: v.dead_letters,
        audit: v
            .audit
            .into_iter()
            .map(|e| AuditOut {
                at_ms: e.at_ms,
                who: e.who,
                operation: e.operation,
                outcome: e.outcome,
            })
            .collect(),
    }))
}
