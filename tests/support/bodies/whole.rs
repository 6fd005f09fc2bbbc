//! Envelopes stored whole in their lane (issue 23): enqueue writes no
//! record, a lease keeps the envelope in `P:leased` until its ack, and only
//! a lease that ends otherwise writes a record. Shared by the single-server
//! tests (`tests/integrity.rs`) and the Redis Cluster tests
//! (`tests/cluster.rs`): each takes the Redis URL.

use std::time::Duration;

use lanekeeper::policy::QueuePolicy;
use lanekeeper::store::{keys, Failure, LeaseOutcome, NackOutcome, Store};

use super::dataplane::{lease, raw, store, LEASE, Q};
use super::integrity::named;
use super::stored::Conn;

async fn record_exists(url: &str, s: &Store, tenant: &str, id: &str) -> bool {
    let cmd = redis::cmd("EXISTS")
        .arg(keys::envelope(&s.queue_prefix(Q), tenant, id))
        .clone();
    raw(url, cmd).await == redis::Value::Int(1)
}

async fn leased_bodies(url: &str, s: &Store) -> i64 {
    let cmd = redis::cmd("HLEN")
        .arg(keys::leased(&s.queue_prefix(Q)))
        .clone();
    redis::from_redis_value(raw(url, cmd).await).unwrap()
}

async fn lane(url: &str, s: &Store, tenant: &str) -> Vec<Vec<u8>> {
    let cmd = redis::cmd("LRANGE")
        .arg(keys::lane(&s.queue_prefix(Q), tenant))
        .arg(0)
        .arg(-1)
        .clone();
    redis::from_redis_value(raw(url, cmd).await).unwrap()
}

fn leased(o: LeaseOutcome) -> lanekeeper::store::Lease {
    match o {
        LeaseOutcome::Leased(l) => l,
        o => panic!("{o:?}"),
    }
}

/// The lifecycle: queued whole (no record), leased into `P:leased`, acked
/// to nothing; a nack, a release and an expired lease each write the
/// record the retry is served from, with its payload, seq and attempts.
pub async fn an_envelope_is_stored_whole_until_its_lease_ends_otherwise(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    for i in 0..4 {
        s.enqueue(Q, &named("t", &format!("w{i}"))).await.unwrap();
    }
    let items = lane(url, &s, "t").await;
    assert_eq!(items.len(), 4);
    for (i, item) in items.iter().enumerate() {
        let id = format!("w{i}");
        assert!(
            matches!(keys::lane_item(item), keys::LaneItem::Whole { id: got, .. } if got == id.as_bytes()),
            "{item:?}"
        );
        assert!(!record_exists(url, &s, "t", &id).await, "{id} has a record");
    }
    // an ack leaves nothing
    let l = lease(&s, Q).await.unwrap();
    assert_eq!((l.id.as_str(), l.attempts), ("w0", 0));
    assert_eq!(leased_bodies(url, &s).await, 1);
    assert!(!record_exists(url, &s, "t", "w0").await);
    let seq0 = l.seq;
    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    assert_eq!(leased_bodies(url, &s).await, 0);
    assert!(!record_exists(url, &s, "t", "w0").await);
    // a nack writes the record its retry is served from
    let l = lease(&s, Q).await.unwrap();
    let (payload, seq) = (l.payload.clone(), l.seq);
    assert!(seq > seq0);
    let out = s
        .nack(&l, Duration::ZERO, &Failure::retry("503", Duration::ZERO))
        .await
        .unwrap();
    assert!(matches!(out, NackOutcome::Retry { .. }), "{out:?}");
    assert_eq!(leased_bodies(url, &s).await, 0);
    assert!(record_exists(url, &s, "t", "w1").await);
    s.maintain(Q, 32).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(
        (l.id.as_str(), l.attempts, l.seq, &l.payload),
        ("w1", 1, seq, &payload)
    );
    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    assert!(!record_exists(url, &s, "t", "w1").await);
    // a release puts it back at the head, from its record
    let l = lease(&s, Q).await.unwrap();
    let (payload, seq) = (l.payload.clone(), l.seq);
    assert!(s.release(&l).await.unwrap());
    assert_eq!(leased_bodies(url, &s).await, 0);
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(
        (l.id.as_str(), l.attempts, l.seq, &l.payload),
        ("w2", 0, seq, &payload)
    );
    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    // an expired lease is reaped to its record, an attempt counted
    let l = leased(s.lease(Q, "w", Duration::from_millis(1)).await.unwrap());
    let payload = l.payload.clone();
    tokio::time::sleep(Duration::from_millis(5)).await;
    s.maintain(Q, 32).await.unwrap();
    assert_eq!(leased_bodies(url, &s).await, 0);
    let again = lease(&s, Q).await.unwrap();
    assert_eq!(
        (again.id.as_str(), again.attempts, &again.payload),
        ("w3", 1, &payload)
    );
    // the first lease's ack is stale and changes nothing
    assert!(!s.ack(&l, Duration::from_millis(1)).await.unwrap());
    assert!(s.ack(&again, Duration::from_millis(1)).await.unwrap());
    assert!(!record_exists(url, &s, "t", "w3").await);
    let st = s.tenant_state(Q, "t").await.unwrap();
    assert_eq!((st.depth, st.in_flight), (0, 0), "{st:?}");
}

