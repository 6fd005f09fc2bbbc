//! End-to-end: the full test control plane schedules pods onto a kwok fake
//! node and Deployments report real availability.

mod support;

use std::time::Duration;

#[test]
fn plain_deployment_becomes_available() {
    let cp = support::controlplane::full();
    let ns = cp.namespace("deploy");
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo}
spec:
  replicas: 2
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      containers:
      - name: echo
        image: registry.invalid/echo:1
"#,
    );
    cp.kubectl_ok(&[
        "wait",
        "-n",
        &ns,
        "--for=condition=Available",
        "--timeout=120s",
        "deployment/echo",
    ]);
    let ready = cp.kubectl_ok(&[
        "get",
        "-n",
        &ns,
        "deployment",
        "echo",
        "-o",
        "jsonpath={.status.availableReplicas}",
    ]);
    assert_eq!(ready, "2");
    let nodes = cp.kubectl_ok(&[
        "get",
        "pods",
        "-n",
        &ns,
        "-o",
        "jsonpath={.items[*].spec.nodeName}",
    ]);
    assert_eq!(
        nodes, "kwok-node-0 kwok-node-0",
        "pods were not scheduled onto the fake node"
    );

    // Garbage collection: deleting the Deployment removes its ReplicaSet and pods.
    cp.kubectl_ok(&["delete", "-n", &ns, "deployment", "echo", "--wait=true"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rs = cp.kubectl_ok(&["get", "replicasets", "-n", &ns, "-o", "name"]);
        if rs.trim().is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ReplicaSets not garbage-collected: {rs}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!("full control plane started in {:.1}s", cp.start_seconds);
}
