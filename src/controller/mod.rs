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
pub mod relocation;
pub mod reshard;
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
use crate::store::{ConnectOptions, RedisTls, SetId, Store};
use build::{
    shard_deployments_upto, shard_of, shard_selector, BuildError, PolicyViolation, WorkerPolicy,
    FIELD_MANAGER,
};

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

/// Most Redis connections (one per set) kept at once; past it the least
/// recently used goes.
const MAX_STORES: usize = 4096;

/// A set's Redis connection, or its last failure to connect, for the target
/// with `fingerprint` (a hash of URL and TLS material: no secret in the map
/// key, and a change of URL replaces the entry).
struct CachedStore {
    fingerprint: [u8; 32],
    state: Result<Store, ConnectFailure>,
    used: Instant,
}

/// A failed connect, not tried again before `retry_at` (exponential backoff).
#[derive(Clone)]
struct ConnectFailure {
    retry_at: Instant,
    attempts: u32,
    /// Without any secret.
    message: String,
}

/// Backoff after the `attempts`th consecutive failed connect: 5 s doubling,
/// at most a minute (a Redis that comes back is used within a minute).
fn connect_backoff(attempts: u32) -> Duration {
    Duration::from_secs(
        5u64.saturating_mul(1 << attempts.saturating_sub(1).min(6))
            .min(60),
    )
}

/// Shared state of the reconcilers.
pub struct Context {
    pub client: Client,
    /// Event recorders, one per note: kube-runtime aggregates a repeated
    /// Event into a series only within one Recorder (a Recorder per Event
    /// made every repeat a new Event), and its series key leaves the note
    /// out, so a different note would update the first Event's count and
    /// keep its old note. One Recorder per note repeats what client-go does
    /// (its key includes the note): the same Event again is a series, a new
    /// note a new Event.
    recorders: Mutex<HashMap<u64, Recorder>>,
    /// Per set, its Redis connection (or connect failure), reused across
    /// reconciles; pruned when the set goes, replaced when its target changes.
    stores: Mutex<HashMap<SetId, CachedStore>>,
    /// Consecutive failures per object, for bounded exponential backoff.
    failures: Mutex<HashMap<ObjectRef<ShardSet>, u32>>,
    /// What this process last applied to each shard Deployment, so an
    /// unchanged one is not applied again at every resync.
    applied: Mutex<HashMap<(String, String), Applied>>,
    /// Lane indexes are handed out one at a time.
    admission: tokio::sync::Mutex<()>,
    /// Per set: the reshard under way, as this process last decided it.
    reshards: Mutex<HashMap<ObjectRef<ShardSet>, Arc<tokio::sync::Mutex<ReshardMemory>>>>,
    pub metrics: crate::telemetry::ControllerMetrics,
    /// What the operator lets a ShardSet's worker template ask for.
    pub worker_policy: WorkerPolicy,
}

impl Context {
    pub fn new(client: Client, metrics: crate::telemetry::ControllerMetrics) -> Self {
        Self {
            recorders: Mutex::default(),
            client,
            stores: Mutex::default(),
            failures: Mutex::default(),
            applied: Mutex::default(),
            admission: tokio::sync::Mutex::new(()),
            reshards: Mutex::default(),
            metrics,
            worker_policy: WorkerPolicy::default(),
        }
    }

    /// The operator's limits on worker templates.
    pub fn with_worker_policy(mut self, policy: WorkerPolicy) -> Self {
        self.worker_policy = policy;
        self
    }

    /// Drop the connections of sets not in `live` (the promotion loop's
    /// list of every set in scope).
    pub(crate) fn prune_stores(&self, live: &std::collections::HashSet<SetId>) {
        self.stores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, _| {
                let keep = live.contains(id);
                if !keep {
                    info!(namespace = %id.namespace, set = %id.name, "the set is gone: its Redis connection is closed");
                }
                keep
            });
    }
}

/// Distinct Event notes remembered for aggregation.
const MAX_RECORDERS: usize = 4096;

/// One apply of a Deployment, as the API server answered it.
#[derive(Clone, Debug)]
struct Applied {
    digest: [u8; 32],
    uid: Option<String>,
    generation: Option<i64>,
    at: Instant,
}

