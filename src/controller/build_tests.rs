//! Tests of the pure builders in `build.rs`.

use super::*;

fn set(yaml: &str) -> ShardSet {
    let mut s: ShardSet = serde_yaml::from_str(yaml).unwrap();
    s.metadata.namespace = Some("prod".into());
    s.metadata.uid = Some("uid-1".into());
    s
}

const FIXTURE: &str = r#"
apiVersion: lanekeeper.io/v1alpha1
kind: ShardSet
metadata: {name: webhooks}
spec:
  shards: 3
  redis:
    urlSecretRef: {name: redis, key: url}
  worker:
    image: lanekeeper:1.2.3
    replicas: 2
    concurrency: 24
"#;

#[test]
fn one_deployment_per_shard_with_labels_owner_and_args() {
    let ds = shard_deployments(&set(FIXTURE)).unwrap();
    let names: Vec<_> = ds
        .iter()
        .map(|d| d.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "webhooks-shard-00",
            "webhooks-shard-01",
            "webhooks-shard-02"
        ]
    );
    let d = &ds[1];
    let labels = d.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["app.kubernetes.io/name"], "lanekeeper");
    assert_eq!(labels["app.kubernetes.io/instance"], "webhooks");
    assert_eq!(labels["app.kubernetes.io/component"], "shard");
    assert_eq!(
        labels["app.kubernetes.io/managed-by"],
        "lanekeeper-controller"
    );
    assert_eq!(labels["lanekeeper.io/queue"], "shard-01");
    let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("ShardSet", "webhooks", Some(true))
    );
    assert_eq!(owner.block_owner_deletion, Some(true));
    assert!(owned_by(
        d.metadata.owner_references.as_deref().unwrap(),
        Some(owner.uid.as_str())
    ));
    // Carrying the set's labels is not enough to be pruned as its own.
    assert!(!owned_by(
        d.metadata.owner_references.as_deref().unwrap(),
        Some("another-uid")
    ));
    assert!(!owned_by(&[], Some(owner.uid.as_str())));
    assert!(!owned_by(
        d.metadata.owner_references.as_deref().unwrap(),
        None
    ));
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    let c = &spec.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(c.image.as_deref(), Some("lanekeeper:1.2.3"));
    assert_eq!(c.args.as_deref(), Some(&["worker".to_string()][..]));
    let env = c.env.as_ref().unwrap();
    let get = |n: &str| env.iter().find(|e| e.name == n).unwrap();
    assert_eq!(get("LANEKEEPER_QUEUE").value.as_deref(), Some("shard-01"));
    assert_eq!(
        get("LANEKEEPER_SHARD_SET").value.as_deref(),
        Some("prod/webhooks")
    );
    assert_eq!(get("LANEKEEPER_CONCURRENCY").value.as_deref(), Some("24"));
    // The Redis URL is referenced from its Secret, never copied.
    let url = get("LANEKEEPER_REDIS_URL");
    assert!(url.value.is_none());
    assert_eq!(
        url.value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap()
            .name,
        "redis"
    );
}

#[test]
fn hardened_security_context() {
    let d = &shard_deployments(&set(FIXTURE)).unwrap()[0];
    let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    let sc = pod.containers[0].security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
}

#[test]
fn a_cluster_set_tells_its_workers_so() {
    let env_of = |yaml: &str| {
        let d = &shard_deployments(&set(yaml)).unwrap()[0];
        let c = &d
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0];
        c.env.clone().unwrap()
    };
    let flag = |env: &[EnvVar]| {
        env.iter()
            .find(|e| e.name == "LANEKEEPER_REDIS_CLUSTER")
            .and_then(|e| e.value.clone())
    };
    assert_eq!(flag(&env_of(FIXTURE)), None);
    let yaml = FIXTURE.replace(
        "urlSecretRef: {name: redis, key: url}",
        "urlSecretRef: {name: redis, key: url}\n    cluster: true",
    );
    assert_eq!(flag(&env_of(&yaml)).as_deref(), Some("true"));
}

#[test]
fn autoscaled_sets_leave_replicas_alone() {
    let yaml = FIXTURE.replace("replicas: 2", "autoscaled: true");
    let d = &shard_deployments(&set(&yaml)).unwrap()[0];
    assert_eq!(d.spec.as_ref().unwrap().replicas, None);
    assert!(!serde_json::to_string(d).unwrap().contains("\"replicas\""));
}

