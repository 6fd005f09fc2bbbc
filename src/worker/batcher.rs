//! Group commit of a worker's acks and leases. Each delivery task asks for
//! its next envelope (after acking the one it delivered, or with nothing to
//! ack); the requests that arrive while a call is in flight go together in
//! the next call, [`Store::lease_batch`]: a worker with k free slots acks
//! what finished and leases k envelopes in one script call, each lease its
//! own turn of deficit round robin. A lone request goes at once: batching
//! never makes a task wait for others, it only gathers those already
//! waiting.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, oneshot};

use crate::routing::QueueId;
use crate::store::{Acked, Lease, LeaseOutcome, Store, StoreError, LEASE_BATCH_MAX};

/// What a task gets back: the ack's answer (when it had one to make) and
/// its next lease. A failed call fails every request it carried.
pub(super) type Answer = Result<(Option<Acked>, LeaseOutcome), Arc<StoreError>>;

struct Request {
    done: Option<(Lease, Duration)>,
    reply: oneshot::Sender<Answer>,
}

/// The handle delivery tasks share; the batching task ends when the last
/// handle is dropped.
#[derive(Clone)]
pub(super) struct Batcher {
    tx: mpsc::UnboundedSender<Request>,
}

impl Batcher {
    /// Start the batching task of queue `q` for the worker `worker`; each
    /// call's size goes to `sizes`.
    pub(super) fn start(
        store: Store,
        q: QueueId,
        worker: String,
        lease_for: Duration,
        sizes: Histogram,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(store, q, worker, lease_for, sizes, rx));
        Batcher { tx }
    }

    /// Ack `done` (a delivery and the time it took), if any, and lease the
    /// next envelope.
    pub(super) async fn next(&self, done: Option<(Lease, Duration)>) -> Answer {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Request { done, reply }).is_err() {
            return Err(Arc::new(stopped()));
        }
        answer.await.unwrap_or_else(|_| Err(Arc::new(stopped())))
    }
}

fn stopped() -> StoreError {
    StoreError::InvalidBatch("the worker's lease batcher has stopped".into())
}

async fn run(
    store: Store,
    q: QueueId,
    worker: String,
    lease_for: Duration,
    sizes: Histogram,
    mut rx: mpsc::UnboundedReceiver<Request>,
) {
    let mut waiting = Vec::with_capacity(LEASE_BATCH_MAX);
    while rx.recv_many(&mut waiting, LEASE_BATCH_MAX).await > 0 {
        let batch: Vec<Request> = std::mem::take(&mut waiting);
        sizes.observe(batch.len() as f64);
        let done: Vec<(&Lease, Duration)> = batch
            .iter()
            .filter_map(|r| r.done.as_ref().map(|(l, d)| (l, *d)))
            .collect();
        // every request wants one envelope: k is the worker's free slots
        let answer = store
            .lease_batch(q, &done, batch.len(), &worker, lease_for)
            .await;
        match answer {
            Ok(answer) => {
                let mut acked = answer.acked.into_iter();
                let mut leased = answer.leased.into_iter();
                let short = answer.short.unwrap_or(LeaseOutcome::Again);
                for r in batch {
                    let ack = r.done.as_ref().and_then(|_| acked.next());
                    let next = leased
                        .next()
                        .map_or_else(|| short.clone(), LeaseOutcome::Leased);
                    // a task that stopped waiting (shutdown) has gone:
                    // what was leased for it goes back at once
                    if let Err(Ok((_, LeaseOutcome::Leased(lease)))) = r.reply.send(Ok((ack, next)))
                    {
                        let _ = store.release(&lease).await;
                    }
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                for r in batch {
                    let _ = r.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