/// An unchanged Deployment is applied again after this long anyway, which
/// restores a field someone changed without bumping its generation (labels,
/// annotations).
const REAPPLY_AFTER: Duration = Duration::from_secs(600);

impl Applied {
    /// Would applying `digest` over `seen` (from a list just now) change
    /// nothing? True when this process applied exactly that object, and the
    /// Deployment is still the one it answered (same uid) with no spec change
    /// since (same generation), within [`REAPPLY_AFTER`]. Pure.
    fn covers(&self, digest: &[u8; 32], seen: &Deployment, now: Instant) -> bool {
        self.digest == *digest
            && seen.metadata.uid.is_some()
            && self.uid == seen.metadata.uid
            && self.generation == seen.metadata.generation
            && now.duration_since(self.at) < REAPPLY_AFTER
    }
}

impl Context {
    fn applied_memo(&self, key: &(String, String)) -> Option<Applied> {
        let memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.get(key).cloned()
    }

    fn remember_applied(&self, key: (String, String), applied: Applied) {
        let mut memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.insert(key, applied);
    }

    fn forget_applied(&self, key: &(String, String)) {
        let mut memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.remove(key);
    }

    /// Record an Event about `object` through the shared recorder (repeats
    /// aggregate); a failure to record is logged, never the reconcile's.
    pub async fn event(
        &self,
        object: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note.chars().take(1000).collect()),
            action: action.to_string(),
            secondary: None,
        };
        let recorder = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            event.note.hash(&mut h);
            let mut all = self.recorders.lock().unwrap_or_else(|e| e.into_inner());
            if all.len() >= MAX_RECORDERS {
                // Bounded: forgetting only costs a new Event for a repeat.
                all.clear();
            }
            all.entry(h.finish())
                .or_insert_with(|| {
                    Recorder::new(self.client.clone(), Reporter::from(FIELD_MANAGER))
                })
                .clone()
        };
        if let Err(e) = recorder.publish(&event, object).await {
            warn!(error = %e, reason, "cannot record an event");
        }
    }
}

/// A set's reshard memory, seeded once from its status (after a restart).
#[derive(Debug, Default)]
struct ReshardMemory {
    seeded: bool,
    set: reshard::SetMemory,
}

