//! The operator end to end: `lanekeeper controller` as a process against the
//! full test control plane (kube-apiserver, controller-manager, scheduler and
//! a kwok node, so Deployments really become available) and a real Redis.

mod support;

use std::time::{Duration, Instant};

use support::controlplane::{self, ControlPlane};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

fn controller(cp: &ControlPlane, ns: &str) -> u32 {
    cp.spawn_controller(ns, &[])
}

fn shardset(name: &str, shards: u32, redis_url: &str, image: &str, extra_worker: &str) -> String {
    format!(
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: {shards}
  redis: {{url: "{redis_url}"}}
  worker: {{image: "{image}", replicas: 1, concurrency: 8{extra_worker}}}
"#
    )
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn json(cp: &ControlPlane, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&cp.kubectl_ok(args)).unwrap()
}

fn deployments(cp: &ControlPlane, ns: &str, set: &str) -> Vec<serde_json::Value> {
    let list = json(
        cp,
        &[
            "get",
            "deployments",
            "-n",
            ns,
            "-l",
            &format!("app.kubernetes.io/instance={set}"),
            "-o",
            "json",
        ],
    );
    list["items"].as_array().unwrap().clone()
}

fn condition(cp: &ControlPlane, ns: &str, set: &str, type_: &str) -> (String, String) {
    let s = json(cp, &["get", "shardset", set, "-n", ns, "-o", "json"]);
    let c = s["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or_default();
    (
        c["status"].as_str().unwrap_or("").to_string(),
        c["reason"].as_str().unwrap_or("").to_string(),
    )
}

/// When the set's condition `type_` last changed (RFC 3339).
fn condition_since(cp: &ControlPlane, ns: &str, set: &str, type_: &str) -> String {
    let s = json(cp, &["get", "shardset", set, "-n", ns, "-o", "json"]);
    s["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned())
        .and_then(|c| c["lastTransitionTime"].as_str().map(str::to_string))
        .unwrap_or_default()
}

#[test]
fn shardset_becomes_deployments_with_honest_status() {
    let cp = cluster();
    let ns = cp.namespace("ctl");
    let redis = support::redis::shared();
    let pid = controller(cp, &ns);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("hooks", 4, &redis.url, "lanekeeper:v1", ""),
    );

    wait_until("4 shard Deployments", Duration::from_secs(60), || {
        deployments(cp, &ns, "hooks").len() == 4
    });
    let ds = deployments(cp, &ns, "hooks");
    let mut names: Vec<&str> = ds
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "hooks-shard-00",
            "hooks-shard-01",
            "hooks-shard-02",
            "hooks-shard-03"
        ]
    );
    let d = ds
        .iter()
        .find(|d| d["metadata"]["name"] == "hooks-shard-02")
        .unwrap();
    assert_eq!(
        d["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "lanekeeper-controller"
    );
    assert_eq!(
        d["metadata"]["labels"]["app.kubernetes.io/component"],
        "shard"
    );
    assert_eq!(d["metadata"]["ownerReferences"][0]["kind"], "ShardSet");
    assert_eq!(d["metadata"]["ownerReferences"][0]["controller"], true);
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"][0], "worker");
    let env = c["env"].as_array().unwrap();
    assert!(env
        .iter()
        .any(|e| e["name"] == "LANEKEEPER_QUEUE" && e["value"] == "shard-02"));
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        d["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );

    // Ready once every Deployment is available (pods run on the kwok node).
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=120s",
        "shardset/hooks",
    ]);
    let s = json(cp, &["get", "shardset", "hooks", "-n", &ns, "-o", "json"]);
    assert_eq!(
        s["status"]["observedGeneration"],
        s["metadata"]["generation"]
    );
    assert_eq!(s["status"]["readySummary"], "4/4");
    let row = cp.kubectl_ok(&["get", "shs", "hooks", "-n", &ns, "--no-headers"]);
    assert!(
        row.split_whitespace().collect::<Vec<_>>()[..4] == ["hooks", "4", "4/4", "0/8"],
        "{row}"
    );

    // The routing table is in Redis.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let table = rt.block_on(async {
        let store = lanekeeper::store::Store::connect(
            &redis.url,
            lanekeeper::store::SetId::new(&ns, "hooks"),
            Default::default(),
        )
        .await
        .unwrap();
        store.routing().await.unwrap()
    });
    assert_eq!(table.shards, 4);

    // A new image rolls every Deployment; Progressing shows, then clears.
    // (Polling can miss a short True on a busy machine: a False that changed
    // since the patch was True in between.)
    let progressing_since = condition_since(cp, &ns, "hooks", "Progressing");
    cp.kubectl_ok(&[
        "patch",
        "shardset",
        "hooks",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"worker":{"image":"lanekeeper:v2"}}}"#,
    ]);
    let mut saw_progressing = false;
    wait_until("the rollout to finish", Duration::from_secs(120), || {
        let (p, _) = condition(cp, &ns, "hooks", "Progressing");
        saw_progressing |=
            p == "True" || condition_since(cp, &ns, "hooks", "Progressing") != progressing_since;
        let images_done = deployments(cp, &ns, "hooks")
            .iter()
            .all(|d| d["spec"]["template"]["spec"]["containers"][0]["image"] == "lanekeeper:v2");
        images_done
            && saw_progressing
            && condition(cp, &ns, "hooks", "Ready").0 == "True"
            && p == "False"
    });

    // A hand-scaled Deployment is set back.
    cp.kubectl_ok(&[
        "scale",
        "deployment",
        "hooks-shard-01",
        "-n",
        &ns,
        "--replicas=3",
    ]);
    wait_until(
        "replicas reconciled back to 1",
        Duration::from_secs(60),
        || {
            json(
                cp,
                &[
                    "get",
                    "deployment",
                    "hooks-shard-01",
                    "-n",
                    &ns,
                    "-o",
                    "json",
                ],
            )["spec"]["replicas"]
                == 1
        },
    );

    // Shrinking the spec prunes the extra Deployments.
    cp.kubectl_ok(&[
        "patch",
        "shardset",
        "hooks",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"shards":2}}"#,
    ]);
    wait_until("pruned to 2 Deployments", Duration::from_secs(60), || {
        deployments(cp, &ns, "hooks").len() == 2
    });

    // Deleting the set garbage-collects its Deployments.
    cp.kubectl_ok(&["delete", "shardset", "hooks", "-n", &ns]);
    wait_until(
        "Deployments garbage-collected",
        Duration::from_secs(60),
        || deployments(cp, &ns, "hooks").is_empty(),
    );
    support::process::signal(pid, libc::SIGTERM);
    assert_eq!(
        support::process::wait_exit(pid, Duration::from_secs(20)),
        Some(Some(0)),
        "controller did not exit 0 on SIGTERM"
    );
}

