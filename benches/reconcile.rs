//! `cargo bench --bench reconcile`: on the real test control plane (with
//! kube-controller-manager, scheduler and a kwok node), the time from
//! `kubectl apply` of a 64-shard ShardSet to all 64 Deployments created, and
//! to the status showing them all ready; and the controller's memory.
//! The last line is `RESULT create_64_s=<x> status_64_s=<y> rss_peak_mib=<z>`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let cp = support::controlplane::full();
    let redis = support::redis::shared();
    cp.install_crds();
    let ns = cp.namespace("bench");
    let pid = cp.spawn_controller(&ns, &[]);
    std::thread::sleep(Duration::from_secs(3));
    let idle_kib = rss_kib(pid, "VmRSS:");

    let manifest = format!(
        "apiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: big}}\nspec:\n  shards: 64\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:bench\", replicas: 1}}\n",
        redis.url
    );
    let started = Instant::now();
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &manifest);
    let count = || {
        cp.kubectl_ok(&[
            "get",
            "deployments",
            "-n",
            &ns,
            "-l",
            "app.kubernetes.io/instance=big",
            "-o",
            "name",
        ])
        .lines()
        .count()
    };
    while count() < 64 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "64 Deployments not created"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let created = started.elapsed().as_secs_f64();
    loop {
        let ready = cp.kubectl_ok(&[
            "get",
            "shardset",
            "big",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.shardsReady}",
        ]);
        if ready == "64" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "status never showed 64 ready shards"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = started.elapsed().as_secs_f64();
    let peak_kib = rss_kib(pid, "VmHWM:");
    println!("64-shard ShardSet: Deployments created in {created:.2} s; status shows 64/64 ready after {status:.2} s (pods scheduled onto the kwok node and made Ready)");
    println!(
        "controller RSS: idle {:.1} MiB, peak {:.1} MiB",
        idle_kib as f64 / 1024.0,
        peak_kib as f64 / 1024.0
    );
    println!(
        "RESULT create_64_s={created:.2} status_64_s={status:.2} rss_peak_mib={:.1}",
        peak_kib as f64 / 1024.0
    );
    support::process::stop_all();
}