/// A rolling upgrade: a lane of bare ids with records (what a library
/// before whole items stored) is served in order before the whole items
/// enqueued after it, one lease at a time and in batches, and acks of both
/// kinds in one batch leave no record and no leased body.
pub async fn a_lane_of_records_is_served_in_order_beside_whole_items(url: &str) {
    for k in [1usize, 16] {
        let s = store(url, QueuePolicy::default()).await;
        let p = s.queue_prefix(Q);
        for i in 0..6 {
            s.enqueue(Q, &named("t", &format!("u{i}"))).await.unwrap();
        }
        // the first four as the older library stored them
        let mut conn = Conn::open(url).await;
        for i in 0..4 {
            conn.store_as_record(&p, "t", &format!("u{i}")).await;
        }
        let items = lane(url, &s, "t").await;
        assert!(matches!(
            keys::lane_item(&items[0]),
            keys::LaneItem::Bare(b"u0")
        ));
        assert!(matches!(
            keys::lane_item(&items[5]),
            keys::LaneItem::Whole { .. }
        ));
        let mut got = Vec::new();
        let mut held: Vec<lanekeeper::store::Lease> = Vec::new();
        loop {
            let done: Vec<_> = held.iter().map(|l| (l, Duration::from_millis(1))).collect();
            let b = s.lease_batch(Q, &done, k, "w", LEASE).await.unwrap();
            assert!(b.acked.iter().all(|a| a.acked));
            if b.leased.is_empty() && held.is_empty() {
                break;
            }
            for l in &b.leased {
                let env = l.envelope().unwrap();
                assert_eq!(env.payload["id"], serde_json::json!(l.id), "k={k}");
                got.push((l.id.clone(), l.seq));
            }
            held = b.leased;
        }
        let ids: Vec<_> = got.iter().map(|(id, _)| id.clone()).collect();
        let want: Vec<_> = (0..6).map(|i| format!("u{i}")).collect();
        assert_eq!(ids, want, "k={k}");
        assert!(got.windows(2).all(|w| w[0].1 < w[1].1), "k={k}: {got:?}");
        for id in &want {
            assert!(!conn.body_kept(&p, "t", id).await, "k={k}: {id} kept");
        }
        let st = s.tenant_state(Q, "t").await.unwrap();
        assert_eq!((st.depth, st.in_flight), (0, 0), "k={k}: {st:?}");
    }
}