#[test]
fn lane_deployment_runs_the_lane_queue_with_overrides() {
    let mut s = set(FIXTURE);
    s.spec.promotion.lane_worker = Some(WorkerOverrides {
        concurrency: Some(64),
        ..Default::default()
    });
    let lane: DedicatedLane = serde_yaml::from_str(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {name: webhooks-acme}\nspec: {shardSet: webhooks, tenant: acme, worker: {replicas: 3}}\n",
        )
        .unwrap();
    let d = lane_deployment(&s, &lane, 5).unwrap();
    assert_eq!(d.metadata.name.as_deref(), Some("webhooks-lane-5"));
    let labels = d.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["app.kubernetes.io/component"], "lane");
    assert_eq!(labels["lanekeeper.io/queue"], "lane-5");
    let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("ShardSet", "webhooks")
    );
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(3));
    let env = spec.template.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    let get = |n: &str| env.iter().find(|e| e.name == n).unwrap().value.clone();
    assert_eq!(get("LANEKEEPER_QUEUE").as_deref(), Some("lane-5"));
    assert_eq!(get("LANEKEEPER_CONCURRENCY").as_deref(), Some("64"));
    // Not a shard: the shard prune never sees it.
    assert!(lane_selector("webhooks").contains("app.kubernetes.io/component=lane"));
    assert!(!shard_selector("webhooks").contains("component=lane"));
    assert_eq!(
        lane_deployment(&s, &lane, 8).unwrap_err(),
        BuildError::LaneIndex(8)
    );
}

#[test]
fn redis_tls_and_acl_user_reach_the_workers_by_reference() {
    let mut s = set(FIXTURE);
    s.spec.redis.url = Some("rediss://redis.svc:6380/0".into());
    s.spec.redis.username = Some("lanekeeper".into());
    s.spec.redis.password_secret_ref = Some(SecretKeyRef {
        name: "redis-pw".into(),
        key: "password".into(),
    });
    s.spec.redis.tls = Some(crate::crd::RedisTlsSpec {
        ca_secret_ref: Some(SecretKeyRef {
            name: "redis-ca".into(),
            key: "bundle.pem".into(),
        }),
        client_cert_secret_ref: Some(crate::crd::SecretNameRef {
            name: "redis-client".into(),
        }),
    });
    let d = &shard_deployments(&s).unwrap()[0];
    let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let env = c.env.clone().unwrap();
    let get = |n: &str| {
        env.iter()
            .find(|e| e.name == n)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(
        get("LANEKEEPER_REDIS_USERNAME").as_deref(),
        Some("lanekeeper")
    );
    assert_eq!(
        get("LANEKEEPER_REDIS_CA_FILE").as_deref(),
        Some("/etc/lanekeeper/redis-tls/ca/ca.crt")
    );
    assert_eq!(
        get("LANEKEEPER_REDIS_CLIENT_KEY_FILE").as_deref(),
        Some("/etc/lanekeeper/redis-tls/client/tls.key")
    );
    let vols = pod.volumes.clone().unwrap();
    let ca = vols.iter().find(|v| v.name == "redis-tls-ca").unwrap();
    let src = ca.secret.as_ref().unwrap();
    assert_eq!(src.secret_name.as_deref(), Some("redis-ca"));
    let items = src.items.as_ref().unwrap();
    assert_eq!(
        (items[0].key.as_str(), items[0].path.as_str()),
        ("bundle.pem", "ca.crt")
    );
    let client = vols.iter().find(|v| v.name == "redis-tls-client").unwrap();
    assert_eq!(
        client.secret.as_ref().unwrap().secret_name.as_deref(),
        Some("redis-client")
    );
    let mounts = c.volume_mounts.clone().unwrap();
    assert!(mounts.iter().any(|m| m.name == "redis-tls-ca"
        && m.mount_path == "/etc/lanekeeper/redis-tls/ca"
        && m.read_only == Some(true)));
    assert!(mounts.iter().any(
        |m| m.name == "redis-tls-client" && m.mount_path == "/etc/lanekeeper/redis-tls/client"
    ));
    // No key material in the Deployment itself.
    let yaml = serde_yaml::to_string(d).unwrap();
    assert!(!yaml.contains("BEGIN"), "{yaml}");
    // Without tls, nothing is mounted beyond /tmp.
    let plain = &shard_deployments(&set(FIXTURE)).unwrap()[0];
    let pod = plain.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.volumes.as_ref().unwrap().len(), 1);
}

