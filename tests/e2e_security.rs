//! The operator under the cluster's RBAC (issue 25): the controller runs as
//! the chart's ServiceAccount with `config/rbac`'s rights and no more, and the
//! attacker is a namespace user who may edit ShardSets and DedicatedLanes but
//! may not create pods or Deployments and may not read Secrets. Full control
//! plane (RBAC on, controller-manager, kwok) and a real Redis.

mod support;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use support::controlplane::{self, ControlPlane};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `kubectl` as `who`, with `input` on stdin when there is one.
fn kubectl_as(cp: &ControlPlane, who: &Path, args: &[&str], input: Option<&str>) -> Output {
    cp.kubectl_as_stdin_output(who, args, input.unwrap_or(""))
}

fn can_i(cp: &ControlPlane, who: &Path, ns: &str, verb: &str, resource: &str) -> bool {
    let out = kubectl_as(cp, who, &["auth", "can-i", verb, resource, "-n", ns], None);
    String::from_utf8_lossy(&out.stdout).trim() == "yes"
}

/// The harness itself: the author has exactly the rights the tests assume,
/// and the controller reconciles her ShardSet with the chart's rights only.
#[test]
fn the_author_has_only_shardset_rights_and_the_rbac_controller_reconciles_her_set() {
    let cp = cluster();
    let ns = cp.namespace("rbac");
    let author = cp.shardset_author(&ns);
    assert!(can_i(cp, &author, &ns, "create", "shardsets.lanekeeper.io"));
    assert!(can_i(
        cp,
        &author,
        &ns,
        "patch",
        "dedicatedlanes.lanekeeper.io"
    ));
    for (verb, resource) in [
        ("create", "deployments.apps"),
        ("create", "pods"),
        ("get", "secrets"),
        ("create", "rolebindings.rbac.authorization.k8s.io"),
    ] {
        assert!(
            !can_i(cp, &author, &ns, verb, resource),
            "the author may {verb} {resource}"
        );
    }

    let redis = support::redis::shared();
    let (pid, log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    let set = format!(
        "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: hooks}}\n\
         spec:\n  shards: 2\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:v1\", replicas: 1, concurrency: 4}}\n",
        redis.url
    );
    let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(&set));
    assert!(
        out.status.success(),
        "the author cannot apply a ShardSet: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the set to be Ready", Duration::from_secs(120), || {
        let out = cp.kubectl_ok(&[
            "get",
            "shardset",
            "hooks",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ]);
        out.trim() == "True"
    });
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "name"]);
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !log_text.contains("forbidden"),
        "the controller was refused something under the chart's RBAC:\n{}\nEvents: {events}",
        support::process::tail(&log, 40)
    );
    support::process::signal(pid, libc::SIGKILL);
}

fn status_json(cp: &ControlPlane, ns: &str, name: &str) -> String {
    cp.kubectl_ok(&[
        "get",
        "shardset",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.status}",
    ])
}

/// The Degraded condition of a set: (status, reason, message).
fn degraded(cp: &ControlPlane, ns: &str, name: &str) -> (String, String, String) {
    let out = cp.kubectl_ok(&[
        "get",
        "shardset",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Degraded\")]}",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    (s("status"), s("reason"), s("message"))
}

fn shardset_yaml(name: &str, redis: &str, worker: &str) -> String {
    format!(
        "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: {name}}}\n\
         spec:\n  shards: 1\n  redis: {redis}\n  worker: {worker}\n"
    )
}

/// A TCP listener that accepts and never answers, keeping what it receives.
fn silent_listener() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().unwrap().port();
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let sink = sink.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    (port, got)
}

/// The team's Redis Secret, the one name the chart's RBAC lets the controller read.
fn team_secret(cp: &ControlPlane, ns: &str, url: &str, password: &str) {
    cp.kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "lanekeeper-redis",
        "-n",
        ns,
        &format!("--from-literal=url={url}"),
        &format!("--from-literal=password={password}"),
    ]);
}

