//! `lanekeeper worker` end to end: real worker processes, a real redis-server
//! and a local HTTP receiver that checks every signature on its own.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lanekeeper::policy::{BreakerPolicy, QueuePolicy};
use lanekeeper::signing::Secret;
use support::scenario::{envelope, setup, small_tenant_scenario, stop, wait_percentiles, Q};

#[tokio::test]
async fn deliveries_are_signed_with_every_secret_and_all_arrive() {
    let s = setup(QueuePolicy::default()).await;
    s.endpoint("rotating", "ok", 2).await;
    s.endpoint("plain", "ok", 1).await;
    s.send("rotating", 0..150).await;
    s.send("plain", 0..150).await;
    let metrics_port = support::process::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let pid = s.worker(&["--concurrency", "8", "--metrics-addr", &metrics_addr]);
    s.wait_for_accepted(300, Duration::from_secs(60)).await;
    assert_eq!(
        s.receiver.bad_signatures(),
        0,
        "a signature failed the receiver's own check"
    );

    let http = reqwest::Client::new();
    let health = http
        .get(format!("http://{metrics_addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert!(health.status().is_success());
    let metrics = http
        .get(format!("http://{metrics_addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"lanekeeper_deliveries_total{queue="shard-00",class="delivered"} 300"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"lanekeeper_queue_wait_seconds_count{queue="shard-00",tenant="rotating"} 150"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("lanekeeper_delivery_duration_seconds_bucket"),
        "{metrics}"
    );
    // every lease went through a batched call: the calls asked for at
    // least the 300 delivered
    let series = |name: &str| -> f64 {
        let prefix = format!("{name}{{queue=\"shard-00\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {name}: {metrics}"))
            .trim()
            .parse()
            .unwrap()
    };
    let (calls, asked) = (
        series("lanekeeper_lease_batch_size_count"),
        series("lanekeeper_lease_batch_size_sum"),
    );
    assert!(
        asked >= 300.0 && calls >= 1.0,
        "calls {calls}, asked {asked}"
    );
    eprintln!("lease batches: {calls} calls asked for {asked} deliveries");
    stop(pid);
}

#[tokio::test]
async fn per_tenant_order_holds_with_four_workers_and_a_flaky_receiver() {
    let policy = QueuePolicy {
        ordered: true,
        max_attempts: 100,
        ..Default::default()
    };
    let s = setup(policy).await;
    let tenants: Vec<String> = (0..5).map(|i| format!("ordered{i}")).collect();
    for t in &tenants {
        s.endpoint(t, "flaky-10", 1).await;
        s.send(t, 0..2000).await;
    }
    let pids: Vec<u32> = (0..4).map(|_| s.worker(&["--concurrency", "8"])).collect();
    s.wait_for_accepted(10_000, Duration::from_secs(180)).await;
    let arrivals = s.receiver.arrivals();
    let failed = arrivals.iter().filter(|a| !a.accepted).count();
    for t in &tenants {
        let seqs: Vec<u64> = arrivals
            .iter()
            .filter(|a| a.accepted && &a.tenant == t)
            .map(|a| a.seq)
            .collect();
        assert_eq!(
            seqs,
            (0..2000).collect::<Vec<_>>(),
            "{t}: accepted out of order or duplicated"
        );
    }
    eprintln!("ordering: 10000 delivered in order across 4 workers; {failed} requests failed and were retried");
    assert!(
        failed > 500,
        "the receiver should have failed about 10% ({failed})"
    );
    for pid in pids {
        stop(pid);
    }
}

#[tokio::test]
async fn sigkill_twenty_times_loses_nothing() {
    let s = setup(QueuePolicy::default()).await;
    let tenants: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    for t in &tenants {
        s.endpoint(t, "delay-2", 1).await;
        s.send(t, 0..2000).await;
    }
    let flags = ["--concurrency", "16", "--delivery-timeout", "2s"];
    let mut pids: Vec<u32> = (0..3).map(|_| s.worker(&flags)).collect();
    for kill in 0..20 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let victim = pids.remove(kill % pids.len());
        support::process::signal(victim, libc::SIGKILL);
        pids.push(s.worker(&flags));
    }
    s.wait_for_accepted(20_000, Duration::from_secs(240)).await;
    let accepted = s.accepted();
    let expected: BTreeSet<String> = tenants
        .iter()
        .flat_map(|t| (0..2000).map(move |i| format!("{t}-{i}")))
        .collect();
    let got: BTreeSet<String> = accepted.keys().cloned().collect();
    assert_eq!(got, expected, "envelopes lost");
    let duplicates: usize = accepted.values().map(|n| n - 1).sum();
    eprintln!("sigkill: 20 kills, 20000 envelopes, all received; {duplicates} duplicates (in flight at a kill)");
    for pid in pids {
        stop(pid);
    }
}

#[tokio::test]
async fn ssrf_targets_are_refused_with_a_clear_dead_letter() {
    let s = setup(QueuePolicy::default()).await;
    let port = s.receiver.addr.port();
    let secret = || vec![Secret::generate()];
    s.endpoint_at(
        "loop",
        &format!("http://127.0.0.1:{port}/t/loop/ok"),
        secret(),
    )
    .await;
    s.endpoint_at(
        "byname",
        &format!("http://localhost:{port}/t/byname/ok"),
        secret(),
    )
    .await;
    s.endpoint_at("private", "http://10.0.0.1/hook", secret())
        .await;
    s.endpoint_at(
        "metadata",
        "http://169.254.169.254/latest/meta-data",
        secret(),
    )
    .await;
    for t in ["loop", "byname", "private", "metadata"] {
        s.send(t, 0..1).await;
    }
    // No allowlist: the default a production worker runs with.
    let pid = support::workers::spawn(&s.redis_url, &s.set, "shard-00", &["--concurrency", "4"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead = loop {
        let mut dead = Vec::new();
        for t in ["loop", "byname", "private", "metadata"] {
            dead.extend(s.store.dead_letters(Q, t, None, 10).await.unwrap().letters);
        }
        if dead.len() == 4 {
            break dead;
        }
        assert!(Instant::now() < deadline, "dead letters: {dead:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cause = |t: &str| dead.iter().find(|d| d.tenant == t).unwrap().cause.clone();
    assert!(
        cause("loop").contains("127.0.0.1 is loopback"),
        "{}",
        cause("loop")
    );
    assert!(
        cause("byname").contains("loopback") && cause("byname").contains("localhost"),
        "{}",
        cause("byname")
    );
    assert!(
        cause("private").contains("10.0.0.1 is private"),
        "{}",
        cause("private")
    );
    assert!(
        cause("metadata").contains("link-local"),
        "{}",
        cause("metadata")
    );
    assert!(dead
        .iter()
        .all(|d| d.attempts == 1 && d.cause.starts_with("SSRF guard refused")));
    assert!(
        s.receiver.arrivals().is_empty(),
        "a refused request reached the receiver"
    );
    stop(pid);
}

#[tokio::test]
async fn breaker_opens_for_a_dead_endpoint_and_a_probe_closes_it() {
    let policy = QueuePolicy {
        max_attempts: 1000,
        breaker: BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 5,
            window: Duration::from_secs(60),
            open_for: Duration::from_secs(1),
        },
        ..Default::default()
    };
    let s = setup(policy).await;
    s.endpoint("down", "gate", 1).await;
    s.endpoint("up", "ok", 1).await;
    s.send("down", 0..40).await;
    s.send("up", 0..400).await;
    let metrics_addr = format!("127.0.0.1:{}", support::process::free_port());
    let pid = s.worker(&["--concurrency", "4", "--metrics-addr", &metrics_addr]);
    s.wait_for_accepted(400, Duration::from_secs(60)).await;
    let down_requests = s.receiver.requests_for("down");
    eprintln!("breaker: {down_requests} requests reached the dead endpoint while 400 others were delivered");
    assert!(
        down_requests < 25,
        "an open breaker should stop requests to the dead endpoint: {down_requests}"
    );
    // Recovery: the next probe succeeds and the tenant flows again.
    s.receiver.open_gate();
    s.wait_for_accepted(440, Duration::from_secs(60)).await;
    let metrics = reqwest::get(format!("http://{metrics_addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for state in ["open", "half-open", "closed"] {
        assert!(
            metrics.contains(&format!(
                r#"lanekeeper_breaker_transitions_total{{queue="shard-00",state="{state}"}}"#
            )),
            "no {state} transition counted:\n{metrics}"
        );
    }
    stop(pid);
}

#[tokio::test]
async fn sigterm_finishes_or_releases_in_flight_and_exits_zero() {
    let s = setup(QueuePolicy::default()).await;
    s.endpoint("slow", "delay-3000", 1).await;
    s.send("slow", 0..4).await;
    let pid = s.worker(&[
        "--concurrency",
        "4",
        "--grace-period",
        "500ms",
        "--delivery-timeout",
        "10s",
    ]);
    // All four are in flight at the receiver.
    let deadline = Instant::now() + Duration::from_secs(20);
    while s.store.tenant_state(Q, "slow").await.unwrap().in_flight < 4 {
        assert!(
            Instant::now() < deadline,
            "the worker never leased the envelopes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    stop(pid);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "grace period not honoured: {took:?}"
    );
    // Released at once, not left for the reaper, and no attempt counted.
    let st = s.store.tenant_state(Q, "slow").await.unwrap();
    assert_eq!((st.queued, st.in_flight), (4, 0), "{st:?}");
    let pid = s.worker(&["--concurrency", "4", "--delivery-timeout", "10s"]);
    s.wait_for_accepted(4, Duration::from_secs(30)).await;
    assert!(s
        .store
        .dead_letters(Q, "slow", None, 10)
        .await
        .unwrap()
        .letters
        .is_empty());
    stop(pid);
}

#[tokio::test]
async fn small_tenant_wait_does_not_grow_with_the_whale_backlog() {
    let (alone50, alone99, _) = small_tenant_scenario(0, false).await;
    let (fair50, fair99, fair_drain) = small_tenant_scenario(100_000, false).await;
    let (fifo50, fifo99, fifo_drain) = small_tenant_scenario(100_000, true).await;
    eprintln!("small tenant wait, ms (p50 / p99): alone {alone50} / {alone99}; behind a 100000-envelope whale: fair {fair50} / {fair99} (whale drained in {fair_drain:?}); single FIFO {fifo50} / {fifo99} (drained in {fifo_drain:?})");
    // A ratio against the run alone, measured in this test. The p99 of 50
    // waits is their largest, so it is floored by the machine's own typical
    // wait (3 x the p50 alone) rather than by a number of milliseconds
    // tuned on one machine: a machine twice as slow doubles both sides.
    let floor = alone99.max(3 * alone50);
    assert!(
        fair99 <= 2 * floor,
        "small tenant p99 {fair99} ms behind the whale vs {alone99} ms alone (p50 {alone50} ms)"
    );
    assert!(
        fifo99 > 10 * fair99,
        "the FIFO baseline should show head-of-line blocking"
    );
}

#[tokio::test]
async fn a_slow_endpoint_with_cap_two_barely_moves_the_others() {
    async fn others_p99(with_slow: bool) -> (u64, u64) {
        let policy = QueuePolicy {
            max_in_flight: 2,
            ..Default::default()
        };
        let s = setup(policy).await;
        s.endpoint("slow", "delay-10000", 1).await;
        for t in 0..5 {
            s.endpoint(&format!("other{t}"), "delay-5", 1).await;
        }
        if with_slow {
            s.send("slow", 0..200).await;
        }
        let pid = s.worker(&["--concurrency", "8", "--delivery-timeout", "15s"]);
        for i in 0..40u64 {
            for t in 0..5 {
                let e = envelope(&format!("other{t}"), i);
                s.store.enqueue(Q, &e).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while s
            .accepted()
            .keys()
            .filter(|id| id.starts_with("other"))
            .count()
            < 200
        {
            assert!(
                Instant::now() < deadline,
                "the other tenants' events did not all arrive"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r = wait_percentiles(&s.receiver, "other");
        support::process::signal(pid, libc::SIGKILL);
        r
    }
    // Rounds alternate without and with the slow tenant, so that load from
    // elsewhere on the machine falls on both alike; the medians are compared.
    let (mut base, mut slow) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        base.push(others_p99(false).await);
        slow.push(others_p99(true).await);
    }
    let median = |v: &[(u64, u64)], f: fn(&(u64, u64)) -> u64| {
        let mut x: Vec<u64> = v.iter().map(f).collect();
        x.sort();
        x[x.len() / 2]
    };
    let (base50, base99) = (median(&base, |r| r.0), median(&base, |r| r.1));
    let (slow50, slow99) = (median(&slow, |r| r.0), median(&slow, |r| r.1));
    eprintln!("other tenants' wait, ms (p50 / p99, median of 3 alternating rounds): without the slow tenant {base50} / {base99}; with a 10 s endpoint capped at 2 in flight {slow50} / {slow99} (rounds: {base:?} vs {slow:?})");
    // Mechanism: the cap leaves 6 of the worker's 8 slots to the others, who
    // need about one (5 ms each, 100 a second); were the cap not honoured,
    // the slow tenant would take all 8 for 10 s and the others would wait
    // seconds. So the others' p99 may not more than double, floored by the
    // machine's own typical wait (3 x the p50 without the slow tenant), not
    // by a number of milliseconds tuned on one machine.
    let floor = base99.max(3 * base50);
    assert!(
        slow99 <= 2 * floor,
        "a 10 s endpoint moved the others' p99 from {base99} to {slow99} ms (p50 {base50} ms)"
    );
}

// ---- receiver pacing (Retry-After), issue 20 ---------------------------

/// Register endpoint `name` of `tenant` at the receiver with `mode`, signed
/// with the tenant's one secret (made at its first endpoint).
async fn pace_endpoint(s: &support::scenario::Setup, tenant: &str, name: &str, mode: &str) {
    static SECRETS: std::sync::Mutex<BTreeSet<(String, String)>> =
        std::sync::Mutex::new(BTreeSet::new());
    let secret = {
        let mut known = SECRETS.lock().unwrap();
        let key = format!("{}/{tenant}", s.set);
        match known.iter().find(|(k, _)| *k == key) {
            Some((_, secret)) => secret.clone(),
            None => {
                let secret = Secret::generate();
                known.insert((key, secret.clone()));
                secret
            }
        }
    };
    s.receiver
        .expect_secrets(tenant, std::slice::from_ref(&secret));
    let ep = lanekeeper::endpoint::Endpoint {
        url: s.receiver.url(tenant, mode),
        secrets: vec![secret],
        enabled: true,
        event_types: vec![],
    };
    s.store.put_endpoint(tenant, name, &ep).await.unwrap();
}

/// Enqueue `n` envelopes of `tenant` for endpoint `name`, ids `<tenant>-<name>-<i>`.
async fn pace_send(s: &support::scenario::Setup, tenant: &str, name: &str, n: u64) {
    let envs: Vec<_> = (0..n)
        .map(|i| lanekeeper::envelope::Envelope {
            id: format!("{tenant}-{name}-{i}"),
            endpoint: Some(name.to_string()),
            ..envelope(tenant, i)
        })
        .collect();
    for r in s.store.enqueue_batch(Q, &envs).await.unwrap() {
        r.unwrap();
    }
}

/// Arrivals at the receiver for `mode`, in order of arrival.
fn pace_arrivals(s: &support::scenario::Setup, mode: &str) -> Vec<support::receiver::Arrival> {
    let mut a: Vec<_> = s
        .receiver
        .arrivals()
        .into_iter()
        .filter(|a| a.mode == mode)
        .collect();
    a.sort_by_key(|a| a.at_ms);
    a
}

/// The answer that carried `Retry-After`, and every request after it, for
/// `mode`, once `total` requests arrived there (bounded wait).
async fn pace_answer_and_after(
    s: &support::scenario::Setup,
    mode: &str,
    accepted: usize,
) -> (support::receiver::Arrival, Vec<support::receiver::Arrival>) {
    s.wait_for_accepted(accepted, Duration::from_secs(30)).await;
    let all = pace_arrivals(s, mode);
    let first = all
        .iter()
        .position(|a| a.retry_after.is_some())
        .expect("the receiver answered with Retry-After");
    let after = all[first + 1..].to_vec();
    (all[first].clone(), after)
}

async fn pace_metrics(addr: &str) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn pace_retry_after_seconds_holds_the_endpoint_for_the_time_asked() {
    // One in flight: the requests to the endpoint are sequential, so every
    // one after the 429 was sent after the pause was set.
    let s = setup(QueuePolicy {
        max_in_flight: 1,
        ..Default::default()
    })
    .await;
    let mode = "retry-429-1-2";
    pace_endpoint(&s, "sec", "default", mode).await;
    pace_send(&s, "sec", "default", 5).await;
    let pid = s.worker(&["--concurrency", "4"]);
    let (answer, after) = pace_answer_and_after(&s, mode, 5).await;
    let gaps: Vec<i64> = after
        .iter()
        .map(|a| a.at_ms as i64 - answer.at_ms as i64)
        .collect();
    eprintln!("pace (Retry-After: 2): requests after the 429 came at +{gaps:?} ms");
    assert_eq!(
        after.len(),
        5,
        "the paced envelope and the four others arrive once each"
    );
    assert!(
        gaps.iter().all(|g| *g >= 2000),
        "a request reached the endpoint before the 2 s it asked for: {gaps:?}"
    );
    // ... and the pause is what it asked, not much more (the worker's max
    // backoff here is 200 ms, so this is the receiver's time being honoured).
    assert!(gaps[0] < 2000 + 3000, "{gaps:?}");
    stop(pid);
}

#[tokio::test]
async fn pace_retry_after_http_date_holds_the_endpoint_until_that_date() {
    let s = setup(QueuePolicy {
        max_in_flight: 1,
        ..Default::default()
    })
    .await;
    let mode = "retry-503-1-date2000";
    pace_endpoint(&s, "date", "default", mode).await;
    pace_send(&s, "date", "default", 5).await;
    let pid = s.worker(&["--concurrency", "4"]);
    let (answer, after) = pace_answer_and_after(&s, mode, 5).await;
    let date = answer.retry_after.clone().unwrap();
    let until = httpdate::parse_http_date(&date)
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let gaps: Vec<i64> = after
        .iter()
        .map(|a| a.at_ms as i64 - until as i64)
        .collect();
    eprintln!(
        "pace (Retry-After: {date}, {} ms after the answer): requests came at {gaps:?} ms from that date",
        until - answer.at_ms
    );
    assert!(until >= answer.at_ms + 2000);
    assert_eq!(after.len(), 5);
    assert!(
        gaps.iter().all(|g| *g >= 0),
        "a request reached the endpoint before the date it asked for: {gaps:?}"
    );
    assert!(gaps[0] < 3000, "{gaps:?}");
    stop(pid);
}

#[tokio::test]
async fn pace_one_paced_endpoint_leaves_the_tenants_others_flowing() {
    // One in flight for the whole tenant, so the endpoint's pause is all that
    // could let the other endpoint's envelopes pass it (unordered policy).
    let s = setup(QueuePolicy {
        max_in_flight: 1,
        ..Default::default()
    })
    .await;
    let paced = "retry-429-1-3";
    pace_endpoint(&s, "mixed", "slow", paced).await;
    pace_endpoint(&s, "mixed", "default", "ok").await;
    // the paced endpoint's envelopes are ahead in the tenant's lane
    pace_send(&s, "mixed", "slow", 3).await;
    pace_send(&s, "mixed", "default", 100).await;
    let pid = s.worker(&["--concurrency", "4"]);
    let (answer, after) = pace_answer_and_after(&s, paced, 103).await;
    let ok = pace_arrivals(&s, "ok");
    let during = ok
        .iter()
        .filter(|a| a.at_ms >= answer.at_ms && a.at_ms < answer.at_ms + 3000)
        .count();
    let paced_gaps: Vec<i64> = after
        .iter()
        .map(|a| a.at_ms as i64 - answer.at_ms as i64)
        .collect();
    eprintln!("pace: while one endpoint was paced for 3 s, the tenant's other endpoint received {during} of 100; the paced one's requests came at +{paced_gaps:?} ms");
    assert_eq!(
        during, 100,
        "the tenant's other endpoint stopped while one was paced"
    );
    assert_eq!(after.len(), 3);
    assert!(paced_gaps.iter().all(|g| *g >= 3000), "{paced_gaps:?}");
    stop(pid);
}

#[tokio::test]
async fn pace_paced_answers_do_not_open_the_breaker() {
    // A breaker this eager would open at the third failure of five and stay
    // open for a minute: the paced 429s must not count.
    let s = setup(QueuePolicy {
        max_attempts: 100,
        breaker: BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 3,
            window: Duration::from_secs(60),
            open_for: Duration::from_secs(60),
        },
        ..Default::default()
    })
    .await;
    let mode = "retry-429-12-1";
    pace_endpoint(&s, "brk", "default", mode).await;
    pace_send(&s, "brk", "default", 10).await;
    let metrics_addr = format!("127.0.0.1:{}", support::process::free_port());
    let pid = s.worker(&["--concurrency", "8", "--metrics-addr", &metrics_addr]);
    let started = Instant::now();
    // Bounded: an open breaker would hold the endpoint for 60 s.
    s.wait_for_accepted(10, Duration::from_secs(20)).await;
    let took = started.elapsed();
    let paced = pace_arrivals(&s, mode)
        .iter()
        .filter(|a| a.retry_after.is_some())
        .count();
    let metrics = pace_metrics(&metrics_addr).await;
    eprintln!("pace: {paced} paced 429s, all 10 delivered in {took:?}");
    assert_eq!(paced, 12);
    assert!(took < Duration::from_secs(20));
    assert!(
        !metrics.contains(r#"state="open""#),
        "the breaker opened on paced answers:\n{metrics}"
    );
    stop(pid);
}

#[tokio::test]
async fn pace_is_bounded_by_max_retry_after() {
    let s = setup(QueuePolicy {
        max_in_flight: 1,
        max_retry_after: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let mode = "retry-429-1-86400";
    pace_endpoint(&s, "day", "default", mode).await;
    pace_send(&s, "day", "default", 3).await;
    let pid = s.worker(&["--concurrency", "2"]);
    let (answer, after) = pace_answer_and_after(&s, mode, 3).await;
    let gaps: Vec<i64> = after
        .iter()
        .map(|a| a.at_ms as i64 - answer.at_ms as i64)
        .collect();
    eprintln!(
        "pace (Retry-After: 86400, maxRetryAfter 1s): requests after the 429 came at +{gaps:?} ms"
    );
    assert_eq!(after.len(), 3);
    assert!(gaps.iter().all(|g| *g >= 1000), "{gaps:?}");
    assert!(
        gaps[0] < 1000 + 2500,
        "maxRetryAfter did not bound the pause: {gaps:?}"
    );
    stop(pid);
}

#[tokio::test]
async fn pace_hostile_retry_after_values_neither_crash_nor_pause_beyond_the_max() {
    // Huge, 10 kB, negative and non-ASCII values, each on an endpoint of its
    // own tenant; maxRetryAfter 1s bounds whatever is read as a pause.
    let s = setup(QueuePolicy {
        max_in_flight: 1,
        max_retry_after: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let modes = [
        ("big", "retry-429-1-big", true),
        ("huge", "retry-503-1-huge", true),
        ("neg", "retry-429-1-neg", false),
        ("bin", "retry-429-1-bin", false),
    ];
    for (t, mode, _) in modes {
        pace_endpoint(&s, t, "default", mode).await;
        pace_send(&s, t, "default", 2).await;
    }
    let pid = s.worker(&["--concurrency", "4"]);
    s.wait_for_accepted(8, Duration::from_secs(30)).await;
    for (t, mode, paced) in modes {
        let all = pace_arrivals(&s, mode);
        let answer = all.iter().find(|a| a.retry_after.is_some()).unwrap();
        let retried = all
            .iter()
            .find(|a| a.id == answer.id && a.accepted)
            .unwrap();
        let gap = retried.at_ms - answer.at_ms;
        eprintln!("pace: hostile Retry-After ({t}): retried after {gap} ms");
        assert!(
            gap <= 1000 + 2500,
            "{t}: paused beyond maxRetryAfter: {gap} ms"
        );
        if paced {
            assert!(
                gap >= 1000,
                "{t}: read as a pause, so held for the max: {gap} ms"
            );
        }
    }
    // the worker is still alive and exits cleanly
    stop(pid);
}

/// Tier weights with real workers under contention: one shard, one worker
/// process, four backlogged tenants with the same endpoint delay. The tenant
/// in the tier of weight 4 gets four times the worker-seconds (attribution,
/// as the workers measured them) of the one in the tier of weight 1, within
/// 25%; a tenant with no tier, and one in a tier without a weight, get the
/// default weight 1.
#[tokio::test]
async fn a_tier_of_weight_four_gets_four_times_the_worker_seconds() {
    use lanekeeper::store::{TenantTerms, TierUpdate};
    let mut policy = QueuePolicy {
        quantum_seconds: 0.1,
        ..Default::default()
    };
    policy.tier_weights.insert("gold".into(), 4.0);
    policy.tier_weights.insert("basic".into(), 1.0);
    let s = setup(policy).await;
    let tenants = [
        ("gold", Some("gold")),
        ("basic", Some("basic")),
        ("none", None),
        ("unlisted", Some("platinum")),
    ];
    for (t, tier) in tenants {
        s.endpoint(t, "delay-10", 1).await;
        let envs: Vec<_> = (0..3000).map(|i| envelope(t, i)).collect();
        for chunk in envs.chunks(1000) {
            let terms = |_: &str| TenantTerms {
                backlog_limit: None,
                tier: tier.map_or(TierUpdate::Keep, |x| TierUpdate::Set(x.into())),
            };
            for r in s
                .store
                .enqueue_batch_routed(Q, chunk, terms, 0)
                .await
                .unwrap()
            {
                r.unwrap();
            }
        }
    }
    let pid = s.worker(&["--concurrency", "4"]);
    s.wait_for_accepted(1400, Duration::from_secs(60)).await;
    stop(pid);
    let stats = s
        .store
        .tenant_stats(Q, Duration::from_secs(600))
        .await
        .unwrap();
    let secs = |t: &str| {
        stats
            .iter()
            .find(|x| x.tenant == t)
            .map_or(0.0, |x| x.worker_seconds)
    };
    let (gold, basic, none, unlisted) =
        (secs("gold"), secs("basic"), secs("none"), secs("unlisted"));
    eprintln!(
        "tiers with a real worker: worker-seconds gold {gold:.2}, basic {basic:.2}, no tier {none:.2}, unlisted tier {unlisted:.2}; gold/basic {:.2}",
        gold / basic
    );
    assert!(
        (3.0..=5.0).contains(&(gold / basic)),
        "gold/basic {:.2}",
        gold / basic
    );
    for (what, x) in [("no tier", none), ("unlisted tier", unlisted)] {
        assert!(
            (0.75..=1.25).contains(&(x / basic)),
            "{what}/basic {:.2}",
            x / basic
        );
    }
}

/// Arrivals of `tenant` accepted within [from, to) ms.
fn accepted_between(
    arrivals: &[support::receiver::Arrival],
    tenant: &str,
    from: u64,
    to: u64,
) -> usize {
    arrivals
        .iter()
        .filter(|a| a.accepted && a.tenant == tenant && a.at_ms >= from && a.at_ms < to)
        .count()
}

#[tokio::test]
async fn a_tenant_limited_to_50_per_second_gets_50_and_the_other_gets_the_rest_of_the_pool() {
    let policy = QueuePolicy {
        rate_limits: lanekeeper::policy::RateLimits {
            tenants: [(
                "limited".to_string(),
                lanekeeper::policy::RateLimit {
                    per_second: 50.0,
                    burst: 5.0,
                    ..Default::default()
                },
            )]
            .into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let s = setup(policy).await;
    s.endpoint("limited", "delay-20", 1).await;
    s.endpoint("free", "delay-20", 1).await;
    s.send("limited", 0..400).await;
    s.send("free", 0..6000).await;
    let pid = s.worker(&["--concurrency", "8"]);
    s.wait_for_accepted(6400, Duration::from_secs(120)).await;
    stop(pid);
    let arrivals = s.receiver.arrivals();
    let first = arrivals.iter().map(|a| a.at_ms).min().unwrap();
    let last_limited = arrivals
        .iter()
        .filter(|a| a.tenant == "limited")
        .map(|a| a.at_ms)
        .max()
        .unwrap();
    let last_free = arrivals
        .iter()
        .filter(|a| a.tenant == "free")
        .map(|a| a.at_ms)
        .max()
        .unwrap();
    // While both have work (the limited tenant's 400 take 8 s): 50/s ± 10%,
    // measured over 5 s after the first second.
    let (from, to) = (first + 1000, first + 6000);
    let limited_rate = accepted_between(&arrivals, "limited", from, to) as f64 / 5.0;
    let together = (accepted_between(&arrivals, "limited", from, to)
        + accepted_between(&arrivals, "free", from, to)) as f64
        / 5.0;
    // The pool's rate with the free tenant alone, after the limited one is done.
    assert!(
        last_free > last_limited + 2500,
        "the free tenant's backlog ran out too early to measure the pool alone"
    );
    let alone = accepted_between(&arrivals, "free", last_limited + 500, last_free - 500) as f64
        / ((last_free - last_limited - 1000) as f64 / 1000.0);
    eprintln!(
        "rate limit: limited {limited_rate:.1}/s (limit 50), both {together:.0}/s, the free tenant alone {alone:.0}/s"
    );
    assert!(
        (45.0..=55.0).contains(&limited_rate),
        "the limited tenant delivered {limited_rate:.1}/s, limit 50/s"
    );
    assert!(
        together >= 0.85 * alone,
        "the shard did not stay busy: {together:.0}/s with the limited tenant, {alone:.0}/s without"
    );
}

/// Issue 21, item 5: a real worker sweeps the tenants that sent once and
/// went idle, counts them in `lanekeeper_tenants_swept_total`, and keeps
/// the one that still has work; `top`'s listing (tenant stats) drops them.
#[tokio::test]
async fn a_worker_sweeps_idle_tenants_and_counts_them() {
    let s = setup(QueuePolicy {
        sweep_idle_after: Some(Duration::from_secs(1)),
        idempotency_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    for t in ["once-a", "once-b", "once-c"] {
        s.endpoint(t, "ok", 1).await;
        s.send(t, 0..3).await;
    }
    // a tenant with no endpoint registered: its envelope is dead-lettered,
    // and a tenant with dead letters is kept
    s.send("refused", 0..1).await;
    let metrics_addr = format!("127.0.0.1:{}", support::process::free_port());
    let pid = s.worker(&["--concurrency", "4", "--metrics-addr", &metrics_addr]);
    s.wait_for_accepted(9, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let m = reqwest::get(format!("http://{metrics_addr}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains(r#"lanekeeper_tenants_swept_total{queue="shard-00"} 3"#) {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "three tenants not swept in 30 s:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // top lists a tenant with state here or worker-seconds in its window:
    // once the swept tenants' last deliveries leave the window (whole 10 s
    // buckets), they are gone from it
    let deadline = Instant::now() + Duration::from_secs(40);
    let listed = loop {
        let stats = s
            .store
            .tenant_stats(Q, Duration::from_secs(1))
            .await
            .unwrap();
        let listed: Vec<String> = stats.into_iter().map(|t| t.tenant).collect();
        if !listed.iter().any(|t| t.starts_with("once-")) {
            break listed;
        }
        assert!(
            Instant::now() < deadline,
            "swept tenants still listed: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let listed: Vec<&str> = listed.iter().map(String::as_str).collect();
    assert!(
        listed.contains(&"refused"),
        "the tenant with a dead letter was swept: {listed:?}"
    );
    let letters = s.store.dead_letters(Q, "refused", None, 10).await.unwrap();
    assert_eq!(letters.letters.len(), 1);
    assert!(!metrics.contains("tenants_swept_total{queue=\"shard-00\"} 4"));
    stop(pid);
}

// ---- endpoint isolation, issue 21 item 3 ---------------------------------

/// Fast envelopes tenant `a` streams in one phase of the test below: 40 a
/// second for 4 s.
const FAST_STREAM: u64 = 160;
const FAST_EVERY: Duration = Duration::from_millis(25);

/// What one phase measured: the fast endpoint's waits (enqueue to arrival
/// at the receiver), in ms, and how much of tenant `a`'s work was still
/// queued when the last fast envelope had been sent.
struct FastPhase {
    p50: u64,
    p99: u64,
    /// The five longest waits, longest first.
    worst: Vec<u64>,
    queued_after: u64,
}

/// One phase on a set of its own: tenant `a` has `fast` (answers at once)
/// and `slow` (answers after 300 ms); one worker with 16 slots, so `a`'s cap
/// of 8, not the worker, is what binds. `slow_backlog` envelopes to `slow`
/// are queued and in flight before `a` streams [`FAST_STREAM`] envelopes to
/// `fast` at a steady rate, each stamped with its send time.
async fn fast_endpoint_phase(policy: QueuePolicy, slow_backlog: u64) -> FastPhase {
    let s = setup(policy).await;
    pace_endpoint(&s, "a", "fast", "ok").await;
    pace_endpoint(&s, "a", "slow", "delay-300").await;
    let to = |ep: &str, i: u64| lanekeeper::envelope::Envelope {
        id: format!("a-{ep}-{i}"),
        endpoint: Some(ep.to_string()),
        ..envelope("a", i)
    };
    let pid = s.worker(&["--concurrency", "16", "--grace-period", "2s"]);
    // Warm-up, alike in every phase: the worker is up and its connection to
    // the receiver open before anything is measured.
    let warm = lanekeeper::envelope::Envelope {
        id: "a-warm-up".into(),
        ..to("fast", 0)
    };
    s.store.enqueue(Q, &warm).await.unwrap();
    s.wait_for_accepted(1, Duration::from_secs(30)).await;
    if slow_backlog > 0 {
        pace_send(&s, "a", "slow", slow_backlog).await;
        // The backlog holds its slots before the fast stream starts: the
        // endpoint's cap (4) under endpoint isolation, the tenant's (8)
        // under tenant isolation.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = s.store.tenant_state(Q, "a").await.unwrap();
            if st.in_flight >= 4 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the slow backlog was not leased: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let mut tick = tokio::time::interval(FAST_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for i in 0..FAST_STREAM {
        tick.tick().await;
        s.store.enqueue(Q, &to("fast", i)).await.unwrap();
    }
    let queued_after = s.store.tenant_state(Q, "a").await.unwrap().queued;
    // Under tenant isolation the fast envelopes wait behind the whole slow
    // backlog (300 x 300 ms over 8 slots: about 11 s), hence the bound.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut waits = loop {
        let waits: Vec<u64> = s
            .receiver
            .arrivals()
            .into_iter()
            .filter(|a| a.accepted && a.id.starts_with("a-fast-"))
            .map(|a| a.at_ms.saturating_sub(a.sent_ms))
            .collect();
        if waits.len() as u64 >= FAST_STREAM {
            break waits;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {FAST_STREAM} fast envelopes arrived in 30 s",
            waits.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop(pid);
    waits.sort();
    let pct = |p: f64| waits[((waits.len() as f64 * p).ceil() as usize).clamp(1, waits.len()) - 1];
    FastPhase {
        p50: pct(0.50),
        p99: pct(0.99),
        worst: waits.iter().rev().take(5).copied().collect(),
        queued_after,
    }
}

/// Issue 21, item 3: "a slow endpoint of tenant A does not raise the p99 of
/// A's fast endpoint by more than 2x". Real worker, real receiver; three
/// phases, each on a set of its own: the fast stream alone (baseline), the
/// same stream behind a 300-envelope backlog to a 300 ms endpoint of the
/// same tenant under endpoint isolation, and the same again under tenant
/// isolation, the contrast that shows the test can fail.
///
/// It caught a worker bug: a queue's wake-up went to the oldest waiter of the
/// worker's `Notify`, which could be a task busy delivering to the slow
/// endpoint (its listener, armed before leasing, stayed armed through the
/// delivery), so the fast endpoint waited for that delivery to end: p99
/// 258 to 282 ms before the fix, 3 to 4 ms after (the listener is dropped
/// as soon as a lease comes back).
#[tokio::test]
async fn a_slow_endpoint_does_not_raise_the_fast_endpoints_p99_under_endpoint_isolation() {
    use lanekeeper::policy::Isolation;
    let by_endpoint = QueuePolicy {
        isolation: Isolation::Endpoint,
        ..Default::default()
    };
    let alone = fast_endpoint_phase(by_endpoint.clone(), 0).await;
    let isolated = fast_endpoint_phase(by_endpoint, 300).await;
    let shared = fast_endpoint_phase(QueuePolicy::default(), 300).await;
    eprintln!(
        "fast endpoint wait, ms (p50 / p99; five longest), 160 envelopes at 40/s: alone {} / {} ({:?}); behind 300 envelopes to a 300 ms endpoint of the same tenant: endpoint isolation {} / {} ({:?}), tenant isolation {} / {} ({:?})",
        alone.p50, alone.p99, alone.worst, isolated.p50, isolated.p99, isolated.worst, shared.p50, shared.p99, shared.worst
    );
    // The slow backlog was still queued when the stream ended, so the fast
    // stream met it throughout.
    assert!(
        isolated.queued_after > 0 && shared.queued_after > 0,
        "the slow backlog ran out before the fast stream ended"
    );
    // A 20 ms floor absorbs a loaded 2-core machine's noise on a baseline of
    // a few ms.
    let floor = alone.p99.max(20);
    assert!(
        isolated.p99 <= 2 * floor,
        "under endpoint isolation the slow endpoint moved the fast one's p99 from {} to {} ms (five longest: {:?})",
        alone.p99,
        isolated.p99,
        isolated.worst
    );
    assert!(
        shared.p99 > (5 * floor).max(1000),
        "under tenant isolation the slow backlog should hold the fast endpoint back: p99 {} ms (alone {} ms)",
        shared.p99,
        alone.p99
    );
}
