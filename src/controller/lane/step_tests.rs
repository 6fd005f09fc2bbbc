//! Fast tests of the pure lane state machine, [`next_step`]: every phase and
//! every way out of a move, no I/O.
//!
//! | phase | case | test |
//! |---|---|---|
//! | `Pending` | admit, gate, read table, configure + apply, → `Pausing` | `pending_promotes_through_admission_gate_and_table` |
//! | `Pending` | already pinned to the lane (crash after `Repinning`): source = hash shard | `pending_pinned_to_its_lane_already_finishes_the_move` |
//! | `Pending` | admission refused → requeue after `admission_retry` | `pending_refused_waits_as_long_as_it_has_waited` |
//! | `Pending` | index over a lowered cap, not pinned → delete, end move, re-admit | `pending_over_cap_gives_its_index_back_unless_pinned` |
//! | `Pending` | over the cap but pinned to the lane → keeps going | `pending_over_cap_gives_its_index_back_unless_pinned` |
//! | `Pending` | 0 replicas → `NoWorkers`, 10 s | `pending_without_workers_stays_put` |
//! | `Pending` | gate held by a reshard → `waitingForReshard` once, 2 s | `a_reshard_holding_the_gate_makes_the_lane_wait` |
//! | `Pending` | no routing table → 1 s | `no_routing_table_waits_for_the_set` |
//! | `Pending` | tenant pinned to a shard (reshard move unfinished) → end move, 1 s | `a_tenant_a_reshard_is_moving_is_left_to_it` |
//! | `Pending` | backing off after `DrainTimeout` → requeue at `nextAttemptAt` | `a_backing_off_lane_waits_for_its_next_attempt` |
//! | `Pending`, `Failed` | retire / delete → delete Deployment, → `Retired` | `pending_and_failed_retire_at_once` |
//! | `Retiring` | → `Pausing` | `retiring_pauses_next` |
//! | `Pausing` | pause source, clock starts, → `Draining` | `pausing_pauses_and_starts_the_drain_clock` |
//! | `Pausing` | **abort**: retire during a promotion → resume source, `Pending` | `retire_during_a_promotion_backs_out_before_the_mark` |
//! | `Pausing`, `Draining` | **abort**: no source/target recorded → `Pending` | `a_move_without_queues_starts_over_or_fails` |
//! | `Draining` | reads the source; drained → `Repinning` | `draining_waits_then_repins` |
//! | `Draining` | still draining → poll, record held count only when it changed | `draining_waits_then_repins` |
//! | `Draining` | **abort**: retire during a promotion → resume, `Pending`, clock cleared | `retire_during_a_promotion_backs_out_before_the_mark` |
//! | `Draining` | **abort**: `DrainTimeout` promoting → resume, `Pending`, attempts + 1, backoff | `a_drain_timeout_backs_out_with_a_growing_wait` |
//! | `Draining` | **abort**: `DrainTimeout` retiring → resume on the lane, `Active` | `a_drain_timeout_backs_out_with_a_growing_wait` |
//! | `Repinning` | pause target, pin (lane) / unpin (shard), hand over, → `Scaling` | `repinning_hands_over_or_drains_again` |
//! | `Repinning` | **abort**: mark refused (something arrived) → `Draining` | `repinning_hands_over_or_drains_again` |
//! | `Repinning`, `Scaling` | no queues recorded → fail | `a_move_without_queues_starts_over_or_fails` |
//! | `Scaling` | promote: apply, wait until available, resume lane, → `Active` | `scaling_waits_for_the_lane_then_resumes` |
//! | `Scaling` | retire: resume shard, delete Deployment, free index, → `Retired` | `scaling_waits_for_the_lane_then_resumes` |
//! | `Active` | apply, configure, conditions current, 30 s | `active_follows_the_spec_and_mends_its_pin` |
//! | `Active` | pin lost (epoch present) → restore it | `active_follows_the_spec_and_mends_its_pin` |
//! | `Active` | retire / over the cap → gate, → `Retiring` (target hash shard) | `active_retires_through_the_gate` |
//! | `Active` | retire with no index → `Pending` | `active_retires_through_the_gate` |
//! | `Active` | gate held → `waitingForReshard`, 2 s | `a_reshard_holding_the_gate_makes_the_lane_wait` |
//! | `Active` | no routing table → 1 s | `no_routing_table_waits_for_the_set` |
//! | `Active` | backing off (a retire's drain timed out) → not retiring yet | `a_backing_off_lane_waits_for_its_next_attempt` |
//! | `Retired` | deleting → await change (the finalizer goes) | `retired_waits_comes_back_or_is_deleted` |
//! | `Retired` | un-retired → `Pending` | `retired_waits_comes_back_or_is_deleted` |
//! | `Retired` | made by promotion → delete the lane | `retired_waits_comes_back_or_is_deleted` |

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::crd::{DedicatedLaneStatus, LanePhase};
use crate::routing::{hash_shard, QueueId, RoutingTable};
use crate::store::TenantQueueState;