/// Lease `q` dry in calls of `k`, acking what decodes and dead-lettering
/// what does not (as the worker does). Returns the ids delivered, with
/// their seqs, and how many were dead-lettered.
async fn drain_k(s: &Store, k: usize) -> (Vec<(String, u64)>, usize) {
    let (mut delivered, mut dead) = (Vec::new(), 0);
    loop {
        let b = s.lease_batch(Q, &[], k, "w", LEASE).await.unwrap();
        if b.leased.is_empty() {
            return (delivered, dead);
        }
        for l in b.leased {
            match l.envelope() {
                Ok(_) => {
                    delivered.push((l.id.clone(), l.seq));
                    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
                }
                Err(e) => {
                    let cause = format!("corrupt envelope: {e}");
                    let out = s.nack(&l, Duration::ZERO, &Failure::dead(&cause)).await;
                    assert!(matches!(out.unwrap(), NackOutcome::Dead { .. }));
                    dead += 1;
                }
            }
        }
    }
}

/// Hostile state a lease must not fail on, after its first write or
/// before: lane items that start as whole ones but do not parse, an item
/// whose seq is not a number, and a payload of any bytes. Each envelope is
/// delivered or dead-lettered with a cause and its bytes; none is lost
/// quietly, and the tenant is not wedged.
pub async fn hostile_whole_items_fail_no_lease_and_lose_nothing_quietly(url: &str) {
    for k in [1usize, 16] {
        let s = store(url, QueuePolicy::default()).await;
        let p = s.queue_prefix(Q);
        s.enqueue(Q, &named("t", "ok-0")).await.unwrap();
        // a payload of any bytes, separators and markers included
        let mut conn = Conn::open(url).await;
        conn.set_payload(&p, "t", "ok-0", "raw\n\u{1}bytes\n").await;
        // written behind the scripts' back: a marker alone, a marker and an
        // id, two fields, and a whole item whose seq is not a number
        let mut bad_seq = b"\x01bad-seq\nmain\nx\ny\n".to_vec();
        bad_seq.extend(serde_json::to_vec(&named("t", "bad-seq")).unwrap());
        for item in [
            &b"\x01"[..],
            b"\x01no-newline",
            b"\x01two\nfields",
            &bad_seq,
        ] {
            let push = redis::cmd("RPUSH")
                .arg(keys::lane(&p, "t"))
                .arg(item)
                .clone();
            raw(url, push).await;
        }
        s.enqueue(Q, &named("t", "ok-1")).await.unwrap();
        let (delivered, dead) = drain_k(&s, k).await;
        // the seq that is not a number reads as 0
        let ids: Vec<_> = delivered.iter().map(|d| d.0.as_str()).collect();
        assert_eq!(ids, ["bad-seq", "ok-1"], "k={k}");
        assert_eq!(delivered[0].1, 0, "k={k}");
        // ok-0's payload and the two-field item do not decode; the marker
        // alone and the marker and id are bare ids without records
        assert_eq!(dead, 2, "k={k}");
        let letters = s.dead_letters(Q, "t", None, 10).await.unwrap().letters;
        assert_eq!(letters.len(), 4, "k={k}: {letters:?}");
        // each kept with its bytes
        for (id, bytes) in [("ok-0", "raw\n\u{1}bytes\n"), ("two", "\u{1}two\nfields")] {
            let letter = letters.iter().find(|d| d.id == id);
            let kept = letter.map(|d| d.envelope.as_str());
            assert_eq!(kept, Some(bytes), "k={k}: {id}'s letter");
        }
        let missing = letters
            .iter()
            .filter(|d| d.cause.contains("record missing"))
            .count();
        assert_eq!(missing, 2, "k={k}: {letters:?}");
        let st = s.tenant_state(Q, "t").await.unwrap();
        assert_eq!(st.in_flight, 0, "k={k}: {st:?}");
        assert_eq!(leased_bodies(url, &s).await, 0, "k={k}");
    }
}

