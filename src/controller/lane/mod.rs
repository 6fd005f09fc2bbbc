//! The DedicatedLane reconciler: one tenant moved onto a lane of its own, or
//! back to its hash shard, as a sequence of idempotent phases recorded in
//! status (server-side apply, field manager `lanekeeper-lanes`), so a
//! controller killed at any point resumes where it was.
//!
//! Promote: `Pending` (lane index assigned under the cap; lane Deployment
//! applied) → `Pausing` (tenant paused in its source queue) → `Draining`
//! (until nothing of it is queued, in flight or waiting to retry there) →
//! `Repinning` (paused in the lane, routing pin, source marked moved, source
//! hold buffer appended to the lane) → `Scaling` (until the lane Deployment
//! is available; then the lane's hold buffer is appended and the tenant
//! unpaused) → `Active`.
//!
//! Retire (`spec.retire`, or deletion through the finalizer): `Active` →
//! `Retiring` (target: the tenant's hash shard) → `Pausing` → `Draining` →
//! `Repinning` (pin removed) → `Scaling` (the shard resumed, the lane
//! Deployment removed, the index freed) → `Retired`. Which way a phase goes
//! is told by `status.targetQueue` (a lane or a shard).
//!
//! A drain that outlasts `relocation.drainTimeout` is aborted: the tenant is
//! resumed where it was (hold buffer appended in order), `Relocating=False`
//! with reason `DrainTimeout`, and the move is retried after a backoff.

mod io;
mod rules;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DedicatedLane, LanePhase, ShardSet};
use crate::routing::{hash_shard, QueueId};
use crate::scheduler::QueuePolicy;

use super::status::condition;
use super::Context;
use io::{crash_hook, now, Io};
pub use rules::*;

/// Field manager of DedicatedLane status (and of the finalizer and owner reference).
pub const FIELD_MANAGER: &str = "lanekeeper-lanes";
/// Finalizer that makes deleting a lane demote its tenant first.
pub const FINALIZER: &str = "lanekeeper.io/relocation";
/// Test hook: when set to a phase name, the controller process exits (code
/// 86) right after doing that phase's work and before recording the next
/// phase, to prove that every step can be repeated after a crash.
pub const CRASH_HOOK_ENV: &str = "LANEKEEPER_TEST_CRASH_AFTER_PHASE";

/// How often a lane in motion is looked at again.
const POLL: Duration = Duration::from_millis(250);

/// Run the DedicatedLane controller until `stop` resolves.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    stop: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let lanes: Api<DeserializeGuard<DedicatedLane>> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let sets: Api<DeserializeGuard<ShardSet>> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let controller = Controller::new(lanes.clone(), watcher::Config::default().any_semantic());
    // A lane refused for the cap waits for a slot: it is woken when a lane of
    // its set frees one (retired, retiring, deleted) or the set changes (a
    // larger maxLanes), instead of polling the API server.
    let cache = controller.store();
    let by_lane = cache.clone();
    controller
        .watches(
            lanes,
            watcher::Config::default().any_semantic(),
            move |changed: DeserializeGuard<DedicatedLane>| {
                let freed = changed.0.as_ref().ok().filter(|l| frees_a_slot(l));
                let set = freed.map(|l| (l.namespace(), l.spec.shard_set.clone()));
                waiting_for_a_slot(&by_lane, set)
            },
        )
        .watches(
            sets,
            watcher::Config::default().any_semantic(),
            move |set: DeserializeGuard<ShardSet>| {
                let set = set.0.as_ref().ok().map(|s| (s.namespace(), s.name_any()));
                waiting_for_a_slot(&cache, set)
            },
        )
        .graceful_shutdown_on(stop)
        .run(reconcile_guarded, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                warn!(error = %e, "lane reconcile failed");
            }
        })
        .await;
}

