//! `cargo bench --bench replay`: replaying 100,000 of one tenant's dead
//! letters while another tenant's 1,000,000 letters sit in the same queue
//! (issue 17). Dead letters are per tenant and replayed in bounded pages,
//! so the replay costs what the tenant's own letters cost and no single
//! Redis call grows with the queue: the figure to watch is the longest
//! single call (Redis `SLOWLOG`, target: none over 10 ms) and what the
//! replay does to a small tenant leasing beside it, as a ratio of its lease
//! p99 during the replay to its p99 measured just before it in the same run.
//!
//! The 100,000 letters are made the real way (enqueue, lease, nack as
//! dead); the other tenant's million are written straight into its stream
//! in the format the scripts write (`store::keys`), since making them
//! through the scripts takes minutes and is not what is measured.
//! The last line is
//! `RESULT replay_100k_s=<s> max_call_ms=<ms> small_p99_ms=<ms> small_p99_vs_idle=<ratio>`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{keys, ConnectOptions, Failure, LeaseOutcome, SetId, Store};

const Q: QueueId = QueueId::Shard(0);
const REPLAYED_DEFAULT: u64 = 100_000;
const OTHERS_DEFAULT: u64 = 1_000_000;

/// `BENCH_REPLAY_N` and `BENCH_OTHERS_N` shrink the run (for a quick look).
fn size(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn envelope(tenant: &str, i: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{i}"),
        tenant: tenant.to_string(),
        endpoint: Some("main".into()),
        event_type: Some("bench".into()),
        payload: serde_json::json!({ "n": i, "body": "x".repeat(200) }),
    }
}

async fn admin(url: &str, args: &[&str]) -> redis::Value {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn).await.unwrap()
}

/// Lease p99 of a small tenant that enqueues one envelope, leases and acks
/// it, over and over, until `stop`; returns each lease's round trip.
async fn small_tenant(store: Store, first: u64, stop: Arc<AtomicBool>) -> Vec<Duration> {
    let mut out = Vec::new();
    let mut i = first;
    while !stop.load(Ordering::Relaxed) {
        store.enqueue(Q, &envelope("small", i)).await.unwrap();
        i += 1;
        // Leases go to whoever DRR says; only the small tenant's own count.
        loop {
            let t = Instant::now();
            match store
                .lease(Q, "small-worker", Duration::from_secs(60))
                .await
                .unwrap()
            {
                LeaseOutcome::Leased(l) => {
                    let took = t.elapsed();
                    store.ack(&l, Duration::from_millis(1)).await.unwrap();
                    if l.tenant == "small" {
                        out.push(took);
                        break;
                    }
                }
                LeaseOutcome::Again => {}
                LeaseOutcome::Empty { .. } => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    out
}

fn p99(mut v: Vec<Duration>) -> f64 {
    assert!(!v.is_empty());
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)].as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (replayed_n, others_n) = (
        size("BENCH_REPLAY_N", REPLAYED_DEFAULT),
        size("BENCH_OTHERS_N", OTHERS_DEFAULT),
    );
    let redis = support::redis::dedicated();
    let url = redis.url.clone();
    let store = Store::connect(
        &url,
        SetId::new("bench", "replay"),
        ConnectOptions::default(),
    )
    .await
    .unwrap();
    let mut policy = QueuePolicy::default();
    policy.dead_letters.max_per_tenant = 2 * others_n;
    store.configure_queue(Q, &policy).await.unwrap();

    // The other tenant's million letters, in its own stream.
    let t = Instant::now();
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stream = keys::dead_letters(&store.queue_prefix(Q), "big");
    let body = serde_json::to_string(&envelope("big", 0)).unwrap();
    for chunk in 0..others_n / 5000 {
        let mut pipe = redis::pipe();
        for i in 0..5000 {
            let id = format!("big-{}", chunk * 5000 + i);
            pipe.cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg(&[
                    "id",
                    &id,
                    "a",
                    "10",
                    "c",
                    "HTTP 410 Gone",
                    "at",
                    "0",
                    "p",
                    &body,
                    "ep",
                    "main",
                ])
                .ignore();
        }
        pipe.query_async::<()>(&mut conn).await.unwrap();
    }
    eprintln!(
        "{others_n} letters of tenant big written in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // 100,000 letters of the replaying tenant, the real way.
    let t = Instant::now();
    let envs: Vec<Envelope> = (0..replayed_n).map(|i| envelope("outage", i)).collect();
    for chunk in envs.chunks(1000) {
        for r in store.enqueue_batch(Q, chunk).await.unwrap() {
            r.unwrap();
        }
    }
    let mut dead = 0;
    while dead < replayed_n {
        match store.lease(Q, "w", Duration::from_secs(60)).await.unwrap() {
            LeaseOutcome::Leased(l) => {
                store
                    .nack(
                        &l,
                        Duration::from_millis(1),
                        &Failure::dead("HTTP 410 Gone"),
                    )
                    .await
                    .unwrap();
                dead += 1;
            }
            LeaseOutcome::Again => {}
            LeaseOutcome::Empty { .. } => panic!("ran out after {dead}"),
        }
    }
    eprintln!(
        "{replayed_n} letters of tenant outage made in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // Baseline: the small tenant's lease latency with nothing else going on.
    let stop = Arc::new(AtomicBool::new(false));
    let idle = tokio::spawn(small_tenant(store.clone(), 0, stop.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let idle = p99(idle.await.unwrap());

    // The replay, with the small tenant leasing beside it.
    admin(&url, &["CONFIG", "SET", "slowlog-log-slower-than", "1000"]).await;
    admin(&url, &["CONFIG", "SET", "slowlog-max-len", "4096"]).await;
    admin(&url, &["SLOWLOG", "RESET"]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let small = tokio::spawn(small_tenant(store.clone(), 1 << 40, stop.clone()));
    let t = Instant::now();
    let replayed = store.replay_dead(Q, "outage", &[]).await.unwrap().unwrap();
    let took = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let during = p99(small.await.unwrap());
    assert_eq!(replayed, replayed_n, "replayed {replayed} of {replayed_n}");
    let st = store.tenant_state(Q, "outage").await.unwrap();
    assert_eq!(st.queued, replayed_n, "{st:?}");
    let big = store.dead_letters(Q, "big", None, 1).await.unwrap();
    assert_eq!(
        big.letters.len(),
        1,
        "the other tenant's letters are untouched"
    );

    // The longest single call while the replay ran (SLOWLOG keeps calls over 1 ms).
    let log = admin(&url, &["SLOWLOG", "GET", "4096"]).await;
    let mut max_us = 0i64;
    let mut slow = 0;
    if let redis::Value::Array(entries) = log {
        for e in entries {
            if let redis::Value::Array(f) = e {
                if let Some(redis::Value::Int(us)) = f.get(2) {
                    max_us = max_us.max(*us);
                    slow += 1;
                }
            }
        }
    }
    let max_ms = max_us as f64 / 1e3;
    println!(
        "replayed {replayed} letters in {took:.2}s ({:.0}/s) beside {others_n} of another tenant; calls over 1 ms: {slow}, longest {max_ms:.2} ms",
        replayed as f64 / took
    );
    println!("small tenant lease p99: {during:.2} ms during the replay, {idle:.2} ms before it");
    println!(
        "RESULT replay_100k_s={took:.2} max_call_ms={max_ms:.2} small_p99_ms={during:.2} small_p99_vs_idle={:.2}",
        during / idle
    );
    if max_ms > 10.0 {
        eprintln!("warning: a single Redis call took {max_ms:.2} ms (target: at most 10 ms)");
    }
}
