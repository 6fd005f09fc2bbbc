//! The data plane without Kubernetes: `lanekeeper dataplane apply` writes a
//! ShardSet's routing table, queue policies, tiers and `spec.tenants` into
//! a real redis-server, and real `lanekeeper worker` and `lanekeeper
//! ingest` processes deliver signed webhooks with nothing else running (no
//! API server, no controller, no Redis key written by the test). The
//! receiver checks every signature with its own Standard Webhooks code.
//! Also: re-applying changes nothing, a changed policy takes effect, a
//! Redis restarted empty is brought back by applying again, and what the
//! CLI cannot do without Kubernetes (or the controller) is refused, naming
//! the field, with nothing written and no secret in the message.

mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::process;
use support::receiver::Receiver;
use support::redis::TestRedis;

const SET: &str = "dp/hooks";

/// A ShardSet document for `redis_url` with `shards` and extra spec lines
/// (`extra` is indented under `spec:` already).
fn shardset(name: &str, redis_url: &str, shards: u32, extra: &str) -> String {
    format!(
        "apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata:
  name: {name}
  namespace: dp
spec:
  shards: {shards}
  redis:
    url: {redis_url}
  worker:
    image: ghcr.io/example/lanekeeper:dev
{extra}"
    )
}

/// Run the binary; (success, stdout, stderr). `stdin` is piped in when given.
fn lk(args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(process::lanekeeper_bin());
    cmd.args(args)
        .env_remove("LANEKEEPER_REDIS_URL")
        .env_remove("LANEKEEPER_SHARD_SET")
        .env_remove("LANEKEEPER_REDIS_PASSWORD")
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// `dataplane apply -f <file> --redis <url>` that must succeed; its stdout.
fn apply(file: &Path, redis_url: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "dataplane",
        "apply",
        "-f",
        file.to_str().unwrap(),
        "--redis",
        redis_url,
    ];
    args.extend(extra);
    let (ok, out, err) = lk(&args, None, &[]);
    assert!(ok, "dataplane apply failed:\n{out}\n{err}");
    out
}

/// `dataplane apply` that must fail; its stderr.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let (ok, out, err) = lk(args, None, env);
    assert!(!ok, "accepted {args:?}:\n{out}");
    err
}

