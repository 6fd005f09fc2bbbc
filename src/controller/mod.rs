//! `lanekeeper controller`: a ShardSet becomes one worker Deployment per
//! shard, the routing table and queue policies in Redis, and honest status.
//!
//! Reconcile is a pipeline: validate and build (pure, `build`), apply
//! (server-side apply, then prune what the set no longer wants), write Redis,
//! then status (server-side apply with a stable field manager).

pub mod build;
pub mod lane;
#[cfg(test)]
mod mock_tests;
pub mod promotion;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DedicatedLane, RedisSpec, ShardSet, ShardSetStatus};
use crate::routing::QueueId;
use crate::scheduler::QueuePolicy;
use crate::store::{ConnectOptions, SetId, Store};
use build::{shard_deployments, shard_selector, BuildError, FIELD_MANAGER};

/// What can go wrong in a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("invalid spec: {0}")]
    Build(#[from] BuildError),
    #[error("cannot decode ShardSet {name}: {error}; fix or delete the object")]
    Undecodable { name: String, error: String },
}

/// Shared state of the reconcilers.
pub struct Context {
    pub client: Client,
    reporter: Reporter,
    /// One Redis connection per (URL, set), reused across reconciles.
    stores: Mutex<HashMap<(String, SetId), Store>>,
    /// Consecutive failures per object, for bounded exponential backoff.
    failures: Mutex<HashMap<ObjectRef<ShardSet>, u32>>,
    /// Lane indexes are handed out one at a time.
    admission: tokio::sync::Mutex<()>,
    pub metrics: crate::telemetry::ControllerMetrics,
}

impl Context {
    pub fn new(client: Client, metrics: crate::telemetry::ControllerMetrics) -> Self {
        Self {
            client,
            reporter: Reporter::from(FIELD_MANAGER),
            stores: Mutex::default(),
            failures: Mutex::default(),
            admission: tokio::sync::Mutex::new(()),
            metrics,
        }
    }
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
    let sets: Api<DeserializeGuard<ShardSet>> = match &opts.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let deployments: Api<Deployment> = match &opts.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let lanes: Api<DeserializeGuard<DedicatedLane>> = match &opts.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
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
    Controller::new(sets, watcher::Config::default().any_semantic())
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
        .run(reconcile_guarded, error_policy_guarded, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                warn!(error = %e, "reconcile failed");
            }
        })
        .await;
    let _ = promotion_task.await;
    let _ = lanes_task.await;
    info!("controller stopped");
    Ok(())
}

async fn reconcile_guarded(
    obj: Arc<DeserializeGuard<ShardSet>>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    match &obj.0 {
        Ok(set) => reconcile(Arc::new(set.clone()), ctx).await,
        Err(invalid) => Err(Error::Undecodable {
            name: format!(
                "{}/{}",
                invalid.metadata.namespace.clone().unwrap_or_default(),
                invalid.metadata.name.clone().unwrap_or_default()
            ),
            error: invalid.error.clone(),
        }),
    }
}

fn error_policy_guarded(
    obj: Arc<DeserializeGuard<ShardSet>>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    match &obj.0 {
        Ok(set) => error_policy(Arc::new(set.clone()), err, ctx),
        Err(_) => {
            ctx.metrics
                .reconcile_errors
                .get_or_create(&error_kind(err))
                .inc();
            Action::await_change()
        }
    }
}

fn error_policy(set: Arc<ShardSet>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .reconcile_errors
        .get_or_create(&error_kind(err))
        .inc();
    match err {
        // Waits for a change of the spec (or of an undecodable object).
        Error::Build(_) | Error::Undecodable { .. } => Action::await_change(),
        Error::Kube(_) => {
            let mut failures = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
            let n = failures.entry(ObjectRef::from_obj(&*set)).or_default();
            *n += 1;
            Action::requeue(Duration::from_secs(2u64.saturating_pow(*n).min(300)))
        }
    }
}

fn error_kind(err: &Error) -> crate::telemetry::ErrorLabels {
    crate::telemetry::ErrorLabels {
        kind: match err {
            Error::Kube(_) => "kube",
            Error::Build(_) => "invalid_spec",
            Error::Undecodable { .. } => "undecodable",
        }
        .to_string(),
    }
}

async fn reconcile(set: Arc<ShardSet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_inner(&set, &ctx).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok() {
        ctx.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ObjectRef::from_obj(&*set));
    }
    result
}

