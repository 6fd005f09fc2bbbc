//! ShardSet status, computed from its Deployments and Redis (pure).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::crd::conditions;
use crate::crd::{ShardSet, ShardSetStatus, TenantShare};
use crate::routing::QueueId;
use crate::store::{RedisSettings, TenantStats};

/// What Redis said during this reconcile.
#[derive(Clone, Debug)]
pub struct RedisView {
    /// Per shard, tenant attribution over the promotion window.
    pub queues: Vec<(QueueId, Vec<TenantStats>)>,
    /// The server's (or every primary's) eviction and persistence settings,
    /// or why they could not be read.
    pub settings: Result<Vec<RedisSettings>, String>,
    /// Redis lost the set's state (routing table gone) and this reconcile
    /// restored it: what was restored.
    pub restored: Option<String>,
    /// The epoch mark Redis holds (see `ShardSetStatus::redis_epoch`).
    pub epoch: Option<String>,
}

impl Default for RedisView {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            settings: Ok(Vec::new()),
            restored: None,
            epoch: None,
        }
    }
}

/// Tenants listed in `status.topTenants`.
const TOP_TENANTS: usize = 10;

/// A condition, keeping `lastTransitionTime` unless `status` flips.
pub(crate) fn condition(
    prev: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    condition_maybe(prev, type_, Some(status), reason, message, generation)
}

/// [`condition`] whose status may be `Unknown` (`None`).
pub(crate) fn condition_maybe(
    prev: &[Condition],
    type_: &str,
    status: Option<bool>,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    let status = match status {
        Some(true) => "True",
        Some(false) => "False",
        None => "Unknown",
    }
    .to_string();
    let last = prev
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        last_transition_time: last,
        observed_generation: generation,
    }
}

/// A shard Deployment whose newest pods are all available.
pub fn shard_available(d: &Deployment) -> bool {
    let (Some(spec), Some(st)) = (&d.spec, &d.status) else {
        return false;
    };
    let desired = spec.replicas.unwrap_or(1);
    st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0)
        && st.updated_replicas.unwrap_or(0) == desired
        && st.available_replicas.unwrap_or(0) == desired
        && st.replicas.unwrap_or(0) == desired
}

/// Worker pods a Deployment asks for (the API's default is 1).
pub fn replicas_wanted(d: &Deployment) -> i32 {
    d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1)
}

/// A Deployment that is available and has at least one worker pod: its
/// queue is served. (Zero replicas are "available" to Kubernetes.)
pub fn serving(d: &Deployment) -> bool {
    shard_available(d) && replicas_wanted(d) > 0
}

/// The reason a Deployment has failed, if Kubernetes says it has: pods it
/// cannot create (`ReplicaFailure`, e.g. `FailedCreate` for a missing
/// service account or a quota), or a rollout past its progress deadline.
pub fn deployment_failure(d: &Deployment) -> Option<String> {
    let conditions = d.status.as_ref()?.conditions.as_ref()?;
    let failed = conditions
        .iter()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")
        .or_else(|| {
            conditions
                .iter()
                .find(|c| c.type_ == "Progressing" && c.status == "False")
        })?;
    Some(format!(
        "{}: {}",
        d.metadata.name.clone().unwrap_or_default(),
        failed
            .message
            .clone()
            .unwrap_or_else(|| failed.reason.clone().unwrap_or_default())
    ))
}

/// Status for shard Deployments the API server refused (the API's message).
pub fn deployment_rejected(set: &ShardSet, message: &str) -> ShardSetStatus {
    let mut st = invalid_spec(set, message);
    for c in &mut st.conditions {
        c.reason = conditions::DEPLOYMENT_FAILED.to_string();
    }
    st
}

/// Status for a spec the controller cannot serve.
pub fn invalid_spec(set: &ShardSet, message: &str) -> ShardSetStatus {
    refused(set, conditions::INVALID_SPEC, message)
}

