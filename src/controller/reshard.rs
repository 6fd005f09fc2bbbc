//! Resharding: a change of `spec.shards` is a migration, not a config edit.
//!
//! When the spec's shard count `m` differs from the routing table's `n`, the
//! ShardSet reconciler *plans*: it reads the tenants that live in each shard
//! queue (they have had work there and are not marked as moved away), and
//! pins every one whose rendezvous hash queue changes under `m` to the queue
//! it lives in. It fences every shard queue at the routing version the new
//! count will have (an enqueue routed by an older table answers STALE and
//! the producer refreshes), and only then writes `m` into the table, so no
//! tenant changes queue by accident: the movers stay where they are, pinned,
//! and everyone else keeps the queue it had (rendezvous hashing moves about
//! |m−n|/max(m,n) of them).
//!
//! It then *moves* the pinned tenants with the relocation steps the lanes
//! use, each idempotent and driven by what Redis says, so a controller killed
//! at any point finishes the job after a restart:
//!
//! 1. pause the tenant in its source queue (new envelopes go to the hold
//!    buffer); a tenant with nothing queued, in flight or waiting to retry
//!    moves at once, the others take one of `relocation.maxConcurrentMoves`
//!    slots;
//! 2. wait until its source lane is drained (past `relocation.drainTimeout`
//!    the move is aborted, the tenant resumed in place, and retried later);
//! 3. pause it in the target queue, mark it moved in the source (enqueues
//!    there now answer MOVED, which producers follow, so a stale producer
//!    cannot break order), append the source's hold buffer to the target
//!    lane, resume it in the target (its own hold buffer follows);
//! 4. remove the pin: the tenant is on its hash queue.
//!
//! The pin is removed last, so "pinned to a shard queue" is exactly "a move
//! not finished", and a restarted controller finds every unfinished move in
//! the routing table. Lanes pin to lane queues and are never touched.
//!
//! New shard Deployments are applied first and moves wait until they are
//! available; shard Deployments are only pruned once the reshard is over,
//! so a shrink moves everyone off the retiring shards before their
//! Deployments are deleted. A second spec change during a reshard is
//! replanned from the current state: movers keep their pins (their target is
//! always the hash queue under the table's current count), and residents
//! whose queue changes again are pinned too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use tracing::{info, warn};

use crate::crd::ReshardProgress;
use crate::routing::{hash_shard, QueueId, RoutingTable};
use crate::store::{Store, StoreError, TenantQueueState};

use super::relocation::{self, Drain, DrainClock, MAX_RESHARD_BACKOFF};

/// Moves in progress, advanced concurrently per pass (Redis round trips).
const PASS_CONCURRENCY: usize = 32;

/// Tenants that must move when the shard count becomes `to`: the residents
/// of each shard queue whose hash queue under `to` is another one, unless
/// pinned already (a lane, or a move under way) or excluded (a DedicatedLane
/// of the set is moving them). Each is to be pinned to the queue it lives
/// in. Pure.
pub fn movers(
    residents: &[(u16, Vec<String>)],
    pins: &BTreeMap<String, QueueId>,
    excluded: &BTreeSet<String>,
    to: u16,
) -> Vec<(String, QueueId)> {
    let mut out = Vec::new();
    for (shard, tenants) in residents {
        let home = QueueId::Shard(*shard);
        for t in tenants {
            if pins.contains_key(t) || excluded.contains(t) {
                continue;
            }
            if hash_shard(t, to) != home {
                out.push((t.clone(), home));
            }
        }
    }
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

/// Moves not finished: tenants pinned to a shard queue (lanes pin to lane
/// queues), with the queue they live in.
pub fn in_motion(table: &RoutingTable) -> Vec<(String, QueueId)> {
    table
        .pins
        .iter()
        .filter(|(_, q)| matches!(q, QueueId::Shard(_)))
        .map(|(t, q)| (t.clone(), *q))
        .collect()
}

/// What to do next for one tenant in motion, from its state in the queue it
/// lives in. Pure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Marked moved already (a crash after that): finish towards that queue.
    Finish(QueueId),
    /// Its hash queue is where it lives (the spec changed back): unpin.
    Stay,
    /// Not paused and idle, or a slot is free: pause it now.
    Pause,
    /// Not paused, busy, and every slot is taken: wait for a slot.
    AwaitSlot,
    /// Paused and drained: repin it onto the target.
    Move,
    /// Paused and still draining.
    Drain,
    /// Paused for longer than the drain timeout: resume in place, retry later.
    Abort,
    /// Its last drain timed out; not yet time to retry.
    Backoff,
}

