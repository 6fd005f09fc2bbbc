//! The controller and a Redis that is a production dependency, end to end
//! against the full test control plane: TLS and an ACL user from Secrets,
//! the settings that lose data in status, and recovery from a Redis that
//! lost its state.

mod support;

use std::str::FromStr;
use std::time::{Duration, Instant};

use lanekeeper::store::{SetId, Store};
use support::controlplane::{self, ControlPlane};
use support::redis::{self, TlsRedis};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

fn json(cp: &ControlPlane, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&cp.kubectl_ok(args)).unwrap()
}

/// (status, reason, message) of the set's condition `type_`.
fn condition(cp: &ControlPlane, ns: &str, set: &str, type_: &str) -> (String, String, String) {
    let s = json(cp, &["get", "shardset", set, "-n", ns, "-o", "json"]);
    let c = s["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or_default();
    let f = |k: &str| c[k].as_str().unwrap_or("").to_string();
    (f("status"), f("reason"), f("message"))
}

fn wait_condition(
    cp: &ControlPlane,
    ns: &str,
    set: &str,
    type_: &str,
    status: &str,
    reason: &str,
    timeout: Duration,
) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let (s, r, m) = condition(cp, ns, set, type_);
        if s == status && r == reason {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "{type_} stayed {s}/{r} ({m}), not {status}/{reason}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn events(cp: &ControlPlane, ns: &str) -> String {
    cp.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        ns,
        "-o",
        "custom-columns=REASON:.reason,NOTE:.note",
    ])
}

fn shardset(name: &str, redis: &str) -> String {
    format!(
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: 2
  redis: {redis}
  worker: {{image: "lanekeeper:v1", replicas: 1}}
"#
    )
}

