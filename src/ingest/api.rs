//! The API as one router and one OpenAPI document, plus `/metrics`,
//! `/healthz` and `/readyz`.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, State};
use axum::routing::{get, MethodFilter, MethodRouter};
use axum::{Json, Router};
use utoipa::OpenApi;

use super::admin::*;
use super::error::ApiError;
use super::events::*;
use super::metrics::record;
use super::serve::read_body;
use super::tenants::*;
use super::tiers::*;
use super::Ingest;

/// The API's operations, each named once, by its handler: the handler's
/// `#[utoipa::path]` gives its method, path and documentation. The OpenAPI
/// document, the router and [`ROUTES`] are all made from this one list, so
/// an operation cannot be served undocumented or documented unserved.
macro_rules! operations {
    ($($handler:ident),+ $(,)?) => {
        #[derive(OpenApi)]
        #[openapi(
            info(title = "lanekeeper ingest", description = "Post webhooks for delivery, fairly across tenants."),
            paths($($handler),+),
            modifiers(&SecurityAddon, &CommonResponses)
        )]
        pub struct ApiDoc;

        /// The handler of the operation `id` (utoipa's operation id: the
        /// handler's name), as the route for `method`.
        fn handler(id: &str, method: MethodFilter) -> Option<MethodRouter<Ingest>> {
            match id {
                $(stringify!($handler) => Some(axum::routing::on(method, $handler)),)+
                _ => None,
            }
        }
    };
}

operations!(
    post_event,
    post_batch,
    put_endpoint,
    get_endpoint,
    list_endpoints,
    delete_endpoint,
    list_dead,
    replay_dead,
    stats,
    put_tier,
    get_tier,
    delete_tier,
    post_tiers,
    pause_tenant,
    resume_tenant,
    purge_tenant,
    replay_tenant,
    show_tenant,
);

/// Every operation of the document: `(method, its filter, path, operation id)`.
fn operations() -> Vec<(&'static str, MethodFilter, String, String)> {
    let doc = ApiDoc::openapi();
    let mut out = Vec::new();
    for (path, item) in doc.paths.paths {
        let ops = [
            ("get", MethodFilter::GET, item.get),
            ("put", MethodFilter::PUT, item.put),
            ("post", MethodFilter::POST, item.post),
            ("delete", MethodFilter::DELETE, item.delete),
            ("options", MethodFilter::OPTIONS, item.options),
            ("head", MethodFilter::HEAD, item.head),
            ("patch", MethodFilter::PATCH, item.patch),
            ("trace", MethodFilter::TRACE, item.trace),
        ];
        for (method, filter, op) in ops {
            if let Some(op) = op {
                out.push((
                    method,
                    filter,
                    path.clone(),
                    op.operation_id.unwrap_or_default(),
                ));
            }
        }
    }
    out
}

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

/// The routes the API serves, as `(method, path)`, from [`operations!`].
pub static ROUTES: LazyLock<Vec<(&'static str, String)>> = LazyLock::new(|| {
    operations()
        .into_iter()
        .map(|(method, _, path, _)| (method, path))
        .collect()
});

/// The API, with `/metrics`, `/healthz` and `/readyz` (ready while Redis answers).
pub fn router(ingest: Ingest) -> Router {
    let metrics = ingest.inner.metrics.clone();
    let counted = metrics.clone();
    let body_limit = ingest.inner.config.max_body_bytes;
    let mut api = Router::new();
    for (_, method, path, id) in operations() {
        let route = handler(&id, method)
            .unwrap_or_else(|| panic!("the operation {id} ({path}) has no handler"));
        api = api.route(&path, route);
    }
    let api =
        api.layer(DefaultBodyLimit::max(body_limit))
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
        .route("/metrics", crate::telemetry::metrics_route(metrics))
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
    fn every_documented_operation_is_routed_to_its_handler() {
        let ops = operations();
        for (method, filter, path, id) in &ops {
            assert!(
                handler(id, *filter).is_some(),
                "{method} {path}: operation {id:?} has no handler"
            );
        }
        let mut ids: Vec<&str> = ops.iter().map(|o| o.3.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), ops.len(), "one handler per operation: {ids:?}");
        // The API's surface: a change here is a change of the public API.
        let mut served: Vec<(&str, &str)> = ROUTES.iter().map(|(m, p)| (*m, p.as_str())).collect();
        served.sort();
        let mut want = vec![
            ("post", "/v1/events"),
            ("post", "/v1/events:batch"),
            ("get", "/v1/tenants/{tenant}/endpoints"),
            ("put", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
            ("get", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
            ("delete", "/v1/tenants/{tenant}/endpoints/{endpoint}"),
            ("get", "/v1/tenants/{tenant}/dead-letters"),
            ("post", "/v1/tenants/{tenant}/dead-letters:replay"),
            ("get", "/v1/tenants/{tenant}/stats"),
            ("put", "/v1/admin/tiers/{tenant}"),
            ("get", "/v1/admin/tiers/{tenant}"),
            ("delete", "/v1/admin/tiers/{tenant}"),
            ("post", "/v1/admin/tiers"),
            ("post", "/v1/admin/tenants/{tenant}/pause"),
            ("post", "/v1/admin/tenants/{tenant}/resume"),
            ("post", "/v1/admin/tenants/{tenant}/purge"),
            ("post", "/v1/admin/tenants/{tenant}/replay"),
            ("get", "/v1/admin/tenants/{tenant}"),
        ];
        want.sort();
        assert_eq!(served, want);
    }
}
