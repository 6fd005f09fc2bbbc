//! The admin tier assignments under `/v1/admin/tiers`: one tenant's tier
//! (put, get, delete) and many at once (post, `<tenant> <tier>` lines).
//! Admin keys only. They write the set's `tiers:api` hash, which wins over
//! the ShardSet's ConfigMap; a tenant's queue takes the tier with its next
//! accepted event (this process at once, other ingest replicas within their
//! cache TTL).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

use super::auth::Admin;
use super::config::{MAX_TIERS_BODY_BYTES, MAX_TIER_ASSIGNMENTS};
use super::error::ApiError;
use super::wire::{body, parse, ErrorBody, TierIn, TierOut, TiersOut};
use super::Ingest;
use crate::policy::tiers::{check_tier_name, parse_assignments};

fn valid_tenant(tenant: &str) -> Result<(), ApiError> {
    crate::envelope::validate_tenant(tenant)
        .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "tenant", e.reason))
}

async fn tier_out(ingest: &Ingest, tenant: String) -> Result<TierOut, ApiError> {
    let s = ingest.redis(ingest.store().tier_sources(&tenant)).await?;
    Ok(TierOut {
        tier: s.effective().map(str::to_string),
        api: s.api,
        shard_set: s.spec,
        config_map: s.config_map,
        tenant,
    })
}

/// Set a tenant's tier.
#[utoipa::path(put, path = "/v1/admin/tiers/{tenant}", request_body = TierIn,
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Set; the tenant's queue takes it with its next accepted event", body = TierOut),
        (status = 400, description = "Invalid tenant or tier name", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn put_tier(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    _: Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<TierOut>, ApiError> {
    valid_tenant(&tenant)?;
    let b = body(b, super::MAX_ENDPOINT_BODY_BYTES)?;
    let req: TierIn = parse(&b)?;
    check_tier_name(&req.tier).map_err(|r| ApiError::field(StatusCode::BAD_REQUEST, "tier", r))?;
    ingest
        .redis(
            ingest
                .store()
                .put_api_tiers(&[(tenant.clone(), Some(req.tier))]),
        )
        .await?;
    ingest.forget_tier(&tenant);
    Ok(Json(tier_out(&ingest, tenant).await?))
}

/// Read a tenant's tier and where it comes from.
#[utoipa::path(get, path = "/v1/admin/tiers/{tenant}",
    params(("tenant" = String, Path)),
    responses((status = 200, body = TierOut), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "Not an admin key", body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn get_tier(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    _: Admin,
) -> Result<Json<TierOut>, ApiError> {
    valid_tenant(&tenant)?;
    Ok(Json(tier_out(&ingest, tenant).await?))
}

/// Clear a tenant's tier set through this API (a ConfigMap assignment, if
/// any, then applies).
#[utoipa::path(delete, path = "/v1/admin/tiers/{tenant}",
    params(("tenant" = String, Path)),
    responses((status = 200, description = "Cleared; what is in force now", body = TierOut),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "Not an admin key", body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn delete_tier(
    State(ingest): State<Ingest>,
    Path(tenant): Path<String>,
    _: Admin,
) -> Result<Json<TierOut>, ApiError> {
    valid_tenant(&tenant)?;
    ingest
        .redis(ingest.store().put_api_tiers(&[(tenant.clone(), None)]))
        .await?;
    ingest.forget_tier(&tenant);
    Ok(Json(tier_out(&ingest, tenant).await?))
}

/// Set or clear many tenants' tiers: a `text/plain` body of lines
/// `<tenant> <tier>` (`<tenant> -` clears; blank lines and `#` comments are
/// ignored; a tenant listed twice takes its last line). All or nothing: any
/// bad line refuses the call, naming the line, and nothing is written. At
/// most 100,000 assignments and 8 MiB per call.
#[utoipa::path(post, path = "/v1/admin/tiers",
    request_body(content = String, content_type = "text/plain", description = "Lines `<tenant> <tier>`"),
    responses((status = 200, body = TiersOut),
        (status = 400, description = "A bad line (named), or not UTF-8", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, description = "Not an admin key", body = ErrorBody),
        (status = 413, description = "Body over 8 MiB, or more than 100,000 assignments", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
pub(super) async fn post_tiers(
    State(ingest): State<Ingest>,
    _: Admin,
    b: Result<Bytes, BytesRejection>,
) -> Result<Json<TiersOut>, ApiError> {
    let b = body(b, MAX_TIERS_BODY_BYTES)?;
    let text = std::str::from_utf8(&b).map_err(|e| {
        ApiError::field(
            StatusCode::BAD_REQUEST,
            "body",
            format!("is not UTF-8 (at byte {})", e.valid_up_to()),
        )
    })?;
    let (good, bad) = parse_assignments(text, true, MAX_TIER_ASSIGNMENTS, |t| {
        crate::envelope::validate_tenant(t).map_err(|e| e.reason)
    });
    if let Some(first) = bad.first() {
        if good.len() == MAX_TIER_ASSIGNMENTS && bad.len() == 1 {
            return Err(ApiError::field(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("line {}", first.line),
                first.reason.clone(),
            ));
        }
        let more = match bad.len() {
            1 => String::new(),
            n => format!(" (and {} more bad lines: {})", n - 1, join(&bad[1..])),
        };
        return Err(ApiError::field(
            StatusCode::BAD_REQUEST,
            &format!("line {}", first.line),
            format!("{}{more}; nothing was written", first.reason),
        ));
    }
    ingest.redis(ingest.store().put_api_tiers(&good)).await?;
    let cleared = good.iter().filter(|(_, t)| t.is_none()).count();
    for (t, _) in &good {
        ingest.forget_tier(t);
    }
    Ok(Json(TiersOut {
        set: (good.len() - cleared) as u64,
        cleared: cleared as u64,
    }))
}

fn join(bad: &[crate::policy::tiers::BadLine]) -> String {
    bad.iter()
        .take(5)
        .map(|b| format!("line {}", b.line))
        .collect::<Vec<_>>()
        .join(", ")
}