/// Status for a spec the controller refuses, with the condition reason.
pub fn refused(set: &ShardSet, reason: &str, message: &str) -> ShardSetStatus {
    let prev = set.status.clone().unwrap_or_default();
    let generation = set.metadata.generation;
    ShardSetStatus {
        observed_generation: generation,
        conditions: vec![
            condition(
                &prev.conditions,
                conditions::READY,
                false,
                reason,
                message.to_string(),
                generation,
            ),
            condition(
                &prev.conditions,
                conditions::DEGRADED,
                true,
                reason,
                message.to_string(),
                generation,
            ),
            condition(
                &prev.conditions,
                conditions::PROGRESSING,
                false,
                reason,
                message.to_string(),
                generation,
            ),
        ],
        // Owned by the promotion loop's field manager.
        promotion_candidates: Vec::new(),
        demotion_candidates: Vec::new(),
        ..prev
    }
}

/// The set's DedicatedLanes as its status needs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lanes {
    /// Lanes holding an index under the cap.
    pub admitted: i32,
    /// A lane waits because the cap is reached.
    pub waiting_for_cap: bool,
    /// Lanes holding an index at or above `maxLanes` (it was lowered): they retire.
    pub over_cap: i32,
}

/// A shard-count change, as its status needs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReshardView {
    pub progress: Option<crate::crd::ReshardProgress>,
    /// The spec's new shards are not all available yet: nobody moves.
    pub waiting_for_shards: bool,
    /// DedicatedLanes still moving their tenants: the reshard waits for them
    /// (lane moves and reshards of one set take turns).
    pub waiting_for_lanes: Vec<String>,
    /// Tenants paused and draining now.
    pub draining: usize,
}

/// The `Resharding` condition's status, reason and message.
pub fn resharding(view: &ReshardView, desired: i32) -> (bool, &'static str, String) {
    if !view.waiting_for_lanes.is_empty() {
        return (
            true,
            conditions::WAITING_FOR_LANES,
            format!(
                "waiting for DedicatedLane {} to finish moving its tenant before any tenant moves to {desired} shards",
                view.waiting_for_lanes.join(", ")
            ),
        );
    }
    match (&view.progress, view.waiting_for_shards) {
        (None, false) => (false, conditions::IDLE, "no shard-count change under way".to_string()),
        (None, true) => (
            true,
            conditions::WAITING_FOR_SHARDS,
            format!("waiting for the {desired} shard Deployments to be available before any tenant moves"),
        ),
        (Some(p), true) => (
            true,
            conditions::WAITING_FOR_SHARDS,
            format!(
                "{} to {} shards: waiting for the {desired} shard Deployments to be available; moved {} of {} tenants",
                p.from_shards, p.to_shards, p.moved, p.to_move
            ),
        ),
        (Some(p), false) => (
            true,
            conditions::MOVING_TENANTS,
            format!(
                "{} to {} shards: moved {} of {} tenants ({} draining, {} failed and retrying)",
                p.from_shards, p.to_shards, p.moved, p.to_move, view.draining, p.failed
            ),
        ),
    }
}

