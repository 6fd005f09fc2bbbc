//! The data plane against a real redis-server: routing, enqueue, fair lease,
//! ack, nack, reap and the relocation primitives.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::producer::Producer;
use lanekeeper::routing::{hash_shard, QueueId};
use lanekeeper::store::{
    ConnectOptions, EnqueueOutcome, Failure, LeaseOutcome, NackOutcome, SetId, Store, StoreError,
    SWEEP_STEP,
};

use support::dataplane::{env, fill, lease, seq_of, LEASE, Q};

/// The tests that time Redis calls against a bound (`SLOWLOG`) take this
/// lock, and so does every test that loads the machine for long, so that
/// no other heavy test runs beside a timed one on a small machine.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn store(policy: QueuePolicy) -> Store {
    support::dataplane::store(&support::redis::shared().url, policy).await
}

/// A plain connection to the shared Redis, for writing or reading keys
/// behind the store's back.
async fn raw_conn() -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(support::redis::shared().url.as_str()).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

#[tokio::test]
async fn enqueue_lease_ack_round_trip_and_idempotency() {
    let s = store(QueuePolicy::default()).await;
    let e = env("acme", 1);
    assert!(matches!(
        s.enqueue(Q, &e).await.unwrap(),
        EnqueueOutcome::Queued { seq: 1 }
    ));
    assert_eq!(s.enqueue(Q, &e).await.unwrap(), EnqueueOutcome::Duplicate);
    let l = lease(&s, Q).await.expect("one envelope");
    assert_eq!(l.envelope().unwrap(), e);
    assert_eq!(l.attempts, 0);
    assert!(
        lease(&s, Q).await.is_none(),
        "the same id twice is stored once"
    );
    assert!(s.ack(&l, Duration::from_millis(40)).await.unwrap());
    assert!(
        !s.ack(&l, Duration::from_millis(40)).await.unwrap(),
        "ack is idempotent"
    );
    let stats = s.tenant_stats(Q, Duration::from_secs(60)).await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!((stats[0].depth, stats[0].delivered), (0, 1));
    assert!((stats[0].worker_seconds - 0.04).abs() < 1e-9);
    // Still a duplicate after delivery: the id is remembered for the idempotency window.
    assert_eq!(s.enqueue(Q, &e).await.unwrap(), EnqueueOutcome::Duplicate);
}

