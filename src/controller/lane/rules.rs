//! The DedicatedLane's pure rules: admission under the cap, drain verdicts,
//! conditions, the cap and slot predicates, the pin a phase needs, and the
//! set-level summary. No I/O.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use crate::crd::{DedicatedLane, DedicatedLaneStatus, LanePhase, MAX_LANES};
use crate::routing::QueueId;

use super::super::status::condition;
use crate::crd::conditions;

/// Why a lane has no index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `maxLanes` lanes of the set are admitted already (or earlier lanes wait).
    LaneCapReached { used: usize, max: usize },
    /// Another DedicatedLane of the set serves this tenant.
    DuplicateTenant(String),
    /// The lane's worker template asks for 0 replicas (and no autoscaler):
    /// nobody would serve the tenant there, so it stays on its shard.
    NoWorkers,
}

/// What the admission decision needs to know of one lane of the set.
#[derive(Clone, Debug, PartialEq)]
pub struct LaneSlot {
    pub name: String,
    pub tenant: String,
    pub index: Option<i32>,
    /// Waiting for an index (not retiring, not deleted).
    pub waiting: bool,
    pub created: Option<Timestamp>,
}

/// Admit lane `me` under the cap: the lowest free index, given to waiting
/// lanes oldest first. Pure.
pub fn admit(me: &str, lanes: &[LaneSlot], max_lanes: i32) -> Result<i32, Refusal> {
    let mine = lanes.iter().find(|l| l.name == me);
    if let Some(i) = mine.and_then(|l| l.index) {
        return Ok(i);
    }
    if let Some(me_slot) = mine {
        let older_same_tenant = lanes.iter().find(|l| {
            l.name != me
                && l.tenant == me_slot.tenant
                && (l.index.is_some()
                    || (l.waiting && (l.created, &l.name) < (me_slot.created, &me_slot.name)))
        });
        if let Some(other) = older_same_tenant {
            return Err(Refusal::DuplicateTenant(other.name.clone()));
        }
    }
    let max = max_lanes.clamp(1, MAX_LANES);
    let used: Vec<i32> = lanes.iter().filter_map(|l| l.index).collect();
    let free: Vec<i32> = (0..max).filter(|i| !used.contains(i)).collect();
    let mut queue: Vec<&LaneSlot> = lanes
        .iter()
        .filter(|l| l.index.is_none() && l.waiting)
        .collect();
    queue.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    let position = queue
        .iter()
        .position(|l| l.name == me)
        .unwrap_or(queue.len());
    free.get(position).copied().ok_or(Refusal::LaneCapReached {
        used: used.len(),
        max: max as usize,
    })
}

/// Does this move go onto a lane (promotion) or back to a shard (retirement)?
pub fn promoting(st: &DedicatedLaneStatus) -> bool {
    !matches!(
        st.target_queue.as_deref().and_then(|q| q.parse().ok()),
        Some(QueueId::Shard(_))
    )
}