/// A `P:leased` of the wrong type (written behind the scripts' back) fails
/// no call: leases write records instead, and acks, nacks and releases end
/// them as they would any record's.
pub async fn a_foreign_leased_key_fails_no_lease_or_ack(url: &str) {
    for k in [1usize, 16] {
        let s = store(url, QueuePolicy::default()).await;
        let p = s.queue_prefix(Q);
        for i in 0..3 {
            s.enqueue(Q, &named("t", &format!("f{i}"))).await.unwrap();
        }
        raw(
            url,
            redis::cmd("SET").arg(keys::leased(&p)).arg("x").clone(),
        )
        .await;
        let mut got = Vec::new();
        while got.len() < 3 {
            let b = s
                .lease_batch(Q, &[], k.min(3 - got.len()), "w", LEASE)
                .await;
            got.extend(b.unwrap().leased);
        }
        for l in &got {
            assert!(record_exists(url, &s, "t", &l.id).await, "k={k}: {}", l.id);
            assert_eq!(l.envelope().unwrap().payload["id"], serde_json::json!(l.id));
        }
        assert!(s.ack(&got[0], Duration::from_millis(1)).await.unwrap());
        let out = s
            .nack(
                &got[1],
                Duration::ZERO,
                &Failure::retry("503", Duration::ZERO),
            )
            .await
            .unwrap();
        assert!(matches!(out, NackOutcome::Retry { .. }), "k={k}: {out:?}");
        assert!(s.release(&got[2]).await.unwrap());
        s.maintain(Q, 32).await.unwrap();
        let (delivered, dead) = drain_k(&s, k).await;
        let mut ids: Vec<_> = delivered.into_iter().map(|d| d.0).collect();
        ids.sort();
        assert_eq!(
            (ids, dead),
            (vec!["f1".to_string(), "f2".to_string()], 0),
            "k={k}"
        );
        for i in 0..3 {
            assert!(
                !record_exists(url, &s, "t", &format!("f{i}")).await,
                "k={k}"
            );
        }
        raw(url, redis::cmd("DEL").arg(keys::leased(&p)).clone()).await;
    }
}

/// Enqueue's arguments, grouped by tenant, checked before its first write:
/// a call that does not parse (a count that is not a whole number from 1,
/// or that runs past the arguments; a routing version that is not a
/// number; more than 1,000 envelopes) is refused and changes nothing.
pub async fn a_malformed_enqueue_fails_before_its_first_write(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let p = s.queue_prefix(Q);
    let keyspace = || async {
        let mut cmd = redis::cmd("KEYS");
        cmd.arg(format!("{p}*"));
        let mut keys: Vec<String> = redis::from_redis_value(raw(url, cmd).await).unwrap();
        keys.sort();
        keys
    };
    // the library is loaded by a store's first call
    s.enqueue(Q, &named("w", "warm")).await.unwrap();
    let before = keyspace().await;
    let one = ["id-1", "main", "{}"];
    let mut many = vec!["0", "t", "1001", "0", ""];
    for _ in 0..1001 {
        many.extend(one);
    }
    let cases: Vec<Vec<&str>> = vec![
        vec!["soon", "t", "1", "0", "", "id-1", "main", "{}"],
        // a routing version past the fence's comparison
        vec!["nan", "t", "1", "0", "", "id-1", "main", "{}"],
        vec!["-1", "t", "1", "0", "", "id-1", "main", "{}"],
        vec!["1.5", "t", "1", "0", "", "id-1", "main", "{}"],
        // no envelope at all
        vec!["0"],
        vec!["0", "t", "0", "0", ""],
        vec!["0", "t", "1.5", "0", "", "id-1", "main", "{}"],
        vec!["0", "t", "inf", "0", "", "id-1", "main", "{}"],
        vec!["0", "t", "2", "0", "", "id-1", "main", "{}"],
        vec!["0", "t", "1", "0", "", "id-1", "main"],
        vec!["0", "t", "1", "0", "", "id-1", "main", "{}", "u"],
        many,
    ];
    for args in cases {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(s.function_name("enqueue"))
            .arg(2)
            .arg(&p)
            .arg(keys::slot_guard(&p));
        for a in &args {
            cmd.arg(*a);
        }
        let out = super::dataplane::raw_result(url, cmd).await;
        let err = out.expect_err(&format!("{:?} was taken", &args[..args.len().min(9)]));
        assert!(err.contains("ARGV must be the routing version"), "{err}");
        assert_eq!(
            keyspace().await,
            before,
            "{:?} wrote",
            &args[..args.len().min(9)]
        );
    }
    // and a call that parses is taken
    assert_eq!(
        s.enqueue(Q, &named("t", "id-1")).await.unwrap(),
        lanekeeper::store::EnqueueOutcome::Queued { seq: 2 }
    );
}