/// Decide the next step of a move from `source` to `target` at `now`.
/// `clock` is what this controller has seen of the move (its pause, its
/// aborted attempts); `slot_free`, whether a busy tenant may start draining
/// now.
pub fn next_step(
    st: &TenantQueueState,
    source: QueueId,
    target: QueueId,
    clock: &DrainClock,
    now: Timestamp,
    drain_timeout: Duration,
    slot_free: bool,
) -> Step {
    if let Some(q) = st.moved_to {
        return Step::Finish(q);
    }
    if target == source {
        return Step::Stay;
    }
    if !st.paused {
        if clock.backing_off(now) {
            return Step::Backoff;
        }
        return if st.drained() || slot_free {
            Step::Pause
        } else {
            Step::AwaitSlot
        };
    }
    match clock.verdict(st.drained(), now, drain_timeout) {
        Drain::Drained => Step::Move,
        Drain::Abort => Step::Abort,
        Drain::Wait => Step::Drain,
    }
}

/// Per-set memory of the reshard: the progress last decided (the cached
/// object's status may lag behind our own writes) and each move's drain
/// clock (lost on restart, which only restarts the drain).
#[derive(Debug, Default)]
pub struct SetMemory {
    pub progress: Option<ReshardProgress>,
    pub moves: HashMap<String, DrainClock>,
}

/// Where a reshard stands after one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pass {
    pub progress: Option<ReshardProgress>,
    /// Tenants paused and draining right now.
    pub draining: usize,
    /// Moves finished in this pass, and their pause times.
    pub finished: Vec<Duration>,
    /// New shards not yet available: moves wait.
    pub waiting_for_shards: bool,
    /// The reshard finished in this pass: its final progress.
    pub completed: Option<ReshardProgress>,
}

/// The residents of shard queues `0..shards`, per shard.
async fn residents(store: &Store, shards: u16) -> Result<Vec<(u16, Vec<String>)>, StoreError> {
    let mut out = Vec::with_capacity(shards as usize);
    for s in 0..shards {
        out.push((s, store.residents(QueueId::Shard(s)).await?));
    }
    Ok(out)
}

/// Plan a reshard to `to` shards if the routing table says otherwise: pin
/// the movers where they live, then write the new count. `queues` is how
/// many shard queues may hold tenants (the larger of the old count and the
/// shard Deployments that exist). Returns the progress to record, or `None`
/// when nothing is to be done (the set is new: its count is simply written).
pub async fn plan(
    store: &Store,
    to: u16,
    queues: u16,
    excluded: &BTreeSet<String>,
    before: Option<ReshardProgress>,
) -> Result<Option<ReshardProgress>, StoreError> {
    let table = store.routing().await?;
    if table.shards == 0 {
        store.set_shards(to).await?;
        return Ok(before);
    }
    if table.shards == to {
        return Ok(before);
    }
    let residents = residents(store, queues.max(table.shards)).await?;
    let new = movers(&residents, &table.pins, excluded, to);
    store.pin_many(&new).await?;
    // Fence every shard queue at the version the new count will have, so a
    // producer still hashing by the old count is refused (STALE) and
    // refreshes, instead of sending a tenant's first envelopes to its old
    // hash queue while a fresh producer sends the next ones to the new one.
    let fenced: Vec<QueueId> = (0..queues.max(table.shards).max(to))
        .map(QueueId::Shard)
        .collect();
    let version = store.routing().await?.version + 1;
    for q in &fenced {
        store.fence_routing(*q, version).await?;
    }
    let written = store.set_shards(to).await?;
    if written > version {
        // A lane pinned a tenant in between: fence at the version written.
        for q in &fenced {
            store.fence_routing(*q, written).await?;
        }
    }
    let pinned = in_motion(&table).len() + new.len();
    let progress = match before {
        // Replanned: the moves under way keep going, towards the new count.
        Some(p) => ReshardProgress {
            to_shards: to as i32,
            to_move: p.moved + pinned as i32,
            ..p
        },
        None => ReshardProgress {
            from_shards: table.shards as i32,
            to_shards: to as i32,
            to_move: pinned as i32,
            moved: 0,
            failed: 0,
        },
    };
    info!(
        from = table.shards,
        to,
        movers = new.len(),
        "reshard planned: movers pinned where they live"
    );
    Ok(Some(progress))
}

