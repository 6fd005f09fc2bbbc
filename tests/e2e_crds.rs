//! End-to-end: the CRDs against a real kube-apiserver, driven by the real kubectl.

mod support;

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use support::controlplane::{self, ControlPlane};

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(path)
        .display()
        .to_string()
}

/// The control plane with lanekeeper's CRDs applied and Established.
fn cluster() -> &'static ControlPlane {
    static READY: OnceLock<()> = OnceLock::new();
    let cp = controlplane::api_server();
    READY.get_or_init(|| {
        let out = cp.install_crds();
        assert!(out.contains("shardsets.lanekeeper.io"), "{out}");
        assert!(out.contains("dedicatedlanes.lanekeeper.io"), "{out}");
    });
    cp
}

fn retry<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

#[test]
fn crds_become_established_and_serve_names() {
    let cp = cluster();
    let names = cp.kubectl_ok(&["api-resources", "--api-group=lanekeeper.io", "-o", "wide"]);
    assert!(
        names.contains("shardsets") && names.contains("shs"),
        "{names}"
    );
    assert!(
        names.contains("dedicatedlanes") && names.contains("dl"),
        "{names}"
    );
    assert!(names.contains("lanekeeper"), "category missing: {names}");
}

#[test]
fn samples_apply_and_printer_columns_show() {
    let cp = cluster();
    let ns = cp.namespace("samples");
    cp.kubectl_ok(&["apply", "-n", &ns, "-f", &repo("config/samples/")]);

    // The controller is not running here; write the status it would, through the status subresource.
    cp.kubectl_ok(&[
        "patch", "-n", &ns, "shardset", "webhooks", "--subresource=status", "--type=merge", "-p",
        r#"{"status":{"observedGeneration":1,"shardsDesired":16,"shardsReady":15,"readySummary":"15/16","lanesUsed":1,"lanesMax":8,"laneSummary":"1/8","skewRatio":1.37,
            "conditions":[{"type":"Ready","status":"False","reason":"ShardsUnavailable","message":"15 of 16 shards available","lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1}]}}"#,
    ]);
    cp.kubectl_ok(&[
        "patch", "-n", &ns, "dedicatedlane", "webhooks-bigimport", "--subresource=status", "--type=merge", "-p",
        r#"{"status":{"phase":"Draining","laneIndex":3,"heldEnvelopes":42,
            "conditions":[{"type":"Ready","status":"False","reason":"Relocating","message":"draining shard-07","lastTransitionTime":"2026-01-01T00:00:00Z"}]}}"#,
    ]);

    let shs = cp.kubectl_ok(&["get", "-n", &ns, "shs"]);
    let header: Vec<&str> = shs.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "SHARDS", "READY", "LANES", "SKEW", "STATUS", "AGE"],
        "{shs}"
    );
    let row: Vec<&str> = shs.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..6],
        ["webhooks", "16", "15/16", "1/8", "1.37", "False"],
        "{shs}"
    );

    let dl = cp.kubectl_ok(&["get", "-n", &ns, "dl"]);
    let header: Vec<&str> = dl.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "TENANT", "LANE", "PHASE", "READY", "AGE"],
        "{dl}"
    );
    let row: Vec<&str> = dl.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..5],
        [
            "webhooks-bigimport",
            "bigimport-corp",
            "3",
            "Draining",
            "False"
        ],
        "{dl}"
    );

    // The incident view: both kinds through the category, and the wide columns.
    let all = cp.kubectl_ok(&["get", "-n", &ns, "lanekeeper"]);
    assert!(all.contains("shardset.lanekeeper.io/webhooks"), "{all}");
    assert!(
        all.contains("dedicatedlane.lanekeeper.io/webhooks-bigimport"),
        "{all}"
    );
    let wide = cp.kubectl_ok(&["get", "-n", &ns, "dl", "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("HELD"), "{wide}");
    assert!(wide.contains("42"), "{wide}");
}

#[test]
fn defaults_are_applied_by_the_api_server() {
    let cp = cluster();
    let ns = cp.namespace("defaults");
    let minimal = r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: minimal}
spec:
  shards: 4
  redis: {url: "redis://redis:6379/0"}
  worker: {image: "lanekeeper:dev"}
"#;
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], minimal);
    let json = cp.kubectl_ok(&["get", "-n", &ns, "shardset", "minimal", "-o", "json"]);
    let obj: lanekeeper::crd::ShardSet = serde_json::from_str(&json).unwrap();
    let spec = obj.spec;
    assert_eq!(spec.scheduler.quantum_seconds, 2.0);
    assert_eq!(spec.scheduler.max_in_flight_per_tenant, 8);
    assert_eq!(spec.promotion.max_lanes, 8);
    assert_eq!(spec.promotion.promote_share, 0.30);
    assert_eq!(spec.promotion.demote_share, 0.10);
    assert_eq!(
        spec.promotion.promote_after,
        std::time::Duration::from_secs(900)
    );
    assert_eq!(
        spec.relocation.drain_timeout,
        std::time::Duration::from_secs(120)
    );
    assert_eq!(spec.worker.concurrency, 16);
    assert_eq!(spec.isolation, lanekeeper::crd::Isolation::Tenant);
    assert_eq!(spec.scheduler.max_in_flight_per_endpoint, None);
    let iso = cp.kubectl_ok(&[
        "get",
        "-n",
        &ns,
        "shardset",
        "minimal",
        "-o",
        "jsonpath={.spec.isolation}",
    ]);
    assert_eq!(iso, "Tenant", "the API server writes the default");
}

