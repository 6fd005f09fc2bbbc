//! Lifecycle and status on the real control plane (issue 25, items 6-13):
//! deleting a set retires its lanes first, `--cascade=orphan` keeps the
//! Deployments, pruning spares what the set does not own, demotion retires
//! the lane that serves, a lowered `maxLanes` retires the lanes beyond it,
//! and status says Degraded or not Ready when the Deployment API refuses,
//! pods cannot be created, or nobody serves a queue. The controller runs
//! under the chart's ServiceAccount and `config/rbac` rights; real Redis.

mod support;

use std::time::{Duration, Instant};

use lanekeeper::routing::{hash_shard, QueueId, RoutingTable};
use lanekeeper::store::{SetId, Store, TenantQueueState};
use support::controlplane::{self, ControlPlane};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

/// A namespace with the RBAC-bound controller in it; stopped on drop.
struct Env {
    cp: &'static ControlPlane,
    ns: String,
    pid: u32,
    log: std::path::PathBuf,
    redis_url: String,
}

impl Env {
    fn start(prefix: &str, extra: &[&str]) -> Env {
        let cp = cluster();
        let ns = cp.namespace(prefix);
        let (pid, log) = cp.spawn_controller_with_rbac(&ns, extra, &[]);
        Env {
            cp,
            ns,
            pid,
            log,
            redis_url: support::redis::shared().url.clone(),
        }
    }

    fn apply(&self, manifest: &str) {
        self.cp
            .kubectl_stdin(&["apply", "-n", &self.ns, "-f", "-"], manifest);
    }

