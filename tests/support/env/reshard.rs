//! Resharding scenarios (the e2e test and the bench): a ShardSet whose
//! shard and lane workers follow their Deployments, numbered producers, a
//! spec change, and the reshard watched through the set's status.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use lanekeeper::crd::ReshardProgress;
use lanekeeper::routing::{hash_shard, QueueId};

use crate::support::controlplane::ControlPlane;
use crate::support::lanes::{assert_in_order, LaneEnv, Sent, Traffic};

/// A ShardSet of `shards` shards whose shard and lane workers a stand-in
/// kubelet runs, as their Deployments come and go; returns once the shard
/// workers run.
pub async fn start(cp: &'static ControlPlane, prefix: &str, shards: u16, spec: &str) -> LaneEnv {
    let env =
        LaneEnv::start_opts(cp, prefix, shards, spec, &[], &["--concurrency", "8"], true).await;
    wait_shard_workers(&env, shards).await;
    env
}

/// Wait until the kubelet runs a worker for each of the first `n` shards.
pub async fn wait_shard_workers(env: &LaneEnv, n: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let started = env
            .kubelet
            .as_ref()
            .unwrap()
            .started
            .lock()
            .unwrap()
            .clone();
        if (0..n).all(|i| started.contains(&QueueId::Shard(i).to_string())) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shard workers not started: {started:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Producers for `n` tenants named `<prefix><i>`, `per_sec` events each.
pub async fn load(env: &LaneEnv, prefix: &str, n: usize, per_sec: f64) -> Vec<(String, Traffic)> {
    let mut tenants = Vec::new();
    for i in 0..n {
        let t = format!("{prefix}{i:03}");
        env.endpoint(&t, "ok").await;
        tenants.push(t);
    }
    tenants
        .into_iter()
        .map(|t| {
            let traffic = Traffic::start(&env.store, &t, per_sec);
            (t, traffic)
        })
        .collect()
}

/// Stop the producers, then check every tenant's events arrived exactly
/// once each and in order. Returns how many were sent.
pub async fn stop_and_check(env: &LaneEnv, traffic: Vec<(String, Traffic)>) -> u64 {
    let mut sent: Vec<(String, Sent)> = Vec::new();
    for (t, tr) in traffic {
        sent.push((t, tr.stop().await));
    }
    let total = sent.iter().map(|(_, s)| s.count).sum();
    for (t, s) in &sent {
        assert_in_order(&env.receiver, t, s.count, Duration::from_secs(90)).await;
    }
    total
}

pub fn patch_shards(env: &LaneEnv, shards: u16) {
    env.cp.kubectl_ok(&[
        "patch",
        "shardset",
        &env.set,
        "-n",
        &env.ns,
        "--type=merge",
        "-p",
        &format!("{{\"spec\":{{\"shards\":{shards}}}}}"),
    ]);
}

/// What a reshard looked like from its status.
#[derive(Debug, Default)]
pub struct Observed {
    /// Every distinct progress seen, in order.
    pub progress: Vec<ReshardProgress>,
    /// Every distinct Resharding condition reason seen, in order.
    pub reasons: Vec<String>,
    /// Reasons of the set's Events recorded during the watch (the condition
    /// can be True for less than a poll: idle tenants move in one pass).
    pub events: Vec<String>,
    pub took: Duration,
}

/// The set's Events, oldest first: (reason, note).
fn set_events(env: &LaneEnv) -> Vec<(String, String)> {
    let out = env.cp.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        &env.ns,
        "--field-selector",
        &format!("regarding.name={}", env.set),
        "--sort-by=.metadata.creationTimestamp",
        "-o",
        "jsonpath={range .items[*]}{.reason}{\"\\t\"}{.note}{\"\\n\"}{end}",
    ]);
    out.lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(r, n)| (r.to_string(), n.to_string()))
        .collect()
}

/// The progress a "Resharded" Event reports:
/// `resharded from A to B shards: moved X of Y tenants`.
fn progress_of(note: &str) -> Option<ReshardProgress> {
    let n: Vec<i32> = note
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .filter_map(|w| w.parse().ok())
        .collect();
    match n[..] {
        [from_shards, to_shards, moved, to_move] => Some(ReshardProgress {
            from_shards,
            to_shards,
            to_move,
            moved,
            failed: 0,
        }),
        _ => None,
    }
}