#[test]
fn explain_documents_fields() {
    let cp = cluster();
    // The OpenAPI v3 document is published a moment after the CRD is Established.
    let text = retry(
        "kubectl explain shardset.spec.promotion",
        Duration::from_secs(60),
        || {
            let out = cp
                .kubectl()
                .args(["explain", "shardset.spec.promotion"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && text.contains("promoteShare") {
                Ok(text)
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        },
    );
    assert!(
        text.contains("When tenants are promoted to, and demoted from, dedicated lanes"),
        "{text}"
    );
    assert!(text.contains("maxLanes"), "{text}");
    assert!(
        text.contains("Most dedicated lanes admitted at once"),
        "{text}"
    );

    let field = cp.kubectl_ok(&["explain", "shardset.spec.relocation.drainTimeout"]);
    assert!(
        field.contains("Longest wait for a paused tenant"),
        "{field}"
    );
    let sweep = cp.kubectl_ok(&["explain", "shardset.spec.scheduler.sweepIdleTenantsAfter"]);
    // explain wraps lines where it likes
    let sweep = sweep.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        sweep.contains("no work and no traffic")
            && sweep.contains("lanekeeper_tenants_swept_total"),
        "{sweep}"
    );
    let trend = cp.kubectl_ok(&["explain", "shardset.spec.promotion.projectedWait"]);
    let trend = trend.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(trend.contains("Promote on the trend"), "{trend}");
    let hot = cp.kubectl_ok(&[
        "explain",
        "shardset.status.promotionCandidates.projectedWaitSeconds",
    ]);
    assert!(hot.contains("Hot on the trend"), "{hot}");
    let overrides = cp.kubectl_ok(&["explain", "shardset.spec.tenants"]);
    let overrides = overrides.split_whitespace().collect::<Vec<_>>().join(" ");
    for field in ["maxInFlight", "rateLimit", "paused", "tier", "weight"] {
        assert!(overrides.contains(field), "{field}: {overrides}");
    }
    assert!(
        overrides.contains("Per-tenant overrides kept in Git"),
        "{overrides}"
    );
    let lane = cp.kubectl_ok(&["explain", "dedicatedlane.status.phase"]);
    assert!(lane.contains("Relocation phase"), "{lane}");

    let iso = cp.kubectl_ok(&["explain", "shardset.spec.isolation"]);
    let iso = iso.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "What the fair scheduler isolates inside each queue",
        "`Tenant` (default)",
        "Fixed for the set's life",
        "create a new ShardSet instead",
        "strictly in enqueue order per (tenant, endpoint)",
        "with no order between a tenant's different endpoints",
        "a tenant's share does not grow with its number of endpoints",
        "order survives moves",
    ] {
        assert!(iso.contains(want), "missing {want:?} in:\n{iso}");
    }
    let cap = cp.kubectl_ok(&["explain", "shardset.spec.scheduler.maxInFlightPerEndpoint"]);
    let cap = cap.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "Only with `isolation: Endpoint`",
        "most envelopes of one (tenant, endpoint) leased at once",
        "half the tenant's cap",
        "rounded up",
        "Never above the tenant's cap",
        "Under `ordering: PerTenant` it is 1",
    ] {
        assert!(cap.contains(want), "missing {want:?} in:\n{cap}");
    }
}