/// Status from the shard Deployments (those of the spec's shards), the
/// lanes, what Redis said and the reshard under way.
pub fn compute(
    set: &ShardSet,
    deployments: &[&Deployment],
    lanes: Lanes,
    redis: Result<&RedisView, &String>,
    reshard: &ReshardView,
) -> ShardSetStatus {
    let prev = set.status.clone().unwrap_or_default();
    let generation = set.metadata.generation;
    let desired = set.spec.shards;
    let max_lanes = set.spec.promotion.max_lanes;
    // A shard with zero replicas is served by nobody: not ready, unless an
    // autoscaler owns the count (then `ScaledToZero` says so).
    let autoscaled = set.spec.worker.autoscaled;
    let ready = deployments
        .iter()
        .filter(|d| {
            if autoscaled {
                shard_available(d)
            } else {
                serving(d)
            }
        })
        .count() as i32;
    let unserved = deployments
        .iter()
        .filter(|d| replicas_wanted(d) == 0)
        .count() as i32;
    let rolling_out =
        deployments.iter().any(|d| !shard_available(d)) || (deployments.len() as i32) < desired;
    let failures: Vec<String> = deployments
        .iter()
        .filter_map(|d| deployment_failure(d))
        .collect();
    let all_ready = ready == desired && deployments.len() as i32 == desired;

    let eviction = redis.ok().and_then(|v| {
        v.settings
            .as_ref()
            .ok()?
            .iter()
            .find_map(|s| s.eviction_problem())
    });
    let (degraded, degraded_reason, degraded_message) = match (&redis, failures.first()) {
        (Err(e), _) => (true, conditions::REDIS_UNAVAILABLE, (*e).clone()),
        (Ok(_), _) if eviction.is_some() => (
            true,
            conditions::REDIS_EVICTION_POLICY,
            eviction.clone().unwrap_or_default(),
        ),
        (Ok(_), Some(f)) => (true, conditions::DEPLOYMENT_FAILED, f.clone()),
        (Ok(_), None) => (
            false,
            conditions::AS_EXPECTED,
            "shards and Redis are healthy".to_string(),
        ),
    };
    let (ready_reason, ready_message) = if redis.is_err() {
        (
            conditions::REDIS_UNAVAILABLE,
            "the routing table cannot be written while Redis is unreachable".to_string(),
        )
    } else if all_ready {
        (
            conditions::ALL_SHARDS_AVAILABLE,
            format!("{ready} of {desired} shards available"),
        )
    } else if unserved > 0 && !autoscaled {
        (
            conditions::NO_WORKERS,
            format!(
                "{ready} of {desired} shards available: {unserved} shard Deployments have 0 replicas, so nobody serves their queues (set worker.replicas to 1 or more, or worker.autoscaled)"
            ),
        )
    } else {
        (
            conditions::SHARDS_UNAVAILABLE,
            format!("{ready} of {desired} shards available"),
        )
    };
    let progressing = rolling_out && failures.is_empty();
    let conditions = vec![
        condition(
            &prev.conditions,
            conditions::READY,
            all_ready && redis.is_ok(),
            ready_reason,
            ready_message,
            generation,
        ),
        condition(
            &prev.conditions,
            conditions::PROGRESSING,
            progressing,
            if progressing {
                conditions::ROLLING_OUT
            } else {
                conditions::COMPLETE
            },
            if progressing {
                format!(
                    "{} of {desired} shard Deployments still rolling out",
                    desired - ready
                )
            } else {
                "no rollout under way".to_string()
            },
            generation,
        ),
        condition(
            &prev.conditions,
            conditions::DEGRADED,
            degraded,
            degraded_reason,
            degraded_message,
            generation,
        ),
        if lanes.over_cap > 0 {
            condition(
                &prev.conditions,
                conditions::LANE_CAP_REACHED,
                true,
                conditions::OVER_CAP,
                format!(
                    "{} lanes admitted but maxLanes is {max_lanes}: the {} lanes with an index of {max_lanes} or more are retiring to their hash shards and then wait for an index under the cap",
                    lanes.admitted, lanes.over_cap
                ),
                generation,
            )
        } else if lanes.waiting_for_cap {
            condition(
                &prev.conditions,
                conditions::LANE_CAP_REACHED,
                true,
                conditions::LANE_CAP_REACHED,
                format!(
                    "{} of {max_lanes} lanes admitted and another tenant waits for one: shape this set's ingest rather than adding lanes",
                    lanes.admitted
                ),
                generation,
            )
        } else {
            condition(
                &prev.conditions,
                conditions::LANE_CAP_REACHED,
                false,
                conditions::BELOW_CAP,
                format!("{} of {max_lanes} lanes admitted", lanes.admitted),
                generation,
            )
        },
        {
            let (on, reason, message) = resharding(reshard, desired);
            condition(
                &prev.conditions,
                conditions::RESHARDING,
                on,
                reason,
                message,
                generation,
            )
        },
    ];

    let mut conditions = conditions;
    if autoscaled {
        conditions.push(if unserved > 0 {
            condition(
                &prev.conditions,
                conditions::SCALED_TO_ZERO,
                true,
                conditions::AUTOSCALED_TO_ZERO,
                format!(
                    "the autoscaler left {unserved} of {desired} shards with 0 replicas: their queues wait until it scales them up"
                ),
                generation,
            )
        } else {
            condition(
                &prev.conditions,
                conditions::SCALED_TO_ZERO,
                false,
                conditions::SERVING,
                "every shard has at least one worker".to_string(),
                generation,
            )
        });
    }
    conditions.extend(redis_conditions(&prev.conditions, redis, generation));

    let (skew_ratio, top_tenants) = match redis {
        Ok(view) => attribution(view),
        // Keep the last figures while Redis is away.
        Err(_) => (prev.skew_ratio, prev.top_tenants.clone()),
    };
    ShardSetStatus {
        observed_generation: generation,
        conditions,
        shards_desired: desired,
        shards_ready: ready,
        ready_summary: Some(format!("{ready}/{desired}")),
        lanes_used: lanes.admitted,
        lanes_max: max_lanes,
        lane_summary: Some(format!("{}/{max_lanes}", lanes.admitted)),
        skew_ratio,
        top_tenants,
        // Owned by the promotion loop (its own field manager): left out here.
        promotion_candidates: Vec::new(),
        demotion_candidates: Vec::new(),
        resharding: reshard.progress.clone(),
        redis_epoch: match redis {
            Ok(view) => view.epoch.clone().or(prev.redis_epoch.clone()),
            Err(_) => prev.redis_epoch.clone(),
        },
    }
}

