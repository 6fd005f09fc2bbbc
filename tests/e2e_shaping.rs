//! Shaping at ingest end to end (issue 20, item 4): `lanekeeper controller`
//! against the full test control plane and a real Redis, real worker
//! processes for the shards and (through the stand-in kubelet) the lanes,
//! the real ingest API over HTTP, and a real receiver.
//!
//! The set's eight lanes are taken (eight DedicatedLanes made by hand, as
//! GitOps would, each Active); a ninth tenant turns hot on a shard shared
//! with small tenants. With `promotion.atCap: ShapeAtIngest` its lane waits
//! at the cap, ingest shapes it, its producer sees 429s with Retry-After,
//! its backlog stays bounded, the small tenants' p99 stays near what it was
//! before the flood, and once the producer stops pushing the shaping lifts.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanekeeper::crd::LanePhase;
use lanekeeper::ingest::{auth, Config, Ingest};
use lanekeeper::routing::QueueId;
use lanekeeper::telemetry::IngestMetrics;
use support::controlplane::{self, ControlPlane};
use support::lanes::{p99, LaneEnv, Traffic};
use support::receiver::now_ms;

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

/// Reasons of the Events recorded for `object` in `ns`.
fn event_reasons(cp: &ControlPlane, ns: &str, object: &str) -> Vec<String> {
    let out = cp.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        ns,
        "--field-selector",
        &format!("regarding.name={object}"),
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\n\"}{end}",
    ]);
    out.lines().map(str::to_string).collect()
}

/// What the whale's producer saw.
#[derive(Default)]
struct Seen {
    accepted: AtomicU64,
    shaped: AtomicU64,
    other: AtomicU64,
    /// Largest Retry-After of a shaped answer, and whether one lacked it.
    max_retry_after: AtomicU64,
    missing_retry_after: AtomicU64,
}