fn rejected(cp: &ControlPlane, ns: &str, manifest: &str) -> String {
    let out = cp.kubectl_stdin_output(&["apply", "-n", ns, "-f", "-"], manifest);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "the API server accepted an invalid object:\n{manifest}"
    );
    stderr
}

#[test]
fn invalid_shardset_is_rejected_with_cel_messages() {
    let cp = cluster();
    let ns = cp.namespace("invalid");
    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: nonsense}
spec:
  shards: 0
  redis: {url: "redis://redis:6379/0"}
  worker: {image: "lanekeeper:dev"}
  promotion: {promoteShare: 0.3, demoteShare: 0.5, maxLanes: 9}
"#,
    );
    assert!(
        err.contains("spec.shards") && err.contains("shards must be between 1 and 1024"),
        "{err}"
    );
    assert!(
        err.contains("spec.promotion.maxLanes")
            && err.contains("promotion.maxLanes must be between 1 and 8"),
        "{err}"
    );
    assert!(
        err.contains("promotion.demoteShare must be less than promotion.promoteShare"),
        "{err}"
    );

    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: durations}
spec:
  shards: 1025
  redis: {url: "redis://user:secret@redis:6379/0", urlSecretRef: {name: r, key: url}}
  worker: {image: "lanekeeper:dev", autoscaled: true, replicas: 3}
  promotion: {promoteAfter: 0s, demoteAfter: "-5m"}
  relocation: {drainTimeout: soon}
  delivery: {initialBackoff: 2h, maxBackoff: 1h}
"#,
    );
    for want in [
        "shards must be between 1 and 1024",
        "redis: set exactly one of url and urlSecretRef",
        "redis.url must not carry credentials",
        "worker.replicas must be omitted when worker.autoscaled is true",
        "promotion.promoteAfter must be positive",
        "promotion.demoteAfter must be a duration such as 60m",
        "relocation.drainTimeout must be a duration such as 120s",
        "delivery.initialBackoff must not exceed delivery.maxBackoff",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }

    // Quanta and weights too small to schedule by (issue 17: they rounded to
    // zero and livelocked the queue), and dead-letter retention out of range.
    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: tiny}
spec:
  shards: 1
  redis: {url: "redis://redis:6379/0"}
  worker: {image: "lanekeeper:dev"}
  scheduler:
    quantumSeconds: 0.000001
    defaultWeight: 0.0001
    weights: [{tenant: acme, weight: 0.000001}]
    sweepIdleTenantsAfter: 30s
  promotion: {projectedWait: 10s}
  delivery: {deadLetters: {maxPerTenant: 0, maxAge: 1s}}
  tenants:
  - {tenant: vip, weight: 0, maxInFlight: 0, rateLimit: {perSecond: -1}}
"#,
    );
    for want in [
        "tenants[].weight must be at least 0.01 and at most 1000",
        "tenants[].maxInFlight must be between 1 and 1000",
        "rateLimits perSecond must be between 0 (unlimited) and 1000000",
        "promotion.projectedWait must be between 1m and 24h",
        "spec.scheduler.quantumSeconds",
        "scheduler.sweepIdleTenantsAfter must be 0s (never) or between 1m and 8760h",
        "scheduler.quantumSeconds must be at least 0.01",
        "scheduler.defaultWeight must be at least 0.01",
        "weight must be at least 0.01",
        "delivery.deadLetters.maxPerTenant must be between 1 and 10000000",
        "delivery.deadLetters.maxAge must be at least 1m",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }

    // One entry per tenant in spec.tenants (a list map keyed by tenant).
    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: twice}
