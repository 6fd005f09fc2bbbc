//! Batched lease and ack ([`Store::lease_batch`]): the tenants a batch of k
//! serves are those k single leases serve, and the state it leaves theirs,
//! fairness in worker-seconds and
//! weights hold at k = 16, and a hostile batch (a lease acked twice in one
//! call, another tenant's lease, too many, malformed arguments) settles
//! nothing it should not. Run on one server and on the cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use lanekeeper::policy::QueuePolicy;
use lanekeeper::store::{keys, Lease, LeaseOutcome, Store, StoreError, LEASE_BATCH_MAX};

use super::dataplane::{fill, store, LEASE, Q};

/// Deliver `n` envelopes of queue Q, `k` at a time, each delivery taking
/// `took(tenant)`: every call acks the deliveries held and leases up to `k`
/// more (k = 1: [`Store::lease`] then [`Store::ack`], one at a time).
/// Returns worker-seconds and deliveries per tenant, and the tenants in the
/// order they were served.
pub async fn deliver(
    s: &Store,
    k: usize,
    n: usize,
    took: impl Fn(&str) -> Duration,
) -> (BTreeMap<String, f64>, BTreeMap<String, u64>, Vec<String>) {
    let (mut secs, mut count, mut order) = (BTreeMap::new(), BTreeMap::new(), Vec::new());
    let mut held: Vec<Lease> = Vec::new();
    let mut tally = |l: &Lease, d: Duration| {
        *secs.entry(l.tenant.clone()).or_insert(0.0) += d.as_secs_f64();
        *count.entry(l.tenant.clone()).or_insert(0) += 1;
    };
    let mut leased = 0;
    while leased < n || !held.is_empty() {
        let want = k.min(n - leased);
        if k == 1 {
            for l in held.drain(..) {
                assert!(s.ack(&l, took(&l.tenant)).await.unwrap());
                tally(&l, took(&l.tenant));
            }
            if want == 0 {
                break;
            }
            match s.lease(Q, "w", LEASE).await.unwrap() {
                LeaseOutcome::Leased(l) => held.push(l),
                LeaseOutcome::Again => continue,
                other => panic!("backlog ran out: {other:?}"),
            }
        } else {
            let done: Vec<_> = held.iter().map(|l| (l, took(&l.tenant))).collect();
            let batch = s.lease_batch(Q, &done, want, "w", LEASE).await.unwrap();
            assert!(batch.acked.iter().all(|a| a.acked), "{:?}", batch.acked);
            for l in held.drain(..) {
                tally(&l, took(&l.tenant));
            }
            assert!(
                !batch.leased.is_empty() || want == 0 || batch.short == Some(LeaseOutcome::Again),
                "backlog ran out: {:?}",
                batch.short
            );
            held = batch.leased;
        }
        leased += held.len();
        order.extend(held.iter().map(|l| l.tenant.clone()));
    }
    (secs, count, order)
}

/// One round of two identical queues side by side: `single` acks what it
/// holds (in the order held), then leases up to `k` one call at a time;
/// `batched` acks what it holds and leases up to `k` in one
/// [`Store::lease_batch`] call. Each delivery took `took(tenant)`.
async fn one_round(
    single: &Store,
    batched: &Store,
    (held_single, held_batched): (&mut Vec<Lease>, &mut Vec<Lease>),
    k: usize,
    took: &impl Fn(&str) -> Duration,
) {
    for l in held_single.drain(..) {
        assert!(single.ack(&l, took(&l.tenant)).await.unwrap());
    }
    for _ in 0..k {
        match single.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) => held_single.push(l),
            _ => break,
        }
    }
    let done: Vec<_> = held_batched.iter().map(|l| (l, took(&l.tenant))).collect();
    let batch = batched.lease_batch(Q, &done, k, "w", LEASE).await.unwrap();
    assert!(batch.acked.iter().all(|a| a.acked));
    *held_batched = batch.leased;
}

/// What a round served: "tenant/id" of each lease, in order.
fn served_ids(held: &[Lease]) -> Vec<String> {
    held.iter()
        .map(|l| format!("{}/{}", l.tenant, l.id))
        .collect()
}

