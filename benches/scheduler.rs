//! `cargo bench --bench scheduler`: lease+ack throughput of the fair scheduler
//! against a real redis-server, with the raw-command floor measured in the
//! same run (RPOP then HINCRBY per message: two plain round trips). The fair
//! clients run a worker's loop: one lease, then `ack_and_lease` per delivery
//! (the ack of one envelope and the lease of the next in one script call).
//! A rate-limited case runs lease+ack with 10,000 active tenants, every one
//! limited per tenant and per endpoint (limits so high that none is ever
//! throttled, so what is measured is the cost of checking), against the
//! same tenants unlimited, interleaved. `BENCH_ONLY=rate_limits` runs only
//! that pair, five rounds, and ends with `RESULT rate_limited_vs_unlimited=<x>
//! rate_limited_cpu_vs_unlimited=<limited Redis CPU per cycle over unlimited>`.
//! An endpoint-isolation case runs lease+ack with 1,000 active tenants
//! under `isolation: Endpoint` (each tenant's envelopes in its endpoint's
//! lane, the tenant's ready endpoints in a ZSET) against the same tenants
//! under tenant isolation, interleaved.
//! Batch enqueue runs against its own raw floor, interleaved: the same
//! envelopes, 1,000 per pipeline from 4 producers, as `LPUSH` of the id on
//! one list and `HSET` of the record per envelope (no routing, no
//! idempotency, no fairness), compared by medians.
//! The batched case runs the same as a worker with 16 slots would (four
//! clients, each acking its 16 deliveries and leasing 16 more per
//! `lease_batch` call), interleaved with the baseline and k = 1; then both
//! at 1,000 and 40,000 active tenants. Each phase's Redis CPU per delivery
//! comes from `INFO cpu` around it.
//! Each round also runs the scripted floor (see `common::floor`): the
//! commands the store's layout (each envelope stored whole in its lane)
//! needs of a delivery and no more, at k = 1 and k = 16; the enqueue rounds
//! run its enqueue twin. A fair delivery cannot cost less than the floor on
//! this layout: its ratios say which bars can hold. It also runs the fair
//! floor (`common::floor`'s `FAIR_LEASE_ACK`): the floor plus the least
//! deficit round robin the layout allows (a ring, each tenant's deficit,
//! in-flight cap and estimate in its hash, its worker time, and nothing
//! else: no pause, breaker, limit, tier, maintenance, wake-up or argument
//! check), at k = 1 and k = 16, so the run says what any fair scheduler on
//! this layout costs, and what the store adds to it. With
//! `BENCH_SHARED_FLOOR=1` it also runs the fair floor on another layout
//! (every tenant's state in one field of one shared hash: one read and one
//! write per call instead of per tenant), which RESULT then reports too.
//! The last line is `RESULT fair_vs_raw=<x> batch_vs_raw=<k=16 rate over the raw rate>
//! redis_cpu_vs_raw=<k=16 Redis CPU per delivery over the raw pair's>
//! flat_40k_vs_10=<y> enqueue_per_s=<z>
//! enqueue_vs_raw=<batch enqueue rate over the raw LPUSH+HSET rate>
//! rate_limited_vs_unlimited=<limited rate over unlimited rate>
//! endpoint_isolated_vs_tenant=<endpoint isolation's rate over tenant isolation's>
//! floor_vs_raw=<the floor's k=1 rate over the raw rate>
//! floor_batch_vs_raw=<its k=16 rate over the raw rate>
//! floor_cpu_vs_raw=<its k=16 Redis CPU per delivery over the raw pair's>
//! floor_enqueue_vs_raw=<its enqueue rate over the raw LPUSH+HSET rate>
//! batch_cpu_vs_floor=<k=16 fair Redis CPU per delivery over the floor's>
//! fair_floor_vs_raw=<the fair floor's k=1 rate over the raw rate>
//! fair_floor_cpu_vs_raw=<its k=16 Redis CPU per delivery over the raw pair's>
//! batch_cpu_vs_fair_floor=<k=16 fair Redis CPU per delivery over the fair floor's>
//! fair_vs_fair_floor=<the k=1 fair rate over the fair floor's>`,
//! and with `BENCH_SHARED_FLOOR=1` `shared_floor_vs_raw=<x>
//! shared_floor_cpu_vs_raw=<y>` after them (the same two on the shared layout).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;

