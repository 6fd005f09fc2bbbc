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
    /// What the tier ConfigMap sync shows.
    pub tiers: Option<crate::crd::TierAssignmentsStatus>,
    /// Tenants a user paused, by queue.
    pub paused: Vec<(QueueId, String)>,
    /// What was applied of `spec.tenants`.
    pub overrides: Option<crate::crd::TenantOverridesStatus>,
}

impl Default for RedisView {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            settings: Ok(Vec::new()),
            restored: None,
            epoch: None,
            tiers: None,
            paused: Vec::new(),
            overrides: None,
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
        shaped_tenants: Vec::new(),
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
        shaped_tenants: Vec::new(),
        resharding: reshard.progress.clone(),
        redis_epoch: match redis {
            Ok(view) => view.epoch.clone().or(prev.redis_epoch.clone()),
            Err(_) => prev.redis_epoch.clone(),
        },
        tier_assignments: match redis {
            Ok(view) => view.tiers.clone(),
            Err(_) => prev.tier_assignments.clone(),
        },
        tenant_overrides: match redis {
            Ok(view) => view.overrides.clone(),
            Err(_) => prev.tenant_overrides.clone(),
        },
        paused_tenants: match redis {
            Ok(view) => paused_tenants(&view.paused),
            Err(_) => prev.paused_tenants.clone(),
        },
        tenants_paused: match redis {
            Ok(view) => (!view.paused.is_empty()).then_some(view.paused.len() as i32),
            Err(_) => prev.tenants_paused,
        },
    }
}

/// The first [`MAX_PAUSED_LISTED`] paused tenants by name. Pure.
pub fn paused_tenants(paused: &[(QueueId, String)]) -> Vec<crate::crd::PausedTenant> {
    let mut out: Vec<crate::crd::PausedTenant> = paused
        .iter()
        .map(|(q, t)| crate::crd::PausedTenant {
            tenant: t.clone(),
            queue: q.to_string(),
        })
        .collect();
    out.sort_by(|a, b| a.tenant.cmp(&b.tenant).then(a.queue.cmp(&b.queue)));
    out.truncate(MAX_PAUSED_LISTED);
    out
}

/// Paused tenants `status.pausedTenants` lists (its CRD bound).
pub const MAX_PAUSED_LISTED: usize = 64;

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
    let per_shard: Vec<f64> = view
        .queues
        .iter()
        .map(|(_, stats)| stats.iter().map(|t| t.worker_seconds).sum())
        .collect();
    let skew = crate::policy::attribution::skew(&per_shard).map(|s| (s * 100.0).round() / 100.0);
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
#[path = "status_tests.rs"]
mod tests;
