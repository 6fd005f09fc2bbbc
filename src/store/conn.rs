//! Connections: to one Redis server or a Redis Cluster ([`Conn`]), their
//! tuning and TLS material, [`Store::connect`], and how a call of a library
//! function goes out ([`Store::call`]).

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::Value;

use super::library::{function_missing, load_library, Func, CLUSTER_LIBRARY, LIBRARY};
use super::url::{cluster_nodes, is_tls_url, redact};
use super::{durable, keys, Result, SetId, Store, StoreError};
use crate::routing::QueueId;

/// A connection to one Redis server, or to a Redis Cluster through the
/// cluster client (which routes each command to the primary owning its
/// slot and follows MOVED, ASK and failovers). Both are cheap to clone.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Where wake-up subscriptions connect.
#[derive(Clone)]
pub(super) enum PubSubSource {
    Single(redis::Client),
    /// The cluster's seed node URLs, the connection tuning and the TLS material.
    Cluster(Vec<String>, ConnectOptions, Option<RedisTls>),
}

/// The cluster client for `nodes`. Its retries follow redirects, TRYAGAIN
/// (a slot mid-migration) and failovers: up to 15 tries, 10 ms to 1 s apart
/// with jitter (the crate's default waits at least 1.28 s between tries).
pub(super) fn cluster_builder(
    nodes: &[String],
    opts: &ConnectOptions,
    tls: Option<&RedisTls>,
) -> redis::cluster::ClusterClientBuilder {
    let builder = redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
        .connection_timeout(opts.connect_timeout)
        .response_timeout(opts.response_timeout)
        .retries(15)
        .min_retry_wait(10)
        .max_retry_wait(1000);
    match tls.and_then(RedisTls::certificates) {
        Some(certs) => builder.certs(certs),
        None => builder,
    }
}

/// TLS material for `rediss://` and `rediss+cluster://`: a CA bundle to
/// trust instead of the system roots, and a client certificate for a Redis
/// that asks for one (`tls-auth-clients yes`). Both PEM. Without either,
/// a `rediss://` URL verifies the server against the system roots.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct RedisTls {
    /// PEM certificates to trust (a Secret's `ca.crt`), instead of the system roots.
    pub ca: Option<Vec<u8>>,
    /// PEM client certificate chain and its PEM private key.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key, and the certificates are noise in a log.
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

impl RedisTls {
    /// Read the CA and client certificate files given (`None`: not used).
    /// A file that cannot be read, or holds no PEM block, is an error naming
    /// the file and the setting.
    pub fn from_files(
        ca: Option<&std::path::Path>,
        cert: Option<&std::path::Path>,
        key: Option<&std::path::Path>,
    ) -> std::result::Result<Option<Self>, String> {
        let read = |what: &str, p: &std::path::Path| {
            let bytes = std::fs::read(p)
                .map_err(|e| format!("cannot read the Redis {what} {}: {e}", p.display()))?;
            if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
                return Err(format!(
                    "the Redis {what} {} holds no PEM block (-----BEGIN ...)",
                    p.display()
                ));
            }
            Ok(bytes)
        };
        let ca = ca.map(|p| read("CA file", p)).transpose()?;
        let client = match (cert, key) {
            (Some(c), Some(k)) => Some((read("client certificate", c)?, read("client key", k)?)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(
                    "a Redis client certificate needs its key (--redis-client-key-file)".into(),
                )
            }
            (None, Some(_)) => {
                return Err(
                    "a Redis client key needs its certificate (--redis-client-cert-file)".into(),
                )
            }
        };
        Ok((ca.is_some() || client.is_some()).then_some(RedisTls { ca, client }))
    }

    fn certificates(&self) -> Option<redis::TlsCertificates> {
        if self.ca.is_none() && self.client.is_none() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        })
    }
}

/// Connection tuning.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
        }
    }
}

impl Store {
    /// Connect to `url` for the set `set`. A Redis that is down or slow gives
    /// a typed error, never a panic; the connection reconnects on its own.
    ///
    /// `redis+cluster://` and `rediss+cluster://` URLs (see [`cluster_nodes`])
    /// connect to a Redis Cluster through its seed nodes.
    pub async fn connect(url: &str, set: SetId, opts: ConnectOptions) -> Result<Self> {
        Self::connect_tls(url, set, opts, None).await
    }