#[test]
fn autoscaled_replicas_are_left_to_the_autoscaler() {
    let cp = cluster();
    let ns = cp.namespace("auto");
    let redis = support::redis::shared();
    let pid = controller(cp, &ns);
    let yaml = shardset("auto", 1, &redis.url, "lanekeeper:v1", ", autoscaled: true")
        .replace("replicas: 1, ", "");
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &yaml);
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=120s",
        "shardset/auto",
    ]);
    cp.kubectl_ok(&[
        "scale",
        "deployment",
        "auto-shard-00",
        "-n",
        &ns,
        "--replicas=3",
    ]);
    // Give the controller several chances to fight it; it must not.
    cp.kubectl_ok(&["annotate", "shardset", "auto", "-n", &ns, "poke=1"]);
    std::thread::sleep(Duration::from_secs(5));
    let d = json(
        cp,
        &[
            "get",
            "deployment",
            "auto-shard-00",
            "-n",
            &ns,
            "-o",
            "json",
        ],
    );
    assert_eq!(d["spec"]["replicas"], 3);
    support::process::signal(pid, libc::SIGKILL);
}

#[test]
fn redis_outage_is_degraded_then_clears() {
    let cp = cluster();
    let ns = cp.namespace("outage");
    let redis = support::redis::dedicated();
    let pid = controller(cp, &ns);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("flaky", 2, &redis.url, "lanekeeper:v1", ""),
    );
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=120s",
        "shardset/flaky",
    ]);
    support::redis::kill(&redis);
    wait_until(
        "Degraded=True RedisUnavailable",
        Duration::from_secs(90),
        || condition(cp, &ns, "flaky", "Degraded") == ("True".into(), "RedisUnavailable".into()),
    );
    assert!(
        support::process::is_running(pid),
        "the controller crashed while Redis was down"
    );
    let _again = support::redis::start_on(redis.port);
    wait_until("Degraded clears", Duration::from_secs(90), || {
        condition(cp, &ns, "flaky", "Degraded").0 == "False"
            && condition(cp, &ns, "flaky", "Ready").0 == "True"
    });
    let events = cp.kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(
        events.contains("RedisUnavailable"),
        "no Event for the outage"
    );
    support::process::signal(pid, libc::SIGKILL);
}

