//! The one Rust home of Redis key names. The scripts name the same keys in
//! `lua/common.lua`: the key layout table at its top is the reference for
//! what each key holds. Every key Rust builds (the store's own reads and
//! writes, and the tests and benches that look at Redis directly) is built
//! here, so a name is spelt once on each side.
//!
//! A queue's keys all start with its prefix `P` = `lk:{<namespace>/<set>/<queue>}`
//! ([`queue_prefix`]): its `{...}` is the queue's hash tag, so they share one
//! slot. A set's own keys (routing table, endpoint registry) are under the
//! set's tag, `lk:{<namespace>/<set>}`.

use super::{SetId, SLOT_GUARD};
use crate::routing::QueueId;

/// The key prefix of a queue, `lk:{<namespace>/<set>/<queue>}`; its `{...}`
/// is the queue's hash tag.
pub fn queue_prefix(set: &SetId, q: QueueId) -> String {
    format!("lk:{{{}/{}/{q}}}", set.namespace, set.name)
}

/// The set's routing table: `lk:{<namespace>/<set>}:routing` (a hash; the
/// lane/reshard gate keeps its fields there too, see gate.lua).
pub fn routing(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:routing", set.namespace, set.name)
}

/// A tenant's endpoint registry: `lk:{<namespace>/<set>}:endpoints:<tenant>`
/// (a hash, endpoint name -> JSON).
pub fn endpoints(set: &SetId, tenant: &str) -> String {
    format!("lk:{{{}/{}}}:endpoints:{tenant}", set.namespace, set.name)
}

/// Tier assignments from the ShardSet's ConfigMap: `lk:{<namespace>/<set>}:tiers`
/// (a hash, tenant -> tier; the controller syncs it).
pub fn tiers(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:tiers", set.namespace, set.name)
}

/// Tier assignments from the ShardSet's `spec.tenants[].tier`:
/// `lk:{<namespace>/<set>}:tiers:spec` (a hash, tenant -> tier; wins over
/// [`tiers`], loses to [`tiers_api`]; the controller rewrites it).
pub fn tiers_spec(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:tiers:spec", set.namespace, set.name)
}

/// Tenants the ShardSet's `spec.tenants[].paused` paused (a set): the
/// controller's record of the pauses it made, so it resumes only those:
/// `lk:{<namespace>/<set>}:pausedbyspec`.
pub fn paused_by_spec(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:pausedbyspec", set.namespace, set.name)
}

/// Tier assignments through the ingest admin API: `lk:{<namespace>/<set>}:tiers:api`
/// (a hash, tenant -> tier; wins over [`tiers`]).
pub fn tiers_api(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:tiers:api", set.namespace, set.name)
}

/// The ConfigMap last synced into [`tiers`], `<name>@<resourceVersion>`:
/// `lk:{<namespace>/<set>}:tiers:synced` (a string).
pub fn tiers_synced(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:tiers:synced", set.namespace, set.name)
}

/// The version counter of user pause and resume operations:
/// `lk:{<namespace>/<set>}:pausev` (a string, INCR; see user_pause.lua).
pub fn pause_version(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:pausev", set.namespace, set.name)
}

/// The audit trail of operations on tenants (pause, resume, purge, replay):
/// `lk:{<namespace>/<set>}:audit` (a stream, capped; see `store::operations`).
pub fn audit(set: &SetId) -> String {
    format!("lk:{{{}/{}}}:audit", set.namespace, set.name)
}

/// SCAN pattern of every key of the set's queues: `lk:{<namespace>/<set>/*`.
pub fn set_queues_pattern(set: &SetId) -> String {
    format!("lk:{{{}/{}/*", set.namespace, set.name)
}

/// SCAN pattern of the set's own keys (routing table, endpoints):
/// `lk:{<namespace>/<set>}*`.
pub fn set_keys_pattern(set: &SetId) -> String {
    format!("lk:{{{}/{}}}*", set.namespace, set.name)
}

/// SCAN pattern of every key of the sets in `namespace` whose name starts
/// with `name_prefix` (`""`: every set of the namespace), their queues'
/// keys and their own: `lk:{<namespace>/<name_prefix>*`.
pub fn sets_pattern(namespace: &str, name_prefix: &str) -> String {
    format!("lk:{{{namespace}/{name_prefix}*")
}

/// The second key every per-queue call declares, `P:~slotguard`: never
/// written (see [`SLOT_GUARD`]).
pub fn slot_guard(prefix: &str) -> String {
    format!("{prefix}{SLOT_GUARD}")
}

/// The queue's policy and settings (`P:conf`, a hash: the packed `policy`
/// field, `minroute`, the simulator's `clock`).
pub fn conf(prefix: &str) -> String {
    format!("{prefix}:conf")
}

/// The tenants' weights (`P:weights`, a hash).
pub fn weights(prefix: &str) -> String {
    format!("{prefix}:weights")
}

/// The tenants' own in-flight caps (`P:caps`, a hash: tenant -> cap).
pub fn caps(prefix: &str) -> String {
    format!("{prefix}:caps")
}

