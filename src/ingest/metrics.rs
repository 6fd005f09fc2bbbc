//! The ingest API's request metrics: every request counted and timed by
//! route template and status, with a bounded label set.

use std::time::Instant;

use axum::extract::State;
use axum::response::Response;

use crate::telemetry::{IngestMetrics, RequestLabels, RouteLabels};

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
pub(super) async fn record(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
