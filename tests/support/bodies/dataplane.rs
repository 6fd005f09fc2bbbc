//! Data-plane test bodies shared by the single-server tests (`tests/dataplane.rs`)
//! and the Redis Cluster tests (`tests/cluster.rs`): each takes the Redis URL.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::producer::Producer;
use lanekeeper::routing::{hash_shard, QueueId};
use lanekeeper::store::{ConnectOptions, EnqueueOutcome, Lease, LeaseOutcome, SetId, Store};

pub const Q: QueueId = QueueId::Shard(0);
pub const LEASE: Duration = Duration::from_secs(30);

/// A store on a set of its own, with `policy` on queue [`Q`].
pub async fn store(url: &str, policy: QueuePolicy) -> Store {
    static N: AtomicU32 = AtomicU32::new(0);
    let set = SetId::new("test", format!("set{}", N.fetch_add(1, Ordering::Relaxed)));
    let s = Store::connect(url, set, ConnectOptions::default())
        .await
        .expect("connect to the test redis");
    s.configure_queue(Q, &policy).await.unwrap();
    s
}

pub fn env(tenant: &str, seq: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{seq}"),
        tenant: tenant.to_string(),
        endpoint: Some("main".into()),
        event_type: Some("test.event".into()),
        payload: serde_json::json!({ "seq": seq }),
    }
}

pub fn seq_of(lease: &Lease) -> u64 {
    lease.envelope().unwrap().payload["seq"].as_u64().unwrap()
}

pub async fn lease(s: &Store, q: QueueId) -> Option<Lease> {
    loop {
        match s.lease(q, "w1", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) => return Some(l),
            LeaseOutcome::Empty { .. } => return None,
            LeaseOutcome::Again => continue,
        }
    }
}

pub async fn fill(s: &Store, q: QueueId, tenant: &str, n: u64) {
    let envs: Vec<Envelope> = (0..n).map(|i| env(tenant, i)).collect();
    for chunk in envs.chunks(5000) {
        for r in s.enqueue_batch(q, chunk).await.unwrap() {
            assert!(matches!(r.unwrap(), EnqueueOutcome::Queued { .. }));
        }
    }
}

pub async fn whale_cannot_delay_the_small_tenant(url: &str) {
    for whale_backlog in [10_000u64, 100_000] {
        let s = store(url, QueuePolicy::default()).await;
        fill(&s, Q, "whale", whale_backlog).await;
        s.enqueue(Q, &env("small", 0)).await.unwrap();
        let mut position = None;
        for i in 1..=20 {
            let l = lease(&s, Q).await.unwrap();
            let small = l.tenant == "small";
            s.ack(&l, Duration::from_millis(50)).await.unwrap();
            if small {
                position = Some(i);
                break;
            }
        }
        let position = position.unwrap_or_else(|| {
            panic!(
                "small tenant not leased within 20 leases behind {whale_backlog} whale envelopes"
            )
        });
        eprintln!("whale backlog {whale_backlog}: small tenant leased at position {position}");
    }
}

pub async fn paused_tenant_is_held_and_moved_tenant_answers_moved(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let lane = QueueId::Lane(0);
    s.configure_queue(lane, &QueuePolicy::default())
        .await
        .unwrap();
    s.enqueue(Q, &env("whale", 0)).await.unwrap();
    s.pause(Q, "whale").await.unwrap();
    assert!(matches!(
        s.enqueue(Q, &env("whale", 1)).await.unwrap(),
        EnqueueOutcome::Held { .. }
    ));
    // Not drained yet: moving is refused.
    assert!(!s.mark_moved(Q, "whale", lane).await.unwrap());
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(seq_of(&l), 0);
    assert!(
        !s.mark_moved(Q, "whale", lane).await.unwrap(),
        "in flight still"
    );
    s.ack(&l, Duration::from_millis(1)).await.unwrap();
    assert!(
        lease(&s, Q).await.is_none(),
        "held envelopes are not leased"
    );
    let st = s.tenant_state(Q, "whale").await.unwrap();
    assert!(st.drained() && st.paused && st.held == 1, "{st:?}");
    s.pause(lane, "whale").await.unwrap();
    assert!(s.mark_moved(Q, "whale", lane).await.unwrap());
    assert_eq!(
        s.enqueue(Q, &env("whale", 2)).await.unwrap(),
        EnqueueOutcome::Moved(lane)
    );
    assert!(matches!(
        s.enqueue(lane, &env("whale", 2)).await.unwrap(),
        EnqueueOutcome::Held { .. }
    ));
    assert_eq!(s.move_hold(Q, lane, "whale").await.unwrap(), 1);
    assert_eq!(
        s.move_hold(Q, lane, "whale").await.unwrap(),
        0,
        "repeating the move is a no-op"
    );
    assert_eq!(s.resume(lane, "whale").await.unwrap(), 1);
    let order: Vec<u64> = [
        lease(&s, lane).await.unwrap(),
        lease(&s, lane).await.unwrap(),
    ]
    .iter()
    .map(seq_of)
    .collect();
    assert_eq!(order, vec![1, 2]);
}

