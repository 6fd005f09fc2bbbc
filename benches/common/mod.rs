//! Helpers shared by the benchmarks.
//! Each benchmark uses part of this module.
#![allow(dead_code)]

pub mod floor;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::redis::info_field;
use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{ConnectOptions, LeaseOutcome, SetId, Store};

pub const CLIENTS: usize = 50;
pub const CYCLES: u64 = 30_000;
pub const Q: QueueId = QueueId::Shard(0);

pub fn env(tenant: &str, i: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{i}"),
        tenant: tenant.to_string(),
        endpoint: Some("main".into()),
        event_type: Some("bench".into()),
        payload: serde_json::json!({ "n": i, "body": "x".repeat(200) }),
    }
}

pub async fn connect(url: &str, set: &str) -> Store {
    Store::connect(url, SetId::new("bench", set), ConnectOptions::default())
        .await
        .unwrap()
}

pub async fn enqueue_all(store: &Store, envs: Vec<Envelope>) -> f64 {
    let started = Instant::now();
    let n = envs.len();
    // moved into chunks, not cloned: a deep copy of every envelope here
    // would be timed as the store's work while Redis waits
    let mut envs = envs.into_iter();
    let mut chunks: Vec<Vec<Envelope>> = Vec::with_capacity(n / 1000 + 1);
    loop {
        let chunk: Vec<Envelope> = envs.by_ref().take(1000).collect();
        if chunk.is_empty() {
            break;
        }
        chunks.push(chunk);
    }
    let chunks = Arc::new(std::sync::Mutex::new(chunks));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (store, chunks) = (store.clone(), chunks.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let next = chunks.lock().unwrap().pop();
                let Some(chunk) = next else { break };
                for r in store.enqueue_batch(Q, &chunk).await.unwrap() {
                    r.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// A measured phase: operations per second, and the Redis server's CPU
/// time per operation (less sensitive than wall time to whatever else the
/// machine is doing, and what the scripts' cost comes down to).
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    pub per_s: f64,
    pub redis_us: f64,
}

/// Run `phase`, which performs `ops` operations, and measure it.
/// With `BENCH_COMMANDSTATS=1`, also prints the phase's `INFO
/// commandstats` (reset before it) per operation, indented, before the
/// caller prints the phase's rate: what its script calls cost, without the
/// setup around it.
pub async fn measure<F: std::future::Future<Output = ()>>(url: &str, ops: u64, phase: F) -> Rate {
    let stats = std::env::var_os("BENCH_COMMANDSTATS").is_some();
    if stats {
        redis_admin(url, &["CONFIG", "RESETSTAT"]).await;
    }
    let cpu0 = redis_cpu(url).await;
    let started = Instant::now();
    phase.await;
    let wall = started.elapsed().as_secs_f64();
    let cpu = redis_cpu(url).await - cpu0;
    if stats {
        print_commandstats(&redis_admin(url, &["INFO", "commandstats"]).await, ops);
    }
    Rate {
        per_s: ops as f64 / wall,
        redis_us: cpu * 1e6 / ops as f64,
    }
}

/// Lease+ack cycles with CLIENTS concurrent clients.
pub async fn fair(url: &str, tenants: u64) -> Rate {
    fair_with(url, tenants, &QueuePolicy::default()).await
}

/// `per` envelopes of each of `tenants` tenants (`t0`, `t1`, ...), the
/// tenants interleaved: one of each, then the next of each.
pub fn interleaved(tenants: u64, per: u64) -> Vec<Envelope> {
    (0..per)
        .flat_map(|i| (0..tenants).map(move |t| env(&format!("t{t}"), i)))
        .collect()
}

/// A set of its own (envelope ids repeat between runs) whose queue `Q`
/// has `tenants` active tenants under `policy`, with enough backlog that
/// every tenant stays active for `ops` deliveries, and `clients`
/// connections to it. Returns the admin connection (purge the set with it
/// afterwards: what a run leaves queued would only grow the keyspace the
/// next run works in) and the clients.
pub async fn backlog(
    url: &str,
    tenants: u64,
    policy: &QueuePolicy,
    ops: u64,
    clients: usize,
) -> (Store, Vec<Store>) {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let set = format!("fair{tenants}-{}", RUN.fetch_add(1, Ordering::Relaxed));
    let admin = connect(url, &set).await;
    admin.configure_queue(Q, policy).await.unwrap();
    enqueue_all(&admin, interleaved(tenants, (2 * ops / tenants).max(2))).await;
    let mut stores = Vec::new();
    for _ in 0..clients {
        stores.push(connect(url, &set).await);
    }
    (admin, stores)
}

/// Lease+ack cycles with CLIENTS concurrent clients under `policy`.
pub async fn fair_with(url: &str, tenants: u64, policy: &QueuePolicy) -> Rate {
    let (admin, clients) = backlog(url, tenants, policy, CYCLES, CLIENTS).await;
    let rate = measure(url, CYCLES, run_fair(clients, CYCLES)).await;
    admin.purge_set().await.unwrap();
    rate
}

/// Deliveries with `clients` concurrent clients, each a worker with `k`
/// slots: every call acks the deliveries it holds and leases up to `k`
/// more ([`Store::lease_batch`]).
pub async fn fair_batched(
    url: &str,
    tenants: u64,
    policy: &QueuePolicy,
    clients: usize,
    k: usize,
) -> Rate {
    let (admin, stores) = backlog(url, tenants, policy, CYCLES, clients).await;
    let rate = measure(url, CYCLES, run_batched(stores, k, CYCLES)).await;
    admin.purge_set().await.unwrap();
    rate
}

/// `ops` deliveries from the clients, each acking the deliveries it holds
/// and leasing up to `k` more per [`Store::lease_batch`] call.
pub async fn run_batched(clients: Vec<Store>, k: usize, ops: u64) {
    // deliveries still to lease, claimed up to k at a time
    let left = Arc::new(AtomicU64::new(ops));
    let mut tasks = Vec::new();
    for (c, store) in clients.into_iter().enumerate() {
        let left = left.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("b{c}");
            let lease_for = Duration::from_secs(60);
            let mut held: Vec<lanekeeper::store::Lease> = Vec::new();
            loop {
                let want = left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                        Some(n - n.min(k as u64))
                    })
                    .map(|n| n.min(k as u64))
                    .unwrap() as usize;
                if want == 0 && held.is_empty() {
                    break;
                }
                let done: Vec<_> = held
                    .iter()
                    .map(|l| (l, Duration::from_millis(20)))
                    .collect();
                let batch = store
                    .lease_batch(Q, &done, want, &worker, lease_for)
                    .await
                    .unwrap();
                assert!(batch.acked.iter().all(|a| a.acked));
                if batch.leased.len() < want {
                    assert!(
                        !matches!(batch.short, Some(LeaseOutcome::Empty { .. }))
                            || !held.is_empty(),
                        "backlog ran out: {:?}",
                        batch.short
                    );
                    left.fetch_add((want - batch.leased.len()) as u64, Ordering::Relaxed);
                }
                held = batch.leased;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// `ops` lease+ack cycles from the clients, each a worker's loop: lease,
/// deliver, then ack and lease the next in one call (`ack_and_lease`).
pub async fn run_fair(clients: Vec<Store>, ops: u64) {
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (c, store) in clients.into_iter().enumerate() {
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let worker = format!("b{c}");
            let lease_for = Duration::from_secs(60);
            let leased = |o: LeaseOutcome| match o {
                LeaseOutcome::Leased(l) => l,
                other => panic!("backlog ran out: {other:?}"),
            };
            let mut held = leased(store.lease(Q, &worker, lease_for).await.unwrap());
            while done.fetch_add(1, Ordering::Relaxed) + 1 < ops {
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
}

/// `ops` cycles of the raw pair over `conns`: `RPOP` from the list `key`
/// (which must hold them), then `HINCRBY`, two plain round trips each.
pub async fn raw_pair(conns: Vec<redis::aio::MultiplexedConnection>, key: &'static str, ops: u64) {
    let left = Arc::new(AtomicU64::new(ops));
    let mut tasks = Vec::new();
    for mut conn in conns {
        let left = left.clone();
        tasks.push(tokio::spawn(async move {
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                let msg: Option<String> = redis::cmd("RPOP")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert!(msg.is_some());
                let _: i64 = redis::cmd("HINCRBY")
                    .arg(format!("{key}:acks"))
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
}

/// Fill the list `key` with `n` 200-byte messages for [`raw_pair`].
pub async fn raw_backlog(url: &str, key: &str, n: u64) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    for chunk in 0..n.div_ceil(1000) {
        let mut pipe = redis::pipe();
        for i in (chunk * 1000)..((chunk + 1) * 1000).min(n) {
            pipe.rpush(
                key,
                format!("{{\"n\":{i},\"body\":\"{}\"}}", "x".repeat(200)),
            )
            .ignore();
        }
        pipe.query_async::<()>(&mut conn).await.unwrap();
    }
}

/// `n` connections to `url`.
pub async fn raw_connections(url: &str, n: usize) -> Vec<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).unwrap();
    let mut conns = Vec::new();
    for _ in 0..n {
        conns.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    conns
}

async fn redis_admin(url: &str, args: &[&str]) -> String {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    match cmd.query_async(&mut conn).await.unwrap() {
        redis::Value::SimpleString(s) => s,
        v => redis::from_redis_value(v).unwrap(),
    }
}

/// Each command's calls and microseconds per operation of the phase,
/// costliest first (commands run by scripts are counted on their own and
/// inside the FCALL that ran them).
fn print_commandstats(info: &str, ops: u64) {
    let mut rows: Vec<(String, f64, f64)> = info
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let field = |k: &str| -> Option<f64> {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
            };
            Some((name.to_string(), field("calls")?, field("usec")?))
        })
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    for (name, calls, usec) in rows {
        println!(
            "    {name:<16} {:>6.2} calls/op {:>7.2} us/op",
            calls / ops as f64,
            usec / ops as f64
        );
    }
}

/// Print which redis-server the run measures (`redis_version` and its
/// executable, from `INFO server`): the ratios depend on its version, and
/// the bench takes whichever `redis-server` is first on PATH.
pub async fn print_server(url: &str) {
    let info = redis_admin(url, &["INFO", "server"]).await;
    let field = |k: &str| info_field(&info, k).unwrap_or("?");
    println!(
        "redis-server {} ({})",
        field("redis_version"),
        field("executable")
    );
}

/// CPU seconds the Redis server has used so far (user + system), from
/// `INFO cpu`: the difference over a phase says how much of the phase's
/// time the single Redis thread was busy.
pub async fn redis_cpu(url: &str) -> f64 {
    let info = redis_admin(url, &["INFO", "cpu"]).await;
    ["used_cpu_user", "used_cpu_sys"]
        .iter()
        .map(|k| info_field(&info, k).unwrap().parse::<f64>().unwrap())
        .sum()
}