#[test]
fn tls_with_a_ca_secret_and_an_acl_user_reach_redis_and_the_workers() {
    let cp = cluster();
    let ns = cp.namespace("redis-tls");
    let r = TlsRedis::start("yes", &[]);
    let acl = [
        "ACL",
        "SETUSER",
        "lk",
        "on",
        ">tls-acl-pw",
        "resetkeys",
        "~lk:*",
        "resetchannels",
        "&lk:*",
        "-@all",
        "+@read",
        "+@write",
        "+@transaction",
        "+@pubsub",
        "+@connection",
        "-@dangerous",
        "+fcall",
        "+function|load",
        "+time",
        "+info",
        "+config|get",
    ];
    assert_eq!(redis::cli(&r.redis, &acl).trim(), "OK");
    let ca = r.pki.ca.display().to_string();
    let (cert, key) = (
        r.pki.client_cert.display().to_string(),
        r.pki.client_key.display().to_string(),
    );
    cp.kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "redis-ca",
        "-n",
        &ns,
        &format!("--from-file=bundle.pem={ca}"),
    ]);
    cp.kubectl_ok(&[
        "create",
        "secret",
        "tls",
        "redis-client",
        "-n",
        &ns,
        &format!("--cert={cert}"),
        &format!("--key={key}"),
    ]);
    cp.kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "redis-pw",
        "-n",
        &ns,
        "--from-literal=password=tls-acl-pw",
        &format!("--from-literal=url={}", r.url("")),
    ]);
    let (pid, log) = cp.spawn_controller_env(&ns, &["--leader-election=false"], &[]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset(
            "secure",
            r#"{urlSecretRef: {name: redis-pw, key: url}, username: lk, passwordSecretRef: {name: redis-pw, key: password},
                   tls: {caSecretRef: {name: redis-ca, key: bundle.pem}, clientCertSecretRef: {name: redis-client}}}"#,
        ),
    );
    // The controller reached Redis over TLS as the ACL user: the settings
    // were read with CONFIG GET and the routing table is there.
    let msg = wait_condition(
        cp,
        &ns,
        "secure",
        "RedisChecked",
        "True",
        "ConfigGet",
        Duration::from_secs(60),
    );
    assert!(msg.contains("maxmemory-policy noeviction"), "{msg}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let table = rt.block_on(async {
        let url = lanekeeper::store::with_password(
            &lanekeeper::store::with_username(&r.url(""), "lk").unwrap(),
            "tls-acl-pw",
        )
        .unwrap();
        Store::connect_tls(
            &url,
            SetId::new(&ns, "secure"),
            Default::default(),
            Some(r.pki.tls(true)),
        )
        .await
        .unwrap()
        .routing()
        .await
        .unwrap()
    });
    assert_eq!(table.shards, 2);
    assert!(redis::cli(&r.redis, &["ACL", "LOG"]).trim().is_empty());
    let (d, _, _) = condition(cp, &ns, "secure", "Degraded");
    assert_eq!(d, "False");

    // The workers get the Secrets by reference: mounted, named in env.
    let dep = json(
        cp,
        &[
            "get",
            "deployment",
            "secure-shard-01",
            "-n",
            &ns,
            "-o",
            "json",
        ],
    );
    let pod = &dep["spec"]["template"]["spec"];
    let vols = pod["volumes"].as_array().unwrap();
    assert!(
        vols.iter().any(|v| v["secret"]["secretName"] == "redis-ca"
            && v["secret"]["items"][0]["key"] == "bundle.pem"
            && v["secret"]["items"][0]["path"] == "ca.crt"),
        "{vols:?}"
    );
    assert!(
        vols.iter()
            .any(|v| v["secret"]["secretName"] == "redis-client"),
        "{vols:?}"
    );
    let env = pod["containers"][0]["env"].as_array().unwrap();
    let val = |n: &str| {
        env.iter()
            .find(|e| e["name"] == n)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(val("LANEKEEPER_REDIS_USERNAME")["value"], "lk");
    assert_eq!(
        val("LANEKEEPER_REDIS_CA_FILE")["value"],
        "/etc/lanekeeper/redis-tls/ca/ca.crt"
    );
    assert_eq!(
        val("LANEKEEPER_REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]["name"],
        "redis-pw"
    );
    let text = serde_json::to_string(&dep).unwrap();
    assert!(
        !text.contains("tls-acl-pw") && !text.contains("BEGIN"),
        "a secret was copied into the Deployment"
    );
    // A worker started the way that Deployment starts it (its env; the
    // Secrets' values and files where the kubelet would put them) connects
    // over TLS as the ACL user.
    let wdir = support::process::scratch_dir("tls-worker");
    let wlog = wdir.join("worker.log");
    let mut cmd = std::process::Command::new(support::process::lanekeeper_bin());
    cmd.arg("worker").env("RUST_LOG", "info");
    for e in env {
        let name = e["name"].as_str().unwrap();
        let value = match name {
            "LANEKEEPER_REDIS_PASSWORD" => "tls-acl-pw".to_string(),
            "LANEKEEPER_REDIS_URL" => r.url(""),
            "LANEKEEPER_REDIS_CA_FILE" => ca.clone(),
            "LANEKEEPER_REDIS_CLIENT_CERT_FILE" => cert.clone(),
            "LANEKEEPER_REDIS_CLIENT_KEY_FILE" => key.clone(),
            "LANEKEEPER_METRICS_ADDR" => format!("127.0.0.1:{}", support::process::free_port()),
            "POD_NAME" => "secure-shard-01-test".to_string(),
            _ => e["value"].as_str().unwrap_or_default().to_string(),
        };
        cmd.env(name, value);
    }
    let wpid = support::process::spawn_server(cmd, &wlog);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&wlog).unwrap_or_default();
        if text.contains("worker started") && text.contains("maxmemory-policy noeviction") {
            break;
        }
        assert!(
            Instant::now() < deadline && support::process::is_running(wpid),
            "the worker did not start over TLS:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    support::process::signal(wpid, libc::SIGTERM);
    assert!(redis::cli(&r.redis, &["ACL", "LOG"]).trim().is_empty());
    support::process::signal(pid, libc::SIGTERM);
    let _ = support::process::wait_exit(pid, Duration::from_secs(20));
    let log = std::fs::read_to_string(log).unwrap_or_default();
    assert!(
        !log.contains("tls-acl-pw"),
        "the controller logged the password"
    );
}

#[test]
fn an_evicting_policy_degrades_the_set_and_no_persistence_warns() {
    let cp = cluster();
    let ns = cp.namespace("redis-evict");
    let r = redis::dedicated_with(&["--maxmemory-policy", "volatile-lru"]);
    let pid = cp.spawn_controller(&ns, &["--leader-election=false"]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("hooks", &format!(r#"{{url: "{}"}}"#, r.url)),
    );
    let msg = wait_condition(
        cp,
        &ns,
        "hooks",
        "Degraded",
        "True",
        "RedisEvictionPolicy",
        Duration::from_secs(60),
    );
    assert!(
        msg.contains("maxmemory-policy volatile-lru")
            && msg.contains("set maxmemory-policy noeviction"),
        "{msg}"
    );
    let msg = wait_condition(
        cp,
        &ns,
        "hooks",
        "RedisNotPersistent",
        "True",
        "NoPersistence",
        Duration::from_secs(30),
    );
    assert!(
        msg.contains("appendonly no") && msg.contains("loses every queued envelope"),
        "{msg}"
    );
    // `kubectl describe` shows both.
    let described = cp.kubectl_ok(&["describe", "shs", "hooks", "-n", &ns]);
    assert!(
        described.contains("RedisEvictionPolicy") && described.contains("RedisNotPersistent"),
        "{described}"
    );
    // Events told it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !events(cp, &ns).contains("NoPersistence") {
        assert!(Instant::now() < deadline, "no event: {}", events(cp, &ns));
        std::thread::sleep(Duration::from_millis(250));
    }

    // Fixed on the server: the set recovers without a spec change.
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).trim(),
        "OK"
    );
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "appendonly", "yes"]).trim(),
        "OK"
    );
    // A spec touch wakes the reconcile now rather than at its next requeue.
    cp.kubectl_ok(&["annotate", "shs", "hooks", "-n", &ns, "touch=1"]);
    let (d, reason, _) = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let c = condition(cp, &ns, "hooks", "Degraded");
            if c.1 != "RedisEvictionPolicy" {
                break c;
            }
            assert!(Instant::now() < deadline, "still {c:?}");
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    assert_ne!(
        (d.as_str(), reason.as_str()),
        ("True", "RedisEvictionPolicy")
    );
    wait_condition(
        cp,
        &ns,
        "hooks",
        "RedisNotPersistent",
        "False",
        "Persistent",
        Duration::from_secs(60),
    );
    support::process::signal(pid, libc::SIGTERM);
}

