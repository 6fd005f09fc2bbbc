//! The controller's metrics: reconciles per controller, and what each
//! ShardSet's and DedicatedLane's status says, as series that come and go
//! with the tenants and lanes they describe. Served by
//! [`crate::telemetry::serve`].

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::telemetry::{encode_registry, wait_histogram, Encode, HistogramFamily};

/// The `controller` label of the ShardSet reconciler's series.
pub const SHARDSET: &str = "shardset";
/// The `controller` label of the DedicatedLane reconciler's series.
pub const DEDICATED_LANE: &str = "dedicatedlane";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcilerLabels {
    /// [`SHARDSET`] or [`DEDICATED_LANE`].
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SetLabels {
    pub namespace: String,
    pub shard_set: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueDepthLabels {
    pub namespace: String,
    pub shard_set: String,
    pub queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    pub namespace: String,
    pub shard_set: String,
    pub condition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantShareLabels {
    pub namespace: String,
    pub shard_set: String,
    pub queue: String,
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaneLabels {
    pub namespace: String,
    pub shard_set: String,
    pub lane: String,
    pub tenant: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LaneConditionLabels {
    pub namespace: String,
    pub shard_set: String,
    pub lane: String,
    pub condition: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Series a ShardSet published last time whose labels come and go (tenants
/// in the top list, lanes), so that the ones gone are removed, not frozen.
#[derive(Default)]
struct Published {
    shares: Vec<TenantShareLabels>,
    paused: Vec<TenantShareLabels>,
    lanes: Vec<LaneLabels>,
    lane_conditions: Vec<LaneConditionLabels>,
}

/// The controller's metrics.
#[derive(Clone)]
pub struct ControllerMetrics {
    registry: Arc<Registry>,
    pub reconciles: Family<ReconcilerLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: HistogramFamily<ReconcilerLabels>,
    pub shards: Family<SetLabels, Gauge>,
    pub lanes_used: Family<SetLabels, Gauge>,
    pub lanes_max: Family<SetLabels, Gauge>,
    pub queue_depth: Family<QueueDepthLabels, Gauge>,
    pub queue_backlog: Family<QueueDepthLabels, FloatGauge>,
    pub queue_drain: Family<QueueDepthLabels, FloatGauge>,
    pub queue_fairness: Family<QueueDepthLabels, FloatGauge>,
    pub skew_ratio: Family<SetLabels, FloatGauge>,
    pub conditions: Family<ConditionLabels, Gauge>,
    pub tenant_share: Family<TenantShareLabels, FloatGauge>,
    pub tenant_paused: Family<TenantShareLabels, Gauge>,
    pub tenants_paused: Family<SetLabels, Gauge>,
    pub lane_phase: Family<LaneLabels, Gauge>,
    pub lane_conditions: Family<LaneConditionLabels, Gauge>,
    pub reshard_moves: Family<SetLabels, Counter>,
    pub reshard_pause: HistogramFamily<SetLabels>,
    published: Arc<Mutex<std::collections::HashMap<SetLabels, Published>>>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ReconcilerLabels, Counter>::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let reconcile_duration: HistogramFamily<ReconcilerLabels> =
            Family::new_with_constructor(reconcile_histogram);
        let shards = Family::<SetLabels, Gauge>::default();
        let lanes_used = Family::<SetLabels, Gauge>::default();
        let queue_depth = Family::<QueueDepthLabels, Gauge>::default();
        registry.register(
            "lanekeeper_queue_depth",
            "Envelopes outstanding per queue (queued, held, delayed or in flight), as of the last reconcile",
            queue_depth.clone(),
        );
        let queue_backlog = Family::<QueueDepthLabels, FloatGauge>::default();
        registry.register(
            "lanekeeper_queue_backlog_worker_seconds",
            "Worker-seconds of work outstanding per queue: each tenant's outstanding envelopes at its measured mean delivery cost, as of the last reconcile",
            queue_backlog.clone(),
        );
        let queue_drain = Family::<QueueDepthLabels, FloatGauge>::default();
        registry.register(
            "lanekeeper_queue_drain_seconds",
            "Estimated time to drain per queue: its backlog in worker-seconds over the worker-seconds per second it delivered in the last 30 s (at least 1; paused tenants left out), as of the last reconcile",
            queue_drain.clone(),
        );
        let queue_fairness = Family::<QueueDepthLabels, FloatGauge>::default();
        registry.register(
            "lanekeeper_queue_fairness_index",
            "Jain's index per queue over the tenants waiting for a slot of their worker-seconds per second in the last 30 s over their weights: 1 all equal, 1/n one had it all (1 with fewer than two waiting), as of the last reconcile",
            queue_fairness.clone(),
        );
        registry.register(
            "lanekeeper_reconciles",
            "Reconciles run, per controller (shardset, dedicatedlane)",
            reconciles.clone(),
        );
        registry.register(
            "lanekeeper_reconcile_errors",
            "Failed reconciles, per controller and kind",
            reconcile_errors.clone(),
        );
        registry.register(
            "lanekeeper_reconcile_duration_seconds",
            "Time per reconcile, per controller",
            reconcile_duration.clone(),
        );
        registry.register("lanekeeper_shards", "Shards per ShardSet", shards.clone());
        registry.register(
            "lanekeeper_lanes_used",
            "Dedicated lanes admitted per ShardSet",
            lanes_used.clone(),
        );
        let lanes_max = Family::<SetLabels, Gauge>::default();
        let skew_ratio = Family::<SetLabels, FloatGauge>::default();
        let conditions = Family::<ConditionLabels, Gauge>::default();
        let tenant_share = Family::<TenantShareLabels, FloatGauge>::default();
        let lane_phase = Family::<LaneLabels, Gauge>::default();
        let lane_conditions = Family::<LaneConditionLabels, Gauge>::default();
        let tenant_paused = Family::<TenantShareLabels, Gauge>::default();
        let tenants_paused = Family::<SetLabels, Gauge>::default();
        registry.register(
            "lanekeeper_tenant_paused",
            "1 for each tenant a user paused (status.pausedTenants: at most 64 per ShardSet)",
            tenant_paused.clone(),
        );
        registry.register(
            "lanekeeper_tenants_paused",
            "Tenants a user paused per ShardSet, all queues (status.tenantsPaused)",
            tenants_paused.clone(),
        );
        registry.register(
            "lanekeeper_lanes_max",
            "Dedicated lane cap per ShardSet (spec.promotion.maxLanes)",
            lanes_max.clone(),
        );
        registry.register(
            "lanekeeper_skew_ratio",
            "Max over median of per-shard worker-seconds over the promotion window (status.skewRatio)",
            skew_ratio.clone(),
        );
        registry.register(
            "lanekeeper_shardset_condition",
            "ShardSet status conditions: 1 when True, 0 otherwise",
            conditions.clone(),
        );
        registry.register(
            "lanekeeper_tenant_capacity_share",
            "Share of its queue's worker-seconds over the window, for the ShardSet's top tenants (status.topTenants)",
            tenant_share.clone(),
        );
        registry.register(
            "lanekeeper_lane_phase",
            "DedicatedLane relocation phase: 1 for the lane's current phase, 0 for the others",
            lane_phase.clone(),
        );
        registry.register(
            "lanekeeper_lane_condition",
            "DedicatedLane status conditions: 1 when True, 0 otherwise",
            lane_conditions.clone(),
        );
        let reshard_moves = Family::<SetLabels, Counter>::default();
        let reshard_pause: HistogramFamily<SetLabels> =
            Family::new_with_constructor(wait_histogram);
        registry.register(
            "lanekeeper_reshard_moves",
            "Tenants moved to their new hash queue by reshards",
            reshard_moves.clone(),
        );
        registry.register(
            "lanekeeper_reshard_pause_seconds",
            "Per tenant moved by a reshard: time from its pause to its resume on the new queue",
            reshard_pause.clone(),
        );
        Self {
            registry: Arc::new(registry),
            reconciles,
            reconcile_errors,
            reconcile_duration,
            shards,
            lanes_used,
            lanes_max,
            queue_depth,
            queue_backlog,
            queue_drain,
            queue_fairness,
            skew_ratio,
            conditions,
            tenant_share,
            tenant_paused,
            tenants_paused,
            lane_phase,
            lane_conditions,
            reshard_moves,
            reshard_pause,
            published: Arc::default(),
        }
    }
}

/// Every DedicatedLane phase, as `status.phase` spells it.
const LANE_PHASES: [&str; 9] = [
    "Pending",
    "Pausing",
    "Draining",
    "Repinning",
    "Scaling",
    "Active",
    "Retiring",
    "Retired",
    "Failed",
];

/// What the controller knows of one DedicatedLane, for its metrics.
#[derive(Clone, Debug)]
pub struct LaneView {
    pub name: String,
    pub tenant: String,
    pub phase: String,
    /// Condition type and whether it is True.
    pub conditions: Vec<(String, bool)>,
}

fn reconcile_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

impl ControllerMetrics {
    /// Export one queue's depth, backlog, drain time and fairness.
    pub fn record_queue(
        &self,
        labels: &QueueDepthLabels,
        depth: u64,
        health: &crate::policy::attribution::QueueHealth,
    ) {
        self.queue_depth.get_or_create(labels).set(depth as i64);
        self.queue_backlog
            .get_or_create(labels)
            .set(health.backlog_worker_seconds);
        self.queue_drain
            .get_or_create(labels)
            .set(health.drain_seconds);
        self.queue_fairness
            .get_or_create(labels)
            .set(health.fairness);
    }

    /// Drop one queue's series (a lane queue no tenant uses).
    pub fn forget_queue(&self, labels: &QueueDepthLabels) {
        self.queue_depth.remove(labels);
        self.queue_backlog.remove(labels);
        self.queue_drain.remove(labels);
        self.queue_fairness.remove(labels);
    }

    /// One reconcile by `controller` ([`SHARDSET`], [`DEDICATED_LANE`]) ran for `took`.
    pub fn reconciled(&self, controller: &str, took: std::time::Duration) {
        let labels = ReconcilerLabels {
            controller: controller.to_string(),
        };
        self.reconciles.get_or_create(&labels).inc();
        self.reconcile_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// One reconcile by `controller` failed with an error of `kind`.
    pub fn reconcile_failed(&self, controller: &str, kind: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                controller: controller.to_string(),
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Export what a ShardSet's status says: conditions, lanes against the
    /// cap, skew and the top tenants' capacity shares.
    pub fn record_status(&self, namespace: &str, set: &str, st: &crate::crd::ShardSetStatus) {
        let key = SetLabels {
            namespace: namespace.to_string(),
            shard_set: set.to_string(),
        };
        self.lanes_used
            .get_or_create(&key)
            .set(st.lanes_used as i64);
        self.lanes_max.get_or_create(&key).set(st.lanes_max as i64);
        match st.skew_ratio {
            Some(skew) => {
                self.skew_ratio.get_or_create(&key).set(skew);
            }
            None => {
                self.skew_ratio.remove(&key);
            }
        }
        for c in &st.conditions {
            let labels = ConditionLabels {
                namespace: namespace.to_string(),
                shard_set: set.to_string(),
                condition: c.type_.clone(),
            };
            self.conditions
                .get_or_create(&labels)
                .set(i64::from(c.status == "True"));
        }
        let shares: Vec<TenantShareLabels> = st
            .top_tenants
            .iter()
            .map(|t| {
                let labels = TenantShareLabels {
                    namespace: namespace.to_string(),
                    shard_set: set.to_string(),
                    queue: t.queue.clone(),
                    tenant: t.tenant.clone(),
                };
                self.tenant_share.get_or_create(&labels).set(t.share);
                labels
            })
            .collect();
        let paused: Vec<TenantShareLabels> = st
            .paused_tenants
            .iter()
            .map(|t| {
                let labels = TenantShareLabels {
                    namespace: namespace.to_string(),
                    shard_set: set.to_string(),
                    queue: t.queue.clone(),
                    tenant: t.tenant.clone(),
                };
                self.tenant_paused.get_or_create(&labels).set(1);
                labels
            })
            .collect();
        self.tenants_paused
            .get_or_create(&key)
            .set(st.tenants_paused.unwrap_or(0) as i64);
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let entry = published.entry(key).or_default();
        for gone in entry.shares.iter().filter(|l| !shares.contains(l)) {
            self.tenant_share.remove(gone);
        }
        entry.shares = shares;
        for gone in entry.paused.iter().filter(|l| !paused.contains(l)) {
            self.tenant_paused.remove(gone);
        }
        entry.paused = paused;
    }

    /// Export each DedicatedLane of a ShardSet: its phase (1 for the current
    /// one, 0 for the rest) and its conditions. Lanes no longer listed are removed.
    pub fn record_lanes(&self, namespace: &str, set: &str, lanes: &[LaneView]) {
        let mut phases = Vec::new();
        let mut conditions = Vec::new();
        for lane in lanes {
            for phase in LANE_PHASES {
                let labels = LaneLabels {
                    namespace: namespace.to_string(),
                    shard_set: set.to_string(),
                    lane: lane.name.clone(),
                    tenant: lane.tenant.clone(),
                    phase: phase.to_string(),
                };
                self.lane_phase
                    .get_or_create(&labels)
                    .set(i64::from(lane.phase == phase));
                phases.push(labels);
            }
            for (condition, status) in &lane.conditions {
                let labels = LaneConditionLabels {
                    namespace: namespace.to_string(),
                    shard_set: set.to_string(),
                    lane: lane.name.clone(),
                    condition: condition.clone(),
                };
                self.lane_conditions
                    .get_or_create(&labels)
                    .set(i64::from(*status));
                conditions.push(labels);
            }
        }
        let key = SetLabels {
            namespace: namespace.to_string(),
            shard_set: set.to_string(),
        };
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let entry = published.entry(key).or_default();
        for gone in entry.lanes.iter().filter(|l| !phases.contains(l)) {
            self.lane_phase.remove(gone);
        }
        for gone in entry
            .lane_conditions
            .iter()
            .filter(|l| !conditions.contains(l))
        {
            self.lane_conditions.remove(gone);
        }
        entry.lanes = phases;
        entry.lane_conditions = conditions;
    }
}

impl Encode for ControllerMetrics {
    fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queues_health_series_come_and_go_together() {
        let m = ControllerMetrics::default();
        let labels = QueueDepthLabels {
            namespace: "webhooks".into(),
            shard_set: "webhooks".into(),
            queue: "lane-3".into(),
        };
        let health = crate::policy::attribution::QueueHealth {
            backlog_worker_seconds: 120.0,
            served_rate: 4.0,
            drain_seconds: 30.0,
            fairness: 0.5,
            contending: 2,
        };
        m.record_queue(&labels, 600, &health);
        let text = m.encode();
        for want in [
            r#"lanekeeper_queue_depth{namespace="webhooks",shard_set="webhooks",queue="lane-3"} 600"#,
            r#"lanekeeper_queue_backlog_worker_seconds{namespace="webhooks",shard_set="webhooks",queue="lane-3"} 120.0"#,
            r#"lanekeeper_queue_drain_seconds{namespace="webhooks",shard_set="webhooks",queue="lane-3"} 30.0"#,
            r#"lanekeeper_queue_fairness_index{namespace="webhooks",shard_set="webhooks",queue="lane-3"} 0.5"#,
        ] {
            assert!(text.contains(want), "missing {want}:\n{text}");
        }
        m.forget_queue(&labels);
        assert!(!m.encode().contains("lane-3"), "{}", m.encode());
    }

    #[test]
    fn status_and_lane_series_follow_what_is_current() {
        let m = ControllerMetrics::default();
        let mut st = crate::crd::ShardSetStatus {
            lanes_used: 1,
            lanes_max: 8,
            skew_ratio: Some(3.5),
            top_tenants: vec![crate::crd::TenantShare {
                tenant: "whale".into(),
                queue: "shard-01".into(),
                share: 0.75,
                depth: 10,
            }],
            ..Default::default()
        };
        m.record_status("prod", "hooks", &st);
        let text = m.encode();
        assert!(
            text.contains(r#"lanekeeper_skew_ratio{namespace="prod",shard_set="hooks"} 3.5"#),
            "{text}"
        );
        assert!(text.contains(r#"lanekeeper_tenant_capacity_share{namespace="prod",shard_set="hooks",queue="shard-01",tenant="whale"} 0.75"#), "{text}");
        assert!(
            text.contains(r#"lanekeeper_lanes_max{namespace="prod",shard_set="hooks"} 8"#),
            "{text}"
        );
        st.top_tenants.clear();
        st.skew_ratio = None;
        st.paused_tenants = vec![crate::crd::PausedTenant {
            tenant: "flaky".into(),
            queue: "shard-02".into(),
        }];
        st.tenants_paused = Some(1);
        m.record_status("prod", "hooks", &st);
        let text = m.encode();
        assert!(!text.contains("tenant=\"whale\""), "{text}");
        assert!(text.contains(r#"lanekeeper_tenant_paused{namespace="prod",shard_set="hooks",queue="shard-02",tenant="flaky"} 1"#), "{text}");
        assert!(
            text.contains(r#"lanekeeper_tenants_paused{namespace="prod",shard_set="hooks"} 1"#),
            "{text}"
        );
        st.paused_tenants.clear();
        st.tenants_paused = None;
        m.record_status("prod", "hooks", &st);
        let text = m.encode();
        assert!(!text.contains("flaky"), "{text}");
        assert!(
            text.contains(r#"lanekeeper_tenants_paused{namespace="prod",shard_set="hooks"} 0"#),
            "{text}"
        );
        assert!(!text.contains("lanekeeper_skew_ratio{"), "{text}");

        let lane = LaneView {
            name: "hooks-whale".into(),
            tenant: "whale".into(),
            phase: "Draining".into(),
            conditions: vec![("Admitted".into(), true)],
        };
        m.record_lanes("prod", "hooks", std::slice::from_ref(&lane));
        let text = m.encode();
        assert!(
            text.contains(r#"lane="hooks-whale",tenant="whale",phase="Draining"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"lane="hooks-whale",tenant="whale",phase="Active"} 0"#),
            "{text}"
        );
        assert!(text.contains(r#"lanekeeper_lane_condition{namespace="prod",shard_set="hooks",lane="hooks-whale",condition="Admitted"} 1"#), "{text}");
        m.record_lanes("prod", "hooks", &[]);
        let text = m.encode();
        assert!(!text.contains("hooks-whale"), "{text}");
    }
}