/// A producer posting the whale's events to ingest as fast as `workers`
/// concurrent requests go, each answer counted.
fn flood(
    base: String,
    key: String,
    tenant: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
    workers: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    let next = Arc::new(AtomicU64::new(0));
    (0..workers)
        .map(|_| {
            let (base, key, tenant, stop, seen, next) =
                (base.clone(), key.clone(), tenant.clone(), stop.clone(), seen.clone(), next.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                while !stop.load(Ordering::SeqCst) {
                    let seq = next.fetch_add(1, Ordering::SeqCst);
                    let body = serde_json::json!({
                        "tenant": tenant, "id": format!("{tenant}-{seq}"), "eventType": "test.event",
                        "payload": {"tenant": tenant, "seq": seq, "sent_ms": now_ms()},
                    });
                    let Ok(res) = http
                        .post(format!("{base}/v1/events"))
                        .bearer_auth(&key)
                        .header("content-type", "application/json")
                        .body(body.to_string())
                        .send()
                        .await
                    else {
                        seen.other.fetch_add(1, Ordering::SeqCst);
                        continue;
                    };
                    let status = res.status().as_u16();
                    let retry = res
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok());
                    let text = res.text().await.unwrap_or_default();
                    match status {
                        202 => {
                            seen.accepted.fetch_add(1, Ordering::SeqCst);
                        }
                        429 if text.contains("\"shaped\"") => {
                            seen.shaped.fetch_add(1, Ordering::SeqCst);
                            match retry {
                                Some(s) => {
                                    seen.max_retry_after.fetch_max(s, Ordering::SeqCst);
                                }
                                None => {
                                    seen.missing_retry_after.fetch_add(1, Ordering::SeqCst);
                                }
                            }
                            // A polite producer would wait Retry-After; this
                            // one keeps pushing, a little slower.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        _ => {
                            seen.other.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_lane_cap_the_ninth_hot_tenant_is_shaped_at_ingest_and_small_tenants_stay_flat() {
    let cp = cluster();
    // Two shards of four delivery slots.
    let env = LaneEnv::start(
        cp,
        "shape",
        2,
        "  worker: {image: \"lanekeeper:test\", replicas: 1, concurrency: 4}\n  promotion: {promoteShare: 0.5, demoteShare: 0.01, promoteAfter: 2s, demoteAfter: 600s, window: 8s, maxLanes: 8, atCap: ShapeAtIngest}\n  relocation: {drainTimeout: 60s}\n",
        &["--promotion-tick", "1s"],
        &["--concurrency", "4"],
    )
    .await;
    // The eight lanes, taken by hand.
    for i in 0..8 {
        let t = format!("vip{i}");
        env.endpoint(&t, "ok").await;
        env.create_lane(&format!("vip{i}"), &t);
    }
    let mut phases = Vec::new();
    for i in 0..8 {
        env.wait_phase(
            &format!("vip{i}"),
            LanePhase::Active,
            Duration::from_secs(120),
            &mut phases,
        )
        .await;
    }
    // Small tenants and the whale share shard 0; the whale's deliveries take 50 ms.
    let whale = env.tenant_on("whale", 0);
    let smalls: Vec<String> = (0..3)
        .map(|i| env.tenant_on(&format!("small{i}x"), 0))
        .collect();
    env.endpoint(&whale, "delay-50").await;
    for t in &smalls {
        env.endpoint(t, "delay-20").await;
    }
    let small_traffic: Vec<Traffic> = smalls
        .iter()
        .map(|t| Traffic::start(&env.store, t, 5.0))
        .collect();

    // The real ingest API, the whale's own key.
    let key = auth::generate_key();
    let dir = support::process::scratch_dir("shape-ingest");
    let keys_file = dir.join("keys.yaml");
    std::fs::write(
        &keys_file,
        format!(
            "keys:\n  - {{name: whale, sha256: {}, tenant: {whale}}}\n",
            auth::hash_key_hex(&key)
        ),
    )
    .unwrap();
    let metrics = IngestMetrics::default();
    let ingest = Ingest::new(
        env.store.clone(),
        auth::Keys::load(&keys_file).unwrap(),
        Config::default(),
        metrics.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (addr, _task) = lanekeeper::ingest::serve("127.0.0.1:0".parse().unwrap(), ingest, async {
        let _ = stop_rx.await;
    })
    .await
    .unwrap();
    let base = format!("http://{addr}");

    // Baseline: the small tenants alone, 4 s.
    let t_base = now_ms();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t_flood = now_ms();
    let (base_p99, base_n) = p99(&env.receiver, "small", t_base, t_flood);

    // The flood: offered far beyond what a fair share of four slots drains (80/s at 50 ms).
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let producers = flood(
        base.clone(),
        key.clone(),
        whale.clone(),
        stop.clone(),
        seen.clone(),
        4,
    );

    // Hot for promoteAfter: a lane is asked for, waits at the cap, and the whale is shaped.
    let started = Instant::now();
    let shaped = loop {
        let st = env.shardset().await.status.unwrap_or_default();
        if let Some(s) = st.shaped_tenants.iter().find(|s| s.tenant == whale) {
            break s.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never shaped; lanes {:?}; status {st:?}\n{}",
            env.lanes()
                .await
                .iter()
                .map(|l| (l.spec.tenant.clone(), l.status.clone()))
                .collect::<Vec<_>>(),
            env.controller_log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let shaped_after = started.elapsed();
    let lane = env
        .lane_of(&whale)
        .await
        .expect("the whale's lane was asked for");
    assert!(
        lanekeeper::controller::lane::waits_for_cap(&lane),
        "{:?}",
        lane.status
    );
    assert_eq!(shaped.queue, QueueId::Shard(0).to_string());
    assert!(
        shaped.per_second >= 1.0 && shaped.per_second <= 80.0,
        "{shaped:?}"
    );

    // Shaped for 10 s: measure what the producer got and the small tenants' wait.
    let accepted0 = seen.accepted.load(Ordering::SeqCst);
    let refused0 = seen.shaped.load(Ordering::SeqCst);
    let t_shaped = now_ms();
    let depth_at_start = env
        .store
        .tenant_state(QueueId::Shard(0), &whale)
        .await
        .unwrap()
        .queued;
    let mut max_depth = 0;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let depth = env
            .store
            .tenant_state(QueueId::Shard(0), &whale)
            .await
            .unwrap()
            .queued;
        max_depth = max_depth.max(depth);
    }
    let t_end = now_ms();
    let secs = (t_end - t_shaped) as f64 / 1000.0;
    let accepted = seen.accepted.load(Ordering::SeqCst) - accepted0;
    let refused = seen.shaped.load(Ordering::SeqCst) - refused0;
    let (shaped_p99, shaped_n) = p99(&env.receiver, "small", t_shaped, t_end);
    let rate = accepted as f64 / secs;
    eprintln!(
        "shaped after {:.1}s at {}/s: producer got {accepted} accepted ({rate:.1}/s) and {refused} refused with 429 in {secs:.1}s (Retry-After up to {}s); whale's queued {depth_at_start} when shaped, at most {max_depth} after; small tenants' p99 {shaped_p99} ms over {shaped_n} (before the flood {base_p99} ms over {base_n})",
        shaped_after.as_secs_f64(),
        shaped.per_second,
        seen.max_retry_after.load(Ordering::SeqCst)
    );
    assert!(refused > 0, "the producer saw no 429");
    assert_eq!(
        seen.missing_retry_after.load(Ordering::SeqCst),
        0,
        "every 429 had Retry-After"
    );
    assert!(seen.max_retry_after.load(Ordering::SeqCst) >= 1);
    assert_eq!(
        seen.other.load(Ordering::SeqCst),
        0,
        "only 202 or shaped 429"
    );
    // Admitted at the shaped rate (its burst and a rate revised each tick aside).
    assert!(
        rate <= shaped.per_second * 1.3 + 2.0,
        "{rate}/s admitted, shaped to {}/s",
        shaped.per_second
    );
    // The whale's backlog stops growing: admitted at the rate it drains, its
    // queue holds no more than a few seconds of that rate over what the
    // flood before the shaping left.
    assert!(
        (max_depth as f64) <= depth_at_start as f64 + shaped.per_second * 3.0 + 50.0,
        "queued {max_depth}, {depth_at_start} when shaped"
    );
    // The small tenants' p99 stays flat: within 3x their own before the
    // flood, or 150 ms over it (one whale delivery ahead on each slot, and a tick).
    assert!(
        shaped_p99 <= (base_p99 * 3).max(base_p99 + 150),
        "small p99 {shaped_p99} ms shaped, {base_p99} ms before"
    );
    let text = lanekeeper::telemetry::Encode::encode(&metrics);
    assert!(
        text.contains(&format!(
            "lanekeeper_ingest_shaped_total{{tenant=\"{whale}\"}}"
        )),
        "{text}"
    );
    assert!(event_reasons(cp, &env.ns, &env.set)
        .iter()
        .any(|r| r == "Shaped"));

    // The producer stops: after the window without a refusal the shaping lifts.
    stop.store(true, Ordering::SeqCst);
    for p in producers {
        p.await.unwrap();
    }
    let t_stop = Instant::now();
    loop {
        let st = env.shardset().await.status.unwrap_or_default();
        if st.shaped_tenants.is_empty() {
            break;
        }
        assert!(
            t_stop.elapsed() < Duration::from_secs(40),
            "still shaped: {:?}",
            st.shaped_tenants
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let lifted_after = t_stop.elapsed();
    assert_eq!(
        env.store.shaping(QueueId::Shard(0), &whale).await.unwrap(),
        Default::default(),
        "the bucket is gone from Redis"
    );
    assert!(event_reasons(cp, &env.ns, &env.set)
        .iter()
        .any(|r| r == "Unshaped"));
    eprintln!(
        "lifted {:.1}s after the producer stopped (window 8s)",
        lifted_after.as_secs_f64()
    );
    // Nothing accepted was lost: every accepted whale event arrives.
    let want = seen.accepted.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let got = env
            .receiver
            .arrivals()
            .into_iter()
            .filter(|a| a.accepted && a.tenant == whale)
            .map(|a| a.seq)
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64;
        if got >= want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{got} of {want} accepted whale events arrived"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for t in small_traffic {
        t.stop().await;
    }
    let _ = stop_tx.send(());
}
