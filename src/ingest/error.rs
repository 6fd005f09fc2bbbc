//! [`ApiError`]: every refusal ingest gives, as a status, an [`ErrorBody`] and
//! a `Retry-After` where one helps.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::auth::Principal;
use super::config::MAX_MESSAGE_BYTES;
use super::wire::ErrorBody;
use crate::store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) body: ErrorBody,
    pub(super) retry_after: Option<u64>,
}

impl ApiError {
    pub(super) fn new(
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

    pub(super) fn field(status: StatusCode, field: &str, reason: impl Into<String>) -> Self {
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

    pub(super) fn forbidden(who: &Principal, tenant: &str, field: Option<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            field,
            format!("api key {:?} may not act for tenant {tenant:?}", who.name),
        )
    }

    pub(super) fn unauthorized(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", None, message)
    }

    pub(super) fn unavailable(message: String) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            None,
            message,
        );
        e.retry_after = Some(1);
        e
    }

    pub(super) fn backlog_full(tenant: &str, depth: u64, limit: u64, retry_after: u64) -> Self {
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

    /// The tenant is shaped at ingest: a 429 with `Retry-After` in whole
    /// seconds, at least 1.
    pub(super) fn shaped(tenant: &str, after: std::time::Duration) -> Self {
        let secs = shaped_retry_after(after);
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "shaped",
            Some("tenant".into()),
            format!(
                "tenant {tenant:?} is shaped at ingest: it is hot and the set has no free dedicated lane, so its events are admitted at the rate its fair share drains; retry after {secs}s"
            ),
        );
        e.retry_after = Some(secs);
        e
    }
}

/// `Retry-After` seconds for a shaped tenant: the time its bucket needs,
/// rounded up, at least 1 (the header has whole seconds only).
pub(super) fn shaped_retry_after(after: std::time::Duration) -> u64 {
    after.as_millis().div_ceil(1000).clamp(1, 3600) as u64
}

/// `s` cut to at most `max` bytes (at a character boundary), marked when cut.
pub(super) fn clip(mut s: String, max: usize) -> String {
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

/// The one mapping of a [`StoreError`] to an answer: invalid input (an
/// envelope, an endpoint, a dead-letter cursor) is a 400 naming the field; a
/// missing routing table is a 503 saying so; anything else from Redis is a
/// 503 `redis: ...` to retry.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        Self::from_store(e, "")
    }
}

impl ApiError {
    /// [`From<StoreError>`], with the field at fault named inside `at` (a
    /// batch item's `items[3]`) when `at` is not empty.
    ///
    /// One envelope's result from a batch enqueue comes here too. Those sites
    /// used to map only `Invalid` and answer every other error `redis: ...`;
    /// the three variants mapped otherwise here (`InvalidEndpoint`,
    /// `InvalidCursor`, `RoutingMissing`) never come per envelope
    /// (`Producer::send_batch` returns a missing routing table for the whole
    /// call, where it comes through [`super::Ingest::redis`]), so one mapping
    /// serves both.
    pub(super) fn from_store(e: StoreError, at: &str) -> Self {
        let field = |name: &str| {
            if at.is_empty() {
                name.to_string()
            } else {
                format!("{at}.{name}")
            }
        };
        match e {
            StoreError::Invalid(e) => {
                Self::field(StatusCode::BAD_REQUEST, &field(e.field), e.reason)
            }
            StoreError::InvalidEndpoint(e) => {
                Self::field(StatusCode::BAD_REQUEST, &field(e.field), e.reason)
            }
            e @ StoreError::InvalidCursor => {
                Self::field(StatusCode::BAD_REQUEST, &field("cursor"), e.to_string())
            }
            e @ StoreError::RoutingMissing(_) => Self::unavailable(e.to_string()),
            e @ StoreError::TenantMoving(_) => {
                Self::new(StatusCode::CONFLICT, "moving", None, e.to_string())
            }
            e => Self::unavailable(format!("redis: {e}")),
        }
    }
}
