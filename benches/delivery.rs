//! `cargo bench --bench delivery`: webhooks delivered per second end to end
//! (real worker processes, signed HTTP POSTs to a local receiver that
//! answers at once and checks every signature), against the store-level
//! lease+ack rate measured in the same run, then the whale-and-small
//! scenario. The last line is
//! `RESULT deliveries_per_s=<x> deliveries_vs_lease_ack=<y> small_p99_whale_vs_alone=<z>`.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use lanekeeper::policy::QueuePolicy;
use support::scenario::{setup, small_tenant_scenario, stop};

const TENANTS: u64 = 20;
const PER_TENANT: u64 = 2_500;
const WORKERS: usize = 2;

/// Deliveries per second, and the CPU seconds each part used meanwhile.
async fn end_to_end() -> (f64, String) {
    let s = setup(QueuePolicy {
        max_in_flight: 64,
        ..Default::default()
    })
    .await;
    for t in 0..TENANTS {
        let tenant = format!("t{t}");
        s.endpoint(&tenant, "ok", 1).await;
        s.send(&tenant, 0..PER_TENANT).await;
    }
    let total = (TENANTS * PER_TENANT) as usize;
    let redis_pid = support::redis::shared().pid;
    let me = std::process::id();
    let (redis0, me0) = (
        support::process::cpu_seconds(redis_pid),
        support::process::cpu_seconds(me),
    );
    let started = Instant::now();
    let pids: Vec<u32> = (0..WORKERS)
        .map(|_| s.worker(&["--concurrency", "64"]))
        .collect();
    s.wait_for_accepted(total, Duration::from_secs(600)).await;
    let wall = started.elapsed().as_secs_f64();
    let rate = total as f64 / wall;
    let workers: f64 = pids.iter().map(|p| support::process::cpu_seconds(*p)).sum();
    let cpu = format!(
        "CPU seconds over {wall:.1} s wall (2 cores): redis-server {:.1}, worker processes {workers:.1}, receiver {:.1}",
        support::process::cpu_seconds(redis_pid) - redis0,
        support::process::cpu_seconds(me) - me0,
    );
    assert_eq!(s.receiver.bad_signatures(), 0);
    for pid in pids {
        stop(pid);
    }
    (rate, cpu)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = support::redis::shared().url.clone();
    rt.block_on(async {
        let store_rate = common::fair(&url, 10).await;
        let lease_ack = store_rate.per_s;
        println!(
            "store lease+ack (ack_and_lease), {} clients, 10 tenants: {lease_ack:.0} cycles/s (Redis CPU {:.1} us/cycle)",
            common::CLIENTS,
            store_rate.redis_us
        );
        let (delivered, cpu) = end_to_end().await;
        println!(
            "end to end: {WORKERS} worker processes x 64 in flight, {} envelopes, receiver answers at once: {delivered:.0} deliveries/s ({:.2}x lease+ack)",
            TENANTS * PER_TENANT,
            delivered / lease_ack
        );
        println!("where the time goes: {cpu}");
        let (alone50, alone99, _) = small_tenant_scenario(0, false).await;
        let (fair50, fair99, drain) = small_tenant_scenario(100_000, false).await;
        println!(
            "small tenant wait, ms (p50 / p99): alone {alone50} / {alone99}; behind a 100000-envelope whale {fair50} / {fair99} (whale drained in {:.1} s)",
            drain.as_secs_f64()
        );
        println!(
            "RESULT deliveries_per_s={delivered:.0} deliveries_vs_lease_ack={:.3} small_p99_whale_vs_alone={:.3}",
            delivered / lease_ack,
            fair99 as f64 / alone99.max(1) as f64
        );
    });
    support::process::stop_all();
}