/// `RedisNotPersistent`, `RedisChecked` and `RedisStateLost`, from what
/// Redis said; while Redis is unreachable, the last ones stand.
fn redis_conditions(
    prev: &[Condition],
    redis: Result<&RedisView, &String>,
    generation: Option<i64>,
) -> Vec<Condition> {
    const TYPES: [&str; 3] = [
        conditions::REDIS_NOT_PERSISTENT,
        conditions::REDIS_CHECKED,
        conditions::REDIS_STATE_LOST,
    ];
    let view = match redis {
        Ok(v) => v,
        Err(_) => {
            return prev
                .iter()
                .filter(|c| TYPES.contains(&c.type_.as_str()))
                .cloned()
                .collect()
        }
    };
    let mut out = Vec::new();
    match &view.settings {
        Ok(all) if !all.is_empty() => {
            let worst = crate::store::worst_settings(all).expect("not empty");
            let (status, reason, message) = match worst.persistent() {
                Some(false) => (
                    Some(true),
                    conditions::NO_PERSISTENCE,
                    format!(
                        "{}: a restart of Redis loses every queued envelope; turn on AOF (appendonly yes) or RDB snapshots (save), or accept the risk",
                        worst.summary()
                    ),
                ),
                Some(true) => (Some(false), conditions::PERSISTENT, worst.summary()),
                None => (None, conditions::PERSISTENCE_UNKNOWN, worst.summary()),
            };
            out.push(condition_maybe(
                prev,
                conditions::REDIS_NOT_PERSISTENT,
                status,
                reason,
                message,
                generation,
            ));
            let refused = all.iter().find(|s| s.config_refused.is_some());
            let summaries: Vec<String> = all.iter().map(|s| s.summary()).collect();
            out.push(condition(
                prev,
                conditions::REDIS_CHECKED,
                refused.is_none(),
                if refused.is_none() {
                    conditions::CONFIG_GET
                } else {
                    conditions::CONFIG_GET_REFUSED
                },
                summaries.join("; "),
                generation,
            ));
        }
        Ok(_) => {}
        Err(e) => out.push(condition(
            prev,
            conditions::REDIS_CHECKED,
            false,
            conditions::READ_FAILED,
            format!("cannot read the Redis settings (CONFIG GET, INFO): {e}"),
            generation,
        )),
    }
    out.push(match &view.restored {
        Some(what) => condition(
            prev,
            conditions::REDIS_STATE_LOST,
            true,
            conditions::ROUTING_TABLE_MISSING,
            what.clone(),
            generation,
        ),
        None => condition(
            prev,
            conditions::REDIS_STATE_LOST,
            false,
            conditions::STATE_PRESENT,
            "the routing table and its epoch are in Redis".to_string(),
            generation,
        ),
    });
    out
}