async fn reconcile_inner(set: &ShardSet, ctx: &Context) -> Result<Action, Error> {
    let name = set.name_any();
    let ns = set.namespace().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ns);
    let sets: Api<ShardSet> = Api::namespaced(ctx.client.clone(), &ns);

    // validate + build (pure)
    let wanted = match shard_deployments(set) {
        Ok(w) => w,
        Err(e) => {
            let st = status::invalid_spec(set, &e.to_string());
            write_status(&sets, set, ctx, st).await?;
            return Err(e.into());
        }
    };

    // apply, then prune what the set no longer wants
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for d in &wanted {
        let dname = d.metadata.name.clone().unwrap_or_default();
        deployments.patch(&dname, &params, &Patch::Apply(d)).await?;
    }
    let existing = deployments
        .list(&ListParams::default().labels(&shard_selector(&name)))
        .await?;
    let wanted_names: Vec<String> = wanted
        .iter()
        .filter_map(|d| d.metadata.name.clone())
        .collect();
    for d in &existing.items {
        let dname = d.name_any();
        if !wanted_names.contains(&dname) {
            info!(set = %name, deployment = %dname, "pruning a shard Deployment the set no longer wants");
            deployments
                .delete(&dname, &DeleteParams::background())
                .await?;
        }
    }
    let current: Vec<&Deployment> = existing
        .items
        .iter()
        .filter(|d| wanted_names.contains(&d.name_any()))
        .collect();

    // Redis: routing table and queue policies, then attribution for status
    let redis = sync_redis(set, ctx).await;

    let lane_api: Api<DedicatedLane> = Api::namespaced(ctx.client.clone(), &ns);
    let all_lanes = lane_api.list(&ListParams::default()).await?.items;
    let (admitted, waiting_for_cap) = lane::summary(&name, &all_lanes);
    let lanes = status::Lanes {
        admitted,
        waiting_for_cap,
    };
    let st = status::compute(set, &current, lanes, redis.as_ref());
    let ready = st
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    write_status(&sets, set, ctx, st).await?;
    record_lanes(set, ctx).await;
    Ok(if ready {
        // Also the period at which a Redis outage and attribution are noticed.
        Action::requeue(Duration::from_secs(15))
    } else {
        Action::requeue(Duration::from_secs(10))
    })
}

/// Write the routing table and the queue policies; read attribution.
async fn sync_redis(set: &ShardSet, ctx: &Context) -> Result<status::RedisView, String> {
    let store = store_for(set, ctx).await?;
    let shards = set.spec.shards as u16;
    store.set_shards(shards).await.map_err(|e| e.to_string())?;
    let policy = QueuePolicy::from_spec(&set.spec);
    let window: Duration = set.spec.promotion.window.into();
    let mut view = status::RedisView::default();
    for n in 0..shards {
        let q = QueueId::Shard(n);
        store
            .configure_queue(q, &policy)
            .await
            .map_err(|e| e.to_string())?;
        let stats = store
            .tenant_stats(q, window)
            .await
            .map_err(|e| e.to_string())?;
        let depth: u64 = stats.iter().map(|t| t.depth).sum();
        ctx.metrics
            .queue_depth
            .get_or_create(&crate::telemetry::QueueDepthLabels {
                namespace: set.namespace().unwrap_or_default(),
                shard_set: set.name_any(),
                queue: q.to_string(),
            })
            .set(depth as i64);
        view.queues.push((q, stats));
    }
    // Lane queues: a series for each lane that has had a tenant (the lanes'
    // own reconciler configures them); none for a lane never used.
    for i in 0..crate::routing::MAX_LANES {
        let q = QueueId::Lane(i);
        let labels = crate::telemetry::QueueDepthLabels {
            namespace: set.namespace().unwrap_or_default(),
            shard_set: set.name_any(),
            queue: q.to_string(),
        };
        let stats = store
            .tenant_stats(q, window)
            .await
            .map_err(|e| e.to_string())?;
        if stats.is_empty() {
            ctx.metrics.queue_depth.remove(&labels);
        } else {
            let depth: u64 = stats.iter().map(|t| t.depth).sum();
            ctx.metrics
                .queue_depth
                .get_or_create(&labels)
                .set(depth as i64);
        }
    }
    ctx.metrics
        .shards
        .get_or_create(&set_labels(set))
        .set(shards as i64);
    Ok(view)
}

