//! Endpoint isolation (`spec.isolation: Endpoint`) against a real Redis:
//! bodies run by `tests/dataplane.rs` on one server and by `tests/cluster.rs`
//! on a Redis Cluster. Each (tenant, endpoint) has its own lane and cap, a
//! tenant's endpoints share its turns by worker-seconds, and tenants still
//! share the queue by tenant.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::{Isolation, QueuePolicy};
use lanekeeper::routing::QueueId;
use lanekeeper::store::{EnqueueOutcome, Failure, Lease, LeaseOutcome, NackOutcome, Store};

use super::dataplane::{lease, store, LEASE, Q};

/// The queue's default policy under endpoint isolation.
pub fn isolated() -> QueuePolicy {
    QueuePolicy {
        isolation: Isolation::Endpoint,
        ..Default::default()
    }
}

/// Envelope `seq` of `tenant` to endpoint `ep` (id `<tenant>-<ep>-<seq>`).
pub fn to(tenant: &str, ep: &str, seq: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{ep}-{seq}"),
        tenant: tenant.to_string(),
        endpoint: Some(ep.into()),
        event_type: None,
        payload: serde_json::json!({ "seq": seq, "ep": ep }),
    }
}

/// Enqueue `envs`, each of which must be taken (queued, or held while its
/// tenant is paused for a move).
pub async fn send(s: &Store, q: QueueId, envs: &[Envelope]) {
    for chunk in envs.chunks(500) {
        for r in s.enqueue_batch(q, chunk).await.unwrap() {
            assert!(matches!(
                r.unwrap(),
                EnqueueOutcome::Queued { .. } | EnqueueOutcome::Held { .. }
            ));
        }
    }
}

/// The endpoint and sequence number a lease carries.
pub fn ep_seq(l: &Lease) -> (String, u64) {
    let e = l.envelope().unwrap();
    (
        e.endpoint.clone().unwrap_or_default(),
        e.payload["seq"].as_u64().unwrap(),
    )
}

/// Lease until the queue answers EMPTY or `n` leases are held, acking none.
async fn lease_up_to(s: &Store, n: usize) -> Vec<Lease> {
    let mut out = Vec::new();
    while out.len() < n {
        match lease(s, Q).await {
            Some(l) => out.push(l),
            None => break,
        }
    }
    out
}

fn per_endpoint(leases: &[Lease]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for l in leases {
        *m.entry(ep_seq(l).0).or_insert(0) += 1;
    }
    m
}

/// A tenant's slow endpoint with a backlog ahead of its fast one: under
/// tenant isolation the slow one takes every slot (its FIFO is first);
/// under endpoint isolation it holds at most its endpoint cap (half the
/// tenant's), the fast one's envelopes are leased at once, and the tenant
/// as a whole stays within its cap.
pub async fn a_slow_endpoint_does_not_hold_back_its_tenants_fast_one(url: &str) {
    let backlog: Vec<Envelope> = (0..100)
        .map(|i| to("acme", "slow", i))
        .chain((0..10).map(|i| to("acme", "fast", i)))
        .collect();

    let tenant_mode = store(url, QueuePolicy::default()).await;
    send(&tenant_mode, Q, &backlog).await;
    let held = lease_up_to(&tenant_mode, 20).await;
    assert_eq!(
        per_endpoint(&held),
        BTreeMap::from([("slow".to_string(), 8)]),
        "tenant isolation: the slow endpoint's backlog takes the tenant's 8 slots"
    );

    let s = store(url, isolated()).await;
    send(&s, Q, &backlog).await;
    let held = lease_up_to(&s, 20).await;
    assert_eq!(
        per_endpoint(&held),
        BTreeMap::from([("fast".to_string(), 4), ("slow".to_string(), 4)]),
        "endpoint isolation: each endpoint holds at most half the tenant's cap of 8"
    );
    // Each endpoint's envelopes come in their order.
    for ep in ["slow", "fast"] {
        let seqs: Vec<u64> = held
            .iter()
            .map(ep_seq)
            .filter(|(e, _)| e == ep)
            .map(|(_, n)| n)
            .collect();
        assert_eq!(seqs, (0..4).collect::<Vec<_>>(), "{ep} out of order");
    }
    // The fast endpoint drains while the slow one's four stay in flight.
    let fast: Vec<Lease> = held.into_iter().filter(|l| ep_seq(l).0 == "fast").collect();
    for l in fast {
        assert!(s.ack(&l, Duration::from_millis(2)).await.unwrap());
    }
    let next = lease_up_to(&s, 20).await;
    assert_eq!(
        next.iter().map(ep_seq).collect::<Vec<_>>(),
        (4..8).map(|i| ("fast".to_string(), i)).collect::<Vec<_>>(),
        "the fast endpoint's next four, none of the slow one's (at its cap)"
    );
    let st = s.tenant_state(Q, "acme").await.unwrap();
    assert_eq!((st.in_flight, st.queued), (8, 96 + 2));
    // the stats read the oldest queued envelope from the endpoints' lanes
    let a = s
        .tenant_activity(Q, "acme", Duration::from_secs(60))
        .await
        .unwrap();
    let oldest = a.oldest_enqueued_ms.expect("the oldest queued envelope");
    assert!(oldest <= a.now_ms && a.now_ms - oldest < 60_000, "{a:?}");
}

