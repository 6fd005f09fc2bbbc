//! The in-process producer: route a tenant's envelope to its queue and
//! enqueue it, following MOVED answers. The ingest API builds on this.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::RwLock;

use crate::envelope::Envelope;
use crate::routing::{QueueId, RoutingTable};
use crate::store::{EnqueueOutcome, Result, Store, StoreError, TenantTerms};

/// Routes and enqueues envelopes for one ShardSet.
pub struct Producer {
    routing: RoutingCache,
}

/// How many MOVED or STALE answers in a row before giving up: each one
/// refreshes the table, so more than a few means the table and the queues
/// disagree.
const MAX_REDIRECTS: usize = 6;

impl Producer {
    pub fn new(store: Store, routing_ttl: Duration) -> Self {
        Self {
            routing: RoutingCache::new(store, routing_ttl),
        }
    }

    /// Enqueue one envelope where its tenant is routed now. Returns the queue
    /// it went to and what happened there (queued, held or duplicate).
    pub async fn send(&self, env: &Envelope) -> Result<(QueueId, EnqueueOutcome)> {
        let mut out = self
            .send_batch(std::slice::from_ref(env), |_| TenantTerms::default())
            .await?;
        out.pop().expect("one result per envelope")
    }

    /// Enqueue envelopes where their tenants are routed now, each queue's
    /// share in one pipelined call, following MOVED answers. `terms` gives a
    /// tenant's backlog limit and tier (see [`Store::enqueue_batch_routed`]). One
    /// result per envelope, in order; an invalid envelope gets its error and
    /// the others are stored.
    pub async fn send_batch(
        &self,
        envs: &[Envelope],
        terms: impl Fn(&str) -> TenantTerms,
    ) -> Result<Vec<Result<(QueueId, EnqueueOutcome)>>> {
        let mut results: Vec<Option<Result<(QueueId, EnqueueOutcome)>>> =
            (0..envs.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..envs.len()).collect();
        // Where a queue answered MOVED, the envelope follows that answer: the
        // queue's mark is the authority (the table may still pin the tenant
        // to the queue it left, as a reshard does until its move finishes).
        let mut redirect: BTreeMap<usize, QueueId> = BTreeMap::new();
        let mut table = self.routing.table().await?;
        if !table.present() {
            // Never route by an empty table (everyone would hash to shard 0,
            // dedicated lanes forgotten): look again, then refuse.
            table = self.routing.refresh().await?;
            if !table.present() {
                return Err(StoreError::RoutingMissing(self.store().set().clone()));
            }
        }
        let mut stale = false;
        for attempt in 0..=MAX_REDIRECTS {
            if pending.is_empty() {
                break;
            }
            if attempt > 0 {
                if stale {
                    // A reshard fenced the queues a moment before it writes
                    // the new shard count: give it that moment.
                    tokio::time::sleep(Duration::from_millis(5 << attempt)).await;
                }
                table = self.routing.refresh().await?;
                if !table.present() {
                    return Err(StoreError::RoutingMissing(self.store().set().clone()));
                }
            }
            stale = false;
            let mut by_queue: BTreeMap<QueueId, Vec<usize>> = BTreeMap::new();
            for i in pending.drain(..) {
                let q = redirect
                    .get(&i)
                    .copied()
                    .unwrap_or_else(|| table.route(&envs[i].tenant));
                by_queue.entry(q).or_default().push(i);
            }
            // Replicated: enqueue on the durable connection, where the WAIT goes.
            let store = match table.replicated {
                Some(_) => self.routing.store().durable().await?,
                None => self.routing.store().clone(),
            };
            for (q, idx) in by_queue {
                // All of them, in order, to one queue (the usual case): no copies.
                let whole = idx.len() == envs.len() && idx.iter().enumerate().all(|(k, &i)| k == i);
                let batch: Vec<Envelope> = if whole {
                    Vec::new()
                } else {
                    idx.iter().map(|&i| envs[i].clone()).collect()
                };
                let outcomes = store
                    .enqueue_batch_routed(
                        q,
                        if whole { envs } else { &batch },
                        &terms,
                        table.version.max(1),
                    )
                    .await?;
                let outcomes = match table.replicated {
                    Some(timeout) => replicated(&store, q, outcomes, timeout).await,
                    None => outcomes,
                };
                for (i, outcome) in idx.into_iter().zip(outcomes) {
                    match outcome {
                        Ok(EnqueueOutcome::Moved(to)) => {
                            redirect.insert(i, to);
                            pending.push(i);
                        }
                        Ok(EnqueueOutcome::Stale { .. }) => {
                            // Route again by the fresh table.
                            redirect.remove(&i);
                            stale = true;
                            pending.push(i);
                        }
                        Ok(o) => results[i] = Some(Ok((q, o))),
                        Err(e) => results[i] = Some(Err(e)),
                    }
                }
            }
        }
        Ok(results
            .into_iter()
            .zip(envs)
            .map(|(r, env)| {
                r.unwrap_or_else(|| {
                    Err(StoreError::Protocol {
                        script: "enqueue",
                        detail: format!(
                            "tenant {} kept answering MOVED or STALE after {MAX_REDIRECTS} routing refreshes",
                            env.tenant
                        ),
                    })
                })
            })
            .collect())
    }