use super::step::{Abort, POLL};
use super::*;

const TENANT: &str = "whale";

fn at(s: i64) -> Timestamp {
    Timestamp::from_second(1_000_000 + s).unwrap()
}

fn facts(phase: LanePhase) -> Facts {
    Facts {
        status: DedicatedLaneStatus {
            phase,
            ..Default::default()
        },
        generation: Some(1),
        tenant: TENANT.into(),
        deleting: false,
        retire: false,
        from_promotion: false,
        has_workers: true,
        max_lanes: 8,
        drain_timeout: Duration::from_secs(10),
        now: at(0),
        routing: None,
        source: None,
        available: None,
        done: Done::default(),
    }
}

/// A lane promoting from `shard-01` to `lane-2`, in `phase`.
fn promoting(phase: LanePhase) -> Facts {
    let mut f = facts(phase);
    f.status.lane_index = Some(2);
    f.status.source_queue = Some("shard-01".into());
    f.status.target_queue = Some("lane-2".into());
    f
}

/// A lane retiring from `lane-2` to `shard-01`, in `phase`.
fn retiring(phase: LanePhase) -> Facts {
    let mut f = promoting(phase);
    f.status.source_queue = Some("lane-2".into());
    f.status.target_queue = Some("shard-01".into());
    f
}

/// `Pending`, admitted to lane 2, the gate taken.
fn gate_taken() -> Facts {
    let mut f = facts(LanePhase::Pending);
    f.status.lane_index = Some(2);
    f.done.gate = Some(true);
    f
}

fn table(pins: &[(&str, QueueId)]) -> RoutingTable {
    RoutingTable {
        shards: 4,
        version: 3,
        pins: pins
            .iter()
            .map(|(t, q)| (t.to_string(), *q))
            .collect::<BTreeMap<_, _>>(),
        epoch: Some("e".into()),
        replicated: None,
    }
}

fn state(queued: u64, held: u64) -> TenantQueueState {
    TenantQueueState {
        queued,
        in_flight: 0,
        delayed: 0,
        held,
        paused: true,
        moved_to: None,
        depth: queued,
        user_paused: false,
    }
}

fn act(step: Step) -> Act {
    match step {
        Step::Act(a) => *a,
        other => panic!("expected an act, got {other:?}"),
    }
}

/// The status an act records (it must record one).
fn recorded(a: &Act) -> &DedicatedLaneStatus {
    &a.record.as_ref().expect("a status to record").status
}

/// The act carries out exactly `effects`; the status it records.
fn does(a: &Act, effects: Vec<Effect>) -> &DedicatedLaneStatus {
    assert_eq!(a.effects, effects);
    recorded(a)
}

const LANE: QueueId = QueueId::Lane(2);
const SHARD: QueueId = QueueId::Shard(1);

