//! Every Redis key and Lua script of lanekeeper, and nothing else.
//!
//! Each operation on a queue (enqueue, lease, ack, nack, reap, pause, resume,
//! move) is one script call: one round trip, atomic. All keys of a queue
//! share the hash tag `{<namespace>/<set>/<queue>}`, so every script touches
//! one slot and runs on Redis Cluster. The key layout is documented at the
//! top of `lua/common.lua`. The routing table of a set lives under its own
//! tag, `lk:{<namespace>/<set>}:routing`.
//!
//! Steps that span two queues (moving a hold buffer) are sequences of
//! single-queue scripts, each idempotent, so a mover that dies halfway can
//! run the whole step again.
//!
//! The same store runs on one Redis server (`redis://`, `rediss://`) or on
//! Redis Cluster (`redis+cluster://host:port[,host:port...]`, see
//! [`cluster_nodes`]): there it goes through the `redis` crate's cluster
//! client, which follows MOVED and ASK redirects and failovers. Every
//! per-queue function call declares two keys of its queue's slot, the queue
//! prefix and the prefix with the [`SLOT_GUARD`] suffix, neither of which
//! ever exists: while that slot is being migrated, Redis answers such a
//! call TRYAGAIN (on the source and on the target alike) instead of running
//! it against half-moved keys, and the client retries until the migration
//! of the slot is done (see `docs/architecture.md`, "Redis Cluster").

mod durable;
mod settings;

pub use settings::{log_at_start as log_settings_at_start, worst as worst_settings, RedisSettings};

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::Value;

use crate::endpoint::{Endpoint, InvalidEndpoint};
use crate::envelope::{Envelope, InvalidEnvelope};
use crate::policy::{attribution, QueuePolicy};
use crate::routing::{QueueId, RoutingTable};

pub mod keys;

/// A ShardSet's identity in Redis: `<namespace>/<name>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SetId {
    pub namespace: String,
    pub name: String,
}

impl SetId {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for SetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for SetId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(SetId::new(ns, name))
            }
            _ => Err(format!("{s:?}: expected <namespace>/<name>")),
        }
    }
}

/// What went wrong talking to Redis.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis did not answer within the timeout: {0}")]
    Timeout(#[source] redis::RedisError),
    #[error("redis: {0}")]
    Redis(#[source] redis::RedisError),
    #[error(transparent)]
    Invalid(#[from] InvalidEnvelope),
    #[error("invalid endpoint: {0}")]
    InvalidEndpoint(InvalidEndpoint),
    #[error("invalid cursor: a dead-letter cursor is the `cursor` of a letter listed before (<ms>-<seq>)")]
    InvalidCursor,
    #[error("stored on the Redis primary, but {acked} replicas acknowledged it within {timeout:?} (durability Replicated needs 1): it may be lost if the primary fails now; retry with the same id (a duplicate is stored once)")]
    NotReplicated { acked: u32, timeout: Duration },
    #[error("routing table missing for {0}: Redis holds no shard count for this ShardSet (it lost its state, or the controller has not written it yet); retry shortly")]
    RoutingMissing(SetId),
    #[error("unexpected reply from the {script} script: {detail}")]
    Protocol {
        script: &'static str,
        detail: String,
    },
}

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        if e.is_timeout() {
            StoreError::Timeout(e)
        } else {
            StoreError::Redis(e)
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Where an envelope went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnqueueOutcome {
    /// On the tenant's lane, with its sequence number in the queue.
    Queued { seq: u64 },
    /// In the tenant's hold buffer: the tenant is paused here while it moves.
    Held { seq: u64 },
    /// This id was stored before; nothing changed.
    Duplicate,
    /// The tenant has moved to another queue: refresh routing and retry there.
    Moved(QueueId),
    /// The tenant's backlog here (`depth`: queued, held, delayed and in
    /// flight) has reached the limit given; nothing was stored.
    Full { depth: u64 },
    /// The routing table the caller routed by is older than the queue's
    /// fence (a reshard changed the shard count): nothing was stored;
    /// refresh the table and route again.
    Stale { fence: u64 },
}

/// An envelope leased to a worker until `deadline_ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct Lease {
    pub queue: QueueId,
    pub id: String,
    pub tenant: String,
    /// The stored envelope, as enqueued. Decode with [`Lease::envelope`].
    pub payload: String,
    /// Attempts before this one.
    pub attempts: u32,
    /// Sequence number in this queue.
    pub seq: u64,
    /// The lease as the queue holds it (charge, start, id, tenant and a
    /// unique part): ack, nack and release present it.
    pub token: String,
    pub deadline_ms: u64,
    pub enqueued_ms: u64,
    /// This lease is the probe of a half-open breaker.
    pub breaker: Option<BreakerChange>,
}

impl Lease {
    /// Decode the stored envelope; a corrupt record is an error to dead-letter.
    /// Its tenant and id are the lease's, whatever the stored payload says:
    /// the queue names the envelope by both, so that is who it belongs to.
    pub fn envelope(&self) -> Result<Envelope, serde_json::Error> {
        let mut env: Envelope = serde_json::from_str(&self.payload)?;
        env.tenant.clone_from(&self.tenant);
        env.id.clone_from(&self.id);
        Ok(env)
    }
}

/// The answer to a lease request.
#[derive(Clone, Debug, PartialEq)]
pub enum LeaseOutcome {
    Leased(Lease),
    /// Nothing is eligible; look again after this long at the latest (the next
    /// retry or lease deadline falls due then; new work may come sooner).
    Empty {
        retry_after: Duration,
    },
    /// The scan budget ran out while crediting tenants; ask again at once.
    Again,
}

/// What happened to a failed delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NackOutcome {
    /// Back in the delayed set, due at `due_ms`.
    Retry {
        attempts: u32,
        due_ms: u64,
        breaker: Option<BreakerChange>,
    },
    /// On the dead-letter list.
    Dead {
        attempts: u32,
        breaker: Option<BreakerChange>,
    },
    /// The lease was gone already.
    Stale,
}

/// A failed delivery, as the worker reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure<'a> {
    /// What went wrong, for the dead letter and the logs.
    pub cause: &'a str,
    /// Retry after this long; `None` dead-letters now.
    pub retry_in: Option<Duration>,
    /// The endpoint is at fault (5xx, 429, timeout, connection error): counts
    /// against its circuit breaker.
    pub endpoint_fault: bool,
}

impl<'a> Failure<'a> {
    /// Retry after `after`.
    pub fn retry(cause: &'a str, after: Duration) -> Self {
        Self {
            cause,
            retry_in: Some(after),
            endpoint_fault: false,
        }
    }

    /// Dead-letter now.
    pub fn dead(cause: &'a str) -> Self {
        Self {
            cause,
            retry_in: None,
            endpoint_fault: false,
        }
    }

    /// Count this failure against the endpoint's circuit breaker.
    pub fn blame_endpoint(self) -> Self {
        Self {
            endpoint_fault: true,
            ..self
        }
    }
}

/// A state change of an endpoint's circuit breaker, shared by every worker of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerChange {
    /// Tripped: the endpoint's envelopes are not leased until it cools down.
    Opened,
    /// Cooled down: one probe request goes out.
    HalfOpen,
    /// The probe succeeded.
    Closed,
}

impl BreakerChange {
    fn parse(v: Option<&Value>) -> Option<Self> {
        match v.map(string).as_deref() {
            Some("open") => Some(BreakerChange::Opened),
            Some("half-open") => Some(BreakerChange::HalfOpen),
            Some("closed") => Some(BreakerChange::Closed),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerChange::Opened => "open",
            BreakerChange::HalfOpen => "half-open",
            BreakerChange::Closed => "closed",
        }
    }
}

/// The answer to an ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acked {
    /// False when the lease was gone (already acked, or expired and moved on).
    pub acked: bool,
    /// The ack closed the endpoint's breaker (a successful probe).
    pub breaker: Option<BreakerChange>,
}

/// A tenant's state in one queue, as the relocation phases need it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantQueueState {
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    pub held: u64,
    pub paused: bool,
    pub moved_to: Option<QueueId>,
    pub depth: u64,
}

impl TenantQueueState {
    /// Nothing of the tenant is queued, in flight or waiting to retry here.
    pub fn drained(&self) -> bool {
        self.queued == 0 && self.in_flight == 0 && self.delayed == 0
    }
}

/// One tenant's recent activity in one queue ([`Store::tenant_activity`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TenantActivity {
    pub state: TenantQueueState,
    pub delivered: u64,
    pub failed: u64,
    /// Worker-seconds per delivery, as the scheduler estimates it.
    pub estimate_s: Option<f64>,
    /// The tenant's worker-seconds over the window.
    pub worker_seconds: f64,
    /// Every tenant's worker-seconds in this queue over the window.
    pub queue_worker_seconds: f64,
    pub oldest_enqueued_ms: Option<u64>,
    /// Redis server time of the reading.
    pub now_ms: u64,
    pub window: Duration,
}

impl TenantActivity {
    /// The tenant's share of the queue's worker-seconds over the window.
    pub fn capacity_share(&self) -> f64 {
        if self.queue_worker_seconds > 0.0 {
            self.worker_seconds / self.queue_worker_seconds
        } else {
            0.0
        }
    }

    /// Deliveries per second over the window (worker-seconds spent divided by
    /// the cost of one delivery).
    pub fn drain_rate(&self) -> f64 {
        let per = self.estimate_s.unwrap_or(1.0).max(1e-3);
        self.worker_seconds / self.window.as_secs_f64().max(1.0) / per
    }

    /// How long the oldest queued envelope has waited.
    pub fn oldest_wait(&self) -> Option<Duration> {
        self.oldest_enqueued_ms
            .map(|n| Duration::from_millis(self.now_ms.saturating_sub(n)))
    }
}