/// Advance every move one step (concurrently), and finish the reshard when
/// nothing is left to move. `queues`: shard queues that may hold tenants.
pub async fn advance(
    store: &Store,
    memory: &mut SetMemory,
    queues: u16,
    excluded: &BTreeSet<String>,
    drain_timeout: Duration,
    max_concurrent: usize,
) -> Result<Pass, StoreError> {
    let Some(mut progress) = memory.progress.clone() else {
        return Ok(Pass::default());
    };
    let table = store.routing().await?;
    let mut moving = in_motion(&table);
    if moving.is_empty() {
        // Done, unless a straggler arrived on its old hash queue (a producer
        // whose table was older than the plan): those move too.
        let residents = residents(store, queues.max(table.shards)).await?;
        let late = movers(&residents, &table.pins, excluded, table.shards);
        if late.is_empty() {
            info!(
                from = progress.from_shards,
                to = progress.to_shards,
                moved = progress.moved,
                "reshard complete"
            );
            memory.progress = None;
            memory.moves.clear();
            return Ok(Pass {
                completed: Some(progress),
                ..Pass::default()
            });
        }
        warn!(
            count = late.len(),
            "tenants found on their old hash queue after the plan: moving them too"
        );
        store.pin_many(&late).await?;
        progress.to_move += late.len() as i32;
        moving = late;
    }

    // Owned futures: the controller's future must be Send for any lifetime.
    let states: Vec<Result<TenantQueueState, StoreError>> = futures::stream::iter(moving.clone())
        .map(|(t, q)| {
            let store = store.clone();
            async move { store.tenant_state(q, &t).await }
        })
        .buffered(PASS_CONCURRENCY)
        .collect()
        .await;
    let now = Timestamp::now();
    let mut draining = states
        .iter()
        .filter_map(|s| s.as_ref().ok())
        .filter(|s| s.paused && !s.drained() && s.moved_to.is_none())
        .count();
    let mut plans = Vec::new();
    for ((tenant, source), st) in moving.iter().zip(states) {
        let st = st?;
        let target = hash_shard(tenant, table.shards);
        let memo = memory.moves.entry(tenant.clone()).or_default();
        if st.paused && memo.paused_at.is_none() {
            // Paused before this process started: restart its drain clock.
            memo.paused_at = Some(now);
        }
        let step = next_step(
            &st,
            *source,
            target,
            memo,
            now,
            drain_timeout,
            draining < max_concurrent,
        );
        if step == Step::Pause && !st.drained() {
            draining += 1;
        }
        plans.push((tenant.clone(), *source, target, step));
    }

    let jobs: Vec<_> = plans
        .iter()
        .map(|(tenant, source, target, step)| {
            let paused_at = memory.moves.get(tenant).and_then(|m| m.paused_at);
            (tenant.clone(), *source, *target, *step, paused_at)
        })
        .collect();
    let results: Vec<Result<Option<Duration>, StoreError>> = futures::stream::iter(jobs)
        .map(|(tenant, source, target, step, paused_at)| {
            let store = store.clone();
            async move { execute(&store, &tenant, source, target, step, paused_at).await }
        })
        .buffered(PASS_CONCURRENCY)
        .collect()
        .await;
    let mut pass = Pass::default();
    for ((tenant, source, target, step), result) in plans.into_iter().zip(results) {
        let finished = result?;
        let memo = memory.moves.entry(tenant.clone()).or_default();
        match step {
            Step::Pause => {
                memo.paused_at.get_or_insert(now);
            }
            Step::Abort => {
                let wait = memo.abort(now, drain_timeout, MAX_RESHARD_BACKOFF);
                warn!(%tenant, from = %source, to = %target, attempts = memo.attempts, ?wait, "reshard: drain timed out; resumed in place, will retry");
            }
            _ => {}
        }
        if let Some(paused) = finished {
            if memo.attempts > 0 {
                progress.failed = progress.failed.saturating_sub(1);
            }
            memory.moves.remove(&tenant);
            progress.moved += 1;
            pass.finished.push(paused);
            info!(%tenant, from = %source, to = %target, paused_ms = paused.as_millis() as u64, "reshard: tenant moved");
        } else if step == Step::Abort && memo.attempts == 1 {
            progress.failed += 1;
        }
    }
    pass.draining = memory
        .moves
        .values()
        .filter(|m| m.paused_at.is_some())
        .count();
    memory.progress = Some(progress.clone());
    pass.progress = Some(progress);
    Ok(pass)
}

