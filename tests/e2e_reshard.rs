//! Resharding end to end (issue 8): `lanekeeper controller` against the full
//! test control plane and a real Redis changes `spec.shards` while producers
//! send numbered events; real worker processes serve the shards (a stand-in
//! kubelet starts and stops one per shard or lane Deployment, as they come
//! and go) and a real receiver records what arrived, in what order.
//!
//! The tests take turns: each runs hundreds of producers and several workers
//! on a two-core machine.

mod support;

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use lanekeeper::crd::LanePhase;
use lanekeeper::routing::{hash_shard, QueueId};
use support::controlplane::{self, ControlPlane};
use support::lanes::Traffic;
use support::reshard::{
    changing, load, patch_shards, stop_and_check, wait_shard_deployments, watch_reshard,
};

fn cluster() -> &'static ControlPlane {
    controlplane::full_with_crds()
}

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use support::reshard::start;

const SPEC: &str = "  worker: {image: \"lanekeeper:test\", replicas: 1, concurrency: 8}\n  scheduler: {ordering: PerTenant}\n  promotion: {enabled: false}\n  relocation: {drainTimeout: 60s, maxConcurrentMoves: 8}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_4_to_6_under_load_keeps_every_tenants_order() {
    let _turn = SERIAL.lock().await;
    let env = start(cluster(), "reshard-grow", 4, SPEC).await;
    let traffic = load(&env, "g", 200, 2.0).await;
    let tenants: Vec<String> = traffic.iter().map(|(t, _)| t.clone()).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    patch_shards(&env, 6);
    let seen = watch_reshard(&env, 6, Duration::from_secs(120), |_| false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = stop_and_check(&env, traffic).await;

    let last = seen.progress.last().cloned().expect("progress shown");
    let expected = changing(&tenants, 4, 6);
    println!(
        "grow 4 -> 6: {} of 200 tenants moved ({:.1}%; hash change predicts {expected}), reshard {:.1}s, {total} events in order; reasons {:?}; progress {:?}",
        last.to_move,
        last.to_move as f64 / 2.0,
        seen.took.as_secs_f64(),
        seen.reasons,
        seen.progress
    );
    assert_eq!((last.from_shards, last.to_shards), (4, 6));
    assert_eq!(
        last.to_move as usize, expected,
        "exactly the tenants whose hash queue changed move"
    );
    let share = last.to_move as f64 / 200.0;
    assert!((share - 1.0 / 3.0).abs() < 0.1, "moved share {share}");
    // The condition showed progress (as polled, or as its Events recorded)
    // and then cleared, with a "Resharded" Event.
    let shown = |r: &str| seen.reasons.iter().chain(&seen.events).any(|x| x == r);
    assert!(
        shown("MovingTenants") || shown("WaitingForShards"),
        "{seen:?}"
    );
    assert!(seen.events.iter().any(|e| e == "Resharded"), "{seen:?}");
    assert_eq!(seen.reasons.last().map(String::as_str), Some("Idle"));
    let set = env.shardset().await;
    assert!(set.status.as_ref().unwrap().resharding.is_none());
    wait_shard_deployments(&env, 6, Duration::from_secs(10)).await;
    // every tenant now lives on its hash queue under 6 shards
    let table = env.store.routing().await.unwrap();
    for t in &tenants {
        assert_eq!(table.route(t), hash_shard(t, 6));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_6_to_3_moves_everyone_off_the_retiring_shards_then_deletes_them() {
    let _turn = SERIAL.lock().await;
    let env = start(cluster(), "reshard-shrink", 6, SPEC).await;
    let traffic = load(&env, "s", 200, 2.0).await;
    let tenants: Vec<String> = traffic.iter().map(|(t, _)| t.clone()).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    patch_shards(&env, 3);
    let seen = watch_reshard(&env, 3, Duration::from_secs(120), |_| false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = stop_and_check(&env, traffic).await;

    let last = seen.progress.last().cloned().expect("progress shown");
    let on_retiring = tenants
        .iter()
        .filter(|t| matches!(hash_shard(t, 6), QueueId::Shard(n) if n >= 3))
        .count();
    println!(
        "shrink 6 -> 3: {} of 200 tenants moved (all of the {on_retiring} on shards 3-5), reshard {:.1}s, {total} events in order; reasons {:?}",
        last.to_move,
        seen.took.as_secs_f64(),
        seen.reasons
    );
    assert_eq!(last.to_move as usize, on_retiring);
    assert_eq!(last.moved, last.to_move);
    assert!(seen.events.iter().any(|e| e == "Resharded"), "{seen:?}");
    wait_shard_deployments(&env, 3, Duration::from_secs(30)).await;
    for n in 3..6 {
        let depth: u64 = env
            .store
            .tenant_stats(QueueId::Shard(n), Duration::from_secs(10))
            .await
            .unwrap()
            .iter()
            .map(|s| s.depth)
            .sum();
        assert_eq!(depth, 0, "retired shard {n} still holds envelopes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_mid_reshard_finishes_it_and_a_second_change_is_replanned() {
    let _turn = SERIAL.lock().await;
    // Slow endpoints and two moves at a time: the reshard takes seconds.
    let spec = "  worker: {image: \"lanekeeper:test\", replicas: 1, concurrency: 8}\n  scheduler: {ordering: PerTenant}\n  promotion: {enabled: false}\n  relocation: {drainTimeout: 60s, maxConcurrentMoves: 2}\n";
    let mut env = start(cluster(), "reshard-kill", 4, spec).await;
    let mut traffic = Vec::new();
    for i in 0..40 {
        let t = format!("k{i:03}");
        env.endpoint(&t, "delay-150").await;
        traffic.push((t.clone(), Traffic::start(&env.store, &t, 5.0)));
    }
    let tenants: Vec<String> = traffic.iter().map(|(t, _)| t.clone()).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    patch_shards(&env, 6);
    let seen = watch_reshard(&env, 6, Duration::from_secs(120), |o| {
        o.progress
            .last()
            .is_some_and(|p| p.moved > 0 && p.moved < p.to_move)
    })
    .await;
    let mid = seen.progress.last().cloned().unwrap();
    support::process::signal(env.controller, libc::SIGKILL);
    let _ = support::process::wait_exit(env.controller, Duration::from_secs(10));
    // A second change while nobody reconciles: replanned from where it stands.
    patch_shards(&env, 5);
    env.restart_controller(&[], &[]);
    let after = watch_reshard(&env, 5, Duration::from_secs(180), |_| false).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let total = stop_and_check(&env, traffic).await;
    println!(
        "killed at {mid:?}; after restart and 4 -> 6 -> 5: {:?}; {total} events in order",
        after.progress.last()
    );
    let table = env.store.routing().await.unwrap();
    assert_eq!(table.shards, 5);
    for t in &tenants {
        assert_eq!(
            table.route(t),
            hash_shard(t, 5),
            "{t} not on its hash queue"
        );
    }
    wait_shard_deployments(&env, 5, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_a_dedicated_lane_is_untouched_by_a_reshard() {
    let _turn = SERIAL.lock().await;
    let env = start(cluster(), "reshard-lane", 4, SPEC).await;
    // A lane tenant whose hash queue changes from 4 to 6 shards.
    let laned = (0..1000)
        .map(|i| format!("vip{i}"))
        .find(|t| hash_shard(t, 4) != hash_shard(t, 6))
        .unwrap();
    env.endpoint(&laned, "ok").await;
    let vip = Traffic::start(&env.store, &laned, 20.0);
    env.create_lane("vip", &laned);
    let mut phases = Vec::new();
    let active = env
        .wait_phase(
            "vip",
            LanePhase::Active,
            Duration::from_secs(60),
            &mut phases,
        )
        .await;
    let lane_q = QueueId::Lane(active.status.as_ref().unwrap().lane_index.unwrap() as u8);
    let lane_uid = {
        let api: kube::Api<Deployment> = kube::Api::namespaced(env.client.clone(), &env.ns);
        api.get(&format!("{}-{lane_q}", env.set))
            .await
            .unwrap()
            .metadata
            .uid
    };
    let mut traffic = load(&env, "l", 50, 2.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    patch_shards(&env, 6);
    let mut lane_phases = Vec::new();
    let seen = watch_reshard(&env, 6, Duration::from_secs(120), |_| false).await;
    let lane = env.lanes_api().get("vip").await.unwrap();
    lane_phases.push(lane.status.as_ref().unwrap().phase);
    traffic.push((laned.clone(), vip));
    let total = stop_and_check(&env, traffic).await;
    let last = seen.progress.last().cloned().unwrap();
    println!(
        "reshard 4 -> 6 with {laned} on {lane_q}: {} tenants moved, lane phase {:?}, {total} events in order",
        last.to_move, lane_phases
    );
    assert_eq!(lane_phases, vec![LanePhase::Active]);
    let table = env.store.routing().await.unwrap();
    assert_eq!(
        table.pins.get(&laned),
        Some(&lane_q),
        "the lane's pin stays"
    );
    let api: kube::Api<Deployment> = kube::Api::namespaced(env.client.clone(), &env.ns);
    let uid_after = api
        .get(&format!("{}-{lane_q}", env.set))
        .await
        .unwrap()
        .metadata
        .uid;
    assert_eq!(uid_after, lane_uid, "the lane Deployment was not replaced");
    let others: Vec<String> = (0..50).map(|i| format!("l{i:03}")).collect();
    assert_eq!(last.to_move as usize, changing(&others, 4, 6));
}

/// Lane moves and reshards take turns (issue 17): a shard-count change made
/// while a promotion is draining its tenant waits (`WaitingForLanes`) until
/// the lane is Active, then runs; the lane's tenant keeps its lane and its
/// order, and every other tenant arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_waits_for_a_lane_that_is_moving_its_tenant() {
    let _turn = SERIAL.lock().await;
    let env = start(cluster(), "reshard-gate", 4, SPEC).await;
    // A tenant whose hash queue changes from 4 to 6 shards, with a slow
    // endpoint and a backlog: its promotion drains for several seconds.
    let laned = (0..1000)
        .map(|i| format!("slowvip{i}"))
        .find(|t| hash_shard(t, 4) != hash_shard(t, 6))
        .unwrap();
    env.endpoint(&laned, "delay-400").await;
    let vip = Traffic::start(&env.store, &laned, 5.0);
    let traffic = load(&env, "w", 40, 2.0).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    env.create_lane("slowvip", &laned);
    let mut phases = Vec::new();
    env.wait_phase(
        "slowvip",
        LanePhase::Draining,
        Duration::from_secs(60),
        &mut phases,
    )
    .await;
    let sent = vip.stop().await.count;

    patch_shards(&env, 6);
    let mut waited = false;
    let seen = watch_reshard(&env, 6, Duration::from_secs(180), |seen| {
        if seen.reasons.last().map(String::as_str) == Some("WaitingForLanes") {
            waited = true;
        }
        false
    })
    .await;
    let lane = env
        .wait_phase(
            "slowvip",
            LanePhase::Active,
            Duration::from_secs(60),
            &mut phases,
        )
        .await;
    let total = stop_and_check(&env, traffic).await;
    support::lanes::assert_in_order(&env.receiver, &laned, sent, Duration::from_secs(60)).await;
    let last = seen.progress.last().cloned().expect("progress shown");
    println!(
        "reshard 4 -> 6 while {laned}'s lane drained: reasons {:?}, lane phases {phases:?}, {} tenants moved, {total} + {sent} events in order",
        seen.reasons, last.to_move
    );
    let shown = |r: &str| seen.reasons.iter().chain(&seen.events).any(|x| x == r);
    assert!(
        waited || shown("WaitingForLanes"),
        "the reshard did not wait for the moving lane: {seen:?}"
    );
    let index = lane.status.as_ref().unwrap().lane_index.unwrap();
    let table = env.store.routing().await.unwrap();
    assert_eq!(
        table.pins.get(&laned),
        Some(&QueueId::Lane(index as u8)),
        "the lane's tenant stays on its lane"
    );
    let others: Vec<String> = (0..40).map(|i| format!("w{i:03}")).collect();
    assert_eq!(last.to_move as usize, changing(&others, 4, 6));
}
