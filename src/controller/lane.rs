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

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DedicatedLane, DedicatedLaneStatus, LanePhase, ShardSet, MAX_LANES};
use crate::routing::{hash_shard, QueueId};
use crate::scheduler::QueuePolicy;
use crate::store::Store;

use super::build::{deployment_name, lane_deployment, FIELD_MANAGER as APPLY_MANAGER};
use super::status::{condition, shard_available};
use super::Context;

/// Field manager of DedicatedLane status (and of the finalizer and owner reference).
pub const FIELD_MANAGER: &str = "lanekeeper-lanes";
/// Finalizer that makes deleting a lane demote its tenant first.
pub const FINALIZER: &str = "lanekeeper.io/relocation";
/// Test hook: when set to a phase name, the controller process exits (code
/// 86) right after doing that phase's work and before recording the next
/// phase, to prove that every step can be repeated after a crash.
pub const CRASH_HOOK_ENV: &str = "LANEKEEPER_TEST_CRASH_AFTER_PHASE";
/// Longest pause between two drain attempts after `DrainTimeout`s.
pub const MAX_DRAIN_BACKOFF: Duration = Duration::from_secs(600);
/// Shortest pause between two drain attempts: each abort records an Event.
pub const MIN_DRAIN_BACKOFF: Duration = Duration::from_secs(5);

/// How often a lane in motion is looked at again.
const POLL: Duration = Duration::from_millis(250);

/// Why a lane has no index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `maxLanes` lanes of the set are admitted already (or earlier lanes wait).
    LaneCapReached { used: usize, max: usize },
    /// Another DedicatedLane of the set serves this tenant.
    DuplicateTenant(String),
    /// The lane's worker template asks for 0 replicas (and no autoscaler):
    /// nobody would serve the tenant there, so it stays on its shard.
    NoWorkers,
}

/// What the admission decision needs to know of one lane of the set.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneSlot {
    pub name: String,
    pub tenant: String,
    pub index: Option<i32>,
    /// Waiting for an index (not retiring, not deleted).
    pub waiting: bool,
    pub created: Option<Timestamp>,
}

/// Admit lane `me` under the cap: the lowest free index, given to waiting
/// lanes oldest first. Pure.
pub fn admit(me: &str, lanes: &[LaneSlot], max_lanes: i32) -> Result<i32, Refusal> {
    let mine = lanes.iter().find(|l| l.name == me);
    if let Some(i) = mine.and_then(|l| l.index) {
        return Ok(i);
    }
    if let Some(me_slot) = mine {
        let older_same_tenant = lanes.iter().find(|l| {
            l.name != me
                && l.tenant == me_slot.tenant
                && (l.index.is_some()
                    || (l.waiting && (l.created, &l.name) < (me_slot.created, &me_slot.name)))
        });
        if let Some(other) = older_same_tenant {
            return Err(Refusal::DuplicateTenant(other.name.clone()));
        }
    }
    let max = max_lanes.clamp(1, MAX_LANES);
    let used: Vec<i32> = lanes.iter().filter_map(|l| l.index).collect();
    let free: Vec<i32> = (0..max).filter(|i| !used.contains(i)).collect();
    let mut queue: Vec<&LaneSlot> = lanes
        .iter()
        .filter(|l| l.index.is_none() && l.waiting)
        .collect();
    queue.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    let position = queue
        .iter()
        .position(|l| l.name == me)
        .unwrap_or(queue.len());
    free.get(position).copied().ok_or(Refusal::LaneCapReached {
        used: used.len(),
        max: max as usize,
    })
}

/// What a drain check concludes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    Drained,
    Wait,
    /// Past the drain timeout: resume in place and retry later.
    Abort,
}

/// Is the paused source drained, still draining, or past its timeout? Pure.
pub fn drain_verdict(
    drained: bool,
    paused_at: Option<&Time>,
    now: Timestamp,
    timeout: Duration,
) -> Drain {
    if drained {
        return Drain::Drained;
    }
    let waited = paused_at
        .map(|t| (now.as_millisecond() - t.0.as_millisecond()).max(0) as u64)
        .unwrap_or(0);
    if Duration::from_millis(waited) >= timeout {
        Drain::Abort
    } else {
        Drain::Wait
    }
}

