//! Dedicated-lane scenarios on the real control plane: a ShardSet whose
//! shards and lanes are served by real `lanekeeper worker` processes (a
//! stand-in kubelet starts one for every lane Deployment the controller
//! creates, since kwok runs no images), producers that number their events
//! and follow MOVED, and a real receiver that checks every signature.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanekeeper::crd::{DedicatedLane, LanePhase, ShardSet};
use lanekeeper::endpoint::Endpoint;
use lanekeeper::producer::Producer;
use lanekeeper::routing::{hash_shard, QueueId};
use lanekeeper::signing::Secret;
use lanekeeper::store::{EnqueueOutcome, SetId, Store};

use crate::support::controlplane::ControlPlane;
use crate::support::receiver::{now_ms, Receiver};

/// Runs a worker process for each lane Deployment of a set while it exists.
pub struct Kubelet {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Every lane queue a worker was started for, in order.
    pub started: Arc<Mutex<Vec<String>>>,
}

impl Kubelet {
    /// Workers for the set's lane Deployments.
    pub fn start(cp: &ControlPlane, ns: &str, set: &str, redis_url: &str, extra: &[&str]) -> Self {
        Self::start_for(cp, ns, set, redis_url, extra, "lane")
    }

    /// Workers for the set's Deployments of the given components
    /// (`lane`, or `shard,lane` to follow shard Deployments too).
    pub fn start_for(
        cp: &ControlPlane,
        ns: &str,
        set: &str,
        redis_url: &str,
        extra: &[&str],
        components: &str,
    ) -> Self {
        let selector = format!(
            "app.kubernetes.io/instance={set},app.kubernetes.io/component in ({components})"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(Mutex::new(Vec::new()));
        let kubeconfig = cp.kubeconfig.clone();
        let (ns, set, redis_url) = (ns.to_string(), set.to_string(), redis_url.to_string());
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let thread = {
            let (stop, started) = (stop.clone(), started.clone());
            std::thread::spawn(move || {
                let mut running: BTreeMap<String, u32> = BTreeMap::new();
                while !stop.load(Ordering::SeqCst) {
                    let out = std::process::Command::new("kubectl")
                        .arg(format!("--kubeconfig={}", kubeconfig.display()))
                        .args([
                            "get",
                            "deployments",
                            "-n",
                            &ns,
                            "-l",
                            &selector,
                            "-o",
                            r#"jsonpath={range .items[*]}{.metadata.labels.lanekeeper\.io/queue}{"\n"}{end}"#,
                        ])
                        .output();
                    if let Some(out) = out.ok().filter(|o| o.status.success()) {
                        let want: Vec<String> = String::from_utf8_lossy(&out.stdout)
                            .lines()
                            .filter(|l| !l.is_empty())
                            .map(str::to_string)
                            .collect();
                        for q in &want {
                            if !running.contains_key(q) {
                                let mut args: Vec<&str> =
                                    crate::support::workers::LOCAL_ARGS.to_vec();
                                args.extend(extra.iter().map(|s| s.as_str()));
                                let pid = crate::support::workers::spawn(
                                    &redis_url,
                                    &format!("{ns}/{set}"),
                                    q,
                                    &args,
                                );
                                running.insert(q.clone(), pid);
                                started.lock().unwrap().push(q.clone());
                            }
                        }
                        let gone: Vec<String> = running
                            .keys()
                            .filter(|q| !want.contains(q))
                            .cloned()
                            .collect();
                        for q in gone {
                            let pid = running.remove(&q).unwrap();
                            crate::support::process::signal(pid, libc::SIGTERM);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
                for pid in running.values() {
                    crate::support::process::signal(*pid, libc::SIGTERM);
                }
            })
        };
        Kubelet {
            stop,
            thread: Some(thread),
            started,
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A ShardSet in its own namespace with its controller, shard workers, a
/// stand-in kubelet for lanes, and a receiver.
pub struct LaneEnv {
    pub cp: &'static ControlPlane,
    pub ns: String,
    pub set: String,
    pub redis_url: String,
    pub store: Store,
    pub receiver: Receiver,
    pub client: kube::Client,
    pub controller: u32,
    pub controller_log: std::path::PathBuf,
    pub shard_workers: Vec<u32>,
    pub kubelet: Option<Kubelet>,
    pub shards: u16,
}

impl LaneEnv {
    /// `spec` is the ShardSet spec below `redis` (YAML, indented two spaces).
    pub async fn start(
        cp: &'static ControlPlane,
        prefix: &str,
        shards: u16,
        spec: &str,
        controller_args: &[&str],
        worker_extra: &[&str],
    ) -> LaneEnv {
        Self::start_opts(
            cp,
            prefix,
            shards,
            spec,
            controller_args,
            worker_extra,
            false,
        )
        .await
    }

    /// Like [`LaneEnv::start`]; with `kubelet_shards`, the stand-in kubelet
    /// also runs (and stops) the shard workers as their Deployments come
    /// and go, as a reshard needs.
    pub async fn start_opts(
        cp: &'static ControlPlane,
        prefix: &str,
        shards: u16,
        spec: &str,
        controller_args: &[&str],
        worker_extra: &[&str],
        kubelet_shards: bool,
    ) -> LaneEnv {
        let redis_url = crate::support::redis::shared().url.clone();
        Self::start_on(
            cp,
            prefix,
            shards,
            spec,
            controller_args,
            worker_extra,
            kubelet_shards,
            &redis_url,
        )
        .await
    }

    /// [`LaneEnv::start_opts`] on the Redis at `redis_url` (a dedicated one,
    /// for a test that flushes or kills it).
    #[allow(clippy::too_many_arguments)]
    pub async fn start_on(
        cp: &'static ControlPlane,
        prefix: &str,
        shards: u16,
        spec: &str,
        controller_args: &[&str],
        worker_extra: &[&str],
        kubelet_shards: bool,
        redis_url: &str,
    ) -> LaneEnv {
        let ns = cp.namespace(prefix);
        let set = "hooks".to_string();
        let redis_url = redis_url.to_string();
        let manifest = format!(
            "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: {set}}}\nspec:\n  shards: {shards}\n  redis: {{url: \"{redis_url}\"}}\n{spec}"
        );
        cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &manifest);
        let mut args = vec!["--leader-election=false"];
        args.extend_from_slice(controller_args);
        let (controller, controller_log) = cp.spawn_controller_env(&ns, &args, &[]);
        let store = Store::connect(&redis_url, SetId::new(&ns, &set), Default::default())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while store.routing().await.map(|r| r.shards).unwrap_or(0) != shards {
            assert!(
                Instant::now() < deadline,
                "the controller did not write the routing table"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut wargs: Vec<&str> = crate::support::workers::LOCAL_ARGS.to_vec();
        wargs.extend_from_slice(worker_extra);
        let shard_workers = (0..if kubelet_shards { 0 } else { shards })
            .map(|n| {
                crate::support::workers::spawn(
                    &redis_url,
                    &format!("{ns}/{set}"),
                    &QueueId::Shard(n).to_string(),
                    &wargs,
                )
            })
            .collect();
        let components = if kubelet_shards { "shard,lane" } else { "lane" };
        let kubelet = Some(Kubelet::start_for(
            cp,
            &ns,
            &set,
            &redis_url,
            worker_extra,
            components,
        ));
        LaneEnv {
            cp,
            client: cp.client().await,
            ns,
            set,
            redis_url,
            store,
            receiver: Receiver::start(),
            controller,
            controller_log,
            shard_workers,
            kubelet,
            shards,
        }
    }

    /// A tenant name whose hash shard is `shard`, starting with `prefix`.
    pub fn tenant_on(&self, prefix: &str, shard: u16) -> String {
        (0..10_000)
            .map(|i| format!("{prefix}{i}"))
            .find(|t| hash_shard(t, self.shards) == QueueId::Shard(shard))
            .unwrap()
    }

    /// Register `tenant`'s endpoint at the receiver with `mode` (`ok`, `delay-50`, ...).
    pub async fn endpoint(&self, tenant: &str, mode: &str) {
        let secret = Secret::generate();
        self.receiver
            .expect_secrets(tenant, std::slice::from_ref(&secret));
        let ep = Endpoint {
            url: self.receiver.url(tenant, mode),
            secrets: vec![secret],
            enabled: true,
            event_types: vec![],
        };
        self.store
            .put_endpoint(tenant, "default", &ep)
            .await
            .unwrap();
    }

    pub fn lanes_api(&self) -> kube::Api<DedicatedLane> {
        kube::Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn sets_api(&self) -> kube::Api<ShardSet> {
        kube::Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn shardset(&self) -> ShardSet {
        self.sets_api().get(&self.set).await.unwrap()
    }

    pub async fn lanes(&self) -> Vec<DedicatedLane> {
        self.lanes_api()
            .list(&Default::default())
            .await
            .unwrap()
            .items
    }

    pub async fn lane_of(&self, tenant: &str) -> Option<DedicatedLane> {
        self.lanes()
            .await
            .into_iter()
            .find(|l| l.spec.tenant == tenant)
    }

    /// Create a DedicatedLane by hand, as GitOps would.
    pub fn create_lane(&self, name: &str, tenant: &str) {
        self.cp.kubectl_stdin(
            &["apply", "-n", &self.ns, "-f", "-"],
            &format!(
                "apiVersion: lanekeeper.io/v1alpha1\nkind: DedicatedLane\nmetadata: {{name: {name}}}\nspec: {{shardSet: {}, tenant: {tenant}}}\n",
                self.set
            ),
        );
    }

    pub fn set_retire(&self, name: &str, retire: bool) {
        self.cp.kubectl_ok(&[
            "patch",
            "dedicatedlane",
            name,
            "-n",
            &self.ns,
            "--type=merge",
            "-p",
            &format!(r#"{{"spec":{{"retire":{retire}}}}}"#),
        ]);
    }

    /// Wait until `name` is in `phase`; returns the lane. Records every phase seen.
    pub async fn wait_phase(
        &self,
        name: &str,
        phase: LanePhase,
        timeout: Duration,
        seen: &mut Vec<LanePhase>,
    ) -> DedicatedLane {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(l) = self.lanes_api().get(name).await {
                let p = l.status.as_ref().map(|s| s.phase).unwrap_or_default();
                if seen.last() != Some(&p) {
                    seen.push(p);
                }
                if p == phase {
                    return l;
                }
            }
            assert!(
                Instant::now() < deadline,
                "lane {name} not {phase:?} within {timeout:?}; phases seen {seen:?}; controller log:\n{}",
                self.controller_log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn wait_gone(&self, name: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.lanes_api().get_opt(name).await.unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "lane {name} still exists after {timeout:?}:\n{}",
                self.controller_log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn controller_log(&self) -> String {
        crate::support::process::tail(&self.controller_log, 40)
    }

    /// Restart the controller (after it died or was stopped) with `extra` flags and `env`.
    pub fn restart_controller(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        let mut args = vec!["--leader-election=false"];
        args.extend_from_slice(extra);
        (self.controller, self.controller_log) = self.cp.spawn_controller_env(&self.ns, &args, env);
    }
}

impl Drop for LaneEnv {
    fn drop(&mut self) {
        self.kubelet.take();
        for pid in &self.shard_workers {
            crate::support::process::signal(*pid, libc::SIGTERM);
        }
        crate::support::process::signal(self.controller, libc::SIGTERM);
    }
}

/// What a producer sent.
#[derive(Clone, Debug, Default)]
pub struct Sent {
    pub count: u64,
    /// Send time (ms) of envelopes that landed in a hold buffer.
    pub held_ms: Vec<u64>,
    /// Queue each envelope went to, by sequence number.
    pub queues: Vec<QueueId>,
}

/// A producer sending `tenant`'s numbered events at `per_sec` until stopped.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Sent>,
}

impl Traffic {
    pub fn start(store: &Store, tenant: &str, per_sec: f64) -> Traffic {
        Self::start_at(store, tenant, per_sec, 0)
    }

    /// Like [`Traffic::start`], numbering from `first` (`Sent::count` is then the next number).
    pub fn start_at(store: &Store, tenant: &str, per_sec: f64, first: u64) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let producer = Producer::new(store.clone(), Duration::from_millis(200));
        let tenant = tenant.to_string();
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut sent = Sent {
                    count: first,
                    ..Default::default()
                };
                let every = Duration::from_secs_f64(1.0 / per_sec);
                let started = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    let env = crate::support::scenario::envelope(&tenant, sent.count);
                    let (q, outcome) = producer.send(&env).await.unwrap();
                    if matches!(outcome, EnqueueOutcome::Held { .. }) {
                        sent.held_ms.push(now_ms());
                    }
                    sent.queues.push(q);
                    sent.count += 1;
                    let next = started + every.mul_f64((sent.count - first) as f64);
                    tokio::time::sleep_until(next.into()).await;
                }
                sent
            })
        };
        Traffic { stop, task }
    }

    pub async fn stop(self) -> Sent {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap()
    }
}

/// Wait until the receiver accepted `n` events of `tenant`, then check they
/// arrived exactly once each and strictly in sequence order.
pub async fn assert_in_order(receiver: &Receiver, tenant: &str, n: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let prefix = format!("{tenant}-");
    loop {
        let seqs: Vec<u64> = receiver
            .arrivals()
            .into_iter()
            .filter(|a| a.accepted && a.tenant == tenant && a.id.starts_with(&prefix))
            .map(|a| a.seq)
            .collect();
        if seqs.len() as u64 >= n {
            let want: Vec<u64> = (0..n).collect();
            assert_eq!(
                seqs.len() as u64,
                n,
                "{tenant}: duplicates (at-least-once redelivery where none was expected)"
            );
            if seqs != want {
                let first_bad = seqs
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{tenant}: out of order at position {first_bad}: {:?}",
                    &seqs[first_bad.saturating_sub(3)..(first_bad + 5).min(seqs.len())]
                );
            }
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{tenant}: only {} of {n} events arrived in {timeout:?}",
            seqs.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// p99 (ms) of enqueue-to-arrival wait of tenants starting with `prefix`,
/// for events sent in `[from_ms, to_ms)`.
pub fn p99(receiver: &Receiver, prefix: &str, from_ms: u64, to_ms: u64) -> (u64, usize) {
    let mut waits: Vec<u64> = receiver
        .arrivals()
        .into_iter()
        .filter(|a| {
            a.accepted && a.tenant.starts_with(prefix) && a.sent_ms >= from_ms && a.sent_ms < to_ms
        })
        .map(|a| a.at_ms.saturating_sub(a.sent_ms))
        .collect();
    assert!(
        !waits.is_empty(),
        "no arrivals of {prefix}* sent in the interval"
    );
    waits.sort();
    let i = ((waits.len() as f64 * 0.99).ceil() as usize).clamp(1, waits.len()) - 1;
    (waits[i], waits.len())
}