#[test]
fn a_killed_controller_converges_without_duplicates() {
    let cp = cluster();
    let ns = cp.namespace("crash");
    let redis = support::redis::shared();
    let pid = controller(cp, &ns);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("big", 16, &redis.url, "lanekeeper:v1", ""),
    );
    wait_until("the first Deployments", Duration::from_secs(60), || {
        !deployments(cp, &ns, "big").is_empty()
    });
    support::process::signal(pid, libc::SIGKILL);
    let pid = controller(cp, &ns);
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=180s",
        "shardset/big",
    ]);
    assert_eq!(deployments(cp, &ns, "big").len(), 16);
    support::process::signal(pid, libc::SIGKILL);
}

#[test]
fn only_the_leader_reconciles_and_a_follower_takes_over() {
    let cp = cluster();
    let ns = cp.namespace("leader");
    let redis = support::redis::shared();
    let first = cp.spawn_controller(&ns, &["--lease-duration", "4s", "--identity", "first"]);
    wait_until("the first replica to lead", Duration::from_secs(30), || {
        cp.kubectl()
            .args([
                "get",
                "lease",
                "lanekeeper-controller",
                "-n",
                &ns,
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .output()
            .is_ok_and(|o| o.stdout == b"first")
    });
    let second = cp.spawn_controller(&ns, &["--lease-duration", "4s", "--identity", "second"]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("led", 1, &redis.url, "lanekeeper:v1", ""),
    );
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=120s",
        "shardset/led",
    ]);
    let holder = cp.kubectl_ok(&[
        "get",
        "lease",
        "lanekeeper-controller",
        "-n",
        &ns,
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    assert_eq!(
        holder, "first",
        "the follower must not take the Lease while the leader renews it"
    );

    // The leader dies without releasing; the follower takes over and reconciles.
    support::process::signal(first, libc::SIGKILL);
    wait_until(
        "the second replica to lead",
        Duration::from_secs(60),
        || {
            cp.kubectl()
                .args([
                    "get",
                    "lease",
                    "lanekeeper-controller",
                    "-n",
                    &ns,
                    "-o",
                    "jsonpath={.spec.holderIdentity}",
                ])
                .output()
                .is_ok_and(|o| o.stdout == b"second")
        },
    );
    cp.kubectl_ok(&[
        "patch",
        "shardset",
        "led",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"shards":2}}"#,
    ]);
    wait_until(
        "the new leader to reconcile",
        Duration::from_secs(60),
        || deployments(cp, &ns, "led").len() == 2,
    );
    support::process::signal(second, libc::SIGTERM);
    assert_eq!(
        support::process::wait_exit(second, Duration::from_secs(20)),
        Some(Some(0))
    );
}