/// Item 1: the author points `url` at her own listener and names the team's
/// password Secret: the API server refuses it and her listener never sees
/// the password.
#[test]
fn a_password_goes_only_to_the_url_stored_with_it() {
    let cp = cluster();
    let ns = cp.namespace("pwurl");
    let author = cp.shardset_author(&ns);
    let password = "team-pw-Zq81xv";
    team_secret(cp, &ns, &support::redis::shared().url, password);
    let (port, got) = silent_listener();
    let (pid, _log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    let set = shardset_yaml(
        "steal",
        &format!(
            "{{url: \"redis://127.0.0.1:{port}\", passwordSecretRef: {{name: lanekeeper-redis, key: password}}}}"
        ),
        "{image: \"lanekeeper:v1\", replicas: 1}",
    );
    let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(&set));
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    std::thread::sleep(Duration::from_secs(8));
    let received = String::from_utf8_lossy(&got.lock().unwrap()).to_string();
    support::process::signal(pid, libc::SIGKILL);
    assert!(
        !received.contains(password),
        "the author's server received the team's password: {received:?}"
    );
    assert!(
        !out.status.success() && stderr.contains("passwordSecretRef must name the same Secret"),
        "the API server accepted a password sent to another URL: {stderr}"
    );
}

/// Item 2: `urlSecretRef` pointing at the password key: status and Events
/// say which Secret key is unusable, never its value.
#[test]
fn a_value_read_from_a_secret_never_shows_in_status_or_events() {
    let cp = cluster();
    let ns = cp.namespace("echo");
    let author = cp.shardset_author(&ns);
    let password = "echo-pw-Kd93ma";
    team_secret(cp, &ns, &support::redis::shared().url, password);
    let (pid, log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    let set = shardset_yaml(
        "echo",
        "{urlSecretRef: {name: lanekeeper-redis, key: password}, passwordSecretRef: {name: lanekeeper-redis, key: password}}",
        "{image: \"lanekeeper:v1\", replicas: 1}",
    );
    let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(&set));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until(
        "status to speak of the Redis URL",
        Duration::from_secs(60),
        || status_json(cp, &ns, "echo").to_lowercase().contains("url"),
    );
    std::thread::sleep(Duration::from_secs(3));
    let status = status_json(cp, &ns, "echo");
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    support::process::signal(pid, libc::SIGKILL);
    assert!(
        !status.contains(password),
        "status echoes the Secret: {status}"
    );
    assert!(
        !events.contains(password),
        "an Event echoes the Secret: {events}"
    );
    assert!(!log_text.contains(password), "the log echoes the Secret");
    assert!(
        status.contains("lanekeeper-redis key password"),
        "status does not say which Secret key is unusable: {status}"
    );
}