/// Max over median of per-shard worker-seconds, and the tenants with the
/// largest share of their queue's worker-seconds.
pub fn attribution(view: &RedisView) -> (Option<f64>, Vec<TenantShare>) {
    let mut per_shard: Vec<f64> = view
        .queues
        .iter()
        .map(|(_, stats)| stats.iter().map(|t| t.worker_seconds).sum())
        .collect();
    per_shard.sort_by(f64::total_cmp);
    let skew = if per_shard.is_empty() {
        None
    } else {
        let n = per_shard.len();
        let median = if n % 2 == 1 {
            per_shard[n / 2]
        } else {
            (per_shard[n / 2 - 1] + per_shard[n / 2]) / 2.0
        };
        let max = per_shard[n - 1];
        (median > 0.0).then(|| ((max / median) * 100.0).round() / 100.0)
    };
    let mut top: Vec<TenantShare> = view
        .queues
        .iter()
        .flat_map(|(q, stats)| {
            let total: f64 = stats.iter().map(|t| t.worker_seconds).sum();
            stats
                .iter()
                .filter(|t| t.worker_seconds > 0.0 || t.depth > 0)
                .map(move |t| TenantShare {
                    tenant: t.tenant.clone(),
                    queue: q.to_string(),
                    share: if total > 0.0 {
                        ((t.worker_seconds / total) * 1000.0).round() / 1000.0
                    } else {
                        0.0
                    },
                    depth: t.depth as i64,
                })
        })
        .collect();
    top.sort_by(|a, b| b.share.total_cmp(&a.share).then(b.depth.cmp(&a.depth)));
    top.truncate(TOP_TENANTS);
    (skew, top)
}

/// A condition change worth an Event.
pub struct Transition {
    pub type_: String,
    pub warning: bool,
    pub reason: String,
    pub note: String,
}

