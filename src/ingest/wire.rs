//! The wire types: what producers post and what ingest answers, with their
//! OpenAPI schemas (utoipa), and the parsing of a request body into them that
//! names the field at fault.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::ApiError;
use crate::endpoint::Endpoint;

/// One event, as a producer posts it.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EventIn {
    /// The tenant whose webhook this is: `^[A-Za-z0-9][A-Za-z0-9._:-]*$`, at
    /// most 128 bytes.
    #[schema(
        pattern = "^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        max_length = 128,
        min_length = 1
    )]
    pub tenant: String,
    /// The tenant's endpoint, by name. Without it, an `eventType` fans out to
    /// every enabled endpoint that takes the type; with neither, the endpoint
    /// named `default` gets it.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Event type, e.g. `user.password_reset`.
    #[serde(default)]
    pub event_type: Option<String>,
    /// The webhook body (kept as posted until it is sent, so that a large
    /// payload is never held as a parsed tree longer than its turn).
    #[schema(value_type = Object)]
    pub payload: Box<serde_json::value::RawValue>,
    /// Idempotency key: the same id twice is stored once. Generated when absent.
    #[serde(default)]
    pub id: Option<String>,
}

/// Where one envelope went.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    pub id: String,
    pub endpoint: String,
    /// The queue: `shard-NN` or `lane-N`.
    pub queue: String,
    /// `queued`; `held` (the tenant is moving; delivered after the move, in
    /// order); or `duplicate` (this id was stored before).
    pub status: String,
}

/// The answer to one event: the envelope it became, or one per endpoint
/// for a fan-out.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventAccepted {
    /// The event's id (fan-out envelopes carry it with `.<endpoint>` added).
    pub id: String,
    pub queue: String,
    pub envelopes: Vec<Accepted>,
}

/// One item's result in a batch.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ItemResult {
    pub index: usize,
    /// The HTTP status this item would have had alone: 202, 400, 403, 413,
    /// 422, 429 or 503.
    pub status: u16,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub envelopes: Vec<Accepted>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// For 429: seconds after which the tenant has likely drained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// The answer to a batch: one result per item, in order.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchResult {
    pub accepted: usize,
    pub rejected: usize,
    pub items: Vec<ItemResult>,
}

/// An endpoint definition, as put.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EndpointIn {
    /// `https://` (or `http://`) URL that receives the POSTs.
    pub url: String,
    /// Signing secret in `whsec_` form. Generated when absent, and shown
    /// once, in this answer.
    #[serde(default)]
    pub secret: Option<String>,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Event types this endpoint takes in a fan-out; empty means all.
    #[serde(default)]
    pub event_types: Vec<String>,
}

fn yes() -> bool {
    true
}

/// An endpoint as stored. Secrets are never shown again after they are set.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointOut {
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub event_types: Vec<String>,
    /// Signing secrets in force (two during a rotation).
    pub secrets: usize,
    /// The secret, only in the answer to the PUT that set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

impl EndpointOut {
    pub(super) fn new(name: &str, e: &Endpoint, secret: Option<String>) -> Self {
        Self {
            name: name.to_string(),
            url: e.url.clone(),
            enabled: e.enabled,
            event_types: e.event_types.clone(),
            secrets: e.secrets.len(),
            secret,
        }
    }
}

/// A dead letter.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterOut {
    pub id: String,
    pub queue: String,
    pub attempts: u32,
    pub cause: String,
    /// When it was dead-lettered, ms since the epoch.
    pub at: u64,
    /// The envelope as stored (JSON), empty when its record was missing.
    pub envelope: String,
}

/// One page of a tenant's dead letters, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeadLettersOut {
    pub items: Vec<DeadLetterOut>,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Which dead letters to replay.
#[derive(Clone, Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayIn {
    /// Ids to replay; absent or empty: all of the tenant's.
    #[serde(default)]
    pub ids: Vec<String>,
}

/// What a replay did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplayOut {
    /// Dead letters put back on the tenant's lane.
    pub replayed: u64,
}

/// A tenant's tier, as the admin API sets it.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TierIn {
    /// Tier name: a letter or digit, then up to 62 letters, digits, '.', '_' or '-'.
    pub tier: String,
}

/// A tenant's tier and where it comes from.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TierOut {
    pub tenant: String,
    /// The tier in force (`api`, else `shardSet`, else `configMap`); null:
    /// none, the tenant gets the default weight.
    pub tier: Option<String>,
    /// Set through this API.
    pub api: Option<String>,
    /// From the ShardSet's `spec.tenants[].tier`.
    pub shard_set: Option<String>,
    /// From the ShardSet's `scheduler.tierAssignments` ConfigMap.
    pub config_map: Option<String>,
}