/// Item 3: the worker template gives the author no more than the operator's
/// configuration: a privileged ServiceAccount, other Secrets, a system
/// priority class, tolerations of everything, proxies are refused (status
/// Degraded naming the field, and an Event); the controller's own env names
/// are refused by the API server; workers mount no API token.
#[test]
fn a_shardset_gets_no_more_than_the_operator_allows_its_workers() {
    let cp = cluster();
    let ns = cp.namespace("deputy");
    let author = cp.shardset_author(&ns);
    cp.kubectl_ok(&["create", "serviceaccount", "root", "-n", &ns]);
    cp.kubectl_ok(&[
        "create",
        "rolebinding",
        "root-admin",
        "-n",
        &ns,
        "--clusterrole=cluster-admin",
        &format!("--serviceaccount={ns}:root"),
    ]);
    cp.kubectl_ok(&["create", "serviceaccount", "hooks-worker", "-n", &ns]);
    let redis = support::redis::shared();
    // By environment (the chart passes flags), so that a controller without
    // the policy still starts and shows what it lets through.
    let (pid, log) = cp.spawn_controller_with_rbac(
        &ns,
        &[],
        &[("LANEKEEPER_WORKER_SERVICE_ACCOUNT", "hooks-worker")],
    );
    let url = format!("{{url: \"{}\"}}", redis.url);
    cp.kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "prod-db",
        "-n",
        &ns,
        "--from-literal=url=redis://prod-db:6379",
    ]);
    let secret_url = "{urlSecretRef: {name: prod-db, key: url}}";
    let cases = [
        (
            "sa",
            url.as_str(),
            "{image: lk, serviceAccountName: root}",
            "spec.worker.serviceAccountName",
            "ServiceAccountNotAllowed",
        ),
        (
            "secret",
            url.as_str(),
            "{image: lk, env: [{name: DB, valueFrom: {secretKeyRef: {name: prod-db, key: url}}}]}",
            "spec.worker.env[0].valueFrom.secretKeyRef.name",
            "SecretNotAllowed",
        ),
        (
            "prio",
            url.as_str(),
            "{image: lk, priorityClassName: system-node-critical}",
            "spec.worker.priorityClassName",
            "PriorityClassNotAllowed",
        ),
        (
            "tol",
            url.as_str(),
            "{image: lk, tolerations: [{operator: Exists}]}",
            "spec.worker.tolerations[0]",
            "TolerationNotAllowed",
        ),
        (
            "proxy",
            url.as_str(),
            "{image: lk, env: [{name: https_proxy, value: 'http://me:3128'}]}",
            "spec.worker.env[0].name",
            "EnvNotAllowed",
        ),
        (
            "redissecret",
            secret_url,
            "{image: lk}",
            "spec.redis.urlSecretRef.name",
            "SecretNotAllowed",
        ),
    ];
    for (name, redis, worker, _, _) in &cases {
        let out = kubectl_as(
            cp,
            &author,
            &["apply", "-n", &ns, "-f", "-"],
            Some(&shardset_yaml(name, redis, worker)),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let good = shardset_yaml("good", &url, "{image: lk, replicas: 1}");
    let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(&good));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut refused = Vec::new();
    for (name, _, _, field, reason) in &cases {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = degraded(cp, &ns, name);
        while !(got.0 == "True" && got.1 == *reason) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(300));
            got = degraded(cp, &ns, name);
        }
        refused.push((name, field, reason, got.clone()));
        let deployments = cp.kubectl_ok(&[
            "get",
            "deployments",
            "-n",
            &ns,
            "-l",
            &format!("app.kubernetes.io/instance={name}"),
            "-o",
            "name",
        ]);
        assert!(
            deployments.trim().is_empty(),
            "set {name}: Deployments were made: {deployments}; Degraded {got:?}\n{}",
            support::process::tail(&log, 20)
        );
        assert!(
            got.0 == "True" && got.1 == *reason && got.2.contains(field),
            "set {name}: Degraded {got:?}, want {reason} naming {field}"
        );
    }
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    for (name, _, reason, _) in &refused {
        assert!(
            events.contains(&format!("\"reason\": \"{reason}\"")),
            "no {reason} Event for {name}: {events}"
        );
    }
    // The set within the limits: workers run as the operator's account,
    // without an API token.
    wait_until("the good set's Deployment", Duration::from_secs(60), || {
        cp.kubectl()
            .args(["get", "deployment", "good-shard-00", "-n", &ns])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let pod = cp.kubectl_ok(&[
        "get",
        "deployment",
        "good-shard-00",
        "-n",
        &ns,
        "-o",
        "jsonpath={.spec.template.spec}",
    ]);
    let pod: serde_json::Value = serde_json::from_str(&pod).unwrap();
    assert_eq!(pod["automountServiceAccountToken"], false, "{pod}");
    assert_eq!(pod["serviceAccountName"], "hooks-worker", "{pod}");
    // The controller's own env names: refused by the API server.
    for name in ["LANEKEEPER_ALLOW_CIDRS", "LANEKEEPER_REDIS_URL"] {
        let bad = shardset_yaml(
            "cidrs",
            &url,
            &format!("{{image: lk, env: [{{name: {name}, value: '0.0.0.0/0'}}]}}"),
        );
        let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(&bad));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("worker.env must not set LANEKEEPER_*"),
            "{name} was accepted: {stderr}"
        );
    }
    support::process::signal(pid, libc::SIGKILL);
}