    /// ShardSet `hooks`: `worker` and `spec` are YAML appended to the
    /// worker template's flow mapping and to the spec.
    fn set_yaml(&self, shards: u32, worker: &str, spec: &str) -> String {
        format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: hooks}}\nspec:\n  shards: {shards}\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:v1\", concurrency: 4{worker}}}\n{spec}",
            self.redis_url
        )
    }

    fn lane(&self, name: &str, tenant: &str) {
        self.apply(&format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {{name: {name}}}\nspec: {{shardSet: hooks, tenant: {tenant}}}\n"
        ));
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-n", &self.ns, "-o", "json"]);
        serde_json::from_str(&self.cp.kubectl_ok(&all)).unwrap()
    }

    /// The object, or None when it does not exist.
    fn get(&self, kind: &str, name: &str) -> Option<serde_json::Value> {
        let out = self
            .cp
            .kubectl()
            .args(["get", kind, name, "-n", &self.ns, "-o", "json"])
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).unwrap())
    }

    /// (status, reason, message) of a condition of `kind/name`.
    fn condition(&self, kind: &str, name: &str, type_: &str) -> (String, String, String) {
        let c = self
            .get(kind, name)
            .and_then(|o| {
                o["status"]["conditions"]
                    .as_array()
                    .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned())
            })
            .unwrap_or_default();
        let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
        (s("status"), s("reason"), s("message"))
    }

    fn set_condition(&self, type_: &str) -> (String, String, String) {
        self.condition("shardset", "hooks", type_)
    }

    fn phase(&self, lane: &str) -> String {
        self.get("dedicatedlane", lane)
            .and_then(|l| l["status"]["phase"].as_str().map(str::to_string))
            .unwrap_or_default()
    }

    fn wait(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !f() {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; controller log:\n{}",
                support::process::tail(&self.log, 30)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn wait_ready(&self) {
        self.wait("the set to be Ready", Duration::from_secs(120), || {
            self.set_condition("Ready").0 == "True"
        });
    }

    fn routing(&self) -> RoutingTable {
        let (url, ns) = (self.redis_url.clone(), self.ns.clone());
        block(async move { store(&url, &ns).await.routing().await.unwrap() })
    }

    fn tenant_state(&self, q: QueueId, tenant: &str) -> TenantQueueState {
        let (url, ns, tenant) = (self.redis_url.clone(), self.ns.clone(), tenant.to_string());
        block(async move {
            store(&url, &ns)
                .await
                .tenant_state(q, &tenant)
                .await
                .unwrap()
        })
    }

    fn events_with_reason(&self, reason: &str) -> Vec<serde_json::Value> {
        self.json(&["get", "events.events.k8s.io"])["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["reason"] == reason)
            .cloned()
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        support::process::signal(self.pid, libc::SIGTERM);
    }
}

async fn store(url: &str, ns: &str) -> Store {
    Store::connect(url, SetId::new(ns, "hooks"), Default::default())
        .await
        .unwrap()
}

fn block<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Item 6: a set deleted with `cascade` retires its lanes first; created
/// again, it serves the tenant on its hash shard, with no reshard.
fn delete_and_recreate(cascade: &str) {
    let env = Env::start("life-del", &[]);
    let set = env.set_yaml(2, ", replicas: 1", "");
    env.apply(&set);
    env.wait_ready();
    env.lane("whale", "whale");
    env.wait(
        "the whale's lane to be Active",
        Duration::from_secs(120),
        || env.phase("whale") == "Active",
    );
    assert_eq!(
        env.routing().pins.get("whale"),
        Some(&QueueId::Lane(0)),
        "the Active lane pins its tenant"
    );
    env.cp.kubectl_ok(&[
        "delete",
        "shardset",
        "hooks",
        "-n",
        &env.ns,
        &format!("--cascade={cascade}"),
        "--wait=false",
    ]);
    env.wait("the set to be gone", Duration::from_secs(120), || {
        env.get("shardset", "hooks").is_none()
    });
    env.wait("the lane to be gone", Duration::from_secs(60), || {
        env.get("dedicatedlane", "whale").is_none()
    });
    let home = hash_shard("whale", 2);
    let table = env.routing();
    assert_eq!(
        table.pins.get("whale"),
        None,
        "the deleted set's lane still pins its tenant: {:?}",
        table.pins
    );
    assert_eq!(table.route("whale"), home);
    let at_home = env.tenant_state(home, "whale");
    assert!(
        !at_home.paused && at_home.moved_to.is_none(),
        "the tenant is paused or marked moved on its hash shard: {at_home:?}"
    );

    // The same set again: Ready, the tenant on its shard, nothing resharding.
    env.apply(&set);
    env.wait_ready();
    assert_eq!(env.routing().route("whale"), home);
    let s = env.get("shardset", "hooks").unwrap();
    assert!(
        s["status"]["resharding"].is_null(),
        "a phantom reshard: {}",
        s["status"]
    );
    assert_eq!(env.set_condition("Resharding").0, "False");
    assert_eq!(s["status"]["laneSummary"], "0/8");
}

#[test]
fn deleting_a_set_retires_its_lanes_first() {
    delete_and_recreate("background");
}

#[test]
fn deleting_a_set_in_the_foreground_retires_its_lanes_first() {
    delete_and_recreate("foreground");
}

/// Item 7: `--cascade=orphan` keeps the Deployments, owned by nobody.
#[test]
fn orphaning_deletion_keeps_the_deployments() {
    let env = Env::start("life-orphan", &[]);
    env.apply(&env.set_yaml(2, ", replicas: 1", ""));
    env.wait_ready();
    env.cp.kubectl_ok(&[
        "delete",
        "shardset",
        "hooks",
        "-n",
        &env.ns,
        "--cascade=orphan",
        "--wait=false",
    ]);
    env.wait("the set to be gone", Duration::from_secs(60), || {
        env.get("shardset", "hooks").is_none()
    });
    // Time for the garbage collector to delete what still had an owner.
    std::thread::sleep(Duration::from_secs(10));
    for name in ["hooks-shard-00", "hooks-shard-01"] {
        let d = env
            .get("deployment", name)
            .unwrap_or_else(|| panic!("{name} was deleted despite --cascade=orphan"));
        assert!(
            d["metadata"]["ownerReferences"].is_null()
                || d["metadata"]["ownerReferences"] == serde_json::json!([]),
            "an orphaned Deployment is owned again: {}",
            d["metadata"]["ownerReferences"]
        );
    }
}

/// Item 8: a Deployment with the set's labels that the set does not own
/// is not pruned.
#[test]
fn pruning_spares_deployments_the_set_does_not_own() {
    let env = Env::start("life-prune", &[]);
    env.apply(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: billing-api\n  labels:\n    app.kubernetes.io/name: lanekeeper\n    app.kubernetes.io/instance: hooks\n    app.kubernetes.io/component: shard\n    app.kubernetes.io/managed-by: lanekeeper-controller\n\
         spec:\n  replicas: 1\n  selector: {matchLabels: {app: billing-api}}\n  template:\n    metadata: {labels: {app: billing-api}}\n    spec: {containers: [{name: api, image: billing:v1}]}\n",
    );
    env.apply(&env.set_yaml(2, ", replicas: 1", ""));
    env.wait_ready();
    // Several reconciles (the set's own Deployments change as they roll out).
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        env.get("deployment", "billing-api").is_some(),
        "the controller pruned a Deployment it does not own"
    );
}

/// Item 9: with a duplicate lane for the tenant (sorting first, waiting as
/// DuplicateTenant), demotion retires the lane that serves the tenant.
#[test]
fn demotion_retires_the_serving_lane_not_its_duplicate() {
    let env = Env::start("life-demote", &["--promotion-tick", "1s"]);
    env.apply(&env.set_yaml(
        1,
        ", replicas: 1",
        "  promotion: {enabled: true, promoteAfter: 1h, demoteAfter: 3s, window: 10s}\n",
    ));
    env.wait_ready();
    env.lane("b-whale", "whale");
    env.wait("b-whale to be admitted", Duration::from_secs(60), || {
        env.condition("dedicatedlane", "b-whale", "Admitted").0 == "True"
    });
    env.lane("a-whale", "whale");
    env.wait(
        "a-whale to wait as a duplicate",
        Duration::from_secs(60),
        || env.condition("dedicatedlane", "a-whale", "Admitted").1 == "DuplicateTenant",
    );
    // The whale is idle on its lane: cold, so demoted after demoteAfter.
    env.wait(
        "the serving lane b-whale to be demoted (Retired)",
        Duration::from_secs(90),
        || env.phase("b-whale") == "Retired",
    );
    assert_eq!(
        env.get("dedicatedlane", "b-whale").unwrap()["spec"]["retire"],
        true
    );
}

/// Item 10: lowering maxLanes below the admitted lanes retires those with
/// an index at or above the new cap; they wait under it; status says so.
#[test]
fn lowering_max_lanes_retires_the_lanes_beyond_it() {
    let env = Env::start("life-cap", &[]);
    env.apply(&env.set_yaml(1, ", replicas: 1", "  promotion: {maxLanes: 3}\n"));
    env.wait_ready();
    for t in ["t0", "t1", "t2"] {
        env.lane(t, t);
        env.wait(&format!("{t} Active"), Duration::from_secs(90), || {
            env.phase(t) == "Active"
        });
    }
    env.cp.kubectl_ok(&[
        "patch",
        "shardset",
        "hooks",
        "-n",
        &env.ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"promotion":{"maxLanes":1}}}"#,
    ]);
    env.wait(
        "t1 and t2 retired and waiting for the cap",
        Duration::from_secs(120),
        || {
            ["t1", "t2"].iter().all(|t| {
                env.condition("dedicatedlane", t, "Admitted").1 == "LaneCapReached"
                    && env.get("dedicatedlane", t).unwrap()["status"]["laneIndex"].is_null()
            })
        },
    );
    assert_eq!(env.phase("t0"), "Active");
    let pins = env.routing().pins;
    assert_eq!(pins.get("t0"), Some(&QueueId::Lane(0)));
    assert_eq!(pins.get("t1"), None, "{pins:?}");
    assert_eq!(pins.get("t2"), None, "{pins:?}");
    env.wait("the set to show 1/1", Duration::from_secs(60), || {
        env.get("shardset", "hooks").unwrap()["status"]["laneSummary"] == "1/1"
            && env.set_condition("LaneCapReached").0 == "True"
    });
}

