//! Promotion and demotion with hysteresis: which tenants deserve a dedicated
//! lane (pure, [`evaluate`]), and the periodic loop that measures each
//! ShardSet's tenants, records the candidates in its status and creates or
//! retires DedicatedLanes ([`run`]).
//!
//! The rules themselves are in [`crate::policy::promotion`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{
    DedicatedLane, DedicatedLaneSpec, DemotionCandidate, LanePhase, PromotionCandidate,
    PromotionSpec, ShardSet,
};
use crate::policy::attribution::covered;
use crate::policy::promotion::{
    evaluate, lane_share, shard_observations, Candidate, Decision, Observation, Thresholds,
};
use crate::routing::{hash_shard, QueueId};

use super::Context;

/// Field manager of the candidate lists in ShardSet status.
pub const FIELD_MANAGER: &str = "lanekeeper-promotion";
/// Label on DedicatedLanes the promotion loop created (it deletes them once retired).
pub const ORIGIN_LABEL: &str = "lanekeeper.io/origin";
pub const ORIGIN_PROMOTION: &str = "promotion";
/// A DedicatedLane name for `tenant` of `set`: `<set>-<tenant>` when the
/// tenant id is already a DNS label, else a sanitised form with a hash suffix
/// so that distinct tenants never collide.
pub fn lane_name(set: &str, tenant: &str) -> String {
    let clean: String = tenant
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let clean = clean.trim_matches('-');
    // <set (at most 52)>-<160>-<8 hex>: within the CEL bound of 230.
    let mut clean: String = clean.chars().take(160).collect();
    if clean != tenant || clean.is_empty() {
        let h = crate::routing::score(tenant, QueueId::Lane(0));
        clean = format!("{}-{:08x}", clean.trim_end_matches('-'), h as u32);
        clean = clean.trim_start_matches('-').to_string();
    }
    format!("{set}-{clean}")
}

/// The thresholds of a set's `spec.promotion`.
pub fn thresholds(spec: &PromotionSpec) -> Thresholds {
    Thresholds {
        promote_share: spec.promote_share,
        promote_after: spec.promote_after.into(),
        demote_share: spec.demote_share,
        demote_after: spec.demote_after.into(),
        projected_wait: spec.projected_wait.map(Into::into),
    }
}

/// A candidate's fields as status holds them.
fn in_status(c: &Candidate) -> (String, String, f64, Time) {
    let since = Timestamp::from_millisecond(c.since_ms).unwrap_or(Timestamp::UNIX_EPOCH);
    (c.tenant.clone(), c.queue.clone(), c.share, Time(since))
}

fn from_status(tenant: &str, queue: &str, share: f64, since: &Time) -> Candidate {
    let (tenant, queue) = (tenant.to_string(), queue.to_string());
    let since_ms = since.0.as_millisecond();
    Candidate {
        tenant,
        queue,
        share,
        since_ms,
        projected_wait_s: None,
    }
}

/// A hot tenant as status records it.
pub fn hot_in_status(c: &Candidate) -> PromotionCandidate {
    let (tenant, queue, share, hot_since) = in_status(c);
    PromotionCandidate {
        tenant,
        queue,
        share,
        hot_since,
        projected_wait_seconds: c.projected_wait_s,
    }
}

/// A cold tenant as status records it.
pub fn cold_in_status(c: &Candidate) -> DemotionCandidate {
    let (tenant, queue, share, cold_since) = in_status(c);
    DemotionCandidate {
        tenant,
        queue,
        share,
        cold_since,
    }
}

fn hot_from_status(c: &PromotionCandidate) -> Candidate {
    Candidate {
        projected_wait_s: c.projected_wait_seconds,
        ..from_status(&c.tenant, &c.queue, c.share, &c.hot_since)
    }
}

fn cold_from_status(c: &DemotionCandidate) -> Candidate {
    from_status(&c.tenant, &c.queue, c.share, &c.cold_since)
}

/// Sets measured at once by the promotion loop.
pub const PROMOTION_CONCURRENCY: usize = 16;