/// `CLIENT LIST` lines of `redis` (connected clients, redis-cli included).
fn clients(redis: &support::redis::TestRedis) -> usize {
    support::redis::cli(redis, &["CLIENT", "LIST"])
        .lines()
        .filter(|l| l.contains("addr="))
        .count()
}

fn observed(cp: &ControlPlane, ns: &str, name: &str) -> bool {
    let out = cp.kubectl_ok(&[
        "get",
        "shardset",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.metadata.generation} {.status.observedGeneration}",
    ]);
    let mut it = out.split_whitespace();
    matches!((it.next(), it.next()), (Some(a), Some(b)) if a == b)
}

/// Item 4: one connection per set, whatever its URL history; a deleted
/// set's connection is closed.
#[test]
fn redis_connections_stay_bounded_over_url_changes_and_close_after_deletes() {
    let cp = cluster();
    let ns = cp.namespace("conns");
    let redis = support::redis::dedicated();
    let base = clients(&redis);
    let (pid, log) = cp.spawn_controller_with_rbac(&ns, &["--promotion-tick=2s"], &[]);
    let sets = ["c0", "c1", "c2"];
    let apply = |db: u32| {
        for name in sets {
            let url = format!("{{url: \"redis://127.0.0.1:{}/{db}\"}}", redis.port);
            cp.kubectl_stdin(
                &["apply", "-n", &ns, "-f", "-"],
                &shardset_yaml(name, &url, "{image: lk, replicas: 1}"),
            );
        }
        for name in sets {
            wait_until(
                "the set to observe its spec",
                Duration::from_secs(60),
                || observed(cp, &ns, name),
            );
        }
    };
    apply(0);
    std::thread::sleep(Duration::from_secs(3));
    let first = clients(&redis);
    for db in 1..=8 {
        apply(db);
    }
    std::thread::sleep(Duration::from_secs(3));
    let after = clients(&redis);
    assert!(
        after <= first + sets.len(),
        "Redis clients grew with URL changes: {base} before, {first} with {} sets, {after} after 8 URL changes each\n{}",
        sets.len(),
        support::process::tail(&log, 20)
    );
    for name in sets {
        cp.kubectl_ok(&["delete", "shardset", name, "-n", &ns, "--wait=false"]);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = clients(&redis);
    while now > base + 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        now = clients(&redis);
    }
    support::process::signal(pid, libc::SIGKILL);
    support::redis::kill(&redis);
    assert!(
        now <= base + 1,
        "deleting the sets closed no connection: {base} before, {after} with the sets, {now} after deletes\n{}",
        support::process::tail(&log, 30)
    );
}