/// The lane's conditions for its status. `refusal` is why it has no index;
/// `note` overrides the Relocating reason and message (e.g. `DrainTimeout`). Pure.
pub fn conditions(
    st: &DedicatedLaneStatus,
    refusal: Option<&Refusal>,
    generation: Option<i64>,
    max_lanes: i32,
) -> Vec<Condition> {
    let prev = &st.conditions;
    let admitted = match (st.lane_index, refusal) {
        (_, Some(Refusal::NoWorkers)) => condition(
            prev,
            conditions::ADMITTED,
            false,
            conditions::NO_WORKERS,
            "the lane's worker template has 0 replicas: the tenant stays on its shard until the lane has workers (set worker.replicas to 1 or more)".to_string(),
            generation,
        ),
        (Some(i), _) if over_cap(i, max_lanes) => condition(
            prev,
            conditions::ADMITTED,
            false,
            conditions::OVER_CAP,
            format!(
                "lane index {i} is beyond maxLanes {max_lanes} (lowered): the tenant goes back to its hash shard and the lane waits for an index under the cap"
            ),
            generation,
        ),
        (Some(i), _) => condition(
            prev,
            conditions::ADMITTED,
            true,
            conditions::UNDER_CAP,
            format!("lane {i} of {max_lanes}"),
            generation,
        ),
        (None, Some(Refusal::LaneCapReached { used, max })) => condition(
            prev,
            conditions::ADMITTED,
            false,
            conditions::LANE_CAP_REACHED,
            format!("{used} of {max} lanes are admitted; this lane waits for one to be retired"),
            generation,
        ),
        (None, Some(Refusal::DuplicateTenant(other))) => condition(
            prev,
            conditions::ADMITTED,
            false,
            conditions::DUPLICATE_TENANT,
            format!("DedicatedLane {other} already serves this tenant"),
            generation,
        ),
        (None, None) if st.phase == LanePhase::Retired => condition(
            prev,
            conditions::ADMITTED,
            false,
            "Retired",
            "the lane is retired and its index freed".to_string(),
            generation,
        ),
        (None, None) => condition(
            prev,
            conditions::ADMITTED,
            false,
            "Pending",
            "waiting for a lane index".to_string(),
            generation,
        ),
    };
    let target = st.target_queue.clone().unwrap_or_default();
    let source = st.source_queue.clone().unwrap_or_default();
    let ready = match st.phase {
        LanePhase::Active => condition(
            prev,
            conditions::READY,
            true,
            "Active",
            format!("the tenant is served by {target}"),
            generation,
        ),
        phase => condition(
            prev,
            conditions::READY,
            false,
            &format!("{phase:?}"),
            format!("phase {phase:?}"),
            generation,
        ),
    };
    let moving = moving(st.phase);
    let relocating = if moving {
        condition(
            prev,
            conditions::RELOCATING,
            true,
            if promoting(st) {
                "Promoting"
            } else {
                "Retiring"
            },
            format!("moving from {source} to {target}"),
            generation,
        )
    } else if st.waiting_for_reshard {
        condition(
            prev,
            conditions::RELOCATING,
            false,
            conditions::WAITING_FOR_RESHARD,
            "the ShardSet is changing its shard count; this lane's move starts when that is done"
                .to_string(),
            generation,
        )
    } else if st.next_attempt_at.is_some() {
        let next = st
            .next_attempt_at
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default();
        condition(
            prev,
            conditions::RELOCATING,
            false,
            conditions::DRAIN_TIMEOUT,
            format!(
                "{source} did not drain within the drain timeout ({} attempts); the tenant was resumed where it was; next attempt at {next}",
                st.drain_attempts
            ),
            generation,
        )
    } else {
        condition(
            prev,
            conditions::RELOCATING,
            false,
            conditions::IDLE,
            "no move under way".to_string(),
            generation,
        )
    };
    vec![ready, relocating, admitted]
}

/// Is lane index `index` beyond the set's `maxLanes`? (The cap was lowered
/// below the lanes admitted: the lanes at `maxLanes` and above retire and
/// wait for an index under the cap.) Pure.
pub fn over_cap(index: i32, max_lanes: i32) -> bool {
    index >= max_lanes.clamp(1, MAX_LANES)
}

/// Does a worker template run anyone? Zero replicas do not, unless an
/// autoscaler owns the count. Pure.
pub fn has_workers(w: &crate::crd::WorkerTemplate) -> bool {
    w.autoscaled || w.replicas.unwrap_or(1) > 0
}

/// Is a lane in this phase moving its tenant?
pub fn moving(phase: LanePhase) -> bool {
    matches!(
        phase,
        LanePhase::Pausing
            | LanePhase::Draining
            | LanePhase::Repinning
            | LanePhase::Scaling
            | LanePhase::Retiring
    )
}

/// Is this lane waiting because of the cap? (For the ShardSet's `LaneCapReached`.)
pub fn waits_for_cap(lane: &DedicatedLane) -> bool {
    lane.status.as_ref().is_some_and(|st| {
        st.lane_index.is_none()
            && st.conditions.iter().any(|c| {
                c.type_ == conditions::ADMITTED
                    && c.status == "False"
                    && c.reason == conditions::LANE_CAP_REACHED
            })
    })
}

/// Could this change of a lane have freed a slot under its set's cap? Pure.
pub fn frees_a_slot(lane: &DedicatedLane) -> bool {
    lane.metadata.deletion_timestamp.is_some()
        || lane.spec.retire
        || lane
            .status
            .as_ref()
            .is_some_and(|s| matches!(s.phase, LanePhase::Retired | LanePhase::Failed))
}

/// Is this lane waiting for a slot (no index yet, not on its way out)? Pure.
pub fn waits_for_a_slot(lane: &DedicatedLane) -> bool {
    let st = lane.status.clone().unwrap_or_default();
    st.lane_index.is_none()
        && st.phase == LanePhase::Pending
        && !lane.spec.retire
        && lane.metadata.deletion_timestamp.is_none()
}

/// How long a lane refused for the cap waits before looking again by
/// itself (it is woken sooner when a slot frees): as long as it has waited,
/// from 5 s to 5 min. Pure.
pub fn admission_retry(waited: Duration) -> Duration {
    waited.clamp(Duration::from_secs(5), Duration::from_secs(300))
}