/// The tenants k single leases serve are the tenants one batch of k
/// serves, call after call, with caps that bind (3 of 16), a weighted
/// tenant, tenants of different costs and turns short enough to end
/// inside a batch: two identical queues, one driven by single calls (k
/// acks, then k leases), one by batches.
pub async fn a_batch_serves_the_tenants_k_single_leases_would(url: &str) {
    let mut policy = QueuePolicy {
        max_in_flight: 3,
        quantum_seconds: 0.05,
        ..Default::default()
    };
    policy.weights.insert("t1".into(), 2.0);
    let took = |t: &str| {
        Duration::from_millis(match t {
            "t0" => 5,
            "t1" => 12,
            "t2" => 30,
            _ => 8,
        })
    };
    let (single, batched) = (store(url, policy.clone()).await, store(url, policy).await);
    for s in [&single, &batched] {
        for t in 0..6 {
            fill(s, Q, &format!("t{t}"), 40).await;
        }
    }
    let k = 16;
    let (mut held_single, mut held_batched): (Vec<Lease>, Vec<Lease>) = (Vec::new(), Vec::new());
    let (mut served_single, mut served_batched) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        one_round(
            &single,
            &batched,
            (&mut held_single, &mut held_batched),
            k,
            &took,
        )
        .await;
        served_single.push(served_ids(&held_single));
        served_batched.push(served_ids(&held_batched));
        assert_eq!(
            served_single, served_batched,
            "a batch of {k} served other envelopes than {k} single leases"
        );
        if held_single.is_empty() {
            break;
        }
    }
    let served: usize = served_single.iter().map(Vec::len).sum();
    assert_eq!(served, 240, "every envelope was served: {served_single:?}");
    // the caps bound: no call held more than 3 of any tenant
    for call in &served_batched {
        for t in 0..6 {
            let n = call
                .iter()
                .filter(|id| id.starts_with(&format!("t{t}/")))
                .count();
            assert!(
                n <= 3,
                "t{t} held {n} > its cap of 3 in one batch: {call:?}"
            );
        }
    }
}

