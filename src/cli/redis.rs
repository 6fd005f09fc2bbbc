//! The flags that say where a ShardSet's queues live (`--redis`,
//! `--shard-set` and the Redis credentials and TLS files), shared by
//! `worker`, `ingest`, `route`, `top`, `tiers`, `tenant` and `dataplane
//! apply`, and the connection they make.

use lanekeeper::worker::env;
use std::path::PathBuf;

/// Where a ShardSet's queues live.
// One line per flag attribute, so that the flags read as a table.
#[rustfmt::skip]
#[derive(clap::Args, Debug)]
pub struct RedisTarget {
    /// Redis URL of the ShardSet.
    #[arg(long, env = env::REDIS_URL, required = true)]
    pub redis: Option<String>,
    /// The ShardSet, as <namespace>/<name>.
    #[arg(long, env = env::SHARD_SET, required = true)]
    pub shard_set: Option<lanekeeper::store::SetId>,
    /// The Redis is a Redis Cluster: `redis://host:port` is read as
    /// `redis+cluster://host:port` (a ShardSet's `spec.redis.cluster`).
    #[arg(long, env = env::REDIS_CLUSTER)]
    pub redis_cluster: bool,
    /// Password for the Redis URL (a ShardSet's `spec.redis.passwordSecretRef`).
    #[arg(long, env = env::REDIS_PASSWORD, hide_env_values = true)]
    pub redis_password: Option<String>,
    /// ACL user name for the Redis URL (a ShardSet's `spec.redis.username`);
    /// needs a password.
    #[arg(long, env = env::REDIS_USERNAME, requires = "redis_password")]
    pub redis_username: Option<String>,
    /// PEM CA bundle to verify a `rediss://` server with, instead of the
    /// system roots (a ShardSet's `spec.redis.tls.caSecretRef`).
    #[arg(long, env = env::REDIS_CA_FILE, value_name = "PEM")]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM client certificate for a Redis that asks for one
    /// (`tls-auth-clients`); with --redis-client-key-file.
    #[arg(long, env = env::REDIS_CLIENT_CERT_FILE, value_name = "PEM", requires = "redis_client_key_file")]
    pub redis_client_cert_file: Option<PathBuf>,
    /// PEM private key of --redis-client-cert-file.
    #[arg(long, env = env::REDIS_CLIENT_KEY_FILE, value_name = "PEM", requires = "redis_client_cert_file")]
    pub redis_client_key_file: Option<PathBuf>,
}

impl RedisTarget {
    pub async fn connect(&self) -> anyhow::Result<lanekeeper::store::Store> {
        use anyhow::Context;
        let url = self
            .redis
            .as_deref()
            .context("--redis (or LANEKEEPER_REDIS_URL) is required")?;
        let set = self
            .shard_set
            .clone()
            .context("--shard-set <namespace>/<name> is required")?;
        self.connect_with(url, set, self.redis_cluster, self.redis_username.as_deref())
            .await
    }

    /// Connect to `url` for `set` with this target's password and TLS
    /// files (`dataplane apply` takes the URL, cluster flag and user name
    /// from the ShardSet when the flags do not give them). The user name is
    /// used only with a password. Errors show the URL redacted.
    pub async fn connect_with(
        &self,
        url: &str,
        set: lanekeeper::store::SetId,
        cluster: bool,
        username: Option<&str>,
    ) -> anyhow::Result<lanekeeper::store::Store> {
        use anyhow::Context;
        let mut url = lanekeeper::store::cluster_url(url, cluster);
        if let Some(password) = &self.redis_password {
            if let Some(user) = username {
                url = lanekeeper::store::with_username(&url, user).map_err(anyhow::Error::msg)?;
            }
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
