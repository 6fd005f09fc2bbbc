//! The rate-limit model property test's body (see `tests/model.rs`): random
//! sequences of enqueue, lease, ack, nack, reap and clock steps on a queue
//! whose tenants have delivery token buckets, under the store's virtual
//! clock, so time is exact. A tenant's leases never outrun its bucket (in
//! any window, at most burst + rate x window), an endpoint's never outrun
//! its own, nothing is lost, and under PerTenant ordering each tenant's
//! envelopes are delivered in order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::{QueuePolicy, RateLimit, RateLimits};
use lanekeeper::routing::QueueId;
use lanekeeper::store::{EnqueueOutcome, Failure, Lease, LeaseOutcome, SetId, Store};
use proptest::prelude::*;

const Q: QueueId = QueueId::Shard(0);
const EPOCH: u64 = 1_700_000_000_000;

#[derive(Clone, Debug)]
pub enum Op {
    Enqueue(u8, bool),
    Lease,
    Ack(usize),
    Nack(usize),
    Reap,
    /// Advance the virtual clock by this many ms.
    Tick(u64),
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, any::<bool>()).prop_map(|(t, b)| Op::Enqueue(t, b)),
        4 => Just(Op::Lease),
        2 => (0usize..8).prop_map(Op::Ack),
        1 => (0usize..8).prop_map(Op::Nack),
        1 => Just(Op::Reap),
        2 => (0u64..1500).prop_map(Op::Tick),
    ]
}

/// t0: 2 per second, burst 2; t1: 1 per second to each endpoint, burst 1;
/// t2: unlimited (a tenant with no entry and no default).
/// A policy that checks every lease against a tenant and an endpoint
/// bucket with limits too high to throttle: what checking costs.
pub fn unthrottled_limits() -> QueuePolicy {
    QueuePolicy {
        rate_limits: RateLimits {
            default: Some(RateLimit {
                per_second: 1_000_000.0,
                burst: 1_000_000.0,
                endpoint_per_second: 1_000_000.0,
                endpoint_burst: 1_000_000.0,
            }),
            ..Default::default()
        },
        ..QueuePolicy::default()
    }
}

fn limits() -> RateLimits {
    RateLimits {
        default: None,
        tiers: BTreeMap::new(),
        tenants: [
            (
                "t0".to_string(),
                RateLimit {
                    per_second: 2.0,
                    burst: 2.0,
                    ..Default::default()
                },
            ),
            (
                "t1".to_string(),
                RateLimit {
                    endpoint_per_second: 1.0,
                    endpoint_burst: 1.0,
                    ..Default::default()
                },
            ),
        ]
        .into(),
    }
}

/// Every window between two leases holds at most burst + rate x width of them.
fn check_bucket(what: &str, times: &[u64], rate: f64, burst: f64) -> Result<(), TestCaseError> {
    for i in 0..times.len() {
        for j in i..times.len() {
            let n = (j - i + 1) as f64;
            let allowed = burst + rate * (times[j] - times[i]) as f64 / 1000.0 + 1e-6;
            prop_assert!(
                n <= allowed,
                "{}: {} leases in {} ms (at most {:.3}): {:?}",
                what,
                n,
                times[j] - times[i],
                allowed,
                times
            );
        }
    }
    Ok(())
}

