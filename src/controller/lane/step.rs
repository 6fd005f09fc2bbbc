//! The DedicatedLane state machine as one pure decision: [`next_step`] takes
//! what the effects have observed ([`Facts`]) and says what to do next
//! ([`Step`]): read a fact it needs, or carry out effects, record a status
//! and go on or wait. `io.rs` gathers the facts and carries the steps out;
//! `mod.rs` runs the loop. Each phase's branch keeps the order of effects
//! the reconciler has always had (see the phase table in `docs/architecture.md`).
//!
//! Facts are read only when a decision needs them (a lane being deleted in
//! `Pending` touches no Redis), and are read again after every step that
//! acts. The outcomes of effects that answer (the lane/reshard gate,
//! admission, the hand-over's mark) are [`Done`] and last until the phase
//! changes.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::crd::{DedicatedLaneStatus, LanePhase};
use crate::routing::{hash_shard, QueueId, RoutingTable};
use crate::store::TenantQueueState;

use super::super::relocation::{self, Drain, DrainClock, MAX_DRAIN_BACKOFF};
use super::{admission_retry, conditions, over_cap, promoting, Refusal};

/// How often a lane in motion is looked at again.
pub const POLL: Duration = Duration::from_millis(250);

/// What the effects observed, for one decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Facts {
    /// The status as recorded (read fresh, or as our last write left it).
    pub status: DedicatedLaneStatus,
    pub generation: Option<i64>,
    pub tenant: String,
    /// The lane has a deletionTimestamp.
    pub deleting: bool,
    /// `spec.retire`.
    pub retire: bool,
    /// Made by the promotion loop (deleted once retired).
    pub from_promotion: bool,
    /// The lane's worker template runs someone (`rules::has_workers`).
    pub has_workers: bool,
    /// The set's `promotion.maxLanes`.
    pub max_lanes: i32,
    /// The set's `relocation.drainTimeout` (floored).
    pub drain_timeout: Duration,
    pub now: Timestamp,
    /// The routing table, once read ([`Read::Routing`]).
    pub routing: Option<RoutingTable>,
    /// The tenant's state in its source queue, once read.
    pub source: Option<TenantQueueState>,
    /// Whether the lane Deployment is available (serving), once read.
    pub available: Option<bool>,
    pub done: Done,
}

/// Answers of effects carried out in this reconcile, kept until the phase
/// changes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Done {
    /// The lane/reshard gate: taken (`true`) or held by a reshard.
    pub gate: Option<bool>,
    /// Admission ran: `Some(refusal)` if refused.
    pub admission: Option<Option<Refusal>>,
    /// The hand-over ran: marked moved (`true`) or refused.
    pub marked: Option<bool>,
    /// The lane Deployment was applied.
    pub applied: bool,
}

/// The decision.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Read a fact the decision needs, then decide again.
    Read(Read),
    /// Carry out the effects in order, then write `record` (if any), then
    /// go on as `then` says.
    Act(Box<Act>),
    /// A status that cannot be (the reconcile fails and is retried).
    Fail(&'static str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    Routing,
    /// The tenant's state in this queue.
    Source(QueueId),
    /// Whether lane `i`'s Deployment is available.
    Available(i32),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Act {
    pub effects: Vec<Effect>,
    pub record: Option<Record>,
    pub then: Then,
}

/// A status to write (server-side apply, with conditions and Events).
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub status: DedicatedLaneStatus,
    pub refusal: Option<Refusal>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    /// Decide again from fresh facts.
    Next,
    Requeue(Duration),
    AwaitChange,
}

/// Why a move is backed out of ([`Effect::Abort`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abort {
    /// `spec.retire` or deletion during a promotion's `Pausing`/`Draining`.
    Retire,
    /// The source did not drain within the drain timeout.
    DrainTimeout { attempts: i32 },
}

/// One effect. Those that answer ([`Effect::BeginMove`], [`Effect::Admit`],
/// [`Effect::HandOver`]) come last in their [`Act`], with `then: Next`.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    ApplyDeployment(i32),
    DeleteDeployment(i32),
    /// The set's queue policy on this queue.
    ConfigureQueue(QueueId),
    /// Take the lane/reshard gate for lane `i` (answers [`Done::gate`]).
    BeginMove(i32),
    /// Give the gate back.
    EndMove(i32),
    /// Admit under the cap against a fresh list, under the admission lock,
    /// and record the index or the refusal with this status (answers
    /// [`Done::admission`]).
    Admit(Box<DedicatedLaneStatus>),
    Pause(QueueId),
    Resume(QueueId),
    /// Resume the tenant in `from`, where it was (`relocation::abort`).
    Abort {
        from: QueueId,
        why: Abort,
    },
    Pin(QueueId),
    Unpin,
    /// Mark moved in `from` and append its hold buffer to `to`
    /// (`relocation::hand_over`; answers [`Done::marked`]).
    HandOver {
        from: QueueId,
        to: QueueId,
    },
    /// The table lost an Active lane's pin: pin again, with a Warning Event.
    RestorePin(QueueId),
    /// Delete the DedicatedLane (a retired lane made by promotion).
    DeleteLane,
    /// Log this line.
    Info(&'static str),
    /// The test hook: exit here if asked to after this phase's work.
    CrashHook(LanePhase),
}

