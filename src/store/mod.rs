//! Every Redis key and Lua script of lanekeeper, and nothing else.
//!
//! Each operation on a queue (enqueue, lease, ack, nack, reap, pause, resume,
//! move) is one script call: one round trip, atomic. All keys of a queue
//! share the hash tag `{<namespace>/<set>/<queue>}`, so every script touches
//! one slot and runs on Redis Cluster. The key layout is documented at the
//! top of `lua/common.lua`. The routing table of a set lives under its own
//! tag, `lk:{<namespace>/<set>}:routing`.
//!
//! One file per job: [`keys`] (the Rust names of keys), `library` (the
//! scripts as one Functions library), `conn` (connections and calls), `url`,
//! `reply` (reply types, one decoder per script reply), and the `impl Store`
//! blocks by job: `queue`, `routing`, `relocation`, `stats`, `deadletters`,
//! `endpoints`, `tiers`, `shaping`, `operations` (a user's operations on one
//! tenant, and their audit trail), `admin`, `durable`, `settings`.
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

mod admin;
mod cache;
mod conn;
mod deadletters;
mod durable;
mod endpoints;
mod library;
mod operations;
mod queue;
mod relocation;
mod reply;
mod routing;
mod settings;
mod shaping;
mod stats;
mod tiers;
mod url;

pub mod keys;

pub use cache::TtlCache;
pub use conn::{ConnectOptions, RedisTls};
pub use deadletters::{ReplayFilter, DEAD_LETTER_PAGE, REPLAY_PAGE};
pub use library::SLOT_GUARD;
pub use operations::{
    check_reason, AuditEntry, PauseOutcome, PurgeMode, PurgeOutcome, ReplayOutcome, ReplayPlan,
    TenantView, AUDIT_MAX, MAX_REASON_BYTES, PURGE_PAGE,
};
pub use queue::{TenantTerms, TierUpdate, ENQUEUE_CHUNK, LEASE_BATCH_MAX, SWEEP_STEP};
pub use reply::{
    Acked, BreakerChange, DeadLetter, DeadLetterPage, EnqueueOutcome, Failure, Lease, LeaseBatch,
    LeaseOutcome, NackOutcome, ReplayPage, SweepStep, TenantActivity, TenantQueueState,
    TenantStats,
};
pub use settings::{log_at_start as log_settings_at_start, worst as worst_settings, RedisSettings};
pub use shaping::Shaping;
pub use tiers::{TierSources, TierSync, TIER_CHUNK};
pub use url::{
    cluster_nodes, cluster_url, is_tls_url, redact, with_password, with_username, CLUSTER_SCHEMES,
};

use std::fmt;
use std::time::Duration;

use crate::endpoint::InvalidEndpoint;
use crate::envelope::InvalidEnvelope;
use crate::routing::QueueId;

// What `durable` and `settings` reach through `super::`.
use conn::{cluster_builder, Conn, PubSubSource};
use library::Library;
use reply::{int, string};

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
    #[error("invalid lease batch: {0}")]
    InvalidBatch(String),
    #[error("invalid cursor: a dead-letter cursor is the `cursor` of a letter listed before (<ms>-<seq>)")]
    InvalidCursor,
    #[error("stored on the Redis primary, but {acked} replicas acknowledged it within {timeout:?} (durability Replicated needs 1): it may be lost if the primary fails now; retry with the same id (a duplicate is stored once)")]
    NotReplicated { acked: u32, timeout: Duration },
    #[error("routing table missing for {0}: Redis holds no shard count for this ShardSet (it lost its state, or the controller has not written it yet); retry shortly")]
    RoutingMissing(SetId),
    #[error("tenant {0:?} is being moved between queues (a lane or a reshard): try again once the move is over, in seconds")]
    TenantMoving(String),
    #[error("unexpected reply from the {script} script: {detail}")]
    Protocol {
        script: &'static str,
        detail: String,
    },
}

impl StoreError {
    /// What kind of failure, in a few words that carry nothing of the
    /// request or the server (for audit records and metrics labels).
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "redis timeout",
            StoreError::Redis(_) => "redis error",
            StoreError::Invalid(_)
            | StoreError::InvalidEndpoint(_)
            | StoreError::InvalidCursor
            | StoreError::InvalidBatch(_) => "invalid input",
            StoreError::NotReplicated { .. } => "not replicated",
            StoreError::RoutingMissing(_) => "routing table missing",
            StoreError::TenantMoving(_) => "tenant moving",
            StoreError::Protocol { .. } => "unexpected reply",
        }
    }
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
