//! The model property test's body (see `tests/model.rs`), shared with the
//! Redis Cluster tests: random sequences of enqueue (tenants share ids),
//! retries of ids already sent, lease, ack, nack, dead-lettering, lease
//! expiry and reap, records deleted behind the store's back, dead-letter
//! replays, moves of a tenant between two queues, and a user's pause and
//! resume of a tenant (no lease of a paused tenant; a move keeps the pause),
//! against the real store at a URL. Under endpoint isolation each tenant
//! sends to two endpoints, and order is checked per (tenant, endpoint).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::{Isolation, QueuePolicy};
use lanekeeper::routing::QueueId;
use lanekeeper::store::{keys, EnqueueOutcome, Failure, Lease, LeaseOutcome, SetId, Store};
use proptest::prelude::*;

const Q: QueueId = QueueId::Shard(0);
const LANE: QueueId = QueueId::Lane(0);
const TENANTS: usize = 3;

#[derive(Clone, Debug)]
pub enum Op {
    Enqueue(u8),
    /// A producer's retry of an id the tenant sent before: always a duplicate.
    Retry(u8, usize),
    Lease {
        lane: bool,
        expiring: bool,
    },
    Ack(usize),
    Nack(usize),
    /// Dead-letter a held lease (a refused delivery).
    Kill(usize),
    Reap,
    /// Delete the record of one of the tenant's envelopes (eviction, a hand edit).
    DeleteRecord(u8, usize),
    Replay(u8),
    /// Move the tenant to the other queue (given up if it is not drained).
    Move(u8),
    /// A user's pause (true) or resume (false) of the tenant, where it lives.
    UserPause(u8, bool),
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3).prop_map(Op::Enqueue),
        1 => (0u8..3, 0usize..32).prop_map(|(t, k)| Op::Retry(t, k)),
        3 => (any::<bool>(), any::<bool>()).prop_map(|(lane, e)| Op::Lease { lane, expiring: e }),
        2 => (0usize..8).prop_map(Op::Ack),
        1 => (0usize..8).prop_map(Op::Nack),
        1 => (0usize..8).prop_map(Op::Kill),
        1 => Just(Op::Reap),
        1 => (0u8..3, 0usize..32).prop_map(|(t, k)| Op::DeleteRecord(t, k)),
        1 => (0u8..3).prop_map(Op::Replay),
        1 => (0u8..3).prop_map(Op::Move),
        1 => (0u8..3, any::<bool>()).prop_map(|(t, p)| Op::UserPause(t, p)),
    ]
}

type Key = (String, String); // (tenant, id)

struct Model {
    s: Store,
    raw: super::stored::Conn,
    /// Where each tenant lives.
    at: [QueueId; TENANTS],
    next: [u64; TENANTS],
    enqueued: BTreeSet<Key>,
    /// Records deleted behind the store's back: each ends acked (its lease
    /// had the payload) or as a "record missing" dead letter.
    deleted: BTreeSet<Key>,
    /// Dead-lettered at some time (a replay may bring it back, out of order).
    killed: BTreeSet<Key>,
    held: Vec<Lease>,
    acked: BTreeMap<Key, u32>,
    order: BTreeMap<String, Vec<u64>>,
    isolation: Isolation,
    /// Paused by a user now.
    paused: [bool; TENANTS],
}

impl Model {
    fn tenant(t: u8) -> String {
        format!("t{t}")
    }

    fn ack(&mut self, l: &Lease) -> Result<(), TestCaseError> {
        let env = l.envelope().unwrap();
        // identity: the payload is the one this tenant stored under this id
        prop_assert_eq!(&env.payload["tenant"], &serde_json::json!(l.tenant));
        let seq = env.payload["seq"].as_u64().unwrap();
        prop_assert_eq!(format!("e{seq}"), l.id.clone());
        let key = (l.tenant.clone(), l.id.clone());
        *self.acked.entry(key.clone()).or_default() += 1;
        if !self.killed.contains(&key) && !self.deleted.contains(&key) {
            // order holds per tenant, or per (tenant, endpoint)
            let stream = match self.isolation {
                Isolation::Tenant => l.tenant.clone(),
                Isolation::Endpoint => format!("{}/{}", l.tenant, env.endpoint_name()),
            };
            self.order.entry(stream).or_default().push(seq);
        }
        Ok(())
    }

