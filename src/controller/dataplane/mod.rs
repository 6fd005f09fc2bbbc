//! What a ShardSet spec writes into its Redis, as one function,
//! [`apply_spec`], that the controller's Redis step and `lanekeeper
//! dataplane apply` (the data plane without Kubernetes) both call: the
//! routing table (shard count, epoch mark, durability; restored whole when
//! the mark is missing), the queue policy of every shard queue, the tier
//! assignments of `scheduler.tierAssignments`, and `spec.tenants` (tiers,
//! pauses). It takes no Kubernetes client: what it needs from outside Redis
//! comes in [`Sources`] (the lanes whose pins to restore, the tier source),
//! and what is worth reporting comes back as [`Note`]s, which the controller
//! turns into Events and the CLI prints.
//!
//! A shard-count change of a table that has one is a migration (tenants
//! move, see `controller::reshard`), which needs the shard Deployments up
//! first: the controller defers it to its reshard step
//! ([`ShardChange::Defer`]); the CLI refuses it before writing anything
//! ([`ShardChange::Refuse`]).

mod overrides;
mod tiers;

pub use tiers::{assignments, TierLoad, TierSource, MAX_CONFIG_TIERS};

use std::collections::BTreeSet;
use std::time::Duration;

use kube::ResourceExt;

use crate::controller::build::{
    check_redis_credentials, shard_deployments_upto, BuildError, PolicyViolation,
};
use crate::controller::lane;
use crate::crd::conditions;
use crate::crd::DedicatedLane;
use crate::crd::ShardSet;
use crate::crd::TenantOverridesStatus;
use crate::crd::TierAssignmentsStatus;
use crate::policy::QueuePolicy;
use crate::routing::{QueueId, RoutingTable};
use crate::store::{Store, StoreError};

/// Something one apply did or met that its caller reports: the controller
/// as an Event on the set, the CLI as a line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    /// The reason (`crd::conditions`), e.g. `PausedBySpec`.
    pub reason: &'static str,
    /// The Event's action, e.g. `PauseTenant`.
    pub action: &'static str,
    pub message: String,
}

impl Note {
    pub fn normal(reason: &'static str, action: &'static str, message: String) -> Self {
        Self {
            warning: false,
            reason,
            action,
            message,
        }
    }

    pub fn warning(reason: &'static str, action: &'static str, message: String) -> Self {
        Self {
            warning: true,
            reason,
            action,
            message,
        }
    }
}

/// What to do when the spec's shard count is not the table's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardChange {
    /// Leave the table's count: the caller's reshard step moves tenants
    /// (the controller, once the new shards' Deployments are up).
    Defer,
    /// Refuse before writing anything ([`ApplyError::ShardCountChange`]).
    Refuse,
}

/// What [`apply_spec`] needs from outside Redis.
pub struct Sources<'a, T> {
    /// The DedicatedLanes of the set's namespace, whose pins a restore
    /// writes back (none without Kubernetes).
    pub lanes: &'a [DedicatedLane],
    /// Shard queues whose policy is written beyond the spec's and the
    /// table's count (a shrink under way keeps its retiring queues).
    pub min_queues: u16,
    /// Where the text of `scheduler.tierAssignments` comes from.
    pub tiers: &'a T,
    pub shard_change: ShardChange,
}

/// What one [`apply_spec`] did.
#[derive(Clone, Debug)]
pub struct Applied {
    /// The table had no shard count: this apply wrote it.
    pub created: bool,
    /// The table had no epoch mark (a new set, or a Redis that lost its
    /// state): the shard count, queue policies and lane pins were written
    /// before the mark.
    pub rewritten: bool,
    /// Redis had lost the set's state (the status knew a mark): what was restored.
    pub lost: Option<String>,
    /// The mark Redis holds.
    pub epoch: String,
    /// Durability was not the spec's: written.
    pub durability_changed: bool,
    /// Shard queues whose policy was written (`shard-00` up to this).
    pub queues: u16,
    /// The routing table after the writes.
    pub table: RoutingTable,
    /// `scheduler.tierAssignments`, as status shows it (none when unset).
    pub tiers: Option<TierAssignmentsStatus>,
    /// `spec.tenants`, as status shows it (none when empty and nothing to undo).
    pub overrides: Option<TenantOverridesStatus>,
    pub notes: Vec<Note>,
}

