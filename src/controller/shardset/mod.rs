//! The ShardSet reconciler.

mod apply;
mod finalize;
#[cfg(test)]
pub(crate) mod mock_tests;
mod redis;
mod tiers;

pub use finalize::{finalize_step, Finalize, FINALIZER};

use crate::controller::build;
use crate::controller::build::shard_deployments_upto;
use crate::controller::build::shard_of;
use crate::controller::build::shard_selector;
use crate::controller::build::PolicyViolation;
use crate::controller::build::FIELD_MANAGER;
use crate::controller::check_redis_secrets;
use crate::controller::dataplane;
use crate::controller::lane;
use crate::controller::metrics::SHARDSET;
use crate::controller::reshard;
use crate::controller::status;
use crate::controller::store_for;
use crate::controller::Context;
use crate::controller::Error;
use crate::crd::conditions;
use crate::crd::DedicatedLane;
use crate::crd::ShardSet;
use crate::crd::ShardSetStatus;
use crate::store::Store;
use finalize::{finalize, set_finalizers};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use kube::api::ListParams;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use redis::{run_reshard, sync_redis};
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;
use tracing::warn;

pub(crate) use apply::Applied;

/// A set's reshard memory, seeded once from its status (after a restart).
#[derive(Debug, Default)]
pub(crate) struct ReshardMemory {
    seeded: bool,
    set: reshard::SetMemory,
}

/// How often a reshard under way is looked at again.
const RESHARD_POLL: Duration = Duration::from_millis(500);

pub(super) async fn reconcile_guarded(
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

pub(super) fn error_policy_guarded(
    obj: Arc<DeserializeGuard<ShardSet>>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    match &obj.0 {
        Ok(set) => error_policy(Arc::new(set.clone()), err, ctx),
        Err(_) => {
            ctx.metrics.reconcile_failed(SHARDSET, error_kind(err));
            Action::await_change()
        }
    }
}

fn error_policy(set: Arc<ShardSet>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_failed(SHARDSET, error_kind(err));
    match err {
        // Waits for a change of the spec (or of an undecodable object).
        Error::Build(_) | Error::Policy(_) | Error::Undecodable { .. } => Action::await_change(),
        Error::Kube(_) => {
            let mut failures = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
            let n = failures.entry(ObjectRef::from_obj(&*set)).or_default();
            *n += 1;
            Action::requeue(crate::policy::capped_backoff(
                *n,
                Duration::from_secs(2),
                Duration::from_secs(300),
            ))
        }
    }
}

fn error_kind(err: &Error) -> &'static str {
    match err {
        Error::Kube(_) => "kube",
        Error::Build(_) => "invalid_spec",
        Error::Policy(_) => "refused",
        Error::Undecodable { .. } => "undecodable",
    }
}

#[tracing::instrument(name = "reconcile_shardset", skip_all, fields(namespace = %set.namespace().unwrap_or_default(), shard_set = %set.name_any()))]
async fn reconcile(set: Arc<ShardSet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&set, &ctx).await;
    ctx.metrics.reconciled(SHARDSET, started.elapsed());
    if result.is_ok() {
        ctx.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ObjectRef::from_obj(&*set));
    }
    result
}