    async fn relocate(&mut self, t: u8) {
        let tenant = Self::tenant(t);
        let from = self.at[t as usize];
        let to = if from == Q { LANE } else { Q };
        self.s.pause(from, &tenant).await.unwrap();
        let st = self.s.tenant_state(from, &tenant).await.unwrap();
        if !st.drained() {
            // given up: resumed in place, as a drain timeout does
            self.s.resume(from, &tenant).await.unwrap();
            return;
        }
        self.s.pause(to, &tenant).await.unwrap();
        assert!(self.s.mark_moved(from, &tenant, to).await.unwrap());
        self.s.move_hold(from, to, &tenant).await.unwrap();
        self.s.resume(to, &tenant).await.unwrap();
        self.at[t as usize] = to;
    }
}

pub async fn run(url: &str, ops: Vec<Op>, ordered: bool) -> Result<(), TestCaseError> {
    run_isolated(url, ops, ordered, Isolation::Tenant).await
}

/// [`run`] under `isolation`.
pub async fn run_isolated(
    url: &str,
    ops: Vec<Op>,
    ordered: bool,
    isolation: Isolation,
) -> Result<(), TestCaseError> {
    run_batched(url, ops, ordered, isolation, 1).await
}

/// [`run_isolated`] with leases and acks in batches of up to `batch`
/// ([`Store::lease_batch`]) when `batch` is more than 1: a lease asks for
/// `batch` envelopes, and an ack acks up to `batch` held leases of one
/// queue (from the one picked on) and leases up to `batch` more in the same call.
pub async fn run_batched(
    url: &str,
    ops: Vec<Op>,
    ordered: bool,
    isolation: Isolation,
    batch: usize,
) -> Result<(), TestCaseError> {
    static N: AtomicU32 = AtomicU32::new(0);
    let set = SetId::new("model", format!("m{}", N.fetch_add(1, Ordering::Relaxed)));
    let s = Store::connect(url, set, Default::default()).await.unwrap();
    let policy = QueuePolicy {
        ordered,
        max_in_flight: 2,
        max_attempts: 1000,
        isolation,
        ..Default::default()
    };
    // each tenant's envelopes go to two endpoints under endpoint isolation
    let endpoint = |seq: u64| match isolation {
        Isolation::Tenant => None,
        Isolation::Endpoint => Some(format!("p{}", seq % 2)),
    };
    s.configure_queue(Q, &policy).await.unwrap();
    s.configure_queue(LANE, &policy).await.unwrap();
    // a routing table (every tenant hashes to Q): a user's pause finds the
    // tenant from there, following its moved mark to the lane
    s.set_shards(1).await.unwrap();
    let raw = super::stored::Conn::open(url).await;
    let mut m = Model {
        s,
        raw,
        at: [Q; TENANTS],
        next: [0; TENANTS],
        enqueued: BTreeSet::new(),
        deleted: BTreeSet::new(),
        killed: BTreeSet::new(),
        held: Vec::new(),
        acked: BTreeMap::new(),
        order: BTreeMap::new(),
        isolation,
        paused: [false; TENANTS],
    };
    for op in ops {
        match op {
            Op::Enqueue(t) => {
                let tenant = Model::tenant(t);
                let seq = m.next[t as usize];
                m.next[t as usize] += 1;
                // every tenant uses the same ids: e0, e1, ...
                let e = Envelope {
                    id: format!("e{seq}"),
                    tenant: tenant.clone(),
                    endpoint: endpoint(seq),
                    event_type: None,
                    payload: serde_json::json!({ "seq": seq, "tenant": tenant }),
                };
                let out = m.s.enqueue(m.at[t as usize], &e).await.unwrap();
                prop_assert!(
                    matches!(
                        out,
                        EnqueueOutcome::Queued { .. } | EnqueueOutcome::Held { .. }
                    ),
                    "{:?}",
                    out
                );
                m.enqueued.insert((tenant, e.id));
            }
            Op::Retry(t, k) if m.next[t as usize] > 0 => {
                let tenant = Model::tenant(t);
                let seq = k as u64 % m.next[t as usize];
                let e = Envelope {
                    id: format!("e{seq}"),
                    tenant: tenant.clone(),
                    endpoint: endpoint(seq),
                    event_type: None,
                    payload: serde_json::json!({ "seq": seq, "tenant": tenant, "retry": true }),
                };
                let out = m.s.enqueue(m.at[t as usize], &e).await.unwrap();
                prop_assert_eq!(
                    out,
                    EnqueueOutcome::Duplicate,
                    "retry of {}/e{}",
                    tenant,
                    seq
                );
            }
            Op::Lease { lane, expiring } => {
                let d = if expiring {
                    Duration::from_millis(1)
                } else {
                    Duration::from_secs(60)
                };
                let q = if lane { LANE } else { Q };
                let leased = if batch > 1 {
                    m.s.lease_batch(q, &[], batch, "w", d).await.unwrap().leased
                } else {
                    match m.s.lease(q, "w", d).await.unwrap() {
                        LeaseOutcome::Leased(l) => vec![l],
                        _ => vec![],
                    }
                };
                for l in leased {
                    let t: usize = l.tenant[1..].parse().unwrap();
                    prop_assert!(!m.paused[t], "{} leased while paused by a user", l.tenant);
                    m.held.push(l);
                }
            }
            Op::Ack(i) if !m.held.is_empty() && batch > 1 => {
                // up to `batch` held leases of the queue of the one picked
                // (every other one from it), acked with up to `batch` new
                // leases in one call
                let q = m.held[i % m.held.len()].queue;
                let mut picked = Vec::new();
                let mut j = 0;
                while j < m.held.len() && picked.len() < batch {
                    if m.held[j].queue == q && (picked.is_empty() || j % 2 == i % 2) {
                        picked.push(m.held.remove(j));
                    } else {
                        j += 1;
                    }
                }
                let done: Vec<_> = picked
                    .iter()
                    .map(|l| (l, Duration::from_millis(3)))
                    .collect();
                let answer =
                    m.s.lease_batch(q, &done, batch, "w", Duration::from_secs(60))
                        .await
                        .unwrap();
                prop_assert_eq!(answer.acked.len(), picked.len());
                for (l, a) in picked.iter().zip(&answer.acked) {
                    if a.acked {
                        m.ack(l)?;
                    }
                }
                for l in answer.leased {
                    let t: usize = l.tenant[1..].parse().unwrap();
                    prop_assert!(!m.paused[t], "{} leased while paused by a user", l.tenant);
                    m.held.push(l);
                }
            }
            Op::Ack(i) if !m.held.is_empty() => {
                let l = m.held.remove(i % m.held.len());
                if m.s.ack(&l, Duration::from_millis(3)).await.unwrap() {
                    m.ack(&l)?;
                }
            }
            Op::Nack(i) if !m.held.is_empty() => {
                let l = m.held.remove(i % m.held.len());
                m.s.nack(
                    &l,
                    Duration::from_millis(3),
                    &Failure::retry("model failure", Duration::from_millis(1)),
                )
                .await
                .unwrap();
            }
            Op::Kill(i) if !m.held.is_empty() => {
                let l = m.held.remove(i % m.held.len());
                let out =
                    m.s.nack(
                        &l,
                        Duration::from_millis(3),
                        &Failure::dead("model refusal"),
                    )
                    .await
                    .unwrap();
                if !matches!(out, lanekeeper::store::NackOutcome::Stale) {
                    m.killed.insert((l.tenant.clone(), l.id.clone()));
                }
            }
            Op::Reap => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                for q in [Q, LANE] {
                    m.s.maintain(q, 100).await.unwrap();
                }
            }
            Op::DeleteRecord(t, k) if m.next[t as usize] > 0 => {
                let tenant = Model::tenant(t);
                let id = format!("e{}", k as u64 % m.next[t as usize]);
                let key = (tenant.clone(), id.clone());
                if m.enqueued.contains(&key) && !m.acked.contains_key(&key) {
                    for q in [Q, LANE] {
                        m.raw.lose_body(&m.s.queue_prefix(q), &tenant, &id).await;
                    }
                    m.deleted.insert(key);
                }
            }
            Op::Replay(t) => {
                let tenant = Model::tenant(t);
                let _ =
                    m.s.replay_dead(m.at[t as usize], &tenant, &[])
                        .await
                        .unwrap();
            }
            Op::Move(t) => {
                m.relocate(t).await;
                let st =
                    m.s.tenant_state(m.at[t as usize], &Model::tenant(t))
                        .await
                        .unwrap();
                prop_assert_eq!(
                    st.user_paused,
                    m.paused[t as usize],
                    "the pause moved with t{}",
                    t
                );
            }
            Op::UserPause(t, paused) => {
                let o = m.s.set_user_pause(&Model::tenant(t), paused).await.unwrap();
                prop_assert_eq!(o.queue, m.at[t as usize], "paused where it lives");
                m.paused[t as usize] = paused;
            }
            _ => {}
        }
    }
    // Finish: resume every tenant, then deliver everything still owed (held
    // leases may have expired and moved on), replaying every tenant's dead
    // letters where it lives.
    for t in 0..TENANTS as u8 {
        if m.paused[t as usize] {
            m.s.set_user_pause(&Model::tenant(t), false).await.unwrap();
        }
    }
    for l in std::mem::take(&mut m.held) {
        if m.s.ack(&l, Duration::from_millis(1)).await.unwrap() {
            m.ack(&l)?;
        }
    }
    for t in 0..TENANTS as u8 {
        let tenant = Model::tenant(t);
        m.s.replay_dead(m.at[t as usize], &tenant, &[])
            .await
            .unwrap()
            .ok();
    }
    for q in [Q, LANE] {
        for _ in 0..10_000 {
            match m.s.lease(q, "w", Duration::from_secs(60)).await.unwrap() {
                LeaseOutcome::Leased(l) => {
                    prop_assert!(m.s.ack(&l, Duration::from_millis(1)).await.unwrap());
                    m.ack(&l)?;
                }
                LeaseOutcome::Again => {}
                LeaseOutcome::Empty { .. } => {
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    let (p, r) = m.s.maintain(q, 1000).await.unwrap();
                    if p == 0 && r == 0 {
                        match m.s.lease(q, "w", Duration::from_secs(60)).await.unwrap() {
                            LeaseOutcome::Empty { .. } => break,
                            LeaseOutcome::Leased(l) => {
                                prop_assert!(m.s.ack(&l, Duration::from_millis(1)).await.unwrap());
                                m.ack(&l)?;
                            }
                            LeaseOutcome::Again => {}
                        }
                    }
                }
            }
        }
    }
    // What is left as dead letters: records that went missing (no payload to
    // replay), and killed envelopes of a tenant that moved away since.
    let mut dead: BTreeMap<Key, String> = BTreeMap::new();
    for q in [Q, LANE] {
        for t in 0..TENANTS as u8 {
            let tenant = Model::tenant(t);
            let page = m.s.dead_letters(q, &tenant, None, 1000).await.unwrap();
            for d in page.letters {
                dead.insert((tenant.clone(), d.id), d.cause);
            }
        }
    }
    for key in &m.enqueued {
        let acked = m.acked.get(key).copied().unwrap_or(0);
        prop_assert!(acked <= 1, "{:?} acked {} times", key, acked);
        if acked == 0 {
            let cause = dead.get(key);
            prop_assert!(
                cause.is_some(),
                "{:?} lost: neither delivered nor a dead letter",
                key
            );
            let cause = cause.unwrap();
            prop_assert!(
                (m.deleted.contains(key) && cause.contains("record missing"))
                    || m.killed.contains(key),
                "{:?} dead for no reason of the model's: {}",
                key,
                cause
            );
        }
    }
    prop_assert!(
        m.acked.keys().all(|k| m.enqueued.contains(k)),
        "an envelope nobody enqueued was delivered"
    );
    // Attribution agrees: nothing outstanding.
    for q in [Q, LANE] {
        let stats = m.s.tenant_stats(q, Duration::from_secs(600)).await.unwrap();
        prop_assert!(
            stats.iter().all(|t| t.depth == 0),
            "depth left over in {}: {:?}",
            q,
            stats
        );
    }
    if ordered {
        for (t, seqs) in &m.order {
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
