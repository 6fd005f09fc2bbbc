//! Store-integrity test bodies (issue 17), shared by the single-server tests
//! (`tests/integrity.rs`) and the Redis Cluster tests (`tests/cluster.rs`):
//! each takes the Redis URL. Every one is an attack that broke an earlier
//! version: a tenant acting on another's envelopes, a replay that lost what
//! it replayed, a record gone behind the store's back.

use std::time::Duration;

use lanekeeper::envelope::Envelope;
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{keys, EnqueueOutcome, Failure, NackOutcome, Store};

use crate::support::dataplane::{lease, store, LEASE, Q};

pub const LANE: QueueId = QueueId::Lane(0);

/// An envelope of `tenant` with a chosen id and a payload naming its owner.
pub fn named(tenant: &str, id: &str) -> Envelope {
    Envelope {
        id: id.to_string(),
        tenant: tenant.to_string(),
        endpoint: Some("main".into()),
        event_type: Some("test.event".into()),
        payload: serde_json::json!({ "owner": tenant, "id": id }),
    }
}

fn owner(l: &lanekeeper::store::Lease) -> String {
    l.envelope().unwrap().payload["owner"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Move `tenant` from `from` to `to` with the relocation primitives, in
/// the order the controller runs them. Panics unless it is drained.
pub async fn relocate(s: &Store, from: QueueId, to: QueueId, tenant: &str) -> u64 {
    s.pause(from, tenant).await.unwrap();
    s.pause(to, tenant).await.unwrap();
    assert!(
        s.mark_moved(from, tenant, to).await.unwrap(),
        "{tenant} is not drained in {from}"
    );
    let n = s.move_hold(from, to, tenant).await.unwrap();
    s.resume(to, tenant).await.unwrap();
    n
}

/// Drain everything leasable from `q`, acking each; returns (tenant, id, owner).
pub async fn drain(s: &Store, q: QueueId) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    while let Some(l) = lease(s, q).await {
        out.push((l.tenant.clone(), l.id.clone(), owner(&l)));
        assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    }
    out
}

/// Two tenants of one queue using the same id are two envelopes: neither
/// suppresses the other, each is delivered with its own payload, and each
/// one's retry is still its own duplicate.
pub async fn same_id_in_two_tenants_is_two_envelopes(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    for t in ["alpha", "beta"] {
        assert!(
            matches!(
                s.enqueue(Q, &named(t, "order-1001")).await.unwrap(),
                EnqueueOutcome::Queued { .. }
            ),
            "{t}'s order-1001 was not queued"
        );
    }
    for t in ["alpha", "beta"] {
        assert_eq!(
            s.enqueue(Q, &named(t, "order-1001")).await.unwrap(),
            EnqueueOutcome::Duplicate
        );
    }
    let mut got = drain(&s, Q).await;
    got.sort();
    assert_eq!(
        got,
        vec![
            ("alpha".into(), "order-1001".into(), "alpha".into()),
            ("beta".into(), "order-1001".into(), "beta".into()),
        ]
    );
}

/// The worker takes the tenant from the lease: a stored payload that names
/// another tenant (a bug, a hand edit) cannot make it act for that tenant.
pub async fn the_lease_not_the_payload_names_the_tenant(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let mut forged = named("mallory", "x-1");
    forged.payload = serde_json::json!({ "owner": "mallory" });
    s.enqueue(Q, &forged).await.unwrap();
    let payload = serde_json::json!({ "id": "victim-7", "tenant": "victim", "payload": {} });
    super::stored::Conn::open(url)
        .await
        .set_payload(&s.queue_prefix(Q), "mallory", "x-1", &payload.to_string())
        .await;
    let l = lease(&s, Q).await.unwrap();
    let env = l.envelope().unwrap();
    assert_eq!((env.tenant.as_str(), env.id.as_str()), ("mallory", "x-1"));
}

/// During a move, a held envelope of one tenant whose id another tenant
/// already used in the target queue arrives in the target (it was skipped
/// by the import and trimmed from the source: accepted, then gone).
pub async fn a_move_keeps_envelopes_whose_id_another_tenant_used(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    s.configure_queue(LANE, &QueuePolicy::default())
        .await
        .unwrap();
    // beta used order-7 in the target first
    s.enqueue(LANE, &named("beta", "order-7")).await.unwrap();
    s.pause(Q, "alpha").await.unwrap();
    assert!(matches!(
        s.enqueue(Q, &named("alpha", "order-7")).await.unwrap(),
        EnqueueOutcome::Held { .. }
    ));
    assert_eq!(relocate(&s, Q, LANE, "alpha").await, 1);
    let mut got = drain(&s, LANE).await;
    got.sort();
    assert_eq!(
        got,
        vec![
            ("alpha".into(), "order-7".into(), "alpha".into()),
            ("beta".into(), "order-7".into(), "beta".into()),
        ]
    );
    assert_eq!(s.tenant_state(Q, "alpha").await.unwrap().depth, 0);
}

/// After a move, a producer's retry of an id delivered before it is still a
/// duplicate: the claims travel with the tenant, including ids claimed
/// while the tenant was paused for the move.
pub async fn idempotency_survives_a_move(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    s.configure_queue(LANE, &QueuePolicy::default())
        .await
        .unwrap();
    let ids: Vec<String> = (0..2500).map(|i| format!("evt-{i}")).collect();
    let envs: Vec<Envelope> = ids.iter().map(|id| named("mover", id)).collect();
    s.enqueue_batch(Q, &envs).await.unwrap();
    assert_eq!(drain(&s, Q).await.len(), 2500);
    s.pause(Q, "mover").await.unwrap();
    // accepted while paused, before the mark: held in the source
    assert!(matches!(
        s.enqueue(Q, &named("mover", "late-1")).await.unwrap(),
        EnqueueOutcome::Held { .. }
    ));
    assert_eq!(relocate(&s, Q, LANE, "mover").await, 1);
    for id in ids
        .iter()
        .step_by(97)
        .chain(std::iter::once(&"late-1".to_string()))
    {
        assert_eq!(
            s.enqueue(LANE, &named("mover", id)).await.unwrap(),
            EnqueueOutcome::Duplicate,
            "{id} was accepted again after the move"
        );
    }
    // and a new id is still new
    assert!(matches!(
        s.enqueue(LANE, &named("mover", "evt-new")).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
    let got = drain(&s, LANE).await;
    assert_eq!(
        got.iter().map(|g| g.1.as_str()).collect::<Vec<_>>(),
        vec!["late-1", "evt-new"]
    );
}

/// Ids claimed in the source while the claims are being copied (between the
/// copy's start and the mark) travel too: the mark is set only when none is
/// left uncopied.
pub async fn claims_made_during_the_copy_travel_too(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    s.configure_queue(LANE, &QueuePolicy::default())
        .await
        .unwrap();
    s.pause(Q, "mover").await.unwrap();
    s.pause(LANE, "mover").await.unwrap();
    // The copy begins (as mark_moved's first step does) ...
    let mut conn = raw(url).await;
    let prefix = s.queue_prefix(Q);
    let _: () = redis::cmd("HSET")
        .arg(keys::tenant(&prefix, "mover"))
        .arg("xc")
        .arg("1")
        .query_async(&mut conn)
        .await
        .unwrap();
    // ... and an id is claimed in the source meanwhile
    assert!(matches!(
        s.enqueue(Q, &named("mover", "during")).await.unwrap(),
        EnqueueOutcome::Held { .. }
    ));
    assert!(s.mark_moved(Q, "mover", LANE).await.unwrap());
    assert_eq!(
        s.enqueue(LANE, &named("mover", "during")).await.unwrap(),
        EnqueueOutcome::Duplicate
    );
    assert_eq!(s.move_hold(Q, LANE, "mover").await.unwrap(), 1);
}

/// Replaying 10,000 dead letters (Lua cannot unpack more than about 8,000
/// values: the old script failed after its writes and lost every letter)
/// puts every one back, in order, and the depth is right.
pub async fn replaying_ten_thousand_dead_letters_loses_none(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let n = 10_000usize;
    let envs: Vec<Envelope> = (0..n)
        .map(|i| named("outage", &format!("e{i:05}")))
        .collect();
    s.enqueue_batch(Q, &envs).await.unwrap();
    dead_letter_all(&s, Q).await;
    assert_eq!(s.tenant_state(Q, "outage").await.unwrap().depth, 0);
    assert_eq!(s.replay_dead(Q, "outage", &[]).await.unwrap(), Ok(n as u64));
    assert_eq!(s.tenant_state(Q, "outage").await.unwrap().depth, n as u64);
    let page = s.dead_letters(Q, "outage", None, 10).await.unwrap();
    assert!(page.letters.is_empty(), "{page:?}");
    let got = drain(&s, Q).await;
    let ids: Vec<&str> = got.iter().map(|g| g.1.as_str()).collect();
    let want: Vec<String> = (0..n).map(|i| format!("e{i:05}")).collect();
    assert_eq!(ids, want.iter().map(|s| s.as_str()).collect::<Vec<_>>());
}

/// Lease and dead-letter everything leasable in `q`.
pub async fn dead_letter_all(s: &Store, q: QueueId) -> usize {
    let mut n = 0;
    while let Some(l) = lease(s, q).await {
        let out = s
            .nack(&l, Duration::ZERO, &Failure::dead("HTTP 410 Gone"))
            .await
            .unwrap();
        assert!(matches!(out, NackOutcome::Dead { .. }), "{out:?}");
        n += 1;
    }
    n
}

/// Dead letters are per tenant: one tenant's listing and replay never see
/// another's, a replay that matches nothing examines only the tenant's own
/// letters, and a replay cannot rewrite another tenant's live envelope that
/// uses the same id.
pub async fn dead_letters_are_per_tenant(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let others: Vec<Envelope> = (0..3000).map(|i| named("big", &format!("b{i}"))).collect();
    s.enqueue_batch(Q, &others).await.unwrap();
    s.enqueue(Q, &named("small", "shared-id")).await.unwrap();
    dead_letter_all(&s, Q).await;
    // big reuses small's id for a live envelope
    s.enqueue(Q, &named("big", "shared-id")).await.unwrap();
    let page = s
        .replay_dead_page(Q, "small", None, 1000, &["nothing-like-it".into()])
        .await
        .unwrap()
        .unwrap();
    assert_eq!((page.replayed, page.examined), (0, 1), "{page:?}");
    let listed = s.dead_letters(Q, "small", None, 1000).await.unwrap();
    assert_eq!(listed.letters.len(), 1);
    assert_eq!(listed.letters[0].id, "shared-id");
    assert_eq!(listed.next, None);
    assert_eq!(s.replay_dead(Q, "small", &[]).await.unwrap(), Ok(1));
    let mut got: Vec<_> = drain(&s, Q)
        .await
        .into_iter()
        .filter(|g| g.1 == "shared-id")
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("big".into(), "shared-id".into(), "big".into()),
            ("small".into(), "shared-id".into(), "small".into()),
        ]
    );
    // big's letters are all still there, paged in order
    let mut seen = 0;
    let mut after: Option<String> = None;
    loop {
        let p = s
            .dead_letters(Q, "big", after.as_deref(), 1000)
            .await
            .unwrap();
        for (k, d) in p.letters.iter().enumerate() {
            assert_eq!(d.id, format!("b{}", seen + k));
        }
        seen += p.letters.len();
        match p.next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(seen, 3000);
}

/// Retention: a tenant keeps at most `maxPerTenant` dead letters, the
/// oldest go first, and what is dropped is counted.
pub async fn dead_letter_retention_is_bounded_and_counted(url: &str) {
    let mut policy = QueuePolicy::default();
    policy.dead_letters.max_per_tenant = 50;
    let s = store(url, policy).await;
    let envs: Vec<Envelope> = (0..400)
        .map(|i| named("noisy", &format!("n{i:03}")))
        .collect();
    s.enqueue_batch(Q, &envs).await.unwrap();
    s.enqueue(Q, &named("quiet", "q1")).await.unwrap();
    dead_letter_all(&s, Q).await;
    let kept = s
        .dead_letters(Q, "noisy", None, 1000)
        .await
        .unwrap()
        .letters;
    assert_eq!(kept.len(), 50, "kept {}", kept.len());
    assert_eq!(kept[0].id, "n350", "the oldest go first");
    assert_eq!(s.dead_letters_dropped(Q).await.unwrap(), 350);
    // another tenant's letters are not its to drop
    assert_eq!(
        s.dead_letters(Q, "quiet", None, 10)
            .await
            .unwrap()
            .letters
            .len(),
        1
    );
}

/// Retention by age: letters older than `maxAge` go, at the tenant's next
/// letter or, for a tenant that adds none, by maintenance.
pub async fn dead_letters_age_out(url: &str) {
    let mut policy = QueuePolicy::default();
    policy.dead_letters.max_age = Duration::from_secs(1);
    let s = store(url, policy).await;
    for i in 0..5 {
        s.enqueue(Q, &named("old", &format!("o{i}"))).await.unwrap();
    }
    dead_letter_all(&s, Q).await;
    assert_eq!(
        s.dead_letters(Q, "old", None, 10)
            .await
            .unwrap()
            .letters
            .len(),
        5
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    s.maintain(Q, 32).await.unwrap();
    assert!(s
        .dead_letters(Q, "old", None, 10)
        .await
        .unwrap()
        .letters
        .is_empty());
    assert_eq!(s.dead_letters_dropped(Q).await.unwrap(), 5);
}

/// A missing envelope record (evicted, deleted by hand) never wedges its
/// tenant: reaped, nacked, released or promoted, it becomes a dead letter
/// with the cause, the tenant's counters settle, and the tenant can still
/// be served and moved.
pub async fn a_missing_record_never_wedges_its_tenant(url: &str) {
    for ordered in [false, true] {
        let policy = QueuePolicy {
            ordered,
            ..Default::default()
        };
        let s = store(url, policy.clone()).await;
        s.configure_queue(LANE, &policy).await.unwrap();
        let mut conn = super::stored::Conn::open(url).await;
        let prefix = s.queue_prefix(Q);
        for i in 0..5 {
            s.enqueue(Q, &named("t", &format!("m{i}"))).await.unwrap();
        }
        // 1. reaped with its record gone
        let l = match s.lease(Q, "w", Duration::from_millis(1)).await.unwrap() {
            lanekeeper::store::LeaseOutcome::Leased(l) => l,
            o => panic!("{o:?}"),
        };
        conn.lose_body(&prefix, "t", &l.id).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        s.maintain(Q, 32).await.unwrap();
        let st = s.tenant_state(Q, "t").await.unwrap();
        assert_eq!((st.in_flight, st.depth), (0, 4), "after reap: {st:?}");
        // 2. nacked with its record gone
        let l = lease(&s, Q).await.expect("the tenant is not parked");
        conn.lose_body(&prefix, "t", &l.id).await;
        let out = s
            .nack(
                &l,
                Duration::ZERO,
                &Failure::retry("HTTP 503", Duration::ZERO),
            )
            .await
            .unwrap();
        assert!(matches!(out, NackOutcome::Dead { .. }), "{out:?}");
        // 3. waiting to retry when its record goes
        let l = lease(&s, Q).await.unwrap();
        s.nack(
            &l,
            Duration::ZERO,
            &Failure::retry("HTTP 503", Duration::ZERO),
        )
        .await
        .unwrap();
        conn.lose_body(&prefix, "t", &l.id).await;
        s.maintain(Q, 32).await.unwrap();
        // 4. released with its record gone
        let l = lease(&s, Q).await.expect("its retry slot was given back");
        conn.lose_body(&prefix, "t", &l.id).await;
        assert!(s.release(&l).await.unwrap());
        let st = s.tenant_state(Q, "t").await.unwrap();
        assert_eq!(
            (st.in_flight, st.delayed, st.depth),
            (0, 0, 1),
            "ordered={ordered}: {st:?}"
        );
        let dead = s.dead_letters(Q, "t", None, 10).await.unwrap().letters;
        assert_eq!(dead.len(), 4, "{dead:?}");
        assert!(
            dead.iter().all(|d| d.cause.contains("record missing")),
            "{dead:?}"
        );
        // the last one is delivered, and the tenant can move
        let l = lease(&s, Q).await.unwrap();
        assert!(s.ack(&l, LEASE).await.unwrap());
        relocate(&s, Q, LANE, "t").await;
    }
}

/// A reap is the worker's fault, not the endpoint's: worker crashes do not
/// open the breaker of a healthy endpoint.
pub async fn reaped_leases_do_not_open_the_breaker(url: &str) {
    let mut policy = QueuePolicy::default();
    policy.breaker.min_requests = 2;
    policy.max_attempts = 100;
    let s = store(url, policy).await;
    for i in 0..10 {
        s.enqueue(Q, &named("t", &format!("r{i}"))).await.unwrap();
    }
    for _ in 0..10 {
        let _ = s.lease(Q, "w", Duration::from_millis(1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(3)).await;
        s.maintain(Q, 32).await.unwrap();
    }
    // all ten are still leasable at once: no breaker blocks the tenant
    let mut leased = 0;
    while let Some(l) = lease(&s, Q).await {
        assert!(l.breaker.is_none(), "{l:?}");
        s.ack(&l, Duration::from_millis(1)).await.unwrap();
        leased += 1;
    }
    assert_eq!(leased, 10);
}

/// A quantum that rounds to nothing (set behind the CRD's back) does not
/// livelock the queue: the scripts floor it.
pub async fn a_tiny_quantum_does_not_livelock(url: &str) {
    let policy = QueuePolicy {
        quantum_seconds: 1e-9,
        default_weight: 1e-6,
        ..Default::default()
    };
    let s = store(url, policy).await;
    s.enqueue(Q, &named("t", "a")).await.unwrap();
    s.enqueue(Q, &named("t", "a2")).await.unwrap();
    s.enqueue(Q, &named("u", "b")).await.unwrap();
    let mut again = 0;
    let mut leased = 0;
    while leased < 3 {
        match s.lease(Q, "w", LEASE).await.unwrap() {
            lanekeeper::store::LeaseOutcome::Leased(l) => {
                s.ack(&l, Duration::from_secs(1)).await.unwrap();
                leased += 1;
            }
            lanekeeper::store::LeaseOutcome::Again => again += 1,
            o => panic!("{o:?}"),
        }
        assert!(again < 200, "{again} AGAIN answers for three envelopes");
    }
}

pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Lane moves and reshards of one set take turns: a reshard waits for a
/// lane that is moving its tenant, no lane move starts while a reshard runs
/// or waits, and a lane deleted mid-move does not hold the gate forever.
pub async fn lane_moves_and_reshards_take_turns(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let lanes = vec!["whale-lane".to_string(), "other".to_string()];
    assert!(s.lane_move_begin(0, "whale-lane").await.unwrap());
    assert!(
        s.lane_move_begin(0, "whale-lane").await.unwrap(),
        "idempotent"
    );
    assert_eq!(
        s.reshard_begin(&lanes).await.unwrap(),
        Err(vec!["whale-lane".to_string()])
    );
    // A reshard waits: no new lane move starts meanwhile.
    assert!(!s.lane_move_begin(1, "other").await.unwrap());
    // someone else's end does not free the slot
    s.lane_move_end(0, "other").await.unwrap();
    assert!(s.reshard_begin(&lanes).await.unwrap().is_err());
    s.lane_move_end(0, "whale-lane").await.unwrap();
    assert_eq!(s.reshard_begin(&lanes).await.unwrap(), Ok(()));
    assert!(!s.lane_move_begin(1, "other").await.unwrap());
    s.reshard_end().await.unwrap();
    assert!(s.lane_move_begin(1, "other").await.unwrap());
    // "other" is deleted mid-move: the next reshard drops its record
    assert_eq!(
        s.reshard_begin(&["whale-lane".to_string()]).await.unwrap(),
        Ok(())
    );
    s.reshard_end().await.unwrap();
    // the routing table is untouched by the gate's fields
    let t = s.routing().await.unwrap();
    assert!(t.pins.is_empty(), "{t:?}");
}

/// Per-tenant claims across the idempotency periods: an id claimed in one
/// period is still a duplicate in the next, before and after the tenant
/// claims something new there, and is forgotten after two.
pub async fn claims_span_two_periods(url: &str) {
    let policy = QueuePolicy {
        idempotency_window: Duration::from_secs(1),
        ..Default::default()
    };
    let s = store(url, policy).await;
    // start just after a period boundary, so the steps below land where meant
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(1000 - ms % 1000 + 50)).await;
    assert!(matches!(
        s.enqueue(Q, &named("t", "old")).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        s.enqueue(Q, &named("t", "old")).await.unwrap(),
        EnqueueOutcome::Duplicate,
        "the previous period's claim, before any claim in this one"
    );
    assert!(matches!(
        s.enqueue(Q, &named("t", "new")).await.unwrap(),
        EnqueueOutcome::Queued { .. }
    ));
    assert_eq!(
        s.enqueue(Q, &named("t", "old")).await.unwrap(),
        EnqueueOutcome::Duplicate,
        "the previous period's claim, after a claim in this one"
    );
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert!(
        matches!(
            s.enqueue(Q, &named("t", "old")).await.unwrap(),
            EnqueueOutcome::Queued { .. }
        ),
        "remembered for at most two periods"
    );
}
