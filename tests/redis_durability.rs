//! `spec.redis.durability`: `Fast` acknowledges once the primary holds an
//! envelope, `Replicated` once a replica does too (`WAIT 1 <timeout>`).
//! Against a real primary+replica pair; the primary is SIGKILLed under
//! continuous ingest and the acknowledged envelopes are counted at the
//! receiver, delivered from the promoted replica.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanekeeper::endpoint::Endpoint;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::producer::Producer;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{SetId, Store, StoreError};
use support::redis::{self, TestRedis};

/// A primary and a replica of it, the replica's link up.
pub fn pair() -> (TestRedis, TestRedis) {
    let primary = redis::dedicated_with(&[]);
    let port = primary.port.to_string();
    let replica = redis::dedicated_with(&["--replicaof", "127.0.0.1", &port]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !redis::cli(&replica, &["INFO", "replication"]).contains("master_link_status:up") {
        assert!(Instant::now() < deadline, "the replica did not connect");
        std::thread::sleep(Duration::from_millis(50));
    }
    (primary, replica)
}

async fn store(r: &TestRedis, name: &str) -> Store {
    let s = Store::connect(&r.url, SetId::new("durable", name), Default::default())
        .await
        .unwrap();
    s.set_shards(1).await.unwrap();
    s.configure_queue(QueueId::Shard(0), &QueuePolicy::default())
        .await
        .unwrap();
    s
}

#[tokio::test]
async fn replicated_waits_for_a_replica_and_says_so_when_none_answers() {
    let (primary, replica) = pair();
    let s = store(&primary, "wait").await;
    let producer = Producer::new(s.clone(), Duration::from_millis(1));
    let env = |n: u64| support::scenario::envelope("acme", n);

    // Fast: acknowledged by the primary alone, even with the replica stopped.
    support::process::signal(replica.pid, libc::SIGSTOP);
    let started = Instant::now();
    producer.send(&env(1)).await.expect("Fast does not wait");
    assert!(started.elapsed() < Duration::from_millis(300));

    // Replicated with no replica answering: a clear error after the timeout.
    s.set_durability(Some(Duration::from_millis(400)))
        .await
        .unwrap();
    assert_eq!(
        s.routing().await.unwrap().replicated,
        Some(Duration::from_millis(400))
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    let started = Instant::now();
    let err = producer.send(&env(2)).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err, StoreError::NotReplicated { acked: 0, .. }),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(390) && took < Duration::from_secs(2),
        "{took:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("0 replicas acknowledged it within 400ms")
            && text.contains("retry with the same id"),
        "{text}"
    );

    // The replica back: the retry of the same id is acknowledged, stored once.
    support::process::signal(replica.pid, libc::SIGCONT);
    let (q, outcome) = producer.send(&env(2)).await.expect("replicated now");
    assert_eq!(outcome, lanekeeper::store::EnqueueOutcome::Duplicate);
    assert_eq!(s.tenant_state(q, "acme").await.unwrap().queued, 2);
    // And a new one is acknowledged without waiting out the timeout.
    let started = Instant::now();
    producer.send(&env(3)).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(390));
    // The replica has every acknowledged envelope (read without scripts:
    // a replica refuses them).
    let lane = lanekeeper::store::keys::lane(&s.queue_prefix(q), "acme");
    assert_eq!(redis::cli(&replica, &["LLEN", &lane]).trim(), "3");
}

#[tokio::test]
async fn ingest_answers_503_naming_the_replica_wait() {
    let (primary, replica) = pair();
    let s = store(&primary, "http").await;
    s.set_durability(Some(Duration::from_millis(300)))
        .await
        .unwrap();
    let ep = Endpoint {
        url: "https://example.com/hook".into(),
        secrets: vec![lanekeeper::signing::Secret::generate()],
        enabled: true,
        event_types: vec![],
    };
    s.put_endpoint("acme", "default", &ep).await.unwrap();
    let ingest = support::workers::Ingest::spawn(&primary.url, "durable/http", &[]);
    let http = reqwest::Client::new();
    let post = |id: &str| {
        http.post(format!("{}/v1/events", ingest.base()))
            .bearer_auth(&ingest.key)
            .header("content-type", "application/json")
            .body(serde_json::json!({"tenant": "acme", "id": id, "payload": {}}).to_string())
            .send()
    };
    assert_eq!(post("e1").await.unwrap().status(), 202);
    support::process::signal(replica.pid, libc::SIGSTOP);
    let res = post("e2").await.unwrap();
    assert_eq!(res.status(), 503);
    let body = res.text().await.unwrap();
    assert!(
        body.contains("replicas acknowledged it within 300ms"),
        "{body}"
    );
    support::process::signal(replica.pid, libc::SIGCONT);
    let res = post("e2").await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    support::scenario::stop(ingest.pid);
}

/// What one run of the primary-kill test saw.
#[derive(Debug)]
pub struct KillRun {
    pub acknowledged: usize,
    pub refused: usize,
    pub lost: usize,
    pub delivered: usize,
}

