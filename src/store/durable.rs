//! `Replicated` durability: enqueues that count once a replica holds them.
//!
//! `WAIT n ms` blocks the connection it is sent on, and the store's main
//! connection is multiplexed (routing reads, endpoint lookups, `/readyz`'s
//! PING all share it), so a `WAIT` there would hold every other command
//! behind it, for the whole timeout when the replica is away. Replicated
//! enqueues therefore go over a connection of their own ([`Store::durable`]),
//! and their `WAIT`s are group-committed: at most one `WAIT` is in flight per
//! queue group, and it covers every enqueue whose reply had arrived when it
//! was sent (a `WAIT` covers every earlier write on its connection). Callers
//! that arrive while one is in flight share the next one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{cluster_builder, Conn, ConnectOptions, PubSubSource, QueueId, Result, Store};

/// The durable connection of a store and its wait groups.
pub(super) struct Durable {
    opts: ConnectOptions,
    conn: tokio::sync::OnceCell<Conn>,
    /// One group on one server (one connection); per queue on a cluster
    /// (each queue's primary is its own connection).
    groups: Mutex<HashMap<Option<QueueId>, Arc<Group>>>,
}

#[derive(Default)]
struct Group {
    /// Tickets handed out: one per caller whose enqueue has been answered.
    issued: AtomicU64,
    round: tokio::sync::Mutex<Round>,
}

#[derive(Default)]
struct Round {
    /// Every ticket up to this one is covered by `answer`.
    covered: u64,
    answer: Option<std::result::Result<u32, String>>,
}

impl Durable {
    pub(super) fn new(opts: ConnectOptions) -> Arc<Self> {
        Arc::new(Self {
            opts,
            conn: tokio::sync::OnceCell::new(),
            groups: Mutex::default(),
        })
    }
}

impl Store {
    /// This store on its durable connection (opened on first use): what
    /// `Replicated` enqueues go through, so that their `WAIT`s block
    /// nothing else.
    pub async fn durable(&self) -> Result<Store> {
        let d = self.durable.clone();
        let conn = d
            .conn
            .get_or_try_init(|| async {
                Ok::<_, super::StoreError>(match &self.pubsub {
                    PubSubSource::Single(client) => {
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(d.opts.connect_timeout))
                            .set_response_timeout(Some(d.opts.response_timeout))
                            .set_number_of_retries(2);
                        Conn::Single(
                            ConnectionManager::new_with_config(client.clone(), config).await?,
                        )
                    }
                    PubSubSource::Cluster(nodes, opts, tls) => Conn::Cluster(
                        cluster_builder(nodes, opts, tls.as_ref())
                            .build()?
                            .get_async_connection()
                            .await?,
                    ),
                })
            })
            .await?
            .clone();
        Ok(Store {
            conn,
            ..self.clone()
        })
    }

    /// Wait until `replicas` replicas hold every write this store's durable
    /// connection sent to `q` before the call (`WAIT`, group-committed; on
    /// a cluster, on the primary owning `q`'s slot). Call it on the store
    /// [`Store::durable`] returned, after the enqueue was answered. Returns
    /// how many replicas acknowledged within `timeout`.
    pub async fn wait_replicas(&self, q: QueueId, replicas: u32, timeout: Duration) -> Result<u32> {
        let key = self.is_cluster().then_some(q);
        let group = self
            .durable
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default()
            .clone();
        let ticket = group.issued.fetch_add(1, Ordering::SeqCst) + 1;
        let mut round = group.round.lock().await;
        if round.covered < ticket {
            // Everyone with a ticket so far had their enqueue answered on
            // this connection before this WAIT goes out: it covers them.
            let upto = group.issued.load(Ordering::SeqCst);
            let answer = self.send_wait(q, replicas, timeout).await;
            round.covered = upto;
            round.answer = Some(answer.map_err(|e| e.to_string()));
        }
        match round.answer.clone() {
            Some(Ok(n)) => Ok(n),
            Some(Err(detail)) => Err(super::StoreError::Protocol {
                script: "wait",
                detail,
            }),
            None => unreachable!("a round ran or covered this ticket"),
        }
    }

    async fn send_wait(&self, q: QueueId, replicas: u32, timeout: Duration) -> Result<u32> {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas).arg(timeout.as_millis().max(1) as u64);
        let acked = match &self.conn {
            Conn::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_key(self.queue_prefix(q), SlotAddr::Master),
                ));
                super::int(&c.clone().route_command(cmd, route).await?)
            }
            Conn::Single(_) => {
                let mut conn = self.conn.clone();
                cmd.query_async::<u64>(&mut conn).await?
            }
        };
        Ok(acked as u32)
    }
}
