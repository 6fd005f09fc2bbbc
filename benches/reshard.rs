//! `cargo bench --bench reshard`: grow a ShardSet from 4 to 6 shards with
//! 10,000 tenants that have had work, 200 of them sending all along, on the
//! real test control plane (controller process, kwok node) with a real Redis,
//! real worker processes (a stand-in kubelet runs one per shard Deployment)
//! and a real receiver. Prints the reshard's total time (spec patched to
//! `Resharding` cleared), the fraction of tenants moved, and the per-tenant
//! pause time (pause to resume on the new queue, from the controller's log),
//! for all movers and for the active ones; then checks that every active
//! tenant's events arrived once each and in order. The last line is
//! `RESULT reshard_s=<x> moved_fraction=<y> pause_p99_s=<z>` (p99 over every
//! tenant moved).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::producer::Producer;
use support::reshard::{load, patch_shards, start, stop_and_check, watch_reshard};

const TENANTS: usize = 10_000;
const ACTIVE: usize = 200;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cp = support::controlplane::full();
    cp.install_crds();
    let env = start(
        cp,
        "bench-reshard",
        4,
        "  worker: {image: \"lanekeeper:bench\", replicas: 1, concurrency: 16}\n  scheduler: {ordering: PerTenant}\n  promotion: {enabled: false}\n  relocation: {drainTimeout: 120s, maxConcurrentMoves: 16}\n",
    )
    .await;

    // The idle tenants have had work: one envelope each, delivered.
    let idle: Vec<String> = (0..TENANTS - ACTIVE)
        .map(|i| format!("idle{i:05}"))
        .collect();
    let t_fill = Instant::now();
    for t in &idle {
        env.endpoint(t, "ok").await;
    }
    let producer = Producer::new(env.store.clone(), Duration::from_secs(1));
    let envs: Vec<Envelope> = idle
        .iter()
        .map(|t| support::scenario::envelope(t, 0))
        .collect();
    for chunk in envs.chunks(1000) {
        for r in producer
            .send_batch(chunk, |_| Default::default())
            .await
            .unwrap()
        {
            r.unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while env.receiver.arrivals().len() < idle.len() {
        assert!(
            Instant::now() < deadline,
            "idle tenants' envelopes not delivered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "{} idle tenants registered and served once in {:.1}s",
        idle.len(),
        t_fill.elapsed().as_secs_f64()
    );

    let traffic = load(&env, "active", ACTIVE, 2.0).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    patch_shards(&env, 6);
    let seen = watch_reshard(&env, 6, Duration::from_secs(600), |_| false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = stop_and_check(&env, traffic).await;

    let last = seen
        .progress
        .last()
        .cloned()
        .expect("reshard progress shown");
    let pauses = pause_times(&std::fs::read_to_string(&env.controller_log).unwrap());
    let all: Vec<f64> = pauses.values().copied().collect();
    let active: Vec<f64> = pauses
        .iter()
        .filter(|(t, _)| t.starts_with("active"))
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(
        all.len(),
        last.to_move as usize,
        "one pause time per tenant moved"
    );
    let moved_fraction = last.to_move as f64 / TENANTS as f64;
    println!(
        "reshard 4 -> 6: {} of {TENANTS} tenants moved ({:.1}%; {} of the {ACTIVE} active), {:.2}s from the spec change to Resharding cleared",
        last.to_move,
        moved_fraction * 100.0,
        active.len(),
        seen.took.as_secs_f64()
    );
    for (name, xs) in [("every mover", &all), ("active movers", &active)] {
        println!(
            "pause per tenant, {name:<13} n={:>5}  p50={:.3}s  p95={:.3}s  p99={:.3}s  max={:.3}s",
            xs.len(),
            quantile(xs, 0.50),
            quantile(xs, 0.95),
            quantile(xs, 0.99),
            quantile(xs, 1.0)
        );
    }
    println!("{sent} events of the {ACTIVE} active tenants arrived once each and in order");
    println!(
        "RESULT reshard_s={:.2} moved_fraction={:.3} pause_p99_s={:.3}",
        seen.took.as_secs_f64(),
        moved_fraction,
        quantile(&all, 0.99)
    );
}

/// Tenant -> pause seconds, from the controller's "tenant moved" log lines.
fn pause_times(log: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in log.lines().filter(|l| l.contains("reshard: tenant moved")) {
        let plain = strip_ansi(line);
        let field = |name: &str| {
            plain
                .split_whitespace()
                .find_map(|w| w.strip_prefix(name).map(str::to_string))
        };
        if let (Some(t), Some(ms)) = (field("tenant="), field("paused_ms=")) {
            if let Ok(ms) = ms.parse::<f64>() {
                out.insert(t, ms / 1000.0);
            }
        }
    }
    out
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}
