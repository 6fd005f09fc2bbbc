//! Promotion and demotion with hysteresis: which tenants deserve a dedicated
//! lane (pure, [`evaluate`]), and the periodic loop that measures each
//! ShardSet's tenants, records the candidates in its status and creates or
//! retires DedicatedLanes ([`run`]).
//!
//! A tenant on a hash shard is *hot* while its share of the shard's
//! worker-seconds over the window is at least `promoteShare` **and** the shard
//! is contended: another tenant is waiting, or another tenant is active and
//! the shard is busy (its workers were at least 80% in use over the window,
//! or more is outstanding than it has delivery slots). It is promoted once hot for `promoteAfter`
//! without a break. A tenant on an Active lane is *cold* while the share it
//! would have of its hash shard (its lane's worker-seconds over those plus
//! the shard's) is below `demoteShare`; it is demoted once cold for
//! `demoteAfter` without a break. Either timer resets as soon as its
//! condition breaks, so a tenant that oscillates is neither promoted nor
//! demoted over and over.

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
use crate::routing::{hash_shard, QueueId};
use crate::store::{TenantStats, WORKER_SECONDS_BUCKET};

use super::Context;

/// Field manager of the candidate lists in ShardSet status.
pub const FIELD_MANAGER: &str = "lanekeeper-promotion";
/// Label on DedicatedLanes the promotion loop created (it deletes them once retired).
pub const ORIGIN_LABEL: &str = "lanekeeper.io/origin";
pub const ORIGIN_PROMOTION: &str = "promotion";
/// Utilisation of a shard's workers above which it counts as contended even
/// when no other tenant is waiting at the instant it is sampled.
pub const BUSY_UTILISATION: f64 = 0.8;

/// One tenant as measured this tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub tenant: String,
    /// The queue it is served from now.
    pub queue: QueueId,
    /// Share of worker-seconds: of its shard, or (on a lane) of its hash shard plus its lane.
    pub share: f64,
    /// Its shard is contended (meaningless on a lane).
    pub contended: bool,
    /// On an Active lane: a demotion candidate, not a promotion one.
    pub laned: bool,
}

/// What to do this tick, and the candidate lists for status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    pub hot: Vec<PromotionCandidate>,
    pub cold: Vec<DemotionCandidate>,
    pub promote: Vec<String>,
    pub demote: Vec<String>,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn elapsed(since: &Time, now: Timestamp) -> Duration {
    let secs = now.as_millisecond() - since.0.as_millisecond();
    Duration::from_millis(secs.max(0) as u64)
}

/// Apply the hysteresis timers to this tick's observations. Pure.
pub fn evaluate(
    spec: &PromotionSpec,
    now: Timestamp,
    prev_hot: &[PromotionCandidate],
    prev_cold: &[DemotionCandidate],
    observations: &[Observation],
) -> Decision {
    let promote_after: Duration = spec.promote_after.into();
    let demote_after: Duration = spec.demote_after.into();
    let mut d = Decision::default();
    for o in observations {
        if o.laned {
            if o.share < spec.demote_share {
                let since = prev_cold
                    .iter()
                    .find(|c| c.tenant == o.tenant)
                    .map(|c| c.cold_since.clone())
                    .unwrap_or(Time(now));
                if elapsed(&since, now) >= demote_after {
                    d.demote.push(o.tenant.clone());
                }
                d.cold.push(DemotionCandidate {
                    tenant: o.tenant.clone(),
                    queue: o.queue.to_string(),
                    share: round3(o.share),
                    cold_since: since,
                });
            }
        } else if o.contended && o.share >= spec.promote_share {
            let since = prev_hot
                .iter()
                .find(|c| c.tenant == o.tenant)
                .map(|c| c.hot_since.clone())
                .unwrap_or(Time(now));
            if elapsed(&since, now) >= promote_after {
                d.promote.push(o.tenant.clone());
            }
            d.hot.push(PromotionCandidate {
                tenant: o.tenant.clone(),
                queue: o.queue.to_string(),
                share: round3(o.share),
                hot_since: since,
            });
        }
    }
    d.hot.sort_by(|a, b| b.share.total_cmp(&a.share));
    d.hot.truncate(64);
    d.cold.truncate(64);
    d
}

/// Observations for the tenants of one hash shard. `workers` is the shard's
/// delivery slots (replicas × concurrency) and `covered` the time the
/// worker-seconds were summed over. Tenants in `skip` (they have a lane, or
/// are on their way to one) are left out.
pub fn shard_observations(
    q: QueueId,
    stats: &[TenantStats],
    workers: f64,
    covered: Duration,
    skip: &BTreeSet<String>,
) -> Vec<Observation> {
    let total: f64 = stats.iter().map(|t| t.worker_seconds).sum();
    let capacity = workers * covered.as_secs_f64().max(1.0);
    // Busy: the workers were mostly in use over the window, or more is
    // outstanding right now than there are delivery slots (a backlog).
    let outstanding: u64 = stats.iter().map(|t| t.depth).sum();
    let busy = (capacity > 0.0 && total / capacity >= BUSY_UTILISATION)
        || (workers > 0.0 && outstanding as f64 > workers);
    stats
        .iter()
        .filter(|t| !skip.contains(&t.tenant))
        .map(|t| {
            let others = stats.iter().filter(|u| u.tenant != t.tenant);
            let others_waiting = others.clone().any(|u| u.depth > 0);
            let others_active = others
                .clone()
                .any(|u| u.worker_seconds > 0.0 || u.depth > 0);
            Observation {
                tenant: t.tenant.clone(),
                queue: q,
                share: if total > 0.0 {
                    t.worker_seconds / total
                } else {
                    0.0
                },
                contended: others_waiting || (others_active && busy),
                laned: false,
            }
        })
        .collect()
}