/// The lane whose pin the routing table must hold for this lane's tenant
/// now, from its recorded phase: `Active` and on its way out until the pin
/// is removed (`Retiring`, and `Pausing`/`Draining`/`Repinning` from the
/// lane), and promoted past `Repinning` (`Scaling` to the lane). What the
/// controller rewrites when Redis lost its state.
pub fn pinned_lane(st: &DedicatedLaneStatus) -> Option<QueueId> {
    let lane = QueueId::Lane(u8::try_from(st.lane_index?).ok()?);
    let parse = |q: &Option<String>| q.as_deref().and_then(|q| q.parse::<QueueId>().ok());
    match st.phase {
        LanePhase::Active | LanePhase::Retiring => Some(lane),
        LanePhase::Pausing | LanePhase::Draining | LanePhase::Repinning => {
            (parse(&st.source_queue) == Some(lane)).then_some(lane)
        }
        LanePhase::Scaling => (parse(&st.target_queue) == Some(lane)).then_some(lane),
        LanePhase::Pending | LanePhase::Retired | LanePhase::Failed => None,
    }
}

/// Lanes of a set, by the facts the ShardSet status needs: admitted count and
/// whether one waits for the cap.
/// How many of the set's lanes hold an index beyond `max_lanes` (retiring
/// because the cap was lowered).
pub fn over_cap_count(set: &str, lanes: &[DedicatedLane], max_lanes: i32) -> i32 {
    lanes
        .iter()
        .filter(|l| l.spec.shard_set == set)
        .filter_map(|l| l.status.as_ref().and_then(|s| s.lane_index))
        .filter(|i| over_cap(*i, max_lanes))
        .count() as i32
}