fn set_labels(set: &ShardSet) -> crate::telemetry::SetLabels {
    crate::telemetry::SetLabels {
        namespace: set.namespace().unwrap_or_default(),
        shard_set: set.name_any(),
    }
}

async fn store_for(set: &ShardSet, ctx: &Context) -> Result<Store, String> {
    let ns = set.namespace().unwrap_or_default();
    let url = redis_url(&ctx.client, &ns, &set.spec.redis).await?;
    let id = SetId::new(&ns, set.name_any());
    let key = (url.clone(), id.clone());
    if let Some(s) = ctx
        .stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
    {
        return Ok(s.clone());
    }
    let opts = ConnectOptions {
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(3),
    };
    let store = Store::connect(&url, id, opts)
        .await
        .map_err(|e| format!("cannot reach Redis for {ns}/{}: {e}", set.name_any()))?;
    ctx.stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, store.clone());
    Ok(store)
}

/// The Redis URL of a set, resolving Secret references.
async fn redis_url(client: &Client, ns: &str, spec: &RedisSpec) -> Result<String, String> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let read = |name: String, key: String| {
        let secrets = secrets.clone();
        async move {
            let s = secrets
                .get(&name)
                .await
                .map_err(|e| format!("reading Secret {ns}/{name}: {e}"))?;
            let v = s
                .data
                .and_then(|d| d.get(&key).cloned())
                .ok_or_else(|| format!("Secret {ns}/{name} has no key {key}"))?;
            String::from_utf8(v.0).map_err(|_| format!("Secret {ns}/{name} key {key} is not UTF-8"))
        }
    };
    let url = match (&spec.url, &spec.url_secret_ref) {
        (_, Some(r)) => read(r.name.clone(), r.key.clone()).await?,
        (Some(u), None) => u.clone(),
        (None, None) => return Err("spec.redis has neither url nor urlSecretRef".to_string()),
    };
    let url = crate::store::cluster_url(&url, spec.cluster);
    match &spec.password_secret_ref {
        Some(r) => {
            let password = read(r.name.clone(), r.key.clone()).await?;
            crate::store::with_password(&url, &password)
        }
        None => Ok(url),
    }
}

async fn write_status(
    sets: &Api<ShardSet>,
    set: &ShardSet,
    ctx: &Context,
    st: ShardSetStatus,
) -> Result<(), Error> {
    let before = set.status.clone().unwrap_or_default();
    for t in status::transitions(&before, &st) {
        let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
        let event = Event {
            type_: if t.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: t.reason,
            note: Some(t.note),
            action: format!("{}Changed", t.type_),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &set.object_ref(&())).await {
            warn!(error = %e, "cannot record an event");
        }
    }
    let patch = serde_json::json!({
        "apiVersion": "lanekeeper.io/v1alpha1",
        "kind": "ShardSet",
        "status": st,
    });
    sets.patch_status(
        &set.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    ctx.metrics
        .record_status(&set.namespace().unwrap_or_default(), &set.name_any(), &st);
    Ok(())
}

/// Export the phase and conditions of the set's DedicatedLanes. A failure
/// only costs the metrics of this round, never the reconcile.
async fn record_lanes(set: &ShardSet, ctx: &Context) {
    let ns = set.namespace().unwrap_or_default();
    let name = set.name_any();
    let lanes: Api<DeserializeGuard<DedicatedLane>> = Api::namespaced(ctx.client.clone(), &ns);
    let list = match lanes.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(e) => {
            warn!(set = %name, error = %e, "cannot list DedicatedLanes for metrics");
            return;
        }
    };
    let views: Vec<crate::telemetry::LaneView> = list
        .items
        .iter()
        .filter_map(|l| l.0.as_ref().ok())
        .filter(|l| l.spec.shard_set == name)
        .map(|l| {
            let status = l.status.clone().unwrap_or_default();
            crate::telemetry::LaneView {
                name: l.name_any(),
                tenant: l.spec.tenant.clone(),
                phase: format!("{:?}", status.phase),
                conditions: status
                    .conditions
                    .iter()
                    .map(|c| (c.type_.clone(), c.status == "True"))
                    .collect(),
            }
        })
        .collect();
    ctx.metrics.record_lanes(&ns, &name, &views);
}
