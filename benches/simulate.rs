//! `cargo bench --bench simulate`: the capacity simulator's speed, in
//! simulated envelopes per wall-second, against a real redis-server.
//!
//! The scenario is the seeds' story at scale: one tenant imports 185,000
//! records (pushed at 1,000/s from 20 s) while 1,000 small tenants send
//! 100/s between them (power law) for 150 s: 200,000 envelopes on 8 shards
//! x 4 workers, cap 8, quantum 2 s, lanes of 16 workers after 30 s hot.
//! Every envelope goes through all four strategies (the fair ones through
//! the production scripts), as `lanekeeper simulate` runs them. Then the
//! same scenario ten times over (2,000,000 envelopes: 10,000 small tenants,
//! an import of 1,850,000 at 10,000/s, on the same 8 x 4 workers: overloaded,
//! a test of the simulator's speed on a long run, not a sizing) is timed.
//!
//! `SIM_BENCH_2M=0` skips the 2,000,000-envelope run (it takes minutes).
//! The simulator runs on a current-thread runtime (`SIM_BENCH_RUNTIME=multi`:
//! multi-threaded, as in the `lanekeeper simulate` binary).
//! The last line is `RESULT sim_200k_s=<x> envelopes_per_s=<y>
//! sim_vs_raw=<z>`, where `envelopes_per_s` is the scenario's envelopes
//! over its wall time (each one simulated four times, once per strategy)
//! and `sim_vs_raw` that rate over the raw Redis round-trip rate measured in
//! the same run (one connection, one `PING` after another, on the same
//! runtime as the simulator): a ratio that the machine's speed moves much
//! less than the absolute rate.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use lanekeeper::simulate::{self, Latency, Mix, Promotion, Whale, Workload};

/// The scenario, `scale` times over (1: 200,000 envelopes).
fn scenario(scale: u32) -> Mix {
    Mix {
        seed: 1,
        duration: Duration::from_secs(150).into(),
        tenants: 1_000 * scale,
        rate: 100.0 * scale as f64,
        zipf: 1.0,
        latency: Latency::default(),
        whales: vec![Whale {
            tenant: "acme-import".into(),
            count: 185_000 * scale as u64,
            start: Duration::from_secs(20).into(),
            rate: 1_000.0 * scale as f64,
            latency: None,
        }],
        shards: 8,
        workers: 4,
        cap: 8,
        quantum_seconds: 2.0,
        promotion: Promotion {
            promote_after: Duration::from_secs(30).into(),
            window: Duration::from_secs(60).into(),
            tick: Duration::from_secs(10).into(),
            lane_workers: Some(16),
            ..Promotion::default()
        },
    }
}

/// Run the scenario once; returns (envelopes, wall seconds).
async fn run(url: &str, label: &str, scale: u32) -> (usize, f64) {
    let mix = scenario(scale);
    let generated = Instant::now();
    let workload = Workload::generate(&mix);
    let generate_s = generated.elapsed().as_secs_f64();
    let n = workload.arrivals.len();
    println!("{label}: {n} envelopes, 4 strategies (workload generated in {generate_s:.2} s)");
    let cpu0 = common::redis_cpu(url).await;
    let started = Instant::now();
    let report = simulate::run(url, &mix, &workload).await.unwrap();
    let wall = started.elapsed().as_secs_f64();
    let redis_cpu = common::redis_cpu(url).await - cpu0;
    print!("{}", simulate::table(&report));
    for r in &report.results {
        println!(
            "  {:<12} {:>8.1} s wall  {:>9.0} envelopes/s",
            r.strategy.name(),
            r.wall.as_secs_f64(),
            n as f64 / r.wall.as_secs_f64()
        );
    }
    println!(
        "{label}: {wall:.1} s for all four strategies side by side: {:.0} envelopes/s ({:.0} strategy-envelopes/s); Redis CPU {redis_cpu:.1} s ({:.1} us per strategy-envelope)",
        n as f64 / wall,
        4.0 * n as f64 / wall,
        redis_cpu * 1e6 / (4.0 * n as f64)
    );
    (n, wall)
}

/// The raw round-trip rate: one connection, one `PING` after another, for
/// about two seconds, as the simulator's calls go (each waits for its answer).
async fn round_trips_per_s(url: &str) -> f64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(2) {
        for _ in 0..1000 {
            let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        }
        n += 1000;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    // One thread for the simulator, the other core for Redis: on this
    // two-core machine a current-thread runtime measured about 15% faster
    // than a multi-threaded one (no wake-ups across threads per round trip).
    // `SIM_BENCH_RUNTIME=multi` runs it as the `lanekeeper simulate` binary does.
    let multi = std::env::var("SIM_BENCH_RUNTIME").as_deref() == Ok("multi");
    let rt = if !multi {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let url = support::redis::shared().url.clone();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "machine: {} cores, load average {}, {} runtime",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        if multi {
            "multi-thread"
        } else {
            "current-thread"
        }
    );
    let raw_before = rt.block_on(round_trips_per_s(&url));
    let (n, wall) = rt.block_on(run(&url, "200k", 1));
    let raw_after = rt.block_on(round_trips_per_s(&url));
    // the round-trip rate on either side of the run, so a drift in the
    // machine's speed during it shows
    let raw = (raw_before + raw_after) / 2.0;
    println!("raw round trips: {raw_before:.0}/s before the 200k run, {raw_after:.0}/s after");
    if std::env::var("SIM_BENCH_2M").as_deref() != Ok("0") {
        let (n2, wall2) = rt.block_on(run(&url, "2M", 10));
        println!(
            "2M: {n2} envelopes in {wall2:.1} s ({:.1} min), all four strategies",
            wall2 / 60.0
        );
    } else {
        println!("2M: skipped (SIM_BENCH_2M=0)");
    }
    support::process::stop_all();
    println!(
        "RESULT sim_200k_s={wall:.1} envelopes_per_s={:.0} sim_vs_raw={:.4}",
        n as f64 / wall,
        n as f64 / wall / raw
    );
}
