//! `lanekeeper controller`: a ShardSet becomes one worker Deployment per
//! shard, the routing table and queue policies in Redis, and honest status;
//! a DedicatedLane moves one tenant onto a lane of its own.
//!
//! - [`shardset`] reconciles ShardSets, as a pipeline of typed steps (see
//!   its `reconcile_inner`); [`lane`] reconciles DedicatedLanes;
//!   [`promotion`] decides which tenants get lanes, and [`shaping`] which
//!   of those that cannot get one ingest shapes; [`reshard`] moves
//!   tenants when the shard count changes.
//! - [`build`] and [`status`] are pure: objects and conditions from specs
//!   and observations.
//! - [`dataplane`] is what a spec writes into Redis, shared with
//!   `lanekeeper dataplane apply` (no Kubernetes client).
//! - [`context`] is the shared state (client, recorders, memos),
//!   [`connections`] a set's Redis, [`api`] the small API-server helpers.

pub mod api;
pub mod build;
mod connections;
mod context;
pub mod dataplane;
pub mod lane;
pub mod leader;
pub mod metrics;
pub mod promotion;
pub mod relocation;
pub mod reshard;
pub mod shaping;
mod shardset;
pub mod status;

pub(crate) use connections::{check_redis_secrets, store_for};
pub use context::Context;
pub use shardset::{finalize_step, Finalize, FINALIZER};

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, ListParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::Client;
use tracing::{info, warn};

use crate::crd::{DedicatedLane, ShardSet};
use crate::store::Store;
use build::{BuildError, PolicyViolation};

/// What can go wrong in a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("invalid spec: {0}")]
    Build(#[from] BuildError),
    #[error("refused: {0}")]
    Policy(#[from] PolicyViolation),
    #[error("cannot decode ShardSet {name}: {error}; fix or delete the object")]
    Undecodable { name: String, error: String },
}
/// Where the controller runs.
#[derive(Clone, Debug)]
pub struct ControllerOptions {
    /// Watch one namespace, or all when `None`.
    pub namespace: Option<String>,
    /// Period of the promotion loop (tenants measured, lanes created or retired).
    pub promotion_tick: Duration,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        Self {
            namespace: None,
            promotion_tick: Duration::from_secs(60),
        }
    }
}

/// Check the CRDs are installed, then run the ShardSet controller, the
/// DedicatedLane controller and the promotion loop until `stop` resolves
/// (SIGTERM, or lost leadership).
pub async fn run(
    client: Client,
    opts: ControllerOptions,
    ctx: Arc<Context>,
    stop: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    // Guarded: one object the code cannot decode must not stall the watch.
    let ns = opts.namespace.as_deref();
    let sets: Api<DeserializeGuard<ShardSet>> = api::scoped(&client, ns);
    let deployments: Api<Deployment> = api::scoped(&client, ns);
    let lanes: Api<DeserializeGuard<DedicatedLane>> = api::scoped(&client, ns);
    if let Err(e) = sets.list(&ListParams::default().limit(1)).await {
        anyhow::bail!(
            "cannot list ShardSets ({e}); are the CRDs installed? Run `kubectl apply -f crds/` (or `lanekeeper crds | kubectl apply -f -`)"
        );
    }
    info!(namespace = ?opts.namespace, tick = ?opts.promotion_tick, "controller started");
    let stop = futures::FutureExt::shared(stop);
    let lanes_task = tokio::spawn(lane::run(ctx.clone(), opts.namespace.clone(), stop.clone()));
    let promotion_task = {
        let (ctx, ns, tick, stop) = (
            ctx.clone(),
            opts.namespace.clone(),
            opts.promotion_tick,
            stop.clone(),
        );
        tokio::spawn(async move {
            tokio::select! {
                _ = promotion::run(ctx, ns, tick) => {}
                _ = stop => {}
            }
        })
    };
    // A Redis that lost its state is noticed within seconds, not at the
    // next periodic reconcile: one HEXISTS per set every two seconds.
    let (lost_tx, lost_rx) = tokio::sync::mpsc::channel::<()>(1);
    let lost_task = {
        let ctx = ctx.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = watch_routing(ctx, lost_tx) => {}
                _ = stop => {}
            }
        })
    };
    let lost_stream = futures::stream::unfold(lost_rx, |mut rx| async move {
        rx.recv().await.map(|()| ((), rx))
    });
    Controller::new(sets, watcher::Config::default().any_semantic())
        .reconcile_all_on(lost_stream)
        .owns(
            deployments,
            watcher::Config::default().labels("app.kubernetes.io/managed-by=lanekeeper-controller"),
        )
        // A lane's change is its ShardSet's change (lanes count toward the cap).
        .watches(lanes, watcher::Config::default(), |lane| {
            let (set, ns) = match &lane.0 {
                Ok(l) => (Some(l.spec.shard_set.clone()), l.metadata.namespace.clone()),
                Err(_) => (None, None),
            };
            set.zip(ns)
                .map(|(set, ns)| ObjectRef::<DeserializeGuard<ShardSet>>::new(&set).within(&ns))
        })
        .graceful_shutdown_on(stop)
        .run(
            shardset::reconcile_guarded,
            shardset::error_policy_guarded,
            ctx,
        )
        .for_each(|res| async move {
            if let Err(e) = res {
                warn!(error = %e, "reconcile failed");
            }
        })
        .await;
    let _ = promotion_task.await;
    let _ = lanes_task.await;
    let _ = lost_task.await;
    info!("controller stopped");
    Ok(())
}

/// How often the routing table of every set is checked for a Redis that lost its state.
const ROUTING_WATCH: Duration = Duration::from_secs(2);

/// Ask for a reconcile of every set when the routing table of one of the
/// sets this controller has connected to is gone.
async fn watch_routing(ctx: Arc<Context>, lost: tokio::sync::mpsc::Sender<()>) {
    loop {
        tokio::time::sleep(ROUTING_WATCH).await;
        let stores: Vec<Store> = ctx
            .stores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|c| c.state.as_ref().ok().cloned())
            .collect();
        for store in stores {
            if let Ok(false) = store.routing_present().await {
                let _ = lost.try_send(());
                break;
            }
        }
    }
}