/// What a bulk tier call wrote.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TiersOut {
    /// Assignments set.
    pub set: u64,
    /// Assignments cleared (lines `<tenant> -`).
    pub cleared: u64,
}

/// Why an operator pauses or resumes a tenant (optional; recorded in the
/// audit trail).
#[derive(Clone, Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseIn {
    /// One line, at most 256 bytes.
    #[serde(default)]
    pub reason: Option<String>,
}

/// What a pause or resume did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PauseOut {
    pub tenant: String,
    /// The queue the tenant lives in, where it was set.
    pub queue: String,
    /// Paused by a user now: its deliveries wait (ingest keeps accepting).
    pub paused: bool,
    /// False when it already was in that state.
    pub changed: bool,
    /// Its envelopes outstanding in that queue.
    pub depth: u64,
}

/// Where a purge puts the tenant's queued envelopes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub enum PurgeModeIn {
    /// To its dead letters, cause `purged` (they can be replayed).
    #[default]
    DeadLetter,
    /// Deleted, counted.
    Drop,
}

/// A purge.
#[derive(Clone, Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PurgeIn {
    /// Default `deadLetter`.
    #[serde(default)]
    pub mode: PurgeModeIn,
    /// One line, at most 256 bytes (recorded in the audit trail).
    #[serde(default)]
    pub reason: Option<String>,
}

/// What a purge did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PurgeOut {
    pub tenant: String,
    pub queue: String,
    pub mode: PurgeModeIn,
    /// Envelopes taken from its lane (what was queued when the call began).
    pub purged: u64,
    /// Left to finish: in flight, and waiting to retry (a retry comes back
    /// to the lane when due; purge again to take it).
    pub in_flight: u64,
    pub delayed: u64,
}

/// A replay of a tenant's dead letters, oldest first.
#[derive(Clone, Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdminReplayIn {
    /// Only letters dead-lettered at or after this time (ms since the epoch).
    #[serde(default)]
    pub since_ms: Option<u64>,
    /// Only letters dead-lettered at or before this time (ms since the epoch).
    #[serde(default)]
    pub until_ms: Option<u64>,
    /// Only letters to this endpoint.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Letters per second at most (default: as fast as bounded steps go).
    #[serde(default)]
    pub max_per_second: Option<f64>,
    /// Go on from the `nextCursor` of the call before.
    #[serde(default)]
    pub cursor: Option<String>,
    /// One line, at most 256 bytes (recorded in the audit trail).
    #[serde(default)]
    pub reason: Option<String>,
}

/// What a replay call did. One call works for at most 10 s; `nextCursor`
/// says where the next call goes on.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdminReplayOut {
    pub tenant: String,
    pub queue: String,
    pub replayed: u64,
    pub examined: u64,
    /// Null when the replay is done.
    pub next_cursor: Option<String>,
}

/// One entry of the set's audit trail.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuditOut {
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// `key:<api key name>` or `cli:<user>`.
    pub who: String,
    pub operation: String,
    pub outcome: String,
}

/// One tenant where it lives.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantOut {
    pub tenant: String,
    /// The queue routing sends it to now.
    pub queue: String,
    /// Its hash shard (differs from `queue` while a lane or a move pins it).
    pub hash_shard: String,
    /// Paused by a user.
    pub paused: bool,
    /// Paused by a move (a lane or a reshard): its new events are held.
    pub moving: bool,
    pub moved_to: Option<String>,
    pub depth: u64,
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    pub held: u64,
    pub dead_letters: u64,
    /// Its latest audit entries, newest first (at most 10).
    pub audit: Vec<AuditOut>,
}

/// A tenant's state in its queue.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatsOut {
    pub tenant: String,
    pub queue: String,
    /// Envelopes queued, held, waiting to retry or in flight.
    pub depth: u64,
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    pub held: u64,
    /// Paused by a move (a lane or a reshard): its new events are held.
    pub paused: bool,
    /// Paused by a user (`lanekeeper tenant pause`): its deliveries wait.
    pub user_paused: bool,
    pub delivered: u64,
    pub failed: u64,
    /// How long the oldest queued envelope has waited, ms.
    pub oldest_wait_ms: Option<u64>,
    /// Share of the queue's worker-seconds over the window, 0 to 1.
    pub capacity_share: f64,
    /// Deliveries per second over the window.
    pub drain_rate: f64,
    pub window_s: u64,
}

/// Query of the stats call.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct StatsQuery {
    /// Window in seconds for shares and rates (default 60, at most 7200).
    pub window: Option<u64>,
}

/// Query of the dead-letter list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeadQuery {
    /// Dead letters per page (default 100, at most 1000).
    pub limit: Option<usize>,
    /// Where to continue: the `nextCursor` of the page before (absent: the oldest).
    pub cursor: Option<String>,
}

