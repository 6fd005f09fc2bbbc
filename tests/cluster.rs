//! The data plane on a real Redis Cluster: three primaries and three
//! replicas on loopback ports (`redis-server --cluster-enabled yes`, `redis-cli
//! --cluster create`). The single-server property and fairness tests run
//! here unchanged; real `lanekeeper worker` processes deliver through a
//! coordinated failover and through a slot migration (`redis-cli --cluster
//! reshard`) without losing an envelope; `lanekeeper top` and `lanekeeper
//! simulate` run against the cluster URL.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{SetId, Store};
use proptest::prelude::*;
use support::redis::TestCluster;
use support::scenario::{envelope, setup_named, setup_on, stop, Setup, Q};

/// The cluster shared by the tests that do not change its topology.
fn shared() -> &'static TestCluster {
    static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
    CLUSTER.get_or_init(TestCluster::start)
}

/// Redis Cluster's hash slot of a key (CRC16/XMODEM of its hash tag, mod 16384).
fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|b| *b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for b in tagged.unwrap_or(bytes) {
        crc ^= (*b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[test]
fn key_slot_agrees_with_the_cluster() {
    let c = shared();
    let queue =
        lanekeeper::store::keys::queue_prefix(&SetId::new("worker", "w1"), QueueId::Shard(0));
    let routing = lanekeeper::store::keys::routing(&SetId::new("a", "b"));
    for key in [queue.as_str(), routing.as_str(), "plain", "{}x"] {
        assert_eq!(key_slot(key), c.keyslot(key), "{key}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// `tests/model.rs`, on the cluster: nothing lost, nothing acked twice,
    /// per-tenant order under PerTenant ordering.
    #[test]
    fn model_no_loss_no_double_ack_in_order(
        ops in prop::collection::vec(support::model::op(), 1..60),
        ordered in any::<bool>(),
    ) {
        let url = shared().url.clone();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(support::model::run(&url, ops, ordered))?;
    }

    /// The same under endpoint isolation (order per tenant and endpoint).
    #[test]
    fn model_per_endpoint_no_loss_no_double_ack_in_order(
        ops in prop::collection::vec(support::model::op(), 1..60),
        ordered in any::<bool>(),
    ) {
        let url = shared().url.clone();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(support::model::run_isolated(
            &url,
            ops,
            ordered,
            lanekeeper::policy::Isolation::Endpoint,
        ))?;
    }

    /// The same with batched leases and acks (k = 16).
    #[test]
    fn model_batched_no_loss_no_double_ack_in_order(
        ops in prop::collection::vec(support::model::op(), 1..60),
        ordered in any::<bool>(),
    ) {
        let url = shared().url.clone();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(support::model::run_batched(
            &url,
            ops,
            ordered,
            lanekeeper::policy::Isolation::Tenant,
            16,
        ))?;
    }
}

#[tokio::test]
async fn the_sweep_forgets_only_idle_tenants_across_slots() {
    support::dataplane::the_sweep_forgets_only_idle_tenants(&shared().url).await;
}

#[tokio::test]
async fn whale_cannot_delay_the_small_tenant() {
    support::dataplane::whale_cannot_delay_the_small_tenant(&shared().url).await;
}

/// Store integrity (issue 17) across slots: the scripts that name an
/// envelope by tenant and id, copy claims, and keep dead letters per tenant.
#[tokio::test]
async fn integrity_same_id_in_two_tenants() {
    support::integrity::same_id_in_two_tenants_is_two_envelopes(&shared().url).await;
}

#[tokio::test]
async fn integrity_moves_keep_ids_and_claims_across_slots() {
    support::integrity::a_move_keeps_envelopes_whose_id_another_tenant_used(&shared().url).await;
    support::integrity::idempotency_survives_a_move(&shared().url).await;
}

#[tokio::test]
async fn integrity_dead_letters_per_tenant_bounded_and_replayed() {
    support::integrity::dead_letters_are_per_tenant(&shared().url).await;
    support::integrity::dead_letter_retention_is_bounded_and_counted(&shared().url).await;
    support::integrity::replaying_ten_thousand_dead_letters_loses_none(&shared().url).await;
}

/// Envelopes stored whole (issue 23) on the cluster: the lifecycle, a lane
/// of an older library's records, and hostile items and keys.
#[tokio::test]
async fn envelopes_stored_whole_across_slots() {
    let url = &shared().url;
    support::whole::an_envelope_is_stored_whole_until_its_lease_ends_otherwise(url).await;
    support::whole::a_lane_of_records_is_served_in_order_beside_whole_items(url).await;
    support::whole::hostile_whole_items_fail_no_lease_and_lose_nothing_quietly(url).await;
    support::whole::a_foreign_leased_key_fails_no_lease_or_ack(url).await;
    support::whole::a_malformed_enqueue_fails_before_its_first_write(url).await;
    support::whole::a_replay_waits_while_its_id_is_live_again(url).await;
    support::whole::a_batch_claims_each_id_once_and_its_items_carry_their_seqs(url).await;
    support::whole::claims_hold_when_the_window_grows_or_the_clock_steps_back(url).await;
    support::whole::foreign_gate_keys_fail_no_lease(url).await;
}

#[tokio::test]
async fn a_moved_tenant_keeps_its_tier_across_slots() {
    support::dataplane::a_moved_tenant_keeps_its_tier_on_its_new_queue(&shared().url).await;
}

#[tokio::test]
async fn a_user_pause_travels_across_slots_and_the_newer_operation_wins() {
    support::dataplane::a_user_pause_travels_with_a_move_and_the_newer_operation_wins(
        &shared().url,
    )
    .await;
}

#[tokio::test]
async fn pause_hold_and_moved_work_across_slots() {
    support::dataplane::paused_tenant_is_held_and_moved_tenant_answers_moved(&shared().url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relocation_between_slots_keeps_order_under_continuous_enqueue() {
    support::dataplane::relocation_keeps_order_under_continuous_enqueue(&shared().url).await;
}

/// 64 queues of one set land on every primary; the set's routing table and
/// endpoint registry live in a slot of their own; `purge_set` (a SCAN of
/// every primary) removes every key of the set and nothing else.
#[tokio::test]
async fn queues_spread_over_every_primary_and_purge_reaches_them_all() {
    let c = shared();
    let s = Store::connect(&c.url, SetId::new("spread", "s64"), Default::default())
        .await
        .unwrap();
    let other = Store::connect(&c.url, SetId::new("spread", "other"), Default::default())
        .await
        .unwrap();
    assert!(s.is_cluster());
    s.set_shards(64).await.unwrap();
    for n in 0..64u16 {
        let e = Envelope {
            id: format!("e{n}"),
            ..envelope("t", n as u64)
        };
        s.enqueue(QueueId::Shard(n), &e).await.unwrap();
    }
    other.enqueue(Q, &envelope("t", 0)).await.unwrap();
    let primaries = s.cluster_primaries().await.unwrap();
    assert_eq!(primaries.len(), 3, "{primaries:?}");
    let per_node = |pattern: &str| -> BTreeMap<u16, usize> {
        primaries
            .iter()
            .map(|(_, port, _)| {
                let keys = c.cli(*port, &["--scan", "--pattern", pattern]);
                (*port, keys.lines().filter(|l| !l.is_empty()).count())
            })
            .collect()
    };
    let keys = per_node(&lanekeeper::store::keys::set_queues_pattern(&SetId::new(
        "spread", "s64",
    )));
    eprintln!("keys of 64 queues per primary: {keys:?}");
    assert!(keys.values().all(|n| *n > 0), "{keys:?}");
    assert!(
        key_slot(&s.queue_prefix(Q))
            != key_slot(&lanekeeper::store::keys::routing(&SetId::new(
                "spread", "s64"
            ))),
        "the routing table has its own slot"
    );
    let removed = s.purge_set().await.unwrap();
    assert!(removed >= 64 * 4, "removed {removed}");
    assert_eq!(
        per_node(&lanekeeper::store::keys::sets_pattern("spread", "s64"))
            .values()
            .sum::<usize>(),
        0
    );
    assert!(
        per_node(&lanekeeper::store::keys::sets_pattern("spread", "other"))
            .values()
            .sum::<usize>()
            > 0
    );
    other.purge_set().await.unwrap();
}

/// Wake-ups travel by sharded pub/sub (SPUBLISH in the scripts, SSUBSCRIBE
/// through the cluster client at the node owning the queue's slot).
#[tokio::test]
async fn a_tenant_becoming_active_wakes_subscribers() {
    use futures::StreamExt;
    let c = shared();
    let s = Store::connect(&c.url, SetId::new("wake", "w"), Default::default())
        .await
        .unwrap();
    let mut wakes = Box::pin(s.wakeups(Q).await.unwrap());
    s.enqueue(Q, &envelope("sleepy", 0)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), wakes.next())
        .await
        .expect("a wake-up within 5 s")
        .expect("the stream is open");
    s.purge_set().await.unwrap();
}

/// Deliveries seen by the receiver: (duplicates, longest gap between two
/// accepted arrivals from `from_ms` on).
fn duplicates_and_stall(s: &Setup, from_ms: u64) -> (usize, u64) {
    let arrivals = s.receiver.arrivals();
    let dups = s.accepted().values().filter(|n| **n > 1).count();
    let mut at: Vec<u64> = arrivals
        .iter()
        .filter(|a| a.accepted)
        .map(|a| a.at_ms)
        .filter(|t| *t + 1000 >= from_ms)
        .collect();
    at.sort();
    let stall = at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    (dups, stall)
}

/// A producer that enqueues `per_tenant` more envelopes for each tenant
/// (ids after `from`), a few every 10 ms, retrying a batch that failed (the
/// ids make it idempotent) until every one is stored.
fn produce(
    store: Store,
    tenants: Vec<String>,
    from: u64,
    per_tenant: u64,
    errors: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for seq in (from..from + per_tenant).step_by(5) {
            let batch: Vec<Envelope> = tenants
                .iter()
                .flat_map(|t| (seq..(seq + 5).min(from + per_tenant)).map(|i| envelope(t, i)))
                .collect();
            loop {
                match store.enqueue_batch(Q, &batch).await {
                    Ok(rs) if rs.iter().all(|r| r.is_ok()) => break,
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

const TENANTS: usize = 5;
const BEFORE: u64 = 400;
const DURING: u64 = 400;

/// Five tenants, `BEFORE` envelopes each queued, two worker processes on the
/// cluster, and a producer adding `DURING` more each while `disrupt` runs
/// once a third has arrived. Every envelope must arrive; returns
/// (duplicates, stall ms, producer retries).
async fn deliver_through(s: &Setup, disrupt: impl FnOnce() + Send + 'static) -> (usize, u64, u64) {
    deliver_through_with(s, DURING, disrupt).await
}

/// [`deliver_through`] with `during` envelopes per tenant enqueued while
/// `disrupt` runs (0: none).
async fn deliver_through_with(
    s: &Setup,
    during: u64,
    disrupt: impl FnOnce() + Send + 'static,
) -> (usize, u64, u64) {
    let tenants: Vec<String> = (0..TENANTS).map(|i| format!("c{i}")).collect();
    for t in &tenants {
        s.endpoint(t, "delay-2", 1).await;
        s.send(t, 0..BEFORE).await;
    }
    let flags = ["--concurrency", "16", "--delivery-timeout", "2s"];
    let pids: Vec<u32> = (0..2).map(|_| s.worker(&flags)).collect();
    let total = TENANTS * (BEFORE + during) as usize;
    s.wait_for_accepted(TENANTS * BEFORE as usize / 3, Duration::from_secs(60))
        .await;
    let errors = Arc::new(AtomicU64::new(0));
    let producer = produce(
        s.store.clone(),
        tenants.clone(),
        BEFORE,
        during,
        errors.clone(),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let from_ms = support::receiver::now_ms();
    let disrupted = Arc::new(AtomicBool::new(false));
    {
        let disrupted = disrupted.clone();
        tokio::task::spawn_blocking(move || {
            disrupt();
            disrupted.store(true, Ordering::SeqCst);
        })
        .await
        .unwrap();
    }
    producer.await.unwrap();
    s.wait_for_accepted(total, Duration::from_secs(120)).await;
    let accepted = s.accepted();
    let expected: BTreeSet<String> = tenants
        .iter()
        .flat_map(|t| (0..BEFORE + during).map(move |i| format!("{t}-{i}")))
        .collect();
    let got: BTreeSet<String> = accepted.keys().cloned().collect();
    assert_eq!(
        expected.difference(&got).count(),
        0,
        "lost envelopes: {:?}",
        expected.difference(&got).take(10).collect::<Vec<_>>()
    );
    for pid in pids {
        assert!(support::process::is_running(pid), "a worker died");
        stop(pid);
    }
    let (dups, stall) = duplicates_and_stall(s, from_ms);
    (dups, stall, errors.load(Ordering::Relaxed))
}

/// A coordinated failover (`CLUSTER FAILOVER` on the replica) of the primary
/// that owns the queue, while two worker processes deliver and a producer
/// enqueues: every envelope arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_of_the_queue_primary_loses_nothing() {
    let cluster = Arc::new(TestCluster::start());
    let s = setup_on(&cluster.url, QueuePolicy::default()).await;
    let slot = key_slot(&s.store.queue_prefix(Q));
    let primary = cluster.primary_of(slot);
    let replica = cluster.replica_of(&primary.id);

    // A primary that lost the function library (a fresh node, a restart
    // without persistence) answers "Function not found": the store loads
    // the library on every primary and retries.
    let libraries = |port: u16| cluster.cli(port, &["FUNCTION", "LIST"]);
    assert!(libraries(primary.port).contains("lanekeeper_"));
    assert_eq!(
        cluster.cli(primary.port, &["FUNCTION", "FLUSH"]).trim(),
        "OK"
    );
    assert!(!libraries(primary.port).contains("lanekeeper_"));
    s.endpoint("first", "ok", 1).await;
    s.send("first", 0..1).await;
    for n in cluster.topology().iter().filter(|n| n.primary) {
        assert!(libraries(n.port).contains("lanekeeper_"), "{}", n.port);
    }
    let started = Instant::now();
    let c = cluster.clone();
    let (dups, stall, retries) = deliver_through(&s, move || {
        let t = Instant::now();
        c.failover(replica.port);
        eprintln!(
            "failover: replica {} took over slot {slot} from {} in {:?}",
            replica.port,
            primary.port,
            t.elapsed()
        );
    })
    .await;
    assert_eq!(cluster.primary_of(slot).port, replica.port);
    assert!(
        libraries(replica.port).contains("lanekeeper_"),
        "the promoted replica has the library by replication"
    );
    eprintln!(
        "failover: {} envelopes all arrived in {:?}; {dups} delivered twice; longest stall {stall} ms; {retries} producer batches retried",
        TENANTS as u64 * (BEFORE + DURING),
        started.elapsed()
    );

    // `lanekeeper top` reads the same cluster through its URL.
    let out = std::process::Command::new(support::process::lanekeeper_bin())
        .args(["top", "--redis", &cluster.url, "--shard-set", &s.set])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for i in 0..TENANTS {
        assert!(text.contains(&format!("c{i}")), "top: {text}");
    }
}

/// The primary owning the queue is killed (SIGKILL) while two worker
/// processes deliver; its replica takes over once the cluster notices
/// (node timeout 2 s). The backlog was replicated before the kill (`WAIT`):
/// what the dead primary may take with it are the last leases and acks,
/// whose loss only means a redelivery. Every envelope arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_queue_primary_loses_no_queued_envelope() {
    let cluster = Arc::new(TestCluster::start());
    let s = setup_on(&cluster.url, QueuePolicy::default()).await;
    let slot = key_slot(&s.store.queue_prefix(Q));
    let primary = cluster.primary_of(slot);
    let replica = cluster.replica_of(&primary.id);
    let victim = cluster
        .nodes
        .iter()
        .find(|n| n.port == primary.port)
        .unwrap()
        .clone();
    let started = Instant::now();
    let c = cluster.clone();
    let (dups, stall, _) = deliver_through_with(&s, 0, move || {
        let acked = c.cli(victim.port, &["WAIT", "1", "5000"]);
        assert_eq!(acked.trim(), "1", "the replica has the backlog");
        let t = Instant::now();
        support::process::signal(victim.pid, libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.cli(replica.port, &["ROLE"]).starts_with("master") {
            assert!(Instant::now() < deadline, "the replica was not promoted");
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "kill: replica {} took over slot {slot} {:?} after its primary {} was killed",
            replica.port,
            t.elapsed(),
            victim.port
        );
    })
    .await;
    eprintln!(
        "kill: {} envelopes all arrived in {:?}; {dups} delivered twice; longest stall {stall} ms",
        TENANTS as u64 * BEFORE,
        started.elapsed()
    );
}

/// `redis-cli --cluster reshard` moves the slots up to the queue's slot to
/// another primary (MIGRATE, key by key) while two worker processes deliver
/// and a producer enqueues: every envelope arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_of_the_queue_loses_nothing() {
    let cluster = Arc::new(TestCluster::start());
    // A set whose queue is among the first 150 slots of its primary:
    // `reshard` moves a source's lowest slots first.
    let topology = cluster.topology();
    let (name, slot, from, moved) = (0..)
        .find_map(|i| {
            let name = format!("r{i}");
            let slot = key_slot(&lanekeeper::store::keys::queue_prefix(
                &SetId::new("worker", &name),
                Q,
            ));
            let from = topology.iter().find(|n| n.primary && n.owns(slot))?;
            let first = from.slots.iter().map(|(a, _)| *a).min()?;
            let moved = from
                .slots
                .iter()
                .map(|(a, b)| (slot.min(*b) + 1).saturating_sub(*a) as u32)
                .sum::<u32>();
            (first <= slot && moved <= 150).then(|| (name, slot, from.clone(), moved))
        })
        .unwrap();
    let to = topology
        .iter()
        .find(|n| n.primary && n.id != from.id)
        .unwrap()
        .clone();
    let s = setup_named(&cluster.url, &name, QueuePolicy::default()).await;
    assert_eq!(key_slot(&s.store.queue_prefix(Q)), slot);
    let started = Instant::now();
    let (c, target) = (cluster.clone(), to.clone());
    let (dups, stall, retries) = deliver_through(&s, move || {
        let to = target;
        let t = Instant::now();
        let keys = c.cli(from.port, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()]);
        c.reshard(&from, &to, moved);
        eprintln!(
            "reshard: {moved} slots ({} keys in the queue's slot {slot}) moved from {} to {} in {:?}",
            keys.trim(),
            from.port,
            to.port,
            t.elapsed()
        );
    })
    .await;
    assert_eq!(
        cluster.primary_of(slot).port,
        to.port,
        "the queue's slot moved"
    );
    eprintln!(
        "reshard: {} envelopes all arrived in {:?}; {dups} delivered twice; longest stall {stall} ms; {retries} producer batches retried",
        TENANTS as u64 * (BEFORE + DURING),
        started.elapsed()
    );
}

/// `lanekeeper simulate` replays its workload through the production
/// scripts on the cluster and deletes its throwaway keys from every primary.
#[test]
fn simulate_runs_on_the_cluster_and_cleans_up() {
    let c = shared();
    let mix = concat!(env!("CARGO_MANIFEST_DIR"), "/config/simulate/mix.yaml");
    let out = std::process::Command::new(support::process::lanekeeper_bin())
        .args(["simulate", "--redis", &c.url, "--mix", mix])
        .args(["--duration", "10s", "--tenants", "30", "--rate", "10"])
        .args(["--shards", "2", "--whale", "big:300:1s:100"])
        .args(["--promote-after", "2s", "--promotion-window", "10s"])
        .args(["--promotion-tick", "1s", "--svg"])
        .arg(support::process::scratch_dir("sim-cluster").join("chart.svg"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("small p50") && text.contains("whale drain"),
        "{text}"
    );
    let left: usize = c
        .topology()
        .iter()
        .filter(|n| n.primary)
        .map(|n| {
            c.cli(
                n.port,
                &[
                    "--scan",
                    "--pattern",
                    &lanekeeper::store::keys::sets_pattern("simulate", ""),
                ],
            )
            .lines()
            .count()
        })
        .sum();
    assert_eq!(left, 0, "simulate left keys behind");
}

/// The real `lanekeeper ingest` on the cluster URL: events for tenants on
/// four shards (spread over the primaries) are accepted and land in the
/// queue their tenant routes to.
#[tokio::test]
async fn ingest_enqueues_into_queues_on_every_primary() {
    let c = shared();
    let store = Store::connect(&c.url, SetId::new("ingest", "c1"), Default::default())
        .await
        .unwrap();
    store.set_shards(4).await.unwrap();
    let ingest = support::workers::Ingest::spawn(&c.url, "ingest/c1", &[]);
    let http = reqwest::Client::new();
    let table = store.routing().await.unwrap();
    let tenants: Vec<String> = (0..24).map(|i| format!("acme{i}")).collect();
    for t in &tenants {
        let res = http
            .put(format!(
                "{}/v1/tenants/{t}/endpoints/default",
                ingest.base()
            ))
            .bearer_auth(&ingest.key)
            .header("content-type", "application/json")
            .body(serde_json::json!({"url": format!("https://{t}.example/hook")}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), reqwest::StatusCode::OK);
        let res = http
            .post(format!("{}/v1/events", ingest.base()))
            .bearer_auth(&ingest.key)
            .header("content-type", "application/json")
            .body(
                serde_json::json!({"tenant": t, "payload": {"n": 1}, "id": format!("{t}-1")})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), reqwest::StatusCode::ACCEPTED);
        let v: serde_json::Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(v["envelopes"][0]["status"], "queued", "{v}");
        assert_eq!(v["queue"], table.route(t).to_string(), "{v}");
    }
    let mut owners = BTreeSet::new();
    for t in &tenants {
        let q = table.route(t);
        assert_eq!(store.tenant_state(q, t).await.unwrap().queued, 1, "{t}");
        owners.insert(c.primary_of(key_slot(&store.queue_prefix(q))).port);
    }
    eprintln!(
        "ingest: 24 events over 4 shards on {} primaries",
        owners.len()
    );
    support::process::signal(ingest.pid, libc::SIGTERM);
    store.purge_set().await.unwrap();
}

/// Endpoint isolation across slots: the endpoint lanes, the ready set and
/// the endpoints' blocks live in the queue's slot.
#[tokio::test]
async fn endpoint_isolation_across_slots() {
    let url = &shared().url;
    support::isolation::a_slow_endpoint_does_not_hold_back_its_tenants_fast_one(url).await;
    support::isolation::a_broken_or_paced_endpoint_is_parked_alone(url).await;
    support::isolation::reaps_releases_and_lost_records_free_endpoint_slots(url).await;
    support::isolation::a_move_keeps_each_endpoints_order(url).await;
    support::isolation::purge_replay_and_sweep_follow_the_endpoint_lanes(url).await;
}

#[tokio::test]
async fn a_batch_leaves_the_state_k_single_calls_leave() {
    support::batch::a_batch_leaves_the_state_k_single_calls_leave(&shared().url).await;
}

#[tokio::test]
async fn a_batch_serves_the_tenants_k_single_leases_would() {
    support::batch::a_batch_serves_the_tenants_k_single_leases_would(&shared().url).await;
}

#[tokio::test]
async fn a_malformed_call_fails_before_its_first_write() {
    support::batch::a_malformed_call_fails_before_its_first_write(&shared().url).await;
}

#[tokio::test]
async fn a_hostile_batch_settles_nothing_twice() {
    support::batch::a_hostile_batch_settles_nothing_twice(&shared().url).await;
}

#[tokio::test]
async fn a_garbage_attribution_field_fails_no_ack() {
    support::batch::a_garbage_attribution_field_fails_no_ack(&shared().url).await;
}
