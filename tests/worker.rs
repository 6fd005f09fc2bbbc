//! `lanekeeper worker` end to end: real worker processes, a real redis-server
//! and a local HTTP receiver that checks every signature on its own.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lanekeeper::endpoint::Endpoint;
use lanekeeper::envelope::Envelope;
use lanekeeper::routing::QueueId;
use lanekeeper::scheduler::{BreakerPolicy, QueuePolicy};
use lanekeeper::signing::Secret;
use lanekeeper::store::{SetId, Store};
use support::receiver::{now_ms, Receiver};

const Q: QueueId = QueueId::Shard(0);

struct Setup {
    store: Store,
    set: String,
    redis_url: String,
    receiver: Receiver,
}

async fn setup(policy: QueuePolicy) -> Setup {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("w{}", N.fetch_add(1, Ordering::Relaxed));
    let redis_url = support::redis::shared().url.clone();
    let store = Store::connect(&redis_url, SetId::new("worker", &name), Default::default())
        .await
        .unwrap();
    store.set_shards(1).await.unwrap();
    store.configure_queue(Q, &policy).await.unwrap();
    Setup {
        store,
        set: format!("worker/{name}"),
        redis_url,
        receiver: Receiver::start(),
    }
}

impl Setup {
    /// Register `tenant`'s default endpoint at the receiver with `mode`.
    async fn endpoint(&self, tenant: &str, mode: &str, secrets: usize) {
        let secrets: Vec<String> = (0..secrets).map(|_| Secret::generate()).collect();
        self.receiver.expect_secrets(tenant, &secrets);
        self.endpoint_at(tenant, &self.receiver.url(tenant, mode), secrets)
            .await;
    }

    async fn endpoint_at(&self, tenant: &str, url: &str, secrets: Vec<String>) {
        let ep = Endpoint {
            url: url.to_string(),
            secrets,
            enabled: true,
            event_types: vec![],
        };
        self.store
            .put_endpoint(tenant, "default", &ep)
            .await
            .unwrap();
    }

    async fn send(&self, tenant: &str, seqs: std::ops::Range<u64>) {
        let envs: Vec<Envelope> = seqs.map(|seq| envelope(tenant, seq)).collect();
        for chunk in envs.chunks(2000) {
            for r in self.store.enqueue_batch(Q, chunk).await.unwrap() {
                r.unwrap();
            }
        }
    }

    fn worker(&self, extra: &[&str]) -> u32 {
        let mut args = vec![
            "--allow-cidr",
            "127.0.0.0/8",
            "--initial-backoff",
            "10ms",
            "--max-backoff",
            "200ms",
            "--connect-timeout",
            "1s",
            "--lease-margin",
            "1s",
        ];
        args.extend_from_slice(extra);
        support::workers::spawn(&self.redis_url, &self.set, "shard-00", &args)
    }

    /// Accepted deliveries, by envelope id.
    fn accepted(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for a in self.receiver.arrivals().into_iter().filter(|a| a.accepted) {
            *m.entry(a.id).or_default() += 1;
        }
        m
    }

    async fn wait_for_accepted(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.accepted().len();
            if got >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {got} of {n} envelopes arrived in {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn envelope(tenant: &str, seq: u64) -> Envelope {
    Envelope {
        id: format!("{tenant}-{seq}"),
        tenant: tenant.to_string(),
        endpoint: None,
        event_type: Some("test.event".into()),
        payload: serde_json::json!({ "tenant": tenant, "seq": seq, "sent_ms": now_ms() }),
    }
}

fn stop(pid: u32) {
    support::process::signal(pid, libc::SIGTERM);
    let code = support::process::wait_exit(pid, Duration::from_secs(30));
    assert_eq!(
        code,
        Some(Some(0)),
        "worker {pid} did not exit 0 after SIGTERM"
    );
}

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
        let dead = s.store.dead_letters(Q, 10).await.unwrap();
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