/// What a batch leaves behind is what k single calls leave: after every
/// call, not only the envelopes served but the two queues' rings and every
/// tenant's state (credit, slots, fresh-turn budget, estimate, depth,
/// counters, flags) are equal. A batch serves a tenant that stays at the
/// ring's head in one run, and acks each tenant's deliveries with one read
/// and one write; this is what pins both to the single calls. Every bound
/// of a run binds here: caps (4, against batches of 16), credit (a 30 ms
/// quantum against 1 to 20 ms deliveries), fresh turns whose refunds leave
/// credit above what the turn may still charge (tenants that go idle and
/// come back, deliveries far shorter than their estimate), a weighted
/// tenant, and records missing in the middle of a run (dead-lettered, as
/// a single lease does, and the run's rest served in order after them).
pub async fn a_batch_leaves_the_state_k_single_calls_leave(url: &str) {
    let mut policy = QueuePolicy {
        max_in_flight: 4,
        quantum_seconds: 0.03,
        initial_estimate_seconds: 0.05,
        ..Default::default()
    };
    policy.weights.insert("t1".into(), 2.5);
    // m's turns outlast its cap: its runs are 4 long, and its lost records
    // (4, 9 and 10) fall at a run's head, with the run's rest to go back
    // to the lane in order, and two in a row
    policy.weights.insert("m".into(), 20.0);
    let (single, batched) = (
        store(url, policy.clone()).await,
        store(url, policy.clone()).await,
    );
    let mut tenants: Vec<String> = (0..5).map(|t| format!("t{t}")).collect();
    tenants.push("m".into());
    for s in [&single, &batched] {
        for t in &tenants {
            fill(s, Q, t, if t == "m" { 12 } else { 30 }).await;
        }
        // records lost behind the scripts' back, one mid-lane, two in a row
        let mut conn = super::stored::Conn::open(url).await;
        for (t, i) in [("t1", 2), ("m", 4), ("m", 9), ("m", 10)] {
            conn.lose_body(&s.queue_prefix(Q), t, &format!("{t}-{i}"))
                .await;
        }
    }
    // how long a delivery takes: short on even rounds, long on odd ones, so
    // estimates swing and acks refund
    let took = |t: &str, round: usize| {
        let base = if round.is_multiple_of(2) { 1 } else { 20 };
        Duration::from_millis(base + t.len() as u64)
    };
    let state = |s: &Store, tenants: Vec<String>| {
        let prefix = s.queue_prefix(Q);
        async move {
            let ring: Vec<String> = redis::from_redis_value(
                super::dataplane::raw(
                    url,
                    redis::cmd("LRANGE")
                        .arg(keys::ring(&prefix))
                        .arg(0)
                        .arg(-1)
                        .clone(),
                )
                .await,
            )
            .unwrap();
            let mut states = BTreeMap::new();
            for t in tenants {
                let mut h: BTreeMap<String, String> = redis::from_redis_value(
                    super::dataplane::raw(
                        url,
                        redis::cmd("HGETALL").arg(keys::tenant(&prefix, &t)).clone(),
                    )
                    .await,
                )
                .unwrap();
                // when it last enqueued (seconds of the wall clock)
                h.remove("la");
                states.insert(t, h);
            }
            (ring, states)
        }
    };
    let k = 16;
    let (mut held_single, mut held_batched): (Vec<Lease>, Vec<Lease>) = (Vec::new(), Vec::new());
    let (mut runs, mut served) = (0, 0);
    let mut all = tenants.clone();
    for round in 0..80 {
        // a tenant that comes and goes: a fresh turn every third round
        if round % 3 == 1 {
            let t = format!("s{}", round % 2);
            if !all.contains(&t) {
                all.push(t.clone());
            }
            for s in [&single, &batched] {
                let envs: Vec<_> = (0..3)
                    .map(|i| super::dataplane::env(&t, 1000 * round as u64 + i))
                    .collect();
                s.enqueue_batch(Q, &envs).await.unwrap();
            }
        }
        // caps lowered under tenants parked at them: each rejoins the ring
        // only at the ack that brings it under, and in the order single acks
        // would put them there
        if round == 6 {
            let mut lowered = policy.clone();
            lowered.caps.insert("t0".into(), 1);
            lowered.caps.insert("t3".into(), 2);
            for s in [&single, &batched] {
                s.configure_queue(Q, &lowered).await.unwrap();
            }
        }
        // acks in an order that interleaves the tenants: first, last,
        // second, second to last, ...
        let interleave = |held: &mut Vec<Lease>| {
            let mut v: std::collections::VecDeque<Lease> = held.drain(..).collect();
            let mut out = Vec::new();
            while let Some(l) = v.pop_front() {
                out.push(l);
                if let Some(l) = v.pop_back() {
                    out.push(l);
                }
            }
            *held = out;
        };
        interleave(&mut held_single);
        interleave(&mut held_batched);
        let took_now = |t: &str| took(t, round);
        one_round(
            &single,
            &batched,
            (&mut held_single, &mut held_batched),
            k,
            &took_now,
        )
        .await;
        assert_eq!(
            served_ids(&held_single),
            served_ids(&held_batched),
            "round {round}: a batch of {k} served other envelopes than {k} single leases"
        );
        assert_eq!(
            state(&single, all.clone()).await,
            state(&batched, all.clone()).await,
            "round {round}: a batch of {k} left another ring or tenant state than {k} single calls"
        );
        served += held_batched.len();
        runs += held_batched
            .windows(2)
            .filter(|w| w[0].tenant == w[1].tenant)
            .count();
        if held_single.is_empty() {
            break;
        }
    }
    assert!(served >= 150, "the backlog was served: {served}");
    assert!(runs > 20, "tenants were served runs: {runs} repeats");
    // the four lost records were dead-lettered, in both queues alike
    for s in [&single, &batched] {
        let stats = s.tenant_stats(Q, Duration::from_secs(600)).await.unwrap();
        let dead: u64 = stats.iter().map(|x| x.failed).sum();
        assert_eq!(dead, 4, "{stats:?}");
    }
}

