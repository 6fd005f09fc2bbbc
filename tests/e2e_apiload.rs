//! What the controller costs the API server when nothing happens (issue 25,
//! items 14 and 15), counted by the API server itself
//! (`apiserver_request_total`). These tests have a control plane of their own
//! (this binary's) and take turns, so the counts are theirs alone.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::controlplane::{self, ControlPlane};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Requests so far per "VERB resource[/subresource]" of one API group,
/// watches left out.
fn requests(cp: &ControlPlane, group: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for c in cp.request_counts() {
        if c.group == group && c.verb != "WATCH" {
            *out.entry(c.key()).or_default() += c.count;
        }
    }
    out
}

/// Per key, what was added from `before` to `after`.
fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect()
}

fn jsonpath(cp: &ControlPlane, ns: &str, object: &str, path: &str) -> String {
    cp.kubectl_ok(&["get", object, "-n", ns, "-o", &format!("jsonpath={path}")])
}

#[test]
fn an_idle_set_applies_no_deployment_and_writes_no_status() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cp = cluster();
    let ns = cp.namespace("idle");
    let redis = support::redis::shared();
    let (pid, _log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: idle}}\nspec:\n  shards: 4\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:test\", replicas: 1}}\n  promotion: {{enabled: false}}\n",
            redis.url
        ),
    );
    wait_until("the set to be Ready", Duration::from_secs(120), || {
        jsonpath(
            cp,
            &ns,
            "shardset/idle",
            "{.status.conditions[?(@.type==\"Ready\")].status}",
        ) == "True"
    });
    // Past the first resync after Ready, then two more resync periods (15 s).
    std::thread::sleep(Duration::from_secs(16));
    let (apps0, ours0) = (requests(cp, "apps"), requests(cp, "lanekeeper.io"));
    std::thread::sleep(Duration::from_secs(35));
    let (apps1, ours1) = (requests(cp, "apps"), requests(cp, "lanekeeper.io"));
    let apps = delta(&apps0, &apps1);
    let ours = delta(&ours0, &ours1);
    eprintln!("idle 4-shard set, 35 s: apps {apps:?}; lanekeeper.io {ours:?}");
    let writes = |d: &BTreeMap<String, f64>, resource: &str| -> f64 {
        d.iter()
            .filter(|(k, _)| {
                let (verb, res) = k.split_once(' ').unwrap_or_default();
                res == resource && matches!(verb, "APPLY" | "PATCH" | "UPDATE" | "CREATE")
            })
            .map(|(_, v)| v)
            .sum()
    };
    assert_eq!(
        writes(&apps, "deployments"),
        0.0,
        "an idle set's Deployments were written again: {apps:?}"
    );
    assert_eq!(
        writes(&ours, "shardsets/status"),
        0.0,
        "an idle set's status was written again: {ours:?}"
    );
    support::process::signal(pid, libc::SIGKILL);
}

#[test]
fn a_lane_waiting_for_the_cap_does_not_poll_and_takes_a_freed_slot_at_once() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cp = cluster();
    let ns = cp.namespace("capwait");
    let redis = support::redis::shared();
    let (pid, _log) = cp.spawn_controller_with_rbac(&ns, &[], &[]);
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: capped}}\nspec:\n  shards: 1\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:test\", replicas: 1}}\n  promotion: {{enabled: false, maxLanes: 1}}\n",
            redis.url
        ),
    );
    let lane = |name: &str, tenant: &str| {
        format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {{name: {name}}}\nspec: {{shardSet: capped, tenant: {tenant}}}\n"
        )
    };
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &lane("first", "whale-a"));
    wait_until("the first lane Active", Duration::from_secs(120), || {
        jsonpath(cp, &ns, "dedicatedlane/first", "{.status.phase}") == "Active"
    });
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &lane("second", "whale-b"));
    wait_until(
        "the second lane refused for the cap",
        Duration::from_secs(60),
        || {
            jsonpath(
                cp,
                &ns,
                "dedicatedlane/second",
                "{.status.conditions[?(@.type==\"Admitted\")].reason}",
            ) == "LaneCapReached"
        },
    );
    let before = requests(cp, "lanekeeper.io");
    std::thread::sleep(Duration::from_secs(30));
    let d = delta(&before, &requests(cp, "lanekeeper.io"));
    let total: f64 = d.values().sum();
    eprintln!("one Active lane, one waiting for the cap, 30 s: {total} requests {d:?}");
    // Polling every 2 s cost about 2.5 requests/s (75 in 30 s) for the
    // waiting lane alone; the set's and the Active lane's resyncs are a
    // handful.
    assert!(
        total <= 25.0,
        "{total} requests on lanekeeper.io resources in 30 s while idle: {d:?}"
    );

    // Free the slot: the waiting lane is woken by the watch, not a poll.
    cp.kubectl_ok(&[
        "patch",
        "dedicatedlane",
        "first",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        "{\"spec\":{\"retire\":true}}",
    ]);
    wait_until("the first lane Retired", Duration::from_secs(120), || {
        jsonpath(cp, &ns, "dedicatedlane/first", "{.status.phase}") == "Retired"
    });
    let freed = Instant::now();
    wait_until("the second lane admitted", Duration::from_secs(60), || {
        jsonpath(cp, &ns, "dedicatedlane/second", "{.status.laneIndex}") == "0"
    });
    let took = freed.elapsed();
    eprintln!(
        "slot freed -> second lane admitted in {:.1} s",
        took.as_secs_f64()
    );
    // It had waited over 30 s, so its own retry was at least that far off.
    assert!(
        took < Duration::from_secs(10),
        "the waiting lane took {took:?} to take the freed slot"
    );
    support::process::signal(pid, libc::SIGKILL);
}