/// Item 5: sets whose Redis accepts TCP and never answers do not stretch a
/// healthy set's promotion tick.
#[test]
fn a_redis_that_never_answers_does_not_stretch_other_sets_promotion_ticks() {
    let cp = cluster();
    let ns = cp.namespace("stall");
    let redis = support::redis::shared();
    let (port, _) = silent_listener();
    let tick = Duration::from_secs(2);
    let (pid, log) = cp.spawn_controller_with_rbac(
        &ns,
        &["--promotion-tick=2s"],
        &[("RUST_LOG", "info,lanekeeper::controller::promotion=debug")],
    );
    for i in 0..5 {
        cp.kubectl_stdin(
            &["apply", "-n", &ns, "-f", "-"],
            &shardset_yaml(
                &format!("hang-{i}"),
                &format!("{{url: \"redis://127.0.0.1:{port}\"}}"),
                "{image: lk, replicas: 1}",
            ),
        );
    }
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset_yaml(
            "healthy",
            &format!("{{url: \"{}\"}}", redis.url),
            "{image: lk, replicas: 1}",
        ),
    );
    // When each "measured" line of the healthy set appears.
    let count = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("promotion: set measured") && l.contains("healthy"))
            .count()
    };
    let mut seen = Vec::new();
    let (mut last, end) = (0, Instant::now() + Duration::from_secs(40));
    while Instant::now() < end {
        let n = count();
        if n > last {
            seen.push(Instant::now());
            last = n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    support::process::signal(pid, libc::SIGKILL);
    let gaps: Vec<Duration> = seen.windows(2).map(|w| w[1] - w[0]).collect();
    let worst = gaps.iter().max().copied().unwrap_or(Duration::MAX);
    assert!(
        gaps.len() >= 10 && worst < tick + Duration::from_millis(1500),
        "the healthy set's promotion ticks: {} in 40 s, worst gap {worst:?} (tick {tick:?})\n{}",
        seen.len(),
        support::process::tail(&log, 20)
    );
}

/// Write ConfigMap `name` with `text` under key `tiers` (created, or
/// replaced whole: `apply` would keep a copy of 600 KB in an annotation).
fn tier_config_map(cp: &ControlPlane, ns: &str, name: &str, text: &str) {
    let file = support::process::scratch_dir("tiers").join("tiers");
    std::fs::write(&file, text).unwrap();
    let yaml = cp.kubectl_ok(&[
        "create",
        "configmap",
        name,
        "-n",
        ns,
        &format!("--from-file=tiers={}", file.display()),
        "--dry-run=client",
        "-o",
        "yaml",
    ]);
    let exists = cp
        .kubectl()
        .args(["get", "configmap", name, "-n", ns])
        .output()
        .is_ok_and(|o| o.status.success());
    let verb = if exists { "replace" } else { "create" };
    cp.kubectl_stdin(&[verb, "-n", ns, "-f", "-"], &yaml);
}

/// `status.tierAssignments` of a set (null when absent).
fn tier_status(cp: &ControlPlane, ns: &str, name: &str) -> serde_json::Value {
    let out = cp.kubectl_ok(&[
        "get",
        "shardset",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.status.tierAssignments}",
    ]);
    serde_json::from_str(&out).unwrap_or_default()
}