/// A dead letter is not replayed while an envelope reusing its id is live
/// (the producer sent the id again after the idempotency window), though
/// that envelope, stored whole, has no record: replaying it then put two
/// envelopes of one id in the queue, and the later one's retry wrote its
/// body over the replayed one's record. It is replayed once the reuse's
/// claim has left the window.
pub async fn a_replay_waits_while_its_id_is_live_again(url: &str) {
    let policy = QueuePolicy {
        idempotency_window: Duration::from_secs(1),
        ..QueuePolicy::default()
    };
    let s = store(url, policy).await;
    let mut first = named("t", "x");
    first.payload = serde_json::json!({ "v": 1 });
    s.enqueue(Q, &first).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    s.nack(&l, Duration::ZERO, &Failure::dead("gave up"))
        .await
        .unwrap();
    // the window passes; the producer reuses the id
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let mut again = named("t", "x");
    again.payload = serde_json::json!({ "v": 2 });
    assert!(matches!(
        s.enqueue(Q, &again).await.unwrap(),
        lanekeeper::store::EnqueueOutcome::Queued { .. }
    ));
    assert_eq!(
        s.replay_dead(Q, "t", &[]).await.unwrap(),
        Ok(0),
        "replayed while live"
    );
    // the live one fails once and is delivered; nothing else comes
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(l.envelope().unwrap().payload, serde_json::json!({ "v": 2 }));
    s.nack(&l, Duration::ZERO, &Failure::retry("503", Duration::ZERO))
        .await
        .unwrap();
    s.maintain(Q, 32).await.unwrap();
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(l.envelope().unwrap().payload, serde_json::json!({ "v": 2 }));
    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    assert!(lease(&s, Q).await.is_none());
    // once the reuse's claim has left the window, the letter comes back whole
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    assert_eq!(s.replay_dead(Q, "t", &[]).await.unwrap(), Ok(1));
    let l = lease(&s, Q).await.unwrap();
    assert_eq!(l.envelope().unwrap().payload, serde_json::json!({ "v": 1 }));
    assert!(s.ack(&l, Duration::from_millis(1)).await.unwrap());
    let st = s.tenant_state(Q, "t").await.unwrap();
    assert_eq!((st.depth, st.in_flight, st.delayed), (0, 0, 0), "{st:?}");
}