/// Item 11: a spec the Deployment API refuses is Degraded=True with the
/// API's message and an Event, for a Ready set and for a new one.
#[test]
fn a_deployment_the_api_refuses_is_degraded_with_an_event() {
    let env = Env::start("life-reject", &[]);
    env.apply(&env.set_yaml(1, ", replicas: 1", ""));
    env.wait_ready();
    env.apply(&env.set_yaml(1, ", replicas: 1, nodeSelector: {\"bad key!\": x}", ""));
    env.wait(
        "Degraded=True DeploymentFailed",
        Duration::from_secs(60),
        || env.set_condition("Degraded").1 == "DeploymentFailed",
    );
    let (status, _, message) = env.set_condition("Degraded");
    assert_eq!(status, "True");
    assert!(message.contains("nodeSelector"), "{message}");
    assert_eq!(env.set_condition("Ready").0, "False");
    let s = env.get("shardset", "hooks").unwrap();
    assert_eq!(
        s["status"]["observedGeneration"], s["metadata"]["generation"],
        "status is stale"
    );
    env.wait("a DeploymentFailed Event", Duration::from_secs(30), || {
        !env.events_with_reason("DeploymentFailed").is_empty()
    });
}

/// Item 12: zero replicas on every shard is not Ready.
#[test]
fn zero_replicas_is_not_ready() {
    let env = Env::start("life-zero", &[]);
    env.apply(&env.set_yaml(2, ", replicas: 0", ""));
    env.wait("a status", Duration::from_secs(60), || {
        !env.set_condition("Ready").0.is_empty()
    });
    // Give the Deployments time to report (0 of 0 available).
    std::thread::sleep(Duration::from_secs(5));
    let (status, reason, message) = env.set_condition("Ready");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NoWorkers"),
        "{message}"
    );
}

