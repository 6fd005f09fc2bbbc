//! Shaping at ingest, the promotion loop's last step: a hot tenant whose
//! lane waits at the cap is shaped to the rate its fair share drains
//! (`promotion.atCap: ShapeAtIngest`), recorded in `status.shapedTenants`
//! with an Event, and lifted when its lane is admitted or its producer has
//! not been refused for the promotion window. The rules are in
//! [`crate::policy::shaping`]; the bucket is spent by the enqueue script.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use tracing::info;

use crate::crd::{AtCap, DedicatedLane, Ordering, ShapedTenant, ShardSet};
use crate::policy::promotion::Observation;
use crate::policy::shaping::{burst, decide, fair_rate, to_clear, Other, Shaped, Waiting};
use crate::policy::TenantStats;
use crate::routing::QueueId;
use crate::store::Store;

use super::Context;

/// Field manager of `status.shapedTenants`.
pub const FIELD_MANAGER: &str = "lanekeeper-shaping";

/// Event reasons.
pub const SHAPED: &str = "Shaped";
pub const UNSHAPED: &str = "Unshaped";

/// Tenants whose lane waits at the cap (not retiring, not deleted). Pure.
pub fn waiting_for_cap(lanes: &[DedicatedLane]) -> BTreeSet<String> {
    lanes
        .iter()
        .filter(|l| {
            crate::controller::lane::waits_for_cap(l)
                && !l.spec.retire
                && l.metadata.deletion_timestamp.is_none()
        })
        .map(|l| l.spec.tenant.clone())
        .collect()
}

fn in_status(s: &Shaped) -> ShapedTenant {
    ShapedTenant {
        tenant: s.tenant.clone(),
        queue: s.queue.clone(),
        per_second: s.per_second,
        since: Time(Timestamp::from_millisecond(s.since_ms).unwrap_or(Timestamp::UNIX_EPOCH)),
    }
}

fn from_status(s: &ShapedTenant) -> Shaped {
    Shaped {
        tenant: s.tenant.clone(),
        queue: s.queue.clone(),
        per_second: s.per_second,
        since_ms: s.since.0.as_millisecond(),
    }
}

/// A tenant's weight as the spec gives it (its `spec.tenants` override,
/// else its `scheduler.weights` entry, else the default; a tier's weight
/// lives in Redis and is not read here). Pure.
fn weight_of(set: &ShardSet, tenant: &str) -> f64 {
    let s = &set.spec.scheduler;
    set.spec
        .tenants
        .iter()
        .find(|o| o.tenant == tenant)
        .and_then(|o| o.weight)
        .or_else(|| {
            s.weights
                .iter()
                .find(|w| w.tenant == tenant)
                .map(|w| w.weight)
        })
        .unwrap_or(s.default_weight)
}

/// The rate a waiting tenant is shaped to, from its shard's stats over
/// `covered` and its cost estimate. Pure.
pub fn rate_for(
    set: &ShardSet,
    stats: &[TenantStats],
    tenant: &str,
    slots: f64,
    covered: Duration,
    cost_s: f64,
) -> f64 {
    let secs = covered.as_secs_f64().max(1.0);
    let others: Vec<Other> = stats
        .iter()
        .filter(|t| t.tenant != tenant && (t.depth > 0 || t.worker_seconds > 0.0))
        .map(|t| Other {
            weight: weight_of(set, &t.tenant),
            used_slots: t.worker_seconds / secs,
        })
        .collect();
    // strict order holds a tenant to one slot under tenant isolation; under
    // endpoint isolation each endpoint has one, and the tenant keeps its cap
    let strict = set.spec.scheduler.ordering == Ordering::PerTenant
        && set.spec.isolation == crate::crd::Isolation::Tenant;
    let cap = if strict {
        1.0
    } else {
        f64::from(
            set.spec
                .tenants
                .iter()
                .find(|o| o.tenant == tenant)
                .and_then(|o| o.max_in_flight)
                .unwrap_or(set.spec.scheduler.max_in_flight_per_tenant)
                .max(1),
        )
    };
    fair_rate(slots, &others, weight_of(set, tenant), cap, cost_s)
}