/// One reconcile of a set, as a pipeline whose steps hand typed results on:
/// finalize (a set being deleted stops here) → validate ([`validate`]: the
/// effective set) → dereference ([`observe`]: what exists) → Redis
/// ([`redis_step`]: connection, and what the spec writes into Redis,
/// [`dataplane::apply_spec`]) → build ([`plan`]:
/// the Deployments wanted, pure) → apply ([`apply::apply_and_prune`]) →
/// Redis again ([`run_reshard`], [`sync_redis`]) → status ([`status_step`]).
async fn reconcile_inner(set: &ShardSet, ctx: &Context) -> Result<Action, Error> {
    let apis = Apis::new(ctx, set);
    // A set being deleted is only finalized: nothing is applied or owned
    // again (`--cascade=orphan` keeps its Deployments).
    if set.metadata.deletion_timestamp.is_some() {
        return finalize(set, ctx, &apis.sets, &apis.lanes).await;
    }
    if !set.finalizers().iter().any(|f| f == FINALIZER) {
        let mut finalizers = set.finalizers().to_vec();
        finalizers.push(FINALIZER.to_string());
        set_finalizers(&apis.sets, set, finalizers).await?;
    }
    let effective = validate(set, ctx, &apis.sets).await?;
    let set = &effective;
    let observed = observe(set, &apis).await?;

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
    let redis = redis_step(set, ctx, &observed, &mut memory.set).await;
    let plan = plan(set, &observed, redis.routing.as_ref().ok(), &mut memory.set)?;
    let shards = apply::apply_and_prune(set, ctx, &apis, &observed.deployments, &plan).await?;

    // Redis: the reshard's plan and moves; attribution for status
    let mut view = status::ReshardView::default();
    if let (Ok(store), Ok(_)) = (&redis.store, &redis.routing) {
        match run_reshard(
            set,
            store,
            &mut memory.set,
            &observed.lanes,
            &plan,
            &shards,
            ctx,
        )
        .await
        {
            Ok(v) => view = v,
            Err(e) => warn!(set = %set.name_any(), error = %e, "reshard step failed; retrying"),
        }
    }
    drop(memory);
    // The connection the Redis step resolved: its Secrets are read once per reconcile.
    let mut synced = sync_redis(set, ctx, &redis.store, plan.keep).await;
    if let Ok(v) = &mut synced {
        v.restored = redis.restored;
        v.epoch = redis.epoch;
        v.tiers = redis.tiers;
        v.overrides = redis.overrides;
    }
    status_step(set, ctx, &apis.sets, &observed.lanes, &shards, synced, view).await
}

/// The APIs one reconcile uses, in the set's namespace.
pub(super) struct Apis {
    pub deployments: Api<Deployment>,
    pub sets: Api<ShardSet>,
    /// Guarded: one DedicatedLane this version cannot decode must not stop
    /// every set of its namespace (the lane reconciler reports it on the lane).
    pub lanes: Api<DeserializeGuard<DedicatedLane>>,
}

impl Apis {
    fn new(ctx: &Context, set: &ShardSet) -> Self {
        let ns = set.namespace().unwrap_or_default();
        Self {
            deployments: Api::namespaced(ctx.client.clone(), &ns),
            sets: Api::namespaced(ctx.client.clone(), &ns),
            lanes: Api::namespaced(ctx.client.clone(), &ns),
        }
    }
}