/// The tenants' own rate limits (`P:limits`, a hash: tenant ->
/// "rate burst erate eburst").
pub fn limits(prefix: &str) -> String {
    format!("{prefix}:limits")
}

/// A tenant endpoint's delivery token bucket (`P:rl:<len>:<tenant>:<endpoint>`,
/// a string "micro-tokens:ms"), while the endpoint is not the one whose
/// bucket lives in the tenant's state (its fields `ee`, `ek`).
pub fn endpoint_bucket(prefix: &str, tenant: &str, endpoint: &str) -> String {
    format!("{prefix}:rl:{}:{tenant}:{endpoint}", tenant.len())
}

/// Every tenant that has had work in the queue (`P:tenants`, a set).
pub fn tenants(prefix: &str) -> String {
    format!("{prefix}:tenants")
}

/// Tenants a user paused in the queue (`P:paused`, a set).
pub fn paused(prefix: &str) -> String {
    format!("{prefix}:paused")
}

/// The deficit round robin's ring of tenants with work (`P:ring`, a list,
/// head first).
pub fn ring(prefix: &str) -> String {
    format!("{prefix}:ring")
}

/// A tenant's state in the queue (`P:t:<tenant>`, a hash).
pub fn tenant(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:t:{tenant}")
}

/// A tenant's lane (`P:q:<tenant>`, a list of its queued envelopes, head
/// first: each a [`LaneItem`]).
pub fn lane(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:q:{tenant}")
}

/// Under endpoint isolation, the lane of one of a tenant's endpoints
/// (`P:qe:<len>:<tenant>:<endpoint>`, a list of [`LaneItem`]s, head first).
pub fn endpoint_lane(prefix: &str, tenant: &str, endpoint: &str) -> String {
    format!("{prefix}:qe:{}:{tenant}:{endpoint}", tenant.len())
}

/// Under endpoint isolation, a tenant's ready endpoints (`P:ez:<tenant>`,
/// a sorted set: endpoint -> virtual time in worker-microseconds).
pub fn ready_endpoints(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:ez:{tenant}")
}

/// Under endpoint isolation, a tenant's endpoints whose lane holds work
/// (`P:eps:<tenant>`, a set).
pub fn queued_endpoints(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:eps:{tenant}")
}

/// One 10 s bucket of worker-microseconds by tenant (`P:wsu:<bucket>`, a hash).
pub fn worker_seconds(prefix: &str, bucket: u64) -> String {
    format!("{prefix}:wsu:{bucket}")
}

/// The bucket of fractional worker-seconds library versions before
/// [`worker_seconds`] kept (`P:ws:<bucket>`): no current script writes it;
/// tests write it to play an older version during a rolling upgrade.
pub fn legacy_worker_seconds(prefix: &str, bucket: u64) -> String {
    format!("{prefix}:ws:{bucket}")
}

/// The channel that wakes idle workers (`P:wake`).
pub fn wake(prefix: &str) -> String {
    format!("{prefix}:wake")
}

/// One item of a lane or hold buffer (see `lane_item` in common.lua): an
/// envelope stored whole, `"\x01<id>\n<endpoint>\n<seq>\n<enqueued ms>\n<payload>"`,
/// or a bare id whose [`envelope`] record holds it. A lease of an envelope
/// stored whole hands the worker its item (see `reply::parse_lease`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaneItem<'a> {
    /// Stored whole. `seq` and `enqueued_ms` are 0 when not numbers
    /// (written behind the scripts' back).
    Whole {
        id: &'a [u8],
        endpoint: &'a [u8],
        seq: u64,
        enqueued_ms: u64,
        payload: &'a [u8],
    },
    /// A bare id, whose record is [`envelope`]; also an item that starts
    /// as a whole one but does not parse, which the scripts read the same way.
    Bare(&'a [u8]),
}

/// Read one lane item as [`LaneItem`].
pub fn lane_item(item: &[u8]) -> LaneItem<'_> {
    if item.first() != Some(&1) {
        return LaneItem::Bare(item);
    }
    let mut parts = item[1..].splitn(5, |&b| b == b'\n');
    let number = |b: &[u8]| {
        std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    match (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) {
        (Some(id), Some(endpoint), Some(seq), Some(at), Some(payload)) => LaneItem::Whole {
            id,
            endpoint,
            seq: number(seq),
            enqueued_ms: number(at),
            payload,
        },
        _ => LaneItem::Bare(item),
    }
}

/// The envelope id and tenant lease `member` names: a lease is
/// `"<charge>\n<at>\n<id>\n<tenant>\n<token>"` (see `lease_member` in
/// common.lua; under endpoint isolation `"\n<endpoint>"` follows). None when
/// it is not one.
pub fn lease_names(member: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut parts = member.splitn(5, |&b| b == b'\n');
    let (_charge, _at) = (parts.next()?, parts.next()?);
    let (id, tenant) = (parts.next()?, parts.next()?);
    parts.next()?;
    Some((id, tenant))
}