/// One tick of shaping for `set`. `waiting` holds the observations of the
/// tenants whose lane waits at the cap and `stats` each shard's tenant
/// figures, as the promotion tick read them.
pub async fn tick(
    set: &ShardSet,
    ctx: &Context,
    store: &Store,
    waiting: &[Observation],
    stats: &BTreeMap<QueueId, Vec<TenantStats>>,
    slots: f64,
    covered: Duration,
) -> anyhow::Result<()> {
    let promotion = &set.spec.promotion;
    let prev: Vec<Shaped> = set
        .status
        .as_ref()
        .map(|s| s.shaped_tenants.iter().map(from_status).collect())
        .unwrap_or_default();
    let window = Duration::from(promotion.window);
    let mut measured = Vec::new();
    if promotion.enabled && promotion.at_cap == AtCap::ShapeAtIngest {
        for o in waiting {
            let activity = store.tenant_activity(o.queue, &o.tenant, window).await?;
            let shaping = store.shaping(o.queue, &o.tenant).await?;
            let cost = activity.estimate_s.unwrap_or(1.0);
            let empty = Vec::new();
            let shard = stats.get(&o.queue).unwrap_or(&empty);
            measured.push(Waiting {
                observation: o.clone(),
                rate: rate_for(set, shard, &o.tenant, slots, covered, cost),
                last_refused_ms: shaping.last_refused_ms,
            });
        }
    }
    let now = Timestamp::now().as_millisecond();
    let d = decide(&prev, &measured, promotion.promote_share, window, now);
    // Every tick: a Redis that lost the rate gets it back.
    for s in &d.shaped {
        if let Ok(q) = s.queue.parse::<QueueId>() {
            store
                .set_shaping(q, &s.tenant, Some((s.per_second, burst(s.per_second))))
                .await?;
        }
    }
    for (t, q) in to_clear(&prev, &d) {
        if let Ok(q) = q.parse::<QueueId>() {
            store.set_shaping(q, &t, None).await?;
        }
    }
    let name = set.name_any();
    let oref = set.object_ref(&());
    for s in d.shaped.iter().filter(|s| d.started.contains(&s.tenant)) {
        info!(set = %name, tenant = %s.tenant, per_second = s.per_second, "shaping at ingest");
        ctx.event(
            &oref,
            EventType::Normal,
            SHAPED,
            "Shape",
            format!(
                "tenant {} is hot and its lane waits at the lane cap ({}): ingest admits its events at {}/s, its fair share of {}, and answers 429 beyond it",
                s.tenant, promotion.max_lanes, s.per_second, s.queue
            ),
        )
        .await;
    }
    for t in &d.lifted {
        info!(set = %name, tenant = %t, "shaping lifted");
        ctx.event(
            &oref,
            EventType::Normal,
            UNSHAPED,
            "Unshape",
            format!("tenant {t} is no longer shaped at ingest: its lane was admitted, or its producer stayed under its rate for {}", promotion.window),
        )
        .await;
    }
    let changed = d.shaped.len() != prev.len() || d.shaped.iter().zip(&prev).any(|(a, b)| a != b);
    if changed {
        let sets: Api<ShardSet> =
            Api::namespaced(ctx.client.clone(), &set.namespace().unwrap_or_default());
        let status = serde_json::json!({
            "shapedTenants": d.shaped.iter().map(in_status).collect::<Vec<_>>(),
        });
        super::api::apply_status(&sets, &name, FIELD_MANAGER, &status).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(yaml: &str) -> ShardSet {
        serde_yaml::from_str(&format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: hooks, namespace: prod}}\nspec:\n  shards: 4\n  redis: {{url: \"redis://r:6379\"}}\n{yaml}"
        ))
        .unwrap()
    }

    fn stat(t: &str, depth: u64, ws: f64) -> TenantStats {
        TenantStats {
            tenant: t.into(),
            depth,
            delivered: 0,
            failed: 0,
            worker_seconds: ws,
            ..Default::default()
        }
    }

    #[test]
    fn the_rate_counts_active_tenants_weights_and_the_cap() {
        // Over 10 s: the others kept 2, 1 and 0.5 slots busy, one is idle.
        let stats = vec![
            stat("w", 900, 30.0),
            stat("a", 1, 20.0),
            stat("b", 0, 10.0),
            stat("c", 0, 5.0),
            stat("idle", 0, 0.0),
        ];
        let s =
            set("  worker: {image: x, concurrency: 16}\n  scheduler: {maxInFlightPerTenant: 16}\n");
        let ten = Duration::from_secs(10);
        // 16 slots: 3.5 used by the others, 12.5 left at 0.1 s a delivery;
        // the default in-flight cap (8) bounds it.
        assert_eq!(rate_for(&s, &stats, "w", 16.0, ten, 0.1), 125.0);
        let capped = set("  worker: {image: x, concurrency: 16}\n");
        assert_eq!(rate_for(&capped, &stats, "w", 16.0, ten, 0.1), 80.0);
        // 4 slots: 1 each would be the equal part; b and c use less (1.5),
        // a and w split the 2.5 left.
        assert_eq!(rate_for(&s, &stats, "w", 4.0, ten, 0.1), 12.5);
        let weighted =
            set("  worker: {image: x}\n  scheduler: {weights: [{tenant: w, weight: 4}]}\n");
        // c keeps its 0.5; w (4) and a, b (1 each) split 3.5 by weight.
        assert_eq!(rate_for(&weighted, &stats, "w", 4.0, ten, 0.1), 23.33);
        let ordered = set("  worker: {image: x}\n  scheduler: {ordering: PerTenant}\n");
        assert_eq!(rate_for(&ordered, &stats, "w", 16.0, ten, 0.1), 10.0);
        // under endpoint isolation strict order is per endpoint: the tenant keeps its cap
        let per_endpoint = set(
            "  worker: {image: x, concurrency: 16}\n  isolation: Endpoint\n  scheduler: {ordering: PerTenant}\n",
        );
        assert_eq!(rate_for(&per_endpoint, &stats, "w", 16.0, ten, 0.1), 80.0);
        // spec.tenants overrides the weight and the cap, as the scripts do
        let overridden = set(
            "  worker: {image: x, concurrency: 16}\n  scheduler: {weights: [{tenant: w, weight: 1}]}\n  tenants: [{tenant: w, weight: 4, maxInFlight: 16}]\n",
        );
        assert_eq!(rate_for(&overridden, &stats, "w", 4.0, ten, 0.1), 23.33);
        assert_eq!(rate_for(&overridden, &stats, "w", 16.0, ten, 0.1), 125.0);
    }

    #[test]
    fn shaped_tenants_round_trip_through_status() {
        let s = Shaped {
            tenant: "w".into(),
            queue: "shard-01".into(),
            per_second: 12.5,
            since_ms: 1_700_000_000_123,
        };
        assert_eq!(from_status(&in_status(&s)), s);
    }

    #[test]
    fn at_cap_defaults_to_wait() {
        let s = set("  worker: {image: x}\n");
        assert_eq!(s.spec.promotion.at_cap, AtCap::Wait);
        let s = set("  worker: {image: x}\n  promotion: {atCap: ShapeAtIngest}\n");
        assert_eq!(s.spec.promotion.at_cap, AtCap::ShapeAtIngest);
    }
}