/// Validate: the spec builds (pure, by building no Deployment), and asks
/// for nothing the operator forbids. Returns the effective set (the worker
/// template as the operator's policy leaves it); a refusal is written to
/// status with the field named.
async fn validate(set: &ShardSet, ctx: &Context, sets: &Api<ShardSet>) -> Result<ShardSet, Error> {
    let ns = set.namespace().unwrap_or_default();
    if let Err(e) = shard_deployments_upto(set, 0) {
        let st = status::invalid_spec(set, &e.to_string());
        write_status(sets, set, ctx, st).await?;
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
    match checked {
        Ok(effective) => Ok(effective),
        Err(Error::Policy(v)) => {
            refuse(sets, set, ctx, &v).await?;
            Err(v.into())
        }
        Err(e) => Err(e),
    }
}

/// What the dereference step found: the set's Deployments and lanes.
pub(super) struct Observed {
    /// The shard Deployments this set owns (by owner UID): another object
    /// carrying the set's labels is neither counted nor pruned.
    pub deployments: Vec<Deployment>,
    /// One past the highest shard index among them.
    pub shards: u16,
    pub lanes: SetLanes,
}

/// The DedicatedLanes of a namespace, as they bear on one set.
pub(super) struct SetLanes {
    /// Every decodable lane of the namespace (status and metrics pick the set's).
    pub all: Vec<DedicatedLane>,
    /// The names of the set's lanes.
    pub names: Vec<String>,
    /// Tenants a lane of the set is moving or serving: a reshard leaves them be.
    pub tenants: std::collections::BTreeSet<String>,
}

impl SetLanes {
    /// Pure: from the namespace's lanes, those of `set`.
    pub fn of(set: &str, all: Vec<DedicatedLane>) -> Self {
        let mine = || all.iter().filter(|l| l.spec.shard_set == set);
        let names = mine().map(|l| l.name_any()).collect();
        let tenants = mine()
            .filter(|l| {
                l.status
                    .as_ref()
                    .is_none_or(|s| s.phase != crate::crd::LanePhase::Retired)
            })
            .map(|l| l.spec.tenant.clone())
            .collect();
        Self {
            names,
            tenants,
            all,
        }
    }
}

/// Dereference: list the set's Deployments and its namespace's lanes.
async fn observe(set: &ShardSet, apis: &Apis) -> Result<Observed, Error> {
    let name = set.name_any();
    let uid = set.uid();
    let deployments: Vec<Deployment> = apis
        .deployments
        .list(&ListParams::default().labels(&shard_selector(&name)))
        .await?
        .items
        .into_iter()
        .filter(|d| build::owned_by(d.owner_references(), uid.as_deref()))
        .collect();
    let shards = deployments
        .iter()
        .filter_map(shard_of)
        .map(|n| n + 1)
        .max()
        .unwrap_or(0);
    let all = super::api::decoded(apis.lanes.list(&ListParams::default()).await?.items, &name);
    Ok(Observed {
        deployments,
        shards,
        lanes: SetLanes::of(&name, all),
    })
}

/// What the first Redis step found and wrote: the connection, the routing
/// table, the epoch mark (with what was restored when Redis had lost the
/// set's state), and the tier and `spec.tenants` outcomes for status.
struct RedisStep {
    store: Result<Store, String>,
    routing: Result<crate::routing::RoutingTable, String>,
    epoch: Option<String>,
    restored: Option<String>,
    tiers: Option<crate::crd::TierAssignmentsStatus>,
    overrides: Option<crate::crd::TenantOverridesStatus>,
}

/// Connect, and write what the spec says into Redis
/// ([`dataplane::apply_spec`], the same call as `lanekeeper dataplane
/// apply`): routing table (restored when Redis lost it), durability, queue
/// policies, tiers, `spec.tenants`. A shard-count change is left to the
/// reshard step. Redis trouble is not the reconcile's failure: the status
/// says so. The notes of the apply become Events.
async fn redis_step(
    set: &ShardSet,
    ctx: &Context,
    observed: &Observed,
    memory: &mut reshard::SetMemory,
) -> RedisStep {
    let name = set.name_any();
    let prev = set.status.as_ref();
    let mut step = RedisStep {
        store: store_for(set, ctx).await,
        routing: Err(String::new()),
        epoch: None,
        restored: None,
        tiers: prev.and_then(|s| s.tier_assignments.clone()),
        overrides: prev.and_then(|s| s.tenant_overrides.clone()),
    };
    let store = match &step.store {
        Ok(store) => store,
        Err(e) => {
            step.routing = Err(e.clone());
            return step;
        }
    };
    let sources = dataplane::Sources {
        lanes: &observed.lanes.all,
        // A shrink under way keeps the policies of its retiring queues.
        min_queues: if memory.progress.is_some() {
            observed.shards
        } else {
            0
        },
        tiers: &tiers::ConfigMapTiers {
            client: ctx.client.clone(),
        },
        shard_change: dataplane::ShardChange::Defer,
    };
    match dataplane::apply_spec(set, store, sources).await {
        Ok(applied) => {
            if let Some(what) = &applied.lost {
                warn!(set = %name, "{what}");
                // Whatever the reshard had planned lived in that Redis.
                memory.progress = None;
            }
            let object = set.object_ref(&());
            for note in applied.notes {
                let kind = if note.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                };
                ctx.event(&object, kind, note.reason, note.action, note.message)
                    .await;
            }
            step.routing = Ok(applied.table);
            step.epoch = Some(applied.epoch);
            step.restored = applied.lost;
            step.tiers = applied.tiers;
            step.overrides = applied.overrides;
        }
        Err(e) => {
            warn!(set = %name, error = %e, "cannot write the spec into Redis; retrying");
            step.routing = store.routing().await.map_err(|e| e.to_string());
        }
    }
    step
}

