//! Metrics, logs and health endpoints.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Install the global tracing subscriber; `RUST_LOG` filters (default `info`).
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub queue: String,
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub queue: String,
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BreakerLabels {
    pub queue: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn wait_histogram() -> Histogram {
    // 1 ms to about 9 hours
    Histogram::new(exponential_buckets(0.001, 2.0, 25))
}

fn duration_histogram() -> Histogram {
    // 1 ms to about 65 s
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The worker's metrics. Per-tenant series are capped: the first
/// `tenant_label_cap` tenants seen get their own label, the rest are `other`.
#[derive(Clone)]
pub struct WorkerMetrics {
    registry: Arc<Registry>,
    tenants: Arc<Mutex<HashSet<String>>>,
    tenant_label_cap: usize,
    pub queue_wait: HistogramFamily<TenantLabels>,
    pub delivery_duration: HistogramFamily<OutcomeLabels>,
    pub deliveries: Family<OutcomeLabels, Counter>,
    pub breaker_changes: Family<BreakerLabels, Counter>,
    pub in_flight: Family<QueueLabels, Gauge>,
    /// Dead letters the queue's retention bound has dropped, all tenants, as
    /// the queue counts them in Redis (every worker of the queue reports the
    /// same figure: aggregate with `max by (queue)`).
    pub dead_letters_dropped: Family<QueueLabels, Gauge>,
}

impl WorkerMetrics {
    pub fn new(tenant_label_cap: usize) -> Self {
        let mut registry = Registry::default();
        let queue_wait: HistogramFamily<TenantLabels> =
            Family::new_with_constructor(wait_histogram);
        let delivery_duration: HistogramFamily<OutcomeLabels> =
            Family::new_with_constructor(duration_histogram);
        let deliveries = Family::<OutcomeLabels, Counter>::default();
        let breaker_changes = Family::<BreakerLabels, Counter>::default();
        let in_flight = Family::<QueueLabels, Gauge>::default();
        let dead_letters_dropped = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "lanekeeper_queue_wait_seconds",
            "Time from enqueue to lease, per tenant (capped; the rest are tenant=\"other\")",
            queue_wait.clone(),
        );
        registry.register(
            "lanekeeper_delivery_duration_seconds",
            "HTTP delivery time by outcome class",
            delivery_duration.clone(),
        );
        registry.register(
            "lanekeeper_deliveries",
            "Delivery attempts by outcome class",
            deliveries.clone(),
        );
        registry.register(
            "lanekeeper_breaker_transitions",
            "Circuit breaker state changes seen by this worker",
            breaker_changes.clone(),
        );
        registry.register(
            "lanekeeper_in_flight",
            "Deliveries in flight",
            in_flight.clone(),
        );
        registry.register(
            "lanekeeper_dead_letters_dropped",
            "Dead letters the queue's retention bound (delivery.deadLetters) has dropped, all tenants; read from Redis",
            dead_letters_dropped.clone(),
        );
        Self {
            registry: Arc::new(registry),
            tenants: Arc::default(),
            tenant_label_cap,
            queue_wait,
            delivery_duration,
            deliveries,
            breaker_changes,
            in_flight,
            dead_letters_dropped,
        }
    }

    /// The label for `tenant`: itself while under the cap, else `other`.
    pub fn tenant_label(&self, tenant: &str) -> String {
        let mut seen = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(tenant) {
            return tenant.to_string();
        }
        if seen.len() < self.tenant_label_cap {
            seen.insert(tenant.to_string());
            return tenant.to_string();
        }
        "other".to_string()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
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
    lanes: Vec<LaneLabels>,
    lane_conditions: Vec<LaneConditionLabels>,
}

/// The controller's metrics.
#[derive(Clone)]
pub struct ControllerMetrics {
    registry: Arc<Registry>,
    pub reconciles: Counter,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub shards: Family<SetLabels, Gauge>,
    pub lanes_used: Family<SetLabels, Gauge>,
    pub lanes_max: Family<SetLabels, Gauge>,
    pub queue_depth: Family<QueueDepthLabels, Gauge>,
    pub skew_ratio: Family<SetLabels, FloatGauge>,
    pub conditions: Family<ConditionLabels, Gauge>,
    pub tenant_share: Family<TenantShareLabels, FloatGauge>,
    pub lane_phase: Family<LaneLabels, Gauge>,
    pub lane_conditions: Family<LaneConditionLabels, Gauge>,
    pub reshard_moves: Family<SetLabels, Counter>,
    pub reshard_pause: HistogramFamily<SetLabels>,
    published: Arc<Mutex<std::collections::HashMap<SetLabels, Published>>>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let shards = Family::<SetLabels, Gauge>::default();
        let lanes_used = Family::<SetLabels, Gauge>::default();
        let queue_depth = Family::<QueueDepthLabels, Gauge>::default();
        registry.register(
            "lanekeeper_queue_depth",
            "Envelopes outstanding per queue (queued, held, delayed or in flight), as of the last reconcile",
            queue_depth.clone(),
        );
        registry.register(
            "lanekeeper_reconciles",
            "ShardSet reconciles run",
            reconciles.clone(),
        );
        registry.register(
            "lanekeeper_reconcile_errors",
            "Failed reconciles by kind",
            reconcile_errors.clone(),
        );
        registry.register(
            "lanekeeper_reconcile_duration_seconds",
            "Time per ShardSet reconcile",
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
            skew_ratio,
            conditions,
            tenant_share,
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

impl ControllerMetrics {
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
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let entry = published.entry(key).or_default();
        for gone in entry.shares.iter().filter(|l| !shares.contains(l)) {
            self.tenant_share.remove(gone);
        }
        entry.shares = shares;
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

/// Something that renders Prometheus text.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EnvelopeLabels {
    pub outcome: String,
}

/// The ingest API's metrics.
#[derive(Clone)]
pub struct IngestMetrics {
    registry: Arc<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: HistogramFamily<RouteLabels>,
    pub envelopes: Family<EnvelopeLabels, Counter>,
}

impl Default for IngestMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let request_duration: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(duration_histogram);
        let envelopes = Family::<EnvelopeLabels, Counter>::default();
        registry.register(
            "lanekeeper_ingest_requests",
            "Ingest API requests by route and status code",
            requests.clone(),
        );
        registry.register(
            "lanekeeper_ingest_request_duration_seconds",
            "Ingest API request latency by route",
            request_duration.clone(),
        );
        registry.register(
            "lanekeeper_ingest_envelopes",
            "Envelopes posted to ingest by outcome (queued, held, duplicate, backlog_full, invalid)",
            envelopes.clone(),
        );
        Self {
            registry: Arc::new(registry),
            requests,
            request_duration,
            envelopes,
        }
    }
}

impl Encode for IngestMetrics {
    fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}

pub trait Encode: Clone + Send + Sync + 'static {
    fn encode(&self) -> String;
}

impl Encode for WorkerMetrics {
    fn encode(&self) -> String {
        encode_registry(&self.registry)
    }
}

fn encode_registry(registry: &Registry) -> String {
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// The `/metrics` route of every component: `metrics` in the OpenMetrics
/// text format.
pub fn metrics_route<S: Clone + Send + Sync + 'static>(
    metrics: impl Encode,
) -> axum::routing::MethodRouter<S> {
    axum::routing::get(move || {
        let m = metrics.clone();
        async move {
            (
                [(
                    "content-type",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                m.encode(),
            )
        }
    })
}

/// Serve `/metrics`, `/healthz` and `/readyz` on `addr` until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    metrics: impl Encode,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<SocketAddr> {
    use axum::routing::get;
    let app = axum::Router::new()
        .route("/metrics", metrics_route(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await;
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        m.record_status("prod", "hooks", &st);
        let text = m.encode();
        assert!(!text.contains("tenant=\"whale\""), "{text}");
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

    #[test]
    fn tenant_labels_are_capped() {
        let m = WorkerMetrics::new(2);
        assert_eq!(m.tenant_label("a"), "a");
        assert_eq!(m.tenant_label("b"), "b");
        assert_eq!(m.tenant_label("c"), "other");
        assert_eq!(m.tenant_label("a"), "a");
    }
}