/// Every error answer.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ErrorBody {
    /// Machine-readable: invalid_field, malformed_json, payload_too_large,
    /// unauthorized, forbidden, not_found, backlog_full, shaped, unavailable.
    pub code: String,
    /// The field at fault, as a path (`tenant`, `payload`, `items[3].tenant`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub message: String,
}

/// Parse a JSON body, naming the field at fault.
pub(super) fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                None,
                format!("malformed JSON: {inner}"),
            );
        }
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            Some(field.clone()),
            format!("{field}: {inner}"),
        )
    })
}

pub(super) fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                Some("body".into()),
                format!("body: larger than the limit of {limit} bytes"),
            )
        } else {
            ApiError::new(e.status(), "bad_request", None, e.body_text())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::config::MAX_MESSAGE_BYTES;
    use super::super::events::{batch_items, compact_len};
    use super::*;
    #[test]
    fn unknown_and_invalid_fields_are_named() {
        let e = parse::<EventIn>(br#"{"tenant":"a","payload":{},"colour":1}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.body.message.contains("unknown field `colour`"), "{e:?}");
        let e = parse::<EventIn>(br#"{"tenant":5,"payload":{}}"#).unwrap_err();
        assert_eq!(e.body.field.as_deref(), Some("tenant"), "{e:?}");
        let e = parse::<EventIn>(br#"{"tenant":"a","payload":{}"#).unwrap_err();
        assert_eq!(e.body.code, "malformed_json", "{e:?}");
        let e = parse::<EventIn>(br#"{"payload":{}}"#).unwrap_err();
        assert!(e.body.message.contains("missing field `tenant`"), "{e:?}");
    }

    /// The request parsers over arbitrary bytes (and over mutations of valid
    /// bodies, to get past the first byte): they never panic, never return
    /// more than the item limit, and every error is a 4xx whose message is
    /// bounded. Bounded in time: LANEKEEPER_FUZZ_CASES cases (default 20,000; about 3 s).

    #[test]
    fn request_parsers_hold_up_under_raw_bytes() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config as PConfig, TestRunner};
        let cases = std::env::var("LANEKEEPER_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        let seeds: Vec<&[u8]> = vec![
            br#"{"tenant":"acme","payload":{"a":[1,2,{"b":null}]},"id":"x","eventType":"t"}"#,
            br#"[{"tenant":"a","payload":1},{"tenant":"b","payload":"x","endpoint":"e"}]"#,
            b"{\"tenant\":\"a\",\"payload\":{}}\n\n{\"tenant\":\"b\",\"payload\":[]}\n",
            br#"{"url":"https://x.example/h","eventTypes":["a","b"],"enabled":false}"#,
        ];
        let bytes = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..512),
            (
                proptest::sample::select(seeds),
                proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8)
            )
                .prop_map(|(seed, edits)| {
                    let mut b = seed.to_vec();
                    for (at, byte, op) in edits {
                        let i = at % (b.len() + 1);
                        match op {
                            0 => b.insert(i, byte),
                            1 if i < b.len() => b[i] = byte,
                            _ if i < b.len() => {
                                b.remove(i);
                            }
                            _ => {}
                        }
                    }
                    b
                }),
        ];
        let mut runner = TestRunner::new(PConfig {
            cases,
            failure_persistence: None,
            ..PConfig::default()
        });
        runner
            .run(&(bytes, 1usize..8, any::<bool>()), |(b, max, ndjson)| {
                let check = |e: &ApiError| {
                    prop_assert!(e.status.is_client_error(), "{e:?}");
                    prop_assert!(e.body.message.len() <= MAX_MESSAGE_BYTES, "{e:?}");
                    Ok(())
                };
                match batch_items(&b, ndjson, max) {
                    Ok(items) => {
                        prop_assert!(items.len() <= max);
                        for item in items {
                            if !ndjson {
                                prop_assert!(
                                    serde_json::from_slice::<serde::de::IgnoredAny>(item).is_ok()
                                );
                            }
                            if let Err(e) = parse::<EventIn>(item) {
                                check(&e)?;
                            }
                        }
                    }
                    Err(e) => check(&e)?,
                }
                match parse::<EventIn>(&b) {
                    Ok(ev) => {
                        let n = compact_len(ev.payload.get());
                        let v: serde_json::Value = serde_json::from_str(ev.payload.get()).unwrap();
                        // equal up to string escapes, which re-encoding may shorten
                        prop_assert!(n >= serde_json::to_vec(&v).unwrap().len());
                    }
                    Err(e) => check(&e)?,
                }
                if let Err(e) = parse::<EndpointIn>(&b) {
                    check(&e)?;
                }
                Ok(())
            })
            .unwrap();
    }
}