/// The longest one set's promotion tick may take: its period, at least 1 s
/// and at most 30 s. A set past it is abandoned for this round.
pub fn set_deadline(tick: Duration) -> Duration {
    tick.clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// The promotion loop: every `tick`, each ShardSet in scope is measured.
/// Sets are isolated from each other: each is measured in its own task, at
/// most [`PROMOTION_CONCURRENCY`] at once, each within [`set_deadline`], and a
/// set whose previous round still runs is skipped, so a Redis that accepts
/// and never answers delays only its own sets.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>, tick: Duration) {
    let sets: Api<DeserializeGuard<ShardSet>> =
        super::api::scoped(&ctx.client, namespace.as_deref());
    let mut interval = tokio::time::interval(tick.max(Duration::from_millis(100)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let permits = Arc::new(tokio::sync::Semaphore::new(PROMOTION_CONCURRENCY));
    let running: Arc<std::sync::Mutex<BTreeSet<(String, String)>>> = Arc::default();
    let deadline = set_deadline(tick);
    loop {
        interval.tick().await;
        let list = match sets.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "promotion: cannot list ShardSets");
                continue;
            }
        };
        // The Redis connections of sets that are gone are closed.
        let live: std::collections::HashSet<crate::store::SetId> = list
            .items
            .iter()
            .map(|s| {
                let meta = match &s.0 {
                    Ok(set) => &set.metadata,
                    Err(invalid) => &invalid.metadata,
                };
                crate::store::SetId::new(
                    meta.namespace.clone().unwrap_or_default(),
                    meta.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        ctx.prune_stores(&live);
        for set in list.items.into_iter().filter_map(|s| s.0.ok()) {
            if set.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let key = (set.namespace().unwrap_or_default(), set.name_any());
            if !running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone())
            {
                continue;
            }
            let (ctx, permits, running) = (ctx.clone(), permits.clone(), running.clone());
            tokio::spawn(async move {
                if let Ok(_permit) = permits.acquire_owned().await {
                    match tokio::time::timeout(deadline, tick_set(&set, &ctx)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            warn!(set = %set.name_any(), error = %e, "promotion: tick failed")
                        }
                        Err(_) => warn!(
                            set = %set.name_any(),
                            ?deadline,
                            "promotion: tick abandoned past its deadline"
                        ),
                    }
                }
                running
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&key);
            });
        }
    }
}