#[test]
fn pending_promotes_through_admission_gate_and_table() {
    let mut f = facts(LanePhase::Pending);
    // No index: admit (the act records the status itself).
    let a = act(next_step(&f));
    assert!(matches!(a.effects.as_slice(), [Effect::Admit(_)]), "{a:?}");
    assert_eq!((a.record, a.then), (None, Then::Next));
    // Admitted (index 2): take the gate, nothing read yet.
    f.status.lane_index = Some(2);
    f.done.admission = Some(None);
    let a = act(next_step(&f));
    assert_eq!(a.effects, vec![Effect::BeginMove(2)]);
    assert_eq!((a.record, a.then), (None, Then::Next));
    // Gate taken: the table is read only now.
    f.done.gate = Some(true);
    assert_eq!(next_step(&f), Step::Read(Read::Routing));
    f.routing = Some(table(&[]));
    let a = act(next_step(&f));
    assert_eq!(
        a.effects,
        vec![
            Effect::ConfigureQueue(LANE),
            Effect::ApplyDeployment(2),
            Effect::CrashHook(LanePhase::Pending),
        ]
    );
    let st = recorded(&a);
    assert_eq!(st.phase, LanePhase::Pausing);
    let home = hash_shard(TENANT, 4).to_string();
    assert_eq!(st.source_queue.as_deref(), Some(home.as_str()));
    assert_eq!(st.target_queue.as_deref(), Some("lane-2"));
    assert!(!st.waiting_for_reshard && st.held_envelopes == 0);
    assert_eq!(a.then, Then::Next);
}

#[test]
fn pending_pinned_to_its_lane_already_finishes_the_move() {
    let mut f = gate_taken();
    f.routing = Some(table(&[(TENANT, LANE)]));
    let a = act(next_step(&f));
    let st = recorded(&a);
    // From its hash shard (whose hold buffer must come along), not the lane.
    let home = hash_shard(TENANT, 4).to_string();
    assert_eq!(st.source_queue.as_deref(), Some(home.as_str()));
    assert_eq!(st.target_queue.as_deref(), Some("lane-2"));
    assert_eq!(st.phase, LanePhase::Pausing);
}

#[test]
fn pending_refused_waits_as_long_as_it_has_waited() {
    let mut f = facts(LanePhase::Pending);
    f.done.admission = Some(Some(Refusal::LaneCapReached { used: 8, max: 8 }));
    let waited = |f: &Facts| act(next_step(f)).then;
    // No Admitted condition yet: the 5 s floor.
    assert_eq!(waited(&f), Then::Requeue(Duration::from_secs(5)));
    f.status.conditions = conditions(
        &f.status,
        Some(&Refusal::LaneCapReached { used: 8, max: 8 }),
        Some(1),
        8,
    );
    let since = f.status.conditions[2].last_transition_time.0;
    f.now = since + Duration::from_secs(40);
    assert_eq!(waited(&f), Then::Requeue(Duration::from_secs(40)));
    let a = act(next_step(&f));
    assert!(a.effects.is_empty() && a.record.is_none());
}

#[test]
fn pending_over_cap_gives_its_index_back_unless_pinned() {
    let mut f = facts(LanePhase::Pending);
    f.status.lane_index = Some(5);
    f.max_lanes = 2;
    // The pin decides: read the table first.
    assert_eq!(next_step(&f), Step::Read(Read::Routing));
    f.routing = Some(table(&[]));
    let a = act(next_step(&f));
    match a.effects.as_slice() {
        [Effect::DeleteDeployment(5), Effect::EndMove(5), Effect::Admit(st)] => {
            assert_eq!(st.lane_index, None)
        }
        other => panic!("{other:?}"),
    }
    // Pinned to that lane already: finish (then retire), keep the index.
    f.routing = Some(table(&[(TENANT, QueueId::Lane(5))]));
    let a = act(next_step(&f));
    assert_eq!(a.effects, vec![Effect::BeginMove(5)]);
}