/// Why [`apply_spec`] wrote nothing, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("spec.shards is {to}, but the set's routing table in Redis has {from} shards; nothing was written. Changing the shard count is a migration (the tenants whose hash shard changes are drained and moved one at a time), which only `lanekeeper controller` runs. Keep spec.shards: {from}; or run the set under the controller; or apply the spec under a new metadata.name (a new, empty set) and move producers and workers to it once this one is drained")]
    ShardCountChange { from: u16, to: u16 },
}

/// `spec.redis.durability` as producers read it: the replica wait of `Replicated`.
pub fn replicated(set: &ShardSet) -> Option<Duration> {
    match set.spec.redis.durability {
        crate::crd::Durability::Fast => None,
        crate::crd::Durability::Replicated => Some(set.spec.redis.replica_ack_timeout.into()),
    }
}

/// Write what the spec says into the set's Redis, in the order producers
/// and workers need it: the routing table (restored first when its epoch
/// mark is missing, see [`restore_routing`]), durability, the shard count of
/// a new table, the queue policies, tier assignments, `spec.tenants`.
/// Idempotent: applying the same spec again writes the same values (queue
/// policies are rewritten whole, tiers and pauses only where they differ).
/// The tier and `spec.tenants` parts never fail the apply: their trouble is
/// in [`Applied::tiers`] / [`Applied::overrides`] and the notes.
pub async fn apply_spec<T: TierSource + Sync>(
    set: &ShardSet,
    store: &Store,
    sources: Sources<'_, T>,
) -> Result<Applied, ApplyError> {
    let desired = set.spec.shards as u16;
    let mut table = store.routing().await?;
    if sources.shard_change == ShardChange::Refuse && table.shards != 0 && table.shards != desired {
        return Err(ApplyError::ShardCountChange {
            from: table.shards,
            to: desired,
        });
    }
    let created = table.shards == 0;
    let rewritten = table.epoch.is_none();
    let (epoch, lost) = restore_routing(set, store, &table, sources.lanes, desired).await?;
    if rewritten {
        table = store.routing().await?;
    }
    // What ingest's 202 means: producers read it with the routing table.
    let wanted = replicated(set);
    let durability_changed = table.replicated != wanted;
    if durability_changed {
        store.set_durability(wanted).await?;
        table.replicated = wanted;
    }
    if table.shards == 0 {
        // A table with a mark and no count (not written by this code): a new set.
        store.set_shards(desired).await?;
        table = store.routing().await?;
    }
    let policy = QueuePolicy::from_spec(&set.spec);
    let queues = desired.max(table.shards).max(sources.min_queues);
    for n in 0..queues {
        store.configure_queue(QueueId::Shard(n), &policy).await?;
    }
    let mut notes = Vec::new();
    if let Some(what) = &lost {
        notes.push(Note::warning(
            conditions::REDIS_STATE_LOST,
            "Restore",
            what.clone(),
        ));
    }
    let (tiers, note) = tiers::sync_tiers(set, store, sources.tiers).await;
    notes.extend(note);
    let (overrides, more) = overrides::sync_overrides(set, store, &table).await;
    notes.extend(more);
    Ok(Applied {
        created,
        rewritten,
        lost,
        epoch,
        durability_changed,
        queues,
        table,
        tiers,
        overrides,
        notes,
    })
}

/// Give the set's routing table its epoch mark, first rewriting what the
/// controller knows when the mark is missing: the queue policies of the
/// shards and lanes, the pins of the lanes that serve their tenants (from
/// the DedicatedLanes' recorded phases), then the shard count, then the
/// mark. Pins go before the shard count, so a producer never routes by a
/// table that forgot a lane (it sees no table until the count is back).
/// Returns the mark and, when Redis had lost the set's state (the status
/// knew a mark, or lanes were pinned and the table is empty), what was
/// restored.
pub async fn restore_routing(
    set: &ShardSet,
    store: &Store,
    table: &RoutingTable,
    lanes: &[DedicatedLane],
    desired: u16,
) -> Result<(String, Option<String>), StoreError> {
    if let Some(epoch) = &table.epoch {
        return Ok((epoch.clone(), None));
    }
    let name = set.name_any();
    let known = set.status.as_ref().and_then(|s| s.redis_epoch.clone());
    let policy = QueuePolicy::from_spec(&set.spec);
    let shards = if table.shards == 0 {
        desired
    } else {
        table.shards
    };
    for n in 0..shards.max(desired) {
        store.configure_queue(QueueId::Shard(n), &policy).await?;
    }
    let mut pins = Vec::new();
    for lane in lanes.iter().filter(|l| l.spec.shard_set == name) {
        if let Some(q) = lane.status.as_ref().and_then(lane::pinned_lane) {
            store.configure_queue(q, &policy).await?;
            if table.pins.get(&lane.spec.tenant) != Some(&q) {
                store.pin(&lane.spec.tenant, q).await?;
            }
            pins.push(format!("{}→{q}", lane.spec.tenant));
        }
    }
    store.set_durability(replicated(set)).await?;
    if table.shards == 0 {
        store.set_shards(desired).await?;
    }
    let mark = format!("{:016x}", rand::random::<u64>());
    let held = store.mark_epoch(&mark).await?;
    let lost = known.is_some() || (table.shards == 0 && !pins.is_empty());
    let what = lost.then(|| {
        format!(
            "Redis lost this set's state: the routing table {} was gone{}. Restored: the shard count ({shards}), the queue policies of {} queues, and {}. Ingest answered 503 \"routing table missing\" and workers waited meanwhile. Envelopes queued before the loss, and the tenants' endpoints registered through ingest, were in that Redis too: re-register endpoints unless Redis restored them from persistence",
            if known.is_some() { "and its epoch mark" } else { "" },
            known.map(|k| format!(" (epoch {k}, now {held})")).unwrap_or_default(),
            shards.max(desired) as usize + pins.len(),
            if pins.is_empty() {
                "no lane pins (no lane was serving a tenant)".to_string()
            } else {
                format!("the lane pins {}", pins.join(", "))
            }
        )
    });
    Ok((held, what))
}