fn resharding_condition(env_set: &lanekeeper::crd::ShardSet) -> (String, String) {
    env_set
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Resharding"))
        .map(|c| (c.status.clone(), c.reason.clone()))
        .unwrap_or_default()
}

/// Watch the set's status until the reshard to `to` shards has run and
/// cleared (condition `Resharding` back to False, routing at `to`, no move
/// pinned). `until` stops early (returns) when it answers true.
pub async fn watch_reshard(
    env: &LaneEnv,
    to: u16,
    timeout: Duration,
    mut until: impl FnMut(&Observed) -> bool,
) -> Observed {
    let started = Instant::now();
    let mut seen = Observed::default();
    let mut began = false;
    let events_before = set_events(env).len();
    loop {
        let set = env.shardset().await;
        let (status, reason) = resharding_condition(&set);
        if seen.reasons.last() != Some(&reason) {
            seen.reasons.push(reason.clone());
        }
        if let Some(p) = set.status.as_ref().and_then(|s| s.resharding.clone()) {
            if seen.progress.last() != Some(&p) {
                seen.progress.push(p);
            }
        }
        began |= status == "True";
        seen.took = started.elapsed();
        if until(&seen) {
            return seen;
        }
        if status == "False" {
            let table = env.store.routing().await.unwrap();
            if table.shards == to && !table.pins.values().any(|q| matches!(q, QueueId::Shard(_))) {
                // The Events since the watch began, and the "Resharded" of
                // this change wherever it is: a reshard with nothing to wait
                // for (a shrink) can finish, Event and all, before the
                // watch's first listing.
                let since = |all: Vec<(String, String)>| -> Vec<(String, String)> {
                    let this = format!(" to {to} shards");
                    all.into_iter()
                        .enumerate()
                        .filter(|(i, (r, note))| {
                            *i >= events_before || (r == "Resharded" && note.contains(&this))
                        })
                        .map(|(_, e)| e)
                        .collect()
                };
                let mut events = since(set_events(env));
                // The condition can clear a reconcile before the one that
                // records "Resharded" (the clean-clone run saw that after a
                // 0.35 s reshard): give the Event a few seconds to appear.
                let settle = Instant::now();
                while began
                    && !events.iter().any(|(r, _)| r == "Resharded")
                    && settle.elapsed() < Duration::from_secs(10)
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    events = since(set_events(env));
                }
                let done = events.iter().rev().find(|(r, _)| r == "Resharded");
                if began || done.is_some() {
                    seen.events = events.iter().map(|(r, _)| r.clone()).collect();
                    // What the Event says is final, even if a poll missed it.
                    if let Some(p) = done.and_then(|(_, note)| progress_of(note)) {
                        if seen.progress.last() != Some(&p) {
                            seen.progress.push(p);
                        }
                    }
                    return seen;
                }
            }
        }
        if started.elapsed() >= timeout {
            let table = env.store.routing().await.unwrap();
            let pins: Vec<_> = table
                .pins
                .iter()
                .filter(|(_, q)| matches!(q, QueueId::Shard(_)))
                .take(10)
                .collect();
            panic!(
                "reshard to {to} not done in {timeout:?}; seen {seen:?}; routing at {} shards, shard pins {pins:?}; Events since the change {:?}; controller log:\n{}",
                table.shards,
                set_events(env).into_iter().skip(events_before).collect::<Vec<_>>(),
                env.controller_log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn shard_deployments(env: &LaneEnv) -> BTreeSet<String> {
    let api: kube::Api<Deployment> = kube::Api::namespaced(env.client.clone(), &env.ns);
    api.list(&kube::api::ListParams::default().labels(&format!(
        "app.kubernetes.io/instance={},app.kubernetes.io/component=shard",
        env.set
    )))
    .await
    .unwrap()
    .items
    .iter()
    .filter_map(|d| d.metadata.name.clone())
    .collect()
}

pub async fn wait_shard_deployments(env: &LaneEnv, n: u16, timeout: Duration) {
    let want: BTreeSet<String> = (0..n)
        .map(|i| format!("{}-{}", env.set, QueueId::Shard(i)))
        .collect();
    let deadline = Instant::now() + timeout;
    loop {
        let have = shard_deployments(env).await;
        if have == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shard Deployments {have:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Tenants whose hash queue differs between `a` and `b` shards.
pub fn changing(tenants: &[String], a: u16, b: u16) -> usize {
    tenants
        .iter()
        .filter(|t| hash_shard(t, a) != hash_shard(t, b))
        .count()
}