#[test]
fn incomplete_objects_are_an_error() {
    let mut s = set(FIXTURE);
    s.metadata.uid = None;
    assert_eq!(shard_deployments(&s).unwrap_err(), BuildError::Incomplete);
}

fn worker_set(worker_yaml: &str) -> ShardSet {
    set(&format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: w}}\nspec:\n  shards: 1\n  redis: {{url: \"redis://r:6379\"}}\n  worker: {worker_yaml}\n"
        ))
}

fn refused(worker_yaml: &str, policy: &WorkerPolicy) -> PolicyViolation {
    enforce_worker_policy(&worker_set(worker_yaml), policy).unwrap_err()
}

#[test]
fn workers_mount_no_api_token_and_run_as_the_operators_account() {
    let policy = WorkerPolicy {
        service_account: Some("lanekeeper-worker".into()),
        ..Default::default()
    };
    let s = enforce_worker_policy(&worker_set("{image: lk:1}"), &policy).unwrap();
    let d = &shard_deployments(&s).unwrap()[0];
    let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("lanekeeper-worker")
    );
    // Without a default: the namespace's default account, no token either.
    let s = enforce_worker_policy(&worker_set("{image: lk:1}"), &Default::default()).unwrap();
    let pod = shard_deployments(&s).unwrap()[0]
        .spec
        .clone()
        .unwrap()
        .template
        .spec
        .unwrap();
    assert_eq!(pod.service_account_name, None);
    assert_eq!(pod.automount_service_account_token, Some(false));
}

#[test]
fn a_service_account_the_operator_did_not_allow_is_refused() {
    let v = refused(
        "{image: lk:1, serviceAccountName: cluster-admin-sa}",
        &Default::default(),
    );
    assert_eq!(v.field, "spec.worker.serviceAccountName");
    assert_eq!(v.reason, "ServiceAccountNotAllowed");
    assert!(v.to_string().contains("cluster-admin-sa"), "{v}");
    let policy = WorkerPolicy {
        allowed_service_accounts: vec!["hooks-worker".into()],
        ..Default::default()
    };
    let s = enforce_worker_policy(
        &worker_set("{image: lk:1, serviceAccountName: hooks-worker}"),
        &policy,
    )
    .unwrap();
    assert_eq!(
        s.spec.worker.service_account_name.as_deref(),
        Some("hooks-worker")
    );
    assert!(enforce_worker_policy(
        &worker_set("{image: lk:1, serviceAccountName: other}"),
        &policy
    )
    .is_err());
}

#[test]
fn secrets_priority_classes_images_and_tolerations_are_the_operators_to_allow() {
    let none = WorkerPolicy::default();
    let v = refused(
            "{image: lk:1, env: [{name: TOKEN, valueFrom: {secretKeyRef: {name: prod-db, key: password}}}]}",
            &none,
        );
    assert_eq!(v.field, "spec.worker.env[0].valueFrom.secretKeyRef.name");
    assert_eq!(v.reason, "SecretNotAllowed");
    let v = refused(
        "{image: lk:1, priorityClassName: system-node-critical}",
        &none,
    );
    assert_eq!(v.field, "spec.worker.priorityClassName");
    let v = refused("{image: lk:1, tolerations: [{operator: Exists}]}", &none);
    assert_eq!(v.field, "spec.worker.tolerations[0]");
    assert_eq!(v.reason, "TolerationNotAllowed");
    let allowing = WorkerPolicy {
        allowed_env_secrets: vec!["hooks-signing".into()],
        allowed_priority_classes: vec!["webhooks".into()],
        allowed_image_prefixes: vec!["ghcr.io/acme/lanekeeper".into(), "registry.acme/".into()],
        allowed_toleration_keys: vec!["dedicated".into()],
        ..Default::default()
    };
    let ok = worker_set(
        "{image: 'ghcr.io/acme/lanekeeper:1.2', priorityClassName: webhooks, \
             tolerations: [{key: dedicated, operator: Exists}], \
             env: [{name: KEY, valueFrom: {secretKeyRef: {name: hooks-signing, key: k}}}]}",
    );
    enforce_worker_policy(&ok, &allowing).unwrap();
    for image in ["registry.acme/x/y:1", "ghcr.io/acme/lanekeeper@sha256:00"] {
        enforce_worker_policy(&worker_set(&format!("{{image: '{image}'}}")), &allowing).unwrap();
    }
    for image in ["ghcr.io/acme/lanekeeper-evil:1", "docker.io/evil:1"] {
        let v = refused(&format!("{{image: '{image}'}}"), &allowing);
        assert_eq!(
            (v.field.as_str(), v.reason),
            ("spec.worker.image", "ImageNotAllowed")
        );
    }
    // A toleration of every taint needs `*`, not just some keys.
    let v = refused(
        "{image: 'registry.acme/a:1', tolerations: [{operator: Exists}]}",
        &allowing,
    );
    assert_eq!(v.field, "spec.worker.tolerations[0]");
    let any = WorkerPolicy {
        allowed_toleration_keys: vec!["*".into()],
        ..Default::default()
    };
    enforce_worker_policy(
        &worker_set("{image: a, tolerations: [{operator: Exists}]}"),
        &any,
    )
    .unwrap();
}