/// The lanes of `set` (namespace, name) in the cache that wait for a slot.
fn waiting_for_a_slot(
    cache: &kube::runtime::reflector::Store<DeserializeGuard<DedicatedLane>>,
    set: Option<(Option<String>, String)>,
) -> Vec<kube::runtime::reflector::ObjectRef<DeserializeGuard<DedicatedLane>>> {
    let Some((ns, set)) = set else {
        return Vec::new();
    };
    cache
        .state()
        .iter()
        .filter(|l| {
            l.0.as_ref().is_ok_and(|l| {
                l.namespace() == ns && l.spec.shard_set == set && waits_for_a_slot(l)
            })
        })
        .map(|l| kube::runtime::reflector::ObjectRef::from_obj(l.as_ref()))
        .collect()
}

/// What can go wrong in a lane reconcile.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("Redis: {0}")]
    Store(String),
    #[error("{0}")]
    Other(String),
}

impl From<crate::store::StoreError> for LaneError {
    fn from(e: crate::store::StoreError) -> Self {
        LaneError::Store(e.to_string())
    }
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<DedicatedLane>>,
    ctx: Arc<Context>,
) -> Result<Action, LaneError> {
    match &obj.0 {
        Ok(lane) => {
            ctx.metrics.reconciles.inc();
            let started = std::time::Instant::now();
            let r = reconcile(lane, &ctx).await;
            ctx.metrics
                .reconcile_duration
                .observe(started.elapsed().as_secs_f64());
            r
        }
        Err(_) => Ok(Action::await_change()),
    }
}

fn error_policy(
    _obj: Arc<DeserializeGuard<DedicatedLane>>,
    err: &LaneError,
    ctx: Arc<Context>,
) -> Action {
    let kind = match err {
        LaneError::Kube(_) => "lane_kube",
        LaneError::Store(_) => "lane_redis",
        LaneError::Other(_) => "lane_other",
    };
    ctx.metrics
        .reconcile_errors
        .get_or_create(&crate::telemetry::ErrorLabels {
            kind: kind.to_string(),
        })
        .inc();
    Action::requeue(Duration::from_secs(2))
}

/// One reconcile: run phase steps until the lane must wait for something.
async fn reconcile(cached: &DedicatedLane, ctx: &Context) -> Result<Action, LaneError> {
    let ns = cached.namespace().unwrap_or_default();
    let name = cached.name_any();
    let lanes: Api<DedicatedLane> = Api::namespaced(ctx.client.clone(), &ns);
    // The cache may trail our own last status write: read it fresh.
    let Some(lane) = lanes.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let deleting = lane.metadata.deletion_timestamp.is_some();
    let sets: Api<ShardSet> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(set) = sets.get_opt(&lane.spec.shard_set).await? else {
        if deleting {
            // Nothing to move back to: the set (and its Redis routing) is gone.
            let io_lane = lane.clone();
            let finalizers: Vec<String> = io_lane
                .finalizers()
                .iter()
                .filter(|f| f.as_str() != FINALIZER)
                .cloned()
                .collect();
            let _ = lanes
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"finalizers": finalizers}})),
                )
                .await;
            return Ok(Action::await_change());
        }
        let mut st = lane.status.clone().unwrap_or_default();
        st.phase = LanePhase::Failed;
        let mut conds = st.conditions.clone();
        conds.retain(|c| c.type_ != "Admitted");
        conds.push(condition(
            &st.conditions,
            "Admitted",
            false,
            "ShardSetNotFound",
            format!("ShardSet {} does not exist in {ns}", lane.spec.shard_set),
            lane.metadata.generation,
        ));
        st.conditions = conds;
        let patch = serde_json::json!({"apiVersion": "lanekeeper.io/v1alpha1", "kind": "DedicatedLane", "status": st});
        lanes
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        return Ok(Action::requeue(Duration::from_secs(30)));
    };

    if set.metadata.deletion_timestamp.is_some() && !deleting {
        // The set is going: its finalizer deletes (and so retires) the lanes
        // it owns; with `--cascade=orphan` the lane stays as it is, owned by
        // nobody, its Deployment and routing untouched.
        return Ok(Action::requeue(Duration::from_secs(5)));
    }

    // Finalizer and owner reference, by server-side apply (idempotent).
    if !deleting
        && (!lane.finalizers().iter().any(|f| f == FINALIZER) || lane.owner_references().is_empty())
    {
        let mut meta = serde_json::json!({ "finalizers": [FINALIZER] });
        if lane.owner_references().is_empty() {
            if let Some(mut o) = set.controller_owner_ref(&()) {
                o.controller = Some(false);
                // A foreground deletion of the set waits for its lanes to retire.
                o.block_owner_deletion = Some(true);
                meta["ownerReferences"] = serde_json::json!([o]);
            }
        }
        let patch = serde_json::json!({
            "apiVersion": "lanekeeper.io/v1alpha1",
            "kind": "DedicatedLane",
            "metadata": meta,
        });
        lanes
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
    }

    let store = super::store_for(&set, ctx)
        .await
        .map_err(LaneError::Store)?;
    let mut io = Io {
        ctx,
        lanes: lanes.clone(),
        lane,
        set,
        store,
    };
    let action = step_until_wait(&mut io).await?;
    if deleting
        && io.lane.status.as_ref().is_some_and(|s| {
            s.phase == LanePhase::Retired
                || (s.lane_index.is_none() && s.phase == LanePhase::Pending)
        })
    {
        io.remove_finalizer().await?;
        info!(lane = %name, "finalizer removed; the tenant is on its hash shard");
        return Ok(Action::await_change());
    }
    Ok(action)
}