spec:
  shards: 1
  redis: {url: "redis://redis:6379/0"}
  worker: {image: "lanekeeper:dev"}
  tenants: [{tenant: vip, weight: 2}, {tenant: vip, paused: true}]
"#,
    );
    assert!(
        err.contains("spec.tenants[1]") && err.contains("Duplicate value"),
        "{err}"
    );

    // Tenant ids in weights follow the one tenant rule (issue 24).
    for (name, tenant) in [
        ("spaced", "two words"),
        ("bidi", "evil\\u202egnp"),
        ("dash", "-x"),
    ] {
        let err = rejected(
            cp,
            &ns,
            &format!(
                r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: 1
  redis: {{url: "redis://redis:6379/0"}}
  worker: {{image: "lanekeeper:dev"}}
  scheduler: {{weights: [{{tenant: "{tenant}", weight: 2}}]}}
"#
            ),
        );
        assert!(
            err.contains("spec.scheduler.weights[0].tenant")
                && err.contains("^[A-Za-z0-9][A-Za-z0-9._:-]*$"),
            "{tenant:?}: {err}"
        );
    }

    // A drain timeout so short that every move aborts at once and records
    // an Event (issue 25: `1ns` made 2,695 Events a minute for one lane).
    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: storm}
spec:
  shards: 1
  redis: {url: "redis://redis:6379/0"}
  worker: {image: "lanekeeper:dev"}
  relocation: {drainTimeout: 1ns}
"#,
    );
    assert!(
        err.contains("spec.relocation.drainTimeout")
            && err.contains("relocation.drainTimeout must be at least 1s"),
        "{err}"
    );

    // A name that would make Deployment names too long for their labels.
    let err = rejected(
        cp,
        &ns,
        &format!(
            r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {}}}
spec:
  shards: 1
  redis: {{url: "redis://redis:6379/0"}}
  worker: {{image: "lanekeeper:dev"}}
"#,
            "x".repeat(53)
        ),
    );
    assert!(
        err.contains("metadata.name must be at most 52 characters"),
        "{err}"
    );
    // Nothing was stored.
    let list = cp.kubectl_ok(&["get", "-n", &ns, "shs", "-o", "name"]);
    assert_eq!(list.trim(), "", "{list}");
}

#[test]
fn invalid_dedicated_lane_is_rejected() {
    let cp = cluster();
    let ns = cp.namespace("badlane");
    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: DedicatedLane
metadata: {name: nobody}
spec: {shardSet: webhooks, tenant: ""}
"#,
    );
    assert!(
        err.contains("spec.tenant") && err.contains("tenant must not be empty"),
        "{err}"
    );

    let err = rejected(
        cp,
        &ns,
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: DedicatedLane
metadata: {name: spaces}
spec: {shardSet: webhooks, tenant: "two words"}
"#,
    );
    assert!(
        err.contains("tenant must start with a letter or digit"),
        "{err}"
    );

    // Tenant and shardSet are immutable once created.
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {name: whale}\nspec: {shardSet: webhooks, tenant: whale-1}\n",
    );
    let err = rejected(
        cp,
        &ns,
        "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {name: whale}\nspec: {shardSet: webhooks, tenant: whale-2}\n",
    );
    assert!(err.contains("tenant is immutable"), "{err}");

    // Names long enough that Events about the lane could not be named
    // (issue 25: `<name>.<16 hex>` must fit 253 characters).
    let err = rejected(
        cp,
        &ns,
        &format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {{name: {}}}\nspec: {{shardSet: webhooks, tenant: long}}\n",
            "l".repeat(231)
        ),
    );
    assert!(
        err.contains("metadata.name must be at most 230 characters"),
        "{err}"
    );
    // The longest name the promotion controller makes passes the rule.
    let longest = lanekeeper::controller::promotion::lane_name(&"s".repeat(52), &"T".repeat(300));
    assert!(longest.len() <= 230, "{} characters", longest.len());
}