/// What the build step decided.
pub(super) struct Plan {
    /// The spec's shard count.
    pub desired: u16,
    /// The shard queues and Deployments in use: more than `desired` while a
    /// shrink runs (no shard Deployment is removed during a reshard).
    pub keep: u16,
    pub wanted: Vec<Deployment>,
}

/// Build: how many shards stay, and their Deployments. Pure, but for
/// recording in `memory` a reshard found pinned in the table with no record
/// of it (status lost in a crash).
fn plan(
    set: &ShardSet,
    observed: &Observed,
    table: Option<&crate::routing::RoutingTable>,
    memory: &mut reshard::SetMemory,
) -> Result<Plan, Error> {
    let desired = set.spec.shards as u16;
    if let (Some(table), None) = (table, &memory.progress) {
        let pinned = reshard::in_motion(table).len();
        if pinned > 0 {
            memory.progress = Some(crate::crd::ReshardProgress {
                from_shards: observed.shards.max(table.shards) as i32,
                to_shards: desired as i32,
                to_move: pinned as i32,
                ..Default::default()
            });
        }
    }
    let table_shards = table.map(|t| t.shards).unwrap_or(desired);
    let change_pending = table_shards != 0 && table_shards != desired;
    let resharding = change_pending || memory.progress.is_some();
    let keep = if resharding {
        desired.max(observed.shards).max(table_shards)
    } else {
        desired
    };
    Ok(Plan {
        desired,
        keep,
        wanted: shard_deployments_upto(set, keep)?,
    })
}

/// Status: conditions from what every step found, written only when
/// changed; then when to look again.
async fn status_step(
    set: &ShardSet,
    ctx: &Context,
    sets: &Api<ShardSet>,
    lanes: &SetLanes,
    shards: &apply::Shards,
    redis: Result<status::RedisView, String>,
    view: status::ReshardView,
) -> Result<Action, Error> {
    let name = set.name_any();
    let (admitted, waiting_for_cap) = lane::summary(&name, &lanes.all);
    let counts = status::Lanes {
        admitted,
        waiting_for_cap,
        over_cap: lane::over_cap_count(&name, &lanes.all, set.spec.promotion.max_lanes),
    };
    let current: Vec<&Deployment> = shards.current.iter().collect();
    let st = status::compute(set, &current, counts, redis.as_ref(), &view);
    let ready = st
        .conditions
        .iter()
        .any(|c| c.type_ == conditions::READY && c.status == "True");
    let moving =
        st.resharding.is_some() || view.waiting_for_shards || !view.waiting_for_lanes.is_empty();
    write_status(sets, set, ctx, st).await?;
    record_lanes(set, &lanes.all, ctx);
    Ok(if moving {
        Action::requeue(RESHARD_POLL)
    } else if ready {
        // Also the period at which a Redis outage and attribution are noticed.
        Action::requeue(Duration::from_secs(15))
    } else {
        Action::requeue(Duration::from_secs(10))
    })
}

fn set_labels(set: &ShardSet) -> crate::controller::metrics::SetLabels {
    crate::controller::metrics::SetLabels {
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
            .any(|c| c.type_ == conditions::DEGRADED && c.status == "True" && c.message != message)
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
    super::api::apply_status(sets, &set.name_any(), FIELD_MANAGER, &st).await?;
    Ok(())
}

/// Export the phase and conditions of the set's DedicatedLanes (from the
/// reconcile's own list: no second LIST).
fn record_lanes(set: &ShardSet, all_lanes: &[DedicatedLane], ctx: &Context) {
    let ns = set.namespace().unwrap_or_default();
    let name = set.name_any();
    let views: Vec<crate::controller::metrics::LaneView> = all_lanes
        .iter()
        .filter(|l| l.spec.shard_set == name)
        .map(|l| {
            let status = l.status.clone().unwrap_or_default();
            crate::controller::metrics::LaneView {
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
