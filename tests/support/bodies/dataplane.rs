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

/// Lease everything `q` hands out now, acking each: the (tenant, seq) order.
pub async fn drain_order(s: &Store, q: QueueId) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    while let Some(l) = lease(s, q).await {
        out.push((l.tenant.clone(), seq_of(&l)));
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    out
}

/// A user's pause: leases skip the tenant (what is in flight finishes),
/// ingest keeps accepting within its backlog limit, the others are served;
/// a resume serves it again in its order.
pub async fn a_user_paused_tenant_waits_in_order_while_the_others_flow(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    s.set_shards(1).await.unwrap();
    fill(&s, Q, "acme", 5).await;
    let first = lease(&s, Q).await.unwrap();
    assert_eq!(first.tenant, "acme");
    fill(&s, Q, "other", 3).await;
    let o = s.set_user_pause("acme", true).await.unwrap();
    assert!(o.paused && o.changed && o.queue == Q, "{o:?}");
    assert_eq!(o.depth, 5);
    let again = s.set_user_pause("acme", true).await.unwrap();
    assert!(again.paused && !again.changed, "{again:?}");
    assert!(again.version > o.version);
    // Ingest keeps accepting, within the backlog limit.
    for i in 5..8 {
        let r = s
            .enqueue_limited(Q, &env("acme", i), Some(8))
            .await
            .unwrap();
        assert!(matches!(r, EnqueueOutcome::Queued { .. }), "{r:?}");
    }
    let r = s
        .enqueue_limited(Q, &env("acme", 8), Some(8))
        .await
        .unwrap();
    assert!(matches!(r, EnqueueOutcome::Full { .. }), "{r:?}");
    // The delivery in flight finishes; only the other tenant is served.
    assert!(s.ack(&first, Duration::from_millis(1)).await.unwrap());
    let served = drain_order(&s, Q).await;
    assert!(
        served.iter().all(|(t, _)| t == "other") && served.len() == 3,
        "{served:?}"
    );
    let st = s.tenant_state(Q, "acme").await.unwrap();
    assert!(st.user_paused && !st.paused && st.queued == 7, "{st:?}");
    assert_eq!(s.user_paused(Q).await.unwrap(), vec!["acme".to_string()]);
    let o = s.set_user_pause("acme", false).await.unwrap();
    assert!(!o.paused && o.changed, "{o:?}");
    let served: Vec<u64> = drain_order(&s, Q).await.into_iter().map(|x| x.1).collect();
    let first_seq = seq_of(&first);
    assert_eq!(first_seq, 0);
    assert_eq!(served, (1..8).collect::<Vec<_>>());
    assert!(s.user_paused(Q).await.unwrap().is_empty());
}