/// Ready and Degraded conditions whose status changed.
pub fn transitions(before: &ShardSetStatus, after: &ShardSetStatus) -> Vec<Transition> {
    after
        .conditions
        .iter()
        .filter(|c| {
            matches!(
                c.type_.as_str(),
                conditions::READY
                    | conditions::DEGRADED
                    | conditions::LANE_CAP_REACHED
                    | conditions::RESHARDING
                    | conditions::REDIS_NOT_PERSISTENT
                    | conditions::REDIS_STATE_LOST
            )
        })
        .filter(|c| {
            let old = before.conditions.iter().find(|o| o.type_ == c.type_);
            old.map(|o| o.status != c.status)
                .unwrap_or(c.status == "True")
        })
        .map(|c| Transition {
            type_: c.type_.clone(),
            warning: match c.type_.as_str() {
                conditions::READY => c.status != "True",
                conditions::RESHARDING => false,
                _ => c.status == "True",
            },
            reason: c.reason.clone(),
            note: format!("{}={}: {}", c.type_, c.status, c.message),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reshard_waiting_for_lanes_says_which() {
        let view = ReshardView {
            waiting_for_lanes: vec!["whale".into()],
            ..Default::default()
        };
        let (on, reason, message) = resharding(&view, 6);
        assert!(on);
        assert_eq!(reason, "WaitingForLanes");
        assert!(message.contains("whale"), "{message}");
    }

    fn stats(pairs: &[(&str, f64)]) -> Vec<TenantStats> {
        pairs
            .iter()
            .map(|(t, s)| TenantStats {
                tenant: t.to_string(),
                worker_seconds: *s,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn skew_and_top_tenants() {
        let view = RedisView {
            queues: vec![
                (QueueId::Shard(0), stats(&[("whale", 90.0), ("a", 10.0)])),
                (QueueId::Shard(1), stats(&[("b", 20.0)])),
                (QueueId::Shard(2), stats(&[("c", 25.0)])),
            ],
            ..Default::default()
        };
        let (skew, top) = attribution(&view);
        // per shard 100, 20, 25: median 25, max 100
        assert_eq!(skew, Some(4.0));
        assert_eq!(top[0].tenant, "b");
        assert_eq!(top[0].share, 1.0);
        let whale = top.iter().find(|t| t.tenant == "whale").unwrap();
        assert_eq!((whale.queue.as_str(), whale.share), ("shard-00", 0.9));
    }

    fn a_set() -> ShardSet {
        serde_yaml::from_str(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {name: s, namespace: n}\nspec: {shards: 1, redis: {url: \"redis://r\"}, worker: {image: i}}\n",
        )
        .unwrap()
    }

    fn cond<'a>(st: &'a ShardSetStatus, t: &str) -> &'a Condition {
        st.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn redis_settings_become_conditions() {
        let set = a_set();
        let evicting = RedisSettings {
            via_config: true,
            maxmemory_policy: Some("allkeys-lru".into()),
            appendonly: Some(false),
            save: Some(String::new()),
            ..Default::default()
        };
        let view = RedisView {
            settings: Ok(vec![evicting]),
            ..Default::default()
        };
        let st = compute(
            &set,
            &[],
            Lanes::default(),
            Ok(&view),
            &ReshardView::default(),
        );
        let d = cond(&st, "Degraded");
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "RedisEvictionPolicy")
        );
        assert!(
            d.message.contains("maxmemory-policy allkeys-lru"),
            "{}",
            d.message
        );
        let p = cond(&st, "RedisNotPersistent");
        assert_eq!(
            (p.status.as_str(), p.reason.as_str()),
            ("True", "NoPersistence")
        );
        assert_eq!(cond(&st, "RedisChecked").status, "True");
        assert_eq!(cond(&st, "RedisStateLost").status, "False");

        // From INFO only: persistence unknown, and said.
        let info = RedisSettings {
            maxmemory_policy: Some("noeviction".into()),
            appendonly: Some(false),
            config_refused: Some("ERR unknown command 'CONFIG'".into()),
            ..Default::default()
        };
        let view = RedisView {
            settings: Ok(vec![info]),
            restored: Some("restored the lane pins acme→lane-1".into()),
            epoch: Some("e2".into()),
            ..Default::default()
        };
        let st = compute(
            &set,
            &[],
            Lanes::default(),
            Ok(&view),
            &ReshardView::default(),
        );
        assert_eq!(cond(&st, "Degraded").reason, "AsExpected");
        assert_eq!(cond(&st, "RedisNotPersistent").status, "Unknown");
        let c = cond(&st, "RedisChecked");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "ConfigGetRefused")
        );
        let l = cond(&st, "RedisStateLost");
        assert_eq!(
            (l.status.as_str(), l.message.as_str()),
            ("True", "restored the lane pins acme→lane-1")
        );
        assert_eq!(st.redis_epoch.as_deref(), Some("e2"));
        // Both warnings are Events when they turn on.
        let reasons: Vec<String> = transitions(&ShardSetStatus::default(), &st)
            .into_iter()
            .filter(|t| t.warning)
            .map(|t| t.type_)
            .collect();
        assert!(
            reasons.contains(&"RedisStateLost".to_string()),
            "{reasons:?}"
        );

        // Redis unreachable: the last Redis conditions and epoch stand.
        let mut with_prev = set.clone();
        with_prev.status = Some(st.clone());
        let err = "down".to_string();
        let st2 = compute(
            &with_prev,
            &[],
            Lanes::default(),
            Err(&err),
            &ReshardView::default(),
        );
        assert_eq!(cond(&st2, "RedisNotPersistent").status, "Unknown");
        assert_eq!(st2.redis_epoch.as_deref(), Some("e2"));
        assert_eq!(cond(&st2, "Degraded").reason, "RedisUnavailable");
    }

    #[test]
    fn last_transition_time_moves_only_on_a_flip() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap());
        let prev = vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: "AllShardsAvailable".into(),
            message: "4 of 4".into(),
            last_transition_time: t0.clone(),
            observed_generation: Some(1),
        }];
        let same = condition(
            &prev,
            "Ready",
            true,
            "AllShardsAvailable",
            "4 of 4".into(),
            Some(2),
        );
        assert_eq!(same.last_transition_time, t0);
        let flipped = condition(
            &prev,
            "Ready",
            false,
            "ShardsUnavailable",
            "3 of 4".into(),
            Some(2),
        );
        assert_ne!(flipped.last_transition_time, t0);
    }

    /// A shard Deployment as the API server reports it: `replicas` wanted,
    /// all of them available, with these status conditions.
    fn deployment(name: &str, replicas: i32, conditions: serde_json::Value) -> Deployment {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "generation": 1},
            "spec": {"replicas": replicas, "selector": {}, "template": {}},
            "status": {"observedGeneration": 1, "replicas": replicas,
                "updatedReplicas": replicas, "availableReplicas": replicas,
                "conditions": conditions},
        }))
        .unwrap()
    }

    fn compute_with(set: &ShardSet, ds: &[Deployment]) -> ShardSetStatus {
        let refs: Vec<&Deployment> = ds.iter().collect();
        compute(
            set,
            &refs,
            Lanes::default(),
            Ok(&RedisView::default()),
            &ReshardView::default(),
        )
    }

    #[test]
    fn zero_replicas_is_not_ready_unless_autoscaled() {
        let set = a_set();
        let st = compute_with(&set, &[deployment("s-shard-00", 0, serde_json::json!([]))]);
        let r = cond(&st, "Ready");
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "NoWorkers")
        );
        assert_eq!(st.ready_summary.as_deref(), Some("0/1"));
        // Nothing is rolling out either: it is simply not served.
        assert_eq!(cond(&st, "Progressing").status, "False");
        assert!(st.conditions.iter().all(|c| c.type_ != "ScaledToZero"));

        let st = compute_with(&set, &[deployment("s-shard-00", 2, serde_json::json!([]))]);
        assert_eq!(cond(&st, "Ready").status, "True");

        let mut auto = a_set();
        auto.spec.worker.autoscaled = true;
        let st = compute_with(&auto, &[deployment("s-shard-00", 0, serde_json::json!([]))]);
        assert_eq!(cond(&st, "Ready").status, "True");
        let z = cond(&st, "ScaledToZero");
        assert_eq!(
            (z.status.as_str(), z.reason.as_str()),
            ("True", "AutoscaledToZero")
        );
        let st = compute_with(&auto, &[deployment("s-shard-00", 3, serde_json::json!([]))]);
        assert_eq!(cond(&st, "ScaledToZero").status, "False");
    }

    #[test]
    fn pods_that_cannot_be_created_are_degraded() {
        let set = a_set();
        let failing = deployment(
            "s-shard-00",
            1,
            serde_json::json!([
                {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                 "message": "pods \"s-shard-00-x\" is forbidden: exceeded quota"},
            ]),
        );
        let mut failing = failing;
        failing.status.as_mut().unwrap().available_replicas = Some(0);
        let st = compute_with(&set, &[failing.clone()]);
        let d = cond(&st, "Degraded");
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "DeploymentFailed")
        );
        assert!(d.message.contains("exceeded quota"), "{}", d.message);
        assert_eq!(cond(&st, "Ready").status, "False");
        assert!(deployment_failure(&failing)
            .unwrap()
            .starts_with("s-shard-00: "));
        let healthy = deployment(
            "s-shard-00",
            1,
            serde_json::json!([
            {"type": "ReplicaFailure", "status": "False", "reason": "Recovered"}]),
        );
        assert_eq!(deployment_failure(&healthy), None);
    }

    #[test]
    fn a_rejected_deployment_says_so_with_the_api_message() {
        let mut set = a_set();
        set.metadata.generation = Some(4);
        let st = deployment_rejected(&set, "Deployment.apps \"s-shard-00\" is invalid: spec.template.spec.nodeSelector: Invalid value");
        assert_eq!(st.observed_generation, Some(4));
        for t in ["Ready", "Degraded", "Progressing"] {
            assert_eq!(cond(&st, t).reason, "DeploymentFailed");
            assert!(cond(&st, t).message.contains("nodeSelector"));
        }
        assert_eq!(cond(&st, "Degraded").status, "True");
        assert_eq!(cond(&st, "Ready").status, "False");
        // A new set's first status names the failure in an Event.
        let events = transitions(&ShardSetStatus::default(), &st);
        assert!(events
            .iter()
            .any(|t| t.type_ == "Degraded" && t.warning && t.reason == "DeploymentFailed"));
    }
}