/// One of a tenant's dead letters.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    pub id: String,
    pub tenant: String,
    pub attempts: u32,
    pub cause: String,
    pub at: u64,
    /// The stored envelope (empty when its record was missing).
    pub envelope: String,
    /// Where it is in the tenant's dead letters: a page that ends here
    /// continues after it.
    pub cursor: String,
}

/// One page of a tenant's dead letters, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterPage {
    pub letters: Vec<DeadLetter>,
    /// Pass as `after` for the next page; `None` when this was the last.
    pub next: Option<String>,
}

/// A tenant's dead letters in a queue are listed and replayed by pages of at
/// most this many: one call's work is bounded whatever their number.
pub const DEAD_LETTER_PAGE: usize = 1000;
/// The page a whole replay walks by: a few milliseconds of Redis work per
/// call (each letter is a record written and a lane entry), so queues that
/// share the Redis never wait long behind it.
pub const REPLAY_PAGE: usize = 250;

/// What one replay step did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayPage {
    pub replayed: u64,
    /// Letters looked at (replayed or not).
    pub examined: u64,
    /// Where the next step starts; `None` when the tenant's letters are done.
    pub next: Option<String>,
}

pub use crate::policy::TenantStats;

/// One data-plane operation: a function of the [`Library`].
#[derive(Clone, Copy, Debug)]
enum Func {
    Enqueue,
    Lease,
    Ack,
    AckLease,
    Release,
    Nack,
    Maintain,
    Pause,
    Status,
    MarkMoved,
    Resume,
    ExportHold,
    Import,
    TrimHold,
    ReplayDead,
    Claims,
    RoutingUpdate,
    Gate,
}

impl Func {
    const ALL: [Func; 18] = [
        Func::Enqueue,
        Func::Lease,
        Func::Ack,
        Func::AckLease,
        Func::Release,
        Func::Nack,
        Func::Maintain,
        Func::Pause,
        Func::Status,
        Func::MarkMoved,
        Func::Resume,
        Func::ExportHold,
        Func::Import,
        Func::TrimHold,
        Func::ReplayDead,
        Func::Claims,
        Func::RoutingUpdate,
        Func::Gate,
    ];

    /// The function's name within the library, and its Lua body.
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Func::Enqueue => ("enqueue", include_str!("lua/enqueue.lua")),
            Func::Lease => ("lease", include_str!("lua/lease.lua")),
            Func::Ack => ("ack", include_str!("lua/ack.lua")),
            Func::AckLease => ("ack_lease", include_str!("lua/ack_lease.lua")),
            Func::Release => ("release", include_str!("lua/release.lua")),
            Func::Nack => ("nack", include_str!("lua/nack.lua")),
            Func::Maintain => ("maintain", include_str!("lua/maintain.lua")),
            Func::Pause => ("pause", include_str!("lua/pause.lua")),
            Func::Status => ("status", include_str!("lua/status.lua")),
            Func::MarkMoved => ("mark_moved", include_str!("lua/mark_moved.lua")),
            Func::Resume => ("resume", include_str!("lua/resume.lua")),
            Func::ExportHold => ("export_hold", include_str!("lua/export_hold.lua")),
            Func::Import => ("import", include_str!("lua/import.lua")),
            Func::TrimHold => ("trim_hold", include_str!("lua/trim_hold.lua")),
            Func::ReplayDead => ("replay_dead", include_str!("lua/replay_dead.lua")),
            Func::Claims => ("claims", include_str!("lua/claims.lua")),
            Func::RoutingUpdate => ("routing_update", include_str!("lua/routing_update.lua")),
            Func::Gate => ("gate", include_str!("lua/gate.lua")),
        }
    }

    /// Per-queue functions bind their queue first (`begin` in common.lua);
    /// `routing_update` works on the set's routing hash.
    fn per_queue(self) -> bool {
        !matches!(self, Func::RoutingUpdate | Func::Gate)
    }

    fn name(self, lib: &Library) -> String {
        format!("{}_{}", lib.name, self.source().0)
    }
}

/// Every script, as one Redis Functions library (Redis 7+). Its helpers'
/// closures are built once, when the library loads, instead of on every call
/// as with EVALSHA (that cost about 4 µs per call, a tenth of a lease+ack).
///
/// The library's name carries a hash of its source, so two lanekeeper
/// versions sharing one Redis during a rolling upgrade each call their own
/// functions. It is loaded on first use and again whenever Redis answers
/// that a function is missing (after a restart without persistence, or on a
/// new cluster node); on a cluster it is loaded on every primary.
///
/// There are two variants of the library, differing only in how a queue
/// wakes idle workers: on one server `PUBLISH`, on a cluster `SPUBLISH`
/// (sharded pub/sub: the message stays within the shard that owns the
/// queue's slot instead of crossing the whole cluster bus). A Redis is either
/// a cluster or not, so the two never meet on one server.
struct Library {
    name: String,
    code: String,
}

const COMMON: &str = include_str!("lua/common.lua");
const DELIVER: &str = include_str!("lua/deliver.lua");

/// The suffix of the second key every per-queue call declares: a key of the
/// queue's slot that no script ever writes (see the module documentation).
pub const SLOT_GUARD: &str = ":~slotguard";

fn build_library(cluster: bool) -> Library {
    use blake2::digest::{Update, VariableOutput};
    let common = if cluster {
        COMMON.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    } else {
        COMMON.to_string()
    };
    let mut hasher = blake2::Blake2bVar::new(8).expect("8 is a valid blake2b output size");
    hasher.update(common.as_bytes());
    hasher.update(DELIVER.as_bytes());
    for f in Func::ALL {
        let (name, body) = f.source();
        hasher.update(name.as_bytes());
        hasher.update(body.as_bytes());
    }
    let mut digest = [0u8; 8];
    hasher
        .finalize_variable(&mut digest)
        .expect("the buffer has the output size");
    let name = format!("lanekeeper_{:016x}", u64::from_be_bytes(digest));
    let mut code = format!("#!lua name={name}\n{common}\n{DELIVER}\n");
    for f in Func::ALL {
        let (fname, body) = f.source();
        let begin = if f.per_queue() { "begin(KEYS)\n" } else { "" };
        code.push_str(&format!(
            "redis.register_function('{name}_{fname}', function(KEYS, ARGV)\n{begin}{body}\nend)\n"
        ));
    }
    Library { name, code }
}

static LIBRARY: LazyLock<Library> = LazyLock::new(|| build_library(false));
static CLUSTER_LIBRARY: LazyLock<Library> = LazyLock::new(|| build_library(true));

