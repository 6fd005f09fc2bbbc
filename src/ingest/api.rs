//! The API as one router and one OpenAPI document, plus `/metrics`,
//! `/healthz` and `/readyz`.

use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::routing::{get, post, put};
use axum::{Json, Router};
use utoipa::OpenApi;

use super::error::ApiError;
use super::events::*;
use super::metrics::record;
use super::serve::read_body;
use super::tenants::*;
use super::Ingest;

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
}
