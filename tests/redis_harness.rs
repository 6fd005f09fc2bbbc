//! The throwaway Redis of a test binary is real and isolated.

mod support;

#[tokio::test]
async fn test_redis_is_a_real_server() {
    let redis = support::redis::shared();
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
    let _: () = redis::cmd("SET")
        .arg("lk:test")
        .arg("1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(info.contains(&format!("tcp_port:{}", redis.port)), "{info}");
    // Lua scripting works: the data plane depends on it.
    let n: i64 = redis::Script::new("return redis.call('INCR', KEYS[1])")
        .key("lk:test")
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 2);
}

/// A PATH directory holding only `tools` (links to the real ones).
fn path_with_only(tools: &[&str]) -> std::path::PathBuf {
    let dir = support::process::scratch_dir("path");
    for t in tools {
        let real = support::process::require_program(t, "it is part of every Debian system");
        std::os::unix::fs::symlink(real, dir.join(t)).unwrap();
    }
    dir
}

/// On a fresh machine without Redis, the test support, demo.sh and .ci/run
/// install redis-server and redis-tools with apt-get when they may (root on
/// a Debian-like system), and otherwise stop with the exact command.
/// (The installing branch runs on a fresh machine only: this one has Redis.)
#[test]
fn a_missing_redis_names_the_exact_install_command() {
    let panic = std::panic::catch_unwind(|| {
        support::process::install_or_explain("redis-server", support::redis::REDIS_PACKAGES, false)
    })
    .unwrap_err();
    let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("apt-get update && ")
            && msg.contains("apt-get install -y redis-server redis-tools"),
        "{msg}"
    );
    let root = unsafe { libc::geteuid() } == 0;
    let sudo = if root { "" } else { "sudo " };
    let repo = env!("CARGO_MANIFEST_DIR");
    // With apt-get (but told not to install), and without it.
    for (tools, want) in [
        (
            vec!["bash", "id", "dirname", "apt-get"],
            format!("install with: {sudo}apt-get update && {sudo}apt-get install -y redis-server redis-tools"),
        ),
        (
            vec!["bash", "id", "dirname"],
            format!("install them with your package manager (on Debian or Ubuntu: {sudo}apt-get install -y redis-server redis-tools)"),
        ),
    ] {
        let path = path_with_only(&tools);
        for script in ["demo.sh", ".ci/run"] {
            let out = std::process::Command::new(path.join("bash"))
                .arg(format!("{repo}/{script}"))
                .env_clear()
                .env("PATH", &path)
                .env("LANEKEEPER_NO_INSTALL", "1")
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{script} went on without Redis");
            assert!(err.contains(&want), "{script} ({tools:?}): {err}");
        }
    }
}