/// Issue 20, item 3: tiers in bulk from a ConfigMap. 40,000 assignments are
/// synced into Redis; a change syncs what changed; a bad line syncs
/// nothing, keeps the last good assignments and names the line without
/// quoting it; Redis restarted empty gets them back; a ConfigMap the
/// controller's RBAC does not name is never read (its author could not read
/// it either); a missing one keeps the last good; unsetting drops them.
#[test]
fn tier_assignments_sync_from_the_allowed_config_map_all_or_nothing() {
    let cp = cluster();
    let ns = cp.namespace("tiers");
    let author = cp.shardset_author(&ns);
    let redis = support::redis::dedicated();
    let (pid, log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    let key = format!("lk:{{{ns}/hooks}}:tiers");
    let hlen = || {
        support::redis::cli(&redis, &["HLEN", &key])
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX)
    };
    let hget = |t: &str| {
        support::redis::cli(&redis, &["HGET", &key, t])
            .trim()
            .to_string()
    };
    let set = |assignments: &str| {
        format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: hooks}}\n\
             spec:\n  shards: 1\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:v1\", replicas: 1}}\n\
             {assignments}",
            redis.url
        )
    };
    let apply = |yaml: &str| {
        let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let with = |cm: &str| {
        set(&format!(
            "  scheduler: {{tierAssignments: {{configMapName: {cm}}}}}\n"
        ))
    };
    // The schema names the field of a name that is no ConfigMap's.
    let out = kubectl_as(
        cp,
        &author,
        &["apply", "-n", &ns, "-f", "-"],
        Some(&with("Not_A_Name")),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("tierAssignments.configMapName"),
        "{stderr}"
    );

    let tiers = ["gold", "silver", "bronze", "free"];
    let lines = |n: usize| -> Vec<String> {
        (0..n)
            .map(|i| format!("t-{i:05} {}", tiers[i % 4]))
            .collect()
    };
    let mut text = format!("# {} tenants\n{}\n", 40_000, lines(40_000).join("\n"));
    tier_config_map(cp, &ns, "lanekeeper-tiers", &text);
    let started = Instant::now();
    apply(&with("lanekeeper-tiers"));
    wait_until("40,000 assignments synced", Duration::from_secs(90), || {
        tier_status(cp, &ns, "hooks")["tenants"] == 40_000
    });
    let took = started.elapsed();
    println!(
        "40,000 tier assignments in status {:.1} s after the apply",
        took.as_secs_f64()
    );
    assert_eq!(hlen(), 40_000);
    assert_eq!(hget("t-00001"), "silver");
    assert_eq!(hget("t-39999"), "free");
    let st = tier_status(cp, &ns, "hooks");
    let first = st["synced"].as_str().unwrap().to_string();
    assert!(first.starts_with("lanekeeper-tiers/"), "{st}");
    assert!(st.get("message").is_none(), "{st}");

    // A change: one tenant's tier, one gone, one new.
    let mut changed = lines(40_000);
    changed[1] = "t-00001 gold".into();
    changed.remove(2);
    changed.push("late-joiner silver".into());
    text = changed.join("\n");
    tier_config_map(cp, &ns, "lanekeeper-tiers", &text);
    wait_until("the change synced", Duration::from_secs(60), || {
        tier_status(cp, &ns, "hooks")["synced"] != first.as_str()
    });
    assert_eq!(hget("t-00001"), "gold");
    assert_eq!(hget("t-00002"), "");
    assert_eq!(hget("late-joiner"), "silver");
    assert_eq!(hlen(), 40_000);
    let good = tier_status(cp, &ns, "hooks")["synced"]
        .as_str()
        .unwrap()
        .to_string();

    // A bad line: nothing of it is synced, the line is named, not quoted.
    let mut bad = changed.clone();
    bad[0] = "t-00000 platinum".into();
    bad[6] = "hidden-customer gold extra".into();
    tier_config_map(cp, &ns, "lanekeeper-tiers", &bad.join("\n"));
    wait_until("the bad line reported", Duration::from_secs(60), || {
        tier_status(cp, &ns, "hooks")["message"]
            .as_str()
            .is_some_and(|m| m.contains("line 7"))
    });
    let st = tier_status(cp, &ns, "hooks");
    assert_eq!(st["synced"], good.as_str(), "{st}");
    assert_eq!(
        hget("t-00000"),
        "gold",
        "nothing of the bad version is written"
    );
    assert_eq!(hlen(), 40_000);
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(events.contains("InvalidTierAssignments"), "{events}");
    assert!(events.contains("TierAssignmentsSynced"), "{events}");
    for shown in [events.as_str(), &status_json(cp, &ns, "hooks")] {
        assert!(!shown.contains("hidden-customer"), "{shown}");
    }

    // Redis restarted empty: the assignments come back with the rest.
    tier_config_map(cp, &ns, "lanekeeper-tiers", &text);
    wait_until("the good version again", Duration::from_secs(60), || {
        tier_status(cp, &ns, "hooks").get("message").is_none()
            && tier_status(cp, &ns, "hooks")["synced"] != good.as_str()
    });
    support::redis::cli(&redis, &["FLUSHALL"]);
    wait_until("the assignments restored", Duration::from_secs(60), || {
        hlen() == 40_000
    });
    assert_eq!(hget("t-00001"), "gold");

    // A ConfigMap the controller may not read: refused, nothing of it read.
    cp.kubectl_ok(&[
        "create",
        "configmap",
        "team-private",
        "-n",
        &ns,
        "--from-literal=tiers=private-customer gold",
    ]);
    apply(&with("team-private"));
    wait_until("the refusal", Duration::from_secs(60), || {
        tier_status(cp, &ns, "hooks")["message"]
            .as_str()
            .is_some_and(|m| m.contains("may not read ConfigMap \"team-private\""))
    });
    assert_eq!(hlen(), 40_000, "the last good assignments stay");
    assert_eq!(hget("private-customer"), "");
    // An allowed name whose ConfigMap is gone: the same. (A name RBAC does
    // not allow is refused whether or not it exists: 403 before 404.)
    cp.kubectl_ok(&["delete", "configmap", "lanekeeper-tiers", "-n", &ns]);
    apply(&with("lanekeeper-tiers"));
    wait_until("not found", Duration::from_secs(60), || {
        tier_status(cp, &ns, "hooks")["message"]
            .as_str()
            .is_some_and(|m| m.contains("not found"))
    });
    assert_eq!(hlen(), 40_000);
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(events.contains("TierConfigMapNotAllowed"), "{events}");
    assert!(events.contains("TierConfigMapNotFound"), "{events}");
    assert!(!events.contains("private-customer"), "{events}");

    // Unset: the ConfigMap's assignments go (the admin API's would stay).
    apply(&set(""));
    wait_until("the assignments dropped", Duration::from_secs(60), || {
        hlen() == 0 && tier_status(cp, &ns, "hooks").is_null()
    });
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !log_text.contains("private-customer"),
        "{}",
        support::process::tail(&log, 40)
    );
    support::process::signal(pid, libc::SIGKILL);
    support::redis::kill(&redis);
}