#[test]
fn config_renamed_away_is_said_in_status() {
    let cp = cluster();
    let ns = cp.namespace("redis-noconf");
    let r = redis::dedicated_with(&["--rename-command", "CONFIG", ""]);
    let pid = cp.spawn_controller(&ns, &["--leader-election=false"]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("hooks", &format!(r#"{{url: "{}"}}"#, r.url)),
    );
    let msg = wait_condition(
        cp,
        &ns,
        "hooks",
        "RedisChecked",
        "False",
        "ConfigGetRefused",
        Duration::from_secs(60),
    );
    assert!(
        msg.contains("CONFIG GET was refused") && msg.contains("maxmemory-policy noeviction"),
        "{msg}"
    );
    let msg = wait_condition(
        cp,
        &ns,
        "hooks",
        "RedisNotPersistent",
        "Unknown",
        "PersistenceUnknown",
        Duration::from_secs(30),
    );
    assert!(msg.contains("appendonly no"), "{msg}");
    support::process::signal(pid, libc::SIGTERM);
}

/// One producer's record: (tenant, send time ms, where it went or the error).
type Sends = Vec<(String, u64, Result<lanekeeper::routing::QueueId, String>)>;

/// Producers of `tenants` sending one envelope every `every` each, through
/// the library's producer (routing cache 200 ms, as ingest's), recording
/// every answer instead of stopping at the first refusal.
fn produce(
    store: &Store,
    tenants: &[String],
    every: Duration,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Sends> {
    let producer = lanekeeper::producer::Producer::new(store.clone(), Duration::from_millis(200));
    let tenants = tenants.to_vec();
    tokio::spawn(async move {
        let mut out = Sends::new();
        let mut seq = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            for t in &tenants {
                let env = support::scenario::envelope(t, seq);
                let at = support::receiver::now_ms();
                let r = producer
                    .send(&env)
                    .await
                    .map(|(q, _)| q)
                    .map_err(|e| e.to_string());
                out.push((t.clone(), at, r));
            }
            seq += 1;
            tokio::time::sleep(every).await;
        }
        out
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_redis_is_restored_lane_pins_included_and_nothing_is_misrouted() {
    use lanekeeper::crd::LanePhase;
    use lanekeeper::routing::{hash_shard, QueueId};
    let cp = cluster();
    // A Redis of its own: this test flushes it.
    let r = redis::dedicated_with(&[]);
    let env = support::lanes::LaneEnv::start_on(
        cp,
        "flush",
        2,
        "  worker: {image: \"lanekeeper:test\", replicas: 1, concurrency: 8}\n  promotion: {enabled: false}\n  relocation: {drainTimeout: 30s}\n",
        &[],
        &["--concurrency", "8"],
        false,
        &r.url,
    )
    .await;
    let whale = env.tenant_on("whale", 0);
    let smalls = vec![env.tenant_on("small", 0), env.tenant_on("other", 1)];
    for t in std::iter::once(&whale).chain(&smalls) {
        env.endpoint(t, "ok").await;
    }
    env.create_lane("whale-lane", &whale);
    let mut seen = Vec::new();
    let active = env
        .wait_phase(
            "whale-lane",
            LanePhase::Active,
            Duration::from_secs(90),
            &mut seen,
        )
        .await;
    let lane = QueueId::Lane(active.status.as_ref().unwrap().lane_index.unwrap() as u8);
    let before = env.store.routing().await.unwrap();
    assert_eq!(before.pins.get(&whale), Some(&lane));
    let epoch_before = before
        .epoch
        .clone()
        .expect("the controller marks the table");
    let expected = |t: &str| if t == whale { lane } else { hash_shard(t, 2) };

    // Under load: every tenant sends every 20 ms.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut all = smalls.clone();
    all.push(whale.clone());
    let producers = produce(&env.store, &all, Duration::from_millis(20), stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Redis loses everything (as a restart without persistence does).
    let t_flush = support::receiver::now_ms();
    assert_eq!(redis::cli(&r, &["FLUSHALL"]).trim(), "OK");

    // The controller notices and restores, lane pin first.
    let deadline = Instant::now() + Duration::from_secs(30);
    let restored = loop {
        let t = env.store.routing().await.unwrap();
        if t.epoch.is_some() {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the routing table was not restored:\n{}",
            env.controller_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let t_restored = support::receiver::now_ms();
    assert_eq!(restored.shards, 2);
    assert_eq!(restored.pins.get(&whale), Some(&lane), "{restored:?}");
    assert_ne!(restored.epoch.as_deref(), Some(epoch_before.as_str()));
    // The endpoints were in the flushed Redis too: the operator re-registers them.
    for t in &all {
        env.endpoint(t, "ok").await;
    }
    // Workers remember a missing endpoint for 5 s (their endpoint cache).
    let t_endpoints = support::receiver::now_ms() + 5_500;
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sends = producers.await.unwrap();

    // No envelope went to a wrong queue, before, during or after the loss.
    let misrouted: Vec<_> = sends
        .iter()
        .filter(|(t, _, r)| matches!(r, Ok(q) if *q != expected(t)))
        .collect();
    assert!(
        misrouted.is_empty(),
        "misrouted: {:?}",
        &misrouted[..misrouted.len().min(5)]
    );
    // While the table was missing, producers were refused, saying why.
    let refused: Vec<&String> = sends
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().err())
        .collect();
    assert!(!refused.is_empty(), "no producer noticed the missing table");
    assert!(
        refused.iter().all(|e| e.contains("routing table missing")),
        "{:?}",
        &refused[..refused.len().min(3)]
    );
    let accepted_after = sends
        .iter()
        .filter(|(t, at, r)| *t == whale && *at > t_restored && r.is_ok())
        .count();
    assert!(
        accepted_after > 50,
        "the whale was not accepted after the restore ({accepted_after})"
    );
    // The whale's envelopes sent after its endpoint is back arrive, from its lane.
    let want: std::collections::BTreeSet<String> = sends
        .iter()
        .filter(|(t, at, r)| *t == whale && *at > t_endpoints + 100 && r.is_ok())
        .map(|(_, at, _)| at.to_string())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = env
            .receiver
            .arrivals()
            .iter()
            .filter(|a| a.accepted && a.tenant == whale && a.sent_ms > t_endpoints + 100)
            .count();
        if got >= want.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{got} of {} whale envelopes arrived after the restore",
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let on_lane = env
        .store
        .tenant_stats(lane, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        on_lane.iter().any(|s| s.tenant == whale && s.delivered > 0),
        "nothing of the whale was delivered on {lane} after the restore"
    );

    // Status told the story: an Event with what was restored, the condition
    // raised and then cleared, the lane still Active.
    let notes = events(cp, &env.ns);
    assert!(
        notes.contains("RedisStateLost")
            && notes.contains(&format!("{whale}→{lane}"))
            && notes.contains("shard count (2)"),
        "{notes}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, reason, _) = condition(cp, &env.ns, &env.set, "RedisStateLost");
        let obj = json(
            cp,
            &["get", "shardset", &env.set, "-n", &env.ns, "-o", "json"],
        );
        let since = obj["status"]["conditions"]
            .as_array()
            .unwrap_or_else(|| panic!("no conditions: {obj}"))
            .iter()
            .find(|c| c["type"] == "RedisStateLost")
            .and_then(|c| c["lastTransitionTime"].as_str().map(str::to_string))
            .unwrap_or_default();
        let since_ms = k8s_openapi::jiff::Timestamp::from_str(&since)
            .map(|t| t.as_millisecond() as u64)
            .unwrap_or(0);
        // Cleared after it was raised (the second flip is after the flush).
        if s == "False" && reason == "StatePresent" && since_ms + 1000 >= t_flush {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "RedisStateLost is {s}/{reason} since {since}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let transitions = cp.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        &env.ns,
        "-o",
        "jsonpath={range .items[*]}{.note}{\"\\n\"}{end}",
    ]);
    assert!(transitions.contains("RedisStateLost=True"), "{transitions}");
    assert!(
        transitions.contains("RedisStateLost=False"),
        "{transitions}"
    );
    let lane_now = env.lane_of(&whale).await.unwrap();
    assert_eq!(lane_now.status.unwrap().phase, LanePhase::Active);
    eprintln!(
        "flush at {t_flush}, table restored {} ms later; {} sends refused with 503 meanwhile; {} whale envelopes on {lane} after",
        t_restored - t_flush,
        refused.len(),
        accepted_after
    );
}