/// Fairness in worker-seconds at k = 16: a tenant whose deliveries take
/// ten times as long gets a tenth of the deliveries and the same
/// worker-seconds. The cap (32) is above the 16 in flight, so the shares
/// are deficit round robin's. (With a cap that binds, a tenant parked at
/// it loses the rest of its turn, with a batch of 16 as with 16 single
/// workers: `a_batch_serves_the_tenants_k_single_leases_would`.)
pub async fn fairness_in_worker_seconds_holds_in_batches(url: &str) {
    let s = store(
        url,
        QueuePolicy {
            max_in_flight: 32,
            ..Default::default()
        },
    )
    .await;
    fill(&s, Q, "slow", 3000).await;
    fill(&s, Q, "fast", 3000).await;
    let took = |t: &str| Duration::from_millis(if t == "slow" { 200 } else { 20 });
    let (secs, count, _) = deliver(&s, 16, 1500, took).await;
    let (a, b) = (secs["slow"], secs["fast"]);
    eprintln!(
        "k=16: worker-seconds slow={a:.2} fast={b:.2}; deliveries slow={} fast={}",
        count["slow"], count["fast"]
    );
    assert!(
        (a - b).abs() / a.max(b) < 0.20,
        "worker-seconds not within 20% at k=16: slow={a} fast={b}"
    );
    assert!(
        count["fast"] > 5 * count["slow"],
        "the fast tenant gets many more deliveries: {count:?}"
    );
    // attribution, gathered per tenant per call, agrees with the deliveries
    let stats = s.tenant_stats(Q, Duration::from_secs(600)).await.unwrap();
    for t in ["slow", "fast"] {
        let st = stats.iter().find(|x| x.tenant == t).unwrap();
        assert!(
            (st.worker_seconds - secs[t]).abs() < 1e-6,
            "{st:?} against {}",
            secs[t]
        );
    }
}

/// Weights at k = 16: weight 3 gets three times the worker-seconds.
pub async fn weights_hold_in_batches(url: &str) {
    let mut policy = QueuePolicy {
        max_in_flight: 32,
        ..Default::default()
    };
    policy.weights.insert("gold".into(), 3.0);
    let s = store(url, policy).await;
    fill(&s, Q, "gold", 2000).await;
    fill(&s, Q, "plain", 2000).await;
    let (secs, _, _) = deliver(&s, 16, 800, |_| Duration::from_millis(100)).await;
    let ratio = secs["gold"] / secs["plain"];
    assert!(
        (2.4..=3.6).contains(&ratio),
        "weight 3 gets about 3x the worker-seconds at k=16, got {ratio:.2}"
    );
}