/// Worker-seconds, not deliveries, are what a tenant's endpoints share: one
/// worker leasing and acking in turn gives an endpoint whose deliveries take
/// 1 ms about as many worker-seconds as one whose deliveries take 50 ms, so
/// it makes about fifty times the deliveries.
pub async fn a_tenants_endpoints_share_its_worker_seconds(url: &str) {
    let s = store(url, isolated()).await;
    let envs: Vec<Envelope> = (0..2000)
        .flat_map(|i| [to("acme", "slow", i), to("acme", "fast", i)])
        .collect();
    send(&s, Q, &envs).await;
    let cost = |ep: &str| {
        if ep == "slow" {
            Duration::from_millis(50)
        } else {
            Duration::from_millis(1)
        }
    };
    let mut used: BTreeMap<String, Duration> = BTreeMap::new();
    let mut count: BTreeMap<String, u64> = BTreeMap::new();
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for _ in 0..1000 {
        let l = lease(&s, Q).await.unwrap();
        let (ep, seq) = ep_seq(&l);
        if let Some(prev) = last.insert(ep.clone(), seq) {
            assert!(seq > prev, "{ep}: {seq} after {prev}");
        }
        *used.entry(ep.clone()).or_default() += cost(&ep);
        *count.entry(ep.clone()).or_default() += 1;
        assert!(s.ack(&l, cost(&ep)).await.unwrap());
    }
    let ratio = used["slow"].as_secs_f64() / used["fast"].as_secs_f64();
    eprintln!(
        "endpoint shares: slow {} deliveries ({:?}), fast {} deliveries ({:?}); worker-seconds slow/fast {ratio:.2}",
        count["slow"], used["slow"], count["fast"], used["fast"]
    );
    assert!(
        (0.67..=1.5).contains(&ratio),
        "worker-seconds split {ratio:.2}, not about even: {count:?}"
    );
}

/// Between tenants, fairness stays per tenant: a tenant with ten endpoints
/// gets no more of the queue than a tenant with one.
pub async fn many_endpoints_do_not_buy_a_tenant_more_of_the_queue(url: &str) {
    // a quantum of 20 ms: turns of about four 5 ms deliveries
    let s = store(
        url,
        QueuePolicy {
            quantum_seconds: 0.02,
            initial_estimate_seconds: 0.005,
            ..isolated()
        },
    )
    .await;
    let mut envs = Vec::new();
    for i in 0..300 {
        envs.push(to("wide", &format!("ep{}", i % 10), i));
        envs.push(to("narrow", "main", i));
    }
    send(&s, Q, &envs).await;
    let mut count: BTreeMap<String, u64> = BTreeMap::new();
    for _ in 0..300 {
        let l = lease(&s, Q).await.unwrap();
        *count.entry(l.tenant.clone()).or_default() += 1;
        assert!(s.ack(&l, Duration::from_millis(5)).await.unwrap());
    }
    let (wide, narrow) = (count["wide"] as f64, count["narrow"] as f64);
    eprintln!("ten endpoints {wide} deliveries, one endpoint {narrow}");
    assert!(
        (0.8..=1.25).contains(&(wide / narrow)),
        "the tenant with ten endpoints got {wide} against {narrow}"
    );
}