    /// [`Store::connect`] with TLS material (a CA to trust instead of the
    /// system roots, a client certificate); `url` must then be `rediss://`
    /// or `rediss+cluster://`, or this is an error (a CA given for a
    /// plain-text URL is a mistake, not something to ignore).
    pub async fn connect_tls(
        url: &str,
        set: SetId,
        opts: ConnectOptions,
        tls: Option<RedisTls>,
    ) -> Result<Self> {
        let tls = tls.filter(|t| t.certificates().is_some());
        if tls.is_some() && !is_tls_url(url) {
            return Err(StoreError::Protocol {
                script: "redis url",
                detail: format!(
                    "a Redis CA or client certificate is set but {} is not a rediss:// URL",
                    redact(url)
                ),
            });
        }
        if let Some(nodes) = cluster_nodes(url) {
            let nodes = nodes.map_err(|detail| StoreError::Protocol {
                script: "redis url",
                detail,
            })?;
            let client = cluster_builder(&nodes, &opts, tls.as_ref()).build()?;
            let conn = client.get_async_connection().await?;
            return Ok(Self {
                pubsub: PubSubSource::Cluster(nodes, opts.clone(), tls),
                conn: Conn::Cluster(conn),
                lib: &CLUSTER_LIBRARY,
                set,
                durable: durable::Durable::new(opts),
            });
        }
        let client = match tls.as_ref().and_then(RedisTls::certificates) {
            Some(certs) => redis::Client::build_with_tls(url, certs)?,
            None => redis::Client::open(url)?,
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.connect_timeout))
            .set_response_timeout(Some(opts.response_timeout))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client.clone(), config).await?;
        Ok(Self {
            pubsub: PubSubSource::Single(client),
            conn: Conn::Single(conn),
            lib: &LIBRARY,
            set,
            durable: durable::Durable::new(opts),
        })
    }

    /// Is this store on a Redis Cluster?
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    pub fn set(&self) -> &SetId {
        &self.set
    }

    /// The Redis function `FCALL` runs for the script `script` (`lease`,
    /// `lease_batch`, ...) of the library this store loads: for tools and
    /// tests that call a script directly. The name carries the library's
    /// version (a hash of its source).
    pub fn function_name(&self, script: &str) -> String {
        self.lib.function_name(script)
    }

    /// The key prefix of a queue; its `{...}` is the queue's hash tag.
    pub fn queue_prefix(&self, q: QueueId) -> String {
        keys::queue_prefix(&self.set, q)
    }

    pub(super) fn routing_key(&self) -> String {
        keys::routing(&self.set)
    }

    /// Call one function of the library on queue `q`.
    pub(super) async fn run_owned(&self, f: Func, q: QueueId, args: Vec<Vec<u8>>) -> Result<Value> {
        let refs: Vec<&[u8]> = args.iter().map(|a| a.as_slice()).collect();
        self.run(f, q, &refs).await
    }

    pub(super) async fn run(&self, f: Func, q: QueueId, args: &[&[u8]]) -> Result<Value> {
        self.call(f, &self.queue_prefix(q), args).await
    }

    pub(super) async fn call(&self, f: Func, key: &str, args: &[&[u8]]) -> Result<Value> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(f.name(self.lib));
        if f.per_queue() {
            cmd.arg(2).arg(key).arg(keys::slot_guard(key));
        } else {
            cmd.arg(1).arg(key);
        }
        for a in args {
            cmd.arg(*a);
        }
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if function_missing(&e) => {
                load_library(&mut conn, self.lib).await?;
                Ok(cmd.query_async(&mut conn).await?)
            }
            other => Ok(other?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_material_is_never_printed() {
        let tls = RedisTls {
            ca: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
            client: Some((b"cert".to_vec(), b"PRIVATE KEY BYTES".to_vec())),
        };
        let shown = format!("{tls:?}");
        assert!(!shown.contains("PRIVATE"), "{shown}");
        assert!(!shown.contains("BEGIN"), "{shown}");
    }
}
