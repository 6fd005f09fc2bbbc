//! Scenarios shared by the worker tests and the delivery benchmark: a
//! ShardSet with one shard, real worker processes and a local receiver.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lanekeeper::endpoint::Endpoint;
use lanekeeper::envelope::Envelope;
use lanekeeper::routing::QueueId;
use lanekeeper::scheduler::QueuePolicy;
use lanekeeper::signing::Secret;
use lanekeeper::store::{SetId, Store};

use crate::support::receiver::{now_ms, Receiver};

pub const Q: QueueId = QueueId::Shard(0);

pub struct Setup {
    pub store: Store,
    pub set: String,
    pub redis_url: String,
    pub receiver: Receiver,
}

pub async fn setup(policy: QueuePolicy) -> Setup {
    setup_on(&crate::support::redis::shared().url, policy).await
}

/// [`setup`] on the Redis (or Redis Cluster) at `redis_url`.
pub async fn setup_on(redis_url: &str, policy: QueuePolicy) -> Setup {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("w{}", N.fetch_add(1, Ordering::Relaxed));
    setup_named(redis_url, &name, policy).await
}

/// [`setup_on`] for the ShardSet `worker/<name>`.
pub async fn setup_named(redis_url: &str, name: &str, policy: QueuePolicy) -> Setup {
    let redis_url = redis_url.to_string();
    let store = Store::connect(&redis_url, SetId::new("worker", name), Default::default())
        .await
        .unwrap();
    store.set_shards(1).await.unwrap();
    store.configure_queue(Q, &policy).await.unwrap();
    Setup {
        store,
        set: format!("worker/{name}"),
        redis_url,
        receiver: Receiver::start(),
    }
}

impl Setup {
    /// Register `tenant`'s default endpoint at the receiver with `mode`.
    pub async fn endpoint(&self, tenant: &str, mode: &str, secrets: usize) {
        let secrets: Vec<String> = (0..secrets).map(|_| Secret::generate()).collect();
        self.receiver.expect_secrets(tenant, &secrets);
        self.endpoint_at(tenant, &self.receiver.url(tenant, mode), secrets)
            .await;
    }

    pub async fn endpoint_at(&self, tenant: &str, url: &str, secrets: Vec<String>) {
        let ep = Endpoint {
            url: url.to_string(),
            secrets,
            enabled: true,
            event_types: vec![],
        };
        self.store
            .put_endpoint(tenant, "default", &ep)
            .await
            .unwrap();
    }

    pub async fn send(&self, tenant: &str, seqs: std::ops::Range<u64>) {
        let envs: Vec<Envelope> = seqs.map(|seq| envelope(tenant, seq)).collect();
        for chunk in envs.chunks(2000) {
            for r in self.store.enqueue_batch(Q, chunk).await.unwrap() {
                r.unwrap();
            }
        }
    }

    pub fn worker(&self, extra: &[&str]) -> u32 {
        let mut args = crate::support::workers::LOCAL_ARGS.to_vec();
        args.extend_from_slice(extra);
        crate::support::workers::spawn(&self.redis_url, &self.set, "shard-00", &args)
    }

    /// Accepted deliveries, by envelope id.
    pub fn accepted(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for a in self.receiver.arrivals().into_iter().filter(|a| a.accepted) {
            *m.entry(a.id).or_default() += 1;
        }
        m
    }

    /// Wait until `n` distinct envelopes were accepted. `timeout` bounds the
    /// time *without progress*: a slower machine takes longer but keeps
    /// delivering, and what this catches is a stall (the mechanism's failure),
    /// not a machine's speed.
    pub async fn wait_for_accepted(&self, n: usize, timeout: Duration) {
        let started = Instant::now();
        let mut deadline = started + timeout;
        let mut last = 0;
        loop {
            let got = self.accepted().len();
            if got >= n {
                return;
            }
            if got > last {
                last = got;
                deadline = Instant::now() + timeout;
            }
            assert!(
                Instant::now() < deadline,
                "only {got} of {n} envelopes arrived: none for {timeout:?} (after {:?})",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

pub fn envelope(tenant: &str, seq: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{seq}"),
        tenant: tenant.to_string(),
        endpoint: None,
        event_type: Some("test.event".into()),
        payload: serde_json::json!({ "tenant": tenant, "seq": seq, "sent_ms": now_ms() }),
    }
}

/// SIGTERM a worker and check it exits 0.
pub fn stop(pid: u32) {
    crate::support::process::signal(pid, libc::SIGTERM);
    let code = crate::support::process::wait_exit(pid, Duration::from_secs(30));
    assert_eq!(
        code,
        Some(Some(0)),
        "worker {pid} did not exit 0 after SIGTERM"
    );
}

/// p50 and p99 of the small tenant's wait (enqueue to arrival at the receiver), in ms.
pub fn wait_percentiles(receiver: &Receiver, small: &str) -> (u64, u64) {
    let mut waits: Vec<u64> = receiver
        .arrivals()
        .into_iter()
        .filter(|a| a.accepted && a.id.starts_with(small))
        .map(|a| a.at_ms.saturating_sub(a.sent_ms))
        .collect();
    assert!(!waits.is_empty());
    waits.sort();
    let pct = |p: f64| waits[((waits.len() as f64 * p).ceil() as usize).clamp(1, waits.len()) - 1];
    (pct(0.50), pct(0.99))
}

/// The small tenant sends one event every 100 ms, 50 in all, while `whale`
/// envelopes (if any) are queued ahead of it. With `fifo`, whale and small
/// share one tenant, which is what a single FIFO queue does.
pub async fn small_tenant_scenario(whale: u64, fifo: bool) -> (u64, u64, Duration) {
    // The whale may use 32 of the 64 delivery slots at once: a hard case for the small tenant.
    let s = setup(QueuePolicy {
        max_in_flight: 32,
        ..Default::default()
    })
    .await;
    let (whale_tenant, small_tenant) = if fifo {
        ("fifo", "fifo")
    } else {
        ("whale", "small")
    };
    s.endpoint(whale_tenant, "delay-5", 1).await;
    if !fifo {
        s.endpoint(small_tenant, "delay-5", 1).await;
    }
    let envs: Vec<Envelope> = (0..whale)
        .map(|i| Envelope {
            id: format!("whale-{i}"),
            ..envelope(whale_tenant, i)
        })
        .collect();
    for chunk in envs.chunks(2000) {
        s.store.enqueue_batch(Q, chunk).await.unwrap();
    }
    let pids: Vec<u32> = (0..2).map(|_| s.worker(&["--concurrency", "32"])).collect();
    let started = Instant::now();
    for i in 0..50u64 {
        let e = Envelope {
            id: format!("small-{i}"),
            ..envelope(small_tenant, i)
        };
        s.store.enqueue(Q, &e).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while s
        .accepted()
        .keys()
        .filter(|id| id.starts_with("small"))
        .count()
        < 50
    {
        assert!(
            Instant::now() < deadline,
            "small tenant's events did not all arrive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (p50, p99) = wait_percentiles(&s.receiver, "small");
    s.wait_for_accepted((whale + 50) as usize, Duration::from_secs(300))
        .await;
    let drained = started.elapsed();
    for pid in pids {
        stop(pid);
    }
    (p50, p99, drained)
}
