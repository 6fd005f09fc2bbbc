//! Which queue a tenant's envelopes go to: rendezvous (highest random weight)
//! hashing with blake2b over a fixed shard count, with pins that override it.
//!
//! Pure: the table (shard count, pins, version) lives in Redis (the store
//! reads and writes it), and producers keep a copy for a short TTL
//! (`producer::RoutingCache`). A stale copy cannot break order: the enqueue
//! script answers MOVED when the tenant has left a queue, and the caller
//! refreshes.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};

/// A queue of a ShardSet: a hash shard or a dedicated lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QueueId {
    /// Hash shard `n` (0-based), named `shard-07`.
    Shard(u16),
    /// Dedicated lane `n` (0 to 7), named `lane-3`.
    Lane(u8),
}

impl fmt::Display for QueueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueueId::Shard(n) => write!(f, "shard-{n:02}"),
            QueueId::Lane(n) => write!(f, "lane-{n}"),
        }
    }
}

/// A queue name that is neither `shard-N` nor `lane-N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("queue {0:?}: expected shard-<N> (0 to 1023) or lane-<N> (0 to 7)")]
pub struct BadQueueName(pub String);

/// Dedicated lanes per ShardSet at most: `lane-0` to `lane-7`.
pub const MAX_LANES: u8 = 8;
/// Shards per ShardSet at most: `shard-00` to `shard-1023`.
pub const MAX_SHARDS: u16 = 1024;

impl FromStr for QueueId {
    type Err = BadQueueName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadQueueName(s.to_string());
        if let Some(n) = s.strip_prefix("shard-") {
            let n = n.parse::<u16>().ok().filter(|n| *n < MAX_SHARDS);
            return n.map(QueueId::Shard).ok_or_else(bad);
        }
        if let Some(n) = s.strip_prefix("lane-") {
            let n = n.parse::<u8>().ok().filter(|n| *n < MAX_LANES);
            return n.map(QueueId::Lane).ok_or_else(bad);
        }
        Err(bad())
    }
}

/// The stable 64-bit score of `tenant` on `queue`: blake2b of `tenant:queue`.
/// Never the language's salted hash: every process must agree.
pub fn score(tenant: &str, queue: QueueId) -> u64 {
    // Feeds the queue's display name straight into the hash, without allocating.
    struct Feed(Blake2b<U8>);
    impl fmt::Write for Feed {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            self.0.update(s.as_bytes());
            Ok(())
        }
    }
    let mut h = Feed(Blake2b::<U8>::new());
    h.0.update(tenant.as_bytes());
    h.0.update(b":");
    let _ = fmt::Write::write_fmt(&mut h, format_args!("{queue}"));
    u64::from_be_bytes(h.0.finalize().into())
}

/// The hash shard of `tenant` among `shards` shards: the one with the highest
/// score. Going from n to n+1 shards moves only the tenants whose new shard
/// wins, about 1/(n+1) of them.
pub fn hash_shard(tenant: &str, shards: u16) -> QueueId {
    (0..shards.max(1))
        .map(QueueId::Shard)
        .max_by_key(|q| score(tenant, *q))
        .unwrap_or(QueueId::Shard(0))
}

/// Shard count, pins and the version that changes with either.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoutingTable {
    pub shards: u16,
    pub version: u64,
    /// Tenants whose queue is set explicitly (dedicated lanes, reshard moves).
    pub pins: BTreeMap<String, QueueId>,
    /// The controller's mark of this Redis's state: written with the table,
    /// gone when Redis lost its state (see `docs/architecture.md`, "A Redis
    /// that lost its state").
    pub epoch: Option<String>,
    /// `spec.redis.durability: Replicated`: an enqueue counts once a replica
    /// holds it, waited for up to this long (`WAIT 1 <ms>`). `None`: `Fast`.
    pub replicated: Option<Duration>,
}

impl RoutingTable {
    /// The table is there: the controller wrote a shard count. Without it
    /// (a new set, or a Redis that lost its state) nobody may route: every
    /// tenant would hash to shard 0, dedicated lanes forgotten.
    pub fn present(&self) -> bool {
        self.shards > 0
    }

    /// The queue `tenant` is routed to: its pin, else its hash shard.
    pub fn route(&self, tenant: &str) -> QueueId {
        self.pins
            .get(tenant)
            .copied()
            .unwrap_or_else(|| hash_shard(tenant, self.shards))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_round_trip() {
        for q in [
            QueueId::Shard(0),
            QueueId::Shard(7),
            QueueId::Shard(1023),
            QueueId::Lane(3),
        ] {
            assert_eq!(q.to_string().parse::<QueueId>().unwrap(), q);
        }
        assert_eq!(QueueId::Shard(7).to_string(), "shard-07");
        assert!("shard-1024".parse::<QueueId>().is_err());
        assert!("lane-8".parse::<QueueId>().is_err());
        assert!("s07".parse::<QueueId>().is_err());
    }

    #[test]
    fn pins_override_the_hash() {
        let mut t = RoutingTable {
            shards: 16,
            ..Default::default()
        };
        let hashed = t.route("acme");
        assert_eq!(hashed, hash_shard("acme", 16));
        t.pins.insert("acme".into(), QueueId::Lane(2));
        assert_eq!(t.route("acme"), QueueId::Lane(2));
    }

    #[test]
    fn known_vector_is_stable() {
        // Pinned so a change of hash function or input encoding cannot slip in:
        // every producer and worker must agree across versions.
        let shards: Vec<QueueId> = ["a", "b", "c", "tenant-42"]
            .iter()
            .map(|t| hash_shard(t, 32))
            .collect();
        assert_eq!(shards, KNOWN.map(QueueId::Shard).to_vec());
    }
    // Cross-checked with Python: max(range(32), key=lambda i: int.from_bytes(
    // hashlib.blake2b(f"{t}:shard-{i:02d}".encode(), digest_size=8).digest(), "big")).
    const KNOWN: [u16; 4] = [20, 20, 16, 24];
}