/// How often a reshard under way is looked at again.
const RESHARD_POLL: Duration = Duration::from_millis(500);

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
        .run(reconcile_guarded, error_policy_guarded, ctx)
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
        Error::Build(_) | Error::Policy(_) | Error::Undecodable { .. } => Action::await_change(),
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
            Error::Policy(_) => "refused",
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
    let lane_api: Api<DeserializeGuard<DedicatedLane>> = Api::namespaced(ctx.client.clone(), &ns);

    // A set being deleted is only finalized: nothing is applied or owned
    // again (`--cascade=orphan` keeps its Deployments).
    if set.metadata.deletion_timestamp.is_some() {
        return finalize(set, ctx, &sets, &lane_api).await;
    }
    if !set.finalizers().iter().any(|f| f == FINALIZER) {
        let mut finalizers = set.finalizers().to_vec();
        finalizers.push(FINALIZER.to_string());
        set_finalizers(&sets, set, finalizers).await?;
    }

    // validate (pure)
    if let Err(e) = shard_deployments_upto(set, 0) {
        let st = status::invalid_spec(set, &e.to_string());
        write_status(&sets, set, ctx, st).await?;
        return Err(e.into());
    }
    // What the set's author may not ask for: refused, with the field named.
    let checked = match build::check_redis_credentials(&set.spec.redis)
        .and_then(|()| build::enforce_worker_policy(set, &ctx.worker_policy))
    {
        Ok(effective) => check_redis_secrets(&ctx.client, &ns, &set.spec.redis)
            .await
            .map(|()| effective),
        Err(v) => Err(v.into()),
    };
    let effective = match checked {
        Ok(effective) => effective,
        Err(Error::Policy(v)) => {
            refuse(&sets, set, ctx, &v).await?;
            return Err(v.into());
        }
        Err(e) => return Err(e),
    };
    let set = &effective;
    let desired = set.spec.shards as u16;
    // Only the Deployments this set owns (by owner UID): another object
    // carrying the set's labels is neither counted nor pruned.
    let uid = set.uid();
    let existing: Vec<Deployment> = deployments
        .list(&ListParams::default().labels(&shard_selector(&name)))
        .await?
        .items
        .into_iter()
        .filter(|d| build::owned_by(d.owner_references(), uid.as_deref()))
        .collect();
    let existing_shards = existing
        .iter()
        .filter_map(shard_of)
        .map(|n| n + 1)
        .max()
        .unwrap_or(0);
    // Guarded: one DedicatedLane this version cannot decode must not stop
    // every set of its namespace (the lane reconciler reports it on the lane).
    let all_lanes: Vec<DedicatedLane> = lane_api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|l| match l.0 {
            Ok(lane) => Some(lane),
            Err(e) => {
                warn!(set = %name, error = %e, "skipping a DedicatedLane that cannot be decoded");
                None
            }
        })
        .collect();
    let lane_names: Vec<String> = all_lanes
        .iter()
        .filter(|l| l.spec.shard_set == name)
        .map(|l| l.name_any())
        .collect();
    // Tenants a DedicatedLane is moving or serving: a reshard leaves them be.
    let lane_tenants: std::collections::BTreeSet<String> = all_lanes
        .iter()
        .filter(|l| l.spec.shard_set == name)
        .filter(|l| {
            l.status
                .as_ref()
                .is_none_or(|s| s.phase != crate::crd::LanePhase::Retired)
        })
        .map(|l| l.spec.tenant.clone())
        .collect();

    // The reshard under way, if any: remembered here, seeded from status.
    let memory = {
        let mut all = ctx.reshards.lock().unwrap_or_else(|e| e.into_inner());
        all.entry(ObjectRef::from_obj(set)).or_default().clone()
    };
    let mut memory = memory.lock().await;
    if !memory.seeded {
        memory.seeded = true;
        memory.set.progress = set.status.as_ref().and_then(|s| s.resharding.clone());
    }
    let store = store_for(set, ctx).await;
    let mut routing = match &store {
        Ok(store) => store.routing().await.map_err(|e| e.to_string()),
        Err(e) => Err(e.clone()),
    };
    // A table without the epoch mark: a new set, one from before the mark
    // existed, or a Redis that lost its state. Rewrite what the controller
    // knows (shard count, queue policies, lane pins) before anyone routes.
    let mut restored = None;
    let mut epoch = None;
    if let (Ok(store), Ok(table)) = (&store, &routing) {
        match restore_routing(set, store, table, &all_lanes, desired).await {
            Ok((mark, lost)) => {
                epoch = Some(mark);
                if let Some(what) = lost {
                    warn!(set = %name, "{what}");
                    // Whatever the reshard had planned lived in that Redis.
                    memory.set.progress = None;
                    ctx.event(
                        &set.object_ref(&()),
                        EventType::Warning,
                        "RedisStateLost",
                        "Restore",
                        what.clone(),
                    )
                    .await;
                    restored = Some(what);
                }
                if table.epoch.is_none() {
                    routing = store.routing().await.map_err(|e| e.to_string());
                }
            }
            Err(e) => warn!(set = %name, error = %e, "cannot restore the routing table; retrying"),
        }
    }
    // What ingest's 202 means: producers read it with the routing table.
    if let (Ok(store), Ok(table)) = (&store, &routing) {
        let wanted = replicated(set);
        if table.replicated != wanted {
            if let Err(e) = store.set_durability(wanted).await {
                warn!(set = %name, error = %e, "cannot write the durability setting; retrying");
            }
        }
    }
    if let (Ok(table), None) = (&routing, &memory.set.progress) {
        // Moves pinned but no record of them (status lost in a crash).
        let pinned = reshard::in_motion(table).len();
        if pinned > 0 {
            memory.set.progress = Some(crate::crd::ReshardProgress {
                from_shards: existing_shards.max(table.shards) as i32,
                to_shards: desired as i32,
                to_move: pinned as i32,
                ..Default::default()
            });
        }
    }
    let table_shards = routing.as_ref().map(|t| t.shards).unwrap_or(desired);
    let change_pending = table_shards != 0 && table_shards != desired;
    let resharding = change_pending || memory.set.progress.is_some();
    // While a reshard runs, no shard Deployment is removed.
    let keep = if resharding {
        desired.max(existing_shards).max(table_shards)
    } else {
        desired
    };
    let wanted = shard_deployments_upto(set, keep)?;

    // apply, then prune what the set no longer wants
    let params = PatchParams::apply(FIELD_MANAGER).force();
    // What the API server returns from each apply: the Deployments as they
    // are now (a new generation not yet rolled out is not available).
    // An unchanged Deployment (what this process applied last, same uid and
    // generation) is not sent again: an idle set costs its lists and nothing
    // more per resync.
    let mut applied = Vec::with_capacity(wanted.len());
    for d in &wanted {
        let dname = d.metadata.name.clone().unwrap_or_default();
        let key = (ns.clone(), dname.clone());
        let digest = build::digest(d);
        let seen = existing.iter().find(|e| e.name_any() == dname);
        let memo = ctx.applied_memo(&key);
        if let (Some(seen), Some(memo)) = (seen, memo) {
            if memo.covers(&digest, seen, Instant::now()) {
                applied.push(seen.clone());
                continue;
            }
        }
        let out = match deployments.patch(&dname, &params, &Patch::Apply(d)).await {
            Ok(out) => out,
            // A Deployment the API server refuses (a bad nodeSelector key,
            // requests over limits): say so in status and an Event.
            Err(kube::Error::Api(e)) if matches!(e.code, 400 | 422) => {
                let message = format!(
                    "the API server refused Deployment {dname}: {}",
                    e.message.chars().take(1000).collect::<String>()
                );
                warn!(set = %name, "{message}");
                write_status(&sets, set, ctx, status::deployment_rejected(set, &message)).await?;
                return Err(Error::Kube(kube::Error::Api(e)));
            }
            Err(e) => return Err(e.into()),
        };
        ctx.remember_applied(
            key,
            Applied {
                digest,
                uid: out.metadata.uid.clone(),
                generation: out.metadata.generation,
                at: Instant::now(),
            },
        );
        applied.push(out);
    }
    let wanted_names: Vec<String> = wanted
        .iter()
        .filter_map(|d| d.metadata.name.clone())
        .collect();
    for d in &existing {
        let dname = d.name_any();
        if !wanted_names.contains(&dname) {
            info!(set = %name, deployment = %dname, "pruning a shard Deployment the set no longer wants");
            deployments
                .delete(&dname, &DeleteParams::background())
                .await?;
            ctx.forget_applied(&(ns.clone(), dname));
        }
    }
    // Readiness counts the shards the spec asks for.
    let current: Vec<&Deployment> = applied
        .iter()
        .filter(|d| shard_of(d).is_some_and(|n| n < desired))
        .collect();
    let shards_up = current
        .iter()
        .filter(|d| status::shard_available(d))
        .count()
        == desired as usize;

    // Redis: the reshard's plan and moves, queue policies, attribution
    let mut view = status::ReshardView::default();
    if let (Ok(store), Ok(_)) = (&store, &routing) {
        if let Err(e) = run_reshard(
            set,
            store,
            &mut memory.set,
            &lane_tenants,
            &lane_names,
            keep,
            shards_up,
            &mut view,
            ctx,
        )
        .await
        {
            warn!(set = %name, error = %e, "reshard step failed; retrying");
        }
    }
    drop(memory);
    let mut redis = sync_redis(set, ctx, keep).await;
    if let Ok(view) = &mut redis {
        view.restored = restored;
        view.epoch = epoch;
    }

    let (admitted, waiting_for_cap) = lane::summary(&name, &all_lanes);
    let lanes = status::Lanes {
        admitted,
        waiting_for_cap,
        over_cap: lane::over_cap_count(&name, &all_lanes, set.spec.promotion.max_lanes),
    };
    let st = status::compute(set, &current, lanes, redis.as_ref(), &view);
    let ready = st
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let moving =
        st.resharding.is_some() || view.waiting_for_shards || !view.waiting_for_lanes.is_empty();
    write_status(&sets, set, ctx, st).await?;
    record_lanes(set, &all_lanes, ctx);
    Ok(if moving {
        Action::requeue(RESHARD_POLL)
    } else if ready {
        // Also the period at which a Redis outage and attribution are noticed.
        Action::requeue(Duration::from_secs(15))
    } else {
        Action::requeue(Duration::from_secs(10))
    })
}

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
async fn finalize(
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
async fn set_finalizers(
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

/// `spec.redis.durability` as producers read it: the replica wait of `Replicated`.
fn replicated(set: &ShardSet) -> Option<Duration> {
    match set.spec.redis.durability {
        crate::crd::Durability::Fast => None,
        crate::crd::Durability::Replicated => Some(set.spec.redis.replica_ack_timeout.into()),
    }
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
async fn restore_routing(
    set: &ShardSet,
    store: &Store,
    table: &crate::routing::RoutingTable,
    lanes: &[DedicatedLane],
    desired: u16,
) -> Result<(String, Option<String>), crate::store::StoreError> {
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

/// Plan a shard-count change once the spec's shards are available, then
/// advance its moves. Fills `view` for status.
#[allow(clippy::too_many_arguments)]
async fn run_reshard(
    set: &ShardSet,
    store: &Store,
    memory: &mut reshard::SetMemory,
    lane_tenants: &std::collections::BTreeSet<String>,
    lane_names: &[String],
    keep: u16,
    shards_up: bool,
    view: &mut status::ReshardView,
    ctx: &Context,
) -> Result<(), crate::store::StoreError> {
    let desired = set.spec.shards as u16;
    let table = store.routing().await?;
    if table.shards == 0 {
        // A new set: nothing lives anywhere yet.
        store.set_shards(desired).await?;
    } else if table.shards != desired {
        if !shards_up {
            // New shards first: nobody moves onto a shard without workers.
            view.waiting_for_shards = true;
            view.progress = memory.progress.clone();
            return Ok(());
        }
        // Lane moves and reshards take turns: wait for lanes moving now (new
        // ones wait for the reshard from here on).
        if let Err(busy) = store.reshard_begin(lane_names).await? {
            view.waiting_for_lanes = busy;
            view.progress = memory.progress.clone();
            return Ok(());
        }
        let policy = QueuePolicy::from_spec(&set.spec);
        for n in 0..keep {
            store.configure_queue(QueueId::Shard(n), &policy).await?;
        }
        memory.progress =
            reshard::plan(store, desired, keep, lane_tenants, memory.progress.take()).await?;
    }
    if memory.progress.is_none() {
        if table.shards == desired {
            // Nothing to move (or the change was taken back): lane moves may start.
            store.reshard_end().await?;
        }
        return Ok(());
    }
    if !shards_up {
        view.waiting_for_shards = true;
        view.progress = memory.progress.clone();
        return Ok(());
    }
    let pass = reshard::advance(
        store,
        memory,
        keep,
        lane_tenants,
        set.spec.relocation.drain_timeout(),
        set.spec.relocation.max_concurrent_moves.max(1) as usize,
    )
    .await?;
    let labels = set_labels(set);
    for paused in &pass.finished {
        ctx.metrics
            .reshard_pause
            .get_or_create(&labels)
            .observe(paused.as_secs_f64());
    }
    ctx.metrics
        .reshard_moves
        .get_or_create(&labels)
        .inc_by(pass.finished.len() as u64);
    if let Some(done) = &pass.completed {
        store.reshard_end().await?;
        // The condition may be True for less than a watch round trip (idle
        // tenants move in one pass): say what happened in an Event too.
        ctx.event(
            &set.object_ref(&()),
            EventType::Normal,
            "Resharded",
            "Reshard",
            format!(
                "resharded from {} to {} shards: moved {} of {} tenants",
                done.from_shards, done.to_shards, done.moved, done.to_move
            ),
        )
        .await;
    }
    view.progress = pass.progress;
    view.draining = pass.draining;
    Ok(())
}

/// Write the queue policies; read attribution and export queue depths.
/// `shards`: the shard queues in use (more than the spec's while a shrink
/// runs). The routing table's shard count is the reshard's to write.
async fn sync_redis(
    set: &ShardSet,
    ctx: &Context,
    shards: u16,
) -> Result<status::RedisView, String> {
    let store = store_for(set, ctx).await?;
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
        .set(set.spec.shards as i64);
    view.settings = store.redis_settings().await.map_err(|e| e.to_string());
    Ok(view)
}

fn set_labels(set: &ShardSet) -> crate::telemetry::SetLabels {
    crate::telemetry::SetLabels {
        namespace: set.namespace().unwrap_or_default(),
        shard_set: set.name_any(),
    }
}

/// Write a refusal to status (Degraded, the reason naming what) and say
/// it in an Event.
async fn refuse(
    sets: &Api<ShardSet>,
    set: &ShardSet,
    ctx: &Context,
    v: &PolicyViolation,
) -> Result<(), Error> {
    let message = v.to_string();
    // A flip of Degraded to True has its Event from `write_status`; a new
    // refusal of a set Degraded already gets one here.
    let news = set.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Degraded" && c.status == "True" && c.message != message)
    });
    if news {
        ctx.event(
            &set.object_ref(&()),
            EventType::Warning,
            v.reason,
            "Refuse",
            message.clone(),
        )
        .await;
    }
    let st = status::refused(set, v.reason, &message);
    write_status(sets, set, ctx, st).await
}

/// The Secrets `spec.redis` names must be ones the controller itself may
/// read: worker pods mount them by reference, so a Secret outside the
/// controller's RBAC (the chart's `redis.secretName` / `extraSecretNames`)
/// would reach a pod the author could not create. A Secret that does not
/// exist yet is not refused (the status says it is missing).
pub(crate) async fn check_redis_secrets(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
) -> Result<(), Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut refs: Vec<(&str, &str)> = Vec::new();
    if let Some(r) = &spec.url_secret_ref {
        refs.push(("spec.redis.urlSecretRef.name", &r.name));
    }
    if let Some(r) = &spec.password_secret_ref {
        refs.push(("spec.redis.passwordSecretRef.name", &r.name));
    }
    if let Some(t) = &spec.tls {
        if let Some(r) = &t.ca_secret_ref {
            refs.push(("spec.redis.tls.caSecretRef.name", &r.name));
        }
        if let Some(r) = &t.client_cert_secret_ref {
            refs.push(("spec.redis.tls.clientCertSecretRef.name", &r.name));
        }
    }
    for (field, name) in refs {
        match api.get_metadata(name).await {
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return Err(PolicyViolation {
                    field: field.to_string(),
                    reason: "SecretNotAllowed",
                    message: format!("the controller may not read Secret {name:?}, so a ShardSet may not use it (the operator names the Secrets it may read: chart values redis.secretName, redis.extraSecretNames)"),
                }
                .into())
            }
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A fingerprint of a Redis target (URL with credentials, TLS material),
/// so that the connection map holds no secret.
fn fingerprint(url: &str, tls: Option<&RedisTls>) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let part = |h: &mut sha2::Sha256, b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(&mut h, url.as_bytes());
    if let Some(t) = tls {
        part(&mut h, t.ca.as_deref().unwrap_or_default());
        if let Some((cert, key)) = &t.client {
            part(&mut h, cert);
            part(&mut h, key);
        }
    }
    h.finalize().into()
}

/// The set's Redis connection: the cached one while its target (URL,
/// credentials, TLS) is the same, else a new one replacing it. A failed
/// connect is remembered and not tried again before its backoff ends, so an
/// unreachable Redis costs nothing per reconcile or promotion tick.
async fn store_for(set: &ShardSet, ctx: &Context) -> Result<Store, String> {
    let ns = set.namespace().unwrap_or_default();
    let (url, tls, secrets) = redis_target(&ctx.client, &ns, &set.spec.redis)
        .await
        .map_err(|(e, secrets)| scrub(&e, &secrets))?;
    let id = SetId::new(&ns, set.name_any());
    let print = fingerprint(&url, tls.as_ref());
    let now = Instant::now();
    let mut attempts = 0;
    if let Some(c) = ctx
        .stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&id)
        .filter(|c| c.fingerprint == print)
    {
        c.used = now;
        match &c.state {
            Ok(store) => return Ok(store.clone()),
            Err(f) if now < f.retry_at => return Err(f.message.clone()),
            Err(f) => attempts = f.attempts,
        }
    }
    let opts = ConnectOptions {
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(3),
    };
    let result = Store::connect_tls(&url, id.clone(), opts, tls)
        .await
        .map_err(|e| {
            scrub(
                &format!("cannot reach Redis for {ns}/{}: {e}", set.name_any()),
                &secrets,
            )
        });
    let state = result.clone().map_err(|message| ConnectFailure {
        retry_at: Instant::now() + connect_backoff(attempts + 1),
        attempts: attempts + 1,
        message,
    });
    let mut stores = ctx.stores.lock().unwrap_or_else(|e| e.into_inner());
    if stores.len() >= MAX_STORES && !stores.contains_key(&id) {
        if let Some(oldest) = stores
            .iter()
            .min_by_key(|(_, c)| c.used)
            .map(|(k, _)| k.clone())
        {
            stores.remove(&oldest);
        }
    }
    stores.insert(
        id,
        CachedStore {
            fingerprint: print,
            state,
            used: now,
        },
    );
    result
}

/// `message` with every secret value in it replaced by `***`.
fn scrub(message: &str, secrets: &[String]) -> String {
    let mut out = message.to_string();
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        out = out.replace(s.as_str(), "***");
    }
    out
}

