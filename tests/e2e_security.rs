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
    use std::io::Write;
    let mut child = cp
        .kubectl_as(who)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl");
    let mut stdin = child.stdin.take().expect("kubectl stdin");
    if let Some(input) = input {
        stdin
            .write_all(input.as_bytes())
            .expect("write kubectl stdin");
    }
    drop(stdin);
    child.wait_with_output().expect("wait for kubectl")
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