#[tokio::test]
async fn a_tenant_at_its_backlog_limit_is_refused_and_its_ids_stay_unclaimed() {
    let s = store(QueuePolicy::default()).await;
    let envs: Vec<Envelope> = (0..6).map(|i| env("whale", i)).collect();
    let limit = |t: &str| (t == "whale").then_some(3);
    // Under the limit when the call starts: the whole call goes in.
    for r in s.enqueue_batch_limited(Q, &envs[..4], limit).await.unwrap() {
        assert!(matches!(r.unwrap(), EnqueueOutcome::Queued { .. }));
    }
    // At it: refused, with the depth, and nothing stored.
    let out: Vec<EnqueueOutcome> = s
        .enqueue_batch_limited(Q, &envs[4..], limit)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(out, vec![EnqueueOutcome::Full { depth: 4 }; 2]);
    assert_eq!(s.tenant_state(Q, "whale").await.unwrap().queued, 4);
    // Other tenants are not limited by the whale's limit.
    assert!(matches!(
        s.enqueue_limited(Q, &env("small", 0), limit("small"))
            .await
            .unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
    // Once the whale drains below its limit, the refused ids go in: they
    // were never claimed.
    for _ in 0..3 {
        let l = lease(&s, Q).await.unwrap();
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert!(matches!(
        s.enqueue_limited(Q, &envs[4], Some(3)).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field() {
    let s = store(QueuePolicy::default()).await;
    let mut e = env("acme", 1);
    e.tenant = String::new();
    let err = s.enqueue(Q, &e).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)));
    assert_eq!(err.to_string(), "tenant: must not be empty");
    e.tenant = "x".repeat(300);
    assert!(s
        .enqueue(Q, &e)
        .await
        .unwrap_err()
        .to_string()
        .contains("300 bytes"));
    e.tenant = "bad\u{7}tenant".into();
    assert!(s
        .enqueue(Q, &e)
        .await
        .unwrap_err()
        .to_string()
        .contains("contains '\\u{7}'; a tenant id starts with a letter or digit"));
    // In a batch, one bad item does not sink the others.
    let mut bad = env("acme", 2);
    bad.tenant = String::new();
    let res = s
        .enqueue_batch(Q, &[env("acme", 1), bad, env("acme", 3)])
        .await
        .unwrap();
    assert!(res[0].is_ok() && res[1].is_err() && res[2].is_ok());
}

#[tokio::test]
async fn corrupt_stored_envelope_is_dead_lettered_not_fatal() {
    let s = store(QueuePolicy::default()).await;
    // Store a payload the way a bug or a manual edit might: not an Envelope.
    s.enqueue(Q, &env("acme", 1)).await.unwrap();
    support::bodies::stored::Conn::open(support::redis::shared().url.as_str())
        .await
        .set_payload(&s.queue_prefix(Q), "acme", "acme-1", "{not json")
        .await;
    let l = lease(&s, Q).await.unwrap();
    let cause = l.envelope().unwrap_err().to_string();
    assert_eq!(
        s.nack(
            &l,
            Duration::ZERO,
            &Failure::dead(&format!("corrupt envelope: {cause}"))
        )
        .await
        .unwrap(),
        NackOutcome::Dead {
            attempts: 1,
            breaker: None
        }
    );
    let dead = s.dead_letters(Q, "acme", None, 10).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].cause.starts_with("corrupt envelope"),
        "{:?}",
        dead[0]
    );
    assert_eq!(dead[0].envelope, "{not json");
}

#[tokio::test]
async fn redis_down_or_silent_is_a_typed_error() {
    // Nothing listens here.
    let port = support::process::free_port();
    let down = Store::connect(
        &format!("redis://127.0.0.1:{port}/"),
        SetId::new("t", "down"),
        ConnectOptions::default(),
    )
    .await;
    assert!(
        matches!(
            down,
            Err(StoreError::Redis(_)) | Err(StoreError::Timeout(_))
        ),
        "{:?}",
        down.err()
    );

    // Something accepts connections but never answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    let opts = ConnectOptions {
        connect_timeout: Duration::from_millis(300),
        response_timeout: Duration::from_millis(300),
    };
    let started = Instant::now();
    let r = Store::connect(
        &format!("redis://127.0.0.1:{silent}/"),
        SetId::new("t", "silent"),
        opts,
    )
    .await;
    let err = r.err().expect("a silent server is an error");
    assert!(
        matches!(err, StoreError::Timeout(_) | StoreError::Redis(_)),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn whale_cannot_delay_the_small_tenant() {
    support::dataplane::whale_cannot_delay_the_small_tenant(&support::redis::shared().url).await;
}

#[tokio::test]
async fn fairness_is_in_worker_seconds_not_message_counts() {
    let s = store(QueuePolicy::default()).await;
    fill(&s, Q, "slow", 3000).await;
    fill(&s, Q, "fast", 3000).await;
    // A's endpoint takes 10x longer than B's. One worker, virtual time.
    let (mut secs, mut count): (BTreeMap<String, f64>, BTreeMap<String, u64>) = Default::default();
    for _ in 0..1500 {
        let l = lease(&s, Q).await.unwrap();
        let took = if l.tenant == "slow" { 0.200 } else { 0.020 };
        s.ack(&l, Duration::from_secs_f64(took)).await.unwrap();
        *secs.entry(l.tenant.clone()).or_default() += took;
        *count.entry(l.tenant).or_default() += 1;
    }
    let (a, b) = (secs["slow"], secs["fast"]);
    eprintln!(
        "worker-seconds slow={a:.2} fast={b:.2}; deliveries slow={} fast={}",
        count["slow"], count["fast"]
    );
    assert!(
        (a - b).abs() / a.max(b) < 0.20,
        "worker-seconds not within 20%: slow={a} fast={b}"
    );
    assert!(
        count["fast"] > 5 * count["slow"],
        "fast tenant should get many more deliveries: {count:?}"
    );
    // Attribution agrees with what the workers measured.
    let stats = s.tenant_stats(Q, Duration::from_secs(600)).await.unwrap();
    let slow = stats.iter().find(|t| t.tenant == "slow").unwrap();
    assert!((slow.worker_seconds - a).abs() < 1e-6, "{slow:?} vs {a}");
}

/// Enqueue `n` envelopes of `tenant` saying its tier.
async fn fill_tier(s: &Store, tenant: &str, n: u64, tier: lanekeeper::store::TierUpdate) {
    let envs: Vec<Envelope> = (0..n).map(|i| env(tenant, i)).collect();
    for chunk in envs.chunks(1000) {
        let terms = |_: &str| lanekeeper::store::TenantTerms {
            backlog_limit: None,
            tier: tier.clone(),
        };
        for r in s.enqueue_batch_routed(Q, chunk, terms, 0).await.unwrap() {
            r.unwrap();
        }
    }
}

/// Tier weights: a tenant in a tier of weight 4 gets four times the
/// worker-seconds of one of weight 1; a tenant with no tier, or in a tier
/// the policy has no weight for, gets the default; a tenant's own weight
/// wins over its tier's; and a tier cleared by enqueue ('-') is gone.
#[tokio::test]
async fn tier_weights_scale_the_quantum_and_the_rest_get_the_default() {
    use lanekeeper::store::TierUpdate;
    let mut policy = QueuePolicy {
        quantum_seconds: 0.5,
        ..Default::default()
    };
    policy.tier_weights.insert("gold".into(), 4.0);
    policy.tier_weights.insert("bronze".into(), 1.0);
    policy.weights.insert("own".into(), 2.0);
    let s = store(policy).await;
    let set = |t: &str| TierUpdate::Set(t.into());
    fill_tier(&s, "g", 3000, set("gold")).await;
    fill_tier(&s, "b", 3000, set("bronze")).await;
    fill_tier(&s, "none", 3000, TierUpdate::Keep).await;
    fill_tier(&s, "unlisted", 3000, set("platinum")).await;
    // its own weight (2) wins over its tier's (4)
    fill_tier(&s, "own", 3000, set("gold")).await;
    let mut secs: BTreeMap<String, f64> = BTreeMap::new();
    for _ in 0..2000 {
        let l = lease(&s, Q).await.unwrap();
        s.ack(&l, Duration::from_millis(100)).await.unwrap();
        *secs.entry(l.tenant).or_default() += 0.1;
    }
    eprintln!("tier weights: worker-seconds {secs:?}");
    let ratio = |a: &str, b: &str| secs[a] / secs[b];
    assert!(
        (3.4..=4.6).contains(&ratio("g", "b")),
        "gold/bronze {:.2}",
        ratio("g", "b")
    );
    assert!(
        (0.85..=1.15).contains(&ratio("none", "b")),
        "no tier {:.2}",
        ratio("none", "b")
    );
    assert!(
        (0.85..=1.15).contains(&ratio("unlisted", "b")),
        "unlisted tier {:.2}",
        ratio("unlisted", "b")
    );
    assert!(
        (1.7..=2.3).contains(&ratio("own", "b")),
        "own weight {:.2}",
        ratio("own", "b")
    );

    // the tier is kept in the tenant's state, written only when it changes
    let mut conn = raw_conn().await;
    let tk = lanekeeper::store::keys::tenant(&s.queue_prefix(Q), "g");
    let tr = |conn: &mut redis::aio::MultiplexedConnection| {
        let tk = tk.clone();
        let mut conn = conn.clone();
        async move {
            redis::cmd("HGET")
                .arg(tk)
                .arg("tr")
                .query_async::<Option<String>>(&mut conn)
                .await
                .unwrap()
        }
    };
    assert_eq!(tr(&mut conn).await.as_deref(), Some("gold"));
    fill_tier(&s, "g", 1, TierUpdate::Keep).await;
    assert_eq!(tr(&mut conn).await.as_deref(), Some("gold"), "'' keeps");
    fill_tier(&s, "g", 1, TierUpdate::Clear).await;
    assert_eq!(tr(&mut conn).await, None, "'-' clears");
}

#[tokio::test]
async fn weights_scale_the_quantum() {
    let mut policy = QueuePolicy::default();
    policy.weights.insert("gold".into(), 3.0);
    let s = store(policy).await;
    fill(&s, Q, "gold", 2000).await;
    fill(&s, Q, "plain", 2000).await;
    let mut secs: BTreeMap<String, f64> = BTreeMap::new();
    for _ in 0..800 {
        let l = lease(&s, Q).await.unwrap();
        s.ack(&l, Duration::from_millis(100)).await.unwrap();
        *secs.entry(l.tenant).or_default() += 0.1;
    }
    let ratio = secs["gold"] / secs["plain"];
    assert!(
        (2.4..=3.6).contains(&ratio),
        "weight 3 should get about 3x the worker-seconds, got {ratio:.2}"
    );
}

#[tokio::test]
async fn in_flight_cap_holds_under_eight_concurrent_clients() {
    let policy = QueuePolicy {
        max_in_flight: 3,
        ..Default::default()
    };
    let s = store(policy).await;
    fill(&s, Q, "busy", 400).await;
    let holding = Arc::new(AtomicUsize::new(0));
    let max_seen = Arc::new(AtomicUsize::new(0));
    let delivered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (s, holding, max_seen, delivered) = (
            s.clone(),
            holding.clone(),
            max_seen.clone(),
            delivered.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let mut idle = 0;
            while idle < 50 {
                match s.lease(Q, &worker, LEASE).await.unwrap() {
                    LeaseOutcome::Leased(l) => {
                        idle = 0;
                        let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                        max_seen.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        holding.fetch_sub(1, Ordering::SeqCst);
                        assert!(s.ack(&l, Duration::from_millis(2)).await.unwrap());
                        delivered.fetch_add(1, Ordering::SeqCst);
                    }
                    _ => {
                        idle += 1;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(delivered.load(Ordering::SeqCst), 400);
    let max = max_seen.load(Ordering::SeqCst);
    assert!(max <= 3, "cap 3 exceeded: {max} held at once");
    assert!(
        max >= 2,
        "8 clients should have reached the cap at least partly, saw {max}"
    );
}

#[tokio::test]
async fn a_changed_policy_applies_at_the_next_call() {
    // The scripts keep each parsed policy string; a new one must still be
    // read at once, and an unconfigured queue runs on the defaults.
    let cap = |max_in_flight| QueuePolicy {
        max_in_flight,
        ..Default::default()
    };
    let s = store(cap(2)).await;
    fill(&s, Q, "acme", 5).await;
    let mut held = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        held.push(l);
    }
    assert_eq!(held.len(), 2, "cap 2");
    s.configure_queue(Q, &cap(3)).await.unwrap();
    // a tenant parked at its cap rejoins when a slot frees, under the new cap
    assert!(s
        .ack(&held.pop().unwrap(), Duration::from_millis(5))
        .await
        .unwrap());
    held.extend(lease(&s, Q).await);
    held.extend(lease(&s, Q).await);
    assert_eq!(held.len(), 3, "the raised cap lets three out at once");
    assert!(lease(&s, Q).await.is_none(), "and no more");
    let ordered = QueuePolicy {
        ordered: true,
        ..Default::default()
    };
    s.configure_queue(Q, &ordered).await.unwrap();
    for l in held.drain(..) {
        assert!(s.ack(&l, Duration::from_millis(5)).await.unwrap());
    }
    let one = lease(&s, Q).await.expect("work left");
    assert!(
        lease(&s, Q).await.is_none(),
        "PerTenant ordering means one in flight"
    );
    assert!(s.ack(&one, Duration::from_millis(5)).await.unwrap());

    // The policy as the scripts read it: one packed field.
    let fresh = store(QueuePolicy::default()).await;
    let conf = lanekeeper::store::keys::conf(&fresh.queue_prefix(Q));
    let mut conn = raw_conn().await;
    let packed: String = redis::cmd("HGET")
        .arg(&conf)
        .arg("policy")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        packed.contains("cap=8") && packed.contains("ordered=0"),
        "{packed}"
    );
    // Without it (a queue nobody configured) the defaults apply: cap 8.
    let _: () = redis::cmd("DEL")
        .arg(&conf)
        .query_async(&mut conn)
        .await
        .unwrap();
    fill(&fresh, Q, "bare", 10).await;
    let mut n = 0;
    while lease(&fresh, Q).await.is_some() {
        n += 1;
    }
    assert_eq!(n, 8, "default cap");
}

#[tokio::test]
async fn state_left_by_the_previous_library_version_does_not_break_delivery() {
    // The previous version kept worker-time in fractional seconds: a
    // deficit and an estimate as floats, and worker-seconds buckets filled
    // by HINCRBYFLOAT under `ws:`. During a rolling upgrade both versions
    // work on one queue; the current one must keep delivering.
    let s = store(QueuePolicy::default()).await;
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    let (secs, _us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    for b in [secs / 10, secs / 10 + 1] {
        let _: () = redis::cmd("HSET")
            .arg(lanekeeper::store::keys::legacy_worker_seconds(&p, b))
            .arg("acme")
            .arg("0.0213")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    fill(&s, Q, "acme", 2).await;
    let _: () = redis::cmd("HSET")
        .arg(lanekeeper::store::keys::tenant(&p, "acme"))
        .arg(&["d", "0.75", "e", "0.0213"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let first = lease(&s, Q).await.expect("leased despite float state");
    let (acked, next) = s
        .ack_and_lease(&first, Duration::from_millis(30), "w1", LEASE)
        .await
        .unwrap();
    assert!(acked.acked);
    let LeaseOutcome::Leased(second) = next else {
        panic!("second envelope: {next:?}")
    };
    assert!(s.ack(&second, Duration::from_millis(10)).await.unwrap());
    let stats = s.tenant_stats(Q, Duration::from_secs(60)).await.unwrap();
    assert_eq!(stats[0].delivered, 2);
    assert!((stats[0].worker_seconds - 0.04).abs() < 1e-9, "{stats:?}");
}

#[tokio::test]
async fn expired_leases_return_to_the_head_in_order() {
    let s = store(QueuePolicy::default()).await;
    for i in 0..5 {
        s.enqueue(Q, &env("acme", i)).await.unwrap();
    }
    let mut first = Vec::new();
    for _ in 0..5 {
        match s
            .lease(Q, "doomed", Duration::from_millis(50))
            .await
            .unwrap()
        {
            LeaseOutcome::Leased(l) => first.push(l),
            other => panic!("{other:?}"),
        }
    }
    // The worker dies: no ack. Another envelope arrives meanwhile.
    s.enqueue(Q, &env("acme", 5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    let (_, reaped) = s.maintain(Q, 100).await.unwrap();
    assert_eq!(reaped, 5);
    let mut again = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        again.push(seq_of(&l));
        assert_eq!(l.attempts, if seq_of(&l) < 5 { 1 } else { 0 });
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    assert_eq!(again, vec![0, 1, 2, 3, 4, 5]);
    // The dead worker's late ack is refused, not double-counted.
    assert!(!s.ack(&first[0], Duration::from_millis(1)).await.unwrap());
}

#[tokio::test]
async fn nack_retries_with_backoff_then_dead_letters() {
    let policy = QueuePolicy {
        max_attempts: 3,
        ..Default::default()
    };
    let s = store(policy).await;
    s.enqueue(Q, &env("acme", 0)).await.unwrap();
    for attempt in 1..=2u32 {
        let l = lease(&s, Q).await.unwrap();
        let out = s
            .nack(
                &l,
                Duration::from_millis(5),
                &Failure::retry("HTTP 503", Duration::from_millis(100)),
            )
            .await
            .unwrap();
        assert!(
            matches!(out, NackOutcome::Retry { attempts, .. } if attempts == attempt),
            "{out:?}"
        );
        match s.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Empty { retry_after } => {
                assert!(retry_after <= Duration::from_millis(100), "{retry_after:?}")
            }
            other => panic!("retry leased before it was due: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(130)).await;
    }
    let l = lease(&s, Q).await.expect("retry due");
    assert_eq!(l.attempts, 2);
    let out = s
        .nack(
            &l,
            Duration::from_millis(5),
            &Failure::retry("HTTP 410 Gone", Duration::from_millis(100)),
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        NackOutcome::Dead {
            attempts: 3,
            breaker: None
        }
    );
    let dead = s.dead_letters(Q, "acme", None, 10).await.unwrap().letters;
    assert_eq!(dead[0].cause, "HTTP 410 Gone");
    assert_eq!(dead[0].attempts, 3);
    let stats = s.tenant_stats(Q, Duration::from_secs(60)).await.unwrap();
    assert_eq!((stats[0].depth, stats[0].failed), (0, 1));
}

#[tokio::test]
async fn per_tenant_order_blocks_only_the_failing_tenant() {
    let policy = QueuePolicy {
        ordered: true,
        ..Default::default()
    };
    let s = store(policy).await;
    for i in 0..3 {
        s.enqueue(Q, &env("stuck", i)).await.unwrap();
        s.enqueue(Q, &env("fine", i)).await.unwrap();
    }
    let mut fine = Vec::new();
    let mut stuck = Vec::new();
    // `stuck`'s head fails once; `fine` keeps flowing; `stuck` resumes in order.
    let mut failed_once = false;
    let deadline = Instant::now() + Duration::from_secs(5);
    while fine.len() + stuck.len() < 6 && Instant::now() < deadline {
        match s.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) if l.tenant == "stuck" && !failed_once => {
                failed_once = true;
                s.nack(
                    &l,
                    Duration::ZERO,
                    &Failure::retry("HTTP 500", Duration::from_millis(200)),
                )
                .await
                .unwrap();
            }
            LeaseOutcome::Leased(l) => {
                if l.tenant == "stuck" {
                    stuck.push(seq_of(&l))
                } else {
                    fine.push(seq_of(&l))
                }
                s.ack(&l, Duration::from_millis(1)).await.unwrap();
            }
            LeaseOutcome::Empty { retry_after } => {
                tokio::time::sleep(retry_after.min(Duration::from_millis(50))).await
            }
            LeaseOutcome::Again => {}
        }
    }
    assert_eq!(fine, vec![0, 1, 2]);
    assert_eq!(stuck, vec![0, 1, 2]);
}

#[tokio::test]
async fn a_moved_tenant_keeps_its_tier_on_its_new_queue() {
    support::dataplane::a_moved_tenant_keeps_its_tier_on_its_new_queue(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn a_user_paused_tenant_waits_in_order_while_the_others_flow() {
    support::dataplane::a_user_paused_tenant_waits_in_order_while_the_others_flow(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn a_user_pause_travels_with_a_move_and_the_newer_operation_wins() {
    support::dataplane::a_user_pause_travels_with_a_move_and_the_newer_operation_wins(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn paused_tenant_is_held_and_moved_tenant_answers_moved() {
    support::dataplane::paused_tenant_is_held_and_moved_tenant_answers_moved(
        &support::redis::shared().url,
    )
    .await;
}

/// Sequence numbers arrive in order across a relocation, under continuous enqueue
/// by a producer whose routing cache goes stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relocation_keeps_order_under_continuous_enqueue() {
    support::dataplane::relocation_keeps_order_under_continuous_enqueue(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn ack_and_lease_is_one_round_trip_of_both() {
    let s = store(QueuePolicy::default()).await;
    for i in 0..3 {
        s.enqueue(Q, &env("acme", i)).await.unwrap();
    }
    let first = lease(&s, Q).await.unwrap();
    let (ack, next) = s
        .ack_and_lease(&first, Duration::from_millis(10), "w1", LEASE)
        .await
        .unwrap();
    assert!(ack.acked);
    let LeaseOutcome::Leased(second) = next else {
        panic!("{next:?}")
    };
    assert_eq!((seq_of(&first), seq_of(&second)), (0, 1));
    // A stale ack is refused, and the lease half still happens.
    let (ack, next) = s
        .ack_and_lease(&first, Duration::from_millis(10), "w1", LEASE)
        .await
        .unwrap();
    assert!(!ack.acked);
    let LeaseOutcome::Leased(third) = next else {
        panic!("{next:?}")
    };
    assert_eq!(seq_of(&third), 2);
    let (ack, next) = s
        .ack_and_lease(&second, Duration::from_millis(10), "w1", LEASE)
        .await
        .unwrap();
    assert!(ack.acked);
    assert!(matches!(next, LeaseOutcome::Empty { .. }), "{next:?}");
    assert!(s.ack(&third, Duration::from_millis(10)).await.unwrap());
    let stats = s.tenant_stats(Q, Duration::from_secs(60)).await.unwrap();
    assert_eq!((stats[0].depth, stats[0].delivered), (0, 3));
}

#[tokio::test]
async fn open_breaker_gives_the_tenant_share_to_others_then_a_probe_closes_it() {
    use lanekeeper::policy::BreakerPolicy;
    use lanekeeper::store::BreakerChange;
    let policy = QueuePolicy {
        breaker: BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 3,
            window: Duration::from_secs(60),
            open_for: Duration::from_millis(300),
        },
        ..Default::default()
    };
    let s = store(policy).await;
    for i in 0..10 {
        s.enqueue(Q, &env("broken", i)).await.unwrap();
        s.enqueue(Q, &env("fine", i)).await.unwrap();
    }
    // Fail `broken`'s endpoint until its breaker opens.
    let mut opened = false;
    let mut failures = 0;
    while !opened {
        let l = lease(&s, Q).await.unwrap();
        if l.tenant == "fine" {
            s.ack(&l, Duration::from_millis(1)).await.unwrap();
            continue;
        }
        failures += 1;
        let out = s
            .nack(
                &l,
                Duration::from_millis(1),
                &Failure::retry("HTTP 503", Duration::ZERO).blame_endpoint(),
            )
            .await
            .unwrap();
        opened = matches!(
            out,
            NackOutcome::Retry {
                breaker: Some(BreakerChange::Opened),
                ..
            }
        );
        assert!(
            failures <= 3,
            "the breaker should open at the third failure"
        );
    }
    // While open, only `fine` is leased.
    let mut fine = 0;
    while let Some(l) = lease(&s, Q).await {
        assert_eq!(l.tenant, "fine", "an open breaker's tenant was leased");
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
        fine += 1;
    }
    assert!(fine >= 7, "fine tenant kept flowing: {fine}");
    // After open_for, one probe goes out; its success closes the breaker.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let probe = lease(&s, Q)
        .await
        .expect("a probe after the breaker cooled down");
    assert_eq!(probe.tenant, "broken");
    assert_eq!(probe.breaker, Some(BreakerChange::HalfOpen));
    assert!(
        lease(&s, Q).await.is_none(),
        "only one probe while half-open"
    );
    let (ack, next) = s
        .ack_and_lease(&probe, Duration::from_millis(1), "w1", LEASE)
        .await
        .unwrap();
    assert_eq!(ack.breaker, Some(BreakerChange::Closed));
    let LeaseOutcome::Leased(after) = next else {
        panic!("{next:?}")
    };
    assert_eq!(
        after.tenant, "broken",
        "closed breaker: the tenant flows again"
    );
}

#[tokio::test]
async fn release_returns_the_envelope_without_counting_an_attempt() {
    let s = store(QueuePolicy::default()).await;
    s.enqueue(Q, &env("acme", 0)).await.unwrap();
    s.enqueue(Q, &env("acme", 1)).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    assert!(s.release(&l).await.unwrap());
    assert!(!s.release(&l).await.unwrap(), "release is idempotent");
    let again = lease(&s, Q).await.unwrap();
    assert_eq!((seq_of(&again), again.attempts), (0, 0));
}

/// A reshard fences the shard queues before it writes the new shard count:
/// a producer whose cached table still has the old count is refused (STALE)
/// and sends where the new table says, so a tenant never seen before cannot
/// have its first envelopes split between its old and new hash queues.
#[tokio::test]
async fn a_fenced_queue_refuses_a_stale_table_and_the_producer_reroutes() {
    let s = store(QueuePolicy::default()).await;
    s.set_shards(4).await.unwrap();
    // cached for a minute: stale after the change below
    let stale = Producer::new(s.clone(), Duration::from_secs(60));
    let tenant = (0..1000)
        .map(|i| format!("newcomer{i}"))
        .find(|t| hash_shard(t, 4) != hash_shard(t, 6))
        .unwrap();
    let warm = Envelope {
        id: "warm".into(),
        ..env("someone-else", 0)
    };
    stale.send(&warm).await.unwrap();
    let (old, new) = (hash_shard(&tenant, 4), hash_shard(&tenant, 6));

    // what the planner does: fence every shard queue, then the new count
    let version = s.routing().await.unwrap().version + 1;
    for n in 0..6 {
        s.fence_routing(QueueId::Shard(n), version).await.unwrap();
    }
    // a lower fence never replaces a higher one
    s.fence_routing(old, version - 1).await.unwrap();
    assert_eq!(s.set_shards(6).await.unwrap(), version);

    // routed by the stale table (version - 1), the queue says STALE
    let refused = s
        .enqueue_batch_routed(
            old,
            &[env(&tenant, 0)],
            |_| lanekeeper::store::TenantTerms::default(),
            version - 1,
        )
        .await
        .unwrap();
    assert_eq!(
        refused[0].as_ref().unwrap(),
        &EnqueueOutcome::Stale { fence: version }
    );
    assert_eq!(s.tenant_state(old, &tenant).await.unwrap().depth, 0);
    // the producer refreshes and goes to the new hash queue
    let (q, outcome) = stale.send(&env(&tenant, 1)).await.unwrap();
    assert_eq!(q, new);
    assert!(matches!(outcome, EnqueueOutcome::Queued { .. }));
    assert_eq!(s.tenant_state(old, &tenant).await.unwrap().depth, 0);
    // calls that did not route by a table (tests, imports) are not checked
    assert!(matches!(
        s.enqueue(old, &env(&tenant, 2)).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
}

/// Receiver pacing (issue 20): a nack with a pace pauses the endpoint, not
/// only the envelope; the tenant's other endpoint keeps flowing; the pause
/// keeps the later of two, is bounded by the policy's maximum, leaves the
/// breaker alone, and its state is cleaned once it is over.
#[tokio::test]
async fn pace_pauses_the_endpoint_not_the_tenant_and_cleans_up_after() {
    use lanekeeper::policy::BreakerPolicy;
    use lanekeeper::store::keys;
    let policy = QueuePolicy {
        breaker: BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 1,
            window: Duration::from_secs(60),
            open_for: Duration::from_secs(60),
        },
        max_retry_after: Duration::from_millis(600),
        ..Default::default()
    };
    let s = store(policy).await;
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    let on = |ep: &str, seq: u64| Envelope {
        id: format!("{ep}-{seq}"),
        endpoint: Some(ep.to_string()),
        ..env("acme", seq)
    };
    for i in 0..3 {
        s.enqueue(Q, &on("a", i)).await.unwrap();
    }
    for i in 0..3 {
        s.enqueue(Q, &on("b", i)).await.unwrap();
    }
    let first = lease(&s, Q).await.unwrap();
    assert_eq!(first.id, "a-0");
    // blamed too: a paced answer is not the endpoint's fault, so the blame is ignored
    let failure = Failure::retry("HTTP 429", Duration::from_millis(400))
        .paced(Duration::from_millis(400))
        .blame_endpoint();
    let NackOutcome::Retry {
        due_ms, breaker, ..
    } = s
        .nack(&first, Duration::from_millis(1), &failure)
        .await
        .unwrap()
    else {
        panic!("not a retry")
    };
    assert_eq!(breaker, None, "a paced answer changed the breaker");
    let breaker_keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{p}:br:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        breaker_keys.is_empty(),
        "the breaker was touched: {breaker_keys:?}"
    );
    let until: u64 = redis::cmd("HGET")
        .arg(keys::pace(&p, "acme"))
        .arg("a")
        .query_async(&mut conn)
        .await
        .unwrap();
    let pz: u64 = redis::cmd("HGET")
        .arg(keys::tenant(&p, "acme"))
        .arg("pz")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (until, pz),
        (due_ms, due_ms),
        "the retry is due when the pause ends"
    );
    // A shorter pause does not shorten it.
    let again = lease(&s, Q).await.unwrap();
    assert_eq!(again.id, "b-0", "a paced endpoint's envelope was leased");
    // (b-0 is fine; a-1 and a-2 went to wait out the pause)
    s.ack(&again, Duration::from_millis(1)).await.unwrap();
    // The other endpoint flows; the paced one's envelopes wait in the delayed set.
    let mut got = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        got.push(l.id.clone());
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    assert_eq!(got, vec!["b-1", "b-2"]);
    let delayed: u64 = redis::cmd("ZCARD")
        .arg(keys::delayed(&p))
        .query_async(&mut conn)
        .await
        .unwrap();
    let w: u64 = redis::cmd("HGET")
        .arg(keys::tenant(&p, "acme"))
        .arg("w")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (delayed, w),
        (3, 3),
        "a-0 as a retry, a-1 and a-2 waiting out the pause"
    );
    let mid = s.tenant_state(Q, "acme").await.unwrap();
    assert_eq!((mid.delayed, mid.depth), (3, 3));
    // A nack asking for less than what is left keeps the later end; one asking
    // for more than the maximum is cut to it.
    // (exercised on a second tenant, so acme's timeline stays simple)
    s.enqueue(
        Q,
        &Envelope {
            endpoint: Some("c".into()),
            ..env("zed", 0)
        },
    )
    .await
    .unwrap();
    s.enqueue(
        Q,
        &Envelope {
            endpoint: Some("c".into()),
            ..env("zed", 1)
        },
    )
    .await
    .unwrap();
    let z0 = lease(&s, Q).await.unwrap();
    assert_eq!(z0.tenant, "zed");
    let NackOutcome::Retry { due_ms: long, .. } = s
        .nack(
            &z0,
            Duration::ZERO,
            &Failure::retry("HTTP 503", Duration::from_secs(3600)).paced(Duration::from_secs(3600)),
        )
        .await
        .unwrap()
    else {
        panic!()
    };
    let (t, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    assert!(
        long <= t * 1000 + 1000 + 600,
        "the pause was not bounded by pmax: {long}"
    );
    let z1 = lease(&s, Q).await;
    assert!(
        z1.is_none() || z1.as_ref().unwrap().tenant != "zed",
        "{z1:?}"
    );
    // After the pause: the paced endpoint's envelopes come back in order.
    tokio::time::sleep(Duration::from_millis(650)).await;
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < 5 && Instant::now() < deadline {
        match lease(&s, Q).await {
            Some(l) => {
                got.push(l.id.clone());
                s.ack(&l, Duration::from_millis(1)).await.unwrap();
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    got.sort();
    assert_eq!(got, vec!["a-0", "a-1", "a-2", "zed-0", "zed-1"]);
    // ...and the pause state is gone: the hash and the tenant's pz.
    let exists: u64 = redis::cmd("EXISTS")
        .arg(keys::pace(&p, "acme"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let pz: Option<u64> = redis::cmd("HGET")
        .arg(keys::tenant(&p, "acme"))
        .arg("pz")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (exists, pz),
        (0, None),
        "the pause state outlived the pause"
    );
    let end = s.tenant_state(Q, "acme").await.unwrap();
    assert_eq!((end.delayed, end.depth), (0, 0));
}

/// Under PerTenant ordering a paced endpoint holds its tenant (order forbids
/// passing the paced envelope), and only that tenant.
#[tokio::test]
async fn pace_under_per_tenant_order_parks_the_tenant_and_keeps_its_order() {
    use lanekeeper::store::keys;
    let s = store(QueuePolicy {
        ordered: true,
        ..Default::default()
    })
    .await;
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    for i in 0..3 {
        s.enqueue(Q, &env("ord", i)).await.unwrap();
    }
    for i in 0..3 {
        s.enqueue(Q, &env("fine", i)).await.unwrap();
    }
    let mut ord = Vec::new();
    let mut fine = Vec::new();
    let mut paced_at = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while ord.len() + fine.len() < 5 && Instant::now() < deadline {
        match s.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) if l.tenant == "ord" && paced_at.is_none() => {
                // the last attempt: dead-lettered, and its endpoint still paced
                let f = Failure::dead("HTTP 429").paced(Duration::from_millis(400));
                assert!(matches!(
                    s.nack(&l, Duration::ZERO, &f).await.unwrap(),
                    NackOutcome::Dead { .. }
                ));
                paced_at = Some(Instant::now());
            }
            LeaseOutcome::Leased(l) => {
                if l.tenant == "ord" {
                    let since = paced_at.unwrap().elapsed();
                    assert!(
                        since >= Duration::from_millis(350),
                        "ord leased {since:?} into a 400 ms pause"
                    );
                    ord.push(seq_of(&l));
                } else {
                    fine.push(seq_of(&l));
                }
                s.ack(&l, Duration::from_millis(1)).await.unwrap();
                if l.tenant == "fine" && fine.len() == 3 {
                    // ord's next envelope met the pause: ord is parked, blocked until it ends
                    let blocked: Option<u64> = redis::cmd("ZSCORE")
                        .arg(keys::blocked(&p))
                        .arg("ord")
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    assert!(blocked.is_some(), "ord was not parked by its pause");
                }
            }
            LeaseOutcome::Empty { retry_after } => {
                tokio::time::sleep(retry_after.min(Duration::from_millis(20))).await
            }
            LeaseOutcome::Again => {}
        }
    }
    assert_eq!(fine, vec![0, 1, 2]);
    assert_eq!(ord, vec![1, 2], "order kept after the pause");
}

// ---- delivery rate limits --------------------------------------------------

fn limit(per_second: f64, burst: f64) -> lanekeeper::policy::RateLimit {
    lanekeeper::policy::RateLimit {
        per_second,
        burst,
        ..Default::default()
    }
}

/// Lease `n` times (AGAIN retried), acking each at once; the tenants leased,
/// and how many answers were EMPTY.
async fn lease_acking(s: &Store, n: usize) -> (Vec<String>, usize) {
    let mut got = Vec::new();
    let mut empty = 0;
    for _ in 0..n {
        match lease(s, Q).await {
            Some(l) => {
                got.push(l.tenant.clone());
                s.ack(&l, Duration::from_millis(1)).await.unwrap();
            }
            None => empty += 1,
        }
    }
    (got, empty)
}

#[tokio::test]
async fn a_tenant_out_of_tokens_steps_aside_and_the_others_get_its_share() {
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            tenants: [("slow".to_string(), limit(2.0, 2.0))].into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = store(policy).await;
    let t0 = 1_700_000_000_000u64;
    s.set_virtual_clock(Q, t0).await.unwrap();
    fill(&s, Q, "slow", 20).await;
    fill(&s, Q, "free", 30).await;
    // At one instant: the slow tenant gets its burst (2), the free one every
    // other lease; no lease answers EMPTY while the free tenant has work.
    let (got, empty) = lease_acking(&s, 25).await;
    assert_eq!(empty, 0, "the shard went idle with work queued: {got:?}");
    assert_eq!(got.iter().filter(|t| *t == "slow").count(), 2, "{got:?}");
    assert_eq!(got.iter().filter(|t| *t == "free").count(), 23, "{got:?}");
    // Half a second later: one more token, so exactly one more lease.
    s.set_virtual_clock(Q, t0 + 500).await.unwrap();
    let (got, _) = lease_acking(&s, 10).await;
    assert_eq!(got.iter().filter(|t| *t == "slow").count(), 1, "{got:?}");
    // Only the slow tenant left: EMPTY, with the wait until its next token.
    s.set_virtual_clock(Q, t0 + 600).await.unwrap();
    let (got, _) = lease_acking(&s, 10).await;
    assert!(got.iter().all(|t| t == "slow"), "{got:?}");
    match s.lease(Q, "w1", LEASE).await.unwrap() {
        LeaseOutcome::Empty { retry_after } => assert!(
            retry_after <= Duration::from_millis(400),
            "the next token is due in 400 ms: {retry_after:?}"
        ),
        other => panic!("out of tokens, nothing else queued: {other:?}"),
    }
    // Its next token is due at +1000: not a lease before, one at it.
    s.set_virtual_clock(Q, t0 + 999).await.unwrap();
    s.maintain(Q, 100).await.unwrap();
    assert!(
        lease(&s, Q).await.is_none(),
        "a lease before the token was due"
    );
    s.set_virtual_clock(Q, t0 + 1000).await.unwrap();
    let l = lease(&s, Q).await.expect("the token came due");
    assert_eq!(l.tenant, "slow");
}

#[tokio::test]
async fn an_endpoint_limit_holds_per_endpoint_and_a_changed_limit_applies_at_the_next_lease() {
    let ep_limit = lanekeeper::policy::RateLimit {
        endpoint_per_second: 1.0,
        endpoint_burst: 1.0,
        ..Default::default()
    };
    let mut policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            default: Some(ep_limit),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = store(policy.clone()).await;
    let t0 = 1_700_000_000_000u64;
    s.set_virtual_clock(Q, t0).await.unwrap();
    // a, b, a, b: one token per endpoint per second
    for (i, ep) in ["a", "b", "a", "b"].iter().enumerate() {
        let mut e = env("acme", i as u64);
        e.endpoint = Some(ep.to_string());
        s.enqueue(Q, &e).await.unwrap();
    }
    let (got, _) = lease_acking(&s, 4).await;
    assert_eq!(got.len(), 2, "one per endpoint at once: {got:?}");
    s.set_virtual_clock(Q, t0 + 1000).await.unwrap();
    s.maintain(Q, 100).await.unwrap();
    let (got, _) = lease_acking(&s, 4).await;
    assert_eq!(
        got.len(),
        2,
        "one more per endpoint a second later: {got:?}"
    );
    // Raised to unlimited: the next lease sees it.
    fill(&s, Q, "acme2", 5).await;
    policy.rate_limits = Default::default();
    s.configure_queue(Q, &policy).await.unwrap();
    let (got, empty) = lease_acking(&s, 5).await;
    assert_eq!((got.len(), empty), (5, 0), "{got:?}");
}

#[tokio::test]
async fn a_tiers_limit_applies_and_a_tenants_own_entry_wins() {
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            default: Some(limit(1.0, 1.0)),
            tiers: [("gold".to_string(), limit(3.0, 3.0))].into(),
            tenants: [("vip".to_string(), limit(0.0, 0.0))].into(),
        },
        ..Default::default()
    };
    let s = store(policy).await;
    s.set_virtual_clock(Q, 1_700_000_000_000).await.unwrap();
    // the tier as enqueue records it (the tenant's `tr` field)
    let mut raw = raw_conn().await;
    for t in ["goldie", "vip"] {
        let _: () = redis::cmd("HSET")
            .arg(lanekeeper::store::keys::tenant(&s.queue_prefix(Q), t))
            .arg("tr")
            .arg("gold")
            .query_async(&mut raw)
            .await
            .unwrap();
    }
    for t in ["plain", "goldie", "vip"] {
        fill(&s, Q, t, 10).await;
    }
    let (got, _) = lease_acking(&s, 30).await;
    let count = |t: &str| got.iter().filter(|x| *x == t).count();
    assert_eq!(
        (count("plain"), count("goldie"), count("vip")),
        (1, 3, 10),
        "default 1, tier gold 3, vip unlimited: {got:?}"
    );
}

#[tokio::test]
async fn a_lease_writes_its_tenants_bucket_as_the_numbers_it_holds() {
    // The bucket's level and time go to Redis as a whole number's digits
    // (int_text, ms_text) rather than as numbers Redis formats itself;
    // a level past 2^53 micro-tokens goes as a number, which Redis formats
    // (7.0 with "%.17g", 7.4 as the double's digits while it fits a 64-bit
    // integer). Here it is past 2^63, where '%d' would print the integer's
    // floor (-2^63) on x86-64. Each must read back as the number the lease
    // left. (The CRD bounds a burst to 10^6 tokens, 10^12 micro-tokens:
    // this level comes only from a policy written behind its back.)
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            default: Some(limit(1.0, 3.0)),
            tenants: [("vast".to_string(), limit(1.0, 1e13))].into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = store(policy).await;
    let t0 = 1_700_000_000_123u64;
    s.set_virtual_clock(Q, t0).await.unwrap();
    fill(&s, Q, "acme", 2).await;
    fill(&s, Q, "vast", 2).await;
    let (mut got, _) = lease_acking(&s, 4).await;
    got.sort();
    assert_eq!(
        got,
        ["acme", "acme", "vast", "vast"],
        "every envelope, the clock standing"
    );
    let p = s.queue_prefix(Q);
    let raw = raw_conn().await;
    let bucket = |t: &str| {
        let mut raw = raw.clone();
        let key = lanekeeper::store::keys::tenant(&p, t);
        async move {
            let got: (String, String) = redis::cmd("HMGET")
                .arg(key)
                .arg("tk")
                .arg("tu")
                .query_async(&mut raw)
                .await
                .unwrap();
            got
        }
    };
    assert_eq!(
        bucket("acme").await,
        ("1000000".to_string(), t0.to_string()),
        "a full bucket less two tokens, at the clock, as whole numbers' digits"
    );
    let (tk, tu) = bucket("vast").await;
    let level: f64 = tk.parse().unwrap();
    let want = 1e19 - 2e6;
    assert!(
        (level - want).abs() <= want * 1e-15 && tu == t0.to_string(),
        "a level past 2^63 as Redis formats a number (not '%d'), which reads back: {tk} at {tu}"
    );
}

/// A store whose tenants have an endpoint limit only (one per second,
/// `burst`), its virtual clock at `t0`.
async fn endpoint_limited(burst: f64, t0: u64) -> Store {
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            default: Some(lanekeeper::policy::RateLimit {
                endpoint_per_second: 1.0,
                endpoint_burst: burst,
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = store(policy).await;
    s.set_virtual_clock(Q, t0).await.unwrap();
    s
}

/// A tenant's endpoint-bucket slot as stored: its `ee` and `ek` fields.
async fn endpoint_slot(
    raw: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    tenant: &str,
) -> (Option<String>, Option<String>) {
    redis::cmd("HMGET")
        .arg(lanekeeper::store::keys::tenant(prefix, tenant))
        .arg("ee")
        .arg("ek")
        .query_async(raw)
        .await
        .unwrap()
}

/// Issue 20's bar, kept under issue 23's batching: one endpoint's bucket
/// lives in its tenant's state (the slot: `ee` its endpoint, `ek` the
/// bucket), read and written with the lease's own HMGET and HSET; any other
/// endpoint's is a key of its own. The slot changes hands only once its
/// bucket is full again, and never to an endpoint whose key holds a bucket
/// short of full (as a library version before this one leaves it while it
/// still leases, in a rolling upgrade), so no endpoint's tokens are counted
/// in two places by this version.
#[tokio::test]
async fn one_endpoint_bucket_lives_in_its_tenants_state_and_changes_hands_only_when_full() {
    use lanekeeper::store::keys;
    let t0 = 1_700_000_000_000u64;
    let s = endpoint_limited(2.0, t0).await;
    let p = s.queue_prefix(Q);
    let mut raw = raw_conn().await;
    let send = |eps: &'static [&'static str], from: u64| {
        let s = s.clone();
        async move {
            for (i, ep) in eps.iter().enumerate() {
                let mut e = env("acme", from + i as u64);
                e.endpoint = Some(ep.to_string());
                s.enqueue(Q, &e).await.unwrap();
            }
        }
    };
    let bucket_key = |ep: &str| keys::endpoint_bucket(&p, "acme", ep);
    let get = |raw: &mut redis::aio::MultiplexedConnection, key: String| {
        let mut raw = raw.clone();
        async move {
            let got: Option<String> = redis::cmd("GET")
                .arg(key)
                .query_async(&mut raw)
                .await
                .unwrap();
            got
        }
    };

    // a first: the slot is free, so a's bucket goes there; b's to its key
    send(&["a", "b"], 0).await;
    let (got, _) = lease_acking(&s, 2).await;
    assert_eq!(got.len(), 2, "{got:?}");
    let spent = |at: u64| Some(format!("1000000:{at}"));
    assert_eq!(
        endpoint_slot(&mut raw, &p, "acme").await,
        (Some("a".into()), spent(t0))
    );
    assert_eq!(
        get(&mut raw, bucket_key("a")).await,
        None,
        "a's bucket is in the slot only"
    );
    assert_eq!(get(&mut raw, bucket_key("b")).await, spent(t0));

    // a second later a's bucket is full again (the slot is free) but c's
    // key holds one token short of full, as an older version leaves it: c
    // spends from its key and the slot stays as it was
    let t1 = t0 + 1000;
    s.set_virtual_clock(Q, t1).await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(bucket_key("c"))
        .arg(format!("1000000:{t1}"))
        .query_async(&mut raw)
        .await
        .unwrap();
    send(&["c"], 2).await;
    let (got, _) = lease_acking(&s, 1).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        get(&mut raw, bucket_key("c")).await,
        Some(format!("0:{t1}"))
    );
    assert_eq!(
        endpoint_slot(&mut raw, &p, "acme").await,
        (Some("a".into()), spent(t0))
    );

    // b's key is full again too: the free slot goes to b, from its key's
    // level (full)
    send(&["b"], 3).await;
    let (got, _) = lease_acking(&s, 1).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        endpoint_slot(&mut raw, &p, "acme").await,
        (Some("b".into()), spent(t1))
    );
    // a's bucket (in the slot before, full) is a key again when a sends,
    // and b, in the slot, is held to its limit there: one token left
    send(&["a", "b", "b"], 4).await;
    let (got, _) = lease_acking(&s, 4).await;
    assert_eq!(
        got.len(),
        2,
        "a once, b once (its next token is a second off): {got:?}"
    );
    assert_eq!(get(&mut raw, bucket_key("a")).await, spent(t1));
    assert_eq!(
        endpoint_slot(&mut raw, &p, "acme").await,
        (Some("b".into()), Some(format!("0:{t1}")))
    );
}

#[tokio::test]
async fn rate_limits_survive_hostile_state() {
    // A bucket field overwritten with garbage, a P:limits entry that does
    // not parse, one whose endpoint burst is infinite (its bucket's expiry
    // came out as nan, which SET refused after the lease's writes), and a
    // clock that steps back: the scripts neither fail nor lease more than
    // the limit allows.
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            default: Some(limit(1.0, 1.0)),
            tenants: [("odd".to_string(), limit(1.0, 1.0))].into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = store(policy).await;
    let t0 = 1_700_000_000_000u64;
    s.set_virtual_clock(Q, t0).await.unwrap();
    fill(&s, Q, "acme", 5).await;
    fill(&s, Q, "odd", 5).await;
    fill(&s, Q, "boundless", 5).await;
    let p = s.queue_prefix(Q);
    let mut raw = raw_conn().await;
    let _: () = redis::cmd("HSET")
        .arg(lanekeeper::store::keys::tenant(&p, "acme"))
        .arg("tk")
        .arg("not-a-number")
        .arg("tu")
        .arg("-5")
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(lanekeeper::store::keys::limits(&p))
        .arg("odd")
        .arg("garbage")
        .arg("boundless")
        .arg("1000 1000 1 inf")
        .query_async(&mut raw)
        .await
        .unwrap();
    let (got, _) = lease_acking(&s, 15).await;
    assert_eq!(
        got.iter().filter(|t| *t == "acme").count(),
        1,
        "a bucket that does not parse counts as full, then refills at the limit: {got:?}"
    );
    assert_eq!(
        got.iter().filter(|t| *t == "odd").count(),
        5,
        "an entry that does not parse is no limit: {got:?}"
    );
    assert_eq!(
        got.iter().filter(|t| *t == "boundless").count(),
        5,
        "an endpoint bucket without bound is never empty: {got:?}"
    );
    // the clock steps back a minute: no tokens appear from it
    s.set_virtual_clock(Q, t0 - 60_000).await.unwrap();
    let (got, _) = lease_acking(&s, 5).await;
    assert!(got.iter().all(|t| t != "acme"), "{got:?}");
}

/// The tenant's endpoint-bucket slot (`ee`, `ek`) written behind the
/// scripts' back: a bucket that does not parse as two whole numbers from 0
/// up reads as full, whoever the slot names, and the lease writes it whole
/// again; the limit then holds from there (burst 1: one lease each, the
/// clock standing).
#[tokio::test]
async fn a_hostile_endpoint_slot_reads_as_a_full_bucket() {
    use lanekeeper::store::keys;
    let t0 = 1_700_000_000_000u64;
    let s = endpoint_limited(1.0, t0).await;
    let p = s.queue_prefix(Q);
    let mut raw = raw_conn().await;
    let cases = [
        ("main", "garbage"),
        ("main", "-1000000:5"),
        ("main", "5"),
        ("main", ":"),
        ("main", "1e400:0"),
        ("main", "1.5:3"),
        ("main", "99999999999999999999999:1"),
        ("other", "nan:nan"),
        ("", ""),
    ];
    for (i, (ee, ek)) in cases.iter().enumerate() {
        let t = format!("h{i}");
        for n in 0..2 {
            let mut e = env(&t, n);
            e.endpoint = Some("main".into());
            s.enqueue(Q, &e).await.unwrap();
        }
        let _: () = redis::cmd("HSET")
            .arg(keys::tenant(&p, &t))
            .arg("ee")
            .arg(ee)
            .arg("ek")
            .arg(ek)
            .query_async(&mut raw)
            .await
            .unwrap();
    }
    let (got, _) = lease_acking(&s, 3 * cases.len()).await;
    for (i, case) in cases.iter().enumerate() {
        let t = format!("h{i}");
        assert_eq!(
            got.iter().filter(|x| **x == t).count(),
            1,
            "{case:?}: a full bucket of one: {got:?}"
        );
        assert_eq!(
            endpoint_slot(&mut raw, &p, &t).await,
            (Some("main".to_string()), Some(format!("0:{t0}"))),
            "{case:?}"
        );
    }
}

/// Enqueue `n` envelopes of `tenant` numbered from `from` in one call.
async fn enqueue_n(s: &Store, tenant: &str, from: u64, n: u64) -> Vec<EnqueueOutcome> {
    let envs: Vec<Envelope> = (from..from + n).map(|i| env(tenant, i)).collect();
    s.enqueue_batch(Q, &envs)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

fn shaped_ms(o: &EnqueueOutcome) -> Option<u128> {
    match o {
        EnqueueOutcome::Shaped { retry_after } => Some(retry_after.as_millis()),
        _ => None,
    }
}

#[tokio::test]
async fn a_shaped_tenant_is_admitted_at_its_rate_and_refused_whole_beyond_it() {
    let s = store(QueuePolicy::default()).await;
    let t0 = 1_700_000_000_000u64;
    s.set_virtual_clock(Q, t0).await.unwrap();
    s.set_shaping(Q, "whale", Some((10.0, 10.0))).await.unwrap();
    // A full bucket: its burst goes in.
    let first = enqueue_n(&s, "whale", 0, 10).await;
    assert!(
        first
            .iter()
            .all(|o| matches!(o, EnqueueOutcome::Queued { .. })),
        "{first:?}"
    );
    // Empty: the next call is refused whole, nothing stored, no id claimed.
    let refused = enqueue_n(&s, "whale", 10, 3).await;
    assert!(
        refused.iter().all(|o| shaped_ms(o) == Some(300)),
        "three tokens at 10/s: {refused:?}"
    );
    // Another tenant on the same queue is not shaped.
    let other = enqueue_n(&s, "small", 0, 50).await;
    assert!(other
        .iter()
        .all(|o| matches!(o, EnqueueOutcome::Queued { .. })));
    // 300 ms later the same ids go in (they were never claimed).
    s.set_virtual_clock(Q, t0 + 300).await.unwrap();
    let again = enqueue_n(&s, "whale", 10, 3).await;
    assert!(
        again
            .iter()
            .all(|o| matches!(o, EnqueueOutcome::Queued { .. })),
        "{again:?}"
    );
    // A call larger than the burst is taken from a full bucket and leaves
    // it in debt: 40 in at once, then nothing for 3.1 s (31 tokens owed + 1).
    s.set_virtual_clock(Q, t0 + 1300).await.unwrap();
    let big = enqueue_n(&s, "whale", 100, 40).await;
    assert!(big
        .iter()
        .all(|o| matches!(o, EnqueueOutcome::Queued { .. })));
    let after = enqueue_n(&s, "whale", 200, 1).await;
    assert_eq!(shaped_ms(&after[0]), Some(3100), "{after:?}");
    let st = s.shaping(Q, "whale").await.unwrap();
    assert_eq!((st.per_second, st.refused), (Some(10.0), 4));
    assert_eq!(st.last_refused_ms, Some(t0 as i64 + 1300));
    // Over a long run the rate holds: 60 s of one call every 10 ms admits
    // 10/s (plus the burst).
    s.set_virtual_clock(Q, t0 + 10_000).await.unwrap();
    let mut admitted = 0;
    for k in 0..6000u64 {
        s.set_virtual_clock(Q, t0 + 10_000 + k * 10).await.unwrap();
        let o = enqueue_n(&s, "whale", 1000 + k, 1).await;
        if matches!(o[0], EnqueueOutcome::Queued { .. }) {
            admitted += 1;
        }
    }
    assert!(
        (600..=611).contains(&admitted),
        "{admitted} in 60 s at 10/s, burst 10"
    );
    // Lifted: admitted at once, and the state is gone.
    s.set_shaping(Q, "whale", None).await.unwrap();
    let free = enqueue_n(&s, "whale", 9000, 100).await;
    assert!(free
        .iter()
        .all(|o| matches!(o, EnqueueOutcome::Queued { .. })));
    assert_eq!(s.shaping(Q, "whale").await.unwrap(), Default::default());
}

#[tokio::test]
async fn shaping_survives_hostile_state() {
    // Garbage in every shaping field: the script neither fails nor stores
    // past what a sane reading allows.
    let s = store(QueuePolicy::default()).await;
    s.set_virtual_clock(Q, 1_700_000_000_000).await.unwrap();
    let mut raw = raw_conn().await;
    let key = lanekeeper::store::keys::tenant(&s.queue_prefix(Q), "odd");
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(&[
            "sr", "nan", "sb", "x", "sl", "-inf", "su", "later", "sd", "many",
        ])
        .query_async(&mut raw)
        .await
        .unwrap();
    // sr that does not parse: not shaped.
    let o = enqueue_n(&s, "odd", 0, 5).await;
    assert!(
        o.iter().all(|o| matches!(o, EnqueueOutcome::Queued { .. })),
        "{o:?}"
    );
    // a rate, a burst that does not parse (1), a level of -inf and a time
    // in the future: refused with a finite wait, no error.
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(&["sr", "2", "su", "99999999999999"])
        .query_async(&mut raw)
        .await
        .unwrap();
    let o = enqueue_n(&s, "odd", 10, 1).await;
    assert!(
        matches!(
            o[0],
            EnqueueOutcome::Shaped { .. } | EnqueueOutcome::Queued { .. }
        ),
        "{o:?}"
    );
    if let Some(ms) = shaped_ms(&o[0]) {
        assert!(ms <= 3_600_000, "{ms}");
    }
}

/// The longest Redis call (us) since `since_s` (unix seconds) whose
/// arguments name `needle` (a queue prefix), from SLOWLOG.
async fn slowest_call_naming(
    conn: &mut redis::aio::MultiplexedConnection,
    needle: &str,
    since_s: u64,
) -> i64 {
    slow_calls_naming(conn, needle, since_s)
        .await
        .first()
        .copied()
        .unwrap_or(0)
}

/// The durations (us, slowest first) of the Redis calls since `since_s`
/// (unix seconds) whose arguments name `needle` (a queue prefix), from
/// SLOWLOG: those over its threshold (see [`slowlog_from_1ms`]).
async fn slow_calls_naming(
    conn: &mut redis::aio::MultiplexedConnection,
    needle: &str,
    since_s: u64,
) -> Vec<i64> {
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(4096)
        .query_async(conn)
        .await
        .unwrap();
    let mut slow = Vec::new();
    for entry in log {
        let redis::Value::Array(e) = entry else {
            continue;
        };
        let (
            Some(redis::Value::Int(at)),
            Some(redis::Value::Int(us)),
            Some(redis::Value::Array(args)),
        ) = (e.get(1), e.get(2), e.get(3))
        else {
            continue;
        };
        let ours = args
            .iter()
            .any(|a| matches!(a, redis::Value::BulkString(b) if b == needle.as_bytes()));
        if ours && *at as u64 >= since_s {
            slow.push(*us);
        }
    }
    slow.sort_unstable_by(|a, b| b.cmp(a));
    slow
}

async fn slowlog_from_1ms(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(1000)
        .arg("slowlog-max-len")
        .arg(4096)
        .query_async(conn)
        .await
        .unwrap();
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 1
}

/// Issue 21: purge 100,000 queued envelopes of one tenant to its dead
/// letters, replay all 100,000 back in order, then drop them: no Redis call
/// of it takes 10 ms, the other tenant is served throughout, and each step
/// is in the audit trail.
#[tokio::test]
async fn purge_and_replay_of_100000_envelopes_keep_every_redis_call_under_10ms() {
    let _heavy = HEAVY.lock().await;
    use lanekeeper::store::{PurgeMode, ReplayPlan};
    let s = store(QueuePolicy::default()).await;
    s.set_shards(1).await.unwrap();
    fill(&s, Q, "flood", 100_000).await;
    fill(&s, Q, "small", 3).await;
    let mut conn = raw_conn().await;
    let since = slowlog_from_1ms(&mut conn).await;
    let prefix = s.queue_prefix(Q);

    let started = Instant::now();
    let o = s
        .purge_audited(
            "flood",
            PurgeMode::DeadLetter,
            "test:ops",
            Some("runaway import"),
        )
        .await
        .unwrap();
    let purge_took = started.elapsed();
    assert_eq!((o.purged, o.in_flight, o.delayed), (100_000, 0, 0), "{o:?}");
    let st = s.tenant_state(Q, "flood").await.unwrap();
    assert_eq!((st.queued, st.depth), (0, 0), "{st:?}");
    let dl: u64 = redis::cmd("XLEN")
        .arg(lanekeeper::store::keys::dead_letters(&prefix, "flood"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dl, 100_000);
    let page = s.dead_letters(Q, "flood", None, 2).await.unwrap();
    assert_eq!(page.letters[0].cause, "purged");
    assert_eq!(page.letters[0].id, "flood-0");
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(l.tenant, "small", "the other tenant is served");
    s.ack(&l, Duration::from_millis(1)).await.unwrap();

    let started = Instant::now();
    let r = s
        .replay_audited("flood", &ReplayPlan::default(), "test:ops", None)
        .await
        .unwrap();
    let replay_took = started.elapsed();
    assert_eq!(
        (r.replayed, r.examined, r.next.as_deref()),
        (100_000, 100_000, None),
        "{r:?}"
    );
    // oldest first: the lane holds them in their original order
    let lane = lanekeeper::store::keys::lane(&prefix, "flood");
    for from in (0..100_000).step_by(10_000) {
        let ids: Vec<String> = redis::cmd("LRANGE")
            .arg(&lane)
            .arg(from)
            .arg(from + 9_999)
            .query_async(&mut conn)
            .await
            .unwrap();
        let want: Vec<String> = (from..from + 10_000)
            .map(|i| format!("flood-{i}"))
            .collect();
        assert_eq!(ids, want, "order from {from}");
    }
    assert_eq!(s.tenant_state(Q, "flood").await.unwrap().depth, 100_000);

    let started = Instant::now();
    let d = s
        .purge_audited("flood", PurgeMode::Drop, "test:ops", None)
        .await
        .unwrap();
    let drop_took = started.elapsed();
    assert_eq!(d.purged, 100_000);
    let dl: u64 = redis::cmd("XLEN")
        .arg(lanekeeper::store::keys::dead_letters(&prefix, "flood"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        dl, 0,
        "replayed letters left the stream, dropped ones never entered it"
    );
    let worst = slowest_call_naming(&mut conn, &prefix, since).await;
    let audit = s.audit_entries(Some("flood"), 10).await.unwrap();
    let ops: Vec<&str> = audit.iter().map(|e| e.operation.as_str()).collect();
    assert_eq!(ops, vec!["purge", "replay", "purge"]);
    assert!(
        audit[2].outcome.contains("reason: runaway import"),
        "{:?}",
        audit[2]
    );
    eprintln!(
        "100000 envelopes: purged to dead letters in {purge_took:?}, replayed in {replay_took:?}, dropped in {drop_took:?}; slowest Redis call of the queue {worst} us (0: none over 1 ms)"
    );
    assert!(worst < 10_000, "a Redis call took {worst} us");
}

/// A replay takes the letters of a time range or of one endpoint only, and
/// holds its rate; a purge while the tenant moves is refused, changing nothing.
#[tokio::test]
async fn replay_filters_by_time_and_endpoint_and_holds_its_rate() {
    use lanekeeper::store::{PurgeMode, ReplayFilter, ReplayPlan};
    let s = store(QueuePolicy::default()).await;
    s.set_shards(1).await.unwrap();
    let to = |ep: &str, i: u64| Envelope {
        endpoint: Some(ep.to_string()),
        id: format!("{ep}-{i}"),
        ..env("acme", i)
    };
    let batch = |ep: &'static str, from: u64, n: u64| {
        (from..from + n).map(move |i| to(ep, i)).collect::<Vec<_>>()
    };
    for e in batch("a", 0, 10).into_iter().chain(batch("b", 100, 10)) {
        s.enqueue(Q, &e).await.unwrap();
    }
    s.purge_tenant("acme", PurgeMode::DeadLetter).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t2 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for e in batch("a", 200, 300) {
        s.enqueue(Q, &e).await.unwrap();
    }
    s.purge_tenant("acme", PurgeMode::DeadLetter).await.unwrap();

    // until before t2, to endpoint b: the ten of b
    let plan = ReplayPlan {
        filter: ReplayFilter {
            until_ms: Some(t2 - 1),
            endpoint: Some("b".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let r = s.replay_tenant("acme", &plan).await.unwrap();
    assert_eq!((r.replayed, r.examined), (10, 20), "{r:?}");
    let got: Vec<u64> = support::dataplane::drain_order(&s, Q)
        .await
        .into_iter()
        .map(|x| x.1)
        .collect();
    assert_eq!(got, (100..110).collect::<Vec<_>>());

    // since t2, at 100/s: the 300, in order, at the rate
    let plan = ReplayPlan {
        filter: ReplayFilter {
            since_ms: Some(t2),
            ..Default::default()
        },
        max_per_second: Some(100.0),
        ..Default::default()
    };
    let started = Instant::now();
    let r = s.replay_tenant("acme", &plan).await.unwrap();
    let took = started.elapsed();
    assert_eq!(r.replayed, 300, "{r:?}");
    let rate = 300.0 / took.as_secs_f64();
    eprintln!("replayed 300 at a limit of 100/s in {took:?}: {rate:.1}/s");
    assert!((85.0..=115.0).contains(&rate), "{rate:.1}/s");
    let got: Vec<u64> = support::dataplane::drain_order(&s, Q)
        .await
        .into_iter()
        .map(|x| x.1)
        .collect();
    assert_eq!(got, (200..500).collect::<Vec<_>>());

    // what is left: the ten of a before t2
    let r = s
        .replay_tenant("acme", &ReplayPlan::default())
        .await
        .unwrap();
    assert_eq!(r.replayed, 10);

    // a budget stops with a cursor, and the cursor goes on
    s.purge_tenant("acme", PurgeMode::DeadLetter).await.unwrap();
    let plan = ReplayPlan {
        max_per_second: Some(20.0),
        budget: Some(Duration::from_millis(150)),
        ..Default::default()
    };
    let first = s.replay_tenant("acme", &plan).await.unwrap();
    assert!(first.next.is_some() && first.replayed < 10, "{first:?}");
    let rest = s
        .replay_tenant(
            "acme",
            &ReplayPlan {
                after: first.next.clone(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(first.replayed + rest.replayed, 10, "{first:?} {rest:?}");

    // a purge while the tenant is being moved is refused, nothing changes
    s.pause(Q, "acme").await.unwrap();
    let before = s.tenant_state(Q, "acme").await.unwrap();
    let err = s.purge_tenant("acme", PurgeMode::Drop).await.unwrap_err();
    assert!(matches!(err, StoreError::TenantMoving(_)), "{err}");
    assert_eq!(s.tenant_state(Q, "acme").await.unwrap(), before);
}

/// A policy that sweeps tenants idle for a second and remembers ids for a
/// second (so claims leave the window two seconds after the last one).
fn sweeping() -> QueuePolicy {
    QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(1)),
        idempotency_window: Duration::from_secs(1),
        ..QueuePolicy::default()
    }
}

/// Sweep steps of `count` until one ends a pass (a pass not yet due is
/// waited for). Returns what the pass swept and the slowest step.
async fn sweep_pass(s: &Store, count: u32) -> (u64, Duration) {
    let (mut swept, mut slowest) = (0, Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let started = Instant::now();
        let step = s.sweep(Q, count).await.unwrap();
        slowest = slowest.max(started.elapsed());
        swept += step.swept;
        if step.pass_ended {
            return (swept, slowest);
        }
        assert!(Instant::now() < deadline, "no sweep pass ended in 30 s");
        if step.waiting {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn is_member(conn: &mut redis::aio::MultiplexedConnection, set: &str, m: &str) -> bool {
    redis::cmd("SISMEMBER")
        .arg(set)
        .arg(m)
        .query_async(conn)
        .await
        .unwrap()
}

async fn exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_sweep_forgets_only_idle_tenants_in_each_queue() {
    support::dataplane::the_sweep_forgets_only_idle_tenants(&support::redis::shared().url).await;
}

/// Issue 21, item 5: a tenant with no work and no traffic for the idle time
/// loses its per-queue state; one with anything still to do or to remember
/// (queued, in flight, paused by a user, dead letters) keeps it, and the
/// swept one starts afresh when it sends again.
#[tokio::test]
async fn the_sweep_deletes_idle_tenants_and_keeps_every_one_with_something_left() {
    use lanekeeper::store::{keys, PurgeMode};
    let s = store(sweeping()).await;
    s.set_shards(1).await.unwrap();
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    // gone: delivered; paused: delivered then paused by a user; dead: its
    // envelope purged to its dead letters; inflight: leased, not acked;
    // queued: waiting.
    for t in ["gone", "paused", "dead"] {
        s.enqueue(Q, &env(t, 0)).await.unwrap();
    }
    s.purge_tenant("dead", PurgeMode::DeadLetter).await.unwrap();
    for _ in 0..2 {
        let l = lease(&s, Q).await.unwrap();
        // no worker time: the attribution buckets (bounded by time, not
        // swept) then hold nothing of these two
        s.ack(&l, Duration::ZERO).await.unwrap();
    }
    s.set_user_pause("paused", true).await.unwrap();
    s.enqueue(Q, &env("inflight", 0)).await.unwrap();
    let held = lease(&s, Q).await.unwrap();
    assert_eq!(held.tenant, "inflight");
    s.enqueue(Q, &env("queued", 0)).await.unwrap();
    let (swept, _) = sweep_pass(&s, 100).await;
    assert_eq!(swept, 0, "nothing has been idle for a second yet");

    // past the idle time and out of the id window (two periods of 1 s)
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let (swept, _) = sweep_pass(&s, 100).await;
    assert_eq!(swept, 1, "only the delivered tenant is idle");
    assert!(!exists(&mut conn, &keys::tenant(&p, "gone")).await);
    assert!(!is_member(&mut conn, &keys::tenants(&p), "gone").await);
    let claims: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{p}:ids:*:gone"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(claims.is_empty(), "stale claims left behind: {claims:?}");
    for t in ["paused", "dead", "inflight", "queued"] {
        assert!(exists(&mut conn, &keys::tenant(&p, t)).await, "{t} swept");
        assert!(is_member(&mut conn, &keys::tenants(&p), t).await, "{t}");
    }
    let stats = s.tenant_stats(Q, Duration::from_secs(1)).await.unwrap();
    assert!(
        stats.iter().all(|t| t.tenant != "gone"),
        "top no longer lists the swept tenant: {stats:?}"
    );
    assert_eq!(
        s.dead_letters(Q, "dead", None, 10)
            .await
            .unwrap()
            .letters
            .len(),
        1
    );
    assert!(s.tenant_state(Q, "paused").await.unwrap().user_paused);

    // the swept tenant sends again: a fresh start, delivered as ever
    assert!(matches!(
        s.enqueue(Q, &env("gone", 1)).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
    s.ack(&held, Duration::from_millis(5)).await.unwrap();
    let mut got = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        got.push(l.tenant.clone());
        s.ack(&l, Duration::from_millis(5)).await.unwrap();
    }
    got.sort();
    assert_eq!(got, vec!["gone", "queued"]);
    assert_eq!(s.tenant_state(Q, "gone").await.unwrap().depth, 0);
}

/// The sweep must not forget ids a producer may still resend: a tenant idle
/// past the sweep time whose claims are still inside the idempotency window
/// keeps them, and its resend is still a duplicate.
#[tokio::test]
async fn the_sweep_keeps_a_tenant_whose_ids_are_still_remembered() {
    let s = store(QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(1)),
        idempotency_window: Duration::from_secs(3600),
        ..QueuePolicy::default()
    })
    .await;
    let e = env("recent", 0);
    s.enqueue(Q, &e).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    s.ack(&l, Duration::from_millis(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (swept, _) = sweep_pass(&s, 100).await;
    assert_eq!(swept, 0);
    assert_eq!(s.enqueue(Q, &e).await.unwrap(), EnqueueOutcome::Duplicate);
}

/// A tenant that keeps working is never swept however old its last enqueue:
/// a sweep that finds it busy marks it active now.
#[tokio::test]
async fn a_busy_tenant_is_marked_active_and_never_swept() {
    use lanekeeper::store::keys;
    let s = store(QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(2)),
        idempotency_window: Duration::from_secs(1),
        ..QueuePolicy::default()
    })
    .await;
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    fill(&s, Q, "slow", 2).await;
    // its last enqueue was long ago
    let _: () = redis::cmd("HSET")
        .arg(keys::tenant(&p, "slow"))
        .arg("la")
        .arg(1)
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2200)).await;
    assert_eq!(sweep_pass(&s, 100).await.0, 0);
    let la: u64 = redis::cmd("HGET")
        .arg(keys::tenant(&p, "slow"))
        .arg("la")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(la > 1, "the sweep marked the busy tenant active");
    // it drains; at the next pass (a second later) it had work within the
    // idle time; once that is over it goes
    while let Some(l) = lease(&s, Q).await {
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    assert_eq!(sweep_pass(&s, 100).await.0, 0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(sweep_pass(&s, 100).await.0, 1);
}

/// State written behind the scripts' back neither fails a sweep step (so
/// one bad key cannot stop the queue's sweep) nor gets a tenant swept that
/// it cannot read: a tenant key of the wrong type, counters that are not
/// numbers, a last-activity time in the future.
#[tokio::test]
async fn the_sweep_survives_hostile_state_and_deletes_only_what_it_can_read() {
    use lanekeeper::store::keys;
    let s = store(sweeping()).await;
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    let _: () = redis::cmd("SADD")
        .arg(keys::tenants(&p))
        .arg(&["wrongtype", "garbage", "future", "ghost"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(keys::tenant(&p, "wrongtype"))
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys::tenant(&p, "garbage"))
        .arg(&["n", "nan", "f", "-", "la", "1", "ip", "zz"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys::tenant(&p, "future"))
        .arg(&["la", "99999999999999", "ip", "-5"])
        .query_async(&mut conn)
        .await
        .unwrap();
    // "ghost" is listed with no state at all
    tokio::time::sleep(Duration::from_millis(1100)).await;
    sweep_pass(&s, 100).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (swept, _) = sweep_pass(&s, 100).await;
    assert_eq!(swept, 2, "future (restamped, then idle) and ghost");
    let _: () = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert!(exists(&mut conn, &keys::tenant(&p, "wrongtype")).await);
    assert!(exists(&mut conn, &keys::tenant(&p, "garbage")).await);
    assert!(!exists(&mut conn, &keys::tenant(&p, "future")).await);
    assert!(!is_member(&mut conn, &keys::tenants(&p), "ghost").await);
}

/// Issue 21, item 5: 100,000 distinct tenants each send once, are delivered
/// and go idle; the sweep gives back the memory they took, in the workers'
/// steps, bounded in what each costs Redis (see the bound at the end). A
/// Redis of its own, so no other
/// test's keys move `used_memory` (taken without the script VMs' heaps,
/// which Redis 7.4 and later count in it).
#[tokio::test]
async fn redis_memory_is_flat_after_100000_tenants_send_once_and_go_idle() {
    let _heavy = HEAVY.lock().await;
    use lanekeeper::store::keys;
    let redis = support::redis::dedicated();
    let s = support::dataplane::store(&redis.url, sweeping()).await;
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let p = s.queue_prefix(Q);
    let used = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut c = conn.clone();
        async move {
            let _: () = redis::cmd("MEMORY")
                .arg("PURGE")
                .query_async(&mut c)
                .await
                .unwrap();
            let info: String = redis::cmd("INFO")
                .arg("server")
                .arg("memory")
                .query_async(&mut c)
                .await
                .unwrap();
            let field = |k: &str| {
                support::redis::info_field(&info, k).unwrap_or_else(|| panic!("INFO has no {k}"))
            };
            let used: i64 = field("used_memory").parse().unwrap();
            // Since Redis 7.4 `used_memory` counts the script VMs' heaps too
            // (redis#13133), which Lua's collector bounds and which are
            // not the tenants' state; earlier versions leave them out.
            let version: Vec<u32> = field("redis_version")
                .split('.')
                .map(|n| n.parse().unwrap())
                .collect();
            if version[..2] >= [7, 4][..] {
                used - field("used_memory_vm_total").parse::<i64>().unwrap()
            } else {
                used
            }
        }
    };
    const N: u64 = 100_000;
    // A first round of 1,000 tenants through the whole cycle (the library
    // loaded, the queue's keys made, the sweep run, the buckets expired):
    // what a queue in service holds before the 100,000 come.
    {
        let envs: Vec<Envelope> = (0..1000).map(|i| env(&format!("warm{i}"), 0)).collect();
        s.enqueue_batch(Q, &envs).await.unwrap();
        while let Some(l) = lease(&s, Q).await {
            s.ack(&l, Duration::from_micros(300)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2200)).await;
        assert_eq!(sweep_pass(&s, SWEEP_STEP).await.0, 1000);
        let buckets: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{p}:wsu:*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        for b in &buckets {
            let _: () = redis::cmd("DEL")
                .arg(b)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        // the next pass may start at once
        let _: () = redis::cmd("HDEL")
            .arg(keys::conf(&p))
            .arg("swn")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let baseline = used(&mut conn).await;
    let envs: Vec<Envelope> = (0..N).map(|i| env(&format!("t{i:06}"), 0)).collect();
    for chunk in envs.chunks(5000) {
        for r in s.enqueue_batch(Q, chunk).await.unwrap() {
            assert!(matches!(r.unwrap(), EnqueueOutcome::Queued { .. }));
        }
    }
    let queued = used(&mut conn).await;
    let mut delivered = 0;
    let mut l = lease(&s, Q).await;
    while let Some(done) = l {
        delivered += 1;
        let (_, next) = s
            .ack_and_lease(&done, Duration::from_micros(300), "w1", LEASE)
            .await
            .unwrap();
        l = match next {
            LeaseOutcome::Leased(n) => Some(n),
            _ => lease(&s, Q).await,
        };
    }
    assert_eq!(delivered, N);
    let idle = used(&mut conn).await;
    let since = slowlog_from_1ms(&mut conn).await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let started = Instant::now();
    let (swept, slowest_step) = sweep_pass(&s, SWEEP_STEP).await;
    let took = started.elapsed();
    assert_eq!(swept, N);
    let slow = slow_calls_naming(&mut conn, &p, since).await;
    let worst_us = slow.first().copied().unwrap_or(0);
    let over_10ms = slow.iter().filter(|&&us| us >= 10_000).count();
    // The slow log is this test's instrument, not the tenants' state: with
    // its 1 ms threshold it holds the arguments of every slower sweep step
    // (hundreds of KiB on a loaded machine), so it goes before measuring.
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(&mut conn)
        .await
        .unwrap();
    // let Redis's cron shrink the emptied hash tables
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let swept_used = used(&mut conn).await;
    // The attribution buckets are bounded by time, not by tenants: each
    // expires two hours after its first write, whatever the sweep does.
    // Delete them as their TTL will, to see what is left of the tenants.
    let buckets: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{p}:wsu:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    for b in &buckets {
        let ttl: i64 = redis::cmd("TTL")
            .arg(b)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!((0..=7200).contains(&ttl), "{b} ttl {ttl}");
        let _: () = redis::cmd("DEL")
            .arg(b)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let after = used(&mut conn).await;
    let bucket_bytes = swept_used - after;
    let tenants: u64 = redis::cmd("SCARD")
        .arg(keys::tenants(&p))
        .query_async(&mut conn)
        .await
        .unwrap();
    let left_keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mib = |b: i64| b as f64 / (1 << 20) as f64;
    let grown = idle - bucket_bytes - baseline;
    let left = after - baseline;
    eprintln!(
        "sweep of {N} idle tenants: used_memory baseline {:.2} MiB, queued {:.2} MiB, \
         delivered and idle {:.2} MiB (of which attribution buckets {:.2} MiB, expiring by TTL), \
         swept {:.2} MiB, swept and buckets expired {:.2} MiB; tenants' state above baseline: \
         before the sweep {:.2} MiB, after {:.3} MiB; pass {took:.2?} in steps of {SWEEP_STEP}, \
         slowest step {slowest_step:.2?} round trip, slowest Redis call {worst_us} us ({over_10ms} over 10 ms); \
         {tenants} tenants left, keys left {left_keys:?}",
        mib(baseline),
        mib(queued),
        mib(idle),
        mib(bucket_bytes),
        mib(swept_used),
        mib(after),
        mib(grown),
        mib(left),
    );
    assert_eq!(tenants, 0);
    // Each step is bounded (SWEEP_STEP tenants), so a step costs Redis a
    // few ms; an unbounded one (the whole set) would take seconds, and
    // steps of too many tenants would all be slow. The bound allows for a
    // step stalled by the machine (a 2-core VM showed one or two steps of
    // 10 to 31 ms among 2,000 of under 4 ms, run alone): at most 1% of the
    // steps (at least N / SWEEP_STEP of them) over 10 ms, none over 100 ms.
    let steps = N / SWEEP_STEP as u64;
    assert!(
        worst_us < 100_000 && (over_10ms as u64) * 100 <= steps,
        "sweep steps too slow in Redis: {over_10ms} of at least {steps} over 10 ms, the slowest {worst_us} us ({slow:?})"
    );
    assert!(
        left < grown / 50 && left < 256 << 10,
        "the sweep gave back too little: {left} bytes left of {grown}"
    );
    support::redis::kill(&redis);
}

/// Attacks from the review of the sweep (each failed before its fix):
/// a cursor or next-pass time in `P:conf` that would stop the sweep for
/// good; a rate-limited tenant whose bucket is not yet full again (sweeping
/// it would refill it), and one whose endpoint's is, in its state's slot; a tenant whose dead letters are all gone but whose
/// empty stream stays; a swept tenant paused afterwards must be listed
/// among the queue's residents so a reshard carries its pause.
#[tokio::test]
async fn the_sweep_is_not_wedged_by_its_own_state_and_keeps_what_a_reset_would_give_away() {
    use lanekeeper::policy::{RateLimit, RateLimits};
    use lanekeeper::store::keys;
    let mut policy = sweeping();
    policy.rate_limits = RateLimits {
        tenants: [
            (
                "limited".to_string(),
                RateLimit {
                    per_second: 0.001,
                    burst: 5.0,
                    ..Default::default()
                },
            ),
            (
                "endpoint-limited".to_string(),
                RateLimit {
                    endpoint_per_second: 0.001,
                    endpoint_burst: 5.0,
                    ..Default::default()
                },
            ),
        ]
        .into(),
        ..Default::default()
    };
    let s = store(policy).await;
    s.set_shards(1).await.unwrap();
    let p = s.queue_prefix(Q);
    let mut conn = raw_conn().await;
    // limited: spends a token of a bucket that refills in 1000 s
    s.enqueue(Q, &env("limited", 0)).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    s.ack(&l, Duration::ZERO).await.unwrap();
    // endpoint-limited: the same of its endpoint's bucket, kept in the
    // tenant's state (its slot, see endpoint_gate)
    let mut e = env("endpoint-limited", 0);
    e.endpoint = Some("main".into());
    s.enqueue(Q, &e).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    s.ack(&l, Duration::ZERO).await.unwrap();
    // emptied: a dead letter, then replayed and delivered
    s.enqueue(Q, &env("emptied", 0)).await.unwrap();
    s.purge_tenant("emptied", lanekeeper::store::PurgeMode::DeadLetter)
        .await
        .unwrap();
    s.replay_tenant("emptied", &Default::default())
        .await
        .unwrap();
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(l.tenant, "emptied");
    s.ack(&l, Duration::ZERO).await.unwrap();
    // a cursor above 2^64 and a next pass in the year 10^292
    let _: () = redis::cmd("HSET")
        .arg(keys::conf(&p))
        .arg(&["swc", "99999999999999999999", "swn", "1e300"])
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let (swept, _) = sweep_pass(&s, 100).await;
    assert_eq!(swept, 1, "only the tenant with an emptied stream goes");
    assert!(!exists(&mut conn, &keys::tenant(&p, "emptied")).await);
    assert!(!exists(&mut conn, &keys::dead_letters(&p, "emptied")).await);
    assert!(exists(&mut conn, &keys::tenant(&p, "limited")).await);
    assert!(exists(&mut conn, &keys::tenant(&p, "endpoint-limited")).await);

    // a swept tenant paused afterwards is a resident again
    s.set_user_pause("emptied", true).await.unwrap();
    assert!(s
        .residents(Q)
        .await
        .unwrap()
        .contains(&"emptied".to_string()));
    // and a tenant never seen here, paused ahead of its first event
    s.set_user_pause("newcomer", true).await.unwrap();
    assert!(s
        .residents(Q)
        .await
        .unwrap()
        .contains(&"newcomer".to_string()));
}

/// Issue 21, item 2: a tenant's own in-flight cap (`spec.tenants[].maxInFlight`)
/// holds at lease, at the parked tenant's rejoin on ack and on release,
/// leaves the other tenants on the queue's cap, is dropped when the
/// override goes, and gives way to strict order. A hostile stored cap is
/// ignored, not obeyed.
#[tokio::test]
async fn a_tenants_own_in_flight_cap_holds_and_the_others_keep_the_queues() {
    use lanekeeper::store::keys;
    let with_caps = |caps: &[(&str, u32)]| QueuePolicy {
        max_in_flight: 2,
        caps: caps.iter().map(|(t, c)| (t.to_string(), *c)).collect(),
        ..Default::default()
    };
    let s = store(with_caps(&[("vip", 5), ("tight", 1)])).await;
    for t in ["vip", "tight", "plain"] {
        fill(&s, Q, t, 10).await;
    }
    let mut held = Vec::new();
    while let Some(l) = lease(&s, Q).await {
        held.push(l);
    }
    let count =
        |held: &[lanekeeper::store::Lease], t: &str| held.iter().filter(|l| l.tenant == t).count();
    assert_eq!(
        (
            count(&held, "vip"),
            count(&held, "tight"),
            count(&held, "plain")
        ),
        (5, 1, 2),
        "own caps 5 and 1, the queue's 2"
    );
    // an ack frees a slot: the parked tenant rejoins under its own cap
    let i = held.iter().position(|l| l.tenant == "vip").unwrap();
    s.ack(&held.remove(i), Duration::from_millis(1))
        .await
        .unwrap();
    let next = lease(&s, Q).await.expect("vip rejoins");
    assert_eq!(next.tenant, "vip");
    assert!(lease(&s, Q).await.is_none());
    held.push(next);
    // a release does the same
    let i = held.iter().position(|l| l.tenant == "tight").unwrap();
    s.release(&held.remove(i)).await.unwrap();
    let next = lease(&s, Q).await.expect("tight rejoins");
    assert_eq!(next.tenant, "tight");
    held.push(next);

    // a hostile cap in Redis is ignored: the queue's cap holds
    let mut conn = raw_conn().await;
    let _: () = redis::cmd("HSET")
        .arg(keys::caps(&s.queue_prefix(Q)))
        .arg(&["plain", "1e9"])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(lease(&s, Q).await.is_none(), "plain stays at the queue's 2");

    // the override removed: vip is back on the queue's cap of 2
    s.configure_queue(Q, &with_caps(&[])).await.unwrap();
    for l in held.drain(..) {
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    while let Some(l) = lease(&s, Q).await {
        held.push(l);
    }
    assert_eq!(
        count(&held, "vip"),
        2,
        "{:?}",
        held.iter().map(|l| &l.tenant).collect::<Vec<_>>()
    );
    // strict order: one each, whatever the caps say
    let ordered = QueuePolicy {
        ordered: true,
        ..with_caps(&[("vip", 5)])
    };
    s.configure_queue(Q, &ordered).await.unwrap();
    for l in held.drain(..) {
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    while let Some(l) = lease(&s, Q).await {
        held.push(l);
    }
    assert_eq!(count(&held, "vip"), 1);
}

// ---- endpoint isolation (tests/support/bodies/isolation.rs) ----

#[tokio::test]
async fn a_slow_endpoint_does_not_hold_back_its_tenants_fast_one() {
    support::isolation::a_slow_endpoint_does_not_hold_back_its_tenants_fast_one(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn a_tenants_endpoints_share_its_worker_seconds() {
    support::isolation::a_tenants_endpoints_share_its_worker_seconds(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn many_endpoints_do_not_buy_a_tenant_more_of_the_queue() {
    support::isolation::many_endpoints_do_not_buy_a_tenant_more_of_the_queue(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn a_broken_or_paced_endpoint_is_parked_alone() {
    support::isolation::a_broken_or_paced_endpoint_is_parked_alone(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn strict_order_holds_per_endpoint() {
    support::isolation::strict_order_holds_per_endpoint(&support::redis::shared().url).await;
}

#[tokio::test]
async fn reaps_releases_and_lost_records_free_endpoint_slots() {
    support::isolation::reaps_releases_and_lost_records_free_endpoint_slots(
        &support::redis::shared().url,
    )
    .await;
}

#[tokio::test]
async fn a_move_keeps_each_endpoints_order_under_endpoint_isolation() {
    support::isolation::a_move_keeps_each_endpoints_order(&support::redis::shared().url).await;
}

#[tokio::test]
async fn purge_replay_and_sweep_follow_the_endpoint_lanes() {
    support::isolation::purge_replay_and_sweep_follow_the_endpoint_lanes(
        &support::redis::shared().url,
    )
    .await;
}

// ---- batched lease and ack (k = 16) -----------------------------------

#[tokio::test]
async fn a_batch_serves_the_tenants_k_single_leases_would() {
    support::batch::a_batch_serves_the_tenants_k_single_leases_would(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn a_batch_leaves_the_state_k_single_calls_leave() {
    support::batch::a_batch_leaves_the_state_k_single_calls_leave(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn fairness_in_worker_seconds_holds_in_batches() {
    support::batch::fairness_in_worker_seconds_holds_in_batches(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn weights_hold_in_batches() {
    support::batch::weights_hold_in_batches(&support::redis::shared().url).await;
}

#[tokio::test]
async fn a_malformed_call_fails_before_its_first_write() {
    support::batch::a_malformed_call_fails_before_its_first_write(&support::redis::shared().url)
        .await;
}

#[tokio::test]
async fn a_hostile_batch_settles_nothing_twice() {
    support::batch::a_hostile_batch_settles_nothing_twice(&support::redis::shared().url).await;
}

#[tokio::test]
async fn a_batch_scans_no_more_than_one_lease_may() {
    support::batch::a_batch_scans_no_more_than_one_lease_may(&support::redis::shared().url).await;
}

#[tokio::test]
async fn a_garbage_attribution_field_fails_no_ack() {
    support::batch::a_garbage_attribution_field_fails_no_ack(&support::redis::shared().url).await;
}

// ---- queue health: time to drain and fairness (what the controller exports)

#[tokio::test]
async fn drain_time_follows_a_whales_backlog() {
    support::health::drain_time_follows_a_whales_backlog(&support::redis::shared().url).await;
}

#[tokio::test]
async fn fairness_falls_when_the_cap_lets_one_tenant_take_every_slot() {
    support::health::fairness_falls_when_the_cap_lets_one_tenant_take_every_slot(
        &support::redis::shared().url,
    )
    .await;
}