#[test]
fn env_the_controller_sets_or_that_switches_off_safeguards_is_refused() {
    let none = WorkerPolicy::default();
    for name in [
        "LANEKEEPER_ALLOW_CIDRS",
        "LANEKEEPER_QUEUE",
        "lanekeeper_proxy",
        "POD_NAME",
    ] {
        let v = refused(
            &format!("{{image: a, env: [{{name: {name}, value: x}}]}}"),
            &none,
        );
        assert_eq!(
            (v.field.as_str(), v.reason),
            ("spec.worker.env[0].name", "EnvNotAllowed"),
            "{name}"
        );
    }
    for name in ["HTTP_PROXY", "https_proxy", "No_Proxy", "ALL_PROXY"] {
        let v = refused(
            &format!("{{image: a, env: [{{name: OK, value: x}}, {{name: {name}, value: x}}]}}"),
            &none,
        );
        assert_eq!(v.field, "spec.worker.env[1].name", "{name}");
    }
    let proxies = WorkerPolicy {
        allow_proxy_env: true,
        worker_allow_cidrs: vec!["10.0.0.0/8".into()],
        ..Default::default()
    };
    let s = enforce_worker_policy(
        &worker_set("{image: a, env: [{name: HTTPS_PROXY, value: 'http://proxy:3128'}]}"),
        &proxies,
    )
    .unwrap();
    // The operator's CIDRs reach the workers; the author cannot set them.
    let env = shard_deployments(&s).unwrap()[0]
        .spec
        .clone()
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers[0]
        .env
        .clone()
        .unwrap();
    assert!(env
        .iter()
        .any(|e| e.name == "LANEKEEPER_ALLOW_CIDRS" && e.value.as_deref() == Some("10.0.0.0/8")));
}

#[test]
fn a_password_goes_only_to_the_url_stored_with_it() {
    let key = |name: &str, key: &str| SecretKeyRef {
        name: name.into(),
        key: key.into(),
    };
    let mut r = crate::crd::RedisSpec {
        url: Some("redis://attacker:6379".into()),
        password_secret_ref: Some(key("team-redis", "password")),
        ..Default::default()
    };
    let v = check_redis_credentials(&r).unwrap_err();
    assert_eq!(
        (v.field.as_str(), v.reason),
        ("spec.redis.passwordSecretRef", "PasswordNotWithURL")
    );
    r.url = None;
    r.url_secret_ref = Some(key("mine", "url"));
    assert!(check_redis_credentials(&r).is_err());
    r.url_secret_ref = Some(key("team-redis", "url"));
    check_redis_credentials(&r).unwrap();
    r.password_secret_ref = None;
    check_redis_credentials(&r).unwrap();
}

#[test]
fn a_shard_set_can_set_no_name_of_the_workers_env_contract() {
    for name in worker_env::ALL {
        assert!(
            name.starts_with(worker_env::PREFIX) || name == worker_env::POD_NAME,
            "{name} is outside what the CRD refuses"
        );
        assert!(
            controller_env_name(name),
            "{name} is not refused in a worker template"
        );
    }
}

#[test]
fn the_crd_refuses_the_prefix_and_pod_name_in_worker_env() {
    let yaml = crate::crd::all_yaml().unwrap();
    let rule = format!(
        "!e.name.startsWith('{}') && e.name != '{}'",
        worker_env::PREFIX,
        worker_env::POD_NAME
    );
    assert!(yaml.contains(&rule), "no CEL rule {rule:?} in the CRDs");
}