/// Redis answered that the called function does not exist (yet).
fn function_missing(e: &redis::RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// Load the library; a copy already there (another process won) is fine.
/// On a cluster, `FUNCTION LOAD` goes to every primary (the cluster client
/// routes it so); `REPLACE` makes a primary that has it already (identical
/// code: the name is its hash) no error.
async fn load_library(conn: &mut Conn, lib: &Library) -> Result<()> {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD");
    if matches!(conn, Conn::Cluster(_)) {
        cmd.arg("REPLACE");
    }
    let loaded: redis::RedisResult<Value> = cmd.arg(&lib.code).query_async(conn).await;
    match loaded {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("already exists") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A connection to one Redis server, or to a Redis Cluster through the
/// cluster client (which routes each command to the primary owning its
/// slot and follows MOVED, ASK and failovers). Both are cheap to clone.
#[derive(Clone)]
enum Conn {
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
enum PubSubSource {
    Single(redis::Client),
    /// The cluster's seed node URLs, the connection tuning and the TLS material.
    Cluster(Vec<String>, ConnectOptions, Option<RedisTls>),
}

/// The cluster client for `nodes`. Its retries follow redirects, TRYAGAIN
/// (a slot mid-migration) and failovers: up to 15 tries, 10 ms to 1 s apart
/// with jitter (the crate's default waits at least 1.28 s between tries).
fn cluster_builder(
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

/// Is `url` a TLS URL (`rediss://` or `rediss+cluster://`)?
pub fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("rediss+cluster://")
}

/// The URL schemes that mean Redis Cluster.
pub const CLUSTER_SCHEMES: [&str; 2] = ["redis+cluster", "rediss+cluster"];

/// The seed nodes of a Redis Cluster URL, as one `redis://` (or `rediss://`)
/// URL each: `redis+cluster://[user:password@]host:port[,host:port...][/][?query]`
/// gives `redis://[user:password@]host:port[?query]` per node (port 6379
/// when omitted). `None` when `url` is not a cluster URL. A cluster has only
/// database 0, so a path other than `/` or `/0` is an error.
pub fn cluster_nodes(url: &str) -> Option<std::result::Result<Vec<String>, String>> {
    let (scheme, rest) = url.split_once("://")?;
    let base = match scheme {
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        _ => return None,
    };
    Some((|| {
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (path, query) = match tail.split_once('?') {
            Some((p, q)) => (p, format!("?{q}")),
            None => (tail, String::new()),
        };
        if !matches!(path, "" | "/" | "/0") {
            return Err(format!(
                "redis url {:?}: a cluster has only database 0, not {path:?}",
                redact(url)
            ));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        let mut nodes = Vec::new();
        for host in hosts.split(',') {
            if host.is_empty() {
                return Err(format!(
                    "redis url {:?}: empty host in the node list",
                    redact(url)
                ));
            }
            let has_port = match host.rfind(']') {
                Some(i) => host[i..].contains(':'),
                None => host.contains(':'),
            };
            let port = if has_port { "" } else { ":6379" };
            let node = format!("{base}://{userinfo}{host}{port}{query}");
            url::Url::parse(&node)
                .map_err(|e| format!("redis url {:?}: node {host:?}: {e}", redact(url)))?;
            nodes.push(node);
        }
        Ok(nodes)
    })())
}

/// Envelopes per enqueue script call in a batch.
pub const ENQUEUE_CHUNK: usize = 200;
/// Envelopes moved per step when a hold buffer changes queue.
const MOVE_CHUNK: usize = 500;
/// Idempotency claims copied per step when a tenant moves.
const CLAIMS_CHUNK: usize = 1000;
/// Tenants a lease may credit and rotate before it answers `Again`.
const LEASE_SCAN_BUDGET: u32 = 256;

/// A connection to the Redis of one ShardSet.
#[derive(Clone)]
pub struct Store {
    pubsub: PubSubSource,
    conn: Conn,
    lib: &'static Library,
    set: SetId,
    /// The connection of `Replicated` enqueues and their `WAIT`s, opened on
    /// first use (see [`durable`]).
    durable: std::sync::Arc<durable::Durable>,
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

    /// The key prefix of a queue; its `{...}` is the queue's hash tag.
    pub fn queue_prefix(&self, q: QueueId) -> String {
        format!("lk:{{{}/{}/{q}}}", self.set.namespace, self.set.name)
    }

    fn routing_key(&self) -> String {
        format!("lk:{{{}/{}}}:routing", self.set.namespace, self.set.name)
    }

    /// Call one function of the library on queue `q`.
    async fn run_owned(&self, f: Func, q: QueueId, args: Vec<Vec<u8>>) -> Result<Value> {
        let refs: Vec<&[u8]> = args.iter().map(|a| a.as_slice()).collect();
        self.run(f, q, &refs).await
    }

    async fn run(&self, f: Func, q: QueueId, args: &[&[u8]]) -> Result<Value> {
        self.call(f, &self.queue_prefix(q), args).await
    }

    async fn call(&self, f: Func, key: &str, args: &[&[u8]]) -> Result<Value> {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(f.name(self.lib));
        if f.per_queue() {
            cmd.arg(2).arg(key).arg(format!("{key}{SLOT_GUARD}"));
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

    // ---- routing table -------------------------------------------------

    /// Read the set's routing table.
    pub async fn routing(&self) -> Result<RoutingTable> {
        let mut conn = self.conn.clone();
        let fields: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(self.routing_key())
            .query_async(&mut conn)
            .await?;
        let mut table = RoutingTable::default();
        for (k, v) in fields {
            let bad = |detail: String| StoreError::Protocol {
                script: "routing table",
                detail,
            };
            match k.as_str() {
                "shards" => table.shards = v.parse().map_err(|_| bad(format!("shards = {v:?}")))?,
                "version" => {
                    table.version = v.parse().map_err(|_| bad(format!("version = {v:?}")))?
                }
                "epoch" => table.epoch = Some(v),
                "replicated" => {
                    let ms: u64 = v.parse().map_err(|_| bad(format!("replicated = {v:?}")))?;
                    table.replicated = (ms > 0).then(|| Duration::from_millis(ms));
                }
                _ => {
                    if let Some(tenant) = k.strip_prefix("pin:") {
                        let q = v
                            .parse()
                            .map_err(|e| bad(format!("pin of {tenant}: {e}")))?;
                        table.pins.insert(tenant.to_string(), q);
                    }
                }
            }
        }
        Ok(table)
    }

    async fn routing_update(&self, op: &str, a: &str, b: &str) -> Result<u64> {
        let v = self
            .call(
                Func::RoutingUpdate,
                &self.routing_key(),
                &[op.as_bytes(), a.as_bytes(), b.as_bytes()],
            )
            .await?;
        Ok(int(&v))
    }

    /// Mark this Redis's state with `epoch` unless it is marked already;
    /// returns the mark Redis holds. The controller writes it last when it
    /// writes (or restores) a routing table, so a table without it is one
    /// Redis lost.
    pub async fn mark_epoch(&self, epoch: &str) -> Result<String> {
        let mut conn = self.conn.clone();
        let (_, held): (u8, String) = redis::pipe()
            .atomic()
            .cmd("HSETNX")
            .arg(self.routing_key())
            .arg("epoch")
            .arg(epoch)
            .cmd("HGET")
            .arg(self.routing_key())
            .arg("epoch")
            .query_async(&mut conn)
            .await?;
        Ok(held)
    }

    /// Write the set's durability into its routing table, where producers
    /// read it: `Some(timeout)` for `Replicated` (wait up to `timeout` for a
    /// replica), `None` for `Fast`. Not a routing change: the version stays.
    pub async fn set_durability(&self, replicated: Option<Duration>) -> Result<()> {
        let ms = replicated.map(|d| d.as_millis().max(1) as u64).unwrap_or(0);
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(self.routing_key())
            .arg("replicated")
            .arg(ms)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Is the routing table there (a shard count written)? One HEXISTS,
    /// cheap enough to poll.
    pub async fn routing_present(&self) -> Result<bool> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("HEXISTS")
            .arg(self.routing_key())
            .arg("shards")
            .query_async(&mut conn)
            .await?)
    }

    /// Is Redis answering?
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }

    // ---- lane moves and reshards take turns (gate.lua) ------------------

    /// A lane (admitted under `index`) may start moving its tenant: true, and
    /// it is recorded as moving, unless a reshard of the set runs or waits
    /// to run (false: try again later).
    pub async fn lane_move_begin(&self, index: i32, lane: &str) -> Result<bool> {
        let i = index.to_string();
        let v = self
            .call(
                Func::Gate,
                &self.routing_key(),
                &[b"lane_begin", i.as_bytes(), lane.as_bytes()],
            )
            .await?;
        Ok(string(&v) == "OK")
    }

    /// The lane's move is over (Active, Retired, or given up).
    pub async fn lane_move_end(&self, index: i32, lane: &str) -> Result<()> {
        let i = index.to_string();
        self.call(
            Func::Gate,
            &self.routing_key(),
            &[b"lane_end", i.as_bytes(), lane.as_bytes()],
        )
        .await?;
        Ok(())
    }

    /// A reshard may start: `Ok(())` and it holds the gate, or the names of
    /// the lanes still moving (it then waits for them, and new lane moves
    /// wait for it). `lanes`: the set's DedicatedLanes that exist, so a lane
    /// deleted mid-move does not hold the gate forever.
    pub async fn reshard_begin(
        &self,
        lanes: &[String],
    ) -> Result<std::result::Result<(), Vec<String>>> {
        let mut args: Vec<&[u8]> = vec![b"reshard_begin"];
        args.extend(lanes.iter().map(|l| l.as_bytes()));
        let items = array(
            "gate",
            self.call(Func::Gate, &self.routing_key(), &args).await?,
        )?;
        match tag(&items).as_deref() {
            Some("OK") => Ok(Ok(())),
            Some("WAIT") => Ok(Err(items[1..].iter().map(string).collect())),
            _ => Err(unexpected("gate", &items)),
        }
    }

    /// The reshard is over: lane moves may start again.
    pub async fn reshard_end(&self) -> Result<()> {
        self.call(Func::Gate, &self.routing_key(), &[b"reshard_end"])
            .await?;
        Ok(())
    }

    /// Set the shard count; returns the new version (unchanged if equal).
    pub async fn set_shards(&self, shards: u16) -> Result<u64> {
        self.routing_update("shards", &shards.to_string(), "").await
    }

    /// Pin a tenant to a queue; returns the new version.
    pub async fn pin(&self, tenant: &str, q: QueueId) -> Result<u64> {
        self.routing_update("pin", tenant, &q.to_string()).await
    }

    /// Remove a tenant's pin; returns the new version.
    pub async fn unpin(&self, tenant: &str) -> Result<u64> {
        self.routing_update("unpin", tenant, "").await
    }

    /// Fence `q` at routing version `version`: from now on an enqueue routed
    /// by an older table answers STALE (the caller refreshes its table). A
    /// reshard fences every shard queue before it changes the shard count,
    /// so no producer still hashing by the old count can enqueue anywhere.
    /// Never lowers an existing fence.
    pub async fn fence_routing(&self, q: QueueId, version: u64) -> Result<()> {
        let key = format!("{}:conf", self.queue_prefix(q));
        let mut conn = self.conn.clone();
        let current: Option<u64> = redis::cmd("HGET")
            .arg(&key)
            .arg("minroute")
            .query_async(&mut conn)
            .await?;
        if current.unwrap_or(0) < version {
            redis::cmd("HSET")
                .arg(&key)
                .arg("minroute")
                .arg(version)
                .query_async::<()>(&mut conn)
                .await?;
        }
        Ok(())
    }

    /// Pin many tenants at once (one pipelined round trip per chunk); each
    /// pin is its own idempotent update, so a partial run can be repeated.
    pub async fn pin_many(&self, pins: &[(String, QueueId)]) -> Result<()> {
        for chunk in pins.chunks(500) {
            let mut pipe = redis::pipe();
            for (tenant, q) in chunk {
                pipe.cmd("FCALL")
                    .arg(Func::RoutingUpdate.name(self.lib))
                    .arg(1)
                    .arg(self.routing_key())
                    .arg("pin")
                    .arg(tenant)
                    .arg(q.to_string())
                    .ignore();
            }
            let mut conn = self.conn.clone();
            match pipe.query_async::<()>(&mut conn).await {
                Err(e) if function_missing(&e) => {
                    load_library(&mut conn, self.lib).await?;
                    pipe.query_async::<()>(&mut conn).await?
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// The tenants that live in `q`: they have had work here and are not
    /// marked as moved away (a reshard plans its moves from these).
    pub async fn residents(&self, q: QueueId) -> Result<Vec<String>> {
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let tenants: Vec<String> = redis::cmd("SMEMBERS")
            .arg(format!("{p}:tenants"))
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(tenants.len());
        for chunk in tenants.chunks(1000) {
            let mut pipe = redis::pipe();
            for t in chunk {
                pipe.hget(format!("{p}:t:{t}"), "m");
            }
            let moved: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
            out.extend(
                chunk
                    .iter()
                    .zip(moved)
                    .filter(|(_, m)| m.as_deref().unwrap_or("").is_empty())
                    .map(|(t, _)| t.clone()),
            );
        }
        Ok(out)
    }

    // ---- endpoint registry ----------------------------------------------

    fn endpoints_key(&self, tenant: &str) -> String {
        format!(
            "lk:{{{}/{}}}:endpoints:{tenant}",
            self.set.namespace, self.set.name
        )
    }

    /// Create or replace a tenant's endpoint.
    pub async fn put_endpoint(&self, tenant: &str, name: &str, endpoint: &Endpoint) -> Result<()> {
        crate::envelope::validate_tenant(tenant)?;
        endpoint.validate().map_err(StoreError::InvalidEndpoint)?;
        let json = serde_json::to_string(endpoint).map_err(|e| StoreError::Protocol {
            script: "endpoint registry",
            detail: e.to_string(),
        })?;
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .arg(json)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// One endpoint of a tenant, if registered.
    pub async fn endpoint(&self, tenant: &str, name: &str) -> Result<Option<Endpoint>> {
        let mut conn = self.conn.clone();
        let raw: Option<String> = redis::cmd("HGET")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .query_async(&mut conn)
            .await?;
        raw.map(|r| decode_endpoint(tenant, name, &r)).transpose()
    }

    /// Every endpoint of a tenant, by name.
    pub async fn endpoints(&self, tenant: &str) -> Result<BTreeMap<String, Endpoint>> {
        let mut conn = self.conn.clone();
        let raw: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(self.endpoints_key(tenant))
            .query_async(&mut conn)
            .await?;
        raw.iter()
            .map(|(name, r)| Ok((name.clone(), decode_endpoint(tenant, name, r)?)))
            .collect()
    }

    /// Remove a tenant's endpoint; false if there was none.
    pub async fn delete_endpoint(&self, tenant: &str, name: &str) -> Result<bool> {
        let mut conn = self.conn.clone();
        let n: u32 = redis::cmd("HDEL")
            .arg(self.endpoints_key(tenant))
            .arg(name)
            .query_async(&mut conn)
            .await?;
        Ok(n > 0)
    }

    // ---- queue policy --------------------------------------------------

    /// Write the fairness policy a queue's scripts read.
    pub async fn configure_queue(&self, q: QueueId, policy: &QueuePolicy) -> Result<()> {
        let p = self.queue_prefix(q);
        let fields = [
            ("quantum", policy.quantum_seconds.to_string()),
            ("cap", policy.max_in_flight.to_string()),
            (
                "ordered",
                if policy.ordered { "1" } else { "0" }.to_string(),
            ),
            ("weight", policy.default_weight.to_string()),
            ("est0", policy.initial_estimate_seconds.to_string()),
            ("maxatt", policy.max_attempts.to_string()),
            (
                "idttl",
                policy.idempotency_window.as_secs().max(1).to_string(),
            ),
            ("bratio", policy.breaker.failure_ratio.to_string()),
            ("bmin", policy.breaker.min_requests.to_string()),
            ("bwin", policy.breaker.window.as_millis().to_string()),
            ("bopen", policy.breaker.open_for.as_millis().to_string()),
            (
                "dlmax",
                policy.dead_letters.max_per_tenant.max(1).to_string(),
            ),
            (
                "dlage",
                policy.dead_letters.max_age.as_secs().max(1).to_string(),
            ),
        ];
        // The scripts read the policy as one field (see common.lua); the
        // fields one by one are what library versions before it read, kept
        // while such workers may still run during a rolling upgrade.
        let packed = fields
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset_multiple(format!("{p}:conf"), &fields)
            .ignore()
            .hset(format!("{p}:conf"), "policy", packed)
            .ignore()
            .del(format!("{p}:weights"))
            .ignore();
        if !policy.weights.is_empty() {
            let weights: Vec<(String, String)> = policy
                .weights
                .iter()
                .map(|(t, w)| (t.clone(), w.to_string()))
                .collect();
            pipe.hset_multiple(format!("{p}:weights"), &weights)
                .ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    // ---- enqueue -------------------------------------------------------

    /// Enqueue one envelope into `q` (one script call). The script decides,
    /// atomically, whether it is queued, held (tenant paused) or refused with
    /// MOVED (tenant gone); the caller routes, this does not.
    pub async fn enqueue(&self, q: QueueId, env: &Envelope) -> Result<EnqueueOutcome> {
        self.enqueue_limited(q, env, None).await
    }

    /// Enqueue one envelope unless its tenant's backlog in `q` has reached
    /// `limit` (then [`EnqueueOutcome::Full`], and nothing is stored).
    pub async fn enqueue_limited(
        &self,
        q: QueueId,
        env: &Envelope,
        limit: Option<u64>,
    ) -> Result<EnqueueOutcome> {
        let payload = encode(env)?;
        let limit = limit.unwrap_or(0).to_string();
        let v = self
            .run(
                Func::Enqueue,
                q,
                &[
                    env.id.as_bytes(),
                    env.tenant.as_bytes(),
                    env.endpoint_name().as_bytes(),
                    &payload,
                    limit.as_bytes(),
                ],
            )
            .await?;
        let items = array("enqueue", v)?;
        match items.as_slice() {
            [tag, value] => parse_enqueue(tag, value),
            _ => Err(unexpected("enqueue", &items)),
        }
    }

    /// Enqueue many envelopes into `q`: up to [`ENQUEUE_CHUNK`] per script
    /// call, all calls in one pipeline (one round trip). Invalid envelopes get
    /// their error; the others are stored. Safe to repeat: ids are
    /// idempotency keys.
    pub async fn enqueue_batch(
        &self,
        q: QueueId,
        envs: &[Envelope],
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        self.enqueue_batch_limited(q, envs, |_| None).await
    }

    /// [`Store::enqueue_batch`] with a backlog limit per tenant: envelopes of
    /// a tenant whose depth in `q` has reached `limit(tenant)` answer
    /// [`EnqueueOutcome::Full`] and are not stored.
    pub async fn enqueue_batch_limited(
        &self,
        q: QueueId,
        envs: &[Envelope],
        limit: impl Fn(&str) -> Option<u64>,
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        self.enqueue_batch_routed(q, envs, limit, 0).await
    }

    /// [`Store::enqueue_batch_limited`] by a caller that routed with the
    /// routing table of version `routed`: if the queue's fence is newer, every
    /// envelope answers [`EnqueueOutcome::Stale`] and nothing is stored.
    pub async fn enqueue_batch_routed(
        &self,
        q: QueueId,
        envs: &[Envelope],
        limit: impl Fn(&str) -> Option<u64>,
        routed: u64,
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        let prefix = self.queue_prefix(q);
        let guard = format!("{prefix}{SLOT_GUARD}");
        let function = Func::Enqueue.name(self.lib);
        let mut results: Vec<Option<Result<EnqueueOutcome>>> = Vec::with_capacity(envs.len());
        let mut valid: Vec<(usize, Vec<u8>)> = Vec::with_capacity(envs.len());
        for (i, env) in envs.iter().enumerate() {
            match encode(env) {
                Err(e) => results.push(Some(Err(e))),
                Ok(payload) => {
                    results.push(None);
                    valid.push((i, payload));
                }
            }
        }
        // Each tenant's envelopes side by side (a stable sort: a tenant's
        // order is kept), so a call carries few tenants: the script's work is
        // per tenant as well as per envelope (state, claims, lane push).
        valid.sort_by(|a, b| envs[a.0].tenant.cmp(&envs[b.0].tenant));
        let mut pipe = redis::pipe();
        for chunk in valid.chunks(ENQUEUE_CHUNK) {
            let cmd = pipe
                .cmd("FCALL")
                .arg(&function)
                .arg(2)
                .arg(&prefix)
                .arg(&guard);
            for (i, payload) in chunk {
                let env = &envs[*i];
                cmd.arg(&env.id)
                    .arg(&env.tenant)
                    .arg(env.endpoint_name())
                    .arg(payload)
                    .arg(limit(&env.tenant).unwrap_or(0));
            }
            if routed > 0 {
                cmd.arg(routed);
            }
        }
        if !valid.is_empty() {
            let mut conn = self.conn.clone();
            let replies: Vec<Value> = match pipe.query_async(&mut conn).await {
                Ok(r) => r,
                Err(e) if function_missing(&e) => {
                    load_library(&mut conn, self.lib).await?;
                    pipe.query_async(&mut conn).await?
                }
                Err(e) => return Err(e.into()),
            };
            for (chunk, reply) in valid.chunks(ENQUEUE_CHUNK).zip(replies) {
                let items = array("enqueue", reply)?;
                if items.len() != 2 * chunk.len() {
                    return Err(unexpected("enqueue", &items));
                }
                for ((i, _), pair) in chunk.iter().zip(items.chunks(2)) {
                    results[*i] = Some(parse_enqueue(&pair[0], &pair[1]));
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every slot filled"))
            .collect())
    }

    // ---- lease, ack, nack ----------------------------------------------

    /// Lease the next envelope of `q` by deficit round robin (one script call).
    pub async fn lease(
        &self,
        q: QueueId,
        worker: &str,
        lease_for: Duration,
    ) -> Result<LeaseOutcome> {
        let ms = lease_for.as_millis().max(1).to_string();
        let budget = LEASE_SCAN_BUDGET.to_string();
        let token = lease_token(worker);
        let v = self
            .run(
                Func::Lease,
                q,
                &[ms.as_bytes(), token.as_bytes(), budget.as_bytes()],
            )
            .await?;
        parse_lease(q, &array("lease", v)?)
    }

    /// Acknowledge `done` and lease the next envelope of the same queue in
    /// one script call: the worker's loop after each delivery, at one round
    /// trip instead of two. The bool is what [`Store::ack`] would return.
    pub async fn ack_and_lease(
        &self,
        done: &Lease,
        elapsed: Duration,
        worker: &str,
        lease_for: Duration,
    ) -> Result<(Acked, LeaseOutcome)> {
        let us = elapsed.as_micros().to_string();
        let ms = lease_for.as_millis().max(1).to_string();
        let budget = LEASE_SCAN_BUDGET.to_string();
        let token = lease_token(worker);
        let v = self
            .run(
                Func::AckLease,
                done.queue,
                &[
                    done.id.as_bytes(),
                    done.token.as_bytes(),
                    us.as_bytes(),
                    ms.as_bytes(),
                    token.as_bytes(),
                    budget.as_bytes(),
                ],
            )
            .await?;
        let items = array("ack_lease", v)?;
        match items.as_slice() {
            [acked, change, lease @ ..] => Ok((
                Acked {
                    acked: string(acked) == "OK",
                    breaker: BreakerChange::parse(Some(change)),
                },
                parse_lease(done.queue, lease)?,
            )),
            _ => Err(unexpected("ack_lease", &items)),
        }
    }

    /// Acknowledge a delivery that took `elapsed`. Idempotent: a second ack,
    /// or an ack for a lease that expired and moved on, returns false.
    pub async fn ack(&self, lease: &Lease, elapsed: Duration) -> Result<bool> {
        let us = elapsed.as_micros().to_string();
        let v = self
            .run(
                Func::Ack,
                lease.queue,
                &[lease.id.as_bytes(), lease.token.as_bytes(), us.as_bytes()],
            )
            .await?;
        let items = array("ack", v)?;
        Ok(tag(&items).as_deref() == Some("OK"))
    }

    /// Report a failed delivery. With `retry_in`, the envelope waits in the
    /// delayed set and then returns to the head of its lane; with `None`, or
    /// after the last attempt, it is dead-lettered with the cause.
    pub async fn nack(
        &self,
        lease: &Lease,
        elapsed: Duration,
        failure: &Failure<'_>,
    ) -> Result<NackOutcome> {
        let us = elapsed.as_micros().to_string();
        let delay = failure.retry_in.unwrap_or_default().as_millis().to_string();
        let flag = |b: bool| if b { "1" } else { "0" };
        let v = self
            .run(
                Func::Nack,
                lease.queue,
                &[
                    lease.id.as_bytes(),
                    lease.token.as_bytes(),
                    us.as_bytes(),
                    delay.as_bytes(),
                    flag(failure.retry_in.is_none()).as_bytes(),
                    failure.cause.as_bytes(),
                    flag(failure.endpoint_fault).as_bytes(),
                ],
            )
            .await?;
        let items = array("nack", v)?;
        match tag(&items).as_deref() {
            Some("RETRY") => Ok(NackOutcome::Retry {
                attempts: items.get(1).map(int).unwrap_or(0) as u32,
                due_ms: items.get(2).map(int).unwrap_or(0),
                breaker: BreakerChange::parse(items.get(3)),
            }),
            Some("DEAD") => Ok(NackOutcome::Dead {
                attempts: items.get(1).map(int).unwrap_or(0) as u32,
                breaker: BreakerChange::parse(items.get(3)),
            }),
            Some("STALE") => Ok(NackOutcome::Stale),
            _ => Err(unexpected("nack", &items)),
        }
    }

    /// Give a leased envelope back undelivered (a worker shutting down): it
    /// returns to the head of its lane, no attempt counted. False if the
    /// lease was gone.
    pub async fn release(&self, lease: &Lease) -> Result<bool> {
        let v = self
            .run(
                Func::Release,
                lease.queue,
                &[lease.id.as_bytes(), lease.token.as_bytes()],
            )
            .await?;
        Ok(string(&v) == "OK")
    }

    /// Promote due retries and reap expired leases, up to `limit` of each.
    /// Returns (promoted, reaped). Leases do a little of this on every call;
    /// workers also run it on a timer so an idle queue still recovers.
    pub async fn maintain(&self, q: QueueId, limit: u32) -> Result<(u64, u64)> {
        let v = self
            .run(Func::Maintain, q, &[limit.to_string().as_bytes()])
            .await?;
        let items = array("maintain", v)?;
        Ok((
            items.first().map(int).unwrap_or(0),
            items.get(1).map(int).unwrap_or(0),
        ))
    }

    /// A stream that yields whenever a tenant becomes active in `q` (new
    /// work for idle workers), from the queue's pub/sub channel. It ends
    /// when the connection drops; workers then fall back to polling and
    /// subscribe again.
    pub async fn wakeups(
        &self,
        q: QueueId,
    ) -> Result<impl futures::Stream<Item = ()> + Send + use<>> {
        use futures::StreamExt;
        let channel = format!("{}:wake", self.queue_prefix(q));
        match &self.pubsub {
            PubSubSource::Single(client) => {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(channel).await?;
                Ok(pubsub.into_on_message().map(|_| ()).boxed())
            }
            PubSubSource::Cluster(nodes, opts, tls) => {
                // Sharded pub/sub (the cluster library SPUBLISHes): the
                // cluster client sends SSUBSCRIBE to the node owning the
                // channel's slot and passes messages on as RESP3 pushes.
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let client = cluster_builder(nodes, opts, tls.as_ref())
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(tx)
                    .build()?;
                let mut conn = client.get_async_connection().await?;
                conn.ssubscribe(&channel).await?;
                Ok(
                    futures::stream::unfold((rx, conn), |(mut rx, conn)| async move {
                        loop {
                            match rx.recv().await?.kind {
                                redis::PushKind::SMessage => return Some(((), (rx, conn))),
                                // The node dropped the subscription (its slot
                                // moved away) or the connection: end, and the
                                // worker subscribes again where the slot is now.
                                redis::PushKind::SUnsubscribe | redis::PushKind::Disconnection => {
                                    return None
                                }
                                _ => continue,
                            }
                        }
                    })
                    .boxed(),
                )
            }
        }
    }

    // ---- relocation primitives -----------------------------------------

    /// Pause `tenant` in `q`: its new envelopes go to the hold buffer.
    pub async fn pause(&self, q: QueueId, tenant: &str) -> Result<()> {
        self.run(Func::Pause, q, &[tenant.as_bytes()]).await?;
        Ok(())
    }

    /// The tenant's state in `q`: is it drained, paused, moved?
    pub async fn tenant_state(&self, q: QueueId, tenant: &str) -> Result<TenantQueueState> {
        let v = self.run(Func::Status, q, &[tenant.as_bytes()]).await?;
        let items = array("status", v)?;
        if items.len() != 7 {
            return Err(unexpected("status", &items));
        }
        let moved = string(&items[5]);
        Ok(TenantQueueState {
            queued: int(&items[0]),
            in_flight: int(&items[1]),
            delayed: int(&items[2]),
            held: int(&items[3]),
            paused: int(&items[4]) == 1,
            moved_to: if moved.is_empty() {
                None
            } else {
                moved.parse().ok()
            },
            depth: int(&items[6]),
        })
    }

    /// Mark `tenant` as moved from `q` to `target`: enqueues into `q` answer
    /// MOVED from now on. Refused (returns false) unless the tenant is paused
    /// and drained in `q`.
    ///
    /// The tenant's idempotency claims travel first: every id `q` claimed for
    /// it is copied to `target` (in bounded steps), and ids claimed while the
    /// copy runs are tracked and copied too; the mark is set only in the same
    /// script call that finds none left uncopied. So a producer's retry of
    /// an id accepted before the move is still a duplicate after it.
    /// Idempotent: after a crash it is simply called again.
    pub async fn mark_moved(&self, q: QueueId, tenant: &str, target: QueueId) -> Result<bool> {
        let state = self.tenant_state(q, tenant).await?;
        if !state.paused || !state.drained() {
            return Ok(false);
        }
        let t = tenant.as_bytes();
        let claims = |op: &'static str, rest: Vec<Vec<u8>>| {
            let mut args: Vec<Vec<u8>> = vec![op.as_bytes().to_vec(), t.to_vec()];
            args.extend(rest);
            args
        };
        let periods = self
            .run_owned(Func::Claims, q, claims("begin", vec![]))
            .await?;
        for period in array("claims", periods)?.iter().map(int) {
            let mut cursor = "0".to_string();
            loop {
                let page = array(
                    "claims",
                    self.run_owned(
                        Func::Claims,
                        q,
                        claims(
                            "scan",
                            vec![
                                period.to_string().into_bytes(),
                                cursor.clone().into_bytes(),
                                (CLAIMS_CHUNK / 2).to_string().into_bytes(),
                            ],
                        ),
                    )
                    .await?,
                )?;
                let Some((next, ids)) = page.split_first() else {
                    return Err(unexpected("claims", &page));
                };
                // SSCAN's count is a hint: a step may return more
                for chunk in ids.chunks(CLAIMS_CHUNK) {
                    let chunk: Vec<Vec<u8>> = chunk.iter().map(bytes).collect();
                    self.run_owned(Func::Claims, target, claims("import", chunk))
                        .await?;
                }
                cursor = string(next);
                if cursor == "0" {
                    break;
                }
            }
        }
        loop {
            let v = self
                .run(
                    Func::MarkMoved,
                    q,
                    &[tenant.as_bytes(), target.to_string().as_bytes()],
                )
                .await?;
            let items = array("mark_moved", v)?;
            match tag(&items).as_deref() {
                Some("OK") => return Ok(true),
                Some("BUSY") => return Ok(false),
                Some("CLAIMS") => {
                    let delta = array(
                        "claims",
                        self.run_owned(
                            Func::Claims,
                            q,
                            claims("delta", vec![CLAIMS_CHUNK.to_string().into_bytes()]),
                        )
                        .await?,
                    )?;
                    let ids: Vec<Vec<u8>> = delta.iter().map(bytes).collect();
                    if !ids.is_empty() {
                        self.run_owned(Func::Claims, target, claims("import", ids.clone()))
                            .await?;
                        self.run_owned(Func::Claims, q, claims("done", ids)).await?;
                    }
                }
                _ => return Err(unexpected("mark_moved", &items)),
            }
        }
    }

    /// Append the tenant's hold buffer in `q` to its lane, in order, and
    /// unpause it there. Used on the target after a move, and on the source
    /// when a drain is aborted. Returns the count moved.
    pub async fn resume(&self, q: QueueId, tenant: &str) -> Result<u64> {
        let mut total = 0;
        loop {
            let v = self
                .run(
                    Func::Resume,
                    q,
                    &[tenant.as_bytes(), MOVE_CHUNK.to_string().as_bytes()],
                )
                .await?;
            let items = array("resume", v)?;
            total += items.get(1).map(int).unwrap_or(0);
            match tag(&items).as_deref() {
                Some("DONE") => return Ok(total),
                Some("MORE") => continue,
                _ => return Err(unexpected("resume", &items)),
            }
        }
    }

    /// Move the tenant's hold buffer from `from` to the lane of `to`, in
    /// order, in chunks. Each chunk is exported, imported (skipping what `to`
    /// imported from `from` before, by sequence number) and then trimmed from
    /// `from`, so the move can be repeated after a crash without loss or
    /// duplicates. Returns the count appended to `to`.
    pub async fn move_hold(&self, from: QueueId, to: QueueId, tenant: &str) -> Result<u64> {
        let mut appended = 0;
        loop {
            let v = self
                .run(
                    Func::ExportHold,
                    from,
                    &[tenant.as_bytes(), MOVE_CHUNK.to_string().as_bytes()],
                )
                .await?;
            let items = array("export_hold", v)?;
            if items.is_empty() {
                return Ok(appended);
            }
            let mut import: Vec<Vec<u8>> =
                vec![tenant.as_bytes().to_vec(), from.to_string().into_bytes()];
            let mut ids: Vec<Vec<u8>> = vec![tenant.as_bytes().to_vec()];
            for chunk in items.chunks(6) {
                for v in chunk {
                    import.push(bytes(v));
                }
                ids.push(bytes(&chunk[0]));
            }
            let import_refs: Vec<&[u8]> = import.iter().map(|v| v.as_slice()).collect();
            let v = self.run(Func::Import, to, &import_refs).await?;
            appended += int(&v);
            let id_refs: Vec<&[u8]> = ids.iter().map(|v| v.as_slice()).collect();
            self.run(Func::TrimHold, from, &id_refs).await?;
        }
    }

    // ---- attribution ---------------------------------------------------

    /// Per-tenant depth, delivered, failed and worker-seconds over `window`
    /// in `q`, largest worker-seconds first.
    pub async fn tenant_stats(&self, q: QueueId, window: Duration) -> Result<Vec<TenantStats>> {
        let mut conn = self.conn.clone();
        let now_ms: u64 = {
            let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
            s * 1000 + us / 1000
        };
        self.tenant_stats_at(q, window, now_ms).await
    }

    /// [`Store::tenant_stats`] for the window that ends at `now_ms` instead
    /// of Redis's own time: the capacity simulator reads attribution at its
    /// virtual time (see [`Store::set_virtual_clock`]).
    pub async fn tenant_stats_at(
        &self,
        q: QueueId,
        window: Duration,
        now_ms: u64,
    ) -> Result<Vec<TenantStats>> {
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let newest = attribution::bucket_of(now_ms);
        let buckets = attribution::buckets(window);
        let tenants: Vec<String> = redis::cmd("SMEMBERS")
            .arg(format!("{p}:tenants"))
            .query_async(&mut conn)
            .await?;
        let mut pipe = redis::pipe();
        for t in &tenants {
            pipe.cmd("HMGET")
                .arg(format!("{p}:t:{t}"))
                .arg(&["n", "ok", "ko"]);
        }
        for b in 0..buckets {
            pipe.hgetall(format!("{p}:wsu:{}", newest.saturating_sub(b)));
        }
        let replies: Vec<Value> = pipe.query_async(&mut conn).await?;
        let (counters, windows) = replies.split_at(tenants.len().min(replies.len()));
        let mut by_tenant: BTreeMap<String, TenantStats> = BTreeMap::new();
        for (t, v) in tenants.iter().zip(counters) {
            let n: Vec<Option<u64>> =
                redis::from_redis_value_ref(v).map_err(|e| StoreError::Protocol {
                    script: "tenant stats",
                    detail: format!("counters of {t}: {e}"),
                })?;
            let field = |i: usize| n.get(i).copied().flatten().unwrap_or(0);
            by_tenant.insert(
                t.clone(),
                TenantStats {
                    tenant: t.clone(),
                    depth: field(0),
                    delivered: field(1),
                    failed: field(2),
                    worker_seconds: 0.0,
                },
            );
        }
        for v in windows {
            let map: BTreeMap<String, f64> =
                redis::from_redis_value_ref(v).map_err(|e| StoreError::Protocol {
                    script: "tenant stats",
                    detail: format!("worker-seconds bucket: {e}"),
                })?;
            for (t, us) in map {
                by_tenant
                    .entry(t.clone())
                    .or_insert_with(|| TenantStats {
                        tenant: t,
                        ..Default::default()
                    })
                    .worker_seconds += us / 1e6;
            }
        }
        by_tenant.retain(|_, s| s.depth + s.delivered + s.failed > 0 || s.worker_seconds > 0.0);
        let mut out: Vec<TenantStats> = by_tenant.into_values().collect();
        out.sort_by(|a, b| {
            b.worker_seconds
                .total_cmp(&a.worker_seconds)
                .then(b.depth.cmp(&a.depth))
        });
        Ok(out)
    }

    /// Replay one page of `tenant`'s dead letters in `q` (all of them, or
    /// those with the given ids), starting after `after` (`None`: the
    /// oldest). Each is put back on the tail of its lane in order as a new
    /// delivery. One call examines at most `page` letters (at most
    /// [`DEAD_LETTER_PAGE`]), so it is bounded however many the tenant has.
    /// `Err(queue)` when the tenant has moved away from `q` (nothing changed).
    pub async fn replay_dead_page(
        &self,
        q: QueueId,
        tenant: &str,
        after: Option<&str>,
        page: usize,
        ids: &[String],
    ) -> Result<std::result::Result<ReplayPage, QueueId>> {
        let page = page.clamp(1, DEAD_LETTER_PAGE).to_string();
        let cursor = after.unwrap_or("-");
        check_stream_cursor(cursor)?;
        let mut args: Vec<&[u8]> = vec![tenant.as_bytes(), cursor.as_bytes(), page.as_bytes()];
        args.extend(ids.iter().map(|id| id.as_bytes()));
        let items = array("replay_dead", self.run(Func::ReplayDead, q, &args).await?)?;
        match (tag(&items).as_deref(), items.as_slice()) {
            (Some("OK"), [_, n, next, examined]) => {
                let next = string(next);
                Ok(Ok(ReplayPage {
                    replayed: int(n),
                    examined: int(examined),
                    next: (!next.is_empty()).then_some(next),
                }))
            }
            (Some("MOVED"), [_, to]) => {
                string(to)
                    .parse()
                    .map(Err)
                    .map_err(|e| StoreError::Protocol {
                        script: "replay_dead",
                        detail: format!("MOVED to {e}"),
                    })
            }
            _ => Err(unexpected("replay_dead", &items)),
        }
    }

    /// Replay all of `tenant`'s dead letters in `q` (or those with the given
    /// ids), oldest first, in bounded steps ([`Store::replay_dead_page`]).
    /// Returns how many, or `Err(queue)` when the tenant has moved away.
    pub async fn replay_dead(
        &self,
        q: QueueId,
        tenant: &str,
        ids: &[String],
    ) -> Result<std::result::Result<u64, QueueId>> {
        let mut total = 0;
        let mut after: Option<String> = None;
        loop {
            let page = match self
                .replay_dead_page(q, tenant, after.as_deref(), REPLAY_PAGE, ids)
                .await?
            {
                Ok(p) => p,
                Err(moved) if total == 0 => return Ok(Err(moved)),
                Err(_) => return Ok(Ok(total)),
            };
            total += page.replayed;
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(Ok(total)),
            }
        }
    }

    /// One page of `tenant`'s dead letters in `q`, oldest first, after the
    /// cursor `after` (`None`: from the oldest): at most `limit` (at most
    /// [`DEAD_LETTER_PAGE`]), read in O(limit) whatever the tenant or the
    /// queue holds.
    pub async fn dead_letters(
        &self,
        q: QueueId,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<DeadLetterPage> {
        let limit = limit.clamp(1, DEAD_LETTER_PAGE);
        let from = match after {
            Some(c) => {
                check_stream_cursor(c)?;
                format!("({c}")
            }
            None => "-".to_string(),
        };
        let mut conn = self.conn.clone();
        let raw: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(keys::dead_letters(&self.queue_prefix(q), tenant))
            .arg(from)
            .arg("+")
            .arg("COUNT")
            .arg(limit)
            .query_async(&mut conn)
            .await?;
        let full = raw.len() == limit;
        let letters: Vec<DeadLetter> = raw
            .into_iter()
            .map(|(cursor, fields)| {
                let mut d = DeadLetter {
                    id: String::new(),
                    tenant: tenant.to_string(),
                    attempts: 0,
                    cause: String::new(),
                    at: 0,
                    envelope: String::new(),
                    cursor,
                };
                for (k, v) in fields {
                    let v = String::from_utf8_lossy(&v).into_owned();
                    match k.as_str() {
                        "id" => d.id = v,
                        "a" => d.attempts = v.parse().unwrap_or(0),
                        "c" => d.cause = v,
                        "at" => d.at = v.parse::<f64>().map(|x| x as u64).unwrap_or(0),
                        "p" => d.envelope = v,
                        _ => {}
                    }
                }
                d
            })
            .collect();
        let next = if full {
            letters.last().map(|d| d.cursor.clone())
        } else {
            None
        };
        Ok(DeadLetterPage { letters, next })
    }

    /// How many dead letters `q`'s retention bound has dropped, all tenants.
    pub async fn dead_letters_dropped(&self, q: QueueId) -> Result<u64> {
        let mut conn = self.conn.clone();
        let n: Option<u64> = redis::cmd("GET")
            .arg(keys::dead_letters_dropped(&self.queue_prefix(q)))
            .query_async(&mut conn)
            .await?;
        Ok(n.unwrap_or(0))
    }

    /// One tenant's recent activity in `q`: what [`Store::tenant_state`]
    /// says, plus delivered and failed counts, its worker-seconds and the
    /// queue's over `window`, its cost estimate per delivery, and when its
    /// oldest queued envelope was enqueued.
    pub async fn tenant_activity(
        &self,
        q: QueueId,
        tenant: &str,
        window: Duration,
    ) -> Result<TenantActivity> {
        let state = self.tenant_state(q, tenant).await?;
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        let now_ms = s * 1000 + us / 1000;
        let newest = attribution::bucket_of(now_ms);
        let buckets = attribution::buckets(window);
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(format!("{p}:t:{tenant}"))
            .arg(&["ok", "ko", "e"]);
        pipe.cmd("LINDEX").arg(format!("{p}:q:{tenant}")).arg(0);
        for b in 0..buckets {
            pipe.hgetall(format!("{p}:wsu:{}", newest.saturating_sub(b)));
        }
        let replies: Vec<Value> = pipe.query_async(&mut conn).await?;
        let bad = |detail: String| StoreError::Protocol {
            script: "tenant activity",
            detail,
        };
        let counters: Vec<Option<String>> =
            redis::from_redis_value_ref(&replies[0]).map_err(|e| bad(e.to_string()))?;
        let num = |i: usize| {
            counters
                .get(i)
                .cloned()
                .flatten()
                .and_then(|v| v.parse::<f64>().ok())
        };
        let mut activity = TenantActivity {
            state,
            delivered: num(0).unwrap_or(0.0) as u64,
            failed: num(1).unwrap_or(0.0) as u64,
            estimate_s: num(2).map(|us| us / 1e6),
            worker_seconds: 0.0,
            queue_worker_seconds: 0.0,
            oldest_enqueued_ms: None,
            now_ms,
            window,
        };
        for v in &replies[2..] {
            let map: BTreeMap<String, f64> =
                redis::from_redis_value_ref(v).map_err(|e| bad(e.to_string()))?;
            activity.queue_worker_seconds += map.values().sum::<f64>() / 1e6;
            activity.worker_seconds += map.get(tenant).copied().unwrap_or(0.0) / 1e6;
        }
        if let Value::BulkString(id) = &replies[1] {
            let id = String::from_utf8_lossy(id);
            let n: Option<u64> = redis::cmd("HGET")
                .arg(keys::envelope(&p, tenant, &id))
                .arg("n")
                .query_async(&mut conn)
                .await?;
            activity.oldest_enqueued_ms = n;
        }
        Ok(activity)
    }

    // ---- capacity simulator support -------------------------------------
    // Used only by `lanekeeper simulate` (crate::simulate), on a throwaway set.

    /// Run `q`'s scripts at the virtual time `ms` instead of Redis TIME,
    /// until [`Store::clear_virtual_clock`]. The scripts read the clock with
    /// the queue's policy (one HMGET they do anyway), so this costs them
    /// nothing; it exists for the capacity simulator, which replays a day
    /// of traffic through the production scripts in seconds. Never set it
    /// on a live queue: leases, retries and breakers would stop aging.
    pub async fn set_virtual_clock(&self, q: QueueId, ms: u64) -> Result<()> {
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(format!("{}:conf", self.queue_prefix(q)))
            .arg("clock")
            .arg(ms)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Back to Redis TIME for `q`.
    pub async fn clear_virtual_clock(&self, q: QueueId) -> Result<()> {
        let mut conn = self.conn.clone();
        redis::cmd("HDEL")
            .arg(format!("{}:conf", self.queue_prefix(q)))
            .arg("clock")
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Delete every key of this set (its queues and its routing table):
    /// the simulator's cleanup of its throwaway set. Returns how many.
    pub async fn purge_set(&self) -> Result<u64> {
        let mut removed = 0u64;
        // `lk:{ns/name/<queue>}...` and `lk:{ns/name}:...`
        for pattern in [
            format!("lk:{{{}/{}/*", self.set.namespace, self.set.name),
            format!("lk:{{{}/{}}}*", self.set.namespace, self.set.name),
        ] {
            for node in self.scan_targets().await? {
                let mut cursor = 0u64;
                loop {
                    let mut scan = redis::cmd("SCAN");
                    scan.arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000);
                    let (next, keys): (u64, Vec<String>) = redis::from_redis_value(
                        self.on_node(node.as_ref(), scan).await?,
                    )
                    .map_err(|e| StoreError::Protocol {
                        script: "scan",
                        detail: e.to_string(),
                    })?;
                    if !keys.is_empty() {
                        // The cluster client splits a many-key UNLINK by
                        // slot and adds up the counts.
                        let mut conn = self.conn.clone();
                        let n: u64 = redis::cmd("UNLINK")
                            .arg(&keys)
                            .query_async(&mut conn)
                            .await?;
                        removed += n;
                    }
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
        }
        Ok(removed)
    }

    /// The primaries of the cluster as (host, port), from `CLUSTER SLOTS`;
    /// on one server, that server (`None`). A key-space walk (SCAN) has to
    /// visit each of them.
    async fn scan_targets(&self) -> Result<Vec<Option<(String, u16)>>> {
        if !self.is_cluster() {
            return Ok(vec![None]);
        }
        Ok(self
            .cluster_primaries()
            .await?
            .into_iter()
            .map(|(host, port, _)| Some((host, port)))
            .collect())
    }

    /// The cluster's primaries as (host, port, slots owned), from `CLUSTER
    /// SLOTS`; empty on one server.
    pub async fn cluster_primaries(&self) -> Result<Vec<(String, u16, u32)>> {
        if !self.is_cluster() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let ranges: Vec<Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await?;
        let mut primaries: BTreeMap<(String, u16), u32> = BTreeMap::new();
        for range in ranges {
            let items = array("cluster slots", range)?;
            if let [start, end, primary, ..] = items.as_slice() {
                let node = array("cluster slots", primary.clone())?;
                if let [host, port, ..] = node.as_slice() {
                    let key = (string(host), int(port) as u16);
                    *primaries.entry(key).or_default() += (int(end) + 1 - int(start)) as u32;
                }
            }
        }
        Ok(primaries.into_iter().map(|((h, p), n)| (h, p, n)).collect())
    }

    /// Run `cmd` on one cluster node (`Some((host, port))`) or, with
    /// `None`, on the server.
    async fn on_node(&self, node: Option<&(String, u16)>, cmd: redis::Cmd) -> Result<Value> {
        match (&self.conn, node) {
            (Conn::Cluster(c), Some((host, port))) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                Ok(c.clone().route_command(cmd, route).await?)
            }
            _ => {
                let mut conn = self.conn.clone();
                Ok(cmd.query_async(&mut conn).await?)
            }
        }
    }
}

/// A lease token, unique per lease, so a late ack from an expired holder is told apart.
/// One stream entry as XRANGE returns it: its id and its field-value pairs.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// A dead-letter cursor is a stream id, `<ms>-<seq>`: anything else is
/// refused before it reaches a script.
fn check_stream_cursor(c: &str) -> Result<()> {
    let ok = c == "-"
        || c.split_once('-').is_some_and(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && a.len() <= 20
                && b.len() <= 20
                && a.bytes().all(|x| x.is_ascii_digit())
                && b.bytes().all(|x| x.is_ascii_digit())
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidCursor)
    }
}

fn lease_token(worker: &str) -> String {
    // The lease as stored separates its parts by newlines (see common.lua).
    let worker: String = worker.chars().filter(|c| !c.is_control()).collect();
    format!("{worker}:{:016x}", rand::random::<u64>())
}

fn parse_lease(q: QueueId, items: &[Value]) -> Result<LeaseOutcome> {
    match tag(items).as_deref() {
        Some("LEASED") if items.len() == 10 => Ok(LeaseOutcome::Leased(Lease {
            queue: q,
            id: string(&items[1]),
            tenant: string(&items[2]),
            payload: string(&items[3]),
            attempts: int(&items[4]) as u32,
            seq: int(&items[5]),
            token: string(&items[6]),
            deadline_ms: int(&items[7]),
            enqueued_ms: int(&items[8]),
            breaker: BreakerChange::parse(items.get(9)),
        })),
        Some("EMPTY") => Ok(LeaseOutcome::Empty {
            retry_after: Duration::from_millis(items.get(1).map(int).unwrap_or(1000)),
        }),
        Some("AGAIN") => Ok(LeaseOutcome::Again),
        _ => Err(unexpected("lease", items)),
    }
}

/// `url` as a Redis Cluster URL when `cluster` is set (a ShardSet's
/// `spec.redis.cluster`): `redis://` becomes `redis+cluster://` and
/// `rediss://` `rediss+cluster://`. Otherwise, or when it names a cluster
/// already, `url` unchanged.
pub fn cluster_url(url: &str, cluster: bool) -> String {
    match url.split_once("://") {
        Some((scheme @ ("redis" | "rediss"), rest)) if cluster => {
            format!("{scheme}+cluster://{rest}")
        }
        _ => url.to_string(),
    }
}

/// `url` with any password replaced by `***`, for messages. The userinfo
/// is taken to end at the *last* `@` (a password typed unencoded may hold
/// `/`, `?`, `#` or `@`), and a URL without a scheme is read as one without
/// `scheme://`, so a typo cannot make a password show; at worst a query
/// holding `@` is hidden too.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _)) if !user.contains(['/', '?', '#']) => {
                format!("{scheme}{user}:***@{hosts}")
            }
            _ => format!("{scheme}***@{hosts}"),
        },
        None => url.to_string(),
    }
}

/// `url` with `password` set (for a Redis whose password lives in its own Secret).
/// A cluster URL (`redis+cluster://host:port,host:port`) gets it once, for
/// every node.
pub fn with_password(url: &str, password: &str) -> std::result::Result<String, String> {
    if let Some(nodes) = cluster_nodes(url) {
        nodes?;
        let (scheme, rest) = url.split_once("://").expect("a cluster url has a scheme");
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (u.split_once(':').map_or(u, |(u, _)| u), h),
            None => ("", authority),
        };
        // Percent-encode the password as a URL's userinfo wants it.
        let mut encoder = url::Url::parse("redis://host").expect("a valid url");
        encoder
            .set_password(Some(password))
            .map_err(|_| format!("redis url {:?} cannot carry a password", redact(url)))?;
        let encoded = encoder.password().unwrap_or_default();
        return Ok(format!("{scheme}://{user}:{encoded}@{hosts}{tail}"));
    }
    let mut u = url::Url::parse(url).map_err(|e| format!("redis url {:?}: {e}", redact(url)))?;
    u.set_password(Some(password))
        .map_err(|_| format!("redis url {:?} cannot carry a password", redact(url)))?;
    Ok(u.to_string())
}

/// `url` with the ACL user `username` (a ShardSet's `spec.redis.username`),
/// keeping any password: `redis://host` becomes `redis://user@host`, and a
/// cluster URL carries the user once, for every node. Apply it before
/// [`with_password`]. A user name that a URL cannot carry (empty, or a
/// control character) is an error.
pub fn with_username(url: &str, username: &str) -> std::result::Result<String, String> {
    if username.is_empty() || username.chars().any(|c| c.is_control() || c == ' ') {
        return Err(format!(
            "redis username {username:?}: must be non-empty, without spaces or control characters"
        ));
    }
    // Percent-encode the user name as a URL's userinfo wants it.
    let mut encoder = url::Url::parse("redis://host").expect("a valid url");
    encoder
        .set_username(username)
        .map_err(|_| format!("redis username {username:?} cannot be put in a URL"))?;
    let encoded = encoder.username().to_string();
    if let Some(nodes) = cluster_nodes(url) {
        nodes?;
        let (scheme, rest) = url.split_once("://").expect("a cluster url has a scheme");
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (password, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (u.split_once(':').map(|(_, p)| p), h),
            None => (None, authority),
        };
        let userinfo = match password {
            Some(p) => format!("{encoded}:{p}@"),
            None => format!("{encoded}@"),
        };
        return Ok(format!("{scheme}://{userinfo}{hosts}{tail}"));
    }
    let mut u = url::Url::parse(url).map_err(|e| format!("redis url {}: {e}", redact(url)))?;
    u.set_username(username)
        .map_err(|_| format!("redis url {} cannot carry a user name", redact(url)))?;
    Ok(u.to_string())
}

/// Validate an envelope and encode it as stored.
fn encode(env: &Envelope) -> Result<Vec<u8>> {
    env.validate()?;
    serde_json::to_vec(env).map_err(|e| StoreError::Protocol {
        script: "enqueue",
        detail: format!("cannot encode envelope {}: {e}", env.id),
    })
}

fn unexpected(script: &'static str, items: &[Value]) -> StoreError {
    StoreError::Protocol {
        script,
        detail: format!("{items:?}"),
    }
}

fn decode_endpoint(tenant: &str, name: &str, raw: &str) -> Result<Endpoint> {
    serde_json::from_str(raw).map_err(|e| StoreError::Protocol {
        script: "endpoint registry",
        detail: format!("endpoint {name} of {tenant}: {e}"),
    })
}

fn parse_enqueue(tag: &Value, value: &Value) -> Result<EnqueueOutcome> {
    match string(tag).as_str() {
        "OK" => Ok(EnqueueOutcome::Queued { seq: int(value) }),
        "HELD" => Ok(EnqueueOutcome::Held { seq: int(value) }),
        "DUP" => Ok(EnqueueOutcome::Duplicate),
        "FULL" => Ok(EnqueueOutcome::Full { depth: int(value) }),
        "STALE" => Ok(EnqueueOutcome::Stale { fence: int(value) }),
        "MOVED" => string(value)
            .parse()
            .map(EnqueueOutcome::Moved)
            .map_err(|e| StoreError::Protocol {
                script: "enqueue",
                detail: format!("MOVED to {e}"),
            }),
        _ => Err(unexpected("enqueue", &[tag.clone(), value.clone()])),
    }
}

fn array(script: &'static str, v: Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(items) => Ok(items),
        Value::ServerError(e) => Err(StoreError::Redis(e.into())),
        other => Err(StoreError::Protocol {
            script,
            detail: format!("expected an array, got {other:?}"),
        }),
    }
}

fn tag(items: &[Value]) -> Option<String> {
    items.first().map(string)
}

fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        Value::SimpleString(s) => s.as_bytes().to_vec(),
        Value::Int(i) => i.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

fn string(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Okay => "OK".to_string(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

fn int(v: &Value) -> u64 {
    match v {
        Value::Int(i) => (*i).max(0) as u64,
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_bucket_width_is_the_policys() {
        let line = format!(
            "local BUCKET_MS = {}\n",
            crate::policy::attribution::BUCKET_SECONDS * 1000
        );
        assert!(include_str!("lua/common.lua").contains(&line), "{line}");
    }

    #[test]
    fn cluster_urls_give_one_url_per_seed_node() {
        assert_eq!(cluster_nodes("redis://h:1/0"), None);
        assert_eq!(
            cluster_nodes("redis+cluster://a:7000,b:7001,c")
                .unwrap()
                .unwrap(),
            vec!["redis://a:7000", "redis://b:7001", "redis://c:6379"]
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://u:p%40ss@a:7000,[::1]:7001/?protocol=resp3")
                .unwrap()
                .unwrap(),
            vec![
                "rediss://u:p%40ss@a:7000?protocol=resp3",
                "rediss://u:p%40ss@[::1]:7001?protocol=resp3"
            ]
        );
        assert!(cluster_nodes("redis+cluster://a:1/3").unwrap().is_err());
        assert!(cluster_nodes("redis+cluster://a:1,,b:2").unwrap().is_err());
        assert!(cluster_nodes("redis+cluster://a:notaport")
            .unwrap()
            .is_err());
    }

    #[test]
    fn a_password_goes_to_every_cluster_node() {
        let url = with_password("redis+cluster://a:7000,b:7001/", "p@ss word").unwrap();
        assert_eq!(url, "redis+cluster://:p%40ss%20word@a:7000,b:7001/");
        assert_eq!(
            cluster_nodes(&url).unwrap().unwrap(),
            vec![
                "redis://:p%40ss%20word@a:7000",
                "redis://:p%40ss%20word@b:7001"
            ]
        );
        assert_eq!(
            with_password("redis://r:6379/0", "x").unwrap(),
            "redis://:x@r:6379/0"
        );
    }

    #[test]
    fn an_acl_user_name_goes_beside_the_password() {
        let url = with_username("redis://r:6379/0", "lanekeeper").unwrap();
        assert_eq!(url, "redis://lanekeeper@r:6379/0");
        assert_eq!(
            with_password(&url, "p@ss").unwrap(),
            "redis://lanekeeper:p%40ss@r:6379/0"
        );
        let cluster = with_username("rediss+cluster://a:7000,b:7001/", "lk").unwrap();
        assert_eq!(cluster, "rediss+cluster://lk@a:7000,b:7001/");
        let both = with_password(&cluster, "pw").unwrap();
        assert_eq!(both, "rediss+cluster://lk:pw@a:7000,b:7001/");
        assert_eq!(
            cluster_nodes(&both).unwrap().unwrap(),
            vec!["rediss://lk:pw@a:7000", "rediss://lk:pw@b:7001"]
        );
        assert!(with_username("redis://r", "").is_err());
        assert!(with_username("redis://r", "a b").is_err());
        assert_eq!(redact(&both), "rediss+cluster://lk:***@a:7000,b:7001/");
    }

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

    #[test]
    fn the_cluster_flag_turns_a_url_into_a_cluster_url() {
        assert_eq!(cluster_url("redis://r:6379/0", false), "redis://r:6379/0");
        assert_eq!(
            cluster_url("redis://r:6379", true),
            "redis+cluster://r:6379"
        );
        assert_eq!(
            cluster_url("rediss://:pw@r:6379", true),
            "rediss+cluster://:pw@r:6379"
        );
        assert_eq!(
            cluster_url("redis+cluster://a:1,b:2", true),
            "redis+cluster://a:1,b:2"
        );
        assert_eq!(
            redact("redis+cluster://u:secret@a:1,b:2/?x=1"),
            "redis+cluster://u:***@a:1,b:2/?x=1"
        );
        assert_eq!(redact("redis://r:6379/0"), "redis://r:6379/0");
    }

    #[test]
    fn the_cluster_library_wakes_workers_by_sharded_publish() {
        assert!(LIBRARY.code.contains("redis.call('PUBLISH',"));
        assert!(!LIBRARY.code.contains("redis.call('SPUBLISH',"));
        assert!(CLUSTER_LIBRARY.code.contains("redis.call('SPUBLISH',"));
        assert!(!CLUSTER_LIBRARY.code.contains("redis.call('PUBLISH',"));
        assert_ne!(LIBRARY.name, CLUSTER_LIBRARY.name);
    }
}
