use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// lanekeeper keeps one tenant's flood of webhooks from delaying everyone else's.
///
/// One binary runs every part: the Kubernetes operator, the delivery workers,
/// the ingest API and the tools around them.
#[derive(Parser, Debug)]
#[command(name = "lanekeeper", version, about, long_about)]
struct Cli {
    /// Log format (logs go to stderr; RUST_LOG filters).
    #[arg(
        long,
        global = true,
        env = "LANEKEEPER_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: lanekeeper::telemetry::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the ShardSet and DedicatedLane CustomResourceDefinitions as YAML.
    ///
    /// Without --out, both CRDs go to stdout as one multi-document stream, ready
    /// for `lanekeeper crds | kubectl apply -f -`. With --out DIR, each CRD is
    /// written to DIR/<name>.yaml, as committed in the repository's crds/.
    Crds {
        /// Directory to write one file per CRD into, instead of stdout.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },

    /// Print the queue each tenant routes to.
    ///
    /// With --shards, the rendezvous hash alone (no Redis needed). With
    /// --redis and --shard-set, the set's live routing table, pins included.
    Route {
        /// Shard count to hash over, instead of reading the routing table.
        #[arg(long, conflicts_with = "redis")]
        shards: Option<u16>,
        #[command(flatten)]
        target: RedisTarget,
        /// Tenant ids; with none, one per line is read from stdin.
        tenants: Vec<String>,
    },

    /// Deliver the webhooks of one queue (what every shard and lane pod runs).
    ///
    /// Leases envelopes fairly, POSTs them signed (Standard Webhooks) to the
    /// tenant's endpoint, and acks, retries with backoff, or dead-letters.
    /// SIGTERM stops leasing, lets deliveries in flight finish within the
    /// grace period and gives back the rest; SIGKILL loses nothing either.
    Worker(Box<WorkerArgs>),

    /// Run the operator: ShardSets become worker Deployments, routing in
    /// Redis, and status. Uses the in-cluster identity or $KUBECONFIG.
    Controller {
        /// Watch only this namespace (default: all).
        #[arg(long, env = "LANEKEEPER_WATCH_NAMESPACE")]
        namespace: Option<String>,
        /// Address for /metrics, /healthz and /readyz.
        #[arg(long, env = "LANEKEEPER_METRICS_ADDR", default_value = "0.0.0.0:8080")]
        metrics_addr: std::net::SocketAddr,
        /// How often each ShardSet's tenants are measured for promotion to,
        /// and demotion from, dedicated lanes.
        #[arg(long, env = "LANEKEEPER_PROMOTION_TICK", default_value = "60s")]
        promotion_tick: kube::core::Duration,
        #[command(flatten)]
        election: Election,
        #[command(flatten)]
        workers: WorkerPolicyArgs,
    },

    /// Serve the ingest API: producers post events over HTTP.
    ///
    /// Events are validated, routed and enqueued (following MOVED answers,
    /// held while their tenant moves); endpoints, dead letters and tenant
    /// stats are managed under /v1/tenants/{tenant}. The OpenAPI document is
    /// at /v1/openapi.json; /metrics, /healthz and /readyz share the port.
    /// SIGTERM stops accepting and lets requests in flight finish.
    Ingest(Box<IngestArgs>),

    /// Make a new API key for ingest: prints the key (give it to the
    /// producer, once) and the entry for the api keys file (its SHA-256 only).
    IngestKey {
        /// Name of the key, for logs.
        #[arg(long)]
        name: String,
        /// The tenant the key may act for.
        #[arg(long, conflicts_with = "admin", required_unless_present = "admin")]
        tenant: Option<String>,
        /// The key may act for every tenant.
        #[arg(long)]
        admin: bool,
    },

    /// Show which tenants own each queue's backlog and capacity.
    ///
    /// For every queue of a ShardSet: tenant, outstanding depth, its share of
    /// the queue's depth, and its share of the queue's worker-seconds over the
    /// window (capacity %), largest consumers first.
    Top {
        #[command(flatten)]
        target: RedisTarget,
        /// Window for worker-second shares (Go duration: 5m, 90s).
        #[arg(long, default_value = "5m")]
        window: kube::core::Duration,
        /// Rows per queue.
        #[arg(long, default_value_t = 10)]
        limit: usize,
    },

    /// Compare FIFO, hashed shards, fair scheduling and dedicated lanes on a
    /// tenant mix, before touching production (needs --redis).
    ///
    /// Replays one generated workload (small tenants with power-law volumes,
    /// whale imports, log-normal endpoint latencies) through each strategy,
    /// running the production Lua scripts on the Redis given with --redis
    /// under a virtual clock, in a throwaway ShardSet whose keys it deletes.
    /// Prints small-tenant wait p50/p95/p99, whale drain time and shard skew
    /// per strategy, and writes an SVG chart of small-tenant wait over time.
    Simulate(Box<lanekeeper::simulate::SimulateArgs>),
}

#[derive(clap::Args, Debug)]
struct IngestArgs {
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

#[derive(clap::Args, Debug)]
struct WorkerArgs {
    #[command(flatten)]
    target: RedisTarget,
    /// The queue to serve: shard-<N> or lane-<N>.
    #[arg(long, env = "LANEKEEPER_QUEUE")]
    queue: lanekeeper::routing::QueueId,
    /// Deliveries in flight in this process.
    #[arg(long, env = "LANEKEEPER_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// Total time for one delivery attempt.
    #[arg(long, env = "LANEKEEPER_DELIVERY_TIMEOUT", default_value = "30s")]
    delivery_timeout: kube::core::Duration,
    /// Time to connect to an endpoint.
    #[arg(long, env = "LANEKEEPER_CONNECT_TIMEOUT", default_value = "5s")]
    connect_timeout: kube::core::Duration,
    /// First retry delay; doubles per attempt, with jitter.
    #[arg(long, env = "LANEKEEPER_INITIAL_BACKOFF", default_value = "1s")]
    initial_backoff: kube::core::Duration,
    /// Longest retry delay.
    #[arg(long, env = "LANEKEEPER_MAX_BACKOFF", default_value = "1h")]
    max_backoff: kube::core::Duration,
    /// Lease = connect timeout + delivery timeout + this margin; past it, the
    /// envelope goes to another worker.
    #[arg(long, env = "LANEKEEPER_LEASE_MARGIN", default_value = "10s")]
    lease_margin: kube::core::Duration,
    /// CIDRs that deliveries may reach although they are not global
    /// (loopback, private, ...). Comma-separated.
    #[arg(
        long = "allow-cidr",
        env = "LANEKEEPER_ALLOW_CIDRS",
        value_delimiter = ','
    )]
    allow_cidrs: Vec<ipnet::IpNet>,
    /// HTTP proxy for every delivery (http://host:port). Without it no proxy
    /// is used: HTTP_PROXY, HTTPS_PROXY and ALL_PROXY are ignored. With it,
    /// the SSRF guard checks each URL's host before the request, but the
    /// proxy resolves and connects on its own: its access rules must refuse
    /// internal addresses (see docs/architecture.md).
    #[arg(long, env = "LANEKEEPER_PROXY")]
    proxy: Option<reqwest::Url>,
    /// After SIGTERM, time for deliveries in flight to finish.
    #[arg(long, env = "LANEKEEPER_GRACE_PERIOD", default_value = "25s")]
    grace_period: kube::core::Duration,
    /// Address for /metrics and /healthz, e.g. 0.0.0.0:9090.
    #[arg(long, env = "LANEKEEPER_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Tenants with their own metric labels; the rest are "other".
    #[arg(long, env = "LANEKEEPER_TENANT_LABEL_CAP", default_value_t = 100)]
    tenant_label_cap: usize,
    /// Identity in lease tokens and logs (defaults to the pod name, then host:pid).
    #[arg(long, env = "POD_NAME")]
    worker_id: Option<String>,
}