/// A ShardSet whose Redis is a Redis Cluster (`redis+cluster://` seed list):
/// the controller connects through the cluster client, writes the routing
/// table and the queues' policy into the cluster, reports Ready, and hands
/// the URL to its workers.
#[test]
fn shardset_on_a_redis_cluster_is_synced_and_ready() {
    let cp = cluster();
    let ns = cp.namespace("rcluster");
    let redis = support::redis::TestCluster::start();
    let pid = controller(cp, &ns);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &shardset("rc", 3, &redis.url, "lanekeeper:v1", ""),
    );
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Ready",
        "--timeout=120s",
        "shardset/rc",
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = rt
        .block_on(lanekeeper::store::Store::connect(
            &redis.url,
            lanekeeper::store::SetId::new(&ns, "rc"),
            Default::default(),
        ))
        .unwrap();
    assert_eq!(rt.block_on(store.routing()).unwrap().shards, 3);
    // The queue policy went to the primaries owning the queues' slots.
    for n in 0..3u16 {
        let conf = lanekeeper::store::keys::conf(
            &store.queue_prefix(lanekeeper::routing::QueueId::Shard(n)),
        );
        let slot = redis.keyslot(&conf);
        let owner = redis.primary_of(slot);
        // the packed field the scripts read (see common.lua)
        let policy = redis.cli(owner.port, &["HGET", &conf, "policy"]);
        assert!(
            policy.contains("quantum=") && policy.contains("cap="),
            "{conf} on {}: {policy:?}",
            owner.port
        );
    }
    let ds = deployments(cp, &ns, "rc");
    assert_eq!(ds.len(), 3);
    let env = ds[0]["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        env.iter()
            .any(|e| e["name"] == "LANEKEEPER_REDIS_URL" && e["value"] == redis.url.as_str()),
        "{env:?}"
    );
    support::process::signal(pid, libc::SIGKILL);
}

/// Issue 19: a Recorder per Event made kube-runtime's aggregation of repeats
/// impossible (DrainTimeout and LaneCapReached piled up as new Events). The
/// controller's one recorder turns repeats into one Event with a series.
#[tokio::test]
async fn repeated_events_aggregate_into_one_series_on_the_api_server() {
    use kube::api::{Api, ListParams, PostParams};
    use kube::runtime::events::EventType;
    use kube::Resource;
    let cp = cluster();
    let ns = cp.namespace("events");
    let client = cp.client().await;
    let sets: Api<lanekeeper::crd::ShardSet> = Api::namespaced(client.clone(), &ns);
    let set: lanekeeper::crd::ShardSet = serde_yaml::from_str(&shardset(
        "noisy",
        1,
        "redis://127.0.0.1:1/0",
        "lanekeeper:v1",
        "",
    ))
    .unwrap();
    let set = sets.create(&PostParams::default(), &set).await.unwrap();
    let ctx = lanekeeper::controller::Context::new(client.clone(), Default::default());
    let reference = set.object_ref(&());
    for _ in 0..3 {
        ctx.event(
            &reference,
            EventType::Warning,
            "DrainTimeout",
            "Relocate",
            "the same note each time".into(),
        )
        .await;
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, &ns);
    let list = events
        .list(&ListParams::default().fields("regarding.name=noisy"))
        .await
        .unwrap();
    assert_eq!(
        list.items.len(),
        1,
        "three identical Events should be one Event with a series: {:?}",
        list.items
            .iter()
            .map(|e| e.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    let series = list.items[0].series.as_ref().expect("a series");
    assert_eq!(series.count, 3, "{series:?}");
    // A different note is a new Event, not the old one's count with its
    // old note (kube-runtime's series key leaves the note out).
    ctx.event(
        &reference,
        EventType::Warning,
        "DrainTimeout",
        "Relocate",
        "another note".into(),
    )
    .await;
    let list = events
        .list(&ListParams::default().fields("regarding.name=noisy"))
        .await
        .unwrap();
    let mut notes: Vec<String> = list.items.iter().filter_map(|e| e.note.clone()).collect();
    notes.sort();
    assert_eq!(notes, ["another note", "the same note each time"]);
}
