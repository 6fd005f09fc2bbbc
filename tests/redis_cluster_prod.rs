//! Issue 18 on a real Redis Cluster: the settings check on every primary
//! (`cluster-require-full-coverage` included), `Replicated` durability
//! waiting on the primary that owns the queue's slot, and `rediss+cluster://`
//! against a cluster whose clients and bus speak TLS only.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use lanekeeper::policy::QueuePolicy;
use lanekeeper::producer::Producer;
use lanekeeper::routing::{hash_shard, QueueId};
use lanekeeper::store::{SetId, Store, StoreError};
use support::process;
use support::redis::{Pki, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_primary_is_checked_and_replicated_waits_on_the_queue_primary() {
    let cluster = TestCluster::start();
    let store = Store::connect(
        &cluster.url,
        SetId::new("prod", "cluster"),
        Default::default(),
    )
    .await
    .unwrap();
    let all = store.redis_settings().await.unwrap();
    assert_eq!(all.len(), 3, "{all:?}");
    for s in &all {
        assert!(s.cluster && s.via_config, "{s:?}");
        assert!(s.node.starts_with("127.0.0.1:"), "{s:?}");
        assert_eq!(s.cluster_require_full_coverage, Some(true), "{s:?}");
        assert!(
            s.summary()
                .contains("cluster-require-full-coverage yes (one primary down"),
            "{}",
            s.summary()
        );
    }

    store.set_shards(8).await.unwrap();
    for n in 0..8 {
        store
            .configure_queue(QueueId::Shard(n), &QueuePolicy::default())
            .await
            .unwrap();
    }
    store
        .set_durability(Some(Duration::from_millis(400)))
        .await
        .unwrap();
    let producer = Producer::new(store.clone(), Duration::from_millis(1));
    // Two tenants whose queues live on different primaries.
    let primary_of = |t: &str| {
        let q = hash_shard(t, 8);
        let slot = cluster.keyslot(&store.queue_prefix(q));
        cluster.primary_of(slot)
    };
    let a = "tenant-a".to_string();
    let a_primary = primary_of(&a);
    let b = (0..1000)
        .map(|i| format!("tenant-b{i}"))
        .find(|t| primary_of(t).id != a_primary.id)
        .unwrap();
    producer
        .send(&support::scenario::envelope(&a, 1))
        .await
        .expect("the replicas acknowledge");
    producer
        .send(&support::scenario::envelope(&b, 1))
        .await
        .expect("the replicas acknowledge");

    // a's primary loses its replica: a's enqueues are refused, b's are not.
    let replica = cluster.replica_of(&a_primary.id);
    let pid = cluster
        .nodes
        .iter()
        .find(|n| n.port == replica.port)
        .unwrap()
        .pid;
    process::signal(pid, libc::SIGSTOP);
    let err = producer
        .send(&support::scenario::envelope(&a, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::NotReplicated { acked: 0, .. }),
        "{err}"
    );
    producer
        .send(&support::scenario::envelope(&b, 2))
        .await
        .expect("b's primary still has its replica");
    process::signal(pid, libc::SIGCONT);
    producer
        .send(&support::scenario::envelope(&a, 2))
        .await
        .expect("acknowledged again once the replica is back");
}

/// Three TLS-only cluster nodes (clients and the cluster bus over TLS, no
/// replicas), joined with `redis-cli --tls --cluster create`.
struct TlsCluster {
    pki: Pki,
    ports: Vec<u16>,
    pids: Vec<u32>,
}

impl TlsCluster {
    fn start() -> TlsCluster {
        let server = process::require_program("redis-server", "apt-get install redis-server");
        let cli = process::require_program("redis-cli", "apt-get install redis-tools");
        let pki = Pki::generate();
        let dir = process::scratch_dir("redis-tls-cluster");
        let (mut ports, mut pids) = (Vec::new(), Vec::new());
        for i in 0..3 {
            let port = process::free_port();
            let bus = process::free_port();
            let node_dir = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&node_dir).unwrap();
            let log = node_dir.join("redis.log");
            let mut cmd = Command::new(&server);
            cmd.args(["--bind", "127.0.0.1", "--port", "0"])
                .args(pki.server_args(port, "no"))
                .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus.to_string(),
                ])
                .args([
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&node_dir);
            let pid = process::spawn_server(cmd, &log);
            let tls_cli = |args: &[&str]| {
                Command::new(&cli)
                    .args(["--tls", "--cacert"])
                    .arg(&pki.ca)
                    .args(["-h", "127.0.0.1", "-p", &port.to_string()])
                    .args(args)
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default()
            };
            process::wait_until(
                "redis-server (TLS)",
                Duration::from_secs(20),
                &log,
                pid,
                || tls_cli(&["PING"]).contains("PONG"),
            );
            ports.push(port);
            pids.push(pid);
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        // Bounded: a bus that cannot handshake leaves redis-cli waiting forever.
        let out = Command::new("timeout")
            .arg("60")
            .arg(&cli)
            .args(["--tls", "--cacert"])
            .arg(&pki.ca)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --tls --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = ports.iter().all(|p| {
                let o = Command::new(&cli)
                    .args(["--tls", "--cacert"])
                    .arg(&pki.ca)
                    .args(["-h", "127.0.0.1", "-p", &p.to_string(), "CLUSTER", "INFO"])
                    .output()
                    .unwrap();
                let s = String::from_utf8_lossy(&o.stdout);
                s.contains("cluster_state:ok") && s.contains("cluster_known_nodes:3")
            });
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the TLS cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        TlsCluster { pki, ports, pids }
    }

    fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("rediss+cluster://{}", nodes.join(","))
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        for pid in &self.pids {
            process::signal(*pid, libc::SIGKILL);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_cluster_carries_enqueue_lease_and_wakeups_over_tls() {
    use futures::StreamExt;
    let cluster = TlsCluster::start();
    let store = Store::connect_tls(
        &cluster.url(),
        SetId::new("prod", "tls-cluster"),
        Default::default(),
        Some(cluster.pki.tls(false)),
    )
    .await
    .expect("connect to the TLS cluster with the test CA");
    assert!(store.is_cluster());
    assert_eq!(store.cluster_primaries().await.unwrap().len(), 3);
    store.set_shards(6).await.unwrap();
    let producer = Producer::new(store.clone(), Duration::from_millis(100));
    // Queues on every primary: one tenant per shard.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..200 {
        let t = format!("t{i}");
        let q = hash_shard(&t, 6);
        if !seen.insert(q) {
            continue;
        }
        store
            .configure_queue(q, &QueuePolicy::default())
            .await
            .unwrap();
        let wake = store.wakeups(q).await.expect("sharded subscribe over TLS");
        let mut wake = std::pin::pin!(wake);
        let (got, _) = producer
            .send(&support::scenario::envelope(&t, 1))
            .await
            .unwrap();
        assert_eq!(got, q);
        tokio::time::timeout(Duration::from_secs(5), wake.next())
            .await
            .expect("a wake-up")
            .expect("an open stream");
        match store.lease(q, "w", Duration::from_secs(30)).await.unwrap() {
            lanekeeper::store::LeaseOutcome::Leased(l) => {
                assert!(store.ack(&l, Duration::from_millis(1)).await.unwrap())
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(seen.len(), 6);
    let settings = store.redis_settings().await.unwrap();
    assert_eq!(settings.len(), 3, "{settings:?}");
    // Without the CA the cluster is refused.
    let untrusted =
        Store::connect(&cluster.url(), SetId::new("prod", "x"), Default::default()).await;
    let refused = match untrusted {
        Err(_) => true,
        Ok(s) => s.ping().await.is_err(),
    };
    assert!(
        refused,
        "connected to a TLS cluster with an untrusted certificate"
    );
}
