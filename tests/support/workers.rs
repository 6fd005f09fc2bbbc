//! Real `lanekeeper worker` processes for tests and benchmarks.

use std::process::Command;

use super::process;

/// Start a worker process on `queue` of `set` (`<ns>/<name>`); extra flags
/// are appended. Its log is in the Redis scratch directory.
pub fn spawn(redis_url: &str, set: &str, queue: &str, extra: &[&str]) -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = process::scratch_dir("worker");
    let log = dir.join(format!("worker-{n}.log"));
    let mut cmd = Command::new(process::lanekeeper_bin());
    cmd.arg("worker")
        .args(["--redis", redis_url, "--shard-set", set, "--queue", queue])
        .args(["--worker-id", &format!("test-worker-{n}")])
        .args(extra)
        .env("RUST_LOG", "warn");
    process::spawn_server(cmd, &log)
}