pub fn summary(set: &str, lanes: &[DedicatedLane]) -> (i32, bool) {
    let mine: Vec<&DedicatedLane> = lanes.iter().filter(|l| l.spec.shard_set == set).collect();
    let used = mine
        .iter()
        .filter(|l| l.status.as_ref().and_then(|s| s.lane_index).is_some())
        .count() as i32;
    let waiting = mine.iter().any(|l| waits_for_cap(l));
    (used, waiting)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn slot(name: &str, tenant: &str, index: Option<i32>, created: i64) -> LaneSlot {
        LaneSlot {
            name: name.into(),
            tenant: tenant.into(),
            index,
            waiting: index.is_none(),
            created: Some(Timestamp::from_second(1_000 + created).unwrap()),
        }
    }

    #[test]
    fn admission_gives_the_lowest_free_index_oldest_first() {
        let lanes = vec![
            slot("a", "ta", Some(0), 0),
            slot("b", "tb", Some(2), 1),
            slot("c", "tc", None, 5),
            slot("d", "td", None, 3),
        ];
        assert_eq!(admit("a", &lanes, 8), Ok(0));
        assert_eq!(admit("d", &lanes, 8), Ok(1));
        assert_eq!(admit("c", &lanes, 8), Ok(3));
        // Cap 3: one index free (1); d is older than c, so d gets it.
        assert_eq!(admit("d", &lanes, 3), Ok(1));
        assert_eq!(
            admit("c", &lanes, 3),
            Err(Refusal::LaneCapReached { used: 2, max: 3 })
        );
    }

    #[test]
    fn eight_admitted_the_ninth_waits_then_gets_the_freed_index() {
        let mut lanes: Vec<LaneSlot> = (0..8)
            .map(|i| slot(&format!("l{i}"), &format!("t{i}"), Some(i), i as i64))
            .collect();
        lanes.push(slot("l8", "t8", None, 9));
        assert_eq!(
            admit("l8", &lanes, 8),
            Err(Refusal::LaneCapReached { used: 8, max: 8 })
        );
        lanes[5].index = None; // retired
        lanes[5].waiting = false;
        assert_eq!(admit("l8", &lanes, 8), Ok(5));
        // maxLanes above 8 is clamped.
        assert_eq!(admit("l8", &lanes, 99), Ok(5));
    }

    #[test]
    fn one_tenant_one_lane() {
        let lanes = vec![slot("a", "whale", Some(0), 0), slot("b", "whale", None, 1)];
        assert_eq!(
            admit("b", &lanes, 8),
            Err(Refusal::DuplicateTenant("a".into()))
        );
    }

    #[test]
    fn the_set_counts_admitted_lanes_and_sees_one_waiting_for_the_cap() {
        let lane = |name: &str, set: &str, status: serde_json::Value| -> DedicatedLane {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "lanekeeper.io/v1alpha1",
                "kind": "DedicatedLane",
                "metadata": {"name": name},
                "spec": {"shardSet": set, "tenant": name},
                "status": status,
            }))
            .unwrap()
        };
        let cond = |reason: &str| {
            serde_json::json!([{"type": "Admitted", "status": "False", "reason": reason,
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}])
        };
        let lanes = vec![
            lane(
                "a",
                "hooks",
                serde_json::json!({"phase": "Active", "laneIndex": 0}),
            ),
            lane(
                "b",
                "hooks",
                serde_json::json!({"phase": "Draining", "laneIndex": 1}),
            ),
            lane(
                "c",
                "other",
                serde_json::json!({"phase": "Active", "laneIndex": 0}),
            ),
            lane(
                "d",
                "hooks",
                serde_json::json!({"phase": "Pending", "conditions": cond("DuplicateTenant")}),
            ),
        ];
        assert_eq!(summary("hooks", &lanes), (2, false));
        let mut lanes = lanes;
        lanes.push(lane(
            "e",
            "hooks",
            serde_json::json!({"phase": "Pending", "conditions": cond("LaneCapReached")}),
        ));
        assert_eq!(summary("hooks", &lanes), (2, true));
        assert_eq!(summary("other", &lanes), (1, false));
    }

    #[test]
    fn the_pin_a_lane_needs_follows_its_phase() {
        let st = |phase, source: Option<&str>, target: Option<&str>| DedicatedLaneStatus {
            phase,
            lane_index: Some(2),
            source_queue: source.map(str::to_string),
            target_queue: target.map(str::to_string),
            ..Default::default()
        };
        let lane = Some(QueueId::Lane(2));
        assert_eq!(
            pinned_lane(&st(LanePhase::Active, None, Some("lane-2"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Retiring, Some("lane-2"), Some("shard-01"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Draining, Some("lane-2"), Some("shard-01"))),
            lane
        );
        assert_eq!(
            pinned_lane(&st(LanePhase::Scaling, Some("shard-01"), Some("lane-2"))),
            lane
        );
        // Promoting and not yet repinned: the tenant is still on its shard.
        assert_eq!(
            pinned_lane(&st(LanePhase::Draining, Some("shard-01"), Some("lane-2"))),
            None
        );
        // Retired, or back on the shard and scaling the lane down.
        assert_eq!(
            pinned_lane(&st(LanePhase::Scaling, Some("lane-2"), Some("shard-01"))),
            None
        );
        assert_eq!(pinned_lane(&st(LanePhase::Retired, None, None)), None);
        assert_eq!(pinned_lane(&st(LanePhase::Pending, None, None)), None);
    }

    #[test]
    fn a_waiting_lane_is_woken_by_a_freed_slot_and_otherwise_backs_off() {
        let lane = |phase: LanePhase, index: Option<i32>, retire: bool| {
            let mut l = DedicatedLane::new(
                "l",
                crate::crd::DedicatedLaneSpec {
                    shard_set: "hooks".into(),
                    tenant: "t".into(),
                    worker: None,
                    retire,
                },
            );
            l.status = Some(DedicatedLaneStatus {
                phase,
                lane_index: index,
                ..Default::default()
            });
            l
        };
        assert!(waits_for_a_slot(&lane(LanePhase::Pending, None, false)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Pending, Some(0), false)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Pending, None, true)));
        assert!(!waits_for_a_slot(&lane(LanePhase::Active, Some(1), false)));
        assert!(frees_a_slot(&lane(LanePhase::Retired, None, false)));
        assert!(frees_a_slot(&lane(LanePhase::Active, Some(1), true)));
        assert!(!frees_a_slot(&lane(LanePhase::Active, Some(1), false)));
        let mut deleting = lane(LanePhase::Active, Some(1), false);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert!(frees_a_slot(&deleting));
        assert_eq!(admission_retry(Duration::ZERO), Duration::from_secs(5));
        assert_eq!(
            admission_retry(Duration::from_secs(40)),
            Duration::from_secs(40)
        );
        assert_eq!(
            admission_retry(Duration::from_secs(86_400)),
            Duration::from_secs(300)
        );
    }

    #[test]
    fn a_lane_waiting_for_a_reshard_says_so() {
        let st = DedicatedLaneStatus {
            phase: LanePhase::Pending,
            lane_index: Some(2),
            waiting_for_reshard: true,
            ..Default::default()
        };
        let c = conditions(&st, None, Some(1), 8);
        let r = c.iter().find(|c| c.type_ == "Relocating").unwrap();
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "WaitingForReshard")
        );
        assert!(moving(LanePhase::Draining) && moving(LanePhase::Retiring));
        assert!(
            !moving(LanePhase::Active)
                && !moving(LanePhase::Pending)
                && !moving(LanePhase::Retired)
        );
    }

    #[test]
    fn conditions_follow_the_phase() {
        let mut st = DedicatedLaneStatus {
            phase: LanePhase::Draining,
            lane_index: Some(2),
            source_queue: Some("shard-03".into()),
            target_queue: Some("lane-2".into()),
            ..Default::default()
        };
        let get = |cs: &[Condition], t: &str| {
            let c = cs.iter().find(|c| c.type_ == t).unwrap().clone();
            (c.status, c.reason)
        };
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Relocating"), ("True".into(), "Promoting".into()));
        assert_eq!(get(&cs, "Admitted"), ("True".into(), "UnderCap".into()));
        assert_eq!(get(&cs, "Ready"), ("False".into(), "Draining".into()));
        assert!(promoting(&st));

        st.phase = LanePhase::Pending;
        st.drain_attempts = 1;
        st.next_attempt_at = Some(Time(Timestamp::from_second(2_000).unwrap()));
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(
            get(&cs, "Relocating"),
            ("False".into(), "DrainTimeout".into())
        );

        st.phase = LanePhase::Active;
        st.next_attempt_at = None;
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Ready"), ("True".into(), "Active".into()));
        assert_eq!(get(&cs, "Relocating"), ("False".into(), "Idle".into()));

        st.phase = LanePhase::Retiring;
        st.source_queue = Some("lane-2".into());
        st.target_queue = Some("shard-03".into());
        assert!(!promoting(&st));
        let cs = conditions(&st, None, Some(1), 8);
        assert_eq!(get(&cs, "Relocating"), ("True".into(), "Retiring".into()));

        let waiting = DedicatedLaneStatus::default();
        let cs = conditions(
            &waiting,
            Some(&Refusal::LaneCapReached { used: 8, max: 8 }),
            Some(1),
            8,
        );
        assert_eq!(
            get(&cs, "Admitted"),
            ("False".into(), "LaneCapReached".into())
        );
    }

    #[test]
    fn a_lane_beyond_a_lowered_cap_says_so_and_counts() {
        assert!(over_cap(7, 2) && over_cap(2, 2) && !over_cap(1, 2));
        // maxLanes is clamped like admission clamps it.
        assert!(!over_cap(7, 99) && over_cap(0, 0) == over_cap(0, 1));
        let st = DedicatedLaneStatus {
            phase: LanePhase::Active,
            lane_index: Some(7),
            target_queue: Some("lane-7".into()),
            ..Default::default()
        };
        let cs = conditions(&st, None, Some(1), 2);
        let a = cs.iter().find(|c| c.type_ == "Admitted").unwrap();
        assert_eq!((a.status.as_str(), a.reason.as_str()), ("False", "OverCap"));
        assert!(!a.message.contains("lane 7 of 2"), "{}", a.message);

        let lane = |name: &str, index: i32| -> DedicatedLane {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "lanekeeper.io/v1alpha1",
                "kind": "DedicatedLane",
                "metadata": {"name": name},
                "spec": {"shardSet": "hooks", "tenant": name},
                "status": {"phase": "Active", "laneIndex": index},
            }))
            .unwrap()
        };
        let lanes: Vec<DedicatedLane> = (0..8).map(|i| lane(&format!("l{i}"), i)).collect();
        assert_eq!(over_cap_count("hooks", &lanes, 2), 6);
        assert_eq!(over_cap_count("hooks", &lanes, 8), 0);
        assert_eq!(over_cap_count("other", &lanes, 2), 0);
    }

    #[test]
    fn a_lane_with_zero_replicas_does_not_take_its_tenant() {
        let mut w: crate::crd::WorkerTemplate =
            serde_json::from_value(serde_json::json!({"image": "i"})).unwrap();
        assert!(has_workers(&w));
        w.replicas = Some(0);
        assert!(!has_workers(&w));
        w.replicas = None;
        w.autoscaled = true;
        assert!(has_workers(&w));
        let st = DedicatedLaneStatus {
            phase: LanePhase::Pending,
            lane_index: Some(1),
            ..Default::default()
        };
        let cs = conditions(&st, Some(&Refusal::NoWorkers), Some(1), 8);
        let a = cs.iter().find(|c| c.type_ == "Admitted").unwrap();
        assert_eq!(
            (a.status.as_str(), a.reason.as_str()),
            ("False", "NoWorkers")
        );
    }
}