#[test]
fn pending_without_workers_stays_put() {
    let mut f = facts(LanePhase::Pending);
    f.status.lane_index = Some(1);
    f.has_workers = false;
    let a = act(next_step(&f));
    assert!(a.effects.is_empty());
    let r = a.record.unwrap();
    assert_eq!(r.refusal, Some(Refusal::NoWorkers));
    assert_eq!(r.status.phase, LanePhase::Pending);
    assert_eq!(a.then, Then::Requeue(Duration::from_secs(10)));
}

#[test]
fn a_reshard_holding_the_gate_makes_the_lane_wait() {
    for mut f in [
        {
            let mut f = facts(LanePhase::Pending);
            f.status.lane_index = Some(2);
            f
        },
        {
            let mut f = promoting(LanePhase::Active);
            f.retire = true;
            f.routing = Some(table(&[(TENANT, LANE)]));
            f
        },
    ] {
        f.done.gate = Some(false);
        let a = act(next_step(&f));
        assert!(a.effects.is_empty());
        assert!(recorded(&a).waiting_for_reshard);
        assert_eq!(recorded(&a).phase, f.status.phase);
        assert_eq!(a.then, Then::Requeue(Duration::from_secs(2)));
        // Said once: no second write.
        f.status.waiting_for_reshard = true;
        let a = act(next_step(&f));
        assert_eq!(a.record, None);
        assert_eq!(a.then, Then::Requeue(Duration::from_secs(2)));
    }
}

#[test]
fn no_routing_table_waits_for_the_set() {
    let mut pending = gate_taken();
    let mut active = promoting(LanePhase::Active);
    for f in [&mut pending, &mut active] {
        f.routing = Some(RoutingTable::default());
        let a = act(next_step(f));
        assert!(a.effects.is_empty() && a.record.is_none(), "{a:?}");
        assert_eq!(a.then, Then::Requeue(Duration::from_secs(1)));
    }
}

#[test]
fn a_tenant_a_reshard_is_moving_is_left_to_it() {
    let mut f = gate_taken();
    f.routing = Some(table(&[(TENANT, QueueId::Shard(3))]));
    let a = act(next_step(&f));
    assert_eq!(a.effects, vec![Effect::EndMove(2)]);
    assert_eq!(
        (a.record, a.then),
        (None, Then::Requeue(Duration::from_secs(1)))
    );
}

#[test]
fn a_backing_off_lane_waits_for_its_next_attempt() {
    let mut f = promoting(LanePhase::Pending);
    f.status.drain_attempts = 1;
    f.status.next_attempt_at = Some(Time(at(20)));
    let a = act(next_step(&f));
    assert!(a.effects.is_empty());
    assert_eq!(recorded(&a), &f.status);
    assert_eq!(
        a.then,
        Then::Requeue(Duration::from_secs(20) + Duration::from_millis(50))
    );
    // Time is up: the move starts over (admitted already: the gate).
    f.now = at(20);
    assert_eq!(act(next_step(&f)).effects, vec![Effect::BeginMove(2)]);

    // A retire whose drain timed out: Active, and not retiring until then.
    let mut f = promoting(LanePhase::Active);
    f.retire = true;
    f.status.next_attempt_at = Some(Time(at(20)));
    f.routing = Some(table(&[(TENANT, LANE)]));
    let a = act(next_step(&f));
    assert!(a.effects.contains(&Effect::ApplyDeployment(2)), "{a:?}");
    assert_eq!(
        a.then,
        Then::Requeue(Duration::from_secs(20) + Duration::from_millis(50))
    );
}

#[test]
fn pending_and_failed_retire_at_once() {
    for phase in [LanePhase::Pending, LanePhase::Failed] {
        let mut f = promoting(phase);
        f.deleting = true;
        f.status.next_attempt_at = Some(Time(at(99)));
        let a = act(next_step(&f));
        assert_eq!(
            a.effects,
            vec![Effect::DeleteDeployment(2), Effect::CrashHook(phase)]
        );
        let st = recorded(&a);
        assert_eq!(
            (st.phase, st.lane_index, st.next_attempt_at.clone()),
            (LanePhase::Retired, None, None)
        );
        assert_eq!(a.then, Then::Next);
        // Never admitted: nothing to delete, and no Redis touched.
        let mut f = facts(phase);
        f.retire = true;
        let a = act(next_step(&f));
        assert_eq!(a.effects, vec![Effect::CrashHook(phase)]);
    }
}

