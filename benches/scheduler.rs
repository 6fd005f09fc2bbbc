//! `cargo bench --bench scheduler`: lease+ack throughput of the fair scheduler
//! against a real redis-server, with the raw-command floor measured in the
//! same run (RPOP then HINCRBY per message: two plain round trips). The fair
//! clients run a worker's loop: one lease, then `ack_and_lease` per delivery
//! (the ack of one envelope and the lease of the next in one script call).
//! The last line is `RESULT fair_vs_raw=<x> flat_40k_vs_10=<y> enqueue_per_s=<z>`.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::{connect, enqueue_all, env, fair, CLIENTS, CYCLES};
use lanekeeper::envelope::Envelope;

/// The floor: RPOP from one FIFO list, then HINCRBY, per message.
async fn raw(url: &str) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = "bench:raw:fifo";
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    for chunk in 0..(2 * CYCLES / 1000) {
        let mut pipe = redis::pipe();
        for i in 0..1000 {
            pipe.rpush(
                key,
                format!(
                    "{{\"n\":{},\"body\":\"{}\"}}",
                    chunk * 1000 + i,
                    "x".repeat(200)
                ),
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut conn).await.unwrap();
    }
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            while done.fetch_add(1, Ordering::Relaxed) < CYCLES {
                let msg: Option<String> = redis::cmd("RPOP")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(msg.is_some());
                let _: i64 = redis::cmd("HINCRBY")
                    .arg("bench:raw:acks")
                    .arg("t")
                    .arg(1)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    CYCLES as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = support::redis::shared().url.clone();
    rt.block_on(async {
        let raw_rate = raw(&url).await;
        println!("raw RPOP+HINCRBY, {CLIENTS} clients: {raw_rate:>9.0} cycles/s");
        let mut fair_rates = Vec::new();
        for tenants in [10u64, 1_000, 40_000] {
            let r = fair(&url, tenants).await;
            println!("fair lease+ack, {CLIENTS} clients, {tenants:>6} active tenants: {r:>9.0} cycles/s ({:.2}x raw)", r / raw_rate);
            fair_rates.push(r);
        }
        let store = connect(&url, "enqueue").await;
        let envs: Vec<Envelope> = (0..200_000u64).map(|i| env(&format!("imp{}", i % 100), i)).collect();
        let enqueue_rate = enqueue_all(&store, envs).await;
        println!("batch enqueue (pipelined, 1000 per batch, 4 producers): {enqueue_rate:.0} envelopes/s");
        let fair_vs_raw = fair_rates[0] / raw_rate;
        // Flatness: 40k-tenant throughput relative to 10 (1.0 = no slowdown).
        let flat = fair_rates[0] / fair_rates[2];
        println!("RESULT fair_vs_raw={fair_vs_raw:.3} flat_40k_vs_10={flat:.3} enqueue_per_s={enqueue_rate:.0}");
    });
    support::process::stop_all();
}
