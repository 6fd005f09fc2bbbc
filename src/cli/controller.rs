//! `lanekeeper controller`: the operator's flags (watch scope, metrics,
//! promotion tick, leader election, and the worker policy a ShardSet gets
//! no more than), and its run: serve metrics, wait to lead, reconcile until
//! SIGTERM or until the Lease is lost.

use anyhow::Context;
use lanekeeper::controller::leader;
use lanekeeper::worker::env;

use super::shutdown::Shutdown;

#[derive(clap::Args, Debug)]
pub struct ControllerArgs {
    /// Watch only this namespace (default: all).
    #[arg(long, env = "LANEKEEPER_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = env::METRICS_ADDR, default_value = "0.0.0.0:8080")]
    metrics_addr: std::net::SocketAddr,
    /// How often each ShardSet's tenants are measured for promotion to,
    /// and demotion from, dedicated lanes.
    #[arg(long, env = "LANEKEEPER_PROMOTION_TICK", default_value = "60s")]
    promotion_tick: kube::core::Duration,
    #[command(flatten)]
    election: ElectionArgs,
    #[command(flatten)]
    workers: WorkerPolicyArgs,
}

/// Leader election: only the holder of a Lease reconciles, so two replicas
/// never both write.
#[derive(clap::Args, Debug)]
pub struct ElectionArgs {
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
    #[arg(long, env = env::POD_NAME)]
    identity: Option<String>,
}

impl ElectionArgs {
    /// The Lease to hold, or `None` without leader election.
    fn election(&self) -> Option<leader::Election> {
        self.leader_election.then(|| leader::Election {
            namespace: self.lease_namespace.clone(),
            name: self.lease_name.clone(),
            identity: self.identity.clone().unwrap_or_else(super::host_pid),
            duration: self.lease_duration.into(),
        })
    }
}

/// What the operator lets a ShardSet's worker template ask for (see the
/// README's "Security model"). A ShardSet author gets no more than this.
// One line per flag attribute, so that the flags read as a table.
#[rustfmt::skip]
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerPolicyArgs {
    /// ServiceAccount worker pods run as when a ShardSet names none
    /// (default: the namespace's `default`). Workers never get an API token.
    #[arg(long, env = "LANEKEEPER_WORKER_SERVICE_ACCOUNT")]
    worker_service_account: Option<String>,
    /// ServiceAccounts a ShardSet may name in spec.worker.serviceAccountName
    /// (comma-separated). Default: none.
    #[arg(long = "allow-worker-service-account", env = "LANEKEEPER_ALLOW_WORKER_SERVICE_ACCOUNTS", value_delimiter = ',')]
    allow_worker_service_accounts: Vec<String>,
    /// Secrets spec.worker.env[].valueFrom.secretKeyRef may name
    /// (comma-separated). Default: none.
    #[arg(long = "allow-worker-secret", env = "LANEKEEPER_ALLOW_WORKER_SECRETS", value_delimiter = ',')]
    allow_worker_secrets: Vec<String>,
    /// PriorityClasses spec.worker.priorityClassName may name
    /// (comma-separated). Default: none.
    #[arg(long = "allow-worker-priority-class", env = "LANEKEEPER_ALLOW_WORKER_PRIORITY_CLASSES", value_delimiter = ',')]
    allow_worker_priority_classes: Vec<String>,
    /// Image prefixes spec.worker.image must start with, at a `/`, `:` or
    /// `@` boundary (comma-separated). Default: any image.
    #[arg(long = "allow-worker-image", env = "LANEKEEPER_ALLOW_WORKER_IMAGES", value_delimiter = ',')]
    allow_worker_images: Vec<String>,
    /// Taint keys spec.worker.tolerations may tolerate (comma-separated);
    /// `*`: any toleration, even of every taint. Default: none.
    #[arg(long = "allow-worker-toleration", env = "LANEKEEPER_ALLOW_WORKER_TOLERATIONS", value_delimiter = ',')]
    allow_worker_tolerations: Vec<String>,
    /// Let spec.worker.env set HTTP_PROXY, HTTPS_PROXY, NO_PROXY or ALL_PROXY.
    #[arg(long, env = "LANEKEEPER_ALLOW_WORKER_PROXY_ENV")]
    allow_worker_proxy_env: bool,
    /// Non-global CIDRs every worker may deliver to (its
    /// LANEKEEPER_ALLOW_CIDRS, which a ShardSet cannot set). Comma-separated.
    #[arg(long = "worker-allow-cidr", env = "LANEKEEPER_WORKER_ALLOW_CIDRS", value_delimiter = ',')]
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

pub async fn run(args: ControllerArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ControllerArgs {
        namespace,
        metrics_addr,
        promotion_tick,
        election,
        workers,
    } = args;
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

    // Leadership: wait to hold the Lease. Losing it stops the controller and
    // the process exits non-zero, so that it restarts as a follower.
    let mut leader: Option<leader::Lost> = None;
    let mut lease_task = None;
    if let Some(election) = election.election() {
        match leader::acquire(client.clone(), &election, shutdown.clone().wait()).await? {
            None => {
                let _ = stop_tx.send(());
                return Ok(());
            }
            Some(l) => {
                leader = Some(l.lost);
                lease_task = Some(l.release);
            }
        }
    }

    let lost = std::sync::Arc::new(AtomicBool::new(false));
    let stop = {
        let lost = lost.clone();
        async move {
            match leader {
                Some(rx) => tokio::select! {
                    _ = rx.wait() => lost.store(true, Ordering::SeqCst),
                    _ = shutdown.wait() => {}
                },
                None => shutdown.wait().await,
            }
        }
    };
    let ctx = std::sync::Arc::new(
        lanekeeper::controller::Context::new(client.clone(), metrics)
            .with_worker_policy(workers.into()),
    );
    let opts = lanekeeper::controller::ControllerOptions {
        namespace,
        promotion_tick: promotion_tick.into(),
    };
    let result = lanekeeper::controller::run(client, opts, ctx, stop).await;
    let _ = stop_tx.send(());
    // The lease task releases the Lease once its receivers are gone.
    if let Some(task) = lease_task {
        task.wait().await;
    }
    if lost.load(Ordering::SeqCst) {
        anyhow::bail!("lost leadership; exiting so that a restart joins as a follower");
    }
    result
}