#[test]
fn retiring_pauses_next() {
    let a = act(next_step(&retiring(LanePhase::Retiring)));
    assert!(a.effects.is_empty());
    assert_eq!(recorded(&a).phase, LanePhase::Pausing);
    assert_eq!(a.then, Then::Next);
}

#[test]
fn pausing_pauses_and_starts_the_drain_clock() {
    for (f, from) in [
        (promoting(LanePhase::Pausing), SHARD),
        (retiring(LanePhase::Pausing), LANE),
    ] {
        let a = act(next_step(&f));
        let pause = vec![Effect::Pause(from), Effect::CrashHook(LanePhase::Pausing)];
        let st = does(&a, pause);
        assert_eq!(st.phase, LanePhase::Draining);
        assert_eq!(st.paused_at, Some(Time(at(0))));
    }
}

#[test]
fn retire_during_a_promotion_backs_out_before_the_mark() {
    for phase in [LanePhase::Pausing, LanePhase::Draining] {
        let mut f = promoting(phase);
        f.status.paused_at = Some(Time(at(-3)));
        f.retire = true;
        let a = act(next_step(&f));
        assert_eq!(
            a.effects,
            vec![Effect::Abort {
                from: SHARD,
                why: Abort::Retire
            }]
        );
        let st = recorded(&a);
        assert_eq!(st.phase, LanePhase::Pending);
        if phase == LanePhase::Draining {
            assert_eq!(st.paused_at, None);
        }
        assert_eq!(a.then, Then::Next);
    }
    // A retirement is not backed out of by retiring.
    let mut f = retiring(LanePhase::Pausing);
    f.retire = true;
    assert_eq!(act(next_step(&f)).effects[0], Effect::Pause(LANE));
}

#[test]
fn a_move_without_queues_starts_over_or_fails() {
    for phase in [LanePhase::Pausing, LanePhase::Draining] {
        let mut f = promoting(phase);
        f.status.source_queue = None;
        let a = act(next_step(&f));
        assert!(a.effects.is_empty());
        assert_eq!(recorded(&a).phase, LanePhase::Pending);
    }
    let mut f = promoting(LanePhase::Repinning);
    f.status.target_queue = Some("nonsense".into());
    assert!(matches!(next_step(&f), Step::Fail(_)));
    let mut f = promoting(LanePhase::Scaling);
    f.status.target_queue = None;
    assert!(matches!(next_step(&f), Step::Fail(_)));
}

#[test]
fn draining_waits_then_repins() {
    let mut f = promoting(LanePhase::Draining);
    f.status.paused_at = Some(Time(at(-3)));
    assert_eq!(next_step(&f), Step::Read(Read::Source(SHARD)));
    // Still draining: poll; the held count is news, so it is recorded.
    f.source = Some(state(7, 2));
    let a = act(next_step(&f));
    assert_eq!(recorded(&a).held_envelopes, 2);
    assert_eq!(a.then, Then::Requeue(POLL));
    f.status.held_envelopes = 2;
    assert_eq!(act(next_step(&f)).record, None);
    // Drained.
    f.source = Some(state(0, 4));
    let a = act(next_step(&f));
    assert_eq!(a.effects, vec![Effect::CrashHook(LanePhase::Draining)]);
    let st = recorded(&a);
    assert_eq!((st.phase, st.held_envelopes), (LanePhase::Repinning, 4));
}