/// A lease reads the breaker, the pause and the endpoint bucket (its key:
/// the tenant's slot is another endpoint's) of the
/// envelope it has just taken off the lane, after its first write: a key of
/// the wrong type there (written behind the scripts' back) used to fail the
/// lease with the envelope off its lane and nowhere else. Each now reads as
/// absent (a closed breaker, no pause, a full bucket) and the envelope is
/// delivered.
pub async fn foreign_gate_keys_fail_no_lease(url: &str) {
    let limited = super::buckets::unthrottled_limits();
    let far = || {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        (ms + 600_000).to_string()
    };
    for (case, policy) in [
        ("breaker", QueuePolicy::default()),
        ("pause", QueuePolicy::default()),
        ("bucket", limited),
    ] {
        let s = store(url, policy).await;
        let p = s.queue_prefix(Q);
        s.enqueue(Q, &named("t", "g-1")).await.unwrap();
        let tk = keys::tenant(&p, "t");
        let setup: Vec<redis::Cmd> = match case {
            "breaker" => vec![
                redis::cmd("HSET").arg(&tk).arg("bw").arg(1).clone(),
                redis::cmd("SET")
                    .arg(format!("{p}:br:1:t:main"))
                    .arg("x")
                    .clone(),
            ],
            "pause" => vec![
                redis::cmd("HSET").arg(&tk).arg("pz").arg(far()).clone(),
                redis::cmd("SET")
                    .arg(format!("{p}:pace:t"))
                    .arg("x")
                    .clone(),
            ],
            // the tenant's bucket slot held by another endpoint, short of
            // full (see endpoint_gate), so main's bucket is its key
            _ => vec![
                redis::cmd("HSET")
                    .arg(&tk)
                    .arg("ee")
                    .arg("other")
                    .arg("ek")
                    .arg(format!("0:{}", far()))
                    .clone(),
                redis::cmd("HSET")
                    .arg(format!("{p}:rl:1:t:main"))
                    .arg("x")
                    .arg(1)
                    .clone(),
            ],
        };
        for cmd in setup {
            raw(url, cmd).await;
        }
        let l = leased(
            s.lease(Q, "w", LEASE)
                .await
                .unwrap_or_else(|e| panic!("{case}: {e}")),
        );
        assert_eq!(l.id, "g-1", "{case}");
        assert!(s.ack(&l, Duration::from_millis(1)).await.is_ok(), "{case}");
    }
}