/// Carry out one step; `Some(pause time)` when the move finished.
async fn execute(
    store: &Store,
    tenant: &str,
    source: QueueId,
    target: QueueId,
    step: Step,
    paused_at: Option<Timestamp>,
) -> Result<Option<Duration>, StoreError> {
    let paused_for = || {
        paused_at
            .map(|at| relocation::since(at, Timestamp::now()))
            .unwrap_or_default()
    };
    match step {
        Step::Finish(to) => {
            finish(store, tenant, source, to).await?;
            Ok(Some(paused_for()))
        }
        Step::Stay => {
            store.resume(source, tenant).await?;
            store.unpin(tenant).await?;
            Ok(Some(paused_for()))
        }
        Step::Pause => {
            let started = Instant::now();
            store.pause(source, tenant).await?;
            // An idle tenant is drained already: move it in the same pass.
            if store.tenant_state(source, tenant).await?.drained()
                && repin(store, tenant, source, target).await?
            {
                return Ok(Some(started.elapsed()));
            }
            Ok(None)
        }
        Step::Move => {
            if repin(store, tenant, source, target).await? {
                Ok(Some(paused_for()))
            } else {
                Ok(None)
            }
        }
        Step::Abort => {
            relocation::abort(store, source, tenant).await?;
            Ok(None)
        }
        Step::AwaitSlot | Step::Drain | Step::Backoff => Ok(None),
    }
}

/// Paused and drained in `source`: hold it in `target`, mark it moved in
/// `source` (refused if something arrived after all), then finish.
async fn repin(
    store: &Store,
    tenant: &str,
    source: QueueId,
    target: QueueId,
) -> Result<bool, StoreError> {
    store.pause(target, tenant).await?;
    if !relocation::hand_over(store, tenant, source, target).await? {
        return Ok(false);
    }
    land(store, tenant, target).await?;
    Ok(true)
}

/// Marked moved from `source` to `to`: append the source's hold buffer to
/// `to`'s lane, resume it there (its own hold buffer follows, in order),
/// and remove the pin. Every step may be repeated.
async fn finish(
    store: &Store,
    tenant: &str,
    source: QueueId,
    to: QueueId,
) -> Result<(), StoreError> {
    store.move_hold(source, to, tenant).await?;
    land(store, tenant, to).await
}