/// Why a spec cannot be applied, found without Redis or Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// What the controller's build refuses (`spec.shards` out of range, ...).
    #[error("{0}")]
    Build(#[from] BuildError),
    /// What the controller refuses as policy (`spec.redis.passwordSecretRef`).
    #[error("{0}")]
    Policy(#[from] PolicyViolation),
    /// What the API server's schema refuses and Rust can check too.
    #[error("{field}: {message}")]
    Field { field: String, message: String },
}

/// `set` as the Deployment builder needs it when it was not read from an
/// API server: in namespace `default` if it names none, with a stand-in uid.
pub fn standalone(set: &ShardSet) -> ShardSet {
    let mut built = set.clone();
    built
        .metadata
        .namespace
        .get_or_insert_with(|| "default".into());
    built
        .metadata
        .uid
        .get_or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
    built
}

/// The checks of a spec that need neither Redis nor Kubernetes: the
/// controller's own (its build of the shard Deployments, and the Redis
/// credentials rule), then those of the CRD's schema that have a Rust
/// equivalent and guard what goes into Redis keys or where the CLI
/// connects: the set's name and namespace (RFC 1123; the name at most 52
/// characters, the CEL rule), `spec.redis.url` (scheme, no credentials),
/// `spec.tenants[].tenant` (the tenant id rule), `spec.tenants[].tier` (the
/// tier name rule), one entry per tenant (the list-map key). Pure; a set not read from the API server is built
/// with a stand-in uid.
pub fn check_spec(set: &ShardSet) -> Result<(), SpecError> {
    let field = |field: &str, message: String| SpecError::Field {
        field: field.to_string(),
        message,
    };
    let name = set.metadata.name.as_deref().unwrap_or_default();
    if name.is_empty() {
        return Err(field("metadata.name", "is required".into()));
    }
    if name.len() > 52 {
        return Err(field("metadata.name", "must be at most 52 characters: it prefixes the shard and lane Deployment names (<name>-shard-NNNN), which must fit a 63-character label".into()));
    }
    // What the API server asks of a name and a namespace (RFC 1123): the
    // set id `<namespace>/<name>` is part of every Redis key of the set.
    let rfc1123 = |s: &str, dots: bool| {
        let ok_char = |c: char| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (dots && c == '.')
        };
        let edge =
            |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        s.chars().all(ok_char) && edge(s.chars().next()) && edge(s.chars().last())
    };
    if !rfc1123(name, true) {
        return Err(field("metadata.name", format!("{name:?} is not a valid name: lower case letters, digits, '-' and '.', starting and ending with a letter or digit")));
    }
    if let Some(ns) = &set.metadata.namespace {
        if ns.len() > 63 || !rfc1123(ns, false) {
            return Err(field("metadata.namespace", format!("{ns:?} is not a valid namespace: at most 63 lower case letters, digits and '-', starting and ending with a letter or digit")));
        }
    }
    // The CEL rules on spec.redis.url.
    if let Some(url) = &set.spec.redis.url {
        let rest = [
            "rediss+cluster://",
            "redis+cluster://",
            "rediss://",
            "redis://",
        ]
        .iter()
        .find_map(|p| url.strip_prefix(p));
        match rest {
            None => return Err(field("spec.redis.url", "must start with redis://, rediss://, redis+cluster:// or rediss+cluster://".into())),
            Some(rest) if rest.split('/').next().unwrap_or_default().contains('@') => {
                return Err(field("spec.redis.url", "must not carry credentials; use passwordSecretRef or urlSecretRef (or, without Kubernetes, --redis-password)".into()))
            }
            Some(_) => {}
        }
    }
    shard_deployments_upto(&standalone(set), 0)?;
    check_redis_credentials(&set.spec.redis)?;
    let mut seen = BTreeSet::new();
    for (i, o) in set.spec.tenants.iter().enumerate() {
        if let Err(e) = crate::envelope::validate_tenant(&o.tenant) {
            return Err(field(&format!("spec.tenants[{i}].tenant"), e.reason));
        }
        if !seen.insert(o.tenant.as_str()) {
            return Err(field(
                &format!("spec.tenants[{i}].tenant"),
                format!("{} is listed twice (one entry per tenant)", o.tenant),
            ));
        }
        if let Some(tier) = &o.tier {
            if let Err(e) = crate::policy::tiers::check_tier_name(tier) {
                return Err(field(&format!("spec.tenants[{i}].tier"), e));
            }
        }
    }
    if set.spec.tenants.len() > 1000 {
        return Err(field(
            "spec.tenants",
            format!("has {} entries, at most 1000", set.spec.tenants.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ShardSetSpec;

    fn set(spec: serde_json::Value) -> ShardSet {
        let spec: ShardSetSpec = serde_json::from_value(spec).unwrap();
        ShardSet::new("hooks", spec)
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "shards": 2,
            "redis": {"url": "redis://r:6379"},
            "worker": {"image": "w:1"},
        })
    }

    #[test]
    fn a_plain_spec_passes_without_namespace_or_uid() {
        check_spec(&set(base())).unwrap();
    }

    #[test]
    fn each_refusal_names_its_field() {
        let with = |patch: serde_json::Value| {
            let mut v = base();
            for (k, val) in patch.as_object().unwrap() {
                v[k] = val.clone();
            }
            check_spec(&set(v)).unwrap_err().to_string()
        };
        let e = with(serde_json::json!({"shards": 0}));
        assert!(e.contains("spec.shards 0"), "{e}");
        let e = with(serde_json::json!({"shards": 1025}));
        assert!(e.contains("spec.shards 1025"), "{e}");
        let e = with(
            serde_json::json!({"redis": {"url": "redis://r", "passwordSecretRef": {"name": "s", "key": "k"}}}),
        );
        assert!(e.starts_with("spec.redis.passwordSecretRef"), "{e}");
        let e = with(serde_json::json!({"tenants": [{"tenant": "bad tenant"}]}));
        assert!(e.starts_with("spec.tenants[0].tenant"), "{e}");
        let e = with(serde_json::json!({"tenants": [{"tenant": "a"}, {"tenant": "a"}]}));
        assert!(
            e.starts_with("spec.tenants[1].tenant") && e.contains("twice"),
            "{e}"
        );
        let e = with(serde_json::json!({"tenants": [{"tenant": "a", "tier": "no good"}]}));
        assert!(e.starts_with("spec.tenants[0].tier"), "{e}");
        let e = with(serde_json::json!({"redis": {"url": "redis://:pw@r:6379"}}));
        assert!(e.starts_with("spec.redis.url") && !e.contains("pw@"), "{e}");
        let e = with(serde_json::json!({"redis": {"url": "http://r:6379"}}));
        assert!(e.starts_with("spec.redis.url"), "{e}");
        let mut bad = set(base());
        bad.metadata.namespace = Some("a/b".into());
        let e = check_spec(&bad).unwrap_err().to_string();
        assert!(e.starts_with("metadata.namespace"), "{e}");
        bad.metadata.namespace = None;
        bad.metadata.name = Some("Hooks".into());
        let e = check_spec(&bad).unwrap_err().to_string();
        assert!(e.starts_with("metadata.name"), "{e}");
        let mut long = set(base());
        long.metadata.name = Some("x".repeat(53));
        let e = check_spec(&long).unwrap_err().to_string();
        assert!(e.starts_with("metadata.name"), "{e}");
    }

    #[test]
    fn the_shard_count_refusal_names_the_field_and_what_to_do() {
        let e = ApplyError::ShardCountChange { from: 2, to: 3 }.to_string();
        for part in [
            "spec.shards is 3",
            "has 2 shards",
            "nothing was written",
            "Keep spec.shards: 2",
            "metadata.name",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }
}