/// Enqueue claims each id of a batch once, whichever way its claims are
/// checked (issue 23, sixth session): a tenant with no claims set yet (one
/// SADD checks and claims, and its count finds an id named twice), one
/// with a set (an id seen before, an id named twice), a tenant whose claims
/// are being copied (each new id also goes to `P:idsx`), and two groups of
/// one tenant in one call (the second sees the first's claims). Each
/// envelope's lane item carries the seq its enqueue answered, across a
/// thousand (the digits `seq_text` writes from its kept three-digit
/// groups), below a thousand, and from 10^14 (formatted whole).
pub async fn a_batch_claims_each_id_once_and_its_items_carry_their_seqs(url: &str) {
    use lanekeeper::store::EnqueueOutcome;
    let s = store(url, QueuePolicy::default()).await;
    let p = s.queue_prefix(Q);
    let batch = |tenant: &'static str, ids: &'static [&'static str]| {
        ids.iter().map(|id| named(tenant, id)).collect::<Vec<_>>()
    };
    let codes = |out: Vec<lanekeeper::store::Result<EnqueueOutcome>>| {
        out.into_iter()
            .map(|o| match o.unwrap() {
                EnqueueOutcome::Queued { seq } => seq as i64,
                EnqueueOutcome::Duplicate => -1,
                o => panic!("{o:?}"),
            })
            .collect::<Vec<i64>>()
    };
    // no set yet: the SADD's count says "a" came twice
    let out = codes(
        s.enqueue_batch(Q, &batch("t", &["a", "b", "a"]))
            .await
            .unwrap(),
    );
    assert_eq!(out, vec![1, 2, -1]);
    // a set: "a" seen before, "c" named twice, "d" new
    let out = codes(
        s.enqueue_batch(Q, &batch("t", &["c", "a", "d", "c"]))
            .await
            .unwrap(),
    );
    assert_eq!(out, vec![4, -1, 6, -1]);
    // all new beside the set
    let out = codes(s.enqueue_batch(Q, &batch("t", &["e", "f"])).await.unwrap());
    assert_eq!(out, vec![8, 9]);
    let lane_ids: Vec<Vec<u8>> = lane(url, &s, "t")
        .await
        .iter()
        .map(|item| match keys::lane_item(item) {
            keys::LaneItem::Whole { id, .. } => id.to_vec(),
            keys::LaneItem::Bare(b) => panic!("{b:?}"),
        })
        .collect();
    assert_eq!(
        lane_ids,
        [b"a", b"b", b"c", b"d", b"e", b"f"].map(|b| b.to_vec())
    );

    // claims being copied: every new id also goes to P:idsx, by either path
    raw(
        url,
        redis::cmd("HSET")
            .arg(keys::tenant(&p, "x"))
            .arg("xc")
            .arg("1")
            .clone(),
    )
    .await;
    let copied = || async {
        let cmd = redis::cmd("SMEMBERS").arg(format!("{p}:idsx:x")).clone();
        let mut ids: Vec<String> = redis::from_redis_value(raw(url, cmd).await).unwrap();
        ids.sort();
        ids
    };
    let out = codes(
        s.enqueue_batch(Q, &batch("x", &["m", "n", "m"]))
            .await
            .unwrap(),
    );
    assert_eq!(out, vec![10, 11, -1]);
    assert_eq!(copied().await, ["m", "n"]);
    let out = codes(s.enqueue_batch(Q, &batch("x", &["n", "o"])).await.unwrap());
    assert_eq!(out, vec![-1, 14]);
    assert_eq!(copied().await, ["m", "n", "o"]);

    // two groups of one tenant in one call (the store sends one a tenant;
    // the script takes any): the second group's "g" is the first's
    let mut cmd = enqueue_fcall(&s);
    for ids in [["g", "h"], ["i", "g"]] {
        cmd.arg("u").arg(2).arg(0).arg("").arg(ids[0]).arg(ids[1]);
        for _ in ids {
            cmd.arg("main").arg("{}");
        }
    }
    let reply = super::dataplane::raw_result(url, cmd).await.unwrap();
    let redis::Value::Array(reply) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(reply[1], redis::Value::BulkString(b"OOOD".to_vec()));
    assert_eq!(lane(url, &s, "u").await.len(), 3);

    // seqs below a thousand, across one, then from 10^14: each item says
    // what its enqueue answered
    drain_k(&s, 16).await;
    for start in [0u64, 997, 1_998, 99_999_999_999_998] {
        raw(
            url,
            redis::cmd("SET").arg(format!("{p}:seq")).arg(start).clone(),
        )
        .await;
        let envs: Vec<_> = (0..4)
            .map(|i| named("v", &format!("s{start}-{i}")))
            .collect();
        let answered = codes(s.enqueue_batch(Q, &envs).await.unwrap());
        let want: Vec<i64> = (1..=4).map(|i| (start + i) as i64).collect();
        assert_eq!(answered, want);
        for (item, seq) in lane(url, &s, "v").await.iter().zip(&want) {
            let text = format!("\n{seq}\n");
            assert!(
                item.windows(text.len()).any(|w| w == text.as_bytes()),
                "{seq}: {:?}",
                String::from_utf8_lossy(item)
            );
        }
        let mut leased = Vec::new();
        while let Some(l) = lease(&s, Q).await {
            leased.push(l.seq as i64);
            s.ack(&l, Duration::from_millis(1)).await.unwrap();
        }
        assert_eq!(leased, want, "from {start}");
    }
}