#[tokio::test]
async fn typed_client_round_trips_both_kinds() {
    use kube::api::{Api, PostParams};
    use lanekeeper::crd::{DedicatedLane, DedicatedLaneSpec};
    let cp = cluster();
    let ns = cp.namespace("typed");
    let client = cp.client().await;
    let lanes: Api<DedicatedLane> = Api::namespaced(client, &ns);
    let lane = DedicatedLane::new(
        "typed",
        DedicatedLaneSpec {
            shard_set: "webhooks".into(),
            tenant: "tenant-a".into(),
            worker: None,
            retire: false,
        },
    );
    let created = lanes.create(&PostParams::default(), &lane).await.unwrap();
    assert_eq!(created.spec, lane.spec);
    let fetched = lanes.get("typed").await.unwrap();
    assert_eq!(fetched.spec.tenant, "tenant-a");
}

#[test]
fn redis_cluster_urls_pass_the_url_rules() {
    let cp = cluster();
    let ns = cp.namespace("cluster-url");
    let set = |name: &str, redis: &str| {
        format!(
            r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: 2
  redis: {redis}
  worker: {{image: "lanekeeper:dev"}}
"#
        )
    };
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &set(
            "seeds",
            r#"{url: "redis+cluster://redis-0.redis:6379,redis-1.redis:6379"}"#,
        ),
    );
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &set("flag", r#"{url: "rediss://redis:6379", cluster: true}"#),
    );
    let err = rejected(
        cp,
        &ns,
        &set("inline", r#"{url: "rediss+cluster://u:secret@a:1,b:2"}"#),
    );
    assert!(
        err.contains("redis.url must not carry credentials"),
        "{err}"
    );
    let err = rejected(cp, &ns, &set("http", r#"{url: "http+cluster://a:1"}"#));
    assert!(
        err.contains(
            "redis.url must start with redis://, rediss://, redis+cluster:// or rediss+cluster://"
        ),
        "{err}"
    );
}

#[test]
fn redis_tls_acl_and_durability_fields_are_checked_by_the_api_server() {
    let cp = cluster();
    let ns = cp.namespace("redis-fields");
    let set = |name: &str, redis: &str| {
        format!(
            r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: 2
  redis: {redis}
  worker: {{image: "lanekeeper:dev"}}
"#
        )
    };
    // Accepted: TLS with a CA and a client certificate, an ACL user with its
    // password, replicated durability; the defaults filled in.
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &set(
            "secure",
            r#"{urlSecretRef: {name: pw, key: url}, username: lanekeeper, passwordSecretRef: {name: pw, key: password},
                tls: {caSecretRef: {name: ca, key: ca.crt}, clientCertSecretRef: {name: client}}, durability: Replicated}"#,
        ),
    );
    let got = cp.kubectl_ok(&[
        "get",
        "-n",
        &ns,
        "shs",
        "secure",
        "-o",
        "jsonpath={.spec.redis}",
    ]);
    let v: serde_json::Value = serde_json::from_str(&got).unwrap();
    assert_eq!(v["durability"], "Replicated", "{v}");
    assert_eq!(v["replicaAckTimeout"], "1s", "{v}");
    cp.kubectl_stdin(
        &["apply", "-n", &ns, "-f", "-"],
        &set("plain", r#"{url: "redis://redis:6379"}"#),
    );
    let got = cp.kubectl_ok(&[
        "get",
        "-n",
        &ns,
        "shs",
        "plain",
        "-o",
        "jsonpath={.spec.redis.durability}",
    ]);
    assert_eq!(got, "Fast");

    let err = rejected(
        cp,
        &ns,
        &set(
            "nouser",
            r#"{url: "redis://redis:6379", username: lanekeeper}"#,
        ),
    );
    assert!(
        err.contains("redis.username needs redis.passwordSecretRef"),
        "{err}"
    );
    let err = rejected(
        cp,
        &ns,
        &set(
            "tlsplain",
            r#"{url: "redis://redis:6379", tls: {caSecretRef: {name: ca, key: ca.crt}}}"#,
        ),
    );
    assert!(
        err.contains("redis.tls needs a rediss:// or rediss+cluster:// url"),
        "{err}"
    );
    let err = rejected(
        cp,
        &ns,
        &set(
            "bad",
            r#"{url: "rediss://redis:6379", durability: Eventually}"#,
        ),
    );
    assert!(
        err.contains("spec.redis.durability") && err.contains("\"Fast\", \"Replicated\""),
        "{err}"
    );
    let err = rejected(
        cp,
        &ns,
        &set(
            "bad",
            r#"{url: "rediss://redis:6379", replicaAckTimeout: soon, username: "a b", passwordSecretRef: {name: pw, key: p}}"#,
        ),
    );
    for want in [
        "redis.replicaAckTimeout must be a duration such as 1s or 500ms",
        "redis.username must be non-empty, without spaces",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

/// A ShardSet of the given name with `spec_extra` (YAML lines, two-space
/// indented under `spec:`).
fn isolation_set(name: &str, spec_extra: &str) -> String {
    format!(
        r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {{name: {name}}}
spec:
  shards: 2
  redis: {{url: "redis://redis:6379/0"}}
  worker: {{image: "lanekeeper:dev"}}
{spec_extra}
"#
    )
}

/// Run kubectl; it must fail. Returns its stderr.
fn refused(cp: &ControlPlane, args: &[&str]) -> String {
    let out = cp.kubectl().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "the API server accepted kubectl {}",
        args.join(" ")
    );
    stderr
}

const ISOLATION_IMMUTABLE: &str = "isolation is immutable: Tenant and Endpoint lay out the queues differently; create a new ShardSet instead";

#[test]
fn isolation_is_checked_and_fixed_for_the_sets_life() {
    let cp = cluster();
    let ns = cp.namespace("isolation");
    let apply = |manifest: &str| cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], manifest);
    let get_isolation = |name: &str| {
        cp.kubectl_ok(&[
            "get",
            "-n",
            &ns,
            "shs",
            name,
            "-o",
            "jsonpath={.spec.isolation}",
        ])
    };

    // A value that is neither Tenant nor Endpoint, named with the field.
    let err = rejected(cp, &ns, &isolation_set("typo", "  isolation: PerEndpoint"));
    assert!(
        err.contains("spec.isolation") && err.contains(r#""Tenant", "Endpoint""#),
        "{err}"
    );

    // Created with Tenant: switching to Endpoint is refused, by apply and
    // by patch; other changes still go through.
    apply(&isolation_set("by-tenant", "  isolation: Tenant"));
    let err = rejected(
        cp,
        &ns,
        &isolation_set("by-tenant", "  isolation: Endpoint"),
    );
    assert!(
        err.contains("spec.isolation") && err.contains(ISOLATION_IMMUTABLE),
        "{err}"
    );
    let err = refused(
        cp,
        &[
            "patch",
            "-n",
            &ns,
            "shs",
            "by-tenant",
            "--type=merge",
            "-p",
            r#"{"spec":{"isolation":"Endpoint"}}"#,
        ],
    );
    assert!(err.contains(ISOLATION_IMMUTABLE), "{err}");
    apply(&isolation_set(
        "by-tenant",
        "  isolation: Tenant\n  scheduler: {maxInFlightPerTenant: 4}",
    ));
    assert_eq!(get_isolation("by-tenant"), "Tenant");

    // Created without the field (Tenant by default): adding Endpoint is
    // refused; adding Tenant, the value in force, is not a change.
    apply(&isolation_set("unset", ""));
    let err = rejected(cp, &ns, &isolation_set("unset", "  isolation: Endpoint"));
    assert!(err.contains(ISOLATION_IMMUTABLE), "{err}");
    apply(&isolation_set("unset", "  isolation: Tenant"));
    assert_eq!(get_isolation("unset"), "Tenant");

    // Created with Endpoint: removing the field (which would make it
    // Tenant) is refused, by apply and by a JSON patch; so is Tenant.
    apply(&isolation_set(
        "by-endpoint",
        "  isolation: Endpoint\n  scheduler: {maxInFlightPerEndpoint: 2}",
    ));
    assert_eq!(get_isolation("by-endpoint"), "Endpoint");
    let err = rejected(cp, &ns, &isolation_set("by-endpoint", ""));
    assert!(
        err.contains("spec.isolation") && err.contains(ISOLATION_IMMUTABLE),
        "{err}"
    );
    let err = refused(
        cp,
        &[
            "patch",
            "-n",
            &ns,
            "shs",
            "by-endpoint",
            "--type=json",
            "-p",
            r#"[{"op":"remove","path":"/spec/isolation"},{"op":"remove","path":"/spec/scheduler/maxInFlightPerEndpoint"}]"#,
        ],
    );
    assert!(err.contains(ISOLATION_IMMUTABLE), "{err}");
    let err = refused(
        cp,
        &[
            "patch",
            "-n",
            &ns,
            "shs",
            "by-endpoint",
            "--type=merge",
            "-p",
            r#"{"spec":{"isolation":"Tenant","scheduler":{"maxInFlightPerEndpoint":null}}}"#,
        ],
    );
    assert!(err.contains(ISOLATION_IMMUTABLE), "{err}");
    // Its endpoint cap may change; the isolation stays.
    apply(&isolation_set(
        "by-endpoint",
        "  isolation: Endpoint\n  scheduler: {maxInFlightPerEndpoint: 5}",
    ));
    let json = cp.kubectl_ok(&["get", "-n", &ns, "shs", "by-endpoint", "-o", "json"]);
    let obj: lanekeeper::crd::ShardSet = serde_json::from_str(&json).unwrap();
    assert_eq!(obj.spec.isolation, lanekeeper::crd::Isolation::Endpoint);
    assert_eq!(obj.spec.scheduler.max_in_flight_per_endpoint, Some(5));
    let p = lanekeeper::policy::QueuePolicy::from_spec(&obj.spec);
    assert_eq!(p.isolation, lanekeeper::policy::Isolation::Endpoint);
    assert_eq!(p.max_in_flight_per_endpoint, Some(5));

    // Deleting the set and creating it anew with the other isolation is
    // the way to change it.
    cp.kubectl_ok(&["delete", "-n", &ns, "shs", "by-tenant", "--wait=true"]);
    apply(&isolation_set("by-tenant", "  isolation: Endpoint"));
    assert_eq!(get_isolation("by-tenant"), "Endpoint");
}

#[test]
fn max_in_flight_per_endpoint_is_checked_by_the_api_server() {
    let cp = cluster();
    let ns = cp.namespace("endpoint-cap");
    for (name, cap) in [("zero", "0"), ("huge", "10001")] {
        let err = rejected(
            cp,
            &ns,
            &isolation_set(
                name,
                &format!("  isolation: Endpoint\n  scheduler: {{maxInFlightPerEndpoint: {cap}}}"),
            ),
        );
        assert!(
            err.contains("spec.scheduler.maxInFlightPerEndpoint")
                && err.contains("scheduler.maxInFlightPerEndpoint must be between 1 and 10000"),
            "{cap}: {err}"
        );
    }
    // Without Endpoint isolation, absent or Tenant, it has no meaning.
    for (name, isolation) in [("absent", ""), ("tenant", "  isolation: Tenant\n")] {
        let err = rejected(
            cp,
            &ns,
            &isolation_set(
                name,
                &format!("{isolation}  scheduler: {{maxInFlightPerEndpoint: 2}}"),
            ),
        );
        assert!(
            err.contains("spec.scheduler.maxInFlightPerEndpoint")
                && err.contains(
                    "scheduler.maxInFlightPerEndpoint needs isolation: Endpoint (under Tenant isolation a tenant has one cap, scheduler.maxInFlightPerTenant)"
                ),
            "{name}: {err}"
        );
    }
    let list = cp.kubectl_ok(&["get", "-n", &ns, "shs", "-o", "name"]);
    assert_eq!(list.trim(), "", "{list}");
    // The bounds themselves are accepted.
    for (name, cap) in [("one", "1"), ("most", "10000")] {
        cp.kubectl_stdin(
            &["apply", "-n", &ns, "-f", "-"],
            &isolation_set(
                name,
                &format!("  isolation: Endpoint\n  scheduler: {{maxInFlightPerEndpoint: {cap}}}"),
            ),
        );
    }
}