/// The hold buffer is on `to`: resume the tenant there and remove the pin
/// (last, so a pin to a shard is exactly a move not finished).
async fn land(store: &Store, tenant: &str, to: QueueId) -> Result<(), StoreError> {
    store.resume(to, tenant).await?;
    store.unpin(tenant).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(queued: u64, in_flight: u64, paused: bool) -> TenantQueueState {
        TenantQueueState {
            queued,
            in_flight,
            delayed: 0,
            held: 0,
            paused,
            moved_to: None,
            depth: queued + in_flight,
            user_paused: false,
        }
    }

    #[test]
    fn only_residents_whose_hash_queue_changes_move_and_pins_are_left_alone() {
        let tenants: Vec<String> = (0..4000).map(|i| format!("t{i}")).collect();
        let mut residents: Vec<(u16, Vec<String>)> = (0..4).map(|s| (s, Vec::new())).collect();
        for t in &tenants {
            let QueueId::Shard(s) = hash_shard(t, 4) else {
                unreachable!()
            };
            residents[s as usize].1.push(t.clone());
        }
        let mut pins = BTreeMap::new();
        pins.insert("t1".to_string(), QueueId::Lane(0));
        let excluded: BTreeSet<String> = ["t2".to_string()].into();
        let grow = movers(&residents, &pins, &excluded, 6);
        // about 1/3 move from 4 to 6, each pinned where it lives
        let share = grow.len() as f64 / tenants.len() as f64;
        assert!((share - 1.0 / 3.0).abs() < 0.05, "moved share {share}");
        for (t, q) in &grow {
            assert_eq!(*q, hash_shard(t, 4));
            assert_ne!(hash_shard(t, 6), *q);
            assert!(t != "t1" && t != "t2");
        }
        // a shrink moves exactly the residents of the retiring shards
        let shrink = movers(&residents, &BTreeMap::new(), &BTreeSet::new(), 2);
        let retiring: usize = residents[2..].iter().map(|(_, v)| v.len()).sum();
        assert_eq!(shrink.len(), retiring);
        // no change, no move
        assert!(movers(&residents, &BTreeMap::new(), &BTreeSet::new(), 4).is_empty());
    }

    #[test]
    fn in_motion_is_the_shard_pins_only() {
        let mut table = RoutingTable {
            shards: 6,
            ..Default::default()
        };
        table.pins.insert("a".into(), QueueId::Shard(1));
        table.pins.insert("b".into(), QueueId::Lane(2));
        assert_eq!(
            in_motion(&table),
            vec![("a".to_string(), QueueId::Shard(1))]
        );
    }

    #[test]
    fn steps_follow_the_tenant_state() {
        let (s, t) = (QueueId::Shard(1), QueueId::Shard(5));
        let timeout = Duration::from_secs(60);
        let now = Timestamp::from_second(10_000).unwrap();
        let step = |st: &TenantQueueState, paused_for: Option<Duration>, backoff: bool, slot| {
            let clock = DrainClock {
                paused_at: paused_for.map(|d| now - d),
                attempts: backoff as u32,
                retry_at: backoff.then(|| relocation::later(now, Duration::from_secs(1))),
            };
            next_step(st, s, t, &clock, now, timeout, slot)
        };
        // idle tenants move at once, even with no slot free
        assert_eq!(step(&state(0, 0, false), None, false, false), Step::Pause);
        // busy ones wait for a slot
        assert_eq!(
            step(&state(3, 1, false), None, false, false),
            Step::AwaitSlot
        );
        assert_eq!(step(&state(3, 1, false), None, false, true), Step::Pause);
        assert_eq!(step(&state(3, 1, false), None, true, true), Step::Backoff);
        // paused: drain, then move; past the timeout, abort
        let secs = |n| Some(Duration::from_secs(n));
        assert_eq!(step(&state(3, 1, true), secs(1), false, true), Step::Drain);
        assert_eq!(step(&state(0, 0, true), secs(1), false, true), Step::Move);
        assert_eq!(step(&state(0, 1, true), secs(61), false, true), Step::Abort);
        // marked moved: finish wherever the mark says
        let mut moved = state(0, 0, true);
        moved.moved_to = Some(QueueId::Shard(4));
        assert_eq!(
            step(&moved, None, false, false),
            Step::Finish(QueueId::Shard(4))
        );
        // the spec went back: stay
        assert_eq!(
            next_step(
                &state(2, 0, true),
                s,
                s,
                &DrainClock::default(),
                now,
                timeout,
                true
            ),
            Step::Stay
        );
    }
}