/// Every key of the set and its value, by type (a dump to compare).
async fn dump(redis_url: &str) -> BTreeMap<String, String> {
    let mut conn = redis::Client::open(redis_url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*dp/hooks*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut out = BTreeMap::new();
    for k in keys {
        let t: String = redis::cmd("TYPE")
            .arg(&k)
            .query_async(&mut conn)
            .await
            .unwrap();
        let v = match t.as_str() {
            "hash" => {
                let m: BTreeMap<String, String> = redis::cmd("HGETALL")
                    .arg(&k)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                format!("{m:?}")
            }
            "set" => {
                let mut m: Vec<String> = redis::cmd("SMEMBERS")
                    .arg(&k)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                m.sort();
                format!("{m:?}")
            }
            "string" => redis::cmd("GET")
                .arg(&k)
                .query_async(&mut conn)
                .await
                .unwrap(),
            "zset" => {
                let m: Vec<(String, f64)> = redis::cmd("ZRANGE")
                    .arg(&k)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                format!("{m:?}")
            }
            "list" => {
                let m: Vec<String> = redis::cmd("LRANGE")
                    .arg(&k)
                    .arg(0)
                    .arg(-1)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                format!("{m:?}")
            }
            "stream" => {
                let n: u64 = redis::cmd("XLEN")
                    .arg(&k)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                format!("stream of {n}")
            }
            other => other.to_string(),
        };
        out.insert(k, v);
    }
    out
}

/// A running `lanekeeper ingest` whose api keys file was written from
/// `lanekeeper ingest-key` output: an admin key and one for tenant `acme`.
struct IngestProc {
    pid: u32,
    base: String,
    admin: String,
    acme: String,
    log: PathBuf,
}

/// The key and the keys-file entry that `ingest-key` prints.
fn ingest_key(args: &[&str]) -> (String, String) {
    let mut all = vec!["ingest-key"];
    all.extend(args);
    let (ok, out, err) = lk(&all, None, &[]);
    assert!(ok, "{err}");
    let key = out
        .lines()
        .find_map(|l| l.rsplit_once("): ").map(|(_, k)| k.trim().to_string()))
        .unwrap_or_else(|| panic!("no key in {out}"));
    let entry = out
        .lines()
        .find(|l| l.trim_start().starts_with("- {"))
        .unwrap_or_else(|| panic!("no entry in {out}"))
        .to_string();
    (key, entry)
}

fn spawn_ingest(redis_url: &str, env: &[(&str, &str)]) -> IngestProc {
    let dir = process::scratch_dir("dp-ingest");
    let (admin, admin_entry) = ingest_key(&["--name", "ops", "--admin"]);
    let (acme, acme_entry) = ingest_key(&["--name", "acme-prod", "--tenant", "acme"]);
    let keys = write(
        &dir,
        "keys.yaml",
        &format!("keys:\n{admin_entry}\n{acme_entry}\n"),
    );
    let port = process::free_port();
    let log = dir.join("ingest.log");
    let mut cmd = Command::new(process::lanekeeper_bin());
    cmd.args(["ingest", "--redis", redis_url, "--shard-set", SET])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--api-keys")
        .arg(&keys)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn");
    let pid = process::spawn_server(cmd, &log);
    let ready = || process::answers_200(port, "/readyz");
    process::wait_until("ingest /readyz", Duration::from_secs(30), &log, pid, ready);
    IngestProc {
        pid,
        base: format!("http://127.0.0.1:{port}"),
        admin,
        acme,
        log,
    }
}

impl IngestProc {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: &str,
        body: Value,
    ) -> (u16, Value) {
        let res = reqwest::Client::new()
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let text = res.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Register `tenant`'s endpoint `default` at the receiver (with
    /// `secret`, or a new one), and have the receiver trust its secret.
    async fn endpoint(
        &self,
        rx: &Receiver,
        tenant: &str,
        mode: &str,
        secret: Option<&str>,
    ) -> String {
        let mut body = json!({"url": rx.url(tenant, mode)});
        if let Some(s) = secret {
            body["secret"] = json!(s);
        }
        let path = format!("/v1/tenants/{tenant}/endpoints/default");
        // a 503 (Redis reconnecting after a restart) is retried, as a producer would
        let deadline = Instant::now() + Duration::from_secs(15);
        let v = loop {
            let (s, v) = self
                .call(reqwest::Method::PUT, &path, &self.admin, body.clone())
                .await;
            if s == 503 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            assert_eq!(s, 200, "{v}\n{}", process::tail(&self.log, 20));
            break v;
        };
        let secret = secret
            .map(str::to_string)
            .or_else(|| v["secret"].as_str().map(str::to_string))
            .unwrap_or_else(|| panic!("no secret in {v}"));
        rx.expect_secrets(tenant, std::slice::from_ref(&secret));
        secret
    }

    /// Wait until `tenant` has `n` dead letters.
    async fn dead_letters(&self, tenant: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let path = format!("/v1/tenants/{tenant}/dead-letters");
            let res = reqwest::Client::new()
                .get(format!("{}{path}", self.base))
                .bearer_auth(&self.admin)
                .send()
                .await
                .unwrap();
            let v: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
            let got = v["items"].as_array().map_or(0, |l| l.len());
            if got >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{got} of {n} dead letters: {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn post(&self, key: &str, tenant: &str, id: &str, seq: u64) -> (u16, Value) {
        let body = json!({"tenant": tenant, "id": id, "payload": {"seq": seq}});
        self.call(reqwest::Method::POST, "/v1/events", key, body)
            .await
    }
}

/// Wait until the receiver accepted `n` deliveries for `tenant`.
async fn wait_accepted(rx: &Receiver, tenant: &str, n: usize, logs: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = rx
            .arrivals()
            .iter()
            .filter(|a| a.tenant == tenant && a.accepted)
            .count();
        if got >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{tenant}: {got} of {n} delivered; {logs}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two tenants whose hash shards (of 2) differ, so both workers deliver.
fn tenants_on_both_shards() -> (&'static str, &'static str) {
    let shard = |t: &str| lanekeeper::routing::hash_shard(t, 2);
    let other = ["globex", "initech", "umbrella", "hooli", "wonka", "stark"]
        .into_iter()
        .find(|t| shard(t) != shard("acme"))
        .unwrap();
    ("acme", other)
}

fn spawn_workers(redis: &TestRedis, shards: u32, env: &[(&str, &str)]) -> Vec<u32> {
    (0..shards)
        .map(|n| {
            support::workers::spawn_env(
                &redis.url,
                SET,
                &format!("shard-{n:02}"),
                support::workers::LOCAL_ARGS,
                env,
            )
        })
        .collect()
}

/// Proxies that lead nowhere: neither the CLI's Redis connection, the
/// workers' deliveries nor ingest may use them (proxies are off unless
/// configured).
const DEAD_PROXIES: &[(&str, &str)] = &[
    ("HTTP_PROXY", "http://127.0.0.1:9"),
    ("HTTPS_PROXY", "http://127.0.0.1:9"),
    ("ALL_PROXY", "socks5://127.0.0.1:9"),
    ("http_proxy", "http://127.0.0.1:9"),
    ("https_proxy", "http://127.0.0.1:9"),
    ("all_proxy", "socks5://127.0.0.1:9"),
];

#[tokio::test]
async fn apply_then_worker_and_ingest_deliver_signed_webhooks_without_kubernetes() {
    let started = Instant::now();
    let redis = support::redis::dedicated();
    let rx = Receiver::start();
    let dir = process::scratch_dir("dp-apply");
    let file = write(&dir, "shardset.yaml", &shardset("hooks", &redis.url, 2, ""));

    // with dead proxies in the environment: Redis is never proxied
    let args = [
        "dataplane",
        "apply",
        "-f",
        file.to_str().unwrap(),
        "--redis",
        &redis.url,
    ];
    let (ok, out, err) = lk(&args, None, DEAD_PROXIES);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("ShardSet dp/hooks"), "{out}");
    assert!(out.contains("routing table: created; 2 shards"), "{out}");
    assert!(
        out.contains("queue policies: written for 2 shard queues"),
        "{out}"
    );
    assert!(out.contains("LANEKEEPER_DELIVERY_TIMEOUT=30s"), "{out}");

    let workers = spawn_workers(&redis, 2, DEAD_PROXIES);
    let ingest = spawn_ingest(&redis.url, DEAD_PROXIES);
    let (a, b) = tenants_on_both_shards();
    let secret_a = ingest.endpoint(&rx, a, "ok", None).await;
    let secret_b = ingest.endpoint(&rx, b, "ok", None).await;
    for i in 0..20u64 {
        // acme's own key for acme; the admin key for the other
        let (s, v) = ingest.post(&ingest.acme, a, &format!("a-{i}"), i).await;
        assert_eq!(s, 202, "{v}");
        let (s, v) = ingest.post(&ingest.admin, b, &format!("b-{i}"), i).await;
        assert_eq!(s, 202, "{v}");
    }
    // acme's key acts for acme only
    let (s, _) = ingest.post(&ingest.acme, b, "x", 0).await;
    assert_eq!(s, 403);
    let logs = format!("ingest log: {}", process::tail(&ingest.log, 20));
    wait_accepted(&rx, a, 20, &logs).await;
    wait_accepted(&rx, b, 20, &logs).await;
    assert_eq!(
        rx.bad_signatures(),
        0,
        "a signature failed the receiver's check"
    );
    let delivered = rx.arrivals().len();
    eprintln!(
        "delivered {delivered} signed webhooks through ingest and 2 workers in {:?}",
        started.elapsed()
    );

    // Redis restarted empty: ingest refuses to route by the missing table
    // (endpoints were in that Redis too: registered again with the same
    // secrets), and applying again brings the set back.
    support::redis::kill(&redis);
    let redis2 = support::redis::start_on(redis.port);
    tokio::time::sleep(Duration::from_millis(1200)).await; // ingest's caches
                                                           // the endpoints were in that Redis: registered again, same secrets
    ingest.endpoint(&rx, a, "ok", Some(&secret_a)).await;
    ingest.endpoint(&rx, b, "ok", Some(&secret_b)).await;
    // (its first calls may meet the broken connection: 503 unavailable)
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, v) = ingest.post(&ingest.admin, a, "after-loss-0", 100).await;
        assert_eq!(s, 503, "{v}");
        if v.to_string().contains("routing table missing") {
            break;
        }
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = apply(&file, &redis2.url, &[]);
    assert!(out.contains("routing table: created; 2 shards"), "{out}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for i in 0..5u64 {
        let (s, v) = ingest
            .post(&ingest.admin, a, &format!("after-loss-{i}"), 100 + i)
            .await;
        assert_eq!(s, 202, "{v}");
        let (s, v) = ingest
            .post(&ingest.admin, b, &format!("after-loss-{i}"), 100 + i)
            .await;
        assert_eq!(s, 202, "{v}");
    }
    wait_accepted(&rx, a, 25, &logs).await;
    wait_accepted(&rx, b, 25, &logs).await;
    assert_eq!(rx.bad_signatures(), 0);
    for pid in workers {
        process::signal(pid, libc::SIGTERM);
    }
    process::signal(ingest.pid, libc::SIGTERM);
    eprintln!("whole test {:?}", started.elapsed());
}

#[tokio::test]
async fn apply_again_changes_nothing_and_a_changed_spec_takes_effect() {
    let redis = support::redis::dedicated();
    let rx = Receiver::start();
    let dir = process::scratch_dir("dp-reapply");
    let (a, _) = tenants_on_both_shards();
    let spec = |max_attempts: u32, paused: bool| {
        shardset(
            "hooks",
            &redis.url,
            2,
            &format!(
                "  delivery:\n    maxAttempts: {max_attempts}\n  tenants:\n    - tenant: whale\n      paused: {paused}\n    - tenant: {a}\n      tier: gold\n"
            ),
        )
    };
    let file = write(&dir, "v1.yaml", &spec(2, true));
    let first = apply(&file, &redis.url, &[]);
    assert!(first.contains("held paused: whale"), "{first}");
    assert!(first.contains("PausedBySpec"), "{first}");
    let before = dump(&redis.url).await;
    assert!(!before.is_empty());

    // the same spec again: the same Redis, and it says so
    let again = apply(&file, &redis.url, &[]);
    assert!(
        again.contains("routing table: unchanged; 2 shards"),
        "{again}"
    );
    assert!(!again.contains("PausedBySpec"), "{again}");
    assert_eq!(
        dump(&redis.url).await,
        before,
        "a second apply changed Redis"
    );
    // from stdin, as JSON: still nothing changes
    let text = std::fs::read_to_string(&file).unwrap();
    let (ok, out, err) = lk(
        &[
            "dataplane",
            "apply",
            "-f",
            "-",
            "--redis",
            &redis.url,
            "-o",
            "json",
        ],
        Some(&text),
        &[],
    );
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["shardSet"], "dp/hooks", "{v}");
    assert_eq!(v[0]["routing"]["action"], "unchanged", "{v}");
    assert_eq!(v[0]["tenantOverrides"]["paused"], json!(["whale"]), "{v}");
    assert_eq!(
        dump(&redis.url).await,
        before,
        "a third apply changed Redis"
    );

    // the tier from spec.tenants is the one in force
    let (ok, out, err) = lk(
        &["tiers", "get", a, "--redis", &redis.url, "--shard-set", SET],
        None,
        &[],
    );
    assert!(ok, "{err}");
    assert!(out.contains("tier\tgold"), "{out}");

    let workers = spawn_workers(&redis, 2, &[]);
    let ingest = spawn_ingest(&redis.url, &[]);
    ingest.endpoint(&rx, "whale", "ok", None).await;
    ingest.endpoint(&rx, a, "fail", None).await;
    let logs = format!("ingest log: {}", process::tail(&ingest.log, 20));

    // maxAttempts 2: a failing delivery is tried twice, then dead-lettered
    let (s, v) = ingest.post(&ingest.admin, a, "f-1", 1).await;
    assert_eq!(s, 202, "{v}");
    ingest.dead_letters(a, 1).await;
    assert_eq!(rx.requests_for(a), 2, "maxAttempts 2");

    // the whale is held paused: accepted, not delivered
    for i in 0..3u64 {
        let (s, v) = ingest
            .post(&ingest.admin, "whale", &format!("w-{i}"), i)
            .await;
        assert_eq!(s, 202, "{v}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(rx.requests_for("whale"), 0, "a paused tenant was delivered");

    // changed: maxAttempts 4, the whale no longer paused
    let file2 = write(&dir, "v2.yaml", &spec(4, false));
    let out = apply(&file2, &redis.url, &[]);
    assert!(out.contains("ResumedBySpec"), "{out}");
    assert!(out.contains("held paused: none"), "{out}");
    wait_accepted(&rx, "whale", 3, &logs).await;
    let (s, v) = ingest.post(&ingest.admin, a, "f-2", 2).await;
    assert_eq!(s, 202, "{v}");
    ingest.dead_letters(a, 2).await;
    assert_eq!(rx.requests_for(a), 2 + 4, "maxAttempts 4 after the change");
    // the tenant override removed: its tier goes too
    let file3 = write(&dir, "v3.yaml", &shardset("hooks", &redis.url, 2, ""));
    let out = apply(&file3, &redis.url, &[]);
    assert!(out.contains("spec.tenants: none"), "{out}");
    let (ok, out, _) = lk(
        &["tiers", "get", a, "--redis", &redis.url, "--shard-set", SET],
        None,
        &[],
    );
    assert!(ok && out.contains("tier\t-"), "{out}");
    assert_eq!(rx.bad_signatures(), 0);
    for pid in workers {
        process::signal(pid, libc::SIGTERM);
    }
    process::signal(ingest.pid, libc::SIGTERM);
}

#[tokio::test]
async fn what_needs_kubernetes_or_the_controller_is_refused_by_field_with_nothing_written() {
    let redis = support::redis::dedicated();
    let dir = process::scratch_dir("dp-refuse");
    let url = redis.url.as_str();
    let run = |file: &Path, extra: &[&str]| {
        let mut args = vec![
            "dataplane",
            "apply",
            "-f",
            file.to_str().unwrap(),
            "--redis",
            url,
        ];
        args.extend(extra);
        refused(&args, &[])
    };
    let good = shardset("hooks", url, 2, "");

    // another kind, another version, a missing field, a bad value
    let f = write(
        &dir,
        "kind.yaml",
        &good.replace("kind: ShardSet", "kind: DedicatedLane"),
    );
    let e = run(&f, &[]);
    assert!(
        e.contains("kind DedicatedLane") && e.contains("only ShardSet"),
        "{e}"
    );
    let f = write(&dir, "version.yaml", &good.replace("v1alpha1", "v1beta1"));
    let e = run(&f, &[]);
    assert!(e.contains("apiVersion lanekeeper.io/v1beta1"), "{e}");
    let f = write(
        &dir,
        "missing.yaml",
        &good.replace(
            "    image: ghcr.io/example/lanekeeper:dev\n",
            "    concurrency: 4\n",
        ),
    );
    let e = run(&f, &[]);
    assert!(e.contains("spec.worker") && e.contains("image"), "{e}");
    // a misspelt field is named, not dropped (kubectl --validate=strict
    // refuses it as well)
    let f = write(
        &dir,
        "typo.yaml",
        &shardset(
            "hooks",
            url,
            2,
            "  scheduler:\n    maxInFlightPerTenat: 8\n  tenants:\n    - tenant: acme\n      weigth: 2\n",
        ),
    );
    let e = run(&f, &[]);
    assert!(
        e.contains("unknown fields spec.scheduler.maxInFlightPerTenat, spec.tenants.0.weigth"),
        "{e}"
    );
    let f = write(&dir, "shards0.yaml", &shardset("hooks", url, 0, ""));
    let e = run(&f, &[]);
    assert!(e.contains("spec.shards 0 is out of range"), "{e}");
    let f = write(
        &dir,
        "badtenant.yaml",
        &shardset("hooks", url, 2, "  tenants:\n    - tenant: \"no spaces\"\n"),
    );
    let e = run(&f, &[]);
    assert!(e.contains("spec.tenants[0].tenant"), "{e}");
    // a second document that is wrong: the first is not written either
    let f = write(
        &dir,
        "two.yaml",
        &format!("{good}---\n{}", shardset("other", url, 0, "")),
    );
    let e = run(&f, &[]);
    assert!(e.contains("document 2"), "{e}");
    assert!(
        dump(url).await.is_empty(),
        "a refused apply wrote something"
    );

    // a Secret the CLI cannot read: the URL must come with --redis
    let secret_url = good.replace(
        &format!("    url: {url}\n"),
        "    urlSecretRef: {name: redis, key: url}\n",
    );
    let f = write(&dir, "secret.yaml", &secret_url);
    let e = refused(&["dataplane", "apply", "-f", f.to_str().unwrap()], &[]);
    assert!(
        e.contains("spec.redis.urlSecretRef") && e.contains("--redis"),
        "{e}"
    );
    // a CA in a Secret: the file must be given
    let f = write(
        &dir,
        "tls.yaml",
        &good.replace(
            &format!("    url: {url}\n"),
            "    url: rediss://127.0.0.1:1\n    tls: {caSecretRef: {name: redis-ca, key: ca.crt}}\n",
        ),
    );
    let e = run(&f, &[]);
    assert!(
        e.contains("spec.redis.tls.caSecretRef") && e.contains("--redis-ca-file"),
        "{e}"
    );
    // a password for a URL not stored with it: the controller's rule
    let f = write(
        &dir,
        "password.yaml",
        &shardset("hooks", url, 2, "").replace(
            &format!("    url: {url}\n"),
            &format!("    url: {url}\n    passwordSecretRef: {{name: redis, key: password}}\n"),
        ),
    );
    let e = run(&f, &[]);
    assert!(e.contains("spec.redis.passwordSecretRef"), "{e}");
    // --shard-set naming another set
    let f = write(&dir, "good.yaml", &good);
    let e = run(&f, &["--shard-set", "dp/other"]);
    assert!(e.contains("--shard-set") && e.contains("dp/hooks"), "{e}");
    assert!(
        dump(url).await.is_empty(),
        "a refused apply wrote something"
    );

    // a tier ConfigMap: refused without --tiers-file, its bad line named
    // (and not quoted), synced from a good one
    let tiered = shardset(
        "hooks",
        url,
        2,
        "  scheduler:\n    tierAssignments:\n      configMapName: tiers\n      key: tiers\n",
    );
    let f = write(&dir, "tiered.yaml", &tiered);
    let e = run(&f, &[]);
    assert!(
        e.contains("spec.scheduler.tierAssignments") && e.contains("--tiers-file"),
        "{e}"
    );
    let bad = write(
        &dir,
        "bad-tiers.txt",
        "acme gold\nsecret-customer gold extra\n",
    );
    let e = run(&f, &["--tiers-file", bad.to_str().unwrap()]);
    assert!(e.contains("line 2"), "{e}");
    assert!(!e.contains("secret-customer"), "{e}");
    assert!(
        dump(url).await.is_empty(),
        "a refused apply wrote something"
    );
    let tiers = write(&dir, "tiers.txt", "# tiers\nacme gold\nglobex silver\n");
    let e = run(
        &f.with_file_name("good.yaml"),
        &["--tiers-file", tiers.to_str().unwrap()],
    );
    assert!(
        e.contains("no ShardSet sets spec.scheduler.tierAssignments"),
        "{e}"
    );
    let out = apply(&f, url, &["--tiers-file", tiers.to_str().unwrap()]);
    assert!(
        out.contains("tier assignments: 2 tenants, synced from tiers/sha256:"),
        "{out}"
    );
    assert!(out.contains("TierAssignmentsSynced"), "{out}");
    let out = apply(&f, url, &["--tiers-file", tiers.to_str().unwrap()]);
    assert!(
        !out.contains("TierAssignmentsSynced"),
        "the same file synced again: {out}"
    );
    let (ok, out, _) = lk(
        &["tiers", "get", "globex", "--redis", url, "--shard-set", SET],
        None,
        &[],
    );
    assert!(
        ok && out.contains("tier\tsilver") && out.contains("configMap\tsilver"),
        "{out}"
    );

    // another shard count for a set whose table has one: a reshard
    let before = dump(url).await;
    let f3 = write(&dir, "three.yaml", &shardset("hooks", url, 3, ""));
    let e = run(&f3, &[]);
    assert!(
        e.contains("spec.shards is 3")
            && e.contains("has 2 shards")
            && e.contains("Keep spec.shards: 2"),
        "{e}"
    );
    assert_eq!(dump(url).await, before, "a refused reshard wrote something");

    // Redis unreachable, or its URL unparsable, with a password in it or
    // given apart: the message never shows the password
    for (target, env) in [
        ("redis://:hunter2@127.0.0.1:1", vec![]),
        ("redis://user:hunter2@127.0.0.1:1/0", vec![]),
        (
            "redis://127.0.0.1:1",
            vec![("LANEKEEPER_REDIS_PASSWORD", "hunter2")],
        ),
        ("redis://:hunter2@[::1", vec![]),
        ("http://:hunter2@127.0.0.1:1", vec![]),
    ] {
        let args = [
            "dataplane",
            "apply",
            "-f",
            f.to_str().unwrap(),
            "--redis",
            target,
        ];
        let (ok, out, err) = lk(&args, None, &env);
        assert!(!ok, "{target}: {out}");
        assert!(
            !err.contains("hunter2") && !out.contains("hunter2"),
            "{target}: {err}"
        );
        assert!(!err.trim().is_empty());
    }
}