/// A hostile batch settles nothing it should not: a lease named twice in
/// one call is acked once (the tenant's in-flight count and delivered
/// count move by one); a lease rewritten to name another tenant, or a
/// lease made up, is STALE; and a call with too many, or malformed, arguments
/// fails before its first write (the acks it carried are not made).
pub async fn a_hostile_batch_settles_nothing_twice(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    fill(&s, Q, "a", 4).await;
    fill(&s, Q, "b", 4).await;
    let first = s.lease_batch(Q, &[], 4, "w", LEASE).await.unwrap();
    assert_eq!(first.leased.len(), 4);
    let l = first.leased[0].clone();
    let other = first
        .leased
        .iter()
        .find(|x| x.tenant != l.tenant)
        .unwrap()
        .clone();
    // the same lease twice, and one rewritten to name the other tenant
    // (an ack carries its lease alone: the lease names the envelope)
    let mut forged = l.clone();
    forged.token = l.token.replacen(
        &format!("\n{}\n", l.tenant),
        &format!("\n{}\n", other.tenant),
        1,
    );
    assert_ne!(forged.token, l.token);
    let mut made_up = l.clone();
    made_up.token = format!("1\n1\n{}\n{}\nnobody", l.id, l.tenant);
    let d = Duration::from_millis(5);
    let answer = s
        .lease_batch(
            Q,
            &[(&l, d), (&l, d), (&forged, d), (&made_up, d)],
            0,
            "w",
            LEASE,
        )
        .await
        .unwrap();
    let acked: Vec<bool> = answer.acked.iter().map(|a| a.acked).collect();
    assert_eq!(acked, [true, false, false, false]);
    let state = s.tenant_state(Q, &l.tenant).await.unwrap();
    let before = first.leased.iter().filter(|x| x.tenant == l.tenant).count() as u64;
    assert_eq!(state.in_flight, before - 1, "one slot freed: {state:?}");
    let stats = s.tenant_stats(Q, Duration::from_secs(600)).await.unwrap();
    let st = stats.iter().find(|x| x.tenant == l.tenant).unwrap();
    assert_eq!(st.delivered, 1, "delivered once: {st:?}");
    assert!((st.worker_seconds - 0.005).abs() < 1e-9, "{st:?}");
    // the other tenant's lease is still held and acks once
    let again = s
        .lease_batch(Q, &[(&other, d)], 0, "w", LEASE)
        .await
        .unwrap();
    assert!(again.acked[0].acked);

    // too many each way: refused before Redis
    let many = vec![(&first.leased[1], d); LEASE_BATCH_MAX + 1];
    assert!(matches!(
        s.lease_batch(Q, &many, 1, "w", LEASE).await,
        Err(StoreError::InvalidBatch(_))
    ));
    assert!(matches!(
        s.lease_batch(Q, &[], LEASE_BATCH_MAX + 1, "w", LEASE).await,
        Err(StoreError::InvalidBatch(_))
    ));
    // and by the script, before its first write, when called directly
    let held = &first.leased[1];
    let fcall = |k: &str, n: &str, extra: &[&str]| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(s.function_name("lease_batch"))
            .arg(2)
            .arg(s.queue_prefix(Q))
            .arg(keys::slot_guard(&s.queue_prefix(Q)))
            .arg("60000")
            .arg("hostile")
            .arg("256")
            .arg(k)
            .arg(n);
        for a in extra {
            cmd.arg(*a);
        }
        cmd
    };
    let token = held.token.clone();
    for (k, n, extra) in [
        ("65", "1", vec![token.as_str(), "5000"]),
        ("1", "1", vec![token.as_str(), "soon"]),
        ("1", "2", vec![token.as_str(), "5000"]),
        ("-1", "1", vec![token.as_str(), "5000"]),
        ("1.5", "1", vec![token.as_str(), "5000"]),
    ] {
        let v = super::dataplane::raw_result(url, fcall(k, n, &extra)).await;
        let err = v.expect_err("a malformed batch is an error");
        assert!(err.contains("lease_batch"), "{err}");
    }
    // none of them acked it: it is still held, and acks once now
    let last = s.lease_batch(Q, &[(held, d)], 0, "w", LEASE).await.unwrap();
    assert!(last.acked[0].acked, "the malformed calls acked nothing");
}