/// An endpoint whose breaker opens, or whose receiver asks for a pause, is
/// parked alone: its tenant's other endpoint keeps flowing, and the parked
/// one's envelopes wait in order and come back when it reopens.
pub async fn a_broken_or_paced_endpoint_is_parked_alone(url: &str) {
    let mut policy = isolated();
    policy.breaker.min_requests = 2;
    policy.breaker.failure_ratio = 0.5;
    policy.breaker.open_for = Duration::from_millis(300);
    let s = store(url, policy).await;
    let envs: Vec<Envelope> = (0..6)
        .flat_map(|i| {
            [
                to("acme", "bad", i),
                to("acme", "good", i),
                to("acme", "busy", i),
            ]
        })
        .collect();
    send(&s, Q, &envs).await;
    // Two failures open bad's breaker; busy's receiver asks for 300 ms.
    let mut leased: Vec<(String, u64)> = Vec::new();
    let mut bad_fails = 0;
    let mut paced = false;
    let start = Instant::now();
    while bad_fails < 2 || !paced {
        assert!(start.elapsed() < Duration::from_secs(5), "{leased:?}");
        let Some(l) = lease(&s, Q).await else {
            continue;
        };
        let (ep, seq) = ep_seq(&l);
        leased.push((ep.clone(), seq));
        match ep.as_str() {
            "bad" if bad_fails < 2 => {
                bad_fails += 1;
                let f = Failure {
                    endpoint_fault: true,
                    ..Failure::retry("500", Duration::from_secs(60))
                };
                assert!(matches!(
                    s.nack(&l, Duration::from_millis(1), &f).await.unwrap(),
                    NackOutcome::Retry { .. }
                ));
            }
            "busy" if !paced => {
                paced = true;
                let f = Failure {
                    pace: Some(Duration::from_millis(300)),
                    ..Failure::retry("429", Duration::from_secs(60))
                };
                s.nack(&l, Duration::from_millis(1), &f).await.unwrap();
            }
            _ => assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap()),
        }
    }
    // While bad is open and busy paced, good drains and nothing else is leased.
    let mut rest = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        rest.push(ep_seq(&l));
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert!(
        rest.iter().all(|(ep, _)| ep == "good"),
        "a parked endpoint was leased: {rest:?} (before: {leased:?})"
    );
    let good: Vec<u64> = leased
        .iter()
        .chain(rest.iter())
        .filter(|(ep, _)| ep == "good")
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(
        good,
        (0..6).collect::<Vec<_>>(),
        "good did not drain in order"
    );
    // Once the breaker's open time and the pause are over, both come back.
    tokio::time::sleep(Duration::from_millis(400)).await;
    s.maintain(Q, 32).await.unwrap();
    let mut after: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while after.values().map(Vec::len).sum::<usize>() < 10 {
        assert!(Instant::now() < deadline, "not back: {after:?}");
        match s.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) => {
                let (ep, seq) = ep_seq(&l);
                after.entry(ep).or_default().push(seq);
                assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                s.maintain(Q, 32).await.unwrap();
            }
        }
    }
    // bad: the probe (2, the next in its lane) closes the breaker, then the
    // rest (its 0 and 1 wait a minute to retry); busy: its 0 was due to retry
    // when the pause ended, and went back to the head of its lane.
    assert_eq!(after["bad"], vec![2, 3, 4, 5], "{after:?}");
    assert_eq!(after["busy"], vec![0, 1, 2, 3, 4, 5], "{after:?}");
}

