//! A throwaway `redis-server` per test binary, on a free loopback port.

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use super::process;

/// A running test Redis.
pub struct TestRedis {
    pub port: u16,
    pub url: String,
    pub pid: u32,
}

static SHARED: OnceLock<TestRedis> = OnceLock::new();

/// The Redis server of this test binary, started on first use. Tests isolate
/// their keys by using a distinct ShardSet name or key prefix.
pub fn shared() -> &'static TestRedis {
    SHARED.get_or_init(start)
}

/// A Redis of its own, for a test that stops and restarts it.
pub fn dedicated() -> TestRedis {
    start_on(process::free_port())
}

/// Stop `redis` at once (SIGKILL).
pub fn kill(redis: &TestRedis) {
    process::signal(redis.pid, libc::SIGKILL);
    let _ = process::wait_exit(redis.pid, Duration::from_secs(10));
}

fn start() -> TestRedis {
    start_on(process::free_port())
}

/// Start a redis-server on `port` (again, after `kill`).
pub fn start_on(port: u16) -> TestRedis {
    let server = process::require_program(
        "redis-server",
        "install it with `apt-get install redis-server` (the tests need a real Redis)",
    );
    let dir = process::scratch_dir("redis");
    let log = dir.join("redis.log");
    let mut cmd = Command::new(server);
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ])
        .arg("--dir")
        .arg(&dir);
    let pid = process::spawn_server(cmd, &log);
    process::wait_until("redis-server", Duration::from_secs(20), &log, pid, || {
        ping(port)
    });
    TestRedis {
        port,
        url: format!("redis://127.0.0.1:{port}/"),
        pid,
    }
}

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 16];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}