/// The body of each in-flight envelope that was leased while stored whole
/// (`P:leased`, a hash: its lease, as in `P:leases` -> its lane item).
pub fn leased(prefix: &str) -> String {
    format!("{prefix}:leased")
}

/// The record of a tenant's envelope: `P:e:<#tenant>:<tenant>:<id>`. The
/// tenant is part of the name, so two tenants' ids never meet.
pub fn envelope(prefix: &str, tenant: &str, id: &str) -> String {
    format!("{prefix}:e:{}:{tenant}:{id}", tenant.len())
}

/// A tenant's dead letters (a stream, oldest first).
pub fn dead_letters(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:dl:{tenant}")
}

/// The count of dead letters the queue's retention bound dropped.
pub fn dead_letters_dropped(prefix: &str) -> String {
    format!("{prefix}:dlx")
}

/// A tenant's idempotency claims of one period.
pub fn claims(prefix: &str, period: u64, tenant: &str) -> String {
    format!("{prefix}:ids:{period}:{tenant}")
}

/// A tenant's paced endpoints: endpoint -> paced-until ms (`P:pace:<tenant>`).
pub fn pace(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:pace:{tenant}")
}

/// Tenants off the ring until a breaker or a pause lets them back (`P:blocked`).
pub fn blocked(prefix: &str) -> String {
    format!("{prefix}:blocked")
}

/// Retries waiting for their time (`P:delayed`).
pub fn delayed(prefix: &str) -> String {
    format!("{prefix}:delayed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_names_its_envelope_and_tenant() {
        assert_eq!(
            lease_names(b"20000\n1700\nord-7\nacme\nw-1.3"),
            Some((&b"ord-7"[..], &b"acme"[..]))
        );
        // under endpoint isolation the endpoint follows the token
        assert_eq!(
            lease_names(b"1\n2\nord-7\nacme\nw-1.3\nmain"),
            Some((&b"ord-7"[..], &b"acme"[..]))
        );
        for not_one in [&b""[..], b"1\n2\nid", b"1\n2\nid\nacme", b"\n\n\n"] {
            assert_eq!(lease_names(not_one), None, "{not_one:?}");
        }
    }

    #[test]
    fn a_lane_item_is_an_envelope_whole_or_a_bare_id() {
        let item = b"\x01ord-7\nmain\n42\n1700000000000\n{\"a\":\"x\ny\x01\"}";
        assert_eq!(
            lane_item(item),
            LaneItem::Whole {
                id: b"ord-7",
                endpoint: b"main",
                seq: 42,
                enqueued_ms: 1_700_000_000_000,
                // the payload is the rest, whatever bytes it holds
                payload: b"{\"a\":\"x\ny\x01\"}",
            }
        );
        assert_eq!(lane_item(b"ord-7"), LaneItem::Bare(b"ord-7"));
        // written behind the scripts' back: read as the scripts read them
        for garbage in [&b"\x01"[..], b"\x01id", b"\x01id\nep\n1\n2"] {
            assert_eq!(lane_item(garbage), LaneItem::Bare(garbage));
        }
        let odd = lane_item(b"\x01id\nep\nx\n-1\n");
        assert_eq!(
            odd,
            LaneItem::Whole {
                id: b"id",
                endpoint: b"ep",
                seq: 0,
                enqueued_ms: 0,
                payload: b"",
            }
        );
    }

    #[test]
    fn a_queue_and_its_set_have_their_own_hash_tags() {
        let set = SetId::new("ns", "web");
        let p = queue_prefix(&set, QueueId::Shard(3));
        assert_eq!(p, format!("lk:{{ns/web/{}}}", QueueId::Shard(3)));
        assert_eq!(routing(&set), "lk:{ns/web}:routing");
        assert_eq!(endpoints(&set, "acme"), "lk:{ns/web}:endpoints:acme");
        assert_eq!(tiers(&set), "lk:{ns/web}:tiers");
        assert_eq!(tiers_api(&set), "lk:{ns/web}:tiers:api");
        assert_eq!(tiers_spec(&set), "lk:{ns/web}:tiers:spec");
        assert_eq!(paused_by_spec(&set), "lk:{ns/web}:pausedbyspec");
        assert_eq!(tiers_synced(&set), "lk:{ns/web}:tiers:synced");
        assert_eq!(pause_version(&set), "lk:{ns/web}:pausev");
        assert_eq!(audit(&set), "lk:{ns/web}:audit");
        assert_eq!(paused(&p), format!("{p}:paused"));
        assert_eq!(slot_guard(&p), format!("{p}:~slotguard"));
        assert_eq!(envelope(&p, "acme", "x"), format!("{p}:e:4:acme:x"));
        assert_eq!(set_queues_pattern(&set), "lk:{ns/web/*");
        assert_eq!(set_keys_pattern(&set), "lk:{ns/web}*");
        assert_eq!(sets_pattern("ns", "we"), "lk:{ns/we*");
    }
}