/// Continuous ingest through the real binary into `primary`; the replica
/// stalls for `stall` (SIGSTOP: a slow replica or a congested link, so
/// replication lags), then the primary is SIGKILLed, the replica resumed and
/// promoted, and a worker delivers everything it holds to a receiver.
/// Acknowledged (202) envelopes missing at the receiver are lost.
pub async fn kill_primary_under_ingest(replicated: bool, stall: Duration) -> KillRun {
    let (primary, replica) = pair();
    let name = if replicated {
        "kill-replicated"
    } else {
        "kill-fast"
    };
    let s = store(&primary, name).await;
    let receiver = support::receiver::Receiver::start();
    let tenants: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
    for t in &tenants {
        let secret = lanekeeper::signing::Secret::generate();
        receiver.expect_secrets(t, std::slice::from_ref(&secret));
        let ep = Endpoint {
            url: receiver.url(t, "ok"),
            secrets: vec![secret],
            enabled: true,
            event_types: vec![],
        };
        s.put_endpoint(t, "default", &ep).await.unwrap();
    }
    if replicated {
        s.set_durability(Some(Duration::from_millis(500)))
            .await
            .unwrap();
    }
    let set = format!("durable/{name}");
    let ingest = support::workers::Ingest::spawn(&primary.url, &set, &["--backlog-limit", "0"]);
    let acked = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let body = "x".repeat(4096);
    let mut posters = Vec::new();
    for c in 0..16 {
        let (http, base, key, acked, refused, stop, body, tenant) = (
            http.clone(),
            ingest.base(),
            ingest.key.clone(),
            acked.clone(),
            refused.clone(),
            stop.clone(),
            body.clone(),
            tenants[c % tenants.len()].clone(),
        );
        posters.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let id = format!("c{c}-{n}");
                let ev = serde_json::json!({"tenant": tenant, "id": id, "payload": {"seq": n, "sent_ms": 0, "body": body}});
                match http
                    .post(format!("{base}/v1/events"))
                    .bearer_auth(&key)
                    .header("content-type", "application/json")
                    .body(ev.to_string())
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 202 => {
                        acked.lock().unwrap().insert(id);
                    }
                    _ => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    if !stall.is_zero() {
        support::process::signal(replica.pid, libc::SIGSTOP);
        tokio::time::sleep(stall).await;
    }
    redis::kill(&primary);
    // What was acknowledged before the primary died is what counts.
    let acknowledged: BTreeSet<String> = acked.lock().unwrap().clone();
    let refused_before_kill = refused.load(Ordering::Relaxed);
    stop.store(true, Ordering::SeqCst);
    for p in posters {
        let _ = p.await;
    }
    support::process::signal(ingest.pid, libc::SIGKILL);
    if !stall.is_zero() {
        support::process::signal(replica.pid, libc::SIGCONT);
    }
    // The replica reads what reached its socket, sees the link drop, and is
    // promoted (what Sentinel or a managed failover does).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !redis::cli(&replica, &["INFO", "replication"]).contains("master_link_status:down") {
        assert!(
            Instant::now() < deadline,
            "the replica never saw its primary go"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        redis::cli(&replica, &["REPLICAOF", "NO", "ONE"]).trim(),
        "OK"
    );

    // Deliver everything the promoted replica holds.
    let promoted = Store::connect(
        &replica.url,
        SetId::new("durable", name),
        Default::default(),
    )
    .await
    .unwrap();
    let mut args = support::workers::LOCAL_ARGS.to_vec();
    args.extend(["--concurrency", "32"]);
    let worker = support::workers::spawn(&replica.url, &set, "shard-00", &args);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut left = 0;
        for t in &tenants {
            let st = promoted.tenant_state(QueueId::Shard(0), t).await.unwrap();
            left += st.queued + st.in_flight + st.delayed;
        }
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} envelopes still queued on the promoted replica"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    support::scenario::stop(worker);
    let arrived: BTreeSet<String> = receiver
        .arrivals()
        .into_iter()
        .filter(|a| a.accepted)
        .map(|a| a.id)
        .collect();
    let lost = acknowledged.difference(&arrived).count();
    KillRun {
        acknowledged: acknowledged.len(),
        refused: refused_before_kill,
        lost,
        delivered: arrived.len(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_primary_loses_no_acknowledged_envelope_when_replicated() {
    // For the record: a healthy replica on loopback, no stall.
    let calm = kill_primary_under_ingest(false, Duration::ZERO).await;
    eprintln!(
        "primary SIGKILLed with a healthy replica (no stall), Fast: {} acknowledged, {} lost, {} delivered",
        calm.acknowledged, calm.lost, calm.delivered
    );
    let stall = Duration::from_secs(3);
    let fast = kill_primary_under_ingest(false, stall).await;
    let replicated = kill_primary_under_ingest(true, stall).await;
    eprintln!(
        "primary SIGKILLed {stall:?} into a replica stall under continuous ingest (16 clients, 4 KiB events):\n  Fast:       {} acknowledged, {} lost (acknowledged, never delivered from the promoted replica), {} refused, {} delivered\n  Replicated: {} acknowledged, {} lost, {} refused (503: no replica within 500ms), {} delivered",
        fast.acknowledged, fast.lost, fast.refused, fast.delivered,
        replicated.acknowledged, replicated.lost, replicated.refused, replicated.delivered
    );
    assert!(replicated.acknowledged > 100, "{replicated:?}");
    assert_eq!(
        replicated.lost, 0,
        "Replicated lost acknowledged envelopes: {replicated:?}"
    );
    // The scenario really loses data without the wait: otherwise the zero
    // above would prove nothing.
    assert!(
        fast.lost > 0,
        "Fast lost nothing: the replica did not lag ({fast:?})"
    );
}