use common::floor::{fair_floor_deliveries, floor_deliveries, floor_enqueue};
use common::{
    connect, enqueue_all, env, fair, fair_batched, fair_with, interleaved, measure, print_server,
    raw_backlog, raw_connections, raw_pair, Rate, CLIENTS, CYCLES,
};
use lanekeeper::envelope::Envelope;
use lanekeeper::policy::{Isolation, QueuePolicy};

/// The floor: RPOP from one FIFO list, then HINCRBY, per message.
async fn raw(url: &str) -> Rate {
    let key = "bench:raw:fifo";
    // twice what the phase pops, as before (the list's length moves its cost little)
    raw_backlog(url, key, 2 * CYCLES).await;
    let conns = raw_connections(url, CLIENTS).await;
    measure(url, CYCLES, raw_pair(conns, key, CYCLES)).await
}

/// The enqueue floor: each envelope as `LPUSH` of its id and `HSET` of its
/// record (the fields `enqueue.lua` stores), 1,000 per pipeline from 4
/// producers, in keys of their own that are deleted afterwards.
async fn raw_enqueue(url: &str, envs: &[Envelope]) -> Rate {
    let client = redis::Client::open(url).unwrap();
    let records: Vec<(String, String, String)> = envs
        .iter()
        .map(|e| {
            (
                e.id.clone(),
                format!("bench:raw:e:{}:{}", e.tenant, e.id),
                serde_json::to_string(e).unwrap(),
            )
        })
        .collect();
    let mut keys: Vec<String> = records.iter().map(|r| r.1.clone()).collect();
    keys.push("bench:raw:lane".to_string());
    let chunks: Vec<Vec<(String, String, String)>> =
        records.chunks(1000).map(|c| c.to_vec()).collect();
    let chunks = Arc::new(std::sync::Mutex::new(chunks));
    let mut conns = Vec::new();
    for _ in 0..4 {
        conns.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    let n = envs.len() as u64;
    let phase = async move {
        let mut tasks = Vec::new();
        for mut conn in conns {
            let chunks = chunks.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let next = chunks.lock().unwrap().pop();
                    let Some(chunk) = next else { break };
                    let mut pipe = redis::pipe();
                    for (id, key, payload) in &chunk {
                        pipe.lpush("bench:raw:lane", id).ignore();
                        pipe.hset_multiple(
                            key,
                            &[("p", payload.as_str()), ("n", "0"), ("ep", "main")],
                        )
                        .ignore();
                    }
                    pipe.query_async::<()>(&mut conn).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    };
    let rate = measure(url, n, phase).await;
    // what the floor wrote would only grow the keyspace later rounds work in
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for chunk in keys.chunks(1000) {
        let _: () = redis::cmd("UNLINK")
            .arg(chunk)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    rate
}

/// Rounds of the baseline and of the 10-tenant case.
const ROUNDS: usize = 5;

/// Workers (clients) and slots per worker of the batched case: 64
/// deliveries in flight, under the 80 slots ten tenants at the default cap
/// of 8 have.
const BATCH_CLIENTS: usize = 4;
const BATCH: usize = 16;

/// The median of the runs' Redis CPU per operation.
fn median_cpu(runs: &[Rate]) -> f64 {
    let mut cpu: Vec<f64> = runs.iter().map(|r| r.redis_us).collect();
    cpu.sort_by(f64::total_cmp);
    cpu[cpu.len() / 2]
}

/// The run with the median rate.
fn median(mut runs: Vec<Rate>) -> Rate {
    runs.sort_by(|a, b| a.per_s.total_cmp(&b.per_s));
    runs[runs.len() / 2]
}

/// Rate limits: 10,000 tenants, each checked against its own bucket and
/// its endpoint's at every lease, none ever out of tokens, interleaved
/// with the same run unlimited, `rounds` times. Returns the median limited
/// rate over the median unlimited rate, and the same of their Redis CPU
/// per cycle.
async fn rate_limited_rounds(url: &str, rounds: usize) -> (f64, f64) {
    let limited = support::buckets::unthrottled_limits();
    let (mut unlimited_runs, mut limited_runs) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let u = fair(url, 10_000).await;
        let l = fair_with(url, 10_000, &limited).await;
        println!(
            "[{round}] fair lease+ack, 10000 active tenants: unlimited {:>9.0} cycles/s (Redis CPU {:.1} us/cycle), rate-limited {:>9.0} cycles/s (Redis CPU {:.1} us/cycle)",
            u.per_s, u.redis_us, l.per_s, l.redis_us
        );
        unlimited_runs.push(u);
        limited_runs.push(l);
    }
    let cpu = median_cpu(&limited_runs) / median_cpu(&unlimited_runs);
    (
        median(limited_runs).per_s / median(unlimited_runs).per_s,
        cpu,
    )
}

/// The floors a round measures beside the store (see `common::floor`).
#[derive(Clone, Copy)]
enum Floor {
    Scripted,
    Fair,
    FairShared,
}

/// One round of `floor` over a backlog of `envs`: k = 1 with CLIENTS
/// clients, then k = BATCH with BATCH_CLIENTS, printed as one line.
async fn floor_round(url: &str, envs: &[Envelope], floor: Floor, round: usize) -> (Rate, Rate) {
    let run = |clients, k| async move {
        match floor {
            Floor::Scripted => floor_deliveries(url, envs, clients, k, CYCLES).await,
            Floor::Fair => fair_floor_deliveries(url, envs, clients, k, CYCLES, false).await,
            Floor::FairShared => fair_floor_deliveries(url, envs, clients, k, CYCLES, true).await,
        }
    };
    let (f, b) = (run(CLIENTS, 1).await, run(BATCH_CLIENTS, BATCH).await);
    let name = match floor {
        Floor::Scripted => "scripted floor",
        Floor::Fair => "fair floor",
        Floor::FairShared => "fair floor, shared state,",
    };
    println!(
        "[{round}] {name} k=1, {CLIENTS} clients: {:>9.0} deliveries/s (Redis CPU {:.1} us/delivery), k={BATCH}, {BATCH_CLIENTS} clients: {:>9.0} deliveries/s (Redis CPU {:.1} us/delivery)",
        f.per_s, f.redis_us, b.per_s, b.redis_us
    );
    (f, b)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = support::redis::shared().url.clone();
    rt.block_on(async {
        print_server(&url).await;
        // the rate-limited pair alone, five rounds (see the header)
        if std::env::var("BENCH_ONLY").as_deref() == Ok("rate_limits") {
            let (rate, cpu) = rate_limited_rounds(&url, 5).await;
            println!("RESULT rate_limited_vs_unlimited={rate:.3} rate_limited_cpu_vs_unlimited={cpu:.3}");
            return;
        }
        // The baseline and the 10-tenant case are measured five times,
        // interleaved, and compared by their medians: both share two cores
        // with whatever else runs, and one pair alone swings by 20% or more.
        let mut raws = Vec::new();
        let mut tens = Vec::new();
        let mut batched_tens = Vec::new();
        let (mut floors, mut batched_floors) = (Vec::new(), Vec::new());
        let (mut fair_floors, mut batched_fair_floors) = (Vec::new(), Vec::new());
        let (mut shared_floors, mut batched_shared_floors) = (Vec::new(), Vec::new());
        // the fair floor on the other layout too, on request (see the header)
        let shared_layout = std::env::var_os("BENCH_SHARED_FLOOR").is_some();
        // the floor's backlog: the fair phases' envelopes
        let floor_envs = interleaved(10, 2 * CYCLES / 10);
        for round in 1..=ROUNDS {
            let r = raw(&url).await;
            println!(
                "[{round}] raw RPOP+HINCRBY, {CLIENTS} clients: {:>9.0} cycles/s  (Redis CPU {:.1} us/cycle)",
                r.per_s, r.redis_us
            );
            raws.push(r);
            let f = fair(&url, 10).await;
            println!(
                "[{round}] fair lease+ack k=1, {CLIENTS} clients,     10 active tenants: {:>9.0} deliveries/s  (Redis CPU {:.1} us/delivery)",
                f.per_s, f.redis_us
            );
            tens.push(f);
            let b = fair_batched(&url, 10, &QueuePolicy::default(), BATCH_CLIENTS, BATCH).await;
            println!(
                "[{round}] fair lease+ack k={BATCH}, {BATCH_CLIENTS} clients,      10 active tenants: {:>9.0} deliveries/s  (Redis CPU {:.1} us/delivery)",
                b.per_s, b.redis_us
            );
            batched_tens.push(b);
            let (f, b) = floor_round(&url, &floor_envs, Floor::Scripted, round).await;
            floors.push(f);
            batched_floors.push(b);
            let (f, b) = floor_round(&url, &floor_envs, Floor::Fair, round).await;
            fair_floors.push(f);
            batched_fair_floors.push(b);
            if shared_layout {
                let (f, b) = floor_round(&url, &floor_envs, Floor::FairShared, round).await;
                shared_floors.push(f);
                batched_shared_floors.push(b);
            }
        }
        let (fair_floor_cpu, batched_fair_floor_cpu) =
            (median_cpu(&fair_floors), median_cpu(&batched_fair_floors));
        let fair_floor = median(fair_floors);
        let (floor_cpu, batched_floor_cpu) = (median_cpu(&floors), median_cpu(&batched_floors));
        let (floor, batched_floor) = (median(floors), median(batched_floors));
        let raw_cpu = median_cpu(&raws);
        let raw = median(raws);
        let (ten_cpu, batched_cpu) = (median_cpu(&tens), median_cpu(&batched_tens));
        let batched = median(batched_tens);
        let mut fair_rates = vec![median(tens)];
        println!(
            "median raw {:.0} cycles/s ({raw_cpu:.1} us), fair k=1 (10 tenants) {:.0}/s ({ten_cpu:.1} us): {:.2}x raw, k={BATCH} {:.0}/s ({batched_cpu:.1} us): {:.2}x raw",
            raw.per_s,
            fair_rates[0].per_s,
            fair_rates[0].per_s / raw.per_s,
            batched.per_s,
            batched.per_s / raw.per_s,
        );
        // Redis CPU per delivered envelope by active tenants, k = 1 and k = BATCH.
        let mut table = vec![(10u64, ten_cpu, batched_cpu)];
        for tenants in [1_000u64, 40_000] {
            let r = fair(&url, tenants).await;
            let b = fair_batched(&url, tenants, &QueuePolicy::default(), BATCH_CLIENTS, BATCH).await;
            println!(
                "{tenants:>6} active tenants: k=1 {:>9.0} deliveries/s ({:.2}x raw, Redis CPU {:.1} us/delivery), k={BATCH} {:>9.0} deliveries/s ({:.2}x raw, Redis CPU {:.1} us/delivery)",
                r.per_s,
                r.per_s / raw.per_s,
                r.redis_us,
                b.per_s,
                b.per_s / raw.per_s,
                b.redis_us
            );
            fair_rates.push(r);
            table.push((tenants, r.redis_us, b.redis_us));
        }
        println!(
            "median scripted floor: k=1 {:.0}/s ({floor_cpu:.1} us): {:.2}x raw, k={BATCH} {:.0}/s ({batched_floor_cpu:.1} us): {:.2}x raw, Redis CPU {:.2}x raw's",
            floor.per_s,
            floor.per_s / raw.per_s,
            batched_floor.per_s,
            batched_floor.per_s / raw.per_s,
            batched_floor_cpu / raw_cpu,
        );
        println!(
            "median fair floor: k=1 {:.0}/s ({fair_floor_cpu:.1} us): {:.2}x raw, k={BATCH} ({batched_fair_floor_cpu:.1} us): Redis CPU {:.2}x raw's",
            fair_floor.per_s,
            fair_floor.per_s / raw.per_s,
            batched_fair_floor_cpu / raw_cpu,
        );
        // RESULT's fields for the fair floor on the other layout, when run
        let mut shared_result = String::new();
        if shared_layout {
            let batched_shared_floor_cpu = median_cpu(&batched_shared_floors);
            let shared_floor = median(shared_floors);
            println!(
                "median fair floor, shared state: k=1 {:.0}/s: {:.2}x raw, k={BATCH} ({batched_shared_floor_cpu:.1} us): Redis CPU {:.2}x raw's",
                shared_floor.per_s,
                shared_floor.per_s / raw.per_s,
                batched_shared_floor_cpu / raw_cpu,
            );
            shared_result = format!(
                " shared_floor_vs_raw={:.3} shared_floor_cpu_vs_raw={:.3}",
                shared_floor.per_s / raw.per_s,
                batched_shared_floor_cpu / raw_cpu
            );
        }
        println!("Redis CPU per delivery (us), against the raw pair's {raw_cpu:.1} us:");
        for (tenants, one, many) in &table {
            println!(
                "  {tenants:>6} tenants: k=1 {one:>5.1} ({:.2}x raw)   k={BATCH} {many:>5.1} ({:.2}x raw)",
                one / raw_cpu,
                many / raw_cpu
            );
        }
        let (rate_limited_vs_unlimited, _) = rate_limited_rounds(&url, 3).await;
        // Endpoint isolation: 1,000 tenants, interleaved with tenant isolation.
        let isolated = QueuePolicy {
            isolation: Isolation::Endpoint,
            ..QueuePolicy::default()
        };
        let (mut tenant_runs, mut endpoint_runs) = (Vec::new(), Vec::new());
        for round in 1..=3 {
            let t = fair(&url, 1_000).await;
            let e = fair_with(&url, 1_000, &isolated).await;
            println!(
                "[{round}] fair lease+ack, 1000 active tenants: tenant isolation {:>9.0} cycles/s (Redis CPU {:.1} us/cycle), endpoint isolation {:>9.0} cycles/s (Redis CPU {:.1} us/cycle)",
                t.per_s, t.redis_us, e.per_s, e.redis_us
            );
            tenant_runs.push(t);
            endpoint_runs.push(e);
        }
        let endpoint_isolated_vs_tenant = median(endpoint_runs).per_s / median(tenant_runs).per_s;
        // Batch enqueue, three times, each into a set of its own that is
        // deleted afterwards, interleaved with its raw floor, compared by
        // the medians.
        let mut enqueues = Vec::new();
        let mut raw_enqueues = Vec::new();
        let mut floor_enqueues = Vec::new();
        for round in 1..=3u64 {
            let store = connect(&url, &format!("enqueue{round}")).await;
            let envs: Vec<Envelope> = (0..200_000u64)
                .map(|i| env(&format!("imp{}", i % 100), i))
                .collect();
            let r = raw_enqueue(&url, &envs).await;
            println!(
                "[{round}] raw enqueue (LPUSH + HSET, pipelined, 1000 per batch, 4 producers): {:.0} envelopes/s  (Redis CPU {:.1} us/envelope)",
                r.per_s, r.redis_us
            );
            raw_enqueues.push(r);
            let r = floor_enqueue(&url, &envs).await;
            println!(
                "[{round}] scripted floor enqueue (200 per call, 1000 per batch, 4 producers): {:.0} envelopes/s  (Redis CPU {:.1} us/envelope)",
                r.per_s, r.redis_us
            );
            floor_enqueues.push(r);
            let n = envs.len() as u64;
            let r = measure(&url, n, async {
                enqueue_all(&store, envs).await;
            })
            .await;
            println!(
                "[{round}] batch enqueue (pipelined, 1000 per batch, 4 producers, 100 tenants): {:.0} envelopes/s  (Redis CPU {:.1} us/envelope)",
                r.per_s, r.redis_us
            );
            enqueues.push(r);
            store.purge_set().await.unwrap();
        }
        let enqueue = median(enqueues);
        let raw_enqueue = median(raw_enqueues);
        let enqueue_vs_raw = enqueue.per_s / raw_enqueue.per_s;
        let floor_enqueue_vs_raw = median(floor_enqueues).per_s / raw_enqueue.per_s;
        let fair_vs_raw = fair_rates[0].per_s / raw.per_s;
        // Flatness: 40k-tenant throughput relative to 10 (1.0 = no slowdown).
        let flat = fair_rates[0].per_s / fair_rates[2].per_s;
        let batch_vs_raw = batched.per_s / raw.per_s;
        let redis_cpu_vs_raw = batched_cpu / raw_cpu;
        // the scripted floor against the same baselines: how far each bar
        // stated against them can be met on this layout at all
        let floor_vs_raw = floor.per_s / raw.per_s;
        let floor_batch_vs_raw = batched_floor.per_s / raw.per_s;
        let floor_cpu_vs_raw = batched_floor_cpu / raw_cpu;
        // what the scheduler adds to the floor, in Redis CPU, at k = BATCH
        let batch_cpu_vs_floor = batched_cpu / batched_floor_cpu;
        // the fair floor: the least deficit round robin on this layout
        let fair_floor_vs_raw = fair_floor.per_s / raw.per_s;
        let fair_floor_cpu_vs_raw = batched_fair_floor_cpu / raw_cpu;
        // what the store adds to the least deficit round robin, at k = BATCH
        let batch_cpu_vs_fair_floor = batched_cpu / batched_fair_floor_cpu;
        // and its k = 1 rate over the fair floor's
        let fair_vs_fair_floor = fair_rates[0].per_s / fair_floor.per_s;
        println!(
            "RESULT fair_vs_raw={fair_vs_raw:.3} batch_vs_raw={batch_vs_raw:.3} redis_cpu_vs_raw={redis_cpu_vs_raw:.3} flat_40k_vs_10={flat:.3} enqueue_per_s={:.0} enqueue_vs_raw={enqueue_vs_raw:.3} rate_limited_vs_unlimited={rate_limited_vs_unlimited:.3} endpoint_isolated_vs_tenant={endpoint_isolated_vs_tenant:.3} floor_vs_raw={floor_vs_raw:.3} floor_batch_vs_raw={floor_batch_vs_raw:.3} floor_cpu_vs_raw={floor_cpu_vs_raw:.3} floor_enqueue_vs_raw={floor_enqueue_vs_raw:.3} batch_cpu_vs_floor={batch_cpu_vs_floor:.3} fair_floor_vs_raw={fair_floor_vs_raw:.3} fair_floor_cpu_vs_raw={fair_floor_cpu_vs_raw:.3} batch_cpu_vs_fair_floor={batch_cpu_vs_fair_floor:.3} fair_vs_fair_floor={fair_vs_fair_floor:.3}{shared_result}",
            enqueue.per_s
        );
    });
    support::process::stop_all();
}
