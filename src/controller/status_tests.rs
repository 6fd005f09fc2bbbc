//! Tests of the pure status functions in `status.rs`.

use super::*;

#[test]
fn a_reshard_waiting_for_lanes_says_which() {
    let view = ReshardView {
        waiting_for_lanes: vec!["whale".into()],
        ..Default::default()
    };
    let (on, reason, message) = resharding(&view, 6);
    assert!(on);
    assert_eq!(reason, "WaitingForLanes");
    assert!(message.contains("whale"), "{message}");
}

fn stats(pairs: &[(&str, f64)]) -> Vec<TenantStats> {
    pairs
        .iter()
        .map(|(t, s)| TenantStats {
            tenant: t.to_string(),
            worker_seconds: *s,
            ..Default::default()
        })
        .collect()
}

#[test]
fn skew_and_top_tenants() {
    let view = RedisView {
        queues: vec![
            (QueueId::Shard(0), stats(&[("whale", 90.0), ("a", 10.0)])),
            (QueueId::Shard(1), stats(&[("b", 20.0)])),
            (QueueId::Shard(2), stats(&[("c", 25.0)])),
        ],
        ..Default::default()
    };
    let (skew, top) = attribution(&view);
    // per shard 100, 20, 25: median 25, max 100
    assert_eq!(skew, Some(4.0));
    assert_eq!(top[0].tenant, "b");
    assert_eq!(top[0].share, 1.0);
    let whale = top.iter().find(|t| t.tenant == "whale").unwrap();
    assert_eq!((whale.queue.as_str(), whale.share), ("shard-00", 0.9));
}

#[test]
fn paused_tenants_are_listed_by_name_up_to_the_bound() {
    let paused: Vec<(QueueId, String)> = (0..100)
        .rev()
        .map(|i| (QueueId::Shard(i % 3), format!("t{i:03}")))
        .collect();
    let listed = paused_tenants(&paused);
    assert_eq!(listed.len(), MAX_PAUSED_LISTED);
    assert_eq!(listed[0].tenant, "t000");
    assert_eq!(listed[0].queue, "shard-00");
    assert_eq!(listed[63].tenant, "t063");
    assert!(paused_tenants(&[]).is_empty());
}

fn a_set() -> ShardSet {
    serde_yaml::from_str(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {name: s, namespace: n}\nspec: {shards: 1, redis: {url: \"redis://r\"}, worker: {image: i}}\n",
        )
        .unwrap()
}

fn cond<'a>(st: &'a ShardSetStatus, t: &str) -> &'a Condition {
    st.conditions.iter().find(|c| c.type_ == t).unwrap()
}

#[test]
fn redis_settings_become_conditions() {
    let set = a_set();
    let evicting = RedisSettings {
        via_config: true,
        maxmemory_policy: Some("allkeys-lru".into()),
        appendonly: Some(false),
        save: Some(String::new()),
        ..Default::default()
    };
    let view = RedisView {
        settings: Ok(vec![evicting]),
        ..Default::default()
    };
    let st = compute(
        &set,
        &[],
        Lanes::default(),
        Ok(&view),
        &ReshardView::default(),
    );
    let d = cond(&st, "Degraded");
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "RedisEvictionPolicy")
    );
    assert!(
        d.message.contains("maxmemory-policy allkeys-lru"),
        "{}",
        d.message
    );
    let p = cond(&st, "RedisNotPersistent");
    assert_eq!(
        (p.status.as_str(), p.reason.as_str()),
        ("True", "NoPersistence")
    );
    assert_eq!(cond(&st, "RedisChecked").status, "True");
    assert_eq!(cond(&st, "RedisStateLost").status, "False");

    // From INFO only: persistence unknown, and said.
    let info = RedisSettings {
        maxmemory_policy: Some("noeviction".into()),
        appendonly: Some(false),
        config_refused: Some("ERR unknown command 'CONFIG'".into()),
        ..Default::default()
    };
    let view = RedisView {
        settings: Ok(vec![info]),
        restored: Some("restored the lane pins acme→lane-1".into()),
        epoch: Some("e2".into()),
        ..Default::default()
    };
    let st = compute(
        &set,
        &[],
        Lanes::default(),
        Ok(&view),
        &ReshardView::default(),
    );
    assert_eq!(cond(&st, "Degraded").reason, "AsExpected");
    assert_eq!(cond(&st, "RedisNotPersistent").status, "Unknown");
    let c = cond(&st, "RedisChecked");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ConfigGetRefused")
    );
    let l = cond(&st, "RedisStateLost");
    assert_eq!(
        (l.status.as_str(), l.message.as_str()),
        ("True", "restored the lane pins acme→lane-1")
    );
    assert_eq!(st.redis_epoch.as_deref(), Some("e2"));
    // Both warnings are Events when they turn on.
    let reasons: Vec<String> = transitions(&ShardSetStatus::default(), &st)
        .into_iter()
        .filter(|t| t.warning)
        .map(|t| t.type_)
        .collect();
    assert!(
        reasons.contains(&"RedisStateLost".to_string()),
        "{reasons:?}"
    );

    // Redis unreachable: the last Redis conditions and epoch stand.
    let mut with_prev = set.clone();
    with_prev.status = Some(st.clone());
    let err = "down".to_string();
    let st2 = compute(
        &with_prev,
        &[],
        Lanes::default(),
        Err(&err),
        &ReshardView::default(),
    );
    assert_eq!(cond(&st2, "RedisNotPersistent").status, "Unknown");
    assert_eq!(st2.redis_epoch.as_deref(), Some("e2"));
    assert_eq!(cond(&st2, "Degraded").reason, "RedisUnavailable");
}