/// Wait before drain attempt `attempts + 1`: the drain timeout, doubling per
/// aborted attempt, at least [`MIN_DRAIN_BACKOFF`] and at most
/// [`MAX_DRAIN_BACKOFF`]. Pure.
pub fn drain_backoff(timeout: Duration, attempts: i32) -> Duration {
    let factor = 2u32.saturating_pow(attempts.saturating_sub(1).clamp(0, 16) as u32);
    timeout
        .saturating_mul(factor)
        .clamp(MIN_DRAIN_BACKOFF, MAX_DRAIN_BACKOFF)
}

/// Does this move go onto a lane (promotion) or back to a shard (retirement)?
pub fn promoting(st: &DedicatedLaneStatus) -> bool {
    !matches!(
        st.target_queue.as_deref().and_then(|q| q.parse().ok()),
        Some(QueueId::Shard(_))
    )
}

/// The lane's conditions for its status. `refusal` is why it has no index;
/// `note` overrides the Relocating reason and message (e.g. `DrainTimeout`). Pure.
pub fn conditions(
    st: &DedicatedLaneStatus,
    refusal: Option<&Refusal>,
    generation: Option<i64>,
    max_lanes: i32,
) -> Vec<Condition> {
    let prev = &st.conditions;
    let admitted = match (st.lane_index, refusal) {
        (_, Some(Refusal::NoWorkers)) => condition(
            prev,
            "Admitted",
            false,
            "NoWorkers",
            "the lane's worker template has 0 replicas: the tenant stays on its shard until the lane has workers (set worker.replicas to 1 or more)".to_string(),
            generation,
        ),
        (Some(i), _) if over_cap(i, max_lanes) => condition(
            prev,
            "Admitted",
            false,
            "OverCap",
            format!(
                "lane index {i} is beyond maxLanes {max_lanes} (lowered): the tenant goes back to its hash shard and the lane waits for an index under the cap"
            ),
            generation,
        ),
        (Some(i), _) => condition(
            prev,
            "Admitted",
            true,
            "UnderCap",
            format!("lane {i} of {max_lanes}"),
            generation,
        ),
        (None, Some(Refusal::LaneCapReached { used, max })) => condition(
            prev,
            "Admitted",
            false,
            "LaneCapReached",
            format!("{used} of {max} lanes are admitted; this lane waits for one to be retired"),
            generation,
        ),
        (None, Some(Refusal::DuplicateTenant(other))) => condition(
            prev,
            "Admitted",
            false,
            "DuplicateTenant",
            format!("DedicatedLane {other} already serves this tenant"),
            generation,
        ),
        (None, None) if st.phase == LanePhase::Retired => condition(
            prev,
            "Admitted",
            false,
            "Retired",
            "the lane is retired and its index freed".to_string(),
            generation,
        ),
        (None, None) => condition(
            prev,
            "Admitted",
            false,
            "Pending",
            "waiting for a lane index".to_string(),
            generation,
        ),
    };
    let target = st.target_queue.clone().unwrap_or_default();
    let source = st.source_queue.clone().unwrap_or_default();
    let ready = match st.phase {
        LanePhase::Active => condition(
            prev,
            "Ready",
            true,
            "Active",
            format!("the tenant is served by {target}"),
            generation,
        ),
        phase => condition(
            prev,
            "Ready",
            false,
            &format!("{phase:?}"),
            format!("phase {phase:?}"),
            generation,
        ),
    };
    let moving = moving(st.phase);
    let relocating = if moving {
        condition(
            prev,
            "Relocating",
            true,
            if promoting(st) {
                "Promoting"
            } else {
                "Retiring"
            },
            format!("moving from {source} to {target}"),
            generation,
        )
    } else if st.waiting_for_reshard {
        condition(
            prev,
            "Relocating",
            false,
            "WaitingForReshard",
            "the ShardSet is changing its shard count; this lane's move starts when that is done"
                .to_string(),
            generation,
        )
    } else if st.next_attempt_at.is_some() {
        let next = st
            .next_attempt_at
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default();
        condition(
            prev,
            "Relocating",
            false,
            "DrainTimeout",
            format!(
                "{source} did not drain within the drain timeout ({} attempts); the tenant was resumed where it was; next attempt at {next}",
                st.drain_attempts
            ),
            generation,
        )
    } else {
        condition(
            prev,
            "Relocating",
            false,
            "Idle",
            "no move under way".to_string(),
            generation,
        )
    };
    vec![ready, relocating, admitted]
}