/// The Redis URL of a set (user name and password in it) and its TLS
/// material, resolving Secret references; with the secret values read (the
/// URL when it came from a Secret, the password), which no message may carry.
/// An error comes with them too, to scrub it.
async fn redis_target(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
) -> Result<(String, Option<RedisTls>, Vec<String>), (String, Vec<String>)> {
    let mut secrets = Vec::new();
    match redis_target_inner(client, ns, spec, &mut secrets).await {
        Ok((url, tls)) => Ok((url, tls, secrets)),
        Err(e) => Err((e, secrets)),
    }
}

async fn redis_target_inner(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
    secrets: &mut Vec<String>,
) -> Result<(String, Option<RedisTls>), String> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let read_bytes = |name: String, key: String| {
        let api = api.clone();
        async move {
            let s = api
                .get(&name)
                .await
                .map_err(|e| format!("reading Secret {ns}/{name}: {e}"))?;
            s.data
                .and_then(|d| d.get(&key).cloned())
                .map(|v| v.0)
                .ok_or_else(|| format!("Secret {ns}/{name} has no key {key}"))
        }
    };
    let read = |name: String, key: String| {
        let bytes = read_bytes(name.clone(), key.clone());
        async move {
            String::from_utf8(bytes.await?)
                .map_err(|_| format!("Secret {ns}/{name} key {key} is not UTF-8"))
        }
    };
    // A URL read from a Secret is never shown, not even redacted: the key
    // may hold something else entirely (a password).
    let (url, from_secret) = match (&spec.url, &spec.url_secret_ref) {
        (_, Some(r)) => {
            let url = read(r.name.clone(), r.key.clone()).await?;
            secrets.push(url.clone());
            (url, Some(r))
        }
        (Some(u), None) => (u.clone(), None),
        (None, None) => return Err("spec.redis has neither url nor urlSecretRef".to_string()),
    };
    let hidden = |e: String| match from_secret {
        Some(r) => format!(
            "the Redis URL in Secret {ns}/{} key {} is not usable (value not shown)",
            r.name, r.key
        ),
        None => e,
    };
    let mut url = crate::store::cluster_url(&url, spec.cluster);
    if let Some(user) = &spec.username {
        url = crate::store::with_username(&url, user).map_err(hidden)?;
    }
    if let Some(r) = &spec.password_secret_ref {
        let password = read(r.name.clone(), r.key.clone()).await?;
        secrets.push(password.clone());
        url = crate::store::with_password(&url, &password).map_err(hidden)?;
    }
    let mut tls = RedisTls::default();
    if let Some(t) = &spec.tls {
        if let Some(r) = &t.ca_secret_ref {
            tls.ca = Some(read_bytes(r.name.clone(), r.key.clone()).await?);
        }
        if let Some(r) = &t.client_cert_secret_ref {
            let cert = read_bytes(r.name.clone(), "tls.crt".into()).await?;
            let key = read_bytes(r.name.clone(), "tls.key".into()).await?;
            tls.client = Some((cert, key));
        }
    }
    let tls = (tls != RedisTls::default()).then_some(tls);
    if tls.is_some() && !crate::store::is_tls_url(&url) {
        return Err(hidden(format!(
            "spec.redis.tls is set but the Redis URL {} is not rediss:// (or rediss+cluster://)",
            crate::store::redact(&url)
        )));
    }
    if from_secret.is_some()
        && url::Url::parse(&url).is_err()
        && crate::store::cluster_nodes(&url).is_none()
    {
        return Err(hidden(String::new()));
    }
    Ok((url, tls))
}