async fn step_until_wait(io: &mut Io<'_>) -> Result<Action, LaneError> {
    let drain_timeout = io.set.spec.relocation.drain_timeout();
    for _ in 0..32 {
        let deleting = io.lane.metadata.deletion_timestamp.is_some();
        let want_out = deleting || io.lane.spec.retire;
        let mut st = io.lane.status.clone().unwrap_or_default();
        let tenant = io.tenant().to_string();
        let source: Option<QueueId> = st.source_queue.as_deref().and_then(|q| q.parse().ok());
        let target: Option<QueueId> = st.target_queue.as_deref().and_then(|q| q.parse().ok());
        let waiting_out = st.next_attempt_at.as_ref().is_some_and(|t| t.0 > now());
        let retry_in = || {
            st.next_attempt_at
                .as_ref()
                .map(|t| {
                    Duration::from_millis(
                        (t.0.as_millisecond() - now().as_millisecond()).max(0) as u64 + 50,
                    )
                })
                .unwrap_or(POLL)
        };
        let phase = st.phase;
        match phase {
            LanePhase::Pending | LanePhase::Failed => {
                if want_out {
                    if let Some(i) = st.lane_index {
                        io.delete_deployment(i).await?;
                    }
                    crash_hook(phase);
                    st.lane_index = None;
                    st.phase = LanePhase::Retired;
                    st.next_attempt_at = None;
                    io.write(&st, None).await?;
                    continue;
                }
                if waiting_out {
                    io.write(&st, None).await?;
                    return Ok(Action::requeue(retry_in()));
                }
                if let Some(i) = st
                    .lane_index
                    .filter(|i| over_cap(*i, io.set.spec.promotion.max_lanes))
                {
                    // Admitted before maxLanes was lowered and the tenant not
                    // on the lane: give the index back, wait under the new
                    // cap. (Pinned there already: finish, then retire.)
                    let pins = io.store.routing().await?.pins;
                    if pins.get(&tenant) != Some(&QueueId::Lane(i as u8)) {
                        io.delete_deployment(i).await?;
                        io.store.lane_move_end(i, &io.lane.name_any()).await?;
                        st.lane_index = None;
                    }
                }
                if st.lane_index.is_none() {
                    if let Some(_refused) = io.admit(&mut st).await? {
                        let since = io
                            .lane
                            .status
                            .as_ref()
                            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Admitted"))
                            .map(|c| c.last_transition_time.0);
                        let waited = since
                            .map(|t| {
                                Duration::from_millis(
                                    (now().as_millisecond() - t.as_millisecond()).max(0) as u64,
                                )
                            })
                            .unwrap_or_default();
                        return Ok(Action::requeue(admission_retry(waited)));
                    }
                }
                if !has_workers(&super::build::lane_worker(&io.set, &io.lane)) {
                    // Nobody would serve the tenant on the lane: it stays put.
                    io.write(&st, Some(&Refusal::NoWorkers)).await?;
                    return Ok(Action::requeue(Duration::from_secs(10)));
                }
                let index = st.lane_index.unwrap_or(0);
                let lane_q = QueueId::Lane(index as u8);
                // Lane moves and reshards take turns (see `Store::lane_move_begin`).
                if !io.store.lane_move_begin(index, &io.lane.name_any()).await? {
                    if !st.waiting_for_reshard {
                        st.waiting_for_reshard = true;
                        io.write(&st, None).await?;
                    }
                    return Ok(Action::requeue(Duration::from_secs(2)));
                }
                st.waiting_for_reshard = false;
                let routing = io.store.routing().await?;
                if !routing.present() {
                    // No table (a Redis that lost its state): the set's
                    // reconciler writes it; nothing routes until then.
                    return Ok(Action::requeue(Duration::from_secs(1)));
                }
                if matches!(routing.pins.get(&tenant), Some(QueueId::Shard(_))) {
                    // A move a reshard began and did not finish (the gate
                    // keeps new ones from starting): take the tenant once it
                    // is on its new hash shard.
                    io.store.lane_move_end(index, &io.lane.name_any()).await?;
                    return Ok(Action::requeue(Duration::from_secs(1)));
                }
                let from = routing.route(&tenant);
                io.store
                    .configure_queue(lane_q, &QueuePolicy::from_spec(&io.set.spec))
                    .await?;
                io.apply_deployment(index).await?;
                crash_hook(phase);
                if from == lane_q {
                    // Pinned here already (a crash after Repinning of an
                    // earlier record): finish the move through every step,
                    // so the hash shard's hold buffer comes along (pausing,
                    // draining and marking are idempotent).
                    st.source_queue = Some(hash_shard(&tenant, routing.shards).to_string());
                    st.target_queue = Some(lane_q.to_string());
                    st.phase = LanePhase::Pausing;
                } else {
                    st.source_queue = Some(from.to_string());
                    st.target_queue = Some(lane_q.to_string());
                    st.phase = LanePhase::Pausing;
                }
                st.held_envelopes = 0;
                io.write(&st, None).await?;
            }
            LanePhase::Pausing => {
                let (Some(from), Some(_)) = (source, target) else {
                    st.phase = LanePhase::Pending;
                    io.write(&st, None).await?;
                    continue;
                };
                if want_out && promoting(&st) {
                    io.store.resume(from, &tenant).await?;
                    st.phase = LanePhase::Pending;
                    io.write(&st, None).await?;
                    continue;
                }
                io.store.pause(from, &tenant).await?;
                crash_hook(phase);
                st.paused_at = Some(Time(now()));
                st.phase = LanePhase::Draining;
                io.write(&st, None).await?;
            }
            LanePhase::Draining => {
                let (Some(from), Some(_)) = (source, target) else {
                    st.phase = LanePhase::Pending;
                    io.write(&st, None).await?;
                    continue;
                };
                if want_out && promoting(&st) {
                    io.store.resume(from, &tenant).await?;
                    st.phase = LanePhase::Pending;
                    st.paused_at = None;
                    io.write(&st, None).await?;
                    continue;
                }
                let state = io.store.tenant_state(from, &tenant).await?;
                st.held_envelopes = state.held as i64;
                match drain_verdict(state.drained(), st.paused_at.as_ref(), now(), drain_timeout) {
                    Drain::Drained => {
                        crash_hook(phase);
                        st.phase = LanePhase::Repinning;
                        io.write(&st, None).await?;
                    }
                    Drain::Wait => {
                        if st.held_envelopes
                            != io
                                .lane
                                .status
                                .as_ref()
                                .map(|s| s.held_envelopes)
                                .unwrap_or(0)
                        {
                            io.write(&st, None).await?;
                        }
                        return Ok(Action::requeue(POLL));
                    }
                    Drain::Abort => {
                        io.store.resume(from, &tenant).await?;
                        st.drain_attempts += 1;
                        let wait = drain_backoff(drain_timeout, st.drain_attempts);
                        st.next_attempt_at = Some(Time(
                            now()
                                .checked_add(
                                    k8s_openapi::jiff::SignedDuration::try_from(wait)
                                        .unwrap_or_default(),
                                )
                                .unwrap_or_else(|_| now()),
                        ));
                        st.paused_at = None;
                        st.held_envelopes = 0;
                        warn!(lane = %io.lane.name_any(), %tenant, from = %from, attempts = st.drain_attempts, "drain timed out; resumed in place");
                        st.phase = if promoting(&st) {
                            LanePhase::Pending
                        } else {
                            LanePhase::Active
                        };
                        if st.phase == LanePhase::Active {
                            // Back on the lane it never left.
                            st.target_queue = Some(from.to_string());
                            st.source_queue = None;
                        }
                        io.write(&st, None).await?;
                        return Ok(Action::requeue(wait));
                    }
                }
            }
            LanePhase::Repinning => {
                let (Some(from), Some(to)) = (source, target) else {
                    return Err(LaneError::Other(
                        "Repinning without source and target queues".into(),
                    ));
                };
                io.store.pause(to, &tenant).await?;
                match to {
                    QueueId::Lane(_) => io.store.pin(&tenant, to).await?,
                    QueueId::Shard(_) => io.store.unpin(&tenant).await?,
                };
                if !io.store.mark_moved(from, &tenant, to).await? {
                    // Something arrived after all (not drained): drain again.
                    st.phase = LanePhase::Draining;
                    io.write(&st, None).await?;
                    continue;
                }
                io.store.move_hold(from, to, &tenant).await?;
                crash_hook(phase);
                st.phase = LanePhase::Scaling;
                io.write(&st, None).await?;
            }
            LanePhase::Scaling => {
                let Some(to) = target else {
                    return Err(LaneError::Other("Scaling without a target queue".into()));
                };
                if promoting(&st) {
                    let index = st.lane_index.unwrap_or(0);
                    io.apply_deployment(index).await?;
                    if !io.deployment_available(index).await? {
                        return Ok(Action::requeue(POLL));
                    }
                    io.store.resume(to, &tenant).await?;
                    crash_hook(phase);
                    st.phase = LanePhase::Active;
                    st.active_since = Some(Time(now()));
                } else {
                    io.store.resume(to, &tenant).await?;
                    if let Some(i) = st.lane_index {
                        io.delete_deployment(i).await?;
                    }
                    crash_hook(phase);
                    st.phase = LanePhase::Retired;
                    st.lane_index = None;
                }
                st.drain_attempts = 0;
                st.next_attempt_at = None;
                st.paused_at = None;
                st.held_envelopes = 0;
                io.write(&st, None).await?;
            }
            LanePhase::Active => {
                let routing = io.store.routing().await?;
                if !routing.present() {
                    return Ok(Action::requeue(Duration::from_secs(1)));
                }
                let beyond_cap = st
                    .lane_index
                    .is_some_and(|i| over_cap(i, io.set.spec.promotion.max_lanes));
                if (want_out || beyond_cap) && !waiting_out {
                    if beyond_cap && !want_out {
                        info!(lane = %io.lane.name_any(), %tenant, "maxLanes lowered below this lane's index: retiring it");
                    }
                    let Some(index) = st.lane_index else {
                        st.phase = LanePhase::Pending;
                        io.write(&st, None).await?;
                        continue;
                    };
                    if !io.store.lane_move_begin(index, &io.lane.name_any()).await? {
                        if !st.waiting_for_reshard {
                            st.waiting_for_reshard = true;
                            io.write(&st, None).await?;
                        }
                        return Ok(Action::requeue(Duration::from_secs(2)));
                    }
                    st.waiting_for_reshard = false;
                    let routing = io.store.routing().await?;
                    st.source_queue = Some(QueueId::Lane(index as u8).to_string());
                    st.target_queue = Some(hash_shard(&tenant, routing.shards).to_string());
                    st.phase = LanePhase::Retiring;
                    io.write(&st, None).await?;
                    continue;
                }
                if let Some(i) = st.lane_index {
                    // Follow changes of the set's worker template and scheduler policy.
                    io.apply_deployment(i).await?;
                    let lane_q = QueueId::Lane(i as u8);
                    io.store
                        .configure_queue(lane_q, &QueuePolicy::from_spec(&io.set.spec))
                        .await?;
                    // An Active lane's tenant is pinned to it, whatever
                    // happened to the table (the set's reconciler restores
                    // pins after a loss; this mends a pin lost on its own).
                    if routing.epoch.is_some() && routing.pins.get(&tenant) != Some(&lane_q) {
                        warn!(lane = %io.lane.name_any(), %tenant, "the routing table lost this Active lane's pin: pinning the tenant to its lane again");
                        io.store.pin(&tenant, lane_q).await?;
                        io.event(
                            EventType::Warning,
                            "Repinned",
                            format!("{tenant} was not pinned to {lane_q} in the routing table; pinned again"),
                        )
                        .await;
                    }
                }
                // Keep the conditions (and observedGeneration) current.
                let before = io.lane.status.clone().unwrap_or_default();
                let mut probe = st.clone();
                probe.observed_generation = io.lane.metadata.generation;
                probe.conditions = conditions(
                    &probe,
                    None,
                    probe.observed_generation,
                    io.set.spec.promotion.max_lanes,
                );
                if probe.conditions != before.conditions
                    || before.observed_generation != io.lane.metadata.generation
                {
                    io.write(&st, None).await?;
                }
                return Ok(if waiting_out {
                    Action::requeue(retry_in())
                } else {
                    Action::requeue(Duration::from_secs(30))
                });
            }
            LanePhase::Retiring => {
                st.phase = LanePhase::Pausing;
                io.write(&st, None).await?;
            }
            LanePhase::Retired => {
                if io.lane.metadata.deletion_timestamp.is_some() {
                    return Ok(Action::await_change());
                }
                if !io.lane.spec.retire {
                    st.phase = LanePhase::Pending;
                    st.source_queue = None;
                    st.target_queue = None;
                    io.write(&st, None).await?;
                    continue;
                }
                let from_promotion = io
                    .lane
                    .labels()
                    .get(super::promotion::ORIGIN_LABEL)
                    .is_some_and(|v| v == super::promotion::ORIGIN_PROMOTION);
                if from_promotion {
                    info!(lane = %io.lane.name_any(), "retired lane made by promotion: deleting it");
                    match io
                        .lanes
                        .delete(&io.lane.name_any(), &DeleteParams::default())
                        .await
                    {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                // Keep conditions current (the Admitted reason).
                let before = io.lane.status.clone().unwrap_or_default();
                let mut probe = st.clone();
                probe.conditions = conditions(
                    &probe,
                    None,
                    io.lane.metadata.generation,
                    io.set.spec.promotion.max_lanes,
                );
                if probe.conditions != before.conditions {
                    io.write(&st, None).await?;
                }
                return Ok(Action::await_change());
            }
        }
    }
    Ok(Action::requeue(POLL))
}