/// One tick for one set: measure, decide, act, record.
#[tracing::instrument(name = "promotion_tick", skip_all, fields(namespace = %set.namespace().unwrap_or_default(), shard_set = %set.name_any()))]
async fn tick_set(set: &ShardSet, ctx: &Context) -> anyhow::Result<()> {
    let ns = set.namespace().unwrap_or_default();
    let name = set.name_any();
    let spec = &set.spec.promotion;
    let sets: Api<ShardSet> = Api::namespaced(ctx.client.clone(), &ns);
    let prev = set.status.clone().unwrap_or_default();
    if set.metadata.deletion_timestamp.is_some() {
        // Being deleted: its finalizer retires its lanes; promote nobody.
        return Ok(());
    }
    if !spec.enabled {
        if !prev.promotion_candidates.is_empty() || !prev.demotion_candidates.is_empty() {
            write_candidates(&sets, &name, &Decision::default()).await?;
        }
        if !prev.shaped_tenants.is_empty() {
            // Lift every shaping: nothing measures it any more.
            let store = super::store_for(set, ctx)
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
            super::shaping::tick(set, ctx, &store, &[], &BTreeMap::new(), 0.0, Duration::ZERO)
                .await?;
        }
        return Ok(());
    }
    let store = super::store_for(set, ctx)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let routing = store.routing().await?;
    let lanes_api: Api<DedicatedLane> = Api::namespaced(ctx.client.clone(), &ns);
    // Guarded: a lane this version cannot decode must not stop promotion.
    let guarded: Api<DeserializeGuard<DedicatedLane>> = Api::namespaced(ctx.client.clone(), &ns);
    let lanes: Vec<DedicatedLane> =
        super::api::decoded(guarded.list(&ListParams::default()).await?.items, &name)
            .into_iter()
            .filter(|l| l.spec.shard_set == name)
            .collect();
    let with_lane: BTreeSet<String> = lanes.iter().map(|l| l.spec.tenant.clone()).collect();
    // Tenants whose lane waits at the cap: measured for shaping, not promotion.
    let at_cap = super::shaping::waiting_for_cap(&lanes);

    // Read as whole buckets plus the current, partial one: a share read just
    // after a bucket turns over still rests on a full window.
    let window = Duration::from(spec.window);
    let now = Timestamp::now();
    let covered = covered(window, now.as_millisecond().max(0) as u64);
    let workers = f64::from(set.spec.worker.replicas.unwrap_or(1).max(0))
        * f64::from(set.spec.worker.concurrency);
    let shards = routing.shards.max(1);
    let mut observations = Vec::new();
    let mut waiting = Vec::new();
    let mut shard_seconds: BTreeMap<QueueId, f64> = BTreeMap::new();
    let mut shard_stats: BTreeMap<QueueId, Vec<crate::policy::TenantStats>> = BTreeMap::new();
    for n in 0..shards {
        let q = QueueId::Shard(n);
        let stats = store.tenant_stats(q, window).await?;
        shard_seconds.insert(q, stats.iter().map(|t| t.worker_seconds).sum());
        for o in shard_observations(q, &stats, workers, covered, &BTreeSet::new()) {
            if at_cap.contains(&o.tenant) {
                waiting.push(o);
            } else if !with_lane.contains(&o.tenant) {
                observations.push(o);
            }
        }
        if !at_cap.is_empty() {
            shard_stats.insert(q, stats);
        }
    }
    for lane in &lanes {
        let st = lane.status.clone().unwrap_or_default();
        let (LanePhase::Active, Some(index), false, None) = (
            st.phase,
            st.lane_index,
            lane.spec.retire,
            &lane.metadata.deletion_timestamp,
        ) else {
            continue;
        };
        let q = QueueId::Lane(index as u8);
        let on_lane: f64 = store
            .tenant_stats(q, window)
            .await?
            .iter()
            .filter(|t| t.tenant == lane.spec.tenant)
            .map(|t| t.worker_seconds)
            .sum();
        let home = hash_shard(&lane.spec.tenant, shards);
        observations.push(Observation {
            tenant: lane.spec.tenant.clone(),
            queue: q,
            share: lane_share(on_lane, shard_seconds.get(&home).copied().unwrap_or(0.0)),
            contended: false,
            laned: true,
            projected_wait: None,
        });
    }
    let prev_hot: Vec<Candidate> = prev
        .promotion_candidates
        .iter()
        .map(hot_from_status)
        .collect();
    let prev_cold: Vec<Candidate> = prev
        .demotion_candidates
        .iter()
        .map(cold_from_status)
        .collect();
    let decision = evaluate(
        &thresholds(spec),
        now.as_millisecond(),
        &prev_hot,
        &prev_cold,
        &observations,
    );
    for tenant in &decision.promote {
        let lane = DedicatedLane {
            metadata: kube::api::ObjectMeta {
                name: Some(lane_name(&name, tenant)),
                namespace: Some(ns.clone()),
                labels: Some(BTreeMap::from([
                    (ORIGIN_LABEL.to_string(), ORIGIN_PROMOTION.to_string()),
                    ("app.kubernetes.io/instance".to_string(), name.clone()),
                ])),
                owner_references: set.controller_owner_ref(&()).map(|mut o| {
                    o.block_owner_deletion = Some(true);
                    vec![o]
                }),
                ..Default::default()
            },
            spec: DedicatedLaneSpec {
                shard_set: name.clone(),
                tenant: tenant.clone(),
                worker: None,
                retire: false,
            },
            status: None,
        };
        match lanes_api.create(&PostParams::default(), &lane).await {
            Ok(_) => info!(set = %name, %tenant, "promoting: DedicatedLane created"),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    for tenant in &decision.demote {
        if let Some(lane) = lane_to_demote(&lanes, tenant) {
            info!(set = %name, %tenant, lane = %lane.name_any(), "demoting: retire set");
            lanes_api
                .patch(
                    &lane.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {"retire": true}})),
                )
                .await?;
        }
    }
    if decision.hot != prev_hot || decision.cold != prev_cold {
        write_candidates(&sets, &name, &decision).await?;
    }
    super::shaping::tick(set, ctx, &store, &waiting, &shard_stats, workers, covered).await?;
    tracing::debug!(namespace = %ns, set = %name, "promotion: set measured");
    Ok(())
}