#[test]
fn last_transition_time_moves_only_on_a_flip() {
    let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap());
    let prev = vec![Condition {
        type_: "Ready".into(),
        status: "True".into(),
        reason: "AllShardsAvailable".into(),
        message: "4 of 4".into(),
        last_transition_time: t0.clone(),
        observed_generation: Some(1),
    }];
    let same = condition(
        &prev,
        "Ready",
        true,
        "AllShardsAvailable",
        "4 of 4".into(),
        Some(2),
    );
    assert_eq!(same.last_transition_time, t0);
    let flipped = condition(
        &prev,
        "Ready",
        false,
        "ShardsUnavailable",
        "3 of 4".into(),
        Some(2),
    );
    assert_ne!(flipped.last_transition_time, t0);
}

/// A shard Deployment as the API server reports it: `replicas` wanted,
/// all of them available, with these status conditions.
fn deployment(name: &str, replicas: i32, conditions: serde_json::Value) -> Deployment {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "generation": 1},
        "spec": {"replicas": replicas, "selector": {}, "template": {}},
        "status": {"observedGeneration": 1, "replicas": replicas,
            "updatedReplicas": replicas, "availableReplicas": replicas,
            "conditions": conditions},
    }))
    .unwrap()
}

fn compute_with(set: &ShardSet, ds: &[Deployment]) -> ShardSetStatus {
    let refs: Vec<&Deployment> = ds.iter().collect();
    compute(
        set,
        &refs,
        Lanes::default(),
        Ok(&RedisView::default()),
        &ReshardView::default(),
    )
}

#[test]
fn zero_replicas_is_not_ready_unless_autoscaled() {
    let set = a_set();
    let st = compute_with(&set, &[deployment("s-shard-00", 0, serde_json::json!([]))]);
    let r = cond(&st, "Ready");
    assert_eq!(
        (r.status.as_str(), r.reason.as_str()),
        ("False", "NoWorkers")
    );
    assert_eq!(st.ready_summary.as_deref(), Some("0/1"));
    // Nothing is rolling out either: it is simply not served.
    assert_eq!(cond(&st, "Progressing").status, "False");
    assert!(st.conditions.iter().all(|c| c.type_ != "ScaledToZero"));

    let st = compute_with(&set, &[deployment("s-shard-00", 2, serde_json::json!([]))]);
    assert_eq!(cond(&st, "Ready").status, "True");

    let mut auto = a_set();
    auto.spec.worker.autoscaled = true;
    let st = compute_with(&auto, &[deployment("s-shard-00", 0, serde_json::json!([]))]);
    assert_eq!(cond(&st, "Ready").status, "True");
    let z = cond(&st, "ScaledToZero");
    assert_eq!(
        (z.status.as_str(), z.reason.as_str()),
        ("True", "AutoscaledToZero")
    );
    let st = compute_with(&auto, &[deployment("s-shard-00", 3, serde_json::json!([]))]);
    assert_eq!(cond(&st, "ScaledToZero").status, "False");
}

#[test]
fn pods_that_cannot_be_created_are_degraded() {
    let set = a_set();
    let failing = deployment(
        "s-shard-00",
        1,
        serde_json::json!([
            {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
             "message": "pods \"s-shard-00-x\" is forbidden: exceeded quota"},
        ]),
    );
    let mut failing = failing;
    failing.status.as_mut().unwrap().available_replicas = Some(0);
    let st = compute_with(&set, &[failing.clone()]);
    let d = cond(&st, "Degraded");
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "DeploymentFailed")
    );
    assert!(d.message.contains("exceeded quota"), "{}", d.message);
    assert_eq!(cond(&st, "Ready").status, "False");
    assert!(deployment_failure(&failing)
        .unwrap()
        .starts_with("s-shard-00: "));
    let healthy = deployment(
        "s-shard-00",
        1,
        serde_json::json!([
            {"type": "ReplicaFailure", "status": "False", "reason": "Recovered"}]),
    );
    assert_eq!(deployment_failure(&healthy), None);
}

#[test]
fn a_rejected_deployment_says_so_with_the_api_message() {
    let mut set = a_set();
    set.metadata.generation = Some(4);
    let st = deployment_rejected(
        &set,
        "Deployment.apps \"s-shard-00\" is invalid: spec.template.spec.nodeSelector: Invalid value",
    );
    assert_eq!(st.observed_generation, Some(4));
    for t in ["Ready", "Degraded", "Progressing"] {
        assert_eq!(cond(&st, t).reason, "DeploymentFailed");
        assert!(cond(&st, t).message.contains("nodeSelector"));
    }
    assert_eq!(cond(&st, "Degraded").status, "True");
    assert_eq!(cond(&st, "Ready").status, "False");
    // A new set's first status names the failure in an Event.
    let events = transitions(&ShardSetStatus::default(), &st);
    assert!(events
        .iter()
        .any(|t| t.type_ == "Degraded" && t.warning && t.reason == "DeploymentFailed"));
}
