//! Packaging for real clusters, checked against real parts: the Helm chart
//! (linted, rendered, installed with the real `helm` into the RBAC-enabled
//! test API server), the kustomize base `config/default` (applied with the
//! real `kubectl`), the controller running under the chart's ServiceAccount
//! token, and the dashboards and alerts, whose every metric name must be one
//! that a running controller and worker really serve on /metrics.
//!
//! Helm is compiled from its Go module by `tests/helm/install.sh` (pinned,
//! cached under ~/.cache/lanekeeper); `LANEKEEPER_HELM` points at another
//! binary. `charts/rendered/lanekeeper.yaml` is the chart rendered with its
//! default values; regenerate it with
//! `LANEKEEPER_BLESS=1 cargo test --test packaging rendered`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_yaml::Value;
use support::controlplane::{self, ControlPlane};
use support::process;
use support::tools::{helm, helm_ok};

const RELEASE: &str = "lk";
/// Names the chart gives the controller's objects for release `lk`.
const SA: &str = "lk-lanekeeper-controller";
const RENDER_NAMESPACE: &str = "lanekeeper-system";
const RENDERED: &str = "charts/rendered/lanekeeper.yaml";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

// ---------------------------------------------------------------- helm

/// The chart rendered as `helm template <release> charts/lanekeeper -n <ns> <set...>`.
fn render(release: &str, ns: &str, set: &[&str]) -> String {
    let mut args = vec!["template", release, "charts/lanekeeper", "--namespace", ns];
    for s in set {
        args.extend(["--set", s]);
    }
    helm_ok(&args)
}

const RENDERED_HEADER: &str = "\
# The Helm chart charts/lanekeeper rendered with its default values:
#   helm template lanekeeper charts/lanekeeper --namespace lanekeeper-system
# (CRDs are in crds/, not here). Generated; do not edit. tests/packaging.rs
# fails when it drifts; regenerate with
#   LANEKEEPER_BLESS=1 cargo test --test packaging rendered
";