/// Item 12: a lane whose worker template has zero replicas does not take
/// its tenant (and does not go Active).
#[test]
fn a_lane_without_workers_does_not_take_its_tenant() {
    let env = Env::start("life-zlane", &[]);
    env.apply(&env.set_yaml(
        1,
        ", replicas: 1",
        "  promotion: {laneWorker: {replicas: 0}}\n",
    ));
    env.wait_ready();
    env.lane("whale", "whale");
    env.wait(
        "the lane to refuse for want of workers",
        Duration::from_secs(60),
        || {
            let phase = env.phase("whale");
            assert_ne!(phase, "Active", "a lane with 0 replicas went Active");
            env.condition("dedicatedlane", "whale", "Admitted").1 == "NoWorkers"
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_ne!(env.phase("whale"), "Active");
    assert_eq!(env.routing().pins.get("whale"), None);
}

/// Item 13: pods that cannot be created (a quota of zero pods: the
/// ReplicaSet's FailedCreate) make the set Degraded, without waiting for
/// the progress deadline.
#[test]
fn pods_that_cannot_be_created_are_degraded() {
    let env = Env::start("life-quota", &[]);
    env.apply("apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: no-pods}\nspec: {hard: {pods: \"0\"}}\n");
    env.wait("the quota to be counted", Duration::from_secs(60), || {
        env.get("resourcequota", "no-pods")
            .is_some_and(|q| !q["status"]["hard"].is_null())
    });
    env.apply(&env.set_yaml(1, ", replicas: 1", ""));
    env.wait(
        "Degraded=True DeploymentFailed",
        Duration::from_secs(90),
        || env.set_condition("Degraded").1 == "DeploymentFailed",
    );
    let (status, _, message) = env.set_condition("Degraded");
    assert_eq!(status, "True");
    assert!(
        message.contains("quota") || message.contains("forbidden"),
        "{message}"
    );
}

/// Issue 19: a DedicatedLane this version cannot decode does not stall the
/// ShardSets of its namespace. The lane's status holds what the schema allows
/// and Rust cannot (a lane index past `i32`); the set's reconcile lists the
/// namespace's lanes, skips that one with a log line, and the set becomes
/// Ready. Before the lists were guarded, every reconcile of every set in the
/// namespace failed to decode the list, and no status was ever written; the
/// lane reconciler's admission and the promotion loop list the lanes too.
#[test]
fn a_lane_that_cannot_be_decoded_does_not_stall_its_set() {
    let env = Env::start("life-undecodable", &[]);
    env.lane("hooks-bad", "bad");
    env.wait(
        "the lane controller to see the lane",
        Duration::from_secs(60),
        || !env.phase("hooks-bad").is_empty(),
    );
    env.cp.kubectl_ok(&[
        "patch",
        "dedicatedlane",
        "hooks-bad",
        "-n",
        &env.ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"laneIndex":5000000000}}"#,
    ]);
    let stored = env.get("dedicatedlane", "hooks-bad").unwrap();
    assert_eq!(stored["status"]["laneIndex"], 5_000_000_000i64, "{stored}");
    env.apply(&env.set_yaml(1, "", ""));
    env.wait_ready();
    // Nor does it stop another lane's admission (the lanes of the set are
    // listed to hand out an index).
    env.lane("hooks-whale", "whale");
    env.wait(
        "the other lane to be admitted",
        Duration::from_secs(60),
        || env.condition("dedicatedlane", "hooks-whale", "Admitted").0 == "True",
    );
    let log = std::fs::read_to_string(&env.log).unwrap_or_default();
    assert!(
        log.contains("cannot be decoded"),
        "the skipped lane is logged: {}",
        support::process::tail(&env.log, 30)
    );
}
