//! `cargo bench --bench profile`: the instructions Redis executes per
//! delivery, counted by callgrind, which (unlike time) do not move with
//! whatever else the machine runs. It starts `redis-server` under
//! `valgrind --tool=callgrind` with instrumentation off, sets up each phase
//! uninstrumented, and counts only the phase itself (`callgrind_control -i
//! on`, zero, run, dump):
//! - the raw pair: `RPOP` then `HINCRBY` (two plain round trips);
//! - fair lease+ack at k = 1: a worker's loop of `ack_and_lease`, 4 clients
//!   (4 leases in flight);
//! - fair lease+ack at k = 16: `lease_batch`, each of 4 clients acking its
//!   16 deliveries and leasing 16 more per call;
//!
//! at 10 and 1,000 active tenants for the fair cases; k = 1 at 1,000
//! tenants with every lease checked against a tenant and an endpoint
//! bucket (limits too high to throttle: the scheduler bench's
//! `rate_limited_vs_unlimited` in instructions); then batch enqueue
//! of 20,000 envelopes of 100 tenants (1,000 per pipeline, 4 producers). Callgrind counts user
//! space only: the kernel's share of each round trip (read, write, epoll),
//! the larger part of the raw pair's cost, is not in these counts.
//! `BENCH_ANNOTATE=1` also prints the costliest functions of each phase
//! (inclusive; names need a `redis-server` with symbols on PATH), and
//! `BENCH_CALLGRIND_OUT=<dir>` keeps each phase's dump there, named by
//! phase, for `callgrind_annotate`. `BENCH_REDIS_ARGS="--name value ..."`
//! starts the server with more settings, to count what one would change
//! (e.g. `--hash-max-listpack-entries 0`).
//! The last line is `RESULT ir_per_delivery_k1=<x> ir_per_delivery_k16=<y>
//! k16_vs_k1=<y/x> raw_ir_per_cycle=<z> ir_per_enqueue=<w>` (10 tenants)
//! `limited_ir_vs_unlimited=<v>` (k = 1, 1,000 tenants).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    backlog, connect, enqueue_all, interleaved, raw_backlog, raw_connections, raw_pair,
    run_batched, run_fair, Q,
};
use lanekeeper::policy::QueuePolicy;
use support::process;

/// Deliveries (or raw cycles) per counted phase.
const OPS: u64 = 4_000;
const CLIENTS: usize = 4;
/// Envelopes in the counted batch-enqueue phase.
const ENQUEUED: u64 = 20_000;

struct Callgrind {
    pid: u32,
    dir: PathBuf,
    url: String,
    control: PathBuf,
    annotate: Option<PathBuf>,
}