/// Is lane index `index` beyond the set's `maxLanes`? (The cap was lowered
/// below the lanes admitted: the lanes at `maxLanes` and above retire and
/// wait for an index under the cap.) Pure.
pub fn over_cap(index: i32, max_lanes: i32) -> bool {
    index >= max_lanes.clamp(1, MAX_LANES)
}

/// Does a worker template run anyone? Zero replicas do not, unless an
/// autoscaler owns the count. Pure.
pub fn has_workers(w: &crate::crd::WorkerTemplate) -> bool {
    w.autoscaled || w.replicas.unwrap_or(1) > 0
}

/// Is a lane in this phase moving its tenant?
pub fn moving(phase: LanePhase) -> bool {
    matches!(
        phase,
        LanePhase::Pausing
            | LanePhase::Draining
            | LanePhase::Repinning
            | LanePhase::Scaling
            | LanePhase::Retiring
    )
}

/// Is this lane waiting because of the cap? (For the ShardSet's `LaneCapReached`.)
pub fn waits_for_cap(lane: &DedicatedLane) -> bool {
    lane.status.as_ref().is_some_and(|st| {
        st.lane_index.is_none()
            && st.conditions.iter().any(|c| {
                c.type_ == "Admitted" && c.status == "False" && c.reason == "LaneCapReached"
            })
    })
}

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

/// Could this change of a lane have freed a slot under its set's cap? Pure.
pub fn frees_a_slot(lane: &DedicatedLane) -> bool {
    lane.metadata.deletion_timestamp.is_some()
        || lane.spec.retire
        || lane
            .status
            .as_ref()
            .is_some_and(|s| matches!(s.phase, LanePhase::Retired | LanePhase::Failed))
}

/// Is this lane waiting for a slot (no index yet, not on its way out)? Pure.
pub fn waits_for_a_slot(lane: &DedicatedLane) -> bool {
    let st = lane.status.clone().unwrap_or_default();
    st.lane_index.is_none()
        && st.phase == LanePhase::Pending
        && !lane.spec.retire
        && lane.metadata.deletion_timestamp.is_none()
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

/// How long a lane refused for the cap waits before looking again by
/// itself (it is woken sooner when a slot frees): as long as it has waited,
/// from 5 s to 5 min. Pure.
pub fn admission_retry(waited: Duration) -> Duration {
    waited.clamp(Duration::from_secs(5), Duration::from_secs(300))
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
            let started = std::time::Instant::now();
            let r = reconcile(lane, &ctx).await;
            ctx.metrics.reconciled(
                crate::controller::metrics::DEDICATED_LANE,
                started.elapsed(),
            );
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
        LaneError::Kube(_) => "kube",
        LaneError::Store(_) => "redis",
        LaneError::Other(_) => "other",
    };
    ctx.metrics
        .reconcile_failed(crate::controller::metrics::DEDICATED_LANE, kind);
    Action::requeue(Duration::from_secs(2))
}

fn now() -> Timestamp {
    Timestamp::now()
}

fn crash_hook(phase: LanePhase) {
    if let Ok(p) = std::env::var(CRASH_HOOK_ENV) {
        if p == format!("{phase:?}") {
            warn!(
                ?phase,
                "test hook: exiting after the work of this phase, before recording the next"
            );
            std::process::exit(86);
        }
    }
}

struct Io<'a> {
    ctx: &'a Context,
    lanes: Api<DedicatedLane>,
    lane: DedicatedLane,
    set: ShardSet,
    store: Store,
}

