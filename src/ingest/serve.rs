//! Serving the API: the accept loop with its connection cap and header
//! timeout, and the middleware that authenticates a request before reading
//! its body within the route's size limit and the body read timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::api::router;
use super::config::{Config, MAX_ENDPOINT_BODY_BYTES, MAX_REPLAY_BODY_BYTES, MAX_TIERS_BODY_BYTES};
use super::error::ApiError;
use super::Ingest;

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

/// Authenticate, then read the request's body before the handler runs,
/// within the route's size limit and the body read timeout: a client
/// without a known key is refused before any of its body is read, and one
/// that sends its body a byte at a time gets 408 instead of holding the
/// request open.
pub(super) async fn read_body(
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
        Some("/v1/tenants/{tenant}/endpoints/{endpoint}")
        | Some("/v1/admin/tiers/{tenant}")
        | Some("/v1/admin/tenants/{tenant}/pause")
        | Some("/v1/admin/tenants/{tenant}/resume")
        | Some("/v1/admin/tenants/{tenant}/purge")
        | Some("/v1/admin/tenants/{tenant}/replay") => MAX_ENDPOINT_BODY_BYTES,
        Some("/v1/admin/tiers") => MAX_TIERS_BODY_BYTES.min(config.max_body_bytes),
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