/// Leader election: only the holder of a Lease reconciles, so two replicas
/// never both write.
#[derive(clap::Args, Debug)]
struct Election {
    /// Take part in leader election (turn off for a single local run).
    #[arg(long, env = "LANEKEEPER_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the Lease (the controller's own namespace in a cluster).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the Lease.
    #[arg(
        long,
        env = "LANEKEEPER_LEASE_NAME",
        default_value = "lanekeeper-controller"
    )]
    lease_name: String,
    /// How long a leader holds the Lease without renewing it.
    #[arg(long, env = "LANEKEEPER_LEASE_DURATION", default_value = "15s")]
    lease_duration: kube::core::Duration,
    /// This replica's identity in the Lease (defaults to the pod name, then host:pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
}

/// Where a ShardSet's queues live.
#[derive(clap::Args, Debug)]
struct RedisTarget {
    /// Redis URL of the ShardSet.
    #[arg(long, env = "LANEKEEPER_REDIS_URL")]
    redis: Option<String>,
    /// The ShardSet, as <namespace>/<name>.
    #[arg(long, env = "LANEKEEPER_SHARD_SET")]
    shard_set: Option<lanekeeper::store::SetId>,
    /// The Redis is a Redis Cluster: `redis://host:port` is read as
    /// `redis+cluster://host:port` (a ShardSet's `spec.redis.cluster`).
    #[arg(long, env = "LANEKEEPER_REDIS_CLUSTER")]
    redis_cluster: bool,
    /// Password for the Redis URL (a ShardSet's `spec.redis.passwordSecretRef`).
    #[arg(long, env = "LANEKEEPER_REDIS_PASSWORD", hide_env_values = true)]
    redis_password: Option<String>,
    /// ACL user name for the Redis URL (a ShardSet's `spec.redis.username`);
    /// needs a password.
    #[arg(long, env = "LANEKEEPER_REDIS_USERNAME", requires = "redis_password")]
    redis_username: Option<String>,
    /// PEM CA bundle to verify a `rediss://` server with, instead of the
    /// system roots (a ShardSet's `spec.redis.tls.caSecretRef`).
    #[arg(long, env = "LANEKEEPER_REDIS_CA_FILE", value_name = "PEM")]
    redis_ca_file: Option<PathBuf>,
    /// PEM client certificate for a Redis that asks for one
    /// (`tls-auth-clients`); with --redis-client-key-file.
    #[arg(
        long,
        env = "LANEKEEPER_REDIS_CLIENT_CERT_FILE",
        value_name = "PEM",
        requires = "redis_client_key_file"
    )]
    redis_client_cert_file: Option<PathBuf>,
    /// PEM private key of --redis-client-cert-file.
    #[arg(
        long,
        env = "LANEKEEPER_REDIS_CLIENT_KEY_FILE",
        value_name = "PEM",
        requires = "redis_client_cert_file"
    )]
    redis_client_key_file: Option<PathBuf>,
}

