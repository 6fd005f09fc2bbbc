//! `lanekeeper ingest`: the flags of the ingest API server, turned into
//! `ingest::Config`, and its start.

use std::path::PathBuf;

use anyhow::Context;

use super::redis::RedisTarget;
use super::shutdown::Shutdown;

#[derive(clap::Args, Debug)]
pub struct IngestArgs {
    #[command(flatten)]
    target: RedisTarget,
    /// Address to serve the API (and /metrics, /healthz, /readyz) on.
    #[arg(long, env = "LANEKEEPER_LISTEN", default_value = "0.0.0.0:8080")]
    listen: std::net::SocketAddr,
    /// The api keys file (YAML with SHA-256 hashes; see `lanekeeper ingest-key`),
    /// usually a mounted Secret. Re-read when it changes.
    #[arg(long, env = "LANEKEEPER_API_KEYS")]
    api_keys: PathBuf,
    /// Most envelopes a tenant may have waiting (queued, held, retrying or in
    /// flight) before its posts get 429. 0: no limit.
    #[arg(long, env = "LANEKEEPER_BACKLOG_LIMIT", default_value_t = 1_000_000)]
    backlog_limit: u64,
    /// A tenant's own backlog limit, as tenant=limit. Repeat, or comma-separate.
    #[arg(long = "backlog-limit-for", env = "LANEKEEPER_BACKLOG_LIMIT_FOR", value_delimiter = ',',
          value_parser = lanekeeper::ingest::BacklogLimits::parse_override)]
    backlog_limit_for: Vec<(String, u64)>,
    /// Largest payload of one event, in bytes.
    #[arg(long, env = "LANEKEEPER_MAX_PAYLOAD_BYTES", default_value_t = 256 * 1024)]
    max_payload_bytes: usize,
    /// Largest request body of an event or a batch, in bytes (an endpoint
    /// definition takes at most 64 KiB).
    #[arg(long, env = "LANEKEEPER_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Most events in one batch.
    #[arg(long, env = "LANEKEEPER_MAX_BATCH_ITEMS", default_value_t = 10_000)]
    max_batch_items: usize,
    /// Longest wait for Redis before answering 503.
    #[arg(long, env = "LANEKEEPER_REDIS_TIMEOUT", default_value = "2s")]
    redis_timeout: kube::core::Duration,
    /// Most endpoints one tenant may define (also the widest fan-out of one event).
    #[arg(
        long,
        env = "LANEKEEPER_MAX_ENDPOINTS_PER_TENANT",
        default_value_t = 16
    )]
    max_endpoints_per_tenant: usize,
    /// Longest endpoint URL, in bytes.
    #[arg(
        long,
        env = "LANEKEEPER_MAX_ENDPOINT_URL_BYTES",
        default_value_t = 2048
    )]
    max_endpoint_url_bytes: usize,
    /// Most entries in an endpoint's eventTypes.
    #[arg(
        long,
        env = "LANEKEEPER_MAX_ENDPOINT_EVENT_TYPES",
        default_value_t = 64
    )]
    max_endpoint_event_types: usize,
    /// Time a client has to send a request's headers; an idle kept-alive
    /// connection is closed after it too.
    #[arg(long, env = "LANEKEEPER_HEADER_READ_TIMEOUT", default_value = "10s")]
    header_read_timeout: kube::core::Duration,
    /// Time a client has to send a request's body (then 408).
    #[arg(long, env = "LANEKEEPER_BODY_READ_TIMEOUT", default_value = "30s")]
    body_read_timeout: kube::core::Duration,
    /// Most connections open at once; more wait in the listen backlog.
    #[arg(long, env = "LANEKEEPER_MAX_CONNECTIONS", default_value_t = 1024)]
    max_connections: usize,
}

pub async fn run(args: IngestArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    let store = args.target.connect().await?;
    lanekeeper::store::log_settings_at_start(&store, "ingest").await;
    let keys = lanekeeper::ingest::auth::Keys::load(&args.api_keys)?;
    if keys.current().is_empty() {
        tracing::warn!(path = %args.api_keys.display(), "the api keys file lists no keys: every request will get 401");
    }
    let _watch = keys.watch(std::time::Duration::from_secs(2));
    let config = lanekeeper::ingest::Config {
        max_payload_bytes: args.max_payload_bytes,
        max_body_bytes: args.max_body_bytes,
        max_batch_items: args.max_batch_items,
        backlog: lanekeeper::ingest::BacklogLimits {
            default: (args.backlog_limit > 0).then_some(args.backlog_limit),
            overrides: args.backlog_limit_for.into_iter().collect(),
        },
        redis_timeout: args.redis_timeout.into(),
        endpoints: lanekeeper::ingest::EndpointLimits {
            per_tenant: args.max_endpoints_per_tenant,
            url_bytes: args.max_endpoint_url_bytes,
            event_types: args.max_endpoint_event_types,
        },
        header_read_timeout: args.header_read_timeout.into(),
        body_read_timeout: args.body_read_timeout.into(),
        max_connections: args.max_connections,
        ..Default::default()
    };
    let ingest = lanekeeper::ingest::Ingest::new(
        store,
        keys,
        config,
        lanekeeper::telemetry::IngestMetrics::default(),
    );
    let (bound, task) = lanekeeper::ingest::serve(args.listen, ingest, shutdown.wait())
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    tracing::info!(%bound, "ingest API listening");
    task.await??;
    tracing::info!("ingest stopped");
    Ok(())
}