impl Io<'_> {
    fn tenant(&self) -> &str {
        &self.lane.spec.tenant
    }

    async fn write(
        &mut self,
        st: &DedicatedLaneStatus,
        refusal: Option<&Refusal>,
    ) -> Result<(), LaneError> {
        let before = self.lane.status.clone().unwrap_or_default();
        let mut st = st.clone();
        st.observed_generation = self.lane.metadata.generation;
        if !moving(st.phase) {
            // Not moving (any more): a reshard may take its turn.
            if let Some(i) = st.lane_index.or(before.lane_index) {
                self.store.lane_move_end(i, &self.lane.name_any()).await?;
            }
        }
        st.conditions = conditions(
            &st,
            refusal,
            st.observed_generation,
            self.set.spec.promotion.max_lanes,
        );
        if before.phase != st.phase {
            st.phase_since = Some(Time(now()));
            self.event(
                EventType::Normal,
                &format!("{:?}", st.phase),
                format!(
                    "phase {:?} -> {:?} ({} -> {})",
                    before.phase,
                    st.phase,
                    st.source_queue.as_deref().unwrap_or("-"),
                    st.target_queue.as_deref().unwrap_or("-")
                ),
            )
            .await;
        }
        let flipped = |t: &str| {
            let a = before.conditions.iter().find(|c| c.type_ == t);
            let b = st.conditions.iter().find(|c| c.type_ == t);
            match (a, b) {
                (Some(a), Some(b)) => a.reason != b.reason || a.status != b.status,
                (None, Some(_)) => true,
                _ => false,
            }
        };
        if flipped("Relocating") {
            if let Some(c) = st
                .conditions
                .iter()
                .find(|c| c.type_ == "Relocating" && c.reason == "DrainTimeout")
            {
                self.event(EventType::Warning, "DrainTimeout", c.message.clone())
                    .await;
            }
        }
        if flipped("Admitted") {
            if let Some(c) = st.conditions.iter().find(|c| {
                c.type_ == "Admitted"
                    && c.status == "False"
                    && c.reason != "Pending"
                    && c.reason != "Retired"
            }) {
                self.event(EventType::Warning, &c.reason.clone(), c.message.clone())
                    .await;
            }
        }
        if st == before {
            // Nothing changed (a lane still waiting, say): no write.
            return Ok(());
        }
        let patch = serde_json::json!({
            "apiVersion": "lanekeeper.io/v1alpha1",
            "kind": "DedicatedLane",
            "status": st,
        });
        let updated = self
            .lanes
            .patch_status(
                &self.lane.name_any(),
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await?;
        self.lane = updated;
        Ok(())
    }

    async fn event(&self, type_: EventType, reason: &str, note: String) {
        self.ctx
            .event(&self.lane.object_ref(&()), type_, reason, "Relocate", note)
            .await;
    }

    async fn apply_deployment(&self, index: i32) -> Result<(), LaneError> {
        // The set's worker template under the operator's limits (the set's
        // reconcile reports a refusal in the set's status).
        let set = super::build::enforce_worker_policy(&self.set, &self.ctx.worker_policy)
            .map_err(|e| LaneError::Other(format!("the ShardSet is refused: {e}")))?;
        let ns = self.lane.namespace().unwrap_or_default();
        super::check_redis_secrets(&self.ctx.client, &ns, &set.spec.redis)
            .await
            .map_err(|e| LaneError::Other(format!("the ShardSet is refused: {e}")))?;
        let d = lane_deployment(&set, &self.lane, index as u8)
            .map_err(|e| LaneError::Other(e.to_string()))?;
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = d.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply(APPLY_MANAGER).force(),
            &Patch::Apply(&d),
        )
        .await?;
        Ok(())
    }

    async fn deployment_available(&self, index: i32) -> Result<bool, LaneError> {
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = deployment_name(&self.set.name_any(), QueueId::Lane(index as u8));
        // Available with zero replicas serves nobody.
        let worker = super::build::lane_worker(&self.set, &self.lane);
        Ok(api.get_opt(&name).await?.is_some_and(|d| {
            if worker.autoscaled {
                shard_available(&d)
            } else {
                super::status::serving(&d)
            }
        }))
    }

    async fn delete_deployment(&self, index: i32) -> Result<(), LaneError> {
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = deployment_name(&self.set.name_any(), QueueId::Lane(index as u8));
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Index under the cap, decided under the context's admission lock
    /// against a fresh list, and recorded before the lock is released.
    async fn admit(&mut self, st: &mut DedicatedLaneStatus) -> Result<Option<Refusal>, LaneError> {
        let _guard = self.ctx.admission.lock().await;
        let set_name = self.set.name_any();
        let slots: Vec<LaneSlot> = self
            .lanes
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|l| l.spec.shard_set == set_name)
            .map(|l| {
                let s = l.status.clone().unwrap_or_default();
                LaneSlot {
                    name: l.name_any(),
                    tenant: l.spec.tenant.clone(),
                    index: s.lane_index,
                    waiting: s.lane_index.is_none()
                        && !l.spec.retire
                        && l.metadata.deletion_timestamp.is_none()
                        && s.phase != LanePhase::Retired,
                    created: l.metadata.creation_timestamp.as_ref().map(|t| t.0),
                }
            })
            .collect();
        match admit(
            &self.lane.name_any(),
            &slots,
            self.set.spec.promotion.max_lanes,
        ) {
            Ok(i) => {
                st.lane_index = Some(i);
                self.write(st, None).await?;
                Ok(None)
            }
            Err(r) => {
                self.write(st, Some(&r)).await?;
                Ok(Some(r))
            }
        }
    }

    async fn remove_finalizer(&self) -> Result<(), LaneError> {
        let finalizers: Vec<String> = self
            .lane
            .finalizers()
            .iter()
            .filter(|f| f.as_str() != FINALIZER)
            .cloned()
            .collect();
        let patch = serde_json::json!({
            "metadata": {
                "finalizers": finalizers,
                "resourceVersion": self.lane.resource_version(),
            }
        });
        match self
            .lanes
            .patch(
                &self.lane.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
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

/// The lane whose pin the routing table must hold for this lane's tenant
/// now, from its recorded phase: `Active` and on its way out until the pin
/// is removed (`Retiring`, and `Pausing`/`Draining`/`Repinning` from the
/// lane), and promoted past `Repinning` (`Scaling` to the lane). What the
/// controller rewrites when Redis lost its state.
pub fn pinned_lane(st: &DedicatedLaneStatus) -> Option<QueueId> {
    let lane = QueueId::Lane(u8::try_from(st.lane_index?).ok()?);
    let parse = |q: &Option<String>| q.as_deref().and_then(|q| q.parse::<QueueId>().ok());
    match st.phase {
        LanePhase::Active | LanePhase::Retiring => Some(lane),
        LanePhase::Pausing | LanePhase::Draining | LanePhase::Repinning => {
            (parse(&st.source_queue) == Some(lane)).then_some(lane)
        }
        LanePhase::Scaling => (parse(&st.target_queue) == Some(lane)).then_some(lane),
        LanePhase::Pending | LanePhase::Retired | LanePhase::Failed => None,
    }
}

/// Lanes of a set, by the facts the ShardSet status needs: admitted count and
/// whether one waits for the cap.
/// How many of the set's lanes hold an index beyond `max_lanes` (retiring
/// because the cap was lowered).
pub fn over_cap_count(set: &str, lanes: &[DedicatedLane], max_lanes: i32) -> i32 {
    lanes
        .iter()
        .filter(|l| l.spec.shard_set == set)
        .filter_map(|l| l.status.as_ref().and_then(|s| s.lane_index))
        .filter(|i| over_cap(*i, max_lanes))
        .count() as i32
}

pub fn summary(set: &str, lanes: &[DedicatedLane]) -> (i32, bool) {
    let mine: Vec<&DedicatedLane> = lanes.iter().filter(|l| l.spec.shard_set == set).collect();
    let used = mine
        .iter()
        .filter(|l| l.status.as_ref().and_then(|s| s.lane_index).is_some())
        .count() as i32;
    let waiting = mine.iter().any(|l| waits_for_cap(l));
    (used, waiting)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str, tenant: &str, index: Option<i32>, created: i64) -> LaneSlot {
        LaneSlot {
            name: name.into(),
            tenant: tenant.into(),
            index,
            waiting: index.is_none(),
            created: Some(Timestamp::from_second(1_000 + created).unwrap()),
        }
    }

    #[test]
    fn admission_gives_the_lowest_free_index_oldest_first() {
        let lanes = vec![
            slot("a", "ta", Some(0), 0),
            slot("b", "tb", Some(2), 1),
            slot("c", "tc", None, 5),
            slot("d", "td", None, 3),
        ];
        assert_eq!(admit("a", &lanes, 8), Ok(0));
        assert_eq!(admit("d", &lanes, 8), Ok(1));
        assert_eq!(admit("c", &lanes, 8), Ok(3));
        // Cap 3: one index free (1); d is older than c, so d gets it.
        assert_eq!(admit("d", &lanes, 3), Ok(1));
        assert_eq!(
            admit("c", &lanes, 3),
            Err(Refusal::LaneCapReached { used: 2, max: 3 })
        );
    }

    #[test]
    fn eight_admitted_the_ninth_waits_then_gets_the_freed_index() {
        let mut lanes: Vec<LaneSlot> = (0..8)
            .map(|i| slot(&format!("l{i}"), &format!("t{i}"), Some(i), i as i64))
            .collect();
        lanes.push(slot("l8", "t8", None, 9));
        assert_eq!(
            admit("l8", &lanes, 8),
            Err(Refusal::LaneCapReached { used: 8, max: 8 })
        );
        lanes[5].index = None; // retired
        lanes[5].waiting = false;
        assert_eq!(admit("l8", &lanes, 8), Ok(5));
        // maxLanes above 8 is clamped.
        assert_eq!(admit("l8", &lanes, 99), Ok(5));
    }

    #[test]
    fn one_tenant_one_lane() {
        let lanes = vec![slot("a", "whale", Some(0), 0), slot("b", "whale", None, 1)];
        assert_eq!(
            admit("b", &lanes, 8),
            Err(Refusal::DuplicateTenant("a".into()))
        );
    }

    #[test]
    fn the_set_counts_admitted_lanes_and_sees_one_waiting_for_the_cap() {
        let lane = |name: &str, set: &str, status: serde_json::Value| -> DedicatedLane {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "lanekeeper.io/v1alpha1",
                "kind": "DedicatedLane",
                "metadata": {"name": name},
                "spec": {"shardSet": set, "tenant": name},
                "status": status,
            }))
            .unwrap()
        };
        let cond = |reason: &str| {
            serde_json::json!([{"type": "Admitted", "status": "False", "reason": reason,
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}])
        };
        let lanes = vec![
            lane(
                "a",
                "hooks",
                serde_json::json!({"phase": "Active", "laneIndex": 0}),
            ),
            lane(
                "b",
                "hooks",
                serde_json::json!({"phase": "Draining", "laneIndex": 1}),
            ),
            lane(
                "c",
                "other",
                serde_json::json!({"phase": "Active", "laneIndex": 0}),
            ),
            lane(
                "d",
                "hooks",
                serde_json::json!({"phase": "Pending", "conditions": cond("DuplicateTenant")}),
            ),
        ];
        assert_eq!(summary("hooks", &lanes), (2, false));
        let mut lanes = lanes;
        lanes.push(lane(
            "e",
            "hooks",
            serde_json::json!({"phase": "Pending", "conditions": cond("LaneCapReached")}),
        ));
        assert_eq!(summary("hooks", &lanes), (2, true));
        assert_eq!(summary("other", &lanes), (1, false));
    }

    #[test]
    fn the_pin_a_lane_needs_follows_its_phase() {
        let st = |phase, source: Option<&str>, target: Option<&str>| DedicatedLaneStatus {
            phase,
            lane_index: Some(2),
            source_queue: source.map(str::to_string),
            target_queue: target.map(str::to_string),
            ..Default::default()
        };
        let lane = Some(QueueId::Lane(2));
        assert_eq!(
            pinned_lane(&st(LanePhase::Active, None, Some("lane-2"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Retiring, Some("lane-2"), Some("shard-01"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Draining, Some("lane-2"), Some("shard-01"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Scaling, Some("shard-01"), Some("lane-2"))),
            lane
        );
        // Promoting and not yet repinned: the tenant is still on its shard.
        assert_eq!(
            pinned_lane(&st(LanePhase::Draining, Some("shard-01"), Some("lane-2"))),
            None
        );
        // Retired, or back on the shard and scaling the lane down.
        assert_eq!(
            pinned_lane(&st(LanePhase::Scaling, Some("lane-2"), Some("shard-01"))),
            None
        );
        assert_eq!(pinned_lane(&st(LanePhase::Retired, None, None)), None);
        assert_eq!(pinned_lane(&st(LanePhase::Pending, None, None)), None);
    }

    #[test]
    fn a_waiting_lane_is_woken_by_a_freed_slot_and_otherwise_backs_off() {
        let lane = |phase: LanePhase, index: Option<i32>, retire: bool| {
            let mut l = DedicatedLane::new(
                "l",
                crate::crd::DedicatedLaneSpec {
                    shard_set: "hooks".into(),
                    tenant: "t".into(),
                    worker: None,
                    retire,
                },
            );
            l.status = Some(DedicatedLaneStatus {
                phase,
                lane_index: index,
                ..Default::default()
            });
            l
        };
        assert!(waits_for_a_slot(&lane(LanePhase::Pending, None, false)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Pending, Some(0), false)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Pending, None, true)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Active, Some(1), false)));
        assert!(frees_a_slot(&lane(LanePhase::Retired, None, false)));
        assert!(frees_a_slot(&lane(LanePhase::Active, Some(1), true)));
        assert!(!frees_a_slot(&lane(LanePhase::Active, Some(1), false)));
        let mut deleting = lane(LanePhase::Active, Some(1), false);
        deleting.metadata.deletion_timestamp = Some(Time(now()));
        assert!(frees_a_slot(&deleting));
        assert_eq!(admission_retry(Duration::ZERO), Duration::from_secs(5));
        assert_eq!(
            admission_retry(Duration::from_secs(40)),
            Duration::from_secs(40)
        );
        assert_eq!(
            admission_retry(Duration::from_secs(86_400)),
            Duration::from_secs(300)
        );
    }

    #[test]
    fn drain_verdicts_and_backoff() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let paused = Time(t0);
        let at = |s: i64| Timestamp::from_second(1_000 + s).unwrap();
        let timeout = Duration::from_secs(10);
        assert_eq!(
            drain_verdict(true, Some(&paused), at(100), timeout),
            Drain::Drained
        );
        assert_eq!(
            drain_verdict(false, Some(&paused), at(9), timeout),
            Drain::Wait
        );
        assert_eq!(
            drain_verdict(false, Some(&paused), at(10), timeout),
            Drain::Abort
        );
        assert_eq!(drain_backoff(timeout, 1), Duration::from_secs(10));
        assert_eq!(drain_backoff(timeout, 2), Duration::from_secs(20));
        assert_eq!(drain_backoff(timeout, 3), Duration::from_secs(40));
        assert_eq!(drain_backoff(timeout, 30), MAX_DRAIN_BACKOFF);
        // A tiny timeout (stored before the CEL floor) still waits the floor.
        let tiny = Duration::from_nanos(1);
        assert_eq!(drain_backoff(tiny, 1), MIN_DRAIN_BACKOFF);
        assert_eq!(drain_backoff(tiny, 40), MIN_DRAIN_BACKOFF);
    }

    #[test]
    fn a_lane_waiting_for_a_reshard_says_so() {
        let st = DedicatedLaneStatus {
            phase: LanePhase::Pending,
            lane_index: Some(2),
            waiting_for_reshard: true,
            ..Default::default()
        };
        let c = conditions(&st, None, Some(1), 8);
        let r = c.iter().find(|c| c.type_ == "Relocating").unwrap();
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "WaitingForReshard")
        );
        assert!(moving(LanePhase::Draining) && moving(LanePhase::Retiring));
        assert!(
            !moving(LanePhase::Active)
                && !moving(LanePhase::Pending)
                && !moving(LanePhase::Retired)
        );
    }

    #[test]
    fn conditions_follow_the_phase() {
        let mut st = DedicatedLaneStatus {
            phase: LanePhase::Draining,
            lane_index: Some(2),
            source_queue: Some("shard-03".into()),
            target_queue: Some("lane-2".into()),
            ..Default::default()
        };
        let get = |cs: &[Condition], t: &str| {
            let c = cs.iter().find(|c| c.type_ == t).unwrap().clone();
            (c.status, c.reason)
        };
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Relocating"), ("True".into(), "Promoting".into()));
        assert_eq!(get(&cs, "Admitted"), ("True".into(), "UnderCap".into()));
        assert_eq!(get(&cs, "Ready"), ("False".into(), "Draining".into()));
        assert!(promoting(&st));

        st.phase = LanePhase::Pending;
        st.drain_attempts = 1;
        st.next_attempt_at = Some(Time(Timestamp::from_second(2_000).unwrap()));
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(
            get(&cs, "Relocating"),
            ("False".into(), "DrainTimeout".into())
        );

        st.phase = LanePhase::Active;
        st.next_attempt_at = None;
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Ready"), ("True".into(), "Active".into()));
        assert_eq!(get(&cs, "Relocating"), ("False".into(), "Idle".into()));

        st.phase = LanePhase::Retiring;
        st.source_queue = Some("lane-2".into());
        st.target_queue = Some("shard-03".into());
        assert!(!promoting(&st));
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Relocating"), ("True".into(), "Retiring".into()));

        let waiting = DedicatedLaneStatus::default();
        let cs = conditions(
            &waiting,
            Some(&Refusal::LaneCapReached { used: 8, max: 8 }),
            Some(1),
            8,
        );
        assert_eq!(
            get(&cs, "Admitted"),
            ("False".into(), "LaneCapReached".into())
        );
    }

    #[test]
    fn a_lane_beyond_a_lowered_cap_says_so_and_counts() {
        assert!(over_cap(7, 2) && over_cap(2, 2) && !over_cap(1, 2));
        // maxLanes is clamped like admission clamps it.
        assert!(!over_cap(7, 99) && over_cap(0, 0) == over_cap(0, 1));
        let st = DedicatedLaneStatus {
            phase: LanePhase::Active,
            lane_index: Some(7),
            target_queue: Some("lane-7".into()),
            ..Default::default()
        };
        let cs = conditions(&st, None, Some(1), 2);
        let a = cs.iter().find(|c| c.type_ == "Admitted").unwrap();
        assert_eq!((a.status.as_str(), a.reason.as_str()), ("False", "OverCap"));
        assert!(!a.message.contains("lane 7 of 2"), "{}", a.message);

        let lane = |name: &str, index: i32| -> DedicatedLane {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "lanekeeper.io/v1alpha1",
                "kind": "DedicatedLane",
                "metadata": {"name": name},
                "spec": {"shardSet": "hooks", "tenant": name},
                "status": {"phase": "Active", "laneIndex": index},
            }))
            .unwrap()
        };
        let lanes: Vec<DedicatedLane> = (0..8).map(|i| lane(&format!("l{i}"), i)).collect();
        assert_eq!(over_cap_count("hooks", &lanes, 2), 6);
        assert_eq!(over_cap_count("hooks", &lanes, 8), 0);
        assert_eq!(over_cap_count("other", &lanes, 2), 0);
    }

    #[test]
    fn a_lane_with_zero_replicas_does_not_take_its_tenant() {
        let mut w: crate::crd::WorkerTemplate =
            serde_json::from_value(serde_json::json!({"image": "i"})).unwrap();
        assert!(has_workers(&w));
        w.replicas = Some(0);
        assert!(!has_workers(&w));
        w.replicas = None;
        w.autoscaled = true;
        assert!(has_workers(&w));
        let st = DedicatedLaneStatus {
            phase: LanePhase::Pending,
            lane_index: Some(1),
            ..Default::default()
        };
        let cs = conditions(&st, Some(&Refusal::NoWorkers), Some(1), 8);
        let a = cs.iter().find(|c| c.type_ == "Admitted").unwrap();
        assert_eq!(
            (a.status.as_str(), a.reason.as_str()),
            ("False", "NoWorkers")
        );
    }
}
