//! `cargo bench --bench durability`: what `spec.redis.durability:
//! Replicated` costs. The real `lanekeeper ingest` binary on loopback
//! against a real primary+replica pair (redis-server `--replicaof`), single
//! events from 32 concurrent HTTP clients in this process, in rounds that
//! alternate `Fast` and `Replicated` (the producer reads the mode from the
//! routing table, as the controller writes it), so both see the same
//! machine. Prints events/s, p50 and p99 per round and the medians, and the
//! last line `RESULT replicated_vs_fast_throughput=<x> fast_p99_ms=<y> replicated_p99_ms=<z>`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanekeeper::endpoint::Endpoint;
use lanekeeper::store::{SetId, Store};

const CLIENTS: usize = 32;
const ROUND: Duration = Duration::from_secs(6);
const ROUNDS: usize = 3;

/// One round: (events/s, p50 ms, p99 ms, refused).
async fn round(http: &reqwest::Client, base: &str, key: &str, tag: &str) -> (f64, f64, f64, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let lat = Arc::new(Mutex::new(Vec::<f64>::new()));
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let body = "x".repeat(200);
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (http, base, key, stop, lat, refused, body, tag) = (
            http.clone(),
            base.to_string(),
            key.to_string(),
            stop.clone(),
            lat.clone(),
            refused.clone(),
            body.clone(),
            tag.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut mine = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let ev = serde_json::json!({"tenant": format!("t{}", c % 16), "id": format!("{tag}-{c}-{n}"), "payload": {"n": n, "body": body}});
                let t0 = Instant::now();
                let res = http
                    .post(format!("{base}/v1/events"))
                    .bearer_auth(&key)
                    .header("content-type", "application/json")
                    .body(ev.to_string())
                    .send()
                    .await
                    .unwrap();
                if res.status() == 202 {
                    mine.push(t0.elapsed().as_secs_f64() * 1000.0);
                } else {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                let _ = res.bytes().await;
            }
            lat.lock().unwrap().extend(mine);
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(ROUND).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    let mut l = lat.lock().unwrap().clone();
    l.sort_by(f64::total_cmp);
    let pct = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)];
    (
        l.len() as f64 / secs,
        pct(0.50),
        pct(0.99),
        refused.load(Ordering::Relaxed),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let primary = support::redis::dedicated_with(&[]);
    let port = primary.port.to_string();
    let replica = support::redis::dedicated_with(&["--replicaof", "127.0.0.1", &port]);
    while !support::redis::cli(&replica, &["INFO", "replication"]).contains("master_link_status:up")
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    rt.block_on(async {
        let store = Store::connect(&primary.url, SetId::new("bench", "durability"), Default::default())
            .await
            .unwrap();
        store.set_shards(4).await.unwrap();
        let ep = Endpoint {
            url: "https://example.com/hooks".into(),
            secrets: vec![lanekeeper::signing::Secret::generate()],
            enabled: true,
            event_types: vec![],
        };
        for t in 0..16 {
            store.put_endpoint(&format!("t{t}"), "default", &ep).await.unwrap();
        }
        let ingest = support::workers::Ingest::spawn(
            &primary.url,
            "bench/durability",
            &["--backlog-limit", "0"],
        );
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(CLIENTS)
            .build()
            .unwrap();
        let (mut fast, mut repl) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            for replicated in [false, true] {
                store
                    .set_durability(replicated.then(|| Duration::from_secs(1)))
                    .await
                    .unwrap();
                // Ingest reads the routing table at most a second old.
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let tag = format!("r{r}-{replicated}");
                let (rate, p50, p99, refused) = round(&http, &ingest.base(), &ingest.key, &tag).await;
                let name = if replicated { "Replicated" } else { "Fast" };
                println!(
                    "round {r} {name:<10}: {rate:>6.0} events/s, p50 {p50:.2} ms, p99 {p99:.2} ms, {refused} refused"
                );
                if replicated {
                    repl.push((rate, p50, p99));
                } else {
                    fast.push((rate, p50, p99));
                }
            }
        }
        let m = |v: &Vec<(f64, f64, f64)>, f: fn(&(f64, f64, f64)) -> f64| median(v.iter().map(f).collect());
        let (fr, f50, f99) = (m(&fast, |x| x.0), m(&fast, |x| x.1), m(&fast, |x| x.2));
        let (rr, r50, r99) = (m(&repl, |x| x.0), m(&repl, |x| x.1), m(&repl, |x| x.2));
        println!(
            "median of {ROUNDS} rounds, {CLIENTS} clients, single events: Fast {fr:.0}/s p50 {f50:.2} ms p99 {f99:.2} ms; Replicated {rr:.0}/s p50 {r50:.2} ms p99 {r99:.2} ms ({:.2}x Fast's throughput, p99 {:.2}x)",
            rr / fr,
            r99 / f99
        );
        support::process::signal(ingest.pid, libc::SIGTERM);
        let _ = support::process::wait_exit(ingest.pid, Duration::from_secs(10));
        println!(
            "RESULT replicated_vs_fast_throughput={:.3} fast_per_s={fr:.0} replicated_per_s={rr:.0} fast_p99_ms={f99:.2} replicated_p99_ms={r99:.2}",
            rr / fr
        );
    });
    support::process::stop_all();
}
