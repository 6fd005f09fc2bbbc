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
//!
//! Layout: `step.rs` decides (the pure [`next_step`] over [`Facts`]),
//! `io.rs` reads the facts and carries the steps out, `rules.rs` holds the
//! pure rules (admission, conditions, the cap); this file runs the
//! controller, one reconcile and the step loop. The move itself is the
//! protocol in `controller::relocation`, shared with reshards.

mod io;
#[cfg(test)]
mod mock_tests;
mod rules;
mod step;
#[cfg(test)]
mod step_tests;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DedicatedLane, LanePhase, ShardSet};

pub use super::relocation::{Drain, MAX_DRAIN_BACKOFF, MIN_DRAIN_BACKOFF};
use super::status::condition;
use super::Context;
use io::Io;
pub use rules::*;
pub use step::{next_step, Act, Done, Effect, Facts, Read, Record, Step, Then};

/// Field manager of DedicatedLane status (and of the finalizer and owner reference).
pub const FIELD_MANAGER: &str = "lanekeeper-lanes";
/// Finalizer that makes deleting a lane demote its tenant first.
pub const FINALIZER: &str = "lanekeeper.io/relocation";
/// Test hook: when set to a phase name, the controller process exits (code
/// 86) right after doing that phase's work and before recording the next
/// phase, to prove that every step can be repeated after a crash.
pub const CRASH_HOOK_ENV: &str = "LANEKEEPER_TEST_CRASH_AFTER_PHASE";

use crate::crd::conditions;
use step::POLL;

/// Run the DedicatedLane controller until `stop` resolves.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    stop: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let ns = namespace.as_deref();
    let lanes: Api<DeserializeGuard<DedicatedLane>> =
        crate::controller::api::scoped(&ctx.client, ns);
    let sets: Api<DeserializeGuard<ShardSet>> = crate::controller::api::scoped(&ctx.client, ns);
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

/// One reconcile: run phase steps until the lane must wait for something.
#[tracing::instrument(name = "reconcile_lane", skip_all, fields(namespace = %cached.namespace().unwrap_or_default(), lane = %cached.name_any(), tenant = %cached.spec.tenant))]
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
        conds.retain(|c| c.type_ != conditions::ADMITTED);
        conds.push(condition(
            &st.conditions,
            conditions::ADMITTED,
            false,
            conditions::SHARD_SET_NOT_FOUND,
            format!("ShardSet {} does not exist in {ns}", lane.spec.shard_set),
            lane.metadata.generation,
        ));
        st.conditions = conds;
        crate::controller::api::apply_status(&lanes, &name, FIELD_MANAGER, &st).await?;
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

/// Carry out steps until the lane must wait for something: decide
/// ([`next_step`]), read what the decision asks for or act on it, repeat.
async fn step_until_wait(io: &mut Io<'_>) -> Result<Action, LaneError> {
    let mut done = Done::default();
    let mut facts = io.facts(&done);
    // A bound on one reconcile (a move takes a dozen steps and reads).
    for _ in 0..128 {
        match next_step(&facts) {
            Step::Read(what) => io.read(what, &mut facts).await?,
            Step::Fail(why) => return Err(LaneError::Other(why.to_string())),
            Step::Act(act) => {
                let phase = facts.status.phase;
                io.act(&act, &mut done).await?;
                facts = io.facts(&done);
                if facts.status.phase != phase {
                    done = Done::default();
                    facts.done = Done::default();
                }
                match act.then {
                    Then::Next => {}
                    Then::Requeue(d) => return Ok(Action::requeue(d)),
                    Then::AwaitChange => return Ok(Action::await_change()),
                }
            }
        }
    }
    Ok(Action::requeue(POLL))
}