/// A tenant's claim fields ahead of now (a helper's attack on the sixth
/// session's enqueue): a longer idempotency window numbers the periods
/// anew, far lower than the one the tenant last claimed in, and a clock
/// that steps back puts now's period behind it. Neither may let an id be
/// stored twice: not by a single post, nor by a call that names it in two
/// groups of its tenant, nor, once the clock is back, by the ids claimed
/// while it was behind.
pub async fn claims_hold_when_the_window_grows_or_the_clock_steps_back(url: &str) {
    use lanekeeper::store::EnqueueOutcome;
    let window = |secs| QueuePolicy {
        idempotency_window: Duration::from_secs(secs),
        ..QueuePolicy::default()
    };
    let s = store(url, window(3600)).await;
    let dup = |o: EnqueueOutcome| o == EnqueueOutcome::Duplicate;
    assert!(!dup(s.enqueue(Q, &named("t1", "x")).await.unwrap()));
    // a day's window: periods numbered about 24 times lower
    s.configure_queue(Q, &window(86_400)).await.unwrap();
    assert!(!dup(s.enqueue(Q, &named("t1", "a")).await.unwrap()));
    assert!(
        dup(s.enqueue(Q, &named("t1", "a")).await.unwrap()),
        "a single post of a claimed id was stored again"
    );
    let mut cmd = enqueue_fcall(&s);
    for (t, id) in [("t1", "b"), ("t2", "b"), ("t1", "b")] {
        cmd.arg(t)
            .arg(1)
            .arg(0)
            .arg("")
            .arg(id)
            .arg("main")
            .arg("{}");
    }
    let reply = super::dataplane::raw_result(url, cmd).await.unwrap();
    let redis::Value::Array(reply) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(
        reply[1],
        redis::Value::BulkString(b"OOD".to_vec()),
        "an id named in two groups of its tenant"
    );

    // the clock: ten seconds into a day's period, then back across its
    // start, then forward again
    let day = 86_400_000u64;
    let start = (1_800_000_000_000 / day) * day;
    s.set_virtual_clock(Q, start + 10_000).await.unwrap();
    assert!(!dup(s.enqueue(Q, &named("t3", "k")).await.unwrap()));
    s.set_virtual_clock(Q, start - 10_000).await.unwrap();
    assert!(
        dup(s.enqueue(Q, &named("t3", "k")).await.unwrap()),
        "an id claimed in the period ahead"
    );
    let out = duplicates(&s, &[named("t3", "k"), named("t3", "m"), named("t3", "m")]).await;
    assert_eq!(out, [true, false, true]);
    s.set_virtual_clock(Q, start + 20_000).await.unwrap();
    let out = duplicates(&s, &[named("t3", "m"), named("t3", "k"), named("t3", "n")]).await;
    assert_eq!(
        out,
        [true, true, false],
        "claims made while the clock was behind"
    );
    // three periods back and forward again: the newest set is still
    // checked (the window is now's period and the one before)
    s.set_virtual_clock(Q, start + day + 10_000).await.unwrap();
    assert!(!dup(s.enqueue(Q, &named("t4", "q")).await.unwrap()));
    s.set_virtual_clock(Q, start - 2 * day).await.unwrap();
    assert!(dup(s.enqueue(Q, &named("t4", "q")).await.unwrap()));
    assert!(!dup(s.enqueue(Q, &named("t4", "r")).await.unwrap()));
    s.set_virtual_clock(Q, start + day + 20_000).await.unwrap();
    let out = duplicates(&s, &[named("t4", "q"), named("t4", "s")]).await;
    assert_eq!(out, [true, false], "the newest set, once the clock is back");
    s.set_virtual_clock(Q, start + 2 * day + 10_000)
        .await
        .unwrap();
    assert!(dup(s.enqueue(Q, &named("t4", "q")).await.unwrap()));
    s.clear_virtual_clock(Q).await.unwrap();
}

/// Whether each of `envs`, enqueued in one batch, was answered duplicate.
async fn duplicates(s: &Store, envs: &[lanekeeper::envelope::Envelope]) -> Vec<bool> {
    s.enqueue_batch(Q, envs)
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap() == lanekeeper::store::EnqueueOutcome::Duplicate)
        .collect()
}

/// An `FCALL` of the enqueue script on `Q`: its keys, then the routing
/// version 0 (not routed); the groups follow.
fn enqueue_fcall(s: &Store) -> redis::Cmd {
    let p = s.queue_prefix(Q);
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(s.function_name("enqueue"))
        .arg(2)
        .arg(&p)
        .arg(keys::slot_guard(&p))
        .arg("0");
    cmd
}