/// Strict order under endpoint isolation is per (tenant, endpoint): each
/// endpoint has one delivery in flight, a retry keeps its endpoint's slot
/// (its later envelopes wait), and the tenant's other endpoint flows.
pub async fn strict_order_holds_per_endpoint(url: &str) {
    let s = store(
        url,
        QueuePolicy {
            ordered: true,
            ..isolated()
        },
    )
    .await;
    let envs: Vec<Envelope> = (0..5)
        .flat_map(|i| [to("acme", "a", i), to("acme", "b", i)])
        .collect();
    send(&s, Q, &envs).await;
    let first = lease_up_to(&s, 10).await;
    assert_eq!(
        first.iter().map(ep_seq).collect::<Vec<_>>(),
        vec![("a".to_string(), 0), ("b".to_string(), 0)],
        "one in flight per endpoint"
    );
    // a-0 fails and waits 200 ms to retry, keeping a's slot; b flows.
    let a0 = first.iter().find(|l| ep_seq(l).0 == "a").unwrap();
    s.nack(
        a0,
        Duration::from_millis(1),
        &Failure::retry("503", Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let mut b_next = first.iter().find(|l| ep_seq(l).0 == "b").cloned();
    let mut order: Vec<(String, u64)> = Vec::new();
    while let Some(l) = b_next.take() {
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
        if let Some(n) = lease(&s, Q).await {
            order.push(ep_seq(&n));
            b_next = Some(n);
        }
    }
    assert_eq!(
        order,
        (1..5).map(|i| ("b".to_string(), i)).collect::<Vec<_>>(),
        "b flows while a's retry holds a's slot"
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    s.maintain(Q, 32).await.unwrap();
    let mut a_order = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        a_order.push(ep_seq(&l).1);
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert_eq!(
        a_order,
        vec![0, 1, 2, 3, 4],
        "a's retry first, then the rest in order"
    );
}

/// Crash paths free an endpoint's slot and keep its order: an expired lease
/// is reaped to the head of its endpoint's lane, a released one too, and a
/// lease whose record is gone is dead-lettered without wedging the endpoint.
pub async fn reaps_releases_and_lost_records_free_endpoint_slots(url: &str) {
    let s = store(
        url,
        QueuePolicy {
            max_in_flight: 2,
            ..isolated()
        },
    )
    .await;
    let envs: Vec<Envelope> = (0..4).map(|i| to("acme", "only", i)).collect();
    send(&s, Q, &envs).await;
    // Endpoint cap 1 (half of 2): one in flight, leased with a short lease.
    let LeaseOutcome::Leased(l0) = s.lease(Q, "w", Duration::from_millis(50)).await.unwrap() else {
        panic!("nothing leased")
    };
    assert_eq!(ep_seq(&l0), ("only".into(), 0));
    assert!(
        lease(&s, Q).await.is_none(),
        "the endpoint is at its cap of 1"
    );
    tokio::time::sleep(Duration::from_millis(80)).await;
    let (_, reaped) = s.maintain(Q, 32).await.unwrap();
    assert_eq!(reaped, 1);
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(ep_seq(&l), ("only".into(), 0), "reaped to its lane's head");
    assert!(s.release(&l).await.unwrap());
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(
        ep_seq(&l),
        ("only".into(), 0),
        "released to its lane's head"
    );
    // Its record is deleted behind the store's back while it is leased.
    let prefix = s.queue_prefix(Q);
    super::stored::Conn::open(url)
        .await
        .lose_body(&prefix, "acme", &l.id)
        .await;
    assert!(matches!(
        s.nack(
            &l,
            Duration::from_millis(1),
            &Failure::retry("x", Duration::ZERO)
        )
        .await
        .unwrap(),
        NackOutcome::Dead { .. }
    ));
    let mut rest = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        rest.push(ep_seq(&l).1);
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert_eq!(rest, vec![1, 2, 3], "the endpoint was wedged");
    let st = s.tenant_state(Q, "acme").await.unwrap();
    assert_eq!((st.queued, st.in_flight, st.depth), (0, 0, 0));
}

/// A move (pause, drain, repin, hold, resume) under endpoint isolation keeps
/// each endpoint's order, with a user's pause and purge in between.
pub async fn a_move_keeps_each_endpoints_order(url: &str) {
    let s = store(url, isolated()).await;
    let dst = QueueId::Lane(1);
    s.configure_queue(dst, &isolated()).await.unwrap();
    let mut next = BTreeMap::<String, u64>::new();
    let mut batch = |n: usize| -> Vec<Envelope> {
        (0..n)
            .map(|i| {
                let ep = ["x", "y", "z"][i % 3];
                let seq = next.entry(ep.to_string()).or_insert(0);
                *seq += 1;
                to("mover", ep, *seq - 1)
            })
            .collect()
    };
    send(&s, Q, &batch(30)).await;
    let mut got: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    // Half of it delivered; a user pauses the tenant; more arrives.
    for _ in 0..15 {
        let l = lease(&s, Q).await.unwrap();
        let (ep, seq) = ep_seq(&l);
        got.entry(ep).or_default().push(seq);
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    s.set_shards(1).await.unwrap();
    s.set_user_pause("mover", true).await.unwrap();
    send(&s, Q, &batch(9)).await;
    assert!(
        lease(&s, Q).await.is_none(),
        "a user-paused tenant was leased"
    );
    // The move: its queued lanes go to the hold buffer, whole.
    s.pause(Q, "mover").await.unwrap();
    send(&s, Q, &batch(6)).await;
    let st = s.tenant_state(Q, "mover").await.unwrap();
    assert!(st.drained(), "{st:?}");
    assert_eq!((st.queued, st.held), (24, 6));
    s.pause(dst, "mover").await.unwrap();
    s.pin("mover", dst).await.unwrap();
    assert!(s.mark_moved(Q, "mover", dst).await.unwrap());
    assert_eq!(s.move_hold(Q, dst, "mover").await.unwrap(), 30);
    s.resume(dst, "mover").await.unwrap();
    assert!(lease(&s, dst).await.is_none(), "still paused by its user");
    s.set_user_pause("mover", false).await.unwrap();
    while let Some(l) = lease(&s, dst).await {
        let (ep, seq) = ep_seq(&l);
        got.entry(ep).or_default().push(seq);
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    for (ep, seqs) in &got {
        assert_eq!(
            seqs,
            &(0..next[ep]).collect::<Vec<_>>(),
            "{ep}: lost, duplicated or reordered across the move"
        );
    }
    // Nothing is left behind in the source.
    let st = s.tenant_state(Q, "mover").await.unwrap();
    assert_eq!((st.queued, st.held, st.in_flight), (0, 0, 0));
}

/// A user's purge takes every endpoint's lane (to dead letters), a replay
/// by endpoint brings that endpoint's letters back in order, and once the
/// tenant is idle the sweep forgets it and leaves no endpoint key behind.
pub async fn purge_replay_and_sweep_follow_the_endpoint_lanes(url: &str) {
    use lanekeeper::store::{PurgeMode, ReplayFilter, ReplayPlan};
    let policy = QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(1)),
        idempotency_window: Duration::from_secs(1),
        ..isolated()
    };
    let s = store(url, policy).await;
    s.set_shards(1).await.unwrap();
    let envs: Vec<Envelope> = (0..40)
        .map(|i| to("acme", ["a", "b", "c", "d"][i as usize % 4], i))
        .collect();
    send(&s, Q, &envs).await;
    let held = lease_up_to(&s, 2).await;
    let out = s.purge_tenant("acme", PurgeMode::DeadLetter).await.unwrap();
    assert_eq!((out.purged, out.in_flight), (38, 2));
    assert!(lease(&s, Q).await.is_none(), "a purged lane was leased");
    for l in &held {
        assert!(s.ack(l, Duration::from_millis(1)).await.unwrap());
    }
    let plan = ReplayPlan {
        filter: ReplayFilter {
            endpoint: Some("c".into()),
            ..Default::default()
        },
        max_per_second: None,
        budget: None,
        after: None,
    };
    assert_eq!(s.replay_tenant("acme", &plan).await.unwrap().replayed, 10);
    let mut got = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        got.push(ep_seq(&l));
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert_eq!(
        got,
        (0..10)
            .map(|k| ("c".to_string(), 4 * k + 2))
            .collect::<Vec<_>>(),
        "the replay of one endpoint, in order"
    );
    // Drop the other letters; then idle past the sweep time.
    let prefix = s.queue_prefix(Q);
    super::dataplane::raw(
        url,
        redis::cmd("DEL")
            .arg(lanekeeper::store::keys::dead_letters(&prefix, "acme"))
            .clone(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut swept = 0;
    loop {
        let step = s.sweep(Q, 100).await.unwrap();
        swept += step.swept;
        if step.pass_ended {
            break;
        }
        assert!(Instant::now() < deadline, "no pass ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(swept, 1, "the idle tenant was not swept");
    let left = super::dataplane::raw(
        url,
        redis::cmd("EXISTS")
            .arg(lanekeeper::store::keys::tenant(&prefix, "acme"))
            .arg(lanekeeper::store::keys::ready_endpoints(&prefix, "acme"))
            .arg(lanekeeper::store::keys::queued_endpoints(&prefix, "acme"))
            .arg(lanekeeper::store::keys::endpoint_lane(&prefix, "acme", "c"))
            .clone(),
    )
    .await;
    assert_eq!(left, redis::Value::Int(0), "keys left behind");
}