fn overrides_status(cp: &ControlPlane, ns: &str, name: &str) -> serde_json::Value {
    let out = cp.kubectl_ok(&[
        "get",
        "shardset",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.status.tenantOverrides}",
    ]);
    serde_json::from_str(&out).unwrap_or_default()
}

/// Issue 21, item 2: per-tenant overrides from a `kubectl apply` of the
/// ShardSet, by its author, reach Redis at the next reconcile: weight, cap
/// and rate limit in the queue policy, the tier in the spec's tier hash
/// (over the ConfigMap's, under the admin API's), and `paused: true` holds
/// the tenant paused (a hand resume is undone); removing it resumes the
/// tenant once. Status says what is in force, and the audit names the set.
#[test]
fn tenant_overrides_from_a_kubectl_apply_reach_redis_and_status() {
    let cp = cluster();
    let ns = cp.namespace("overrides");
    let author = cp.shardset_author(&ns);
    let redis = support::redis::dedicated();
    let (pid, log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    let set = |tenants: &str| {
        format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: hooks}}\n\
             spec:\n  shards: 1\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:v1\", replicas: 1}}\n\
             {tenants}",
            redis.url
        )
    };
    let apply = |yaml: &str| {
        let out = kubectl_as(cp, &author, &["apply", "-n", &ns, "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let cli = |args: &[&str]| support::redis::cli(&redis, args).trim().to_string();
    let q = format!(
        "lk:{{{ns}/hooks/{}}}",
        lanekeeper::routing::QueueId::Shard(0)
    );
    apply(&set(
        "  tenants:\n\
         \x20 - {tenant: vip, weight: 4, maxInFlight: 24, tier: gold}\n\
         \x20 - {tenant: whale, rateLimit: {perSecond: 5, burst: 10}, paused: true}\n",
    ));
    wait_until("the overrides applied", Duration::from_secs(60), || {
        overrides_status(cp, &ns, "hooks")["paused"] == serde_json::json!(["whale"])
    });
    let st = overrides_status(cp, &ns, "hooks");
    assert_eq!(st["tenants"], 2, "{st}");
    assert_eq!(cli(&["HGET", &format!("{q}:weights"), "vip"]), "4");
    assert_eq!(cli(&["HGET", &format!("{q}:caps"), "vip"]), "24");
    assert_eq!(cli(&["HGET", &format!("{q}:limits"), "whale"]), "5 10 0 0");
    assert_eq!(
        cli(&["HGET", &format!("lk:{{{ns}/hooks}}:tiers:spec"), "vip"]),
        "gold"
    );
    assert_eq!(cli(&["HGET", &format!("{q}:t:whale"), "up"]), "1");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt
        .block_on(lanekeeper::store::Store::connect(
            &redis.url,
            lanekeeper::store::SetId::new(&ns, "hooks"),
            Default::default(),
        ))
        .unwrap();
    let audit = rt.block_on(store.audit_entries(Some("whale"), 10)).unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.who == format!("shardset:{ns}/hooks") && e.operation == "pause"),
        "{audit:?}"
    );
    // the admin API's tier wins over the spec's
    rt.block_on(store.put_api_tiers(&[("vip".into(), Some("silver".into()))]))
        .unwrap();
    let tiers = rt.block_on(store.tenant_tiers(&["vip"])).unwrap();
    assert_eq!(tiers, vec![Some("silver".to_string())]);

    // An operator's own pause, then listed paused in Git too: the spec did
    // not make it, so it neither records it nor, later, lifts it.
    rt.block_on(store.user_pause_audited("held", true, "test:ops", Some("incident")))
        .unwrap();
    apply(&set("  tenants:\n\
         \x20 - {tenant: vip, weight: 4, maxInFlight: 24, tier: gold}\n\
         \x20 - {tenant: whale, rateLimit: {perSecond: 5, burst: 10}, paused: true}\n\
         \x20 - {tenant: held, paused: true}\n"));
    wait_until("three overrides", Duration::from_secs(60), || {
        overrides_status(cp, &ns, "hooks")["tenants"] == 3
    });
    assert_eq!(
        overrides_status(cp, &ns, "hooks")["paused"],
        serde_json::json!(["whale"]),
        "only the pause the spec made is the spec's"
    );

    // a hand resume is undone while Git says paused
    rt.block_on(store.user_pause_audited("whale", false, "test:ops", None))
        .unwrap();
    cp.kubectl_ok(&[
        "annotate",
        "shardset",
        "hooks",
        "-n",
        &ns,
        "--overwrite",
        "poke=1",
    ]);
    wait_until("whale paused again", Duration::from_secs(60), || {
        cli(&["HGET", &format!("{q}:t:whale"), "up"]) == "1"
    });
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(events.contains("PausedBySpec"), "{events}");

    // removed from Git: resumed once, and the rest of its overrides go
    apply(&set("  tenants:\n  - {tenant: vip, weight: 4}\n"));
    wait_until("whale resumed", Duration::from_secs(60), || {
        cli(&["HGET", &format!("{q}:t:whale"), "up"]) == "0"
            && overrides_status(cp, &ns, "hooks").get("paused").is_none()
    });
    assert_eq!(cli(&["HGET", &format!("{q}:caps"), "vip"]), "");
    assert_eq!(cli(&["HGET", &format!("{q}:limits"), "whale"]), "");
    assert_eq!(
        cli(&["HGET", &format!("lk:{{{ns}/hooks}}:tiers:spec"), "vip"]),
        ""
    );
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(events.contains("ResumedBySpec"), "{events}");
    assert_eq!(
        cli(&["HGET", &format!("{q}:t:held"), "up"]),
        "1",
        "the operator's pause stays"
    );
    // no overrides at all: the status field goes
    apply(&set(""));
    wait_until("no overrides status", Duration::from_secs(60), || {
        overrides_status(cp, &ns, "hooks").is_null()
    });
    let _ = log;
    support::process::signal(pid, libc::SIGKILL);
    support::redis::kill(&redis);
}
