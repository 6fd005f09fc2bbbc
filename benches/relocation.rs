//! `cargo bench --bench relocation`: a tenant with 10,000 envelopes queued
//! on its hash shard, still sending, becomes hot and is promoted to a
//! dedicated lane, on the real test control plane (controller process, kwok
//! node) with a real Redis, real worker processes (shards, and the lane once
//! its Deployment exists) and a real receiver. Prints how long each phase
//! took, from the moment the tenant became hot (its `hotSince` in the
//! ShardSet status) to the moment its lane is `Active`, and how long its
//! producer's envelopes sat in the hold buffer. The last line is
//! `RESULT hot_to_active_s=<x> hold_max_s=<y>`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lanekeeper::crd::LanePhase;
use lanekeeper::envelope::Envelope;
use support::lanes::{LaneEnv, Traffic};
use support::receiver::now_ms;

const QUEUED: u64 = 10_000;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cp = support::controlplane::full();
    cp.install_crds();
    // Workers: 16 slots per shard; the tenant's endpoint takes 20 ms, so its
    // backlog needs about 25 s of the shard's workers.
    let env = LaneEnv::start(
        cp,
        "bench-reloc",
        2,
        "  worker: {image: \"lanekeeper:bench\", replicas: 1, concurrency: 16}\n  scheduler: {maxInFlightPerTenant: 16}\n  promotion: {promoteShare: 0.5, demoteShare: 0.01, promoteAfter: 2s, demoteAfter: 1h, window: 10s}\n  relocation: {drainTimeout: 600s}\n",
        &["--promotion-tick", "1s"],
        &["--concurrency", "16"],
    )
    .await;
    let bulk = env.tenant_on("bulk", 0);
    let other = env.tenant_on("other", 0);
    env.endpoint(&bulk, "delay-20").await;
    env.endpoint(&other, "delay-5").await;

    // 10,000 queued before the workers get to them: seqs 0..10000.
    let q = env.store.routing().await.unwrap().route(&bulk);
    let envs: Vec<Envelope> = (0..QUEUED)
        .map(|i| Envelope {
            id: format!("{bulk}-q{i}"),
            ..support::scenario::envelope(&bulk, i)
        })
        .collect();
    let t_fill = Instant::now();
    for chunk in envs.chunks(2000) {
        for r in env.store.enqueue_batch(q, chunk).await.unwrap() {
            r.unwrap();
        }
    }
    eprintln!(
        "{QUEUED} envelopes of {bulk} queued on {q} in {:.2}s",
        t_fill.elapsed().as_secs_f64()
    );
    // Its producer keeps sending (50/s) through the move; so does a small tenant.
    let bulk_traffic = Traffic::start(&env.store, &bulk, 50.0);
    let other_traffic = Traffic::start(&env.store, &other, 10.0);

    let started = Instant::now();
    let t0_ms = now_ms();
    // The tenant becomes hot once its shard's window shows it hogging the
    // workers; at that moment its backlog is topped up to 10,000 queued.
    let mut hot_since = loop {
        let set = env.shardset().await;
        if let Some(c) = set
            .status
            .as_ref()
            .and_then(|s| s.promotion_candidates.iter().find(|c| c.tenant == bulk))
        {
            break Some(c.hot_since.0);
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{bulk} never became hot:\n{}",
            env.controller_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let queued = env.store.tenant_state(q, &bulk).await.unwrap().queued;
    let top_up: Vec<Envelope> = (0..QUEUED.saturating_sub(queued))
        .map(|i| Envelope {
            id: format!("{bulk}-t{i}"),
            ..support::scenario::envelope(&bulk, QUEUED + i)
        })
        .collect();
    for chunk in top_up.chunks(2000) {
        for r in env.store.enqueue_batch(q, chunk).await.unwrap() {
            r.unwrap();
        }
    }
    let at_hot = env.store.tenant_state(q, &bulk).await.unwrap().queued;
    eprintln!(
        "{bulk} hot {:.1}s after the start; {queued} still queued, topped up by {} to {at_hot}",
        started.elapsed().as_secs_f64(),
        top_up.len()
    );
    let mut lane_seen_ms = 0;
    let mut name = None;
    let mut phases: BTreeMap<u64, LanePhase> = BTreeMap::new();
    let mut last = None;
    let active_ms = loop {
        if name.is_none() {
            let set = env.shardset().await;
            if let Some(c) = set
                .status
                .as_ref()
                .and_then(|s| s.promotion_candidates.iter().find(|c| c.tenant == bulk))
            {
                hot_since = Some(c.hot_since.0);
            }
            if let Some(l) = env.lane_of(&bulk).await {
                lane_seen_ms = now_ms();
                name = l.metadata.name.clone();
            }
        }
        if let Some(n) = &name {
            if let Ok(l) = env.lanes_api().get(n).await {
                let p = l.status.as_ref().map(|s| s.phase).unwrap_or_default();
                if last != Some(p) {
                    phases.insert(now_ms(), p);
                    last = Some(p);
                }
                if p == LanePhase::Active {
                    break now_ms();
                }
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{bulk} did not become Active on a lane:\n{}",
            env.controller_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = bulk_traffic.stop().await;
    let other_sent = other_traffic.stop().await;

    // Everything arrives.
    let want = QUEUED + top_up.len() as u64 + sent.count;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let got = env
            .receiver
            .arrivals()
            .into_iter()
            .filter(|a| a.accepted && a.tenant == bulk)
            .map(|a| a.id)
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64;
        if got == want {
            break;
        }
        assert!(Instant::now() < deadline, "{got} of {want} arrived");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let hot_ms = hot_since
        .expect("the tenant was a promotion candidate before its lane existed")
        .as_millisecond() as u64;
    println!(
        "tenant {bulk}: {at_hot} queued on {q} when hot (hotSince {:.1}s after the start)",
        (hot_ms as f64 - t0_ms as f64) / 1000.0
    );
    println!(
        "hot -> DedicatedLane created (promoteAfter 2s, tick 1s): {:.2}s",
        (lane_seen_ms.saturating_sub(hot_ms)) as f64 / 1000.0
    );
    let marks: Vec<(u64, LanePhase)> = phases.iter().map(|(t, p)| (*t, *p)).collect();
    for w in marks.windows(2) {
        println!(
            "  {:<10} {:>7.2}s",
            format!("{:?}", w[0].1),
            (w[1].0 - w[0].0) as f64 / 1000.0
        );
    }
    let hot_to_active = (active_ms.saturating_sub(hot_ms)) as f64 / 1000.0;
    let hold_max = sent
        .held_ms
        .iter()
        .map(|t| active_ms.saturating_sub(*t))
        .max()
        .unwrap_or(0) as f64
        / 1000.0;
    println!(
        "producer: {} sent during the run, {} held; the first held envelope waited {hold_max:.2}s in the hold buffer; small tenant sent {}",
        sent.count,
        sent.held_ms.len(),
        other_sent.count
    );
    println!("RESULT hot_to_active_s={hot_to_active:.2} hold_max_s={hold_max:.2}");
}