fn act(effects: Vec<Effect>, record: Option<DedicatedLaneStatus>, then: Then) -> Step {
    Step::Act(Box::new(Act {
        effects,
        record: record.map(|status| Record {
            status,
            refusal: None,
        }),
        then,
    }))
}

fn wait(d: Duration) -> Step {
    act(Vec::new(), None, Then::Requeue(d))
}

fn parse(q: &Option<String>) -> Option<QueueId> {
    q.as_deref().and_then(|q| q.parse().ok())
}

/// Decide the next step of a lane from `f`. Pure.
pub fn next_step(f: &Facts) -> Step {
    let want_out = f.deleting || f.retire;
    let mut st = f.status.clone();
    let source = parse(&st.source_queue);
    let target = parse(&st.target_queue);
    let clock = DrainClock::of_status(
        st.paused_at.as_ref(),
        st.drain_attempts,
        st.next_attempt_at.as_ref(),
    );
    let waiting_out = clock.backing_off(f.now);
    let retry_in = clock
        .retry_at
        .map(|t| relocation::since(f.now, t) + Duration::from_millis(50))
        .unwrap_or(POLL);
    let phase = st.phase;
    match phase {
        LanePhase::Pending | LanePhase::Failed => {
            if want_out {
                let mut effects: Vec<Effect> = st
                    .lane_index
                    .map(Effect::DeleteDeployment)
                    .into_iter()
                    .collect();
                effects.push(Effect::CrashHook(phase));
                st.lane_index = None;
                st.phase = LanePhase::Retired;
                st.next_attempt_at = None;
                return act(effects, Some(st), Then::Next);
            }
            if waiting_out {
                return act(Vec::new(), Some(st), Then::Requeue(retry_in));
            }
            let mut released = Vec::new();
            if let Some(i) = st.lane_index.filter(|i| over_cap(*i, f.max_lanes)) {
                // Admitted before maxLanes was lowered and the tenant not
                // on the lane: give the index back, wait under the new
                // cap. (Pinned there already: finish, then retire.)
                let Some(routing) = &f.routing else {
                    return Step::Read(Read::Routing);
                };
                if routing.pins.get(&f.tenant) != Some(&QueueId::Lane(i as u8)) {
                    released = vec![Effect::DeleteDeployment(i), Effect::EndMove(i)];
                    st.lane_index = None;
                }
            }
            if st.lane_index.is_none() {
                if let Some(Some(_refused)) = &f.done.admission {
                    let since = st
                        .conditions
                        .iter()
                        .find(|c| c.type_ == conditions::ADMITTED)
                        .map(|c| relocation::since(c.last_transition_time.0, f.now))
                        .unwrap_or_default();
                    return wait(admission_retry(since));
                }
                released.push(Effect::Admit(Box::new(st)));
                return act(released, None, Then::Next);
            }
            if !f.has_workers {
                // Nobody would serve the tenant on the lane: it stays put.
                return Step::Act(Box::new(Act {
                    effects: Vec::new(),
                    record: Some(Record {
                        status: st,
                        refusal: Some(Refusal::NoWorkers),
                    }),
                    then: Then::Requeue(Duration::from_secs(10)),
                }));
            }
            let index = st.lane_index.unwrap_or(0);
            let lane_q = QueueId::Lane(index as u8);
            // Lane moves and reshards take turns (see `Store::lane_move_begin`).
            match f.done.gate {
                None => return act(vec![Effect::BeginMove(index)], None, Then::Next),
                Some(false) => return gate_held(st),
                Some(true) => st.waiting_for_reshard = false,
            }
            let Some(routing) = &f.routing else {
                return Step::Read(Read::Routing);
            };
            if !routing.present() {
                // No table (a Redis that lost its state): the set's
                // reconciler writes it; nothing routes until then.
                return wait(Duration::from_secs(1));
            }
            if matches!(routing.pins.get(&f.tenant), Some(QueueId::Shard(_))) {
                // A move a reshard began and did not finish (the gate
                // keeps new ones from starting): take the tenant once it
                // is on its new hash shard.
                return act(
                    vec![Effect::EndMove(index)],
                    None,
                    Then::Requeue(Duration::from_secs(1)),
                );
            }
            let from = routing.route(&f.tenant);
            if from == lane_q {
                // Pinned here already (a crash after Repinning of an
                // earlier record): finish the move through every step,
                // so the hash shard's hold buffer comes along (pausing,
                // draining and marking are idempotent).
                st.source_queue = Some(hash_shard(&f.tenant, routing.shards).to_string());
            } else {
                st.source_queue = Some(from.to_string());
            }
            st.target_queue = Some(lane_q.to_string());
            st.phase = LanePhase::Pausing;
            st.held_envelopes = 0;
            act(
                vec![
                    Effect::ConfigureQueue(lane_q),
                    Effect::ApplyDeployment(index),
                    Effect::CrashHook(phase),
                ],
                Some(st),
                Then::Next,
            )
        }
        LanePhase::Pausing => {
            let from = match before_the_mark(&st, source, target, want_out) {
                Ok(from) => from,
                Err(step) => return step,
            };
            st.paused_at = Some(Time(f.now));
            st.phase = LanePhase::Draining;
            act(
                vec![Effect::Pause(from), Effect::CrashHook(phase)],
                Some(st),
                Then::Next,
            )
        }
        LanePhase::Draining => {
            let from = match before_the_mark(&st, source, target, want_out) {
                Ok(from) => from,
                Err(step) => return step,
            };
            let Some(state) = &f.source else {
                return Step::Read(Read::Source(from));
            };
            st.held_envelopes = state.held as i64;
            match clock.verdict(state.drained(), f.now, f.drain_timeout) {
                Drain::Drained => {
                    st.phase = LanePhase::Repinning;
                    act(vec![Effect::CrashHook(phase)], Some(st), Then::Next)
                }
                Drain::Wait => {
                    let changed = st.held_envelopes != f.status.held_envelopes;
                    act(Vec::new(), changed.then_some(st), Then::Requeue(POLL))
                }
                Drain::Abort => {
                    let mut clock = clock;
                    let wait = clock.abort(f.now, f.drain_timeout, MAX_DRAIN_BACKOFF);
                    st.drain_attempts = clock.attempts as i32;
                    st.next_attempt_at = clock.retry_at.map(Time);
                    st.paused_at = None;
                    st.held_envelopes = 0;
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
                    let why = Abort::DrainTimeout {
                        attempts: st.drain_attempts,
                    };
                    act(
                        vec![Effect::Abort { from, why }],
                        Some(st),
                        Then::Requeue(wait),
                    )
                }
            }
        }
        LanePhase::Repinning => {
            let (Some(from), Some(to)) = (source, target) else {
                return Step::Fail("Repinning without source and target queues");
            };
            match f.done.marked {
                None => {
                    let route = match to {
                        QueueId::Lane(_) => Effect::Pin(to),
                        QueueId::Shard(_) => Effect::Unpin,
                    };
                    let hand_over = Effect::HandOver { from, to };
                    act(vec![Effect::Pause(to), route, hand_over], None, Then::Next)
                }
                Some(false) => {
                    // Something arrived after all (not drained): drain again.
                    st.phase = LanePhase::Draining;
                    act(Vec::new(), Some(st), Then::Next)
                }
                Some(true) => {
                    st.phase = LanePhase::Scaling;
                    act(vec![Effect::CrashHook(phase)], Some(st), Then::Next)
                }
            }
        }
        LanePhase::Scaling => {
            let Some(to) = target else {
                return Step::Fail("Scaling without a target queue");
            };
            let mut effects = Vec::new();
            if promoting(&st) {
                let index = st.lane_index.unwrap_or(0);
                if !f.done.applied {
                    return act(vec![Effect::ApplyDeployment(index)], None, Then::Next);
                }
                let Some(available) = f.available else {
                    return Step::Read(Read::Available(index));
                };
                if !available {
                    return wait(POLL);
                }
                effects.push(Effect::Resume(to));
                st.phase = LanePhase::Active;
                st.active_since = Some(Time(f.now));
            } else {
                effects.push(Effect::Resume(to));
                effects.extend(st.lane_index.map(Effect::DeleteDeployment));
                st.phase = LanePhase::Retired;
                st.lane_index = None;
            }
            effects.push(Effect::CrashHook(phase));
            st.drain_attempts = 0;
            st.next_attempt_at = None;
            st.paused_at = None;
            st.held_envelopes = 0;
            act(effects, Some(st), Then::Next)
        }
        LanePhase::Active => {
            let Some(routing) = &f.routing else {
                return Step::Read(Read::Routing);
            };
            if !routing.present() {
                return wait(Duration::from_secs(1));
            }
            let beyond_cap = st.lane_index.is_some_and(|i| over_cap(i, f.max_lanes));
            if (want_out || beyond_cap) && !waiting_out {
                let Some(index) = st.lane_index else {
                    st.phase = LanePhase::Pending;
                    return act(Vec::new(), Some(st), Then::Next);
                };
                match f.done.gate {
                    None => {
                        let mut effects = Vec::new();
                        if beyond_cap && !want_out {
                            effects.push(Effect::Info(
                                "maxLanes lowered below this lane's index: retiring it",
                            ));
                        }
                        effects.push(Effect::BeginMove(index));
                        return act(effects, None, Then::Next);
                    }
                    Some(false) => return gate_held(st),
                    Some(true) => st.waiting_for_reshard = false,
                }
                // (The table was read again after the gate was taken.)
                st.source_queue = Some(QueueId::Lane(index as u8).to_string());
                st.target_queue = Some(hash_shard(&f.tenant, routing.shards).to_string());
                st.phase = LanePhase::Retiring;
                return act(Vec::new(), Some(st), Then::Next);
            }
            let mut effects = Vec::new();
            if let Some(i) = st.lane_index {
                // Follow changes of the set's worker template and scheduler policy.
                let lane_q = QueueId::Lane(i as u8);
                effects.push(Effect::ApplyDeployment(i));
                effects.push(Effect::ConfigureQueue(lane_q));
                // An Active lane's tenant is pinned to it, whatever
                // happened to the table (the set's reconciler restores
                // pins after a loss; this mends a pin lost on its own).
                if routing.epoch.is_some() && routing.pins.get(&f.tenant) != Some(&lane_q) {
                    effects.push(Effect::RestorePin(lane_q));
                }
            }
            // Keep the conditions (and observedGeneration) current.
            let mut probe = st.clone();
            probe.observed_generation = f.generation;
            probe.conditions = conditions(&probe, None, f.generation, f.max_lanes);
            let stale = probe.conditions != f.status.conditions
                || f.status.observed_generation != f.generation;
            let then = if waiting_out {
                Then::Requeue(retry_in)
            } else {
                Then::Requeue(Duration::from_secs(30))
            };
            act(effects, stale.then_some(st), then)
        }
        LanePhase::Retiring => {
            st.phase = LanePhase::Pausing;
            act(Vec::new(), Some(st), Then::Next)
        }
        LanePhase::Retired => {
            if f.deleting {
                return act(Vec::new(), None, Then::AwaitChange);
            }
            if !f.retire {
                st.phase = LanePhase::Pending;
                st.source_queue = None;
                st.target_queue = None;
                return act(Vec::new(), Some(st), Then::Next);
            }
            let effects = if f.from_promotion {
                vec![Effect::DeleteLane]
            } else {
                Vec::new()
            };
            // Keep conditions current (the Admitted reason).
            let mut probe = st.clone();
            probe.conditions = conditions(&probe, None, f.generation, f.max_lanes);
            let stale = probe.conditions != f.status.conditions;
            act(effects, stale.then_some(st), Then::AwaitChange)
        }
    }
}

