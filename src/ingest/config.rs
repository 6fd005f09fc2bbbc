//! Ingest settings: the [`Config`] of one process, its backlog and endpoint
//! limits, and the size limits every request is held to.

use std::collections::HashMap;
use std::time::Duration;

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
pub(super) const MAX_MESSAGE_BYTES: usize = 512;
/// A batch's envelopes go to Redis in slices of about this many payload
/// bytes (or [`crate::store::ENQUEUE_CHUNK`] envelopes), so that only one
/// slice's payloads are held as parsed JSON at a time.
pub(super) const SEND_SLICE_BYTES: usize = 1024 * 1024;

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

/// Largest body of a dead-letter replay, in bytes (10,000 ids of the
/// longest kind fit).
pub const MAX_REPLAY_BODY_BYTES: usize = 2 * 1024 * 1024;

/// Largest body of a bulk tier call (`POST /v1/admin/tiers`): 8 MiB, about
/// 300,000 lines of typical tenant and tier names.
pub const MAX_TIERS_BODY_BYTES: usize = 8 * 1024 * 1024;

/// Most assignments one bulk tier call takes.
pub const MAX_TIER_ASSIGNMENTS: usize = 100_000;

#[cfg(test)]
mod tests {
    use super::*;

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
