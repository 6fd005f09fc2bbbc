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

pub(crate) type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

pub(crate) fn wait_histogram() -> Histogram {
    // 1 ms to about 9 hours
    Histogram::new(exponential_buckets(0.001, 2.0, 25))
}

fn batch_histogram() -> Histogram {
    // 1 to 64 (`store::LEASE_BATCH_MAX`)
    Histogram::new(exponential_buckets(1.0, 2.0, 7))
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
    tenants: TenantLabeler,
    pub queue_wait: HistogramFamily<TenantLabels>,
    pub delivery_duration: HistogramFamily<OutcomeLabels>,
    pub deliveries: Family<OutcomeLabels, Counter>,
    pub breaker_changes: Family<BreakerLabels, Counter>,
    pub in_flight: Family<QueueLabels, Gauge>,
    /// Dead letters the queue's retention bound has dropped, all tenants, as
    /// the queue counts them in Redis (every worker of the queue reports the
    /// same figure: aggregate with `max by (queue)`).
    pub dead_letters_dropped: Family<QueueLabels, Gauge>,
    /// Tenants whose idle state this worker's sweep steps deleted
    /// (`scheduler.sweepIdleTenantsAfter`): sum over the queue's workers.
    pub tenants_swept: Family<QueueLabels, Counter>,
    /// Deliveries asked for per batched ack-and-lease call (the worker's
    /// free slots at the time; see `worker::batcher`).
    pub lease_batch: HistogramFamily<QueueLabels>,
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
        let tenants_swept = Family::<QueueLabels, Counter>::default();
        let lease_batch: HistogramFamily<QueueLabels> =
            Family::new_with_constructor(batch_histogram);
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
        registry.register(
            "lanekeeper_tenants_swept",
            "Idle tenants whose per-queue state this worker's sweep deleted (scheduler.sweepIdleTenantsAfter)",
            tenants_swept.clone(),
        );
        registry.register(
            "lanekeeper_lease_batch_size",
            "Deliveries asked for per batched ack-and-lease call to Redis (the worker's slots free at the time)",
            lease_batch.clone(),
        );
        Self {
            registry: Arc::new(registry),
            tenants: TenantLabeler::new(tenant_label_cap),
            queue_wait,
            delivery_duration,
            deliveries,
            breaker_changes,
            in_flight,
            dead_letters_dropped,
            tenants_swept,
            lease_batch,
        }
    }

    /// The label for `tenant`: itself while under the cap, else `other`.
    pub fn tenant_label(&self, tenant: &str) -> String {
        self.tenants.label(tenant)
    }
}

/// Per-tenant label values, capped: the first `cap` tenants seen get their
/// own label, the rest are `other`, so no tenant can grow a series set
/// without bound.
#[derive(Clone, Default)]
pub struct TenantLabeler {
    seen: Arc<Mutex<HashSet<String>>>,
    cap: usize,
}

impl TenantLabeler {
    pub fn new(cap: usize) -> Self {
        Self {
            seen: Arc::default(),
            cap,
        }
    }

    /// The label for `tenant`: itself while under the cap, else `other`.
    pub fn label(&self, tenant: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(tenant) {
            return tenant.to_string();
        }
        if seen.len() < self.cap {
            seen.insert(tenant.to_string());
            return tenant.to_string();
        }
        "other".to_string()
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IngestTenantLabels {
    pub tenant: String,
}

/// An admin operation on a tenant: which (`pause`, `resume`) and how it
/// ended (`changed`, `unchanged`, `failed`): a fixed label set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdminOperationLabels {
    pub operation: String,
    pub outcome: String,
}

/// Tenants the ingest's per-tenant series name before the rest are `other`.
pub const INGEST_TENANT_LABEL_CAP: usize = 100;

/// The ingest API's metrics.
#[derive(Clone)]
pub struct IngestMetrics {
    registry: Arc<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: HistogramFamily<RouteLabels>,
    pub envelopes: Family<EnvelopeLabels, Counter>,
    /// Envelopes refused because their tenant is shaped at ingest.
    pub shaped: Family<IngestTenantLabels, Counter>,
    /// Admin operations on tenants (each also a log line and an audit entry).
    pub admin_operations: Family<AdminOperationLabels, Counter>,
    tenants: TenantLabeler,
}

impl IngestMetrics {
    /// The label for `tenant` (capped at [`INGEST_TENANT_LABEL_CAP`]).
    pub fn tenant_label(&self, tenant: &str) -> String {
        self.tenants.label(tenant)
    }
}

impl Default for IngestMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let request_duration: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(duration_histogram);
        let envelopes = Family::<EnvelopeLabels, Counter>::default();
        let shaped = Family::<IngestTenantLabels, Counter>::default();
        let admin_operations = Family::<AdminOperationLabels, Counter>::default();
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
            "Envelopes posted to ingest by outcome (queued, held, duplicate, backlog_full, shaped, invalid)",
            envelopes.clone(),
        );
        registry.register(
            "lanekeeper_ingest_shaped",
            "Envelopes refused with 429 because their tenant is shaped at ingest (promotion.atCap: ShapeAtIngest), per tenant (capped; the rest are tenant=\"other\")",
            shaped.clone(),
        );
        registry.register(
            "lanekeeper_ingest_admin_operations",
            "Admin operations on tenants by operation (pause, resume) and outcome (changed, unchanged, failed); each is also logged and recorded in the set's audit trail",
            admin_operations.clone(),
        );
        Self {
            registry: Arc::new(registry),
            requests,
            request_duration,
            envelopes,
            shaped,
            admin_operations,
            tenants: TenantLabeler::new(INGEST_TENANT_LABEL_CAP),
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

pub(crate) fn encode_registry(registry: &Registry) -> String {
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
    fn tenant_labels_are_capped() {
        let m = WorkerMetrics::new(2);
        assert_eq!(m.tenant_label("a"), "a");
        assert_eq!(m.tenant_label("b"), "b");
        assert_eq!(m.tenant_label("c"), "other");
        assert_eq!(m.tenant_label("a"), "a");
    }
}
