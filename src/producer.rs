//! The in-process producer: route a tenant's envelope to its queue and
//! enqueue it, following MOVED answers. The ingest API builds on this.

use std::time::Duration;

use crate::envelope::Envelope;
use crate::routing::{QueueId, RoutingCache};
use crate::store::{EnqueueOutcome, Result, Store, StoreError};

/// Routes and enqueues envelopes for one ShardSet.
pub struct Producer {
    routing: RoutingCache,
}

/// How many MOVED answers in a row before giving up: each one refreshes the
/// table, so more than a few means the table and the queues disagree.
const MAX_REDIRECTS: usize = 4;

impl Producer {
    pub fn new(store: Store, routing_ttl: Duration) -> Self {
        Self {
            routing: RoutingCache::new(store, routing_ttl),
        }
    }

    /// Enqueue one envelope where its tenant is routed now. Returns the queue
    /// it went to and what happened there (queued, held or duplicate).
    pub async fn send(&self, env: &Envelope) -> Result<(QueueId, EnqueueOutcome)> {
        env.validate()?;
        let mut table = self.routing.table().await?;
        for _ in 0..=MAX_REDIRECTS {
            let q = table.route(&env.tenant);
            match self.routing.store().enqueue(q, env).await? {
                EnqueueOutcome::Moved(_) => table = self.routing.refresh().await?,
                outcome => return Ok((q, outcome)),
            }
        }
        Err(StoreError::Protocol {
            script: "enqueue",
            detail: format!(
                "tenant {} kept answering MOVED after {MAX_REDIRECTS} routing refreshes",
                env.tenant
            ),
        })
    }
}