/// A call whose numbers are not numbers (or not finite, or negative) fails
/// before its first write, whichever script it is: ack, ack_and_lease,
/// nack, lease and lease_batch each check their elapsed time, lease and
/// delay lengths and scan budget first. Before, ack and nack took the
/// lease out of P:leases and then failed on the elapsed time, so the
/// envelope's slot was never freed and a proper ack found its lease gone;
/// and `nan` or `inf`, which Lua's `tonumber` takes, were written into the
/// tenant's estimate and credit. A lease length past 2^40 ms and a token
/// with a newline are refused the same way by the three scripts that lease.
pub async fn a_malformed_call_fails_before_its_first_write(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    fill(&s, Q, "a", 4).await;
    let first = s.lease_batch(Q, &[], 2, "w", LEASE).await.unwrap();
    let held = first.leased[0].clone();
    let tenant_state = |s: &Store| {
        let key = keys::tenant(&s.queue_prefix(Q), "a");
        async move {
            let h: BTreeMap<String, String> = redis::from_redis_value(
                super::dataplane::raw(url, redis::cmd("HGETALL").arg(&key).clone()).await,
            )
            .unwrap();
            h
        }
    };
    let before = tenant_state(&s).await;
    let fcall = |name: &str, args: &[&str]| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(s.function_name(name))
            .arg(2)
            .arg(s.queue_prefix(Q))
            .arg(keys::slot_guard(&s.queue_prefix(Q)));
        for a in args {
            cmd.arg(*a);
        }
        cmd
    };
    let (id, token) = (held.id.as_str(), held.token.as_str());
    // a lease length past 2^40 ms (1e20 wrapped the deadline to -2^63: the
    // next maintenance reaped the lease and handed its envelope to a second
    // worker) and a token with a newline (under endpoint isolation its tail
    // read as the lease's endpoint, whose slot the ack then freed)
    let past_bounds: Vec<(&str, Vec<&str>)> = vec![
        ("lease", vec!["1e20", "t3", "256"]),
        ("lease", vec!["60000", "t3\nmain", "256"]),
        ("ack_lease", vec![id, token, "5000", "1e20", "t2", "256"]),
        (
            "ack_lease",
            vec![id, token, "5000", "60000", "t2\nmain", "256"],
        ),
        (
            "lease_batch",
            vec!["1e20", "t4", "256", "1", "1", token, "5000"],
        ),
        (
            "lease_batch",
            vec!["60000", "t4\nmain", "256", "1", "1", token, "5000"],
        ),
    ];
    for bad in ["soon", "nan", "inf", "-5"] {
        let calls: Vec<(&str, Vec<&str>)> = vec![
            ("ack", vec![id, token, bad]),
            ("ack_lease", vec![id, token, bad, "60000", "t2", "256"]),
            ("ack_lease", vec![id, token, "5000", bad, "t2", "256"]),
            ("ack_lease", vec![id, token, "5000", "60000", "t2", bad]),
            ("nack", vec![id, token, bad, "1000", "0", "boom", "1", "0"]),
            ("nack", vec![id, token, "5000", bad, "0", "boom", "1", "0"]),
            ("lease", vec![bad, "t3", "256"]),
            ("lease", vec!["60000", "t3", bad]),
            (
                "lease_batch",
                vec!["60000", "t4", "256", "1", "1", token, bad],
            ),
            (
                "lease_batch",
                vec![bad, "t4", "256", "1", "1", token, "5000"],
            ),
            (
                "lease_batch",
                vec!["60000", "t4", bad, "1", "1", token, "5000"],
            ),
        ];
        for (name, args) in calls.into_iter().chain(past_bounds.clone()) {
            let v = super::dataplane::raw_result(url, fcall(name, &args)).await;
            let err = v.expect_err(&format!("{name} {args:?} is an error"));
            assert!(err.contains(name), "{name}: {err}");
            assert_eq!(
                tenant_state(&s).await,
                before,
                "{name} {args:?} wrote the tenant's state before failing"
            );
        }
    }
    // none of them took the lease: it is still held, and acks once now
    let last = s
        .lease_batch(Q, &[(&held, Duration::from_millis(5))], 0, "w", LEASE)
        .await
        .unwrap();
    assert!(last.acked[0].acked, "a malformed call took the lease");
}

/// A batch looks at no more tenants than one lease may (the scan budget,
/// 256, is the batch's): with one tenant whose deliveries cost 200 quanta,
/// each lease takes about 200 steps of crediting, so a single lease finds
/// one envelope per call, and a batch of 64 must not find 64 in one call
/// (some 13,000 steps, one long stall of Redis) but stop short with AGAIN.
pub async fn a_batch_scans_no_more_than_one_lease_may(url: &str) {
    let s = store(
        url,
        QueuePolicy {
            quantum_seconds: 0.001,
            max_in_flight: 100,
            ..Default::default()
        },
    )
    .await;
    fill(&s, Q, "costly", 200).await;
    // teach the queue the tenant's cost: 200 ms a delivery, 200 quanta
    let mut taught = 0;
    while taught < 30 {
        match s.lease(Q, "w", LEASE).await.unwrap() {
            LeaseOutcome::Leased(l) => {
                assert!(s.ack(&l, Duration::from_millis(200)).await.unwrap());
                taught += 1;
            }
            LeaseOutcome::Again => {}
            other => panic!("{other:?}"),
        }
    }
    let mut leased = 0;
    for _ in 0..3 {
        let batch = s.lease_batch(Q, &[], 64, "w", LEASE).await.unwrap();
        leased += batch.leased.len();
        assert!(
            batch.leased.len() <= 2,
            "one call leased {} envelopes that cost 200 steps each",
            batch.leased.len()
        );
        assert_eq!(batch.short, Some(LeaseOutcome::Again));
    }
    assert!(leased >= 1, "the batches still make progress");
}