impl RedisTarget {
    async fn connect(&self) -> anyhow::Result<lanekeeper::store::Store> {
        use anyhow::Context;
        let url = self
            .redis
            .as_deref()
            .context("--redis (or LANEKEEPER_REDIS_URL) is required")?;
        let set = self
            .shard_set
            .clone()
            .context("--shard-set <namespace>/<name> is required")?;
        let mut url = lanekeeper::store::cluster_url(url, self.redis_cluster);
        if let Some(user) = &self.redis_username {
            url = lanekeeper::store::with_username(&url, user).map_err(anyhow::Error::msg)?;
        }
        if let Some(password) = &self.redis_password {
            url = lanekeeper::store::with_password(&url, password).map_err(anyhow::Error::msg)?;
        }
        let tls = lanekeeper::store::RedisTls::from_files(
            self.redis_ca_file.as_deref(),
            self.redis_client_cert_file.as_deref(),
            self.redis_client_key_file.as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let shown = lanekeeper::store::redact(&url);
        lanekeeper::store::Store::connect_tls(&url, set, Default::default(), tls)
            .await
            .with_context(|| format!("connecting to {shown}"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    lanekeeper::telemetry::init_logging(cli.log_format);
    let result = match cli.command {
        Command::Crds { out } => crds(out),
        Command::Route {
            shards,
            target,
            tenants,
        } => runtime().and_then(|rt| rt.block_on(route(shards, target, tenants))),
        Command::Top {
            target,
            window,
            limit,
        } => runtime().and_then(|rt| rt.block_on(top(target, window.into(), limit))),
        Command::Worker(args) => runtime().and_then(|rt| rt.block_on(worker(*args))),
        Command::Simulate(args) => {
            runtime().and_then(|rt| rt.block_on(lanekeeper::simulate::run_cli(*args)))
        }
        Command::Ingest(args) => runtime().and_then(|rt| rt.block_on(ingest(*args))),
        Command::IngestKey {
            name,
            tenant,
            admin,
        } => ingest_key(&name, tenant.as_deref(), admin),
        Command::Controller {
            namespace,
            metrics_addr,
            promotion_tick,
            election,
            workers,
        } => runtime().and_then(|rt| {
            rt.block_on(controller(
                namespace,
                metrics_addr,
                promotion_tick.into(),
                election,
                workers.into(),
            ))
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lanekeeper: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn crds(out: Option<PathBuf>) -> anyhow::Result<()> {
    use anyhow::Context;
    match out {
        None => print!("{}", lanekeeper::crd::all_yaml()?),
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating output directory {}", dir.display()))?;
            for crd in lanekeeper::crd::all() {
                let path = dir.join(lanekeeper::crd::file_name(&crd));
                std::fs::write(&path, lanekeeper::crd::to_yaml(&crd)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

async fn route(
    shards: Option<u16>,
    target: RedisTarget,
    mut tenants: Vec<String>,
) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    if tenants.is_empty() {
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            if !line.trim().is_empty() {
                tenants.push(line.trim().to_string());
            }
        }
    }
    let table = match shards {
        Some(n) if (1..=1024).contains(&n) => lanekeeper::routing::RoutingTable {
            shards: n,
            ..Default::default()
        },
        Some(n) => anyhow::bail!("--shards {n}: must be between 1 and 1024"),
        None => target.connect().await?.routing().await?,
    };
    anyhow::ensure!(
        table.shards > 0,
        "the routing table has no shard count yet; is the controller running?"
    );
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for t in tenants {
        lanekeeper::envelope::validate_tenant(&t)?;
        writeln!(out, "{t}\t{}", table.route(&t))?;
    }
    out.flush()?;
    Ok(())
}

async fn top(target: RedisTarget, window: std::time::Duration, limit: usize) -> anyhow::Result<()> {
    let store = target.connect().await?;
    let table = store.routing().await?;
    let mut queues: Vec<lanekeeper::routing::QueueId> = (0..table.shards)
        .map(lanekeeper::routing::QueueId::Shard)
        .collect();
    queues.extend(
        table
            .pins
            .values()
            .copied()
            .filter(|q| matches!(q, lanekeeper::routing::QueueId::Lane(_))),
    );
    queues.sort();
    queues.dedup();
    println!(
        "{:<10} {:<32} {:>10} {:>8} {:>10}",
        "QUEUE", "TENANT", "DEPTH", "DEPTH%", "CAPACITY%"
    );
    for q in queues {
        let stats = store.tenant_stats(q, window).await?;
        let depth: u64 = stats.iter().map(|s| s.depth).sum();
        let secs: f64 = stats.iter().map(|s| s.worker_seconds).sum();
        for s in stats.iter().take(limit) {
            let pct = |part: f64, whole: f64| {
                if whole > 0.0 {
                    100.0 * part / whole
                } else {
                    0.0
                }
            };
            println!(
                "{:<10} {:<32} {:>10} {:>7.1}% {:>9.1}%",
                q.to_string(),
                s.tenant,
                s.depth,
                pct(s.depth as f64, depth as f64),
                pct(s.worker_seconds, secs)
            );
        }
    }
    Ok(())
}

async fn ingest(args: IngestArgs) -> anyhow::Result<()> {
    use anyhow::Context;
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
    let mut stop = lanekeeper::worker::stop_on_signals();
    let (bound, task) = lanekeeper::ingest::serve(args.listen, ingest, async move {
        let _ = stop.wait_for(|s| *s).await;
    })
    .await
    .with_context(|| format!("listening on {}", args.listen))?;
    tracing::info!(%bound, "ingest API listening");
    task.await??;
    tracing::info!("ingest stopped");
    Ok(())
}

fn ingest_key(name: &str, tenant: Option<&str>, admin: bool) -> anyhow::Result<()> {
    use lanekeeper::ingest::auth;
    if let Some(t) = tenant {
        lanekeeper::envelope::validate_tenant(t)?;
    }
    let key = auth::generate_key();
    println!("key (give it to the producer; it is not stored anywhere): {key}");
    println!("entry for the api keys file:");
    let scope = match tenant {
        Some(t) if !admin => format!("tenant: {}", serde_json::to_string(t)?),
        _ => "admin: true".to_string(),
    };
    println!(
        "  - {{name: {}, sha256: {}, {scope}}}",
        serde_json::to_string(name)?,
        auth::hash_key_hex(&key)
    );
    Ok(())
}

async fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let store = args.target.connect().await?;
    lanekeeper::store::log_settings_at_start(&store, "worker").await;
    let worker_id = args.worker_id.unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}:{}", host.trim(), std::process::id())
    });
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
    let stop = lanekeeper::worker::stop_on_signals();
    lanekeeper::worker::run(store, config, stop).await
}

/// What the operator lets a ShardSet's worker template ask for (see the
/// README's "Security model"). A ShardSet author gets no more than this.
#[derive(clap::Args, Debug, Clone)]
struct WorkerPolicyArgs {
    /// ServiceAccount worker pods run as when a ShardSet names none
    /// (default: the namespace's `default`). Workers never get an API token.
    #[arg(long, env = "LANEKEEPER_WORKER_SERVICE_ACCOUNT")]
    worker_service_account: Option<String>,
    /// ServiceAccounts a ShardSet may name in spec.worker.serviceAccountName
    /// (comma-separated). Default: none.
    #[arg(
        long = "allow-worker-service-account",
        env = "LANEKEEPER_ALLOW_WORKER_SERVICE_ACCOUNTS",
        value_delimiter = ','
    )]
    allow_worker_service_accounts: Vec<String>,
    /// Secrets spec.worker.env[].valueFrom.secretKeyRef may name
    /// (comma-separated). Default: none.
    #[arg(
        long = "allow-worker-secret",
        env = "LANEKEEPER_ALLOW_WORKER_SECRETS",
        value_delimiter = ','
    )]
    allow_worker_secrets: Vec<String>,
    /// PriorityClasses spec.worker.priorityClassName may name
    /// (comma-separated). Default: none.
    #[arg(
        long = "allow-worker-priority-class",
        env = "LANEKEEPER_ALLOW_WORKER_PRIORITY_CLASSES",
        value_delimiter = ','
    )]
    allow_worker_priority_classes: Vec<String>,
    /// Image prefixes spec.worker.image must start with, at a `/`, `:` or
    /// `@` boundary (comma-separated). Default: any image.
    #[arg(
        long = "allow-worker-image",
        env = "LANEKEEPER_ALLOW_WORKER_IMAGES",
        value_delimiter = ','
    )]
    allow_worker_images: Vec<String>,
    /// Taint keys spec.worker.tolerations may tolerate (comma-separated);
    /// `*`: any toleration, even of every taint. Default: none.
    #[arg(
        long = "allow-worker-toleration",
        env = "LANEKEEPER_ALLOW_WORKER_TOLERATIONS",
        value_delimiter = ','
    )]
    allow_worker_tolerations: Vec<String>,
    /// Let spec.worker.env set HTTP_PROXY, HTTPS_PROXY, NO_PROXY or ALL_PROXY.
    #[arg(long, env = "LANEKEEPER_ALLOW_WORKER_PROXY_ENV")]
    allow_worker_proxy_env: bool,
    /// Non-global CIDRs every worker may deliver to (its
    /// LANEKEEPER_ALLOW_CIDRS, which a ShardSet cannot set). Comma-separated.
    #[arg(
        long = "worker-allow-cidr",
        env = "LANEKEEPER_WORKER_ALLOW_CIDRS",
        value_delimiter = ','
    )]
    worker_allow_cidrs: Vec<ipnet::IpNet>,
}