/// `f` (`Draining`) paused a minute ago and not drained: the act resumes
/// the tenant in `from`, as its first drain timeout.
fn timed_out(f: &mut Facts, from: QueueId) -> Act {
    f.status.paused_at = Some(Time(at(-60)));
    f.source = Some(state(3, 1));
    let a = act(next_step(f));
    let why = Abort::DrainTimeout { attempts: 1 };
    assert_eq!(a.effects, vec![Effect::Abort { from, why }]);
    a
}

#[test]
fn a_drain_timeout_backs_out_with_a_growing_wait() {
    let mut f = promoting(LanePhase::Draining);
    let a = timed_out(&mut f, SHARD);
    let st = recorded(&a);
    assert_eq!(st.phase, LanePhase::Pending);
    assert_eq!(st.drain_attempts, 1);
    assert_eq!(st.next_attempt_at, Some(Time(at(10))));
    assert_eq!((st.paused_at.clone(), st.held_envelopes), (None, 0));
    assert_eq!(st.source_queue.as_deref(), Some("shard-01"));
    assert_eq!(a.then, Then::Requeue(Duration::from_secs(10)));
    // The third attempt waits four times the timeout.
    f.status.drain_attempts = 2;
    let a = act(next_step(&f));
    assert_eq!(recorded(&a).drain_attempts, 3);
    assert_eq!(a.then, Then::Requeue(Duration::from_secs(40)));

    // Retiring: back on the lane it never left.
    let mut f = retiring(LanePhase::Draining);
    let a = timed_out(&mut f, LANE);
    let st = recorded(&a);
    assert_eq!(st.phase, LanePhase::Active);
    assert_eq!(
        (st.source_queue.as_deref(), st.target_queue.as_deref()),
        (None, Some("lane-2"))
    );
}

#[test]
fn repinning_hands_over_or_drains_again() {
    for (mut f, to, route) in [
        (promoting(LanePhase::Repinning), LANE, Effect::Pin(LANE)),
        (retiring(LanePhase::Repinning), SHARD, Effect::Unpin),
    ] {
        let from = if to == LANE { SHARD } else { LANE };
        let a = act(next_step(&f));
        assert_eq!(
            a.effects,
            vec![Effect::Pause(to), route, Effect::HandOver { from, to }]
        );
        assert_eq!((a.record, a.then), (None, Then::Next));
        f.done.marked = Some(true);
        let a = act(next_step(&f));
        assert_eq!(a.effects, vec![Effect::CrashHook(LanePhase::Repinning)]);
        assert_eq!(recorded(&a).phase, LanePhase::Scaling);
        // Refused: something arrived after all.
        f.done.marked = Some(false);
        let a = act(next_step(&f));
        assert!(a.effects.is_empty());
        assert_eq!(recorded(&a).phase, LanePhase::Draining);
    }
}

#[test]
fn scaling_waits_for_the_lane_then_resumes() {
    let mut f = promoting(LanePhase::Scaling);
    f.status.drain_attempts = 2;
    f.status.paused_at = Some(Time(at(-5)));
    let a = act(next_step(&f));
    assert_eq!(a.effects, vec![Effect::ApplyDeployment(2)]);
    f.done.applied = true;
    assert_eq!(next_step(&f), Step::Read(Read::Available(2)));
    f.available = Some(false);
    assert_eq!(act(next_step(&f)).then, Then::Requeue(POLL));
    f.available = Some(true);
    let a = act(next_step(&f));
    let resume = vec![Effect::Resume(LANE), Effect::CrashHook(LanePhase::Scaling)];
    let st = does(&a, resume);
    assert_eq!(st.phase, LanePhase::Active);
    assert_eq!(st.active_since, Some(Time(at(0))));
    assert_eq!((st.drain_attempts, st.paused_at.clone()), (0, None));

    let a = act(next_step(&retiring(LanePhase::Scaling)));
    assert_eq!(
        a.effects,
        vec![
            Effect::Resume(SHARD),
            Effect::DeleteDeployment(2),
            Effect::CrashHook(LanePhase::Scaling)
        ]
    );
    let st = recorded(&a);
    assert_eq!((st.phase, st.lane_index), (LanePhase::Retired, None));
}