/// The share a laned tenant would have of its hash shard: its lane's
/// worker-seconds over those plus the shard's. An idle lane is cold.
pub fn lane_share(lane_seconds: f64, home_seconds: f64) -> f64 {
    let total = lane_seconds + home_seconds;
    if total > 0.0 {
        lane_seconds / total
    } else {
        0.0
    }
}

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

/// Time covered by a window of `window` read from buckets at `now_ms`.
fn covered(window: Duration, now_ms: u64) -> Duration {
    let bucket = WORKER_SECONDS_BUCKET * 1000;
    let buckets = window.as_secs().div_ceil(WORKER_SECONDS_BUCKET).max(1);
    Duration::from_millis((buckets - 1) * bucket + now_ms % bucket)
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
    let sets: Api<DeserializeGuard<ShardSet>> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
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
        return Ok(());
    }
    let store = super::store_for(set, ctx)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let routing = store.routing().await?;
    let lanes_api: Api<DedicatedLane> = Api::namespaced(ctx.client.clone(), &ns);
    let lanes: Vec<DedicatedLane> = lanes_api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|l| l.spec.shard_set == name)
        .collect();
    let with_lane: BTreeSet<String> = lanes.iter().map(|l| l.spec.tenant.clone()).collect();

    // The window in whole buckets plus the current, partial one: a share
    // read just after a bucket turns over still rests on a full window.
    let window = Duration::from(spec.window) + Duration::from_secs(WORKER_SECONDS_BUCKET);
    let now = Timestamp::now();
    let covered = covered(window, now.as_millisecond().max(0) as u64);
    let workers = f64::from(set.spec.worker.replicas.unwrap_or(1).max(0))
        * f64::from(set.spec.worker.concurrency);
    let shards = routing.shards.max(1);
    let mut observations = Vec::new();
    let mut shard_seconds: BTreeMap<QueueId, f64> = BTreeMap::new();
    for n in 0..shards {
        let q = QueueId::Shard(n);
        let stats = store.tenant_stats(q, window).await?;
        shard_seconds.insert(q, stats.iter().map(|t| t.worker_seconds).sum());
        observations.extend(shard_observations(q, &stats, workers, covered, &with_lane));
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
        });
    }
    let decision = evaluate(
        spec,
        now,
        &prev.promotion_candidates,
        &prev.demotion_candidates,
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
    if decision.hot != prev.promotion_candidates || decision.cold != prev.demotion_candidates {
        write_candidates(&sets, &name, &decision).await?;
    }
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
    let patch = serde_json::json!({
        "apiVersion": "lanekeeper.io/v1alpha1",
        "kind": "ShardSet",
        "status": {
            "promotionCandidates": d.hot,
            "demotionCandidates": d.cold,
        },
    });
    sets.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> PromotionSpec {
        PromotionSpec {
            promote_after: crate::crd::secs(15),
            demote_after: crate::crd::secs(60),
            ..Default::default()
        }
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_000_000 + s).unwrap()
    }

    fn shard(tenant: &str, share: f64, contended: bool) -> Observation {
        Observation {
            tenant: tenant.into(),
            queue: QueueId::Shard(3),
            share,
            contended,
            laned: false,
        }
    }

    fn laned(tenant: &str, share: f64) -> Observation {
        Observation {
            tenant: tenant.into(),
            queue: QueueId::Lane(1),
            share,
            contended: false,
            laned: true,
        }
    }

    type Moves = Vec<(i64, String)>;

    /// Feed (second, observation) pairs through `evaluate` as the loop does.
    fn run(samples: &[(i64, Observation)]) -> (Moves, Moves) {
        let (mut hot, mut cold) = (Vec::new(), Vec::new());
        let (mut promoted, mut demoted) = (Vec::new(), Vec::new());
        for (t, o) in samples {
            let d = evaluate(&spec(), at(*t), &hot, &cold, std::slice::from_ref(o));
            promoted.extend(d.promote.iter().map(|x| (*t, x.clone())));
            demoted.extend(d.demote.iter().map(|x| (*t, x.clone())));
            hot = d.hot;
            cold = d.cold;
        }
        (promoted, demoted)
    }

    #[test]
    fn promoted_after_promote_after_and_not_before() {
        let samples: Vec<_> = (0..=20).map(|t| (t, shard("whale", 0.9, true))).collect();
        let (promoted, _) = run(&samples);
        assert_eq!(promoted.first(), Some(&(15, "whale".to_string())));
    }

    #[test]
    fn a_lone_tenant_in_a_quiet_shard_is_not_hot() {
        let samples: Vec<_> = (0..=60).map(|t| (t, shard("lone", 1.0, false))).collect();
        let (promoted, _) = run(&samples);
        assert!(promoted.is_empty());
        let d = evaluate(&spec(), at(0), &[], &[], &[shard("lone", 1.0, false)]);
        assert!(d.hot.is_empty());
    }

    #[test]
    fn flapping_around_the_thresholds_never_promotes_or_demotes() {
        // Hot for 10 s, cool for 2 s, over and over: the timer resets each time.
        let samples: Vec<_> = (0..300)
            .map(|t| {
                (
                    t,
                    shard("flap", if t % 12 < 10 { 0.35 } else { 0.29 }, true),
                )
            })
            .collect();
        let (promoted, _) = run(&samples);
        assert!(promoted.is_empty(), "{promoted:?}");
        // On a lane: cold for 50 s, warm for 1 s (the seed's defect kept
        // cold_since across the warm-up, so the next dip demoted at once).
        let samples: Vec<_> = (0..600)
            .map(|t| (t, laned("flap", if t % 51 < 50 { 0.05 } else { 0.5 })))
            .collect();
        let (_, demoted) = run(&samples);
        assert!(demoted.is_empty(), "{demoted:?}");
    }

    #[test]
    fn demoted_after_demote_after_of_uninterrupted_cold() {
        let mut samples: Vec<_> = (0..30).map(|t| (t, laned("x", 0.05))).collect();
        samples.push((30, laned("x", 0.2)));
        samples.extend((31..=100).map(|t| (t, laned("x", 0.05))));
        let (_, demoted) = run(&samples);
        assert_eq!(demoted.first(), Some(&(91, "x".to_string())));
    }

    #[test]
    fn between_the_thresholds_nothing_moves() {
        // 0.2 is below promoteShare and above demoteShare: neither timer runs.
        let d = evaluate(
            &spec(),
            at(0),
            &[],
            &[],
            &[shard("a", 0.2, true), laned("b", 0.2)],
        );
        assert_eq!(d, Decision::default());
    }

    #[test]
    fn contention_needs_another_tenant_waiting_or_busy_workers() {
        let st = |t: &str, ws: f64, depth: u64| TenantStats {
            tenant: t.into(),
            worker_seconds: ws,
            depth,
            ..Default::default()
        };
        let none = BTreeSet::new();
        let covered = Duration::from_secs(10);
        // Another tenant is waiting.
        let o = shard_observations(
            QueueId::Shard(0),
            &[st("whale", 50.0, 900), st("small", 1.0, 2)],
            8.0,
            covered,
            &none,
        );
        assert!(o[0].contended);
        assert!((o[0].share - 50.0 / 51.0).abs() < 1e-9);
        // Alone: not contended, however busy.
        let o = shard_observations(
            QueueId::Shard(0),
            &[st("whale", 80.0, 900)],
            8.0,
            covered,
            &none,
        );
        assert!(!o[0].contended);
        // Others active but nobody waiting: contended only when workers are busy.
        let quiet = [st("a", 10.0, 0), st("b", 2.0, 0)];
        assert!(!shard_observations(QueueId::Shard(0), &quiet, 8.0, covered, &none)[0].contended);
        let busy = [st("a", 60.0, 0), st("b", 10.0, 0)];
        assert!(shard_observations(QueueId::Shard(0), &busy, 8.0, covered, &none)[0].contended);
        // Others active and a backlog beyond the delivery slots: contended.
        let backlog = [st("whale", 5.0, 400), st("small", 0.5, 0)];
        assert!(shard_observations(QueueId::Shard(0), &backlog, 8.0, covered, &none)[0].contended);
        // A backlog alone in its shard is still not contended.
        let lone = [st("whale", 5.0, 400)];
        assert!(!shard_observations(QueueId::Shard(0), &lone, 8.0, covered, &none)[0].contended);
        // Tenants with a lane are not candidates.
        let skip = BTreeSet::from(["a".to_string()]);
        let o = shard_observations(QueueId::Shard(0), &busy, 8.0, covered, &skip);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].tenant, "b");
    }

    #[test]
    fn lane_share_and_names() {
        assert_eq!(lane_share(0.0, 0.0), 0.0);
        assert_eq!(lane_share(30.0, 70.0), 0.3);
        assert_eq!(lane_name("hooks", "whale"), "hooks-whale");
        let odd = lane_name("hooks", "Big.Import:1");
        assert!(odd.starts_with("hooks-ig-import-1-") || odd.starts_with("hooks-"));
        assert!(odd
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
        assert_ne!(lane_name("hooks", "A"), lane_name("hooks", "a-"));
    }

    #[test]
    fn covered_time_counts_the_partial_bucket() {
        assert_eq!(
            covered(Duration::from_secs(10), 1_000_004_000),
            Duration::from_secs(4)
        );
        assert_eq!(
            covered(Duration::from_secs(30), 1_000_004_000),
            Duration::from_secs(24)
        );
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