impl From<WorkerPolicyArgs> for lanekeeper::controller::build::WorkerPolicy {
    fn from(a: WorkerPolicyArgs) -> Self {
        Self {
            service_account: a.worker_service_account,
            allowed_service_accounts: a.allow_worker_service_accounts,
            allowed_env_secrets: a.allow_worker_secrets,
            allowed_priority_classes: a.allow_worker_priority_classes,
            allowed_image_prefixes: a.allow_worker_images,
            allowed_toleration_keys: a.allow_worker_tolerations,
            allow_proxy_env: a.allow_worker_proxy_env,
            worker_allow_cidrs: a.worker_allow_cidrs.iter().map(|c| c.to_string()).collect(),
        }
    }
}

async fn controller(
    namespace: Option<String>,
    metrics_addr: std::net::SocketAddr,
    promotion_tick: std::time::Duration,
    election: Election,
    worker_policy: lanekeeper::controller::build::WorkerPolicy,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::sync::atomic::{AtomicBool, Ordering};
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes credentials: run in a pod, or set KUBECONFIG")?;
    let metrics = lanekeeper::telemetry::ControllerMetrics::default();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let bound = lanekeeper::telemetry::serve(metrics_addr, metrics.clone(), async move {
        let _ = stop_rx.await;
    })
    .await
    .with_context(|| format!("serving metrics on {metrics_addr}"))?;
    tracing::info!(%bound, "serving /metrics, /healthz and /readyz");

    let mut signals = lanekeeper::worker::stop_on_signals();
    // Leadership: wait to hold the Lease. Losing it stops the controller and
    // the process exits non-zero, so that it restarts as a follower.
    let mut leader: Option<tokio::sync::watch::Receiver<bool>> = None;
    let mut lease_task = None;
    if election.leader_election {
        let identity = election.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}:{}", host.trim(), std::process::id())
        });
        let duration: std::time::Duration = election.lease_duration.into();
        let manager =
            kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &election.lease_name)
                .with_namespace(&election.lease_namespace)
                .with_identity(&identity)
                .with_duration(duration.as_secs().max(2))
                .with_grace((duration.as_secs() / 3).max(1))
                .build()
                .await
                .with_context(|| {
                    format!(
                        "leader election Lease {}/{}",
                        election.lease_namespace, election.lease_name
                    )
                })?;
        let (mut rx, task) = manager.watch().await;
        tracing::info!(%identity, lease = %election.lease_name, "waiting to become the leader");
        let leading = tokio::select! {
            r = rx.wait_for(|l| *l) => { r.context("leader election stopped")?; true }
            _ = signals.wait_for(|s| *s) => false,
        };
        if !leading {
            let _ = stop_tx.send(());
            return Ok(());
        }
        tracing::info!(%identity, "leading");
        leader = Some(rx);
        lease_task = Some(task);
    }

    let lost = std::sync::Arc::new(AtomicBool::new(false));
    let stop = {
        let lost = lost.clone();
        async move {
            match leader {
                Some(mut rx) => tokio::select! {
                    _ = rx.wait_for(|l| !*l) => lost.store(true, Ordering::SeqCst),
                    _ = signals.wait_for(|s| *s) => {}
                },
                None => {
                    let _ = signals.wait_for(|s| *s).await;
                }
            }
        }
    };
    let ctx = std::sync::Arc::new(
        lanekeeper::controller::Context::new(client.clone(), metrics)
            .with_worker_policy(worker_policy),
    );
    let opts = lanekeeper::controller::ControllerOptions {
        namespace,
        promotion_tick,
    };
    let result = lanekeeper::controller::run(client, opts, ctx, stop).await;
    let _ = stop_tx.send(());
    // The lease task releases the Lease once its receivers are gone.
    if let Some(task) = lease_task {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
    }
    if lost.load(Ordering::SeqCst) {
        anyhow::bail!("lost leadership; exiting so that a restart joins as a follower");
    }
    result
}