/// Every option the chart has, switched on (values that need a namespace get `ns`).
fn all_options(ns: &str) -> Vec<String> {
    [
        "controller.replicaCount=2",
        "controller.podDisruptionBudget.enabled=true",
        "ingest.enabled=true",
        "ingest.podDisruptionBudget.enabled=true",
        "networkPolicy.enabled=true",
        "networkPolicy.apiServer.cidrs[0]=10.96.0.1/32",
        "networkPolicy.redis.to[0].podSelector.matchLabels.app=redis",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.monitoring=enabled",
        "redis.extraSecretNames[0]=redis-eu",
        "controller.tierConfigMapNames[0]=tiers-eu",
        "controller.tierConfigMapNames[1]=tiers-us",
        "redis.tls.caSecretName=redis-ca",
        "redis.tls.clientCertSecretName=redis-client",
        "controller.logFormat=text",
        "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("controller.watchNamespace={ns}"),
        format!("ingest.shardSet={ns}/webhooks"),
    ])
    .collect()
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the render"))
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .map(|x| x.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------- files that must match

fn assert_same_files(dir: &str) {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(repo().join("crds")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        let want = read(&format!("crds/{name}"));
        let have = std::fs::read_to_string(repo().join(dir).join(&name)).unwrap_or_default();
        assert!(
            have == want,
            "{dir}/{name} differs from crds/{name}; copy it: cp crds/*.yaml {dir}/"
        );
        names.push(name);
    }
    let mut present: Vec<String> = std::fs::read_dir(repo().join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    present.sort();
    names.sort();
    assert_eq!(present, names, "{dir} holds CRD files that crds/ does not");
}

#[test]
fn chart_and_kustomize_crds_are_the_repository_crds() {
    assert_same_files("charts/lanekeeper/crds");
    assert_same_files("config/crd");
}

// ---------------------------------------------------------------- chart: lint, render, drift

#[test]
fn helm_lint_passes_with_defaults_and_with_every_option() {
    let t = Instant::now();
    helm_ok(&["lint", "--strict", "charts/lanekeeper"]);
    let mut args: Vec<String> = ["lint", "--strict", "charts/lanekeeper"]
        .map(String::from)
        .to_vec();
    for s in all_options("prod")
        .into_iter()
        .chain(["metrics.serviceMonitor.enabled=true".to_string()])
    {
        args.push("--set".into());
        args.push(s);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    helm_ok(&args);
    // Values the schema or the templates refuse.
    for (bad, why) in [
        ("controller.logFormat=xml", "logFormat"),
        ("controller.leaderElection.enabled=maybe", "leaderElection"),
        ("ingest.enabled=true", "ingest.shardSet"),
    ] {
        let out = helm()
            .args(["template", "x", "charts/lanekeeper", "--set", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(why),
            "--set {bad} should be refused naming {why}: {err}"
        );
    }
    let out = helm()
        .args([
            "template",
            "x",
            "charts/lanekeeper",
            "--set",
            "controller.replicaCount=2",
            "--set-string",
            "controller.leaderElection.enabled=false",
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "two replicas without leader election must be refused"
    );
    eprintln!(
        "helm lint and refusals in {:.1}s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn rendered_chart_matches_the_committed_render() {
    let fresh = format!(
        "{RENDERED_HEADER}{}",
        render("lanekeeper", RENDER_NAMESPACE, &[])
    );
    let path = repo().join(RENDERED);
    if std::env::var_os("LANEKEEPER_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &fresh).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let first = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(fresh.lines().count()));
        panic!(
            "{RENDERED} drifted from the chart (first difference at line {}: committed {:?}, fresh {:?}); \
             regenerate with `LANEKEEPER_BLESS=1 cargo test --test packaging rendered` and commit",
            first + 1,
            committed.lines().nth(first),
            fresh.lines().nth(first)
        );
    }
}

/// What every pod the chart or config/default makes must have.
fn assert_hardened(d: &Value, container: &str) {
    let name = d["metadata"]["name"].as_str().unwrap_or_default();
    let pod = &d["spec"]["template"]["spec"];
    let psc = &pod["securityContext"];
    assert_eq!(psc["runAsNonRoot"], true, "{name}: runAsNonRoot");
    assert_eq!(psc["runAsUser"], 65532, "{name}: fixed UID");
    assert_eq!(
        psc["seccompProfile"]["type"], "RuntimeDefault",
        "{name}: seccomp"
    );
    let c = pod["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == container)
        .unwrap_or_else(|| panic!("{name}: no container {container}"));
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}: read-only root");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
    assert_eq!(strs(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{name}");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{name}");
    assert!(c["resources"]["requests"].is_mapping(), "{name}: requests");
    assert!(c["resources"]["limits"]["memory"].is_string(), "{name}");
}

fn controller_rules(objs: &[Value], kind: &str, name: &str) -> Vec<Value> {
    find(objs, kind, name)["rules"]
        .as_sequence()
        .unwrap()
        .to_vec()
}

/// The controller's rules, exactly: anything more is a review, not a drift.
fn expected_rules(secret_names: &[&str], config_maps: &[&str]) -> Vec<Value> {
    let rule = |groups: &[&str], resources: &[&str], names: &[&str], verbs: &[&str]| {
        let mut m = serde_yaml::Mapping::new();
        m.insert("apiGroups".into(), groups.to_vec().into());
        m.insert("resources".into(), resources.to_vec().into());
        if !names.is_empty() {
            m.insert("resourceNames".into(), names.to_vec().into());
        }
        m.insert("verbs".into(), verbs.to_vec().into());
        Value::Mapping(m)
    };
    let mut rules = vec![
        rule(
            &["lanekeeper.io"],
            &["shardsets", "dedicatedlanes"],
            &[],
            &["get", "list", "watch"],
        ),
        rule(
            &["lanekeeper.io"],
            &["shardsets/status", "dedicatedlanes/status"],
            &[],
            &["patch"],
        ),
        rule(
            &["lanekeeper.io"],
            &["dedicatedlanes"],
            &[],
            &["create", "patch", "delete"],
        ),
        rule(&["lanekeeper.io"], &["shardsets"], &[], &["patch"]),
        rule(
            &["lanekeeper.io"],
            &["shardsets/finalizers", "dedicatedlanes/finalizers"],
            &[],
            &["update"],
        ),
        rule(
            &["apps"],
            &["deployments"],
            &[],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        rule(&["events.k8s.io"], &["events"], &[], &["create", "patch"]),
        rule(&[""], &["secrets"], secret_names, &["get"]),
    ];
    if !config_maps.is_empty() {
        rules.push(rule(&[""], &["configmaps"], config_maps, &["get"]));
    }
    rules
}

#[test]
fn chart_is_least_privilege_hardened_and_elects_a_leader_with_replicas() {
    // Defaults: one replica, no election, Recreate, cluster-wide ClusterRole.
    let objs = docs(&render("lanekeeper", RENDER_NAMESPACE, &[]));
    let d = find(&objs, "Deployment", "lanekeeper-controller");
    assert_hardened(d, "controller");
    let args = strs(&d["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert_eq!(args[0], "controller");
    assert!(
        args.contains(&"--leader-election=false".to_string()),
        "{args:?}"
    );
    assert!(args.contains(&"--log-format=json".to_string()), "{args:?}");
    assert_eq!(d["spec"]["strategy"]["type"], "Recreate");
    assert_eq!(
        controller_rules(&objs, "ClusterRole", "lanekeeper-controller"),
        expected_rules(&["lanekeeper-redis"], &["lanekeeper-tiers"])
    );
    assert!(
        !objs.iter().any(|o| o["kind"] == "Role"),
        "no Lease Role without leader election"
    );
    let env = &d["spec"]["template"]["spec"]["containers"][0]["env"];
    let pod_ns = env
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "POD_NAMESPACE")
        .expect("POD_NAMESPACE env");
    assert_eq!(
        pod_ns["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    let svc = find(&objs, "Service", "lanekeeper-controller-metrics");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
    for kind in [
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "CustomResourceDefinition",
    ] {
        assert!(
            !objs.iter().any(|o| o["kind"] == kind),
            "{kind} is off by default"
        );
    }

    // Every option: Role in the watched namespace, Lease Role, ingest hardened without a token.
    let set = all_options("prod");
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    let objs = docs(&render(RELEASE, "ops", &set));
    let d = find(&objs, "Deployment", "lk-lanekeeper-controller");
    assert_hardened(d, "controller");
    let args = strs(&d["spec"]["template"]["spec"]["containers"][0]["args"]);
    for want in [
        "--leader-election=true",
        "--lease-name=lanekeeper-controller",
        "--namespace=prod",
        "--log-format=text",
    ] {
        assert!(args.contains(&want.to_string()), "{want} in {args:?}");
    }
    assert_eq!(d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    assert!(d["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .contains("@sha256:"));
    let role = find(&objs, "Role", "lk-lanekeeper-controller");
    assert_eq!(role["metadata"]["namespace"], "prod");
    assert_eq!(
        controller_rules(&objs, "Role", "lk-lanekeeper-controller"),
        expected_rules(
            &["lanekeeper-redis", "redis-eu", "redis-ca", "redis-client"],
            &["tiers-eu", "tiers-us"]
        )
    );
    let lease = find(&objs, "Role", "lk-lanekeeper-controller-leader-election");
    assert_eq!(lease["metadata"]["namespace"], "ops");
    assert!(!objs.iter().any(|o| o["kind"] == "ClusterRole"));
    let ingest = find(&objs, "Deployment", "lk-lanekeeper-ingest");
    assert_hardened(ingest, "ingest");
    assert_eq!(
        ingest["spec"]["template"]["spec"]["automountServiceAccountToken"],
        false
    );
    let iargs = strs(&ingest["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert_eq!(
        &iargs[..4],
        [
            "ingest",
            "--redis=$(LANEKEEPER_REDIS_URL)",
            "--shard-set=prod/webhooks",
            "--listen=0.0.0.0:8080"
        ]
    );
    // Ingest gets the Redis CA and client certificate from their Secrets.
    let ipod = &ingest["spec"]["template"]["spec"];
    let ienv = &ipod["containers"][0]["env"];
    let ienv = ienv.as_sequence().unwrap();
    let val = |n: &str| {
        ienv.iter()
            .find(|e| e["name"] == n)
            .map(|e| e["value"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert_eq!(
        val("LANEKEEPER_REDIS_CA_FILE"),
        "/etc/lanekeeper/redis-tls/ca/ca.crt"
    );
    assert_eq!(
        val("LANEKEEPER_REDIS_CLIENT_KEY_FILE"),
        "/etc/lanekeeper/redis-tls/client/tls.key"
    );
    let vols = ipod["volumes"].as_sequence().unwrap();
    assert!(vols.iter().any(|v| v["secret"]["secretName"] == "redis-ca"
        && v["secret"]["items"][0]["key"] == "ca.crt"
        && v["secret"]["items"][0]["path"] == "ca.crt"));
    assert!(vols
        .iter()
        .any(|v| v["secret"]["secretName"] == "redis-client"));
    for (kind, name) in [
        ("NetworkPolicy", "lk-lanekeeper-controller"),
        ("NetworkPolicy", "lk-lanekeeper-ingest"),
        ("PodDisruptionBudget", "lk-lanekeeper-controller"),
        ("PodDisruptionBudget", "lk-lanekeeper-ingest"),
        ("Service", "lk-lanekeeper-ingest"),
        ("ServiceAccount", "lk-lanekeeper-ingest"),
    ] {
        find(&objs, kind, name);
    }

    // The ServiceMonitor selects the metrics Service and keeps the ShardSet's namespace label.
    let objs = docs(&render(
        RELEASE,
        "ops",
        &["metrics.serviceMonitor.enabled=true"],
    ));
    let sm = find(&objs, "ServiceMonitor", "lk-lanekeeper-controller");
    let svc = find(&objs, "Service", "lk-lanekeeper-controller-metrics");
    let want = sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap();
    for (k, v) in want {
        assert_eq!(&svc["metadata"]["labels"][k], v, "Service label {k:?}");
    }
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
}

// ---------------------------------------------------------------- kustomize

fn kustomize(dir: &Path) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The parts of the controller's pod that matter, without labels.
fn pod_essentials(d: &Value) -> Value {
    let pod = &d["spec"]["template"]["spec"];
    let mut c = pod["containers"][0].clone();
    c.as_mapping_mut().unwrap().remove("image");
    serde_yaml::to_value(BTreeMap::from([
        ("serviceAccountName", pod["serviceAccountName"].clone()),
        ("securityContext", pod["securityContext"].clone()),
        ("container", c),
        ("volumes", pod["volumes"].clone()),
        ("strategy", d["spec"]["strategy"].clone()),
        ("replicas", d["spec"]["replicas"].clone()),
    ]))
    .unwrap()
}

#[test]
fn kustomize_base_is_the_chart_with_default_values() {
    let k = docs(&kustomize(&repo().join("config/default")));
    let h = docs(&render("lanekeeper", RENDER_NAMESPACE, &[]));
    assert_eq!(
        controller_rules(&k, "ClusterRole", "lanekeeper-controller"),
        controller_rules(&h, "ClusterRole", "lanekeeper-controller"),
        "config/rbac/role.yaml and the chart's ClusterRole differ"
    );
    let kd = find(&k, "Deployment", "lanekeeper-controller");
    assert_hardened(kd, "controller");
    assert_eq!(
        pod_essentials(kd),
        pod_essentials(find(&h, "Deployment", "lanekeeper-controller")),
        "config/manager/deployment.yaml and the chart's Deployment differ"
    );
    for (kind, name) in [
        ("Namespace", "lanekeeper-system"),
        ("ServiceAccount", "lanekeeper-controller"),
        ("ClusterRoleBinding", "lanekeeper-controller"),
        ("Service", "lanekeeper-controller-metrics"),
        ("CustomResourceDefinition", "shardsets.lanekeeper.io"),
        ("CustomResourceDefinition", "dedicatedlanes.lanekeeper.io"),
    ] {
        let o = find(&k, kind, name);
        if !matches!(
            kind,
            "Namespace" | "ClusterRoleBinding" | "CustomResourceDefinition"
        ) {
            assert_eq!(o["metadata"]["namespace"], "lanekeeper-system", "{kind}");
        }
    }
    let crb = find(&k, "ClusterRoleBinding", "lanekeeper-controller");
    assert_eq!(crb["subjects"][0]["namespace"], "lanekeeper-system");
}

/// An overlay in a scratch directory: config/default plus the leader-election component.
fn leader_election_overlay() -> PathBuf {
    let dir = process::scratch_dir("overlay");
    let up = "../".repeat(dir.components().count() - 1);
    let root = repo().strip_prefix("/").unwrap().display().to_string();
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "resources: [{up}{root}/config/default]\ncomponents: [{up}{root}/config/components/leader-election]\n"
        ),
    )
    .unwrap();
    dir
}

#[test]
fn leader_election_component_matches_the_chart_with_two_replicas() {
    let k = docs(&kustomize(&leader_election_overlay()));
    let h = docs(&render(
        "lanekeeper",
        RENDER_NAMESPACE,
        &["controller.replicaCount=2"],
    ));
    let name = "lanekeeper-controller-leader-election";
    assert_eq!(
        controller_rules(&k, "Role", name),
        controller_rules(&h, "Role", name)
    );
    let args = |objs: &[Value]| {
        strs(
            &find(objs, "Deployment", "lanekeeper-controller")["spec"]["template"]["spec"]
                ["containers"][0]["args"],
        )
    };
    let mut ka = args(&k);
    let mut ha = args(&h);
    // The chart also passes the (default) lease duration.
    ha.retain(|a| !a.starts_with("--lease-duration"));
    ka.sort();
    ha.sort();
    assert_eq!(ka, ha);
    assert_eq!(
        find(&k, "Deployment", "lanekeeper-controller")["spec"]["replicas"],
        2
    );
}

// ---------------------------------------------------------------- the test cluster

/// One cluster-changing setup step at a time (CRDs are shared by every test).
static CLUSTER: Mutex<()> = Mutex::new(());

fn cluster() -> &'static ControlPlane {
    controlplane::full()
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A namespace that enforces the "restricted" Pod Security Standard, so
/// that pods which are not hardened are refused by the API server.
fn restricted_namespace(cp: &ControlPlane, prefix: &str) -> String {
    let ns = cp.namespace(prefix);
    cp.kubectl_ok(&[
        "label",
        "namespace",
        &ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    ]);
    ns
}

fn rollout(cp: &ControlPlane, ns: &str, deployment: &str) {
    let out = cp
        .kubectl()
        .args([
            "rollout",
            "status",
            &format!("deployment/{deployment}"),
            "-n",
            ns,
            "--timeout=120s",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        let rs = cp
            .kubectl()
            .args(["get", "replicasets,pods,events", "-n", ns, "-o", "wide"])
            .output()
            .unwrap();
        panic!(
            "deployment {ns}/{deployment} did not become available (a pod that is not hardened \
             is refused in a restricted namespace):\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&rs.stdout)
        );
    }
}

#[test]
fn kustomize_base_applies_to_the_api_server_and_its_pod_is_admitted_as_restricted() {
    let cp = cluster();
    let t = Instant::now();
    let dir = repo().join("config/default");
    let dir = dir.display().to_string();
    {
        let _one = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        // The issue's check first: server-side validation without changing
        // anything. A dry run cannot create the namespace its objects go in,
        // so that one object is applied for real first.
        cp.kubectl_ok(&[
            "apply",
            "-f",
            &repo()
                .join("config/default/namespace.yaml")
                .display()
                .to_string(),
        ]);
        cp.kubectl_ok(&["apply", "-k", &dir, "--dry-run=server"]);
        let out = cp.kubectl_ok(&["apply", "-k", &dir]);
        assert!(
            out.contains("deployment.apps/lanekeeper-controller"),
            "{out}"
        );
    }
    let overlay = leader_election_overlay().display().to_string();
    cp.kubectl_ok(&["apply", "-k", &overlay, "--dry-run=server"]);
    // config/default labels its namespace restricted; the controller pod must be admitted.
    rollout(cp, "lanekeeper-system", "lanekeeper-controller");
    eprintln!(
        "config/default applied and its controller pod admitted in {:.1}s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn chart_with_every_option_is_accepted_by_the_api_server() {
    let cp = cluster();
    let ops = cp.namespace("lk-ops");
    let watched = cp.namespace("lk-watched");
    let set = all_options(&watched);
    let set: Vec<&str> = set.iter().map(String::as_str).collect();
    // Not the ServiceMonitor: the test API server has no prometheus-operator CRDs.
    let rendered = render("every", &ops, &set);
    cp.kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], &rendered);
}

/// The chart installed with `helm install` into a restricted namespace, with
/// two controller replicas so that the leader-election RBAC is in play.
struct Release {
    ns: String,
    /// `helm get manifest`, as installed.
    manifest: Vec<Value>,
}

fn release() -> &'static Release {
    static R: OnceLock<Release> = OnceLock::new();
    R.get_or_init(|| {
        let cp = cluster();
        let ns = restricted_namespace(cp, "lk-system");
        let kubeconfig = cp.kubeconfig.display().to_string();
        let t = Instant::now();
        {
            let _one = CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
            helm_ok(&[
                "install",
                RELEASE,
                "charts/lanekeeper",
                "--namespace",
                &ns,
                "--kubeconfig",
                &kubeconfig,
                "--set",
                "controller.replicaCount=2",
                "--set",
                "controller.podDisruptionBudget.enabled=true",
                "--set",
                "networkPolicy.enabled=true",
            ]);
        }
        eprintln!("helm install in {:.1}s", t.elapsed().as_secs_f64());
        cp.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/shardsets.lanekeeper.io",
            "crd/dedicatedlanes.lanekeeper.io",
        ]);
        let manifest = docs(&helm_ok(&[
            "get",
            "manifest",
            RELEASE,
            "--namespace",
            &ns,
            "--kubeconfig",
            &kubeconfig,
        ]));
        Release { ns, manifest }
    })
}

#[test]
fn chart_installs_with_helm_and_its_pods_are_admitted_as_restricted() {
    let cp = cluster();
    let r = release();
    for (kind, name) in [
        ("serviceaccount", SA),
        ("clusterrole", "lk-lanekeeper-controller"),
        ("clusterrolebinding", "lk-lanekeeper-controller"),
        ("role", "lk-lanekeeper-controller-leader-election"),
        ("service", "lk-lanekeeper-controller-metrics"),
        ("networkpolicy", "lk-lanekeeper-controller"),
        ("poddisruptionbudget", "lk-lanekeeper-controller"),
    ] {
        cp.kubectl_ok(&["get", kind, name, "-n", &r.ns]);
    }
    let status = helm_ok(&[
        "status",
        RELEASE,
        "--namespace",
        &r.ns,
        "--kubeconfig",
        &cp.kubeconfig.display().to_string(),
    ]);
    assert!(status.contains("STATUS: deployed"), "{status}");
    rollout(cp, &r.ns, "lk-lanekeeper-controller");
}

fn can_i(cp: &ControlPlane, who: &str, args: &[&str]) -> bool {
    let out = cp
        .kubectl()
        .args(["auth", "can-i"])
        .args(args)
        .arg(format!("--as={who}"))
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        answer == "yes" || answer == "no",
        "kubectl auth can-i {} answered {answer:?}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    answer == "yes"
}

#[test]
fn service_account_may_do_what_the_controller_needs_and_nothing_else() {
    let cp = cluster();
    let r = release();
    let sets = cp.namespace("lk-rbac");
    let who = format!("system:serviceaccount:{}:{SA}", r.ns);
    let rel = r.ns.as_str();
    let sets = sets.as_str();
    let allowed: Vec<Vec<&str>> = vec![
        vec!["list", "shardsets.lanekeeper.io", "--all-namespaces"],
        vec!["watch", "shardsets.lanekeeper.io", "--all-namespaces"],
        vec!["get", "shardsets.lanekeeper.io", "-n", sets],
        // The set's finalizer (lanekeeper.io/retire-lanes).
        vec!["patch", "shardsets.lanekeeper.io", "-n", sets],
        vec!["list", "dedicatedlanes.lanekeeper.io", "--all-namespaces"],
        vec!["watch", "dedicatedlanes.lanekeeper.io", "--all-namespaces"],
        vec!["create", "dedicatedlanes.lanekeeper.io", "-n", sets],
        vec!["patch", "dedicatedlanes.lanekeeper.io", "-n", sets],
        vec!["delete", "dedicatedlanes.lanekeeper.io", "-n", sets],
        vec![
            "patch",
            "shardsets.lanekeeper.io",
            "--subresource=status",
            "-n",
            sets,
        ],
        vec![
            "patch",
            "dedicatedlanes.lanekeeper.io",
            "--subresource=status",
            "-n",
            sets,
        ],
        vec![
            "update",
            "shardsets.lanekeeper.io",
            "--subresource=finalizers",
            "-n",
            sets,
        ],
        vec![
            "update",
            "dedicatedlanes.lanekeeper.io",
            "--subresource=finalizers",
            "-n",
            sets,
        ],
        vec!["list", "deployments.apps", "--all-namespaces"],
        vec!["watch", "deployments.apps", "--all-namespaces"],
        vec!["create", "deployments.apps", "-n", sets],
        vec!["patch", "deployments.apps", "-n", sets],
        vec!["delete", "deployments.apps", "-n", sets],
        vec!["create", "events.events.k8s.io", "-n", sets],
        vec!["patch", "events.events.k8s.io", "-n", sets],
        vec!["get", "secrets/lanekeeper-redis", "-n", sets],
        vec!["get", "configmaps/lanekeeper-tiers", "-n", sets],
        vec!["create", "leases.coordination.k8s.io", "-n", rel],
        vec![
            "get",
            "leases.coordination.k8s.io/lanekeeper-controller",
            "-n",
            rel,
        ],
        vec![
            "patch",
            "leases.coordination.k8s.io/lanekeeper-controller",
            "-n",
            rel,
        ],
    ];
    let denied: Vec<Vec<&str>> = vec![
        vec!["*", "*", "--all-namespaces"],
        vec!["*", "*", "-n", sets],
        vec!["delete", "secrets", "-n", sets],
        vec!["delete", "secrets/lanekeeper-redis", "-n", sets],
        vec!["list", "secrets", "--all-namespaces"],
        vec!["list", "secrets", "-n", sets],
        vec!["watch", "secrets", "-n", sets],
        vec!["get", "secrets/some-other-secret", "-n", sets],
        vec!["get", "configmaps/kube-root-ca.crt", "-n", sets],
        vec!["list", "configmaps", "-n", sets],
        vec!["watch", "configmaps", "--all-namespaces"],
        vec!["create", "secrets", "-n", sets],
        vec!["create", "pods", "-n", sets],
        vec!["create", "pods", "-n", rel],
        vec!["create", "pods/exec", "-n", sets],
        vec!["delete", "namespaces", "--all-namespaces"],
        vec!["create", "clusterrolebindings"],
        vec!["escalate", "clusterroles"],
        vec!["bind", "clusterroles"],
        vec!["impersonate", "users"],
        vec!["create", "serviceaccounts/token", "-n", rel],
        vec!["delete", "shardsets.lanekeeper.io", "-n", sets],
        vec!["update", "deployments.apps", "-n", sets],
        vec!["create", "events", "-n", sets],
        vec!["create", "leases.coordination.k8s.io", "-n", sets],
        vec![
            "patch",
            "leases.coordination.k8s.io/kube-scheduler",
            "-n",
            rel,
        ],
        vec![
            "delete",
            "leases.coordination.k8s.io/lanekeeper-controller",
            "-n",
            rel,
        ],
        vec!["create", "customresourcedefinitions.apiextensions.k8s.io"],
    ];
    let mut wrong = Vec::new();
    for a in &allowed {
        if !can_i(cp, &who, a) {
            wrong.push(format!("denied but needed: {}", a.join(" ")));
        }
    }
    for a in &denied {
        if can_i(cp, &who, a) {
            wrong.push(format!("allowed but not needed: {}", a.join(" ")));
        }
    }
    assert!(wrong.is_empty(), "RBAC of {who}:\n{}", wrong.join("\n"));
}

// ---------------------------------------------------------------- the controller under its ServiceAccount

struct Running {
    samples_ns: String,
    metrics_addr: String,
    log: PathBuf,
    pid: u32,
}

/// A kubeconfig that authenticates with a token of the chart's ServiceAccount,
/// as the pod's mounted token would.
fn service_account_kubeconfig(cp: &ControlPlane, ns: &str) -> PathBuf {
    let token = cp
        .kubectl_ok(&["create", "token", SA, "-n", ns, "--duration=2h"])
        .trim()
        .to_string();
    assert!(!token.is_empty(), "kubectl create token printed nothing");
    let path = process::scratch_dir("sa").join("controller.kubeconfig");
    let body = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: {SA}\n  user:\n    token: {token}\n\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: {SA}\n    namespace: {ns}\n\
         current-context: test\n",
        server = cp.server,
        ca = cp.dir.join("pki/ca.crt").display(),
    );
    std::fs::write(&path, body).unwrap();
    path
}

fn running() -> &'static Running {
    static R: OnceLock<Running> = OnceLock::new();
    R.get_or_init(|| {
        let cp = cluster();
        let r = release();
        let redis = support::redis::shared();
        // The samples as a user applies them, next to their Redis Secret.
        let samples_ns = cp.namespace("lk-samples");
        cp.kubectl_ok(&[
            "create",
            "secret",
            "generic",
            "lanekeeper-redis",
            "-n",
            &samples_ns,
            &format!("--from-literal=url={}", redis.url),
        ]);
        cp.kubectl_ok(&[
            "apply",
            "-n",
            &samples_ns,
            "-f",
            &repo().join("config/samples").display().to_string(),
        ]);

        // The container's args and env exactly as the chart installed them; only the
        // listen address moves to a free loopback port.
        let d = find(&r.manifest, "Deployment", "lk-lanekeeper-controller");
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let metrics_addr = format!("127.0.0.1:{}", process::free_port());
        let args: Vec<String> = strs(&c["args"])
            .into_iter()
            .map(|a| {
                if a.starts_with("--metrics-addr=") {
                    format!("--metrics-addr={metrics_addr}")
                } else {
                    a
                }
            })
            .collect();
        assert!(args.contains(&"--leader-election=true".to_string()));
        let kubeconfig = service_account_kubeconfig(cp, &r.ns);
        let dir = process::scratch_dir("sa-controller");
        let log = dir.join("controller.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lanekeeper"));
        cmd.args(&args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("KUBECONFIG", &kubeconfig)
            // What the downward API gives the pod.
            .env("POD_NAMESPACE", &r.ns)
            .env("POD_NAME", "lk-lanekeeper-controller-test-0");
        for e in c["env"].as_sequence().unwrap() {
            if let Some(v) = e["value"].as_str() {
                cmd.env(e["name"].as_str().unwrap(), v);
            }
        }
        eprintln!("controller under {SA}: lanekeeper {}", args.join(" "));
        let t = Instant::now();
        let pid = process::spawn_server(cmd, &log);
        process::wait_until(
            "controller under the chart's ServiceAccount: 16 shard Deployments of the sample",
            Duration::from_secs(120),
            &log,
            pid,
            || {
                cp.kubectl()
                    .args([
                        "get",
                        "deployments",
                        "-n",
                        &samples_ns,
                        "-l",
                        "app.kubernetes.io/instance=webhooks,app.kubernetes.io/component=shard",
                        "-o",
                        "name",
                    ])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().count() == 16)
            },
        );
        eprintln!(
            "16 shard Deployments under the ServiceAccount in {:.1}s",
            t.elapsed().as_secs_f64()
        );
        process::wait_until(
            "sample ShardSet Ready with 16/16 shards (status written under the ServiceAccount)",
            Duration::from_secs(180),
            &log,
            pid,
            || {
                cp.kubectl()
                    .args([
                        "get",
                        "shardset",
                        "webhooks",
                        "-n",
                        &samples_ns,
                        "-o",
                        "jsonpath={.status.readySummary} {.status.conditions[?(@.type==\"Ready\")].status}",
                    ])
                    .output()
                    .is_ok_and(|o| o.stdout == b"16/16 True")
            },
        );
        eprintln!(
            "sample ShardSet Ready under the ServiceAccount in {:.1}s",
            t.elapsed().as_secs_f64()
        );
        Running {
            samples_ns,
            metrics_addr,
            log,
            pid,
        }
    })
}

#[test]
fn controller_reconciles_the_samples_under_the_charts_service_account() {
    let cp = cluster();
    let r = release();
    let run = running();
    // The Lease in the release namespace, held by this replica.
    let holder = cp.kubectl_ok(&[
        "get",
        "lease",
        "lanekeeper-controller",
        "-n",
        &r.ns,
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    assert_eq!(holder, "lk-lanekeeper-controller-test-0");
    // Status, owner references and the Redis URL from the Secret (read under RBAC).
    let set: serde_json::Value = serde_json::from_str(&cp.kubectl_ok(&[
        "get",
        "shardset",
        "webhooks",
        "-n",
        &run.samples_ns,
        "-o",
        "json",
    ]))
    .unwrap();
    assert_eq!(
        set["status"]["observedGeneration"],
        set["metadata"]["generation"]
    );
    let degraded = set["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Degraded")
        .unwrap();
    assert_eq!(degraded["status"], "False", "{degraded}");
    let d: serde_json::Value = serde_json::from_str(&cp.kubectl_ok(&[
        "get",
        "deployment",
        "webhooks-shard-15",
        "-n",
        &run.samples_ns,
        "-o",
        "json",
    ]))
    .unwrap();
    assert_eq!(d["metadata"]["ownerReferences"][0]["kind"], "ShardSet");
    assert_eq!(d["spec"]["replicas"], 2);
    // Events went out through events.k8s.io.
    wait_for(
        "a Ready event for the sample",
        Duration::from_secs(30),
        || {
            cp.kubectl_ok(&[
                "get",
                "events.events.k8s.io",
                "-n",
                &run.samples_ns,
                "-o",
                "jsonpath={.items[*].reason}",
            ])
            .contains("AllShardsAvailable")
        },
    );
    let log = std::fs::read_to_string(&run.log).unwrap();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "the controller was refused something under {SA}:\n{}",
        process::tail(&run.log, 40)
    );
    assert!(process::is_running(run.pid), "controller exited");
    let health = http_get(&run.metrics_addr, "/healthz");
    let ready = http_get(&run.metrics_addr, "/readyz");
    assert_eq!((health.as_str(), ready.as_str()), ("ok", "ok"));
}

// ---------------------------------------------------------------- metrics named by dashboards and alerts

/// The body of a plain HTTP GET on loopback, if it answers 200.
fn try_http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8(raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    Some(
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        },
    )
}

fn http_get(addr: &str, path: &str) -> String {
    try_http_get(addr, path).unwrap_or_else(|| panic!("GET http://{addr}{path} did not answer 200"))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// Every sample name a /metrics text can serve: the names of its samples,
/// and for each family the names its type implies (`_total` for counters,
/// `_bucket`, `_sum`, `_count` for histograms), samples or not.
fn served_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap_or(""));
            match kind {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Metric names a PromQL expression selects: identifiers that are not
/// functions, aggregations, keywords, label names (in `{}`, `by ()`,
/// `on ()`, ...), durations, numbers or Grafana variables.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 10] = [
        "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "Inf", "NaN",
    ];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    // Drop strings, then label matchers and ranges.
    let mut plain = String::new();
    let mut quote: Option<char> = None;
    let mut depth_brace = 0;
    let mut depth_bracket = 0;
    for ch in expr.chars() {
        if let Some(q) = quote {
            if ch == q {
                quote = None;
            }
            continue;
        }
        match ch {
            '"' | '\'' | '`' => quote = Some(ch),
            '{' => depth_brace += 1,
            '}' => depth_brace -= 1,
            '[' => depth_bracket += 1,
            ']' => depth_bracket -= 1,
            _ if depth_brace > 0 || depth_bracket > 0 => {}
            _ => plain.push(ch),
        }
    }
    let chars: Vec<char> = plain.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut skip_list = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '$' {
            // A Grafana variable: skip its name.
            i += 1;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            continue;
        }
        if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            continue;
        }
        if c.is_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let next: String = chars[j..]
                .iter()
                .take_while(|c| c.is_alphanumeric() || **c == '_')
                .collect();
            // `f(`, or an aggregation written `sum by (...) (...)`.
            let call = chars.get(j) == Some(&'(') || next == "by" || next == "without";
            if LABEL_LISTS.contains(&word.as_str()) {
                skip_list = true;
            } else if !call && !KEYWORDS.contains(&word.as_str()) {
                out.insert(word);
            }
            continue;
        }
        if c == '(' && skip_list {
            // The label list after by/without/on/ignoring/group_*.
            while i < chars.len() && chars[i] != ')' {
                i += 1;
            }
            skip_list = false;
        }
        i += 1;
    }
    out
}

/// Label names of the served series (`name{a="x",b="y"} v` lines).
fn served_labels(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(open) = line.find('{') else { continue };
        let mut rest = &line[open + 1..];
        while let Some(eq) = rest.find('=') {
            out.insert(rest[..eq].trim_start_matches(',').trim().to_string());
            // the quoted value, escapes included
            let value = &rest[eq + 2..];
            let mut end = 0;
            let mut escaped = false;
            for (i, c) in value.char_indices() {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = true,
                    (false, '"') => {
                        end = i;
                        break;
                    }
                    _ => {}
                }
            }
            rest = &value[end + 1..];
            if rest.starts_with('}') {
                break;
            }
        }
    }
    out
}

/// Label names a PromQL expression uses: in matchers (`{name=~"..."}`) and
/// in `by`/`without`/`on`/`ignoring`/`group_left`/`group_right` lists.
fn promql_labels(expr: &str) -> BTreeSet<String> {
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let ident = |i: usize| -> (String, usize) {
        let mut j = i;
        while j < chars.len() && (chars[j].is_alphanumeric() || chars[j] == '_') {
            j += 1;
        }
        (chars[i..j].iter().collect(), j)
    };
    let mut out = BTreeSet::new();
    let (mut i, mut brace, mut list) = (0, false, false);
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            '{' => brace = true,
            '}' => brace = false,
            '(' if list => {
                i += 1;
                while i < chars.len() && chars[i] != ')' {
                    if chars[i].is_alphabetic() || chars[i] == '_' {
                        let (name, j) = ident(i);
                        out.insert(name);
                        i = j;
                    } else {
                        i += 1;
                    }
                }
                list = false;
            }
            '$' => {
                // a Grafana variable
                i = ident(i + 1).1;
                continue;
            }
            _ if c.is_alphabetic() || c == '_' => {
                let (word, j) = ident(i);
                if brace {
                    out.insert(word);
                } else if LABEL_LISTS.contains(&word.as_str()) {
                    list = true;
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Labels `exprs` use that no served series carries and no scrape adds.
fn unknown_labels(exprs: &[(String, String)], labels: &BTreeSet<String>) -> Vec<String> {
    let mut unknown = Vec::new();
    for (where_, e) in exprs {
        for l in promql_labels(e) {
            if !labels.contains(&l) {
                unknown.push(format!("{where_}: label {l} (in {e})"));
            }
        }
    }
    unknown
}

#[test]
fn promql_label_extraction() {
    let got = promql_labels(
        r#"histogram_quantile(0.95, sum by (queue, le) (rate(lanekeeper_queue_wait_seconds_bucket{namespace=~"$namespace", x="a{b}=c"}[$__rate_interval]) unless on (namespace, tenant) (m > $small_share))) and topk($topk, up)"#,
    );
    let want: BTreeSet<String> = ["le", "namespace", "queue", "tenant", "x"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
    let served = served_labels(
        "# TYPE a counter\na_total{queue=\"shard-00\",class=\"a \\\"b\\\" c\"} 1\nb 2\n",
    );
    assert_eq!(served, ["class", "queue"].map(String::from).into());
}

#[test]
fn promql_metric_extraction() {
    let got = promql_metrics(
        r#"histogram_quantile(0.95, sum by (queue, le) (rate(lanekeeper_queue_wait_seconds_bucket{namespace=~"$namespace", x="a{b}"}[$__rate_interval]) unless on (namespace, tenant) (lanekeeper_tenant_capacity_share > $small_share))) > 1e3 and topk($topk, up offset 5m)"#,
    );
    let want: BTreeSet<String> = [
        "lanekeeper_queue_wait_seconds_bucket",
        "lanekeeper_tenant_capacity_share",
        "up",
    ]
    .map(String::from)
    .into();
    assert_eq!(got, want);
}

/// Every PromQL expression in the dashboard (panel targets and variable queries).
fn dashboard_exprs(dash: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(v: &serde_json::Value, title: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(m) => {
                let title = m
                    .get("title")
                    .and_then(|t| t.as_str())
                    .unwrap_or(title)
                    .to_string();
                if let Some(e) = m.get("expr").and_then(|e| e.as_str()) {
                    out.push((title.clone(), e.to_string()));
                }
                for v in m.values() {
                    walk(v, &title, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, title, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], "", &mut out);
    for var in dash["templating"]["list"].as_array().unwrap() {
        if var["type"] != "query" {
            continue;
        }
        let q = var["query"]["query"]
            .as_str()
            .or(var["query"].as_str())
            .unwrap();
        // label_values(<selector>, <label>): the selector is PromQL.
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.rsplit_once(','))
            .map(|(sel, _)| sel.to_string())
            .unwrap_or_else(|| panic!("variable {} is not label_values(...): {q}", var["name"]));
        out.push((format!("variable {}", var["name"]), inner));
    }
    out
}

/// Poll `addr`'s /metrics until every string in `want` is in it.
fn scrape_until(addr: &str, what: &str, want: &[String], log: &Path, pid: u32) -> String {
    let mut text = String::new();
    process::wait_until(what, Duration::from_secs(90), log, pid, || {
        text = try_http_get(addr, "/metrics").unwrap_or_default();
        want.iter().all(|w| text.contains(w.as_str()))
    });
    text
}

/// Scrapes of a controller and a worker that have been busy enough for every
/// metric family to have series: a one-shard ShardSet with a worker that
/// delivers for one tenant and trips the breaker of another (deliveries,
/// waits, breaker transitions; worker-seconds, so skew and capacity shares),
/// a ShardSet whose worker env var name the API server refuses in a
/// Deployment (reconcile errors), and the sample DedicatedLane moved onto
/// its lane by the lane reconciler.
fn busy_metrics() -> (String, String) {
    let cp = cluster();
    let run = running();
    let redis = support::redis::shared();
    let ns = cp.namespace("lk-metrics");
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &format!(
            r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: metrics}}
spec:
  shards: 1
  redis: {{url: "{url}"}}
  worker: {{image: "ghcr.io/lanekeeper/lanekeeper:0.1.0", replicas: 1, concurrency: 4}}
  delivery:
    maxAttempts: 50
    breaker: {{failureRatio: 0.5, minRequests: 5, window: 60s, openFor: 1s}}
---
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: bad-env}}
spec:
  shards: 1
  redis: {{url: "{url}"}}
  worker:
    image: "ghcr.io/lanekeeper/lanekeeper:0.1.0"
    env: [{{name: "BAD=NAME", value: "x"}}]
"#,
            url = redis.url
        ),
    );
    wait_for("ShardSet metrics Ready", Duration::from_secs(90), || {
        cp.kubectl_ok(&[
            "get",
            "shardset",
            "metrics",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ]) == "True"
    });

    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = rt.block_on(async {
        let store = lanekeeper::store::Store::connect(
            &redis.url,
            lanekeeper::store::SetId::new(&ns, "metrics"),
            Default::default(),
        )
        .await
        .unwrap();
        let s = support::scenario::Setup {
            store,
            set: format!("{ns}/metrics"),
            redis_url: redis.url.clone(),
            receiver: support::receiver::Receiver::start(),
        };
        s.endpoint("acme", "ok", 1).await;
        s.endpoint("down", "gate", 1).await;
        s.send("acme", 0..20).await;
        s.send("down", 0..20).await;
        s
    });
    let addr = format!("127.0.0.1:{}", process::free_port());
    let worker_log = process::scratch_dir("metrics-worker").join("worker.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lanekeeper"));
    cmd.arg("worker")
        .args([
            "--redis",
            &redis.url,
            "--shard-set",
            &s.set,
            "--queue",
            "shard-00",
        ])
        .args(["--concurrency", "4", "--metrics-addr", &addr])
        .args([
            "--allow-cidr",
            "127.0.0.0/8",
            "--initial-backoff",
            "10ms",
            "--max-backoff",
            "200ms",
        ])
        .env("RUST_LOG", "warn");
    let pid = process::spawn_server(cmd, &worker_log);
    let worker_text = scrape_until(
        &addr,
        "worker: 20 deliveries and an open breaker",
        &[
            r#"lanekeeper_deliveries_total{queue="shard-00",class="delivered"} 20"#.into(),
            r#"lanekeeper_breaker_transitions_total{queue="shard-00",state="open"}"#.into(),
        ],
        &worker_log,
        pid,
    );
    support::scenario::stop(pid);
    drop(s);

    // Worker-seconds are read at reconcile: ask for one now rather than in 15 s.
    cp.kubectl_ok(&[
        "annotate",
        "shardset",
        "metrics",
        "-n",
        &ns,
        "touch=1",
        "--overwrite",
    ]);
    let sns = &run.samples_ns;
    let controller_text = scrape_until(
        &run.metrics_addr,
        "controller: skew, capacity shares, lane phase and conditions, reconcile errors",
        &[
            format!(r#"lanekeeper_skew_ratio{{namespace="{ns}",shard_set="metrics"}} 1"#),
            format!(
                r#"lanekeeper_tenant_capacity_share{{namespace="{ns}",shard_set="metrics",queue="shard-00",tenant="acme"}}"#
            ),
            format!(
                r#"lanekeeper_lane_phase{{namespace="{sns}",shard_set="webhooks",lane="webhooks-bigimport",tenant="bigimport-corp",phase="Active"}} 1"#
            ),
            format!(
                r#"lanekeeper_lane_condition{{namespace="{sns}",shard_set="webhooks",lane="webhooks-bigimport",condition="Admitted"}} 1"#
            ),
            "lanekeeper_reconcile_errors_total{controller=".to_string(),
        ],
        &run.log,
        run.pid,
    );
    (controller_text, worker_text)
}

/// The metric names in `exprs` (where, PromQL) that are not in `served`;
/// an expression naming no metric at all counts too.
fn unserved(exprs: &[(String, String)], served: &BTreeSet<String>) -> Vec<String> {
    let mut unknown = Vec::new();
    for (where_, e) in exprs {
        let names = promql_metrics(e);
        if names.is_empty() {
            unknown.push(format!("{where_}: no metric in {e}"));
        }
        for m in names {
            if !served.contains(&m) {
                unknown.push(format!("{where_}: {m} (in {e})"));
            }
        }
    }
    unknown
}

#[test]
fn dashboards_alerts_and_autoscaling_name_only_metrics_the_binaries_serve() {
    let run = running();
    // The sample's series, before anything else happens to it.
    let ns = &run.samples_ns;
    let first = http_get(&run.metrics_addr, "/metrics");
    for want in [
        format!(
            r#"lanekeeper_queue_depth{{namespace="{ns}",shard_set="webhooks",queue="shard-15"}} 0"#
        ),
        format!(r#"lanekeeper_shards{{namespace="{ns}",shard_set="webhooks"}} 16"#),
        format!(
            r#"lanekeeper_shardset_condition{{namespace="{ns}",shard_set="webhooks",condition="Ready"}} 1"#
        ),
        format!(
            r#"lanekeeper_shardset_condition{{namespace="{ns}",shard_set="webhooks",condition="LaneCapReached"}} 0"#
        ),
        format!(r#"lanekeeper_lanes_max{{namespace="{ns}",shard_set="webhooks"}} 8"#),
    ] {
        assert!(first.contains(&want), "missing {want}:\n{first}");
    }
    // The sample DedicatedLane is admitted and moved onto its lane (lane-0).
    scrape_until(
        &run.metrics_addr,
        "the sample DedicatedLane Active on its lane",
        &[
            format!(r#"lanekeeper_lanes_used{{namespace="{ns}",shard_set="webhooks"}} 1"#),
            format!(
                r#"lanekeeper_lane_phase{{namespace="{ns}",shard_set="webhooks",lane="webhooks-bigimport",tenant="bigimport-corp",phase="Pending"}} 0"#
            ),
            format!(
                r#"lanekeeper_lane_phase{{namespace="{ns}",shard_set="webhooks",lane="webhooks-bigimport",tenant="bigimport-corp",phase="Active"}} 1"#
            ),
        ],
        &run.log,
        run.pid,
    );
    let t = Instant::now();
    let (controller, worker) = busy_metrics();
    eprintln!(
        "busy controller and worker scraped in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    // A family prints nothing, not even # TYPE, before its first series:
    // that is why the scrapes above wait for activity.

    let mut served = served_names(&controller);
    served.extend(served_names(&worker));
    eprintln!("served metric names: {served:?}");

    let dash: serde_json::Value =
        serde_json::from_str(&read("config/monitoring/grafana-dashboard.json"))
            .expect("the dashboard is JSON");
    assert_eq!(dash["uid"], "lanekeeper");
    let mut exprs = dashboard_exprs(&dash);
    let dash_metrics: BTreeSet<String> =
        exprs.iter().flat_map(|(_, e)| promql_metrics(e)).collect();
    // What the dashboard must show (the issue's list).
    for m in [
        "lanekeeper_queue_depth",               // per-shard depth
        "lanekeeper_skew_ratio",                // skew
        "lanekeeper_tenant_capacity_share",     // top-K capacity share
        "lanekeeper_queue_wait_seconds_bucket", // small-tenant wait p95/p99
        "lanekeeper_lanes_used",                // lanes used ...
        "lanekeeper_lanes_max",                 // ... against the cap
        "lanekeeper_lane_phase",                // lane phases
        "lanekeeper_lane_condition",            // lane conditions
        "lanekeeper_shardset_condition",        // set conditions
        "lanekeeper_breaker_transitions_total",
        "lanekeeper_queue_drain_seconds",  // time to drain
        "lanekeeper_queue_fairness_index", // fairness per queue
        "lanekeeper:small_tenant_wait:ratio_to_baseline", // wait against its baseline
    ] {
        assert!(dash_metrics.contains(m), "the dashboard does not show {m}");
    }

    let rule: Value = serde_yaml::from_str(&read("config/monitoring/prometheusrule.yaml")).unwrap();
    assert_eq!(rule["kind"], "PrometheusRule");
    let mut alerts = BTreeMap::new();
    // Recording rules: their names are served by Prometheus, from metrics
    // the binaries serve (checked as every other expression).
    let mut recorded = BTreeSet::new();
    for g in rule["spec"]["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            let expr = r["expr"].as_str().unwrap().to_string();
            if let Some(name) = r["record"].as_str() {
                recorded.insert(name.to_string());
                exprs.push((format!("recording rule {name}"), expr));
                continue;
            }
            let name = r["alert"].as_str().unwrap().to_string();
            assert!(r["for"].is_string(), "{name} has no `for`");
            assert!(
                r["labels"]["severity"].is_string(),
                "{name} has no severity"
            );
            alerts.insert(name.clone(), promql_metrics(&expr));
            exprs.push((format!("alert {name}"), expr));
        }
    }
    for (alert, metric) in [
        ("LanekeeperLaneCapReached", "lanekeeper_shardset_condition"),
        ("LanekeeperShardSkewHigh", "lanekeeper_skew_ratio"),
        ("LanekeeperDedicatedLaneStuck", "lanekeeper_lane_phase"),
        (
            "LanekeeperSmallTenantWaitOverSLO",
            "lanekeeper_queue_wait_seconds_bucket",
        ),
        (
            "LanekeeperBreakersOpening",
            "lanekeeper_breaker_transitions_total",
        ),
        ("LanekeeperQueueDrainSlow", "lanekeeper_queue_drain_seconds"),
        ("LanekeeperQueueUnfair", "lanekeeper_queue_fairness_index"),
    ] {
        assert!(
            alerts.get(alert).is_some_and(|m| m.contains(metric)),
            "alert {alert} on {metric} is missing: {alerts:?}"
        );
    }

    // Every KEDA example (config/autoscaling/*.yaml): each prometheus
    // trigger's query.
    let mut examples: Vec<PathBuf> = std::fs::read_dir(repo().join("config/autoscaling"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    examples.sort();
    assert!(
        !examples.is_empty(),
        "no KEDA example in config/autoscaling"
    );
    for path in examples {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let keda: Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(keda["kind"], "ScaledObject", "{file}");
        assert_eq!(
            keda["spec"]["scaleTargetRef"]["name"], "webhooks-shard-03",
            "{file}"
        );
        let triggers = keda["spec"]["triggers"].as_sequence().unwrap();
        assert!(
            triggers.iter().any(|t| t["type"] == "prometheus"),
            "{file}: no prometheus trigger"
        );
        for trigger in triggers.iter().filter(|t| t["type"] == "prometheus") {
            let q = trigger["metadata"]["query"].as_str().unwrap().to_string();
            exprs.push((format!("KEDA ScaledObject in {file}"), q));
        }
    }

    // What the rules record is served too, once Prometheus runs them.
    served.extend(recorded);
    let unknown = unserved(&exprs, &served);
    assert!(
        unknown.is_empty(),
        "metrics that neither `lanekeeper controller` nor `lanekeeper worker` serve:\n{}",
        unknown.join("\n")
    );
    // Labels: those the binaries' series carry, those the PodMonitor's
    // relabelings add, and the target labels prometheus-operator adds.
    let mut labels = served_labels(&controller);
    labels.extend(served_labels(&worker));
    let pod_monitor: Value =
        serde_yaml::from_str(&read("config/monitoring/podmonitor-workers.yaml")).unwrap();
    for ep in pod_monitor["spec"]["podMetricsEndpoints"]
        .as_sequence()
        .unwrap()
    {
        for r in ep["relabelings"].as_sequence().into_iter().flatten() {
            labels.insert(r["targetLabel"].as_str().unwrap().to_string());
        }
    }
    labels.extend(
        [
            "namespace",
            "pod",
            "container",
            "endpoint",
            "service",
            "job",
            "instance",
        ]
        .map(String::from),
    );
    let mut legends = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let legend = t["legendFormat"].as_str().unwrap_or_default();
            for part in legend.split("{{").skip(1) {
                let name = part.split("}}").next().unwrap().trim();
                legends.push((
                    format!("legend of {}", p["title"]),
                    format!("x{{{name}=\"\"}}"),
                ));
            }
        }
    }
    let unknown = unknown_labels(&[exprs.clone(), legends].concat(), &labels);
    assert!(
        unknown.is_empty(),
        "labels no served series carries (served and added: {labels:?}):\n{}",
        unknown.join("\n")
    );
    // The check sees a misspelt label.
    let broken = [(
        "a panel".to_string(),
        "sum by (queu) (lanekeeper_in_flight)".to_string(),
    )];
    let unknown = unknown_labels(&broken, &labels);
    eprintln!("a panel grouping by a label nothing carries, as expected: {unknown:?}");
    assert_eq!(unknown.len(), 1, "{unknown:?}");
    // The check sees a panel naming a metric no binary serves.
    let mut broken = dash.clone();
    broken["panels"][5]["targets"][0]["expr"] =
        serde_json::Value::from(r#"sum(lanekeeper_queue_depthh{namespace=~"$namespace"})"#);
    let unknown = unserved(&dashboard_exprs(&broken), &served);
    eprintln!("a panel naming an unserved metric, as expected: {unknown:?}");
    assert!(
        unknown.len() == 1 && unknown[0].contains("lanekeeper_queue_depthh"),
        "{unknown:?}"
    );
    eprintln!(
        "{} PromQL expressions checked against {} served names",
        exprs.len(),
        served.len()
    );
}
