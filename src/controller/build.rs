//! Pure functions from a ShardSet to the objects it wants: spec in,
//! Deployments out, no client.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretKeySelector,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;

use crate::crd::conditions;
use crate::crd::{DedicatedLane, SecretKeyRef, ShardSet, WorkerOverrides, WorkerTemplate};
use crate::routing::QueueId;
use crate::worker::env as worker_env;

/// The field manager of every object and status the controller writes.
pub const FIELD_MANAGER: &str = "lanekeeper-controller";
pub const APP: &str = "lanekeeper";
pub const METRICS_PORT: i32 = 9090;

/// Why a ShardSet cannot be built into objects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    #[error("the ShardSet has no name, namespace or uid (not read from the API server?)")]
    Incomplete,
    #[error("spec.shards {0} is out of range 1..=1024")]
    Shards(i32),
    #[error("lane index {0} is out of range 0..=7")]
    LaneIndex(u8),
}

/// What the operator (controller flags, chart values) lets a ShardSet's
/// worker template ask for. A ShardSet author can edit ShardSets, not pods:
/// without these limits a ShardSet would be a way to run any pod in the
/// namespace. Empty lists allow nothing, except `allowed_image_prefixes`,
/// where empty allows any image.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerPolicy {
    /// The ServiceAccount workers run as when the set names none (`None`:
    /// the namespace's `default`).
    pub service_account: Option<String>,
    /// ServiceAccounts a set may name in `worker.serviceAccountName`.
    pub allowed_service_accounts: Vec<String>,
    /// Secrets `worker.env[].valueFrom.secretKeyRef` may name.
    pub allowed_env_secrets: Vec<String>,
    /// PriorityClasses `worker.priorityClassName` may name.
    pub allowed_priority_classes: Vec<String>,
    /// Image prefixes `worker.image` must start with (at a `/`, `:` or `@`
    /// boundary); empty or `*`: any image.
    pub allowed_image_prefixes: Vec<String>,
    /// Taint keys `worker.tolerations` may tolerate; `*`: any toleration,
    /// including one of every taint (empty key).
    pub allowed_toleration_keys: Vec<String>,
    /// Whether `worker.env` may set the proxy variables (HTTP_PROXY,
    /// HTTPS_PROXY, NO_PROXY, ALL_PROXY in any case).
    pub allow_proxy_env: bool,
    /// Non-global CIDRs workers may deliver to (their `LANEKEEPER_ALLOW_CIDRS`,
    /// which only the operator sets).
    pub worker_allow_cidrs: Vec<String>,
}

/// A worker template asks for more than the operator's [`WorkerPolicy`] allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PolicyViolation {
    /// The ShardSet field, e.g. `spec.worker.serviceAccountName`.
    pub field: String,
    /// The condition reason, e.g. `ServiceAccountNotAllowed`.
    pub reason: &'static str,
    pub message: String,
}

/// Environment variable names the controller sets on workers itself.
pub fn controller_env_name(name: &str) -> bool {
    name.to_ascii_uppercase().starts_with(worker_env::PREFIX) || name == worker_env::POD_NAME
}

/// Environment variable names that route deliveries through a proxy.
pub fn proxy_env_name(name: &str) -> bool {
    matches!(
        name.to_ascii_uppercase().as_str(),
        "HTTP_PROXY" | "HTTPS_PROXY" | "NO_PROXY" | "ALL_PROXY"
    )
}

fn image_allowed(image: &str, prefixes: &[String]) -> bool {
    prefixes.is_empty()
        || prefixes.iter().any(|p| {
            p == "*"
                || image == p
                || (image.starts_with(p.as_str())
                    && (p.ends_with(['/', ':', '@']) || image[p.len()..].starts_with([':', '@'])))
        })
}

