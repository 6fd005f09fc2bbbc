//! `cargo bench --bench idle_load`: what idle ShardSets cost the API server.
//! On the real test control plane (kube-controller-manager, scheduler, a kwok
//! node), `IDLE_SETS` ShardSets (default 50) of `IDLE_SHARDS` shards (default
//! 16) are created and left alone until every one is Ready; then for
//! `IDLE_SECONDS` (default 60) the API server's own `apiserver_request_total`
//! counts the requests on the resources the controller uses (Deployments,
//! ShardSets, DedicatedLanes, events.k8s.io Events), by verb, and
//! kube-apiserver's CPU time is read from /proc.
//!
//! With `IDLE_BASELINE_BIN=<path of another lanekeeper binary>` the same sets
//! are measured first under that binary's controller, then under this one's,
//! in the same run, and the last line carries the ratio.
//! The last line is `RESULT idle_requests_per_s_per_set=<x>
//! apiserver_cpu_cores=<y>[ vs_baseline=<r>]`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::controlplane::ControlPlane;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Requests per "VERB resource[/subresource]" on the controller's resources,
/// from the API server's own counter (watches left out).
fn requests(cp: &ControlPlane) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for c in cp.request_counts() {
        let ours = matches!(
            (c.resource.as_str(), c.group.as_str()),
            ("deployments", "apps")
                | ("shardsets", "lanekeeper.io")
                | ("dedicatedlanes", "lanekeeper.io")
                | ("events", "events.k8s.io")
        );
        if ours && c.verb != "WATCH" {
            *out.entry(c.key()).or_default() += c.count;
        }
    }
    out
}

/// kube-apiserver's CPU seconds (user + system) so far.
fn apiserver_cpu(cp: &ControlPlane) -> f64 {
    let dir = cp.dir.display().to_string();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.contains("kube-apiserver") || !cmdline.contains(&dir) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // Fields after the ")" that ends the command name: utime is the 12th, stime the 13th.
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
            + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        return ticks / 100.0;
    }
    panic!("kube-apiserver of {dir} not found in /proc");
}

struct Sample {
    per_set_per_s: f64,
    cpu_cores: f64,
}

fn measure(cp: &ControlPlane, label: &str, sets: u64, seconds: u64) -> Sample {
    let (r0, c0, t0) = (requests(cp), apiserver_cpu(cp), Instant::now());
    std::thread::sleep(Duration::from_secs(seconds));
    let (r1, c1, dt) = (requests(cp), apiserver_cpu(cp), t0.elapsed().as_secs_f64());
    let mut total = 0.0;
    println!(
        "{label}: requests on Deployments, ShardSets, DedicatedLanes and Events over {dt:.0} s"
    );
    for (k, v) in &r1 {
        let d = v - r0.get(k).copied().unwrap_or(0.0);
        if d > 0.0 {
            println!("  {k:<40} {d:>8.0}  ({:.2}/s)", d / dt);
            total += d;
        }
    }
    let per_set_per_s = total / dt / sets as f64;
    let cpu_cores = (c1 - c0) / dt;
    println!(
        "{label}: {:.2} requests/s in all, {per_set_per_s:.3} per idle set; kube-apiserver {cpu_cores:.3} cores",
        total / dt
    );
    Sample {
        per_set_per_s,
        cpu_cores,
    }
}

fn spawn(cp: &ControlPlane, bin: &Path, ns: &str) -> u32 {
    // The controller watches all namespaces: the sets are spread over a few.
    let log = support::process::scratch_dir("idle-controller").join("controller.log");
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["controller", "--lease-namespace", ns])
        .args([
            "--metrics-addr",
            &format!("127.0.0.1:{}", support::process::free_port()),
        ])
        .env("KUBECONFIG", &cp.kubeconfig)
        .env("RUST_LOG", "warn");
    support::process::spawn_server(cmd, &log)
}

fn main() {
    let sets = env_or("IDLE_SETS", 50);
    let shards = env_or("IDLE_SHARDS", 16);
    let seconds = env_or("IDLE_SECONDS", 60);
    let baseline: Option<PathBuf> = std::env::var_os("IDLE_BASELINE_BIN").map(PathBuf::from);
    let cp = support::controlplane::full();
    let redis = support::redis::shared();
    cp.install_crds();
    let ns = cp.namespace("idle");
    let current = support::process::lanekeeper_bin();
    let first = baseline.clone().unwrap_or_else(|| current.clone());
    let mut pid = spawn(cp, &first, &ns);

    let started = Instant::now();
    let mut manifest = String::new();
    for i in 0..sets {
        manifest.push_str(&format!(
            "---\napiVersion: lanekeeper.io/v1alpha1\nkind: ShardSet\nmetadata: {{name: idle-{i:02}}}\nspec:\n  shards: {shards}\n  redis: {{url: \"{}\"}}\n  worker: {{image: \"lanekeeper:bench\", replicas: 1}}\n  promotion: {{enabled: false}}\n",
            redis.url
        ));
    }
    cp.kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &manifest);
    let all_ready = || {
        let out = cp.kubectl_ok(&[
            "get",
            "shardsets",
            "-n",
            &ns,
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}",
        ]);
        out.lines().filter(|l| l.trim() == "True").count() as u64
    };
    let patience = Duration::from_secs(env_or("IDLE_READY_TIMEOUT", 900));
    let mut ready = all_ready();
    while ready < sets && started.elapsed() < patience {
        std::thread::sleep(Duration::from_secs(5));
        ready = all_ready();
    }
    println!(
        "{ready} of {sets} ShardSets x {shards} shards Ready after {:.0} s{}",
        started.elapsed().as_secs_f64(),
        if ready < sets {
            " (measuring anyway: a set that is not Ready resyncs every 10 s instead of 15 s)"
        } else {
            ""
        }
    );
    // Let the first resync of every set pass before counting.
    std::thread::sleep(Duration::from_secs(20));
    let base = baseline.as_ref().map(|b| {
        let s = measure(cp, &format!("baseline {}", b.display()), sets, seconds);
        support::process::signal(pid, libc::SIGKILL);
        pid = spawn(cp, &current, &ns);
        // A new process knows nothing it applied: its first round applies
        // everything once, and a build that makes other Deployments rolls
        // every shard out. Count from when the sets are Ready again.
        let switched = Instant::now();
        std::thread::sleep(Duration::from_secs(20));
        while all_ready() < sets && switched.elapsed() < patience {
            std::thread::sleep(Duration::from_secs(5));
        }
        println!(
            "{} of {sets} sets Ready {:.0} s after the switch",
            all_ready(),
            switched.elapsed().as_secs_f64()
        );
        std::thread::sleep(Duration::from_secs(20));
        s
    });
    let now = measure(
        cp,
        &format!("this build {}", current.display()),
        sets,
        seconds,
    );
    support::process::signal(pid, libc::SIGKILL);
    match base {
        Some(b) => println!(
            "RESULT idle_requests_per_s_per_set={:.3} apiserver_cpu_cores={:.3} vs_baseline={:.3}",
            now.per_set_per_s,
            now.cpu_cores,
            now.per_set_per_s / b.per_set_per_s.max(1e-9)
        ),
        None => println!(
            "RESULT idle_requests_per_s_per_set={:.3} apiserver_cpu_cores={:.3}",
            now.per_set_per_s, now.cpu_cores
        ),
    }
    support::process::stop_all();
}
