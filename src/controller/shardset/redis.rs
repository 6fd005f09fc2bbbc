//! The Redis steps of a ShardSet reconcile after its Deployments are
//! applied: the reshard's plan and moves, and what status reads (attribution,
//! pauses, settings). What the spec writes into Redis (routing table,
//! restore, queue policies, tiers, `spec.tenants`) is
//! `controller::dataplane::apply_spec`, called by the first Redis step.

use super::apply::Shards;
use super::set_labels;
use super::Plan;
use super::SetLanes;
use crate::controller::reshard;
use crate::controller::status;
use crate::controller::Context;
use crate::crd::conditions;
use crate::crd::ShardSet;
use crate::policy::QueuePolicy;
use crate::routing::QueueId;
use crate::store::Store;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use std::time::Duration;

/// Plan a shard-count change once the spec's shards are available, then
/// advance its moves. Returns what status shows of it.
pub(super) async fn run_reshard(
    set: &ShardSet,
    store: &Store,
    memory: &mut reshard::SetMemory,
    lanes: &SetLanes,
    plan: &Plan,
    shards: &Shards,
    ctx: &Context,
) -> Result<status::ReshardView, crate::store::StoreError> {
    let (desired, keep, shards_up) = (plan.desired, plan.keep, shards.up);
    let (lane_tenants, lane_names) = (&lanes.tenants, &lanes.names);
    let mut view = status::ReshardView::default();
    let table = store.routing().await?;
    if table.shards == 0 {
        // A new set: nothing lives anywhere yet.
        store.set_shards(desired).await?;
    } else if table.shards != desired {
        if !shards_up {
            // New shards first: nobody moves onto a shard without workers.
            view.waiting_for_shards = true;
            view.progress = memory.progress.clone();
            return Ok(view);
        }
        // Lane moves and reshards take turns: wait for lanes moving now (new
        // ones wait for the reshard from here on).
        if let Err(busy) = store.reshard_begin(lane_names).await? {
            view.waiting_for_lanes = busy;
            view.progress = memory.progress.clone();
            return Ok(view);
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
        return Ok(view);
    }
    if !shards_up {
        view.waiting_for_shards = true;
        view.progress = memory.progress.clone();
        return Ok(view);
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
            conditions::RESHARDED,
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
    Ok(view)
}

/// Read attribution, pauses and settings, and export queue depths.
/// `shards`: the shard queues in use (more than the spec's while a shrink
/// runs). Their policies were written by the first Redis step.
pub(super) async fn sync_redis(
    set: &ShardSet,
    ctx: &Context,
    store: &Result<Store, String>,
    shards: u16,
) -> Result<status::RedisView, String> {
    let store = store.as_ref().map_err(String::clone)?;
    // Read here only for the queue health figures (weights, first estimate).
    let policy = QueuePolicy::from_spec(&set.spec);
    let window: Duration = set.spec.promotion.window.into();
    let mut view = status::RedisView::default();
    let depth = |stats: &[crate::policy::attribution::TenantStats]| -> u64 {
        stats.iter().map(|t| t.depth).sum()
    };
    let health = |stats: &[crate::policy::attribution::TenantStats]| {
        crate::policy::attribution::queue_health(
            stats,
            policy.initial_estimate_seconds,
            |t, tier| policy.weight(t, tier),
        )
    };
    for n in 0..shards {
        let q = QueueId::Shard(n);
        let stats = store
            .tenant_stats(q, window)
            .await
            .map_err(|e| e.to_string())?;
        ctx.metrics
            .record_queue(&queue_labels(set, q), depth(&stats), &health(&stats));
        view.queues.push((q, stats));
        for t in store.user_paused(q).await.map_err(|e| e.to_string())? {
            view.paused.push((q, t));
        }
    }
    // Lane queues: a series for each lane that has had a tenant (the lanes'
    // own reconciler configures them); none for a lane never used.
    for i in 0..crate::routing::MAX_LANES {
        let q = QueueId::Lane(i);
        let labels = queue_labels(set, q);
        let stats = store
            .tenant_stats(q, window)
            .await
            .map_err(|e| e.to_string())?;
        for t in store.user_paused(q).await.map_err(|e| e.to_string())? {
            view.paused.push((q, t));
        }
        if stats.is_empty() {
            ctx.metrics.forget_queue(&labels);
        } else {
            ctx.metrics
                .record_queue(&labels, depth(&stats), &health(&stats));
        }
    }
    ctx.metrics
        .shards
        .get_or_create(&set_labels(set))
        .set(set.spec.shards as i64);
    view.settings = store.redis_settings().await.map_err(|e| e.to_string());
    Ok(view)
}

/// The labels of one queue's series.
fn queue_labels(set: &ShardSet, q: QueueId) -> crate::controller::metrics::QueueDepthLabels {
    crate::controller::metrics::QueueDepthLabels {
        namespace: set.namespace().unwrap_or_default(),
        shard_set: set.name_any(),
        queue: q.to_string(),
    }
}