#[test]
fn active_follows_the_spec_and_mends_its_pin() {
    let mut f = promoting(LanePhase::Active);
    assert_eq!(next_step(&f), Step::Read(Read::Routing));
    f.routing = Some(table(&[(TENANT, LANE)]));
    f.status.observed_generation = Some(1);
    f.status.conditions = conditions(&f.status, None, Some(1), 8);
    let a = act(next_step(&f));
    assert_eq!(
        a.effects,
        vec![Effect::ApplyDeployment(2), Effect::ConfigureQueue(LANE)]
    );
    // Conditions current: no write.
    assert_eq!(a.record, None);
    assert_eq!(a.then, Then::Requeue(Duration::from_secs(30)));
    // A new generation is recorded.
    f.generation = Some(2);
    assert!(act(next_step(&f)).record.is_some());
    // The pin is gone from a table that kept its epoch: restore it.
    f.routing = Some(table(&[]));
    let a = act(next_step(&f));
    assert_eq!(a.effects.last(), Some(&Effect::RestorePin(LANE)));
    // No epoch (Redis lost its state): the set's reconciler restores pins.
    let mut lost = table(&[]);
    lost.epoch = None;
    f.routing = Some(lost);
    assert!(!act(next_step(&f))
        .effects
        .iter()
        .any(|e| matches!(e, Effect::RestorePin(_))));
}

#[test]
fn active_retires_through_the_gate() {
    // Retired by spec, or by a maxLanes lowered below its index.
    for (retire, max_lanes) in [(true, 8), (false, 2)] {
        let mut f = promoting(LanePhase::Active);
        f.retire = retire;
        f.max_lanes = max_lanes;
        f.routing = Some(table(&[(TENANT, LANE)]));
        let a = act(next_step(&f));
        assert_eq!(a.effects.last(), Some(&Effect::BeginMove(2)));
        assert_eq!(
            a.effects.len(),
            if retire { 1 } else { 2 },
            "an Info line for the cap"
        );
        f.done.gate = Some(true);
        f.status.waiting_for_reshard = true;
        let a = act(next_step(&f));
        assert!(a.effects.is_empty());
        let st = recorded(&a);
        let home = hash_shard(TENANT, 4).to_string();
        assert_eq!(st.phase, LanePhase::Retiring);
        assert_eq!(st.source_queue.as_deref(), Some("lane-2"));
        assert_eq!(st.target_queue.as_deref(), Some(home.as_str()));
        assert!(!st.waiting_for_reshard);
    }
    let mut f = facts(LanePhase::Active);
    f.deleting = true;
    f.routing = Some(table(&[]));
    let a = act(next_step(&f));
    assert_eq!(recorded(&a).phase, LanePhase::Pending);
}

#[test]
fn retired_waits_comes_back_or_is_deleted() {
    let mut f = facts(LanePhase::Retired);
    f.retire = true;
    f.status.conditions = conditions(&f.status, None, Some(1), 8);
    let a = act(next_step(&f));
    assert_eq!((a.effects.len(), a.record.is_none()), (0, true));
    assert_eq!(a.then, Then::AwaitChange);
    f.from_promotion = true;
    assert_eq!(act(next_step(&f)).effects, vec![Effect::DeleteLane]);
    // Deleting: nothing more (the reconcile removes the finalizer).
    f.deleting = true;
    let a = act(next_step(&f));
    assert!(a.effects.is_empty() && a.record.is_none());
    assert_eq!(a.then, Then::AwaitChange);
    // Un-retired: back to Pending, queues cleared.
    let mut f = retiring(LanePhase::Retired);
    let a = act(next_step(&f));
    let st = recorded(&a);
    assert_eq!(st.phase, LanePhase::Pending);
    assert_eq!(
        (st.source_queue.clone(), st.target_queue.clone()),
        (None, None)
    );
    f.retire = true;
    assert_eq!(act(next_step(&f)).then, Then::AwaitChange);
}