    /// The store this producer enqueues into.
    pub fn store(&self) -> &Store {
        self.routing.store()
    }

    /// The routing table as cached (refreshed when older than its TTL).
    pub async fn route(&self, tenant: &str) -> Result<QueueId> {
        let table = self.routing.table().await?;
        if !table.present() {
            return Err(StoreError::RoutingMissing(self.store().set().clone()));
        }
        Ok(table.route(tenant))
    }
}

/// `Replicated` durability: once `q` stored some of `outcomes` (through
/// `store`, a durable store), wait until a replica has them too (`WAIT 1`);
/// if none acknowledges within `timeout`, every stored one becomes
/// [`StoreError::NotReplicated`] (ingest answers 503; a retry with the same
/// id is stored once).
async fn replicated(
    store: &Store,
    q: QueueId,
    outcomes: Vec<Result<EnqueueOutcome>>,
    timeout: Duration,
) -> Vec<Result<EnqueueOutcome>> {
    let stored = |o: &Result<EnqueueOutcome>| {
        matches!(
            o,
            Ok(EnqueueOutcome::Queued { .. }
                | EnqueueOutcome::Held { .. }
                | EnqueueOutcome::Duplicate)
        )
    };
    if !outcomes.iter().any(stored) {
        return outcomes;
    }
    let failure = match store.wait_replicas(q, 1, timeout).await {
        Ok(n) if n >= 1 => return outcomes,
        Ok(acked) => Ok(acked),
        Err(e) => Err(format!("WAIT for a replica failed: {e}")),
    };
    outcomes
        .into_iter()
        .map(|o| match (&failure, stored(&o)) {
            (_, false) => o,
            (Ok(acked), true) => Err(StoreError::NotReplicated {
                acked: *acked,
                timeout,
            }),
            (Err(detail), true) => Err(StoreError::Protocol {
                script: "wait",
                detail: detail.clone(),
            }),
        })
        .collect()
}

/// A routing table read through from Redis and kept for a short TTL.
pub struct RoutingCache {
    store: Store,
    ttl: Duration,
    cached: RwLock<Option<(Arc<RoutingTable>, Instant)>>,
}

impl RoutingCache {
    pub fn new(store: Store, ttl: Duration) -> Self {
        Self {
            store,
            ttl,
            cached: RwLock::new(None),
        }
    }

    /// The table, from cache while it is younger than the TTL.
    pub async fn table(&self) -> Result<Arc<RoutingTable>, StoreError> {
        if let Some((table, at)) = self.cached.read().await.as_ref() {
            if at.elapsed() < self.ttl {
                return Ok(table.clone());
            }
        }
        self.refresh().await
    }

    /// Read the table from Redis now (after a MOVED answer, say).
    pub async fn refresh(&self) -> Result<Arc<RoutingTable>, StoreError> {
        let table = Arc::new(self.store.routing().await?);
        *self.cached.write().await = Some((table.clone(), Instant::now()));
        Ok(table)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }
}
