//! `lanekeeper worker`: the flags of one queue's delivery worker (what
//! every shard and lane pod runs, configured by the environment the
//! controller sets) and its start.

use super::redis::RedisTarget;
use super::shutdown::Shutdown;
use lanekeeper::worker::env;

#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    target: RedisTarget,
    /// The queue to serve: shard-<N> or lane-<N>.
    #[arg(long, env = env::QUEUE)]
    queue: lanekeeper::routing::QueueId,
    /// Deliveries in flight in this process.
    #[arg(long, env = env::CONCURRENCY, default_value_t = 16)]
    concurrency: usize,
    /// Total time for one delivery attempt.
    #[arg(long, env = env::DELIVERY_TIMEOUT, default_value = "30s")]
    delivery_timeout: kube::core::Duration,
    /// Time to connect to an endpoint.
    #[arg(long, env = env::CONNECT_TIMEOUT, default_value = "5s")]
    connect_timeout: kube::core::Duration,
    /// First retry delay; doubles per attempt, with jitter.
    #[arg(long, env = env::INITIAL_BACKOFF, default_value = "1s")]
    initial_backoff: kube::core::Duration,
    /// Longest retry delay.
    #[arg(long, env = env::MAX_BACKOFF, default_value = "1h")]
    max_backoff: kube::core::Duration,
    /// Lease = connect timeout + delivery timeout + this margin; past it, the
    /// envelope goes to another worker.
    #[arg(long, env = env::LEASE_MARGIN, default_value = "10s")]
    lease_margin: kube::core::Duration,
    /// CIDRs that deliveries may reach although they are not global
    /// (loopback, private, ...). Comma-separated.
    #[arg(
        long = "allow-cidr",
        env = env::ALLOW_CIDRS,
        value_delimiter = ','
    )]
    allow_cidrs: Vec<ipnet::IpNet>,
    /// HTTP proxy for every delivery (http://host:port). Without it no proxy
    /// is used: HTTP_PROXY, HTTPS_PROXY and ALL_PROXY are ignored. With it,
    /// the SSRF guard checks each URL's host before the request, but the
    /// proxy resolves and connects on its own: its access rules must refuse
    /// internal addresses (see docs/architecture.md).
    #[arg(long, env = env::PROXY)]
    proxy: Option<reqwest::Url>,
    /// After SIGTERM, time for deliveries in flight to finish.
    #[arg(long, env = env::GRACE_PERIOD, default_value = "25s")]
    grace_period: kube::core::Duration,
    /// Address for /metrics and /healthz, e.g. 0.0.0.0:9090.
    #[arg(long, env = env::METRICS_ADDR)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Tenants with their own metric labels; the rest are "other".
    #[arg(long, env = env::TENANT_LABEL_CAP, default_value_t = 100)]
    tenant_label_cap: usize,
    /// Identity in lease tokens and logs (defaults to the pod name, then host:pid).
    #[arg(long, env = env::POD_NAME)]
    worker_id: Option<String>,
}

pub async fn run(args: WorkerArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    let store = args.target.connect().await?;
    lanekeeper::store::log_settings_at_start(&store, "worker").await;
    let worker_id = args.worker_id.unwrap_or_else(super::host_pid);
    let config = lanekeeper::worker::WorkerConfig {
        queue: args.queue,
        concurrency: args.concurrency.max(1),
        connect_timeout: args.connect_timeout.into(),
        delivery_timeout: args.delivery_timeout.into(),
        lease_margin: args.lease_margin.into(),
        initial_backoff: args.initial_backoff.into(),
        max_backoff: args.max_backoff.into(),
        allow: args.allow_cidrs,
        grace: args.grace_period.into(),
        endpoint_cache: std::time::Duration::from_secs(5),
        worker_id,
        metrics_addr: args.metrics_addr,
        tenant_label_cap: args.tenant_label_cap,
        proxy: args.proxy,
    };
    lanekeeper::worker::run(store, config, shutdown.receiver()).await
}