/// A user's pause composes with a move: a paused tenant's queued lane goes
/// with it (in bounded steps, in order), it stays paused on its new queue,
/// and a resume that reached the new queue first is not undone by the move.
pub async fn a_user_pause_travels_with_a_move_and_the_newer_operation_wins(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    s.set_shards(1).await.unwrap();
    let lane = QueueId::Lane(0);
    s.configure_queue(lane, &QueuePolicy::default())
        .await
        .unwrap();
    // 2,500 queued when paused (more than one merge step), 3 held during the move.
    fill(&s, Q, "acme", 2500).await;
    s.set_user_pause("acme", true).await.unwrap();
    s.pause(Q, "acme").await.unwrap();
    for i in 2500..2503 {
        let r = s.enqueue(Q, &env("acme", i)).await.unwrap();
        assert!(matches!(r, EnqueueOutcome::Held { .. }), "{r:?}");
    }
    let st = s.tenant_state(Q, "acme").await.unwrap();
    assert!(st.drained(), "a paused lane moves along: {st:?}");
    s.pause(lane, "acme").await.unwrap();
    s.pin("acme", lane).await.unwrap();
    assert!(s.mark_moved(Q, "acme", lane).await.unwrap());
    assert_eq!(s.move_hold(Q, lane, "acme").await.unwrap(), 2503);
    s.resume(lane, "acme").await.unwrap();
    let st = s.tenant_state(lane, "acme").await.unwrap();
    assert!(st.user_paused && st.queued == 2503, "{st:?}");
    assert_eq!(s.user_paused(lane).await.unwrap(), vec!["acme".to_string()]);
    assert!(
        s.user_paused(Q).await.unwrap().is_empty(),
        "listed where it lives only"
    );
    assert!(lease(&s, lane).await.is_none(), "still paused on the lane");
    let o = s.set_user_pause("acme", false).await.unwrap();
    assert!(o.changed && o.queue == lane, "{o:?}");
    let served: Vec<u64> = drain_order(&s, lane)
        .await
        .into_iter()
        .map(|x| x.1)
        .collect();
    assert_eq!(
        served,
        (0..2503).collect::<Vec<_>>(),
        "in order across the move"
    );

    // A resume that follows the tenant to its new queue (the source answers
    // MOVED) before the move's import is not undone by the older pause the
    // import carries.
    fill(&s, Q, "beta", 2).await;
    s.set_user_pause("beta", true).await.unwrap();
    s.pause(Q, "beta").await.unwrap();
    s.pause(lane, "beta").await.unwrap();
    assert!(s.mark_moved(Q, "beta", lane).await.unwrap());
    let o = s.set_user_pause("beta", false).await.unwrap();
    assert_eq!(o.queue, lane, "followed the move");
    s.move_hold(Q, lane, "beta").await.unwrap();
    s.resume(lane, "beta").await.unwrap();
    let st = s.tenant_state(lane, "beta").await.unwrap();
    assert!(!st.user_paused, "{st:?}");
    let served: Vec<u64> = drain_order(&s, lane)
        .await
        .into_iter()
        .map(|x| x.1)
        .collect();
    assert_eq!(served, vec![0, 1]);

    // The set's version counter lost (its node restarted empty): the next
    // operation is not refused as stale for ever, it takes a newer version.
    let key = lanekeeper::store::keys::pause_version(s.set());
    raw(url, redis::cmd("DEL").arg(&key).clone()).await;
    let o = s.set_user_pause("beta", true).await.unwrap();
    assert!(o.paused && o.changed && o.queue == lane, "{o:?}");
}

/// Run one command on the test Redis (a server or a cluster), behind the store's back.
pub async fn raw(url: &str, cmd: redis::Cmd) -> redis::Value {
    match lanekeeper::store::cluster_nodes(url) {
        Some(nodes) => {
            let client = redis::cluster::ClusterClient::new(nodes.unwrap()).unwrap();
            let mut c = client.get_async_connection().await.unwrap();
            cmd.query_async(&mut c).await.unwrap()
        }
        None => {
            let client = redis::Client::open(url).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            cmd.query_async(&mut c).await.unwrap()
        }
    }
}

/// [`raw`], answering Redis's error (as text) instead of panicking on it.
pub async fn raw_result(url: &str, cmd: redis::Cmd) -> Result<redis::Value, String> {
    let r = match lanekeeper::store::cluster_nodes(url) {
        Some(nodes) => {
            let client = redis::cluster::ClusterClient::new(nodes.unwrap()).unwrap();
            let mut c = client.get_async_connection().await.unwrap();
            cmd.query_async(&mut c).await
        }
        None => {
            let client = redis::Client::open(url).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            cmd.query_async(&mut c).await
        }
    };
    r.map_err(|e| e.to_string())
}

/// The idle-tenant sweep (issue 21, item 5) on queues in two slots: the
/// tenant that was delivered and went idle is swept, the one with work
/// queued is kept, and each queue keeps its own cursor.
pub async fn the_sweep_forgets_only_idle_tenants(url: &str) {
    let policy = QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(1)),
        idempotency_window: Duration::from_secs(1),
        ..QueuePolicy::default()
    };
    let s = store(url, policy.clone()).await;
    let q2 = QueueId::Shard(1);
    s.configure_queue(q2, &policy).await.unwrap();
    for q in [Q, q2] {
        s.enqueue(q, &env("idle", 0)).await.unwrap();
        let l = lease(&s, q).await.unwrap();
        s.ack(&l, Duration::ZERO).await.unwrap();
        s.enqueue(q, &env("waiting", 0)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(2200)).await;
    for q in [Q, q2] {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut swept = 0;
        loop {
            let step = s.sweep(q, 100).await.unwrap();
            swept += step.swept;
            if step.pass_ended {
                break;
            }
            assert!(Instant::now() < deadline, "no pass ended on {q}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(swept, 1, "{q}");
        let stats = s.tenant_stats(q, Duration::from_secs(1)).await.unwrap();
        let listed: Vec<&str> = stats.iter().map(|t| t.tenant.as_str()).collect();
        assert_eq!(listed, vec!["waiting"], "{q}");
    }
}
