//! `cargo bench --bench cluster`: lease+ack throughput with 64 queues on a
//! Redis Cluster of three primaries (and three replicas) against the same
//! load on one redis-server, measured in the same run, three rounds each,
//! interleaved, compared by their medians.
//!
//! Each of 64 clients runs a worker's loop on a queue of its own (one
//! lease, then `ack_and_lease` per delivery) over a backlog of ten tenants
//! per queue. The cluster run prints which primary holds how many of the
//! queues and of the set's keys. The last line is
//! `RESULT cluster_vs_single=<x>` (cluster cycles/s over single-server
//! cycles/s; on a two-core machine the six cluster servers share the cores
//! the single server has to itself).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{env, Rate};
use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{ConnectOptions, LeaseOutcome, SetId, Store};
use support::redis::TestCluster;

const QUEUES: u16 = 64;
const TENANTS_PER_QUEUE: u64 = 10;
/// Lease+ack cycles per queue (one client per queue).
const PER_QUEUE: u64 = 500;

/// CPU seconds used so far by the servers on `ports` (user + system).
async fn cpu(ports: &[u16]) -> f64 {
    let mut total = 0.0;
    for port in ports {
        let url = format!("redis://127.0.0.1:{port}/");
        total += common::redis_cpu(&url).await;
    }
    total
}

/// Fill 64 queues of a fresh set, then run 64 clients, one per queue.
/// Returns the rate and the set's store (for the key census).
async fn run(url: &str, ports: &[u16]) -> (Rate, Store) {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let set = SetId::new(
        "bench",
        format!("cluster-{}", RUN.fetch_add(1, Ordering::Relaxed)),
    );
    let admin = Store::connect(url, set.clone(), ConnectOptions::default())
        .await
        .unwrap();
    admin.set_shards(QUEUES).await.unwrap();
    let mut fills = Vec::new();
    for n in 0..QUEUES {
        let admin = admin.clone();
        fills.push(tokio::spawn(async move {
            let q = QueueId::Shard(n);
            admin
                .configure_queue(q, &QueuePolicy::default())
                .await
                .unwrap();
            let envs: Vec<Envelope> = (0..2 * PER_QUEUE / TENANTS_PER_QUEUE)
                .flat_map(|i| (0..TENANTS_PER_QUEUE).map(move |t| env(&format!("q{n}t{t}"), i)))
                .collect();
            for chunk in envs.chunks(1000) {
                for r in admin.enqueue_batch(q, chunk).await.unwrap() {
                    r.unwrap();
                }
            }
        }));
    }
    for f in fills {
        f.await.unwrap();
    }
    let mut clients = Vec::new();
    for _ in 0..QUEUES {
        clients.push(
            Store::connect(url, set.clone(), ConnectOptions::default())
                .await
                .unwrap(),
        );
    }
    let cycles = PER_QUEUE * QUEUES as u64;
    let cpu0 = cpu(ports).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, store) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let q = QueueId::Shard(n as u16);
            let worker = format!("b{n}");
            let lease_for = Duration::from_secs(60);
            let leased = |o: LeaseOutcome| match o {
                LeaseOutcome::Leased(l) => l,
                other => panic!("backlog ran out: {other:?}"),
            };
            let mut held = leased(store.lease(q, &worker, lease_for).await.unwrap());
            for _ in 1..PER_QUEUE {
                let (acked, next) = store
                    .ack_and_lease(&held, Duration::from_millis(20), &worker, lease_for)
                    .await
                    .unwrap();
                assert!(acked.acked);
                held = leased(next);
            }
            assert!(store.ack(&held, Duration::from_millis(20)).await.unwrap());
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let wall = started.elapsed().as_secs_f64();
    let used = cpu(ports).await - cpu0;
    (
        Rate {
            per_s: cycles as f64 / wall,
            redis_us: used * 1e6 / cycles as f64,
        },
        admin,
    )
}

/// Which primary holds how many of the set's queues and keys.
fn census(cluster: &TestCluster, store: &Store) {
    let primaries: Vec<_> = cluster
        .topology()
        .into_iter()
        .filter(|n| n.primary)
        .collect();
    let mut queues: BTreeMap<u16, u32> = BTreeMap::new();
    for n in 0..QUEUES {
        let slot = cluster.keyslot(&store.queue_prefix(QueueId::Shard(n)));
        let owner = primaries.iter().find(|p| p.owns(slot)).unwrap();
        *queues.entry(owner.port).or_default() += 1;
    }
    let pattern = lanekeeper::store::keys::sets_pattern(&store.set().namespace, &store.set().name);
    for p in &primaries {
        let keys = cluster
            .cli(p.port, &["--scan", "--pattern", &pattern])
            .lines()
            .count();
        println!(
            "  primary 127.0.0.1:{} ({} slots): {:>2} of {QUEUES} queues, {keys:>6} keys of the set",
            p.port,
            p.slots.iter().map(|(a, b)| (b - a) as u32 + 1).sum::<u32>(),
            queues.get(&p.port).copied().unwrap_or(0),
        );
    }
}

fn median(mut runs: Vec<Rate>) -> Rate {
    runs.sort_by(|a, b| a.per_s.total_cmp(&b.per_s));
    runs[runs.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let single = support::redis::shared();
    let cluster = TestCluster::start();
    let cluster_ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    rt.block_on(async {
        let mut singles = Vec::new();
        let mut clusters = Vec::new();
        for round in 1..=3 {
            let (s, _) = run(&single.url, &[single.port]).await;
            println!(
                "[{round}] one redis-server, {QUEUES} queues: {:>8.0} lease+ack/s  (Redis CPU {:.1} us/cycle)",
                s.per_s, s.redis_us
            );
            singles.push(s);
            let (c, store) = run(&cluster.url, &cluster_ports).await;
            println!(
                "[{round}] cluster, 3 primaries + 3 replicas, {QUEUES} queues: {:>8.0} lease+ack/s  (CPU of all six servers {:.1} us/cycle)",
                c.per_s, c.redis_us
            );
            if round == 1 {
                println!("key distribution of one run's set:");
                census(&cluster, &store);
            }
            clusters.push(c);
        }
        let (s, c) = (median(singles), median(clusters));
        println!(
            "median: one server {:.0}/s, cluster {:.0}/s",
            s.per_s, c.per_s
        );
        println!("RESULT cluster_vs_single={:.3}", c.per_s / s.per_s);
    });
    drop(cluster);
    support::process::stop_all();
}
