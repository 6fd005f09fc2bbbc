//! Real `lanekeeper worker` processes for tests and benchmarks.

use std::process::Command;

use super::process;

/// Worker flags for local delivery to a test receiver: loopback allowed,
/// short backoffs and lease margin.
pub const LOCAL_ARGS: &[&str] = &[
    "--allow-cidr",
    "127.0.0.0/8",
    "--initial-backoff",
    "10ms",
    "--max-backoff",
    "200ms",
    "--connect-timeout",
    "1s",
    "--lease-margin",
    "1s",
];

/// Start a worker process on `queue` of `set` (`<ns>/<name>`); extra flags
/// are appended. Its log is in the Redis scratch directory.
pub fn spawn(redis_url: &str, set: &str, queue: &str, extra: &[&str]) -> u32 {
    spawn_env(redis_url, set, queue, extra, &[])
}

/// [`spawn`] with `env` added to the worker's environment.
pub fn spawn_env(
    redis_url: &str,
    set: &str,
    queue: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = process::scratch_dir("worker");
    let log = dir.join(format!("worker-{n}.log"));
    let mut cmd = Command::new(process::lanekeeper_bin());
    cmd.arg("worker")
        .args(["--redis", redis_url, "--shard-set", set, "--queue", queue])
        .args(["--worker-id", &format!("test-worker-{n}")])
        .args(extra)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn");
    process::spawn_server(cmd, &log)
}

/// A running `lanekeeper ingest` with one admin key.
pub struct Ingest {
    pub pid: u32,
    pub port: u16,
    /// The admin key (the keys file holds only its hash).
    pub key: String,
    pub dir: std::path::PathBuf,
    pub log: std::path::PathBuf,
}

impl Ingest {
    /// Start ingest for `set` (`<ns>/<name>`) on a free loopback port, with
    /// `extra` flags, and wait until `/readyz` answers 200.
    pub fn spawn(redis_url: &str, set: &str, extra: &[&str]) -> Ingest {
        use lanekeeper::ingest::auth;
        let dir = process::scratch_dir("ingest");
        let key = auth::generate_key();
        let keys = dir.join("keys.yaml");
        std::fs::write(
            &keys,
            format!(
                "keys:\n  - {{name: ops, sha256: {}, admin: true}}\n",
                auth::hash_key_hex(&key)
            ),
        )
        .unwrap();
        let port = process::free_port();
        let log = dir.join("ingest.log");
        let mut cmd = Command::new(process::lanekeeper_bin());
        cmd.args(["ingest", "--redis", redis_url, "--shard-set", set])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--api-keys")
            .arg(&keys)
            .args(extra)
            .env("RUST_LOG", "warn");
        let pid = process::spawn_server(cmd, &log);
        let ready = || process::answers_200(port, "/readyz");
        process::wait_until(
            "ingest /readyz",
            std::time::Duration::from_secs(30),
            &log,
            pid,
            ready,
        );
        Ingest {
            pid,
            port,
            key,
            dir,
            log,
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}