/// `Pausing` and `Draining` start alike: the source to pause or drain, or,
/// without recorded queues, start over from `Pending`; and a retire (or
/// deletion) during a promotion backs out of it, resumed in its source
/// (`Draining` forgets its pause too).
fn before_the_mark(
    st: &DedicatedLaneStatus,
    source: Option<QueueId>,
    target: Option<QueueId>,
    want_out: bool,
) -> Result<QueueId, Step> {
    let mut st = st.clone();
    let (Some(from), Some(_)) = (source, target) else {
        st.phase = LanePhase::Pending;
        return Err(act(Vec::new(), Some(st), Then::Next));
    };
    if want_out && promoting(&st) {
        if st.phase == LanePhase::Draining {
            st.paused_at = None;
        }
        st.phase = LanePhase::Pending;
        let why = Abort::Retire;
        return Err(act(vec![Effect::Abort { from, why }], Some(st), Then::Next));
    }
    Ok(from)
}

/// A reshard holds the gate: say so once, look again in 2 s.
fn gate_held(mut st: DedicatedLaneStatus) -> Step {
    let record = (!st.waiting_for_reshard).then(|| {
        st.waiting_for_reshard = true;
        st
    });
    act(Vec::new(), record, Then::Requeue(Duration::from_secs(2)))
}