/// Check a ShardSet's worker template against the operator's policy and
/// return the set as the builders should see it: the default ServiceAccount
/// filled in, and the operator's `LANEKEEPER_ALLOW_CIDRS` added. Pure.
pub fn enforce_worker_policy(
    set: &ShardSet,
    policy: &WorkerPolicy,
) -> Result<ShardSet, PolicyViolation> {
    let w = &set.spec.worker;
    let refuse = |field: String, reason: &'static str, message: String| PolicyViolation {
        field,
        reason,
        message,
    };
    let listed = |list: &[String], v: &str| list.iter().any(|x| x == v);
    if let Some(sa) = &w.service_account_name {
        if !listed(&policy.allowed_service_accounts, sa)
            && policy.service_account.as_deref() != Some(sa.as_str())
        {
            return Err(refuse(
                "spec.worker.serviceAccountName".into(),
                conditions::SERVICE_ACCOUNT_NOT_ALLOWED,
                format!("ServiceAccount {sa:?} is not one the operator allows workers to run as (controller flag --allow-worker-service-account)"),
            ));
        }
    }
    if !image_allowed(&w.image, &policy.allowed_image_prefixes) {
        return Err(refuse(
            "spec.worker.image".into(),
            conditions::IMAGE_NOT_ALLOWED,
            format!(
                "image {:?} does not start with an allowed prefix ({}; controller flag --allow-worker-image)",
                w.image,
                policy.allowed_image_prefixes.join(", ")
            ),
        ));
    }
    if let Some(pc) = &w.priority_class_name {
        if !listed(&policy.allowed_priority_classes, pc) {
            return Err(refuse(
                "spec.worker.priorityClassName".into(),
                conditions::PRIORITY_CLASS_NOT_ALLOWED,
                format!("PriorityClass {pc:?} is not one the operator allows (controller flag --allow-worker-priority-class)"),
            ));
        }
    }
    let any_toleration = listed(&policy.allowed_toleration_keys, "*");
    for (i, t) in w.tolerations.iter().enumerate() {
        let key = t.key.clone().unwrap_or_default();
        if !any_toleration && (key.is_empty() || !listed(&policy.allowed_toleration_keys, &key)) {
            return Err(refuse(
                format!("spec.worker.tolerations[{i}]"),
                conditions::TOLERATION_NOT_ALLOWED,
                if key.is_empty() {
                    "a toleration without a key tolerates every taint; the operator does not allow it (controller flag --allow-worker-toleration=*)".to_string()
                } else {
                    format!("taint key {key:?} is not one the operator allows workers to tolerate (controller flag --allow-worker-toleration)")
                },
            ));
        }
    }
    for (i, e) in w.env.iter().enumerate() {
        if controller_env_name(&e.name) {
            return Err(refuse(
                format!("spec.worker.env[{i}].name"),
                conditions::ENV_NOT_ALLOWED,
                format!(
                    "{:?} is set by the controller (LANEKEEPER_* and POD_NAME)",
                    e.name
                ),
            ));
        }
        if proxy_env_name(&e.name) && !policy.allow_proxy_env {
            return Err(refuse(
                format!("spec.worker.env[{i}].name"),
                conditions::ENV_NOT_ALLOWED,
                format!("{:?} would route deliveries through a proxy past the SSRF guard; the operator does not allow it (controller flag --allow-worker-proxy-env)", e.name),
            ));
        }
        let source = e.value_from.as_ref();
        if let Some(r) = source.and_then(|s| s.secret_key_ref.as_ref()) {
            if !listed(&policy.allowed_env_secrets, &r.name) {
                return Err(refuse(
                    format!("spec.worker.env[{i}].valueFrom.secretKeyRef.name"),
                    conditions::SECRET_NOT_ALLOWED,
                    format!("Secret {:?} is not one the operator allows workers to read (controller flag --allow-worker-secret)", r.name),
                ));
            }
        }
    }
    let mut effective = set.clone();
    let w = &mut effective.spec.worker;
    if w.service_account_name.is_none() {
        w.service_account_name = policy.service_account.clone();
    }
    if !policy.worker_allow_cidrs.is_empty() {
        w.env.push(plain_env(
            worker_env::ALLOW_CIDRS,
            policy.worker_allow_cidrs.join(","),
        ));
    }
    Ok(effective)
}

