//! The model property test's body (see `tests/model.rs`), shared with the
//! Redis Cluster tests: random sequences of enqueue, lease, ack, nack, lease
//! expiry and reap against the real store at a URL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lanekeeper::envelope::Envelope;
use lanekeeper::routing::QueueId;
use lanekeeper::scheduler::QueuePolicy;
use lanekeeper::store::{Failure, Lease, LeaseOutcome, SetId, Store};
use proptest::prelude::*;

const Q: QueueId = QueueId::Shard(0);

#[derive(Clone, Debug)]
pub enum Op {
    Enqueue(u8),
    Lease { expiring: bool },
    Ack(usize),
    Nack(usize),
    Reap,
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3).prop_map(Op::Enqueue),
        3 => any::<bool>().prop_map(|e| Op::Lease { expiring: e }),
        2 => (0usize..8).prop_map(Op::Ack),
        1 => (0usize..8).prop_map(Op::Nack),
        1 => Just(Op::Reap),
    ]
}

pub async fn run(url: &str, ops: Vec<Op>, ordered: bool) -> Result<(), TestCaseError> {
    static N: AtomicU32 = AtomicU32::new(0);
    let set = SetId::new("model", format!("m{}", N.fetch_add(1, Ordering::Relaxed)));
    let s = Store::connect(url, set, Default::default()).await.unwrap();
    let policy = QueuePolicy {
        ordered,
        max_in_flight: 2,
        max_attempts: 1000,
        ..Default::default()
    };
    s.configure_queue(Q, &policy).await.unwrap();
    let mut next = [0u64; 3];
    let mut enqueued = BTreeSet::new();
    let mut held: Vec<Lease> = Vec::new();
    let mut acked: BTreeMap<String, u32> = BTreeMap::new();
    let mut order: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let ack =
        |l: &Lease, acked: &mut BTreeMap<String, u32>, order: &mut BTreeMap<String, Vec<u64>>| {
            *acked.entry(l.id.clone()).or_default() += 1;
            let seq = l.envelope().unwrap().payload["seq"].as_u64().unwrap();
            order.entry(l.tenant.clone()).or_default().push(seq);
        };
    for op in ops {
        match op {
            Op::Enqueue(t) => {
                let tenant = format!("t{t}");
                let seq = next[t as usize];
                next[t as usize] += 1;
                let e = Envelope {
                    id: format!("{tenant}-{seq}"),
                    tenant,
                    endpoint: None,
                    event_type: None,
                    payload: serde_json::json!({ "seq": seq }),
                };
                s.enqueue(Q, &e).await.unwrap();
                enqueued.insert(e.id);
            }
            Op::Lease { expiring } => {
                let d = if expiring {
                    Duration::from_millis(1)
                } else {
                    Duration::from_secs(60)
                };
                if let LeaseOutcome::Leased(l) = s.lease(Q, "w", d).await.unwrap() {
                    held.push(l);
                }
            }
            Op::Ack(i) if !held.is_empty() => {
                let l = held.remove(i % held.len());
                if s.ack(&l, Duration::from_millis(3)).await.unwrap() {
                    ack(&l, &mut acked, &mut order);
                }
            }
            Op::Nack(i) if !held.is_empty() => {
                let l = held.remove(i % held.len());
                s.nack(
                    &l,
                    Duration::from_millis(3),
                    &Failure::retry("model failure", Duration::from_millis(1)),
                )
                .await
                .unwrap();
            }
            Op::Reap => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                s.maintain(Q, 100).await.unwrap();
            }
            _ => {}
        }
    }
    // Finish: deliver everything still owed (held leases may have expired and moved on).
    for l in std::mem::take(&mut held) {
        if s.ack(&l, Duration::from_millis(1)).await.unwrap() {
            ack(&l, &mut acked, &mut order);
        }
    }
    for _ in 0..10_000 {
        match s.lease(Q, "w", Duration::from_secs(60)).await.unwrap() {
            LeaseOutcome::Leased(l) => {
                prop_assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
                ack(&l, &mut acked, &mut order);
            }
            LeaseOutcome::Again => {}
            LeaseOutcome::Empty { .. } => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                let (p, r) = s.maintain(Q, 1000).await.unwrap();
                if p == 0
                    && r == 0
                    && matches!(
                        s.lease(Q, "probe", Duration::from_millis(1)).await.unwrap(),
                        LeaseOutcome::Empty { .. }
                    )
                {
                    break;
                }
            }
        }
    }
    let delivered: BTreeSet<String> = acked.keys().cloned().collect();
    prop_assert_eq!(&delivered, &enqueued, "lost envelopes");
    prop_assert!(
        acked.values().all(|n| *n == 1),
        "an envelope was acked twice: {:?}",
        acked
    );
    // Attribution agrees: nothing outstanding, every delivery counted once.
    let stats = s.tenant_stats(Q, Duration::from_secs(600)).await.unwrap();
    prop_assert!(
        stats.iter().all(|t| t.depth == 0),
        "depth left over: {:?}",
        stats
    );
    prop_assert_eq!(
        stats.iter().map(|t| t.delivered).sum::<u64>(),
        enqueued.len() as u64
    );
    if ordered {
        for (t, seqs) in &order {
            prop_assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "{} out of order: {:?}",
                t,
                seqs
            );
        }
    }
    Ok(())
}