impl Callgrind {
    fn start() -> Self {
        let valgrind = process::require_debian_program("valgrind", &["valgrind"]);
        let control = process::require_debian_program("callgrind_control", &["valgrind"]);
        let server = process::require_debian_program("redis-server", &["redis-server"]);
        let annotate = std::env::var_os("BENCH_ANNOTATE")
            .map(|_| process::require_debian_program("callgrind_annotate", &["valgrind"]));
        let dir = process::scratch_dir("callgrind");
        let port = process::free_port();
        let mut cmd = Command::new(valgrind);
        cmd.arg("--tool=callgrind")
            .arg("--instr-atstart=no")
            .arg(format!("--callgrind-out-file={}/cg.out", dir.display()))
            .arg(server)
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .args(
                std::env::var("BENCH_REDIS_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .arg("--dir")
            .arg(&dir);
        let log = dir.join("redis.log");
        let pid = process::spawn_server(cmd, &log);
        let url = format!("redis://127.0.0.1:{port}/");
        process::wait_until(
            "redis-server under callgrind",
            Duration::from_secs(60),
            &log,
            pid,
            || {
                redis::Client::open(url.as_str())
                    .and_then(|c| c.get_connection())
                    .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                    .is_ok()
            },
        );
        Callgrind {
            pid,
            dir,
            url,
            control,
            annotate,
        }
    }

    fn control(&self, args: &[&str]) {
        let out = Command::new(&self.control)
            .args(args)
            .arg(self.pid.to_string())
            .output()
            .expect("run callgrind_control");
        assert!(
            out.status.success(),
            "callgrind_control {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Run `phase` with instrumentation on and return the instructions
    /// Redis executed in it (the `totals:` of its dump).
    async fn count<F: std::future::Future<Output = ()>>(&self, label: &str, phase: F) -> u64 {
        self.control(&["-i", "on"]);
        self.control(&["-z"]);
        phase.await;
        self.control(&["-d", label]);
        self.control(&["-i", "off"]);
        let dump = newest_dump(&self.dir);
        let text = std::fs::read_to_string(&dump).unwrap();
        if let Some(keep) = std::env::var_os("BENCH_CALLGRIND_OUT") {
            std::fs::create_dir_all(&keep).unwrap();
            std::fs::copy(&dump, Path::new(&keep).join(format!("{label}.callgrind"))).unwrap();
        }
        if let Some(annotate) = &self.annotate {
            let out = Command::new(annotate)
                .args(["--inclusive=yes", "--threshold=90"])
                .arg(&dump)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            for line in text.lines().filter(|l| l.contains(" (")).take(30) {
                println!("    {line}");
            }
        }
        text.lines()
            .find_map(|l| {
                l.strip_prefix("totals:")
                    .or_else(|| l.strip_prefix("summary:"))
            })
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no totals in {}", dump.display()))
    }
}

impl Drop for Callgrind {
    fn drop(&mut self) {
        process::signal(self.pid, libc::SIGKILL);
    }
}

fn newest_dump(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("cg.out.")
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap())
        .expect("callgrind wrote a dump")
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let cg = Callgrind::start();
    let url = cg.url.clone();
    rt.block_on(async {
        raw_backlog(&url, "profile:raw", OPS).await;
        let conns = raw_connections(&url, CLIENTS).await;
        let raw_ir = cg
            .count("raw", raw_pair(conns, "profile:raw", OPS))
            .await as f64
            / OPS as f64;
        println!("raw RPOP+HINCRBY: {raw_ir:>9.0} instructions per cycle");
        let mut per = Vec::new();
        for tenants in [10u64, 1_000] {
            for k in [1usize, 16] {
                // set up uninstrumented, clients connected before the count
                let (admin, clients) =
                    backlog(&url, tenants, &QueuePolicy::default(), OPS, CLIENTS).await;
                let label = format!("k{k}-{tenants}");
                let ir = if k == 1 {
                    cg.count(&label, run_fair(clients, OPS)).await
                } else {
                    cg.count(&label, run_batched(clients, k, OPS)).await
                } as f64
                    / OPS as f64;
                println!(
                    "fair k={k:>2}, {tenants:>5} tenants: {ir:>9.0} instructions per delivery ({:.2}x raw)",
                    ir / raw_ir
                );
                per.push(ir);
                admin.purge_set().await.unwrap();
            }
        }
        // rate limits checked at every lease (limits too high to throttle),
        // k = 1 at 1,000 tenants: the scheduler bench's rate_limited_vs_unlimited
        // in instructions, which do not move with the machine's load
        let limited = support::buckets::unthrottled_limits();
        let (admin, clients) = backlog(&url, 1_000, &limited, OPS, CLIENTS).await;
        let limited_ir = cg.count("k1-1000-limited", run_fair(clients, OPS)).await as f64 / OPS as f64;
        admin.purge_set().await.unwrap();
        println!(
            "fair k= 1,  1000 tenants, rate-limited: {limited_ir:>9.0} instructions per delivery ({:.3}x unlimited)",
            limited_ir / per[2]
        );
        // batch enqueue as the scheduler bench runs it: 100 tenants' envelopes
        // interleaved, 1,000 per pipeline from 4 producers
        let admin = connect(&url, "profile-enqueue").await;
        admin
            .configure_queue(Q, &QueuePolicy::default())
            .await
            .unwrap();
        let envs = interleaved(100, ENQUEUED / 100);
        let enqueue_ir = cg
            .count("enqueue", async {
                enqueue_all(&admin, envs).await;
            })
            .await as f64
            / ENQUEUED as f64;
        println!("batch enqueue, 100 tenants: {enqueue_ir:>9.0} instructions per envelope");
        admin.purge_set().await.unwrap();
        println!(
            "RESULT ir_per_delivery_k1={:.0} ir_per_delivery_k16={:.0} k16_vs_k1={:.3} raw_ir_per_cycle={raw_ir:.0} ir_per_enqueue={enqueue_ir:.0} limited_ir_vs_unlimited={:.3}",
            per[0],
            per[1],
            per[1] / per[0],
            limited_ir / per[2]
        );
    });
    drop(cg);
    support::process::stop_all();
}