async fn write_status(
    sets: &Api<ShardSet>,
    set: &ShardSet,
    ctx: &Context,
    st: ShardSetStatus,
) -> Result<(), Error> {
    let before = set.status.clone().unwrap_or_default();
    for t in status::transitions(&before, &st) {
        let type_ = if t.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let action = format!("{}Changed", t.type_);
        ctx.event(&set.object_ref(&()), type_, &t.reason, &action, t.note)
            .await;
    }
    ctx.metrics
        .record_status(&set.namespace().unwrap_or_default(), &set.name_any(), &st);
    if set.status.as_ref() == Some(&st) {
        // Nothing to say: an idle set writes no status.
        return Ok(());
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
    Ok(())
}

/// Export the phase and conditions of the set's DedicatedLanes (from the
/// reconcile's own list: no second LIST).
fn record_lanes(set: &ShardSet, all_lanes: &[DedicatedLane], ctx: &Context) {
    let ns = set.namespace().unwrap_or_default();
    let name = set.name_any();
    let views: Vec<crate::telemetry::LaneView> = all_lanes
        .iter()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_failures_back_off_to_a_minute() {
        let secs: Vec<u64> = (1..=6).map(|n| connect_backoff(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 60, 60]);
    }

    #[test]
    fn messages_are_scrubbed_of_secret_values_and_keys_hold_none() {
        let secrets = vec!["pw-1".to_string(), String::new()];
        assert_eq!(
            scrub("redis url \"pw-1\": relative URL without a base", &secrets),
            "redis url \"***\": relative URL without a base"
        );
        let a = fingerprint("redis://:pw-1@r:6379", None);
        assert_ne!(a, fingerprint("redis://:pw-2@r:6379", None));
        let tls = RedisTls {
            ca: Some(b"ca".to_vec()),
            client: None,
        };
        assert_ne!(a, fingerprint("redis://:pw-1@r:6379", Some(&tls)));
        assert!(!String::from_utf8_lossy(&a).contains("pw-1"));
    }
}

#[cfg(test)]
mod applied_tests {
    use super::*;

    fn seen(uid: &str, generation: i64) -> Deployment {
        let mut d = Deployment::default();
        d.metadata.uid = Some(uid.into());
        d.metadata.generation = Some(generation);
        d
    }

    #[test]
    fn an_apply_is_skipped_only_for_the_same_object_uid_and_generation_recently() {
        let now = Instant::now();
        let memo = Applied {
            digest: [1; 32],
            uid: Some("u1".into()),
            generation: Some(3),
            at: now,
        };
        assert!(memo.covers(&[1; 32], &seen("u1", 3), now));
        // The controller wants something else now.
        assert!(!memo.covers(&[2; 32], &seen("u1", 3), now));
        // Someone changed the spec (kubectl scale, edit): generation moved.
        assert!(!memo.covers(&[1; 32], &seen("u1", 4), now));
        // Deleted and recreated by someone else under the same name.
        assert!(!memo.covers(&[1; 32], &seen("u2", 3), now));
        // Metadata edits do not move the generation: re-applied after a while.
        assert!(!memo.covers(&[1; 32], &seen("u1", 3), now + REAPPLY_AFTER));
        // A listed object without a uid proves nothing.
        assert!(!memo.covers(&[1; 32], &Deployment::default(), now));
    }
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