/// Sequence numbers arrive in order across a relocation, under continuous enqueue
/// by a producer whose routing cache goes stale.
pub async fn relocation_keeps_order_under_continuous_enqueue(url: &str) {
    let policy = QueuePolicy {
        ordered: true,
        ..Default::default()
    };
    let s = store(url, policy.clone()).await;
    s.set_shards(4).await.unwrap();
    let src = hash_shard("mover", 4);
    let dst = QueueId::Lane(1);
    for q in [
        QueueId::Shard(0),
        QueueId::Shard(1),
        QueueId::Shard(2),
        QueueId::Shard(3),
        dst,
    ] {
        s.configure_queue(q, &policy).await.unwrap();
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(AtomicU32::new(0));
    let producer = {
        let (s, stop, sent) = (s.clone(), stop.clone(), sent.clone());
        tokio::spawn(async move {
            let p = Producer::new(s, Duration::from_millis(200));
            let mut seq = 0u64;
            while !stop.load(Ordering::SeqCst) {
                p.send(&env("mover", seq)).await.unwrap();
                seq += 1;
                sent.store(seq as u32, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            seq
        })
    };
    let consumer = {
        let s = s.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut got = Vec::new();
            let mut quiet_rounds = 0;
            loop {
                let mut any = false;
                for q in [src, dst] {
                    if let LeaseOutcome::Leased(l) = s.lease(q, "c", LEASE).await.unwrap() {
                        got.push(seq_of(&l));
                        s.ack(&l, Duration::from_millis(1)).await.unwrap();
                        any = true;
                    }
                }
                if !any {
                    if stop.load(Ordering::SeqCst) {
                        quiet_rounds += 1;
                        if quiet_rounds > 20 {
                            return got;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The reconcile phases, as the controller runs them.
    s.pause(src, "mover").await.unwrap();
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    // Drained, and the producer has put something in the hold buffer meanwhile.
    loop {
        let st = s.tenant_state(src, "mover").await.unwrap();
        if st.drained() && st.held > 0 {
            break;
        }
        assert!(Instant::now() < drain_deadline, "drain timed out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.pause(dst, "mover").await.unwrap();
    s.pin("mover", dst).await.unwrap();
    assert!(s.mark_moved(src, "mover", dst).await.unwrap());
    let held = s.move_hold(src, dst, "mover").await.unwrap();
    s.resume(dst, "mover").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.store(true, Ordering::SeqCst);
    let total = producer.await.unwrap();
    let got = consumer.await.unwrap();
    eprintln!("relocation: {total} sent, {held} moved from the hold buffer");
    assert!(held > 0, "the move should have happened under load");
    assert_eq!(
        got,
        (0..total).collect::<Vec<_>>(),
        "lost, duplicated or reordered across the move"
    );
}

/// A moved tenant's backlog is weighed by its tier on its new queue before
/// its next event says the tier again; a tier the new queue heard since the
/// repin (newer) is kept.
pub async fn a_moved_tenant_keeps_its_tier_on_its_new_queue(url: &str) {
    use lanekeeper::store::{TenantTerms, TierUpdate};
    let s = store(url, QueuePolicy::default()).await;
    let lane = QueueId::Lane(0);
    s.configure_queue(lane, &QueuePolicy::default())
        .await
        .unwrap();
    let tiered = |tier: Option<&str>| {
        let tier = tier.map_or(TierUpdate::Keep, |t| TierUpdate::Set(t.into()));
        move |_: &str| TenantTerms {
            backlog_limit: None,
            tier: tier.clone(),
        }
    };
    let tier_in = |q: QueueId, t: &'static str| {
        let key = lanekeeper::store::keys::tenant(&s.queue_prefix(q), t);
        let cmd = redis::cmd("HGET").arg(key).arg("tr").clone();
        async move {
            match lanekeeper::store::cluster_nodes(url) {
                Some(nodes) => {
                    let client = redis::cluster::ClusterClient::new(nodes.unwrap()).unwrap();
                    let mut c = client.get_async_connection().await.unwrap();
                    cmd.query_async::<Option<String>>(&mut c).await.unwrap()
                }
                None => {
                    let client = redis::Client::open(url).unwrap();
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    cmd.query_async::<Option<String>>(&mut c).await.unwrap()
                }
            }
        }
    };
    for (t, since_repin, want) in [
        ("gold-co", None, "gold"),
        ("promo-co", Some("silver"), "silver"),
    ] {
        let one = |seq| vec![env(t, seq)];
        let r = s
            .enqueue_batch_routed(Q, &one(0), tiered(Some("gold")), 0)
            .await
            .unwrap();
        assert!(matches!(r[0], Ok(EnqueueOutcome::Queued { .. })), "{r:?}");
        let l = lease(&s, Q).await.unwrap();
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
        s.pause(Q, t).await.unwrap();
        let r = s
            .enqueue_batch_routed(Q, &one(1), tiered(Some("gold")), 0)
            .await
            .unwrap();
        assert!(matches!(r[0], Ok(EnqueueOutcome::Held { .. })), "{r:?}");
        s.pause(lane, t).await.unwrap();
        assert!(s.mark_moved(Q, t, lane).await.unwrap());
        let r = s
            .enqueue_batch_routed(lane, &one(2), tiered(since_repin), 0)
            .await
            .unwrap();
        assert!(matches!(r[0], Ok(EnqueueOutcome::Held { .. })), "{r:?}");
        assert_eq!(s.move_hold(Q, lane, t).await.unwrap(), 1);
        assert_eq!(s.resume(lane, t).await.unwrap(), 1);
        assert_eq!(tier_in(lane, t).await.as_deref(), Some(want), "{t}");
    }
}