/// The lane to retire when `tenant` is demoted: the one that serves it
/// (Active with an index, not already retiring or deleted), not merely the
/// first lane of that tenant by name (a duplicate lane waiting with
/// `DuplicateTenant` serves nothing). Pure.
pub fn lane_to_demote<'a>(lanes: &'a [DedicatedLane], tenant: &str) -> Option<&'a DedicatedLane> {
    lanes.iter().find(|l| {
        let st = l.status.clone().unwrap_or_default();
        l.spec.tenant == tenant
            && st.phase == LanePhase::Active
            && st.lane_index.is_some()
            && !l.spec.retire
            && l.metadata.deletion_timestamp.is_none()
    })
}

async fn write_candidates(sets: &Api<ShardSet>, name: &str, d: &Decision) -> kube::Result<()> {
    let status = serde_json::json!({
        "promotionCandidates": d.hot.iter().map(hot_in_status).collect::<Vec<_>>(),
        "demotionCandidates": d.cold.iter().map(cold_in_status).collect::<Vec<_>>(),
    });
    super::api::apply_status(sets, name, FIELD_MANAGER, &status).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_names() {
        assert_eq!(lane_name("hooks", "whale"), "hooks-whale");
        let odd = lane_name("hooks", "Big.Import:1");
        assert!(odd.starts_with("hooks-ig-import-1-") || odd.starts_with("hooks-"));
        assert!(odd
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
        assert_ne!(lane_name("hooks", "A"), lane_name("hooks", "a-"));
    }

    #[test]
    fn candidates_round_trip_through_status() {
        let c = Candidate {
            tenant: "whale".into(),
            queue: "shard-03".into(),
            share: 0.412,
            since_ms: 1_000_004_123,
            projected_wait_s: None,
        };
        assert_eq!(hot_from_status(&hot_in_status(&c)), c);
        assert_eq!(cold_from_status(&cold_in_status(&c)), c);
        let trending = Candidate {
            projected_wait_s: Some(1250.0),
            ..c
        };
        assert_eq!(hot_from_status(&hot_in_status(&trending)), trending);
    }

    #[test]
    fn demotion_retires_the_lane_that_serves_the_tenant_not_a_duplicate() {
        let lane = |name: &str, tenant: &str, status: serde_json::Value| -> DedicatedLane {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "lanekeeper.io/v1alpha1",
                "kind": "DedicatedLane",
                "metadata": {"name": name},
                "spec": {"shardSet": "hooks", "tenant": tenant},
                "status": status,
            }))
            .unwrap()
        };
        // "a-dup" sorts first and waits as a duplicate; "b-whale" serves.
        let lanes = vec![
            lane("a-dup", "whale", serde_json::json!({"phase": "Pending"})),
            lane(
                "b-whale",
                "whale",
                serde_json::json!({"phase": "Active", "laneIndex": 3}),
            ),
            lane(
                "c-other",
                "other",
                serde_json::json!({"phase": "Active", "laneIndex": 0}),
            ),
        ];
        assert_eq!(
            lane_to_demote(&lanes, "whale").map(|l| l.name_any()),
            Some("b-whale".to_string())
        );
        assert_eq!(
            lane_to_demote(&lanes, "other").map(|l| l.name_any()),
            Some("c-other".to_string())
        );
        // Nothing serves it: nothing to patch.
        let waiting = vec![lane(
            "a-dup",
            "whale",
            serde_json::json!({"phase": "Pending"}),
        )];
        assert!(lane_to_demote(&waiting, "whale").is_none());
        assert!(lane_to_demote(&lanes, "nobody").is_none());
    }
}