/// A worker-seconds bucket field that is not a whole number (written behind
/// the scripts' back: an operator's HSET, a restore of a bad dump) fails no
/// ack. Before, the ack's HINCRBY into it raised after the ack had taken
/// the lease and written the tenant's state, so the script stopped half
/// way: the record stayed, and the tenant's worker-seconds were not
/// counted. Each ack path (ack, ack_and_lease, lease_batch with one tenant
/// and with several) now acks, and the field holds a number again. An
/// elapsed time no delivery could take (a worker's clock gone wrong, 10^19
/// us) leaves whole numbers too: before, one share took '1e+19' and a
/// batch's sum formatted out of range.
pub async fn a_garbage_attribution_field_fails_no_ack(url: &str) {
    let s = store(url, QueuePolicy::default()).await;
    let p = s.queue_prefix(Q);
    for t in ["a", "b"] {
        fill(&s, Q, t, 5).await;
    }
    let mut leased = s.lease_batch(Q, &[], 6, "w", LEASE).await.unwrap().leased;
    assert_eq!(leased.len(), 6);
    // the buckets this test's acks may fall in: now's and the next
    let now: Vec<String> =
        redis::from_redis_value(super::dataplane::raw(url, redis::cmd("TIME").clone()).await)
            .unwrap();
    let bucket = now[0].parse::<u64>().unwrap() / 10;
    let spoil = || async {
        for b in [bucket, bucket + 1] {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(keys::worker_seconds(&p, b))
                .arg(&["a", "lots", "b", "9x"]);
            super::dataplane::raw(url, cmd).await;
        }
    };
    let took = Duration::from_millis(5);
    spoil().await;
    let one = leased.pop().unwrap();
    assert!(s.ack(&one, took).await.unwrap(), "ack");
    spoil().await;
    let one = leased.pop().unwrap();
    let (acked, _) = s.ack_and_lease(&one, took, "w", LEASE).await.unwrap();
    assert!(acked.acked, "ack_and_lease");
    spoil().await;
    let one = leased.pop().unwrap();
    let batch = s
        .lease_batch(Q, &[(&one, took)], 0, "w", LEASE)
        .await
        .unwrap();
    assert!(batch.acked[0].acked, "lease_batch, one ack");
    spoil().await;
    let done: Vec<_> = leased.iter().map(|l| (l, took)).collect();
    let batch = s.lease_batch(Q, &done, 0, "w", LEASE).await.unwrap();
    assert!(
        batch.acked.iter().all(|a| a.acked),
        "lease_batch, both tenants"
    );
    // every body acked is gone, and the buckets hold numbers
    let mut conn = super::stored::Conn::open(url).await;
    for l in leased {
        assert!(
            !conn.body_kept(&p, &l.tenant, &l.id).await,
            "{}'s body stayed",
            l.id
        );
    }
    // the last call acked both tenants in one of the two buckets
    let mut fixed = Vec::new();
    for b in [bucket, bucket + 1] {
        let mut cmd = redis::cmd("HVALS");
        cmd.arg(keys::worker_seconds(&p, b));
        let vals: Vec<String> =
            redis::from_redis_value(super::dataplane::raw(url, cmd).await).unwrap();
        fixed.push(vals.iter().all(|v| v.parse::<u64>().is_ok()));
    }
    assert!(fixed.contains(&true), "no bucket holds numbers again");
    // the huge elapsed time, on a clean slate
    for b in [bucket, bucket + 1] {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(keys::worker_seconds(&p, b));
        super::dataplane::raw(url, cmd).await;
    }
    // (ack_and_lease above leased one of the ten: three are left)
    let leased = s.lease_batch(Q, &[], 4, "w", LEASE).await.unwrap().leased;
    assert_eq!(leased.len(), 3);
    let huge = Duration::from_secs(10_000_000_000_000);
    assert!(s.ack(&leased[0], huge).await.unwrap());
    let done: Vec<_> = leased[1..].iter().map(|l| (l, huge)).collect();
    let batch = s.lease_batch(Q, &done, 0, "w", LEASE).await.unwrap();
    assert!(batch.acked.iter().all(|a| a.acked));
    let mut seen = 0;
    for b in [bucket, bucket + 1, bucket + 2] {
        let mut cmd = redis::cmd("HVALS");
        cmd.arg(keys::worker_seconds(&p, b));
        let vals: Vec<String> =
            redis::from_redis_value(super::dataplane::raw(url, cmd).await).unwrap();
        for v in &vals {
            let n: u64 = v.parse().unwrap_or_else(|_| panic!("bucket {b}: {v:?}"));
            assert!(n <= 1 << 53, "bucket {b}: {n}");
        }
        seen += vals.len();
    }
    assert!(seen >= 2, "the huge acks were not counted");
}