/// A password from a Secret goes only to the URL stored with it: with
/// `passwordSecretRef`, `urlSecretRef` must name the same Secret. Otherwise
/// a ShardSet author could send the team's password to a server she picks
/// (`url` pointing at her own listener). Pure; CEL says the same.
pub fn check_redis_credentials(redis: &crate::crd::RedisSpec) -> Result<(), PolicyViolation> {
    let Some(pw) = &redis.password_secret_ref else {
        return Ok(());
    };
    match &redis.url_secret_ref {
        Some(u) if u.name == pw.name => Ok(()),
        Some(u) => Err(PolicyViolation {
            field: "spec.redis.passwordSecretRef".into(),
            reason: conditions::PASSWORD_NOT_WITH_URL,
            message: format!(
                "the password in Secret {:?} may only go to the URL stored with it, but spec.redis.urlSecretRef names Secret {:?}; name the same Secret in both",
                pw.name, u.name
            ),
        }),
        None => Err(PolicyViolation {
            field: "spec.redis.passwordSecretRef".into(),
            reason: conditions::PASSWORD_NOT_WITH_URL,
            message: format!(
                "the password in Secret {:?} may only go to the URL stored with it: use spec.redis.urlSecretRef naming the same Secret instead of spec.redis.url",
                pw.name
            ),
        }),
    }
}

/// `<set>-shard-07` / `<set>-lane-3`.
pub fn deployment_name(set: &str, q: QueueId) -> String {
    format!("{set}-{q}")
}

/// Labels on every object of a set; `component` is `shard` or `lane`.
pub fn labels(set: &str, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), APP.to_string()),
        ("app.kubernetes.io/instance".to_string(), set.to_string()),
        (
            "app.kubernetes.io/component".to_string(),
            component.to_string(),
        ),
        (
            "app.kubernetes.io/managed-by".to_string(),
            FIELD_MANAGER.to_string(),
        ),
    ])
}

