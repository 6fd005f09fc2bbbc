//! Deleting a ShardSet: its lanes retire first, then the finalizer goes.

use crate::controller::build;
use crate::controller::store_for;
use crate::controller::Context;
use crate::controller::Error;
use crate::crd::DedicatedLane;
use crate::crd::ShardSet;
use kube::api::Api;
use kube::api::DeleteParams;
use kube::api::ListParams;
use kube::api::Patch;
use kube::api::PatchParams;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use std::time::Duration;
use tracing::{info, warn};

/// Finalizer of a ShardSet: its DedicatedLanes are retired (each tenant
/// unpaused and routed back to its hash shard in Redis) before the set goes.
pub const FINALIZER: &str = "lanekeeper.io/retire-lanes";

/// What deleting a set still waits for. Pure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finalize {
    /// Deleted with `--cascade=orphan` and the garbage collector has not
    /// yet taken the owner references off the dependents: wait for it.
    Orphaning,
    /// These lanes the set owns still exist: delete them (the lane
    /// reconciler retires each through its own finalizer) and wait.
    RetireLanes(Vec<String>),
    /// Nothing the set owns is left to retire (an orphaning deletion keeps
    /// its Deployments and lanes, and their routing in Redis, as they are):
    /// the finalizer may go.
    Done,
}

/// Decide what finalizing a set needs, from its finalizers and the names
/// of the lanes it owns (by owner UID) that still exist. Pure.
pub fn finalize_step(finalizers: &[String], owned_lanes: Vec<String>) -> Finalize {
    if finalizers.iter().any(|f| f == "orphan") {
        Finalize::Orphaning
    } else if owned_lanes.is_empty() {
        Finalize::Done
    } else {
        Finalize::RetireLanes(owned_lanes)
    }
}

/// A set with a deletionTimestamp: retire its lanes (unless orphaning),
/// then drop the finalizer. While lanes retire, the set's Deployments stay
/// (background deletion waits for the finalizer; foreground deletion waits
/// for the Deployments and lanes, which block their owner's deletion).
pub(super) async fn finalize(
    set: &ShardSet,
    ctx: &Context,
    sets: &Api<ShardSet>,
    lane_api: &Api<DeserializeGuard<DedicatedLane>>,
) -> Result<Action, Error> {
    if !set.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let name = set.name_any();
    let lanes: Vec<DedicatedLane> = lane_api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        // An undecodable lane cannot be retired by the lane reconciler either.
        .filter_map(|l| l.0.ok())
        .filter(|l| l.spec.shard_set == name)
        .filter(|l| build::owned_by(l.owner_references(), set.uid().as_deref()))
        .collect();
    let names = lanes.iter().map(|l| l.name_any()).collect();
    match finalize_step(set.finalizers(), names) {
        Finalize::Orphaning => return Ok(Action::requeue(Duration::from_secs(1))),
        Finalize::RetireLanes(names) => {
            for lane in lanes
                .iter()
                .filter(|l| l.metadata.deletion_timestamp.is_none())
            {
                info!(set = %name, lane = %lane.name_any(), "the set is being deleted: retiring its lane");
                match lane_api
                    .delete(&lane.name_any(), &DeleteParams::default())
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            // The set is not reconciled any more, so a reshard it began
            // never ends: let the lanes move (the tenants a reshard had in
            // motion stay pinned to shards; a set created again finishes
            // their moves).
            if let Ok(store) = store_for(set, ctx).await {
                if let Err(e) = store.reshard_end().await {
                    warn!(set = %name, error = %e, "cannot open the lane gate for retiring lanes");
                }
            }
            info!(set = %name, lanes = ?names, "waiting for the set's lanes to retire before it goes");
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        Finalize::Done => {}
    }
    let key = ObjectRef::from_obj(set);
    ctx.reshards
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    ctx.failures
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&key);
    let rest: Vec<String> = set
        .finalizers()
        .iter()
        .filter(|f| f.as_str() != FINALIZER)
        .cloned()
        .collect();
    match set_finalizers(sets, set, rest).await {
        Ok(()) => {}
        Err(Error::Kube(kube::Error::Api(e))) if e.code == 404 => {}
        Err(e) => return Err(e),
    }
    info!(set = %name, "finalizer removed");
    Ok(Action::await_change())
}

/// Write the set's finalizers (guarded by its resourceVersion).
pub(super) async fn set_finalizers(
    sets: &Api<ShardSet>,
    set: &ShardSet,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    let patch = serde_json::json!({
        "metadata": {
            "finalizers": finalizers,
            "resourceVersion": set.resource_version(),
        }
    });
    sets.patch(
        &set.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod finalize_tests {
    use super::*;

    #[test]
    fn deleting_a_set_retires_the_lanes_it_owns_then_lets_go() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            finalize_step(&f(&[FINALIZER]), f(&["hooks-whale"])),
            Finalize::RetireLanes(f(&["hooks-whale"]))
        );
        assert_eq!(
            finalize_step(&f(&["foregroundDeletion", FINALIZER]), f(&["a", "b"])),
            Finalize::RetireLanes(f(&["a", "b"]))
        );
        assert_eq!(finalize_step(&f(&[FINALIZER]), vec![]), Finalize::Done);
        // --cascade=orphan: wait for the garbage collector to orphan the
        // dependents; then no lane is owned and nothing is retired.
        assert_eq!(
            finalize_step(&f(&["orphan", FINALIZER]), f(&["hooks-whale"])),
            Finalize::Orphaning
        );
    }
}