pub async fn run(url: &str, ops: Vec<Op>, ordered: bool) -> Result<(), TestCaseError> {
    static N: AtomicU32 = AtomicU32::new(0);
    let set = SetId::new("buckets", format!("b{}", N.fetch_add(1, Ordering::Relaxed)));
    let s = Store::connect(url, set, Default::default()).await.unwrap();
    let policy = QueuePolicy {
        ordered,
        max_in_flight: 3,
        max_attempts: 1000,
        rate_limits: limits(),
        ..Default::default()
    };
    s.configure_queue(Q, &policy).await.unwrap();
    let mut now = EPOCH;
    s.set_virtual_clock(Q, now).await.unwrap();
    let mut next = [0u64; 3];
    let mut enqueued = BTreeSet::new();
    let mut held: Vec<Lease> = Vec::new();
    let mut acked: BTreeMap<(String, String), u32> = BTreeMap::new();
    let mut order: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    // lease times per tenant, and per (tenant, endpoint)
    let mut by_tenant: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut by_endpoint: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    let mut record = |l: &Lease, now: u64| {
        let ep = l.envelope().unwrap().endpoint.unwrap_or_default();
        by_tenant.entry(l.tenant.clone()).or_default().push(now);
        by_endpoint
            .entry((l.tenant.clone(), ep))
            .or_default()
            .push(now);
    };
    let ack = |l: &Lease,
               acked: &mut BTreeMap<(String, String), u32>,
               order: &mut BTreeMap<String, Vec<u64>>| {
        let seq = l.envelope().unwrap().payload["seq"].as_u64().unwrap();
        *acked.entry((l.tenant.clone(), l.id.clone())).or_default() += 1;
        order.entry(l.tenant.clone()).or_default().push(seq);
    };
    for op in ops {
        match op {
            Op::Enqueue(t, other) => {
                let tenant = format!("t{t}");
                let seq = next[t as usize];
                next[t as usize] += 1;
                let e = Envelope {
                    id: format!("e{seq}"),
                    tenant: tenant.clone(),
                    endpoint: Some(if other { "b" } else { "a" }.into()),
                    event_type: None,
                    payload: serde_json::json!({ "seq": seq }),
                };
                let out = s.enqueue(Q, &e).await.unwrap();
                prop_assert!(matches!(out, EnqueueOutcome::Queued { .. }), "{:?}", out);
                enqueued.insert((tenant, e.id));
            }
            Op::Lease => {
                for _ in 0..4 {
                    match s.lease(Q, "w", Duration::from_secs(60)).await.unwrap() {
                        LeaseOutcome::Leased(l) => {
                            record(&l, now);
                            held.push(l);
                            break;
                        }
                        LeaseOutcome::Again => continue,
                        LeaseOutcome::Empty { .. } => break,
                    }
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
                s.maintain(Q, 100).await.unwrap();
            }
            Op::Tick(ms) => {
                now += ms;
                s.set_virtual_clock(Q, now).await.unwrap();
            }
            _ => {}
        }
    }
    // Finish: ack what is held, then deliver the rest, stepping the clock
    // 100 ms whenever nothing is eligible (the buckets refill).
    for l in std::mem::take(&mut held) {
        if s.ack(&l, Duration::from_millis(1)).await.unwrap() {
            ack(&l, &mut acked, &mut order);
        }
    }
    let mut idle_steps = 0;
    while idle_steps < 2000 {
        match s.lease(Q, "w", Duration::from_secs(3600)).await.unwrap() {
            LeaseOutcome::Leased(l) => {
                record(&l, now);
                prop_assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
                ack(&l, &mut acked, &mut order);
                idle_steps = 0;
            }
            LeaseOutcome::Again => {}
            LeaseOutcome::Empty { .. } => {
                if acked.len() == enqueued.len() {
                    break;
                }
                now += 100;
                s.set_virtual_clock(Q, now).await.unwrap();
                s.maintain(Q, 1000).await.unwrap();
                idle_steps += 1;
            }
        }
    }
    for key in &enqueued {
        let n = acked.get(key).copied().unwrap_or(0);
        prop_assert_eq!(n, 1, "{:?} delivered {} times", key, n);
    }
    prop_assert_eq!(acked.len(), enqueued.len(), "something nobody enqueued");
    check_bucket(
        "t0",
        &by_tenant.get("t0").cloned().unwrap_or_default(),
        2.0,
        2.0,
    )?;
    for ep in ["a", "b"] {
        let times = by_endpoint
            .get(&("t1".to_string(), ep.to_string()))
            .cloned()
            .unwrap_or_default();
        check_bucket(&format!("t1/{ep}"), &times, 1.0, 1.0)?;
    }
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
    s.purge_set().await.unwrap();
    Ok(())
}