/// The label selector that finds a set's shard Deployments.
pub fn shard_selector(set: &str) -> String {
    labels(set, "shard")
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// One worker Deployment per shard, named `<set>-shard-NN`.
pub fn shard_deployments(set: &ShardSet) -> Result<Vec<Deployment>, BuildError> {
    shard_deployments_upto(set, 0)
}

/// The shard Deployments of `set`, for at least `keep` shards: during a
/// reshard the shards beyond `spec.shards` stay until everyone has left them.
/// A digest of the object the controller would apply: equal digests mean
/// an apply would send the same request. Pure.
pub fn digest(d: &Deployment) -> [u8; 32] {
    use sha2::Digest;
    let bytes = serde_json::to_vec(d).expect("a Deployment serializes");
    sha2::Sha256::digest(bytes).into()
}

pub fn shard_deployments_upto(set: &ShardSet, keep: u16) -> Result<Vec<Deployment>, BuildError> {
    let shards = set.spec.shards;
    if !(1..=1024).contains(&shards) {
        return Err(BuildError::Shards(shards));
    }
    (0..(shards as u16).max(keep))
        .map(|n| worker_deployment(set, QueueId::Shard(n), "shard", &set.spec.worker))
        .collect()
}

/// The shard a set's shard Deployment serves, from its queue label.
pub fn shard_of(d: &Deployment) -> Option<u16> {
    match d
        .metadata
        .labels
        .as_ref()?
        .get("lanekeeper.io/queue")?
        .parse()
    {
        Ok(QueueId::Shard(n)) => Some(n),
        _ => None,
    }
}

/// The label selector that finds a set's lane Deployments.
pub fn lane_selector(set: &str) -> String {
    labels(set, "lane")
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The worker template of a lane: the set's `worker`, then the set's
/// `promotion.laneWorker`, then the lane's own `worker`; unset fields inherit.
pub fn lane_worker(set: &ShardSet, lane: &DedicatedLane) -> WorkerTemplate {
    let mut w = set.spec.worker.clone();
    let apply = |w: &mut WorkerTemplate, o: &WorkerOverrides| {
        if let Some(r) = o.replicas {
            w.replicas = Some(r);
            w.autoscaled = false;
        }
        if let Some(c) = o.concurrency {
            w.concurrency = c;
        }
        if let Some(r) = &o.resources {
            w.resources = Some(r.clone());
        }
        if let Some(n) = &o.node_selector {
            w.node_selector = n.clone();
        }
    };
    if let Some(o) = &set.spec.promotion.lane_worker {
        apply(&mut w, o);
    }
    if let Some(o) = &lane.spec.worker {
        apply(&mut w, o);
    }
    w
}

/// The worker Deployment of lane `index`, `<set>-lane-<index>`, running
/// `worker --queue lane-<index>`; owned by the set like the shards.
pub fn lane_deployment(
    set: &ShardSet,
    lane: &DedicatedLane,
    index: u8,
) -> Result<Deployment, BuildError> {
    if i32::from(index) >= crate::crd::MAX_LANES {
        return Err(BuildError::LaneIndex(index));
    }
    worker_deployment(set, QueueId::Lane(index), "lane", &lane_worker(set, lane))
}

/// The set as controller owner, with `blockOwnerDeletion`: a foreground
/// deletion of the set waits for its Deployments to go.
fn owner(set: &ShardSet) -> Result<OwnerReference, BuildError> {
    let mut o = set
        .controller_owner_ref(&())
        .ok_or(BuildError::Incomplete)?;
    o.block_owner_deletion = Some(true);
    Ok(o)
}

/// Does the object with these owner references belong to the owner with
/// `uid`? (Labels say which set a Deployment is for; only the owner
/// reference says the set made it: nothing else is pruned.)
pub fn owned_by(owners: &[OwnerReference], uid: Option<&str>) -> bool {
    uid.is_some_and(|uid| owners.iter().any(|o| o.uid == uid))
}

fn secret_env(name: &str, r: &SecretKeyRef) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: r.name.clone(),
                key: r.key.clone(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn plain_env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// Where a worker finds the Redis CA and client certificate of `spec.redis.tls`.
pub const REDIS_TLS_DIR: &str = "/etc/lanekeeper/redis-tls";

/// The Secret volumes, mounts and environment that give a worker the TLS
/// material of `spec.redis.tls`: the Secrets are mounted by reference
/// (read-only), never copied into the Deployment.
fn redis_tls_files(
    tls: Option<&crate::crd::RedisTlsSpec>,
) -> (Vec<Volume>, Vec<VolumeMount>, Vec<EnvVar>) {
    use k8s_openapi::api::core::v1::{KeyToPath, SecretVolumeSource};
    let (mut volumes, mut mounts, mut env) = (Vec::new(), Vec::new(), Vec::new());
    let Some(tls) = tls else {
        return (volumes, mounts, env);
    };
    let mut add = |name: &str, secret: &str, items: Vec<(String, &str)>| {
        volumes.push(Volume {
            name: name.to_string(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.to_string()),
                items: Some(
                    items
                        .iter()
                        .map(|(key, path)| KeyToPath {
                            key: key.clone(),
                            path: path.to_string(),
                            mode: None,
                        })
                        .collect(),
                ),
                optional: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: name.to_string(),
            mount_path: format!("{REDIS_TLS_DIR}/{}", name.trim_start_matches("redis-tls-")),
            read_only: Some(true),
            ..Default::default()
        });
    };
    if let Some(ca) = &tls.ca_secret_ref {
        add("redis-tls-ca", &ca.name, vec![(ca.key.clone(), "ca.crt")]);
        env.push(plain_env(
            worker_env::REDIS_CA_FILE,
            format!("{REDIS_TLS_DIR}/ca/ca.crt"),
        ));
    }
    if let Some(client) = &tls.client_cert_secret_ref {
        add(
            "redis-tls-client",
            &client.name,
            vec![("tls.crt".into(), "tls.crt"), ("tls.key".into(), "tls.key")],
        );
        env.push(plain_env(
            worker_env::REDIS_CLIENT_CERT_FILE,
            format!("{REDIS_TLS_DIR}/client/tls.crt"),
        ));
        env.push(plain_env(
            worker_env::REDIS_CLIENT_KEY_FILE,
            format!("{REDIS_TLS_DIR}/client/tls.key"),
        ));
    }
    (volumes, mounts, env)
}

/// The worker Deployment of queue `q`.
pub fn worker_deployment(
    set: &ShardSet,
    q: QueueId,
    component: &str,
    worker: &WorkerTemplate,
) -> Result<Deployment, BuildError> {
    let name = set.metadata.name.clone().ok_or(BuildError::Incomplete)?;
    let namespace = set
        .metadata
        .namespace
        .clone()
        .ok_or(BuildError::Incomplete)?;
    let mut labels = labels(&name, component);
    let selector = labels.clone();
    labels.insert("lanekeeper.io/queue".to_string(), q.to_string());
    let mut pod_labels = selector.clone();
    pod_labels.insert("lanekeeper.io/queue".to_string(), q.to_string());

    let spec = &set.spec;
    // Credentials are referenced from their Secret, never copied in.
    let mut env = vec![
        plain_env(worker_env::SHARD_SET, format!("{namespace}/{name}")),
        plain_env(worker_env::QUEUE, q.to_string()),
        plain_env(worker_env::CONCURRENCY, worker.concurrency.to_string()),
        plain_env(
            worker_env::DELIVERY_TIMEOUT,
            spec.delivery.timeout.to_string(),
        ),
        plain_env(
            worker_env::CONNECT_TIMEOUT,
            spec.delivery.connect_timeout.to_string(),
        ),
        plain_env(
            worker_env::INITIAL_BACKOFF,
            spec.delivery.initial_backoff.to_string(),
        ),
        plain_env(
            worker_env::MAX_BACKOFF,
            spec.delivery.max_backoff.to_string(),
        ),
        plain_env(worker_env::METRICS_ADDR, format!("0.0.0.0:{METRICS_PORT}")),
        plain_env(worker_env::LOG_FORMAT, "json"),
        EnvVar {
            name: worker_env::POD_NAME.to_string(),
            value_from: Some(EnvVarSource {
                field_ref: Some(k8s_openapi::api::core::v1::ObjectFieldSelector {
                    field_path: "metadata.name".to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ];
    match (&spec.redis.url, &spec.redis.url_secret_ref) {
        (_, Some(r)) => env.push(secret_env(worker_env::REDIS_URL, r)),
        (Some(url), None) => env.push(plain_env(worker_env::REDIS_URL, url.clone())),
        (None, None) => {}
    }
    if let Some(r) = &spec.redis.password_secret_ref {
        env.push(secret_env(worker_env::REDIS_PASSWORD, r));
    }
    if spec.redis.cluster {
        env.push(plain_env(worker_env::REDIS_CLUSTER, "true"));
    }
    if let Some(user) = &spec.redis.username {
        env.push(plain_env(worker_env::REDIS_USERNAME, user.clone()));
    }
    let (tls_volumes, tls_mounts, tls_env) = redis_tls_files(spec.redis.tls.as_ref());
    env.extend(tls_env);
    env.extend(worker.env.iter().cloned());

    let probe = |path: &str| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String("metrics".to_string()),
            ..Default::default()
        }),
        period_seconds: Some(10),
        ..Default::default()
    };
    let container = Container {
        name: "worker".to_string(),
        image: Some(worker.image.clone()),
        image_pull_policy: worker.image_pull_policy.clone(),
        args: Some(vec!["worker".to_string()]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("metrics".to_string()),
            container_port: METRICS_PORT,
            ..Default::default()
        }]),
        resources: worker.resources.clone(),
        liveness_probe: Some(probe("/healthz")),
        readiness_probe: Some(probe("/healthz")),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(
            std::iter::once(VolumeMount {
                name: "tmp".to_string(),
                mount_path: "/tmp".to_string(),
                ..Default::default()
            })
            .chain(tls_mounts)
            .collect(),
        ),
        ..Default::default()
    };
    let pod = PodSpec {
        containers: vec![container],
        node_selector: (!worker.node_selector.is_empty()).then(|| worker.node_selector.clone()),
        tolerations: (!worker.tolerations.is_empty()).then(|| worker.tolerations.clone()),
        affinity: worker.affinity.clone(),
        priority_class_name: worker.priority_class_name.clone(),
        service_account_name: worker.service_account_name.clone(),
        // Workers talk to Redis and webhook endpoints, never to the API server.
        automount_service_account_token: Some(false),
        // Lets deliveries in flight finish or be released (the worker's grace is 25 s).
        termination_grace_period_seconds: Some(30),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volumes: Some(
            std::iter::once(Volume {
                name: "tmp".to_string(),
                empty_dir: Some(Default::default()),
                ..Default::default()
            })
            .chain(tls_volumes)
            .collect(),
        ),
        ..Default::default()
    };
    Ok(Deployment {
        metadata: ObjectMeta {
            name: Some(deployment_name(&name, q)),
            namespace: Some(namespace),
            labels: Some(labels),
            owner_references: Some(vec![owner(set)?]),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            // Left out when an autoscaler owns the count, so SSA never fights it.
            replicas: if worker.autoscaled {
                None
            } else {
                Some(worker.replicas.unwrap_or(1))
            },
            selector: LabelSelector {
                match_labels: Some(pod_labels.clone()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
#[path = "build_tests.rs"]
mod tests;
