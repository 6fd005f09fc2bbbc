//! The Redis settings that lose data, read from real redis-server processes
//! configured each way: `CONFIG GET`, the `INFO` fallback when CONFIG is
//! renamed away (as managed Redis does), the start-up logs of worker and
//! ingest, and ingest's `/readyz` under an evicting policy.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use lanekeeper::store::{SetId, Store};
use support::process;
use support::redis::{self, TestRedis};

async fn store(r: &TestRedis, name: &str) -> Store {
    Store::connect(&r.url, SetId::new("settings", name), Default::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn an_evicting_policy_and_no_persistence_are_named_with_the_fix() {
    let r = redis::dedicated_with(&["--maxmemory-policy", "volatile-lru", "--maxmemory", "64mb"]);
    let all = store(&r, "evicting").await.redis_settings().await.unwrap();
    assert_eq!(all.len(), 1);
    let s = &all[0];
    assert!(s.via_config && s.config_refused.is_none(), "{s:?}");
    assert_eq!(s.maxmemory_policy.as_deref(), Some("volatile-lru"));
    assert_eq!(s.maxmemory, Some(64 * 1024 * 1024));
    assert_eq!(s.version.as_deref().map(|v| v.starts_with('7')), Some(true));
    let problem = s.eviction_problem().expect("volatile-lru evicts");
    assert!(
        problem.contains("maxmemory-policy volatile-lru")
            && problem.contains("set maxmemory-policy noeviction")
            && problem.contains("idempotency"),
        "{problem}"
    );
    // The test Redis runs with --save '' --appendonly no.
    assert_eq!(s.persistent(), Some(false), "{s:?}");

    // Fixed live: noeviction and AOF.
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).trim(),
        "OK"
    );
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "appendonly", "yes"]).trim(),
        "OK"
    );
    let s = &store(&r, "fixed").await.redis_settings().await.unwrap()[0];
    assert_eq!(s.eviction_problem(), None);
    assert_eq!(s.persistent(), Some(true));
    // RDB snapshots alone count as persistence too.
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "appendonly", "no"]).trim(),
        "OK"
    );
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "save", "3600 1"]).trim(),
        "OK"
    );
    let s = &store(&r, "rdb").await.redis_settings().await.unwrap()[0];
    assert_eq!(s.persistent(), Some(true), "{s:?}");
}

#[tokio::test]
async fn with_config_renamed_away_info_is_read_and_that_is_said() {
    // What ElastiCache and Memorystore do: CONFIG is not there.
    let r = redis::dedicated_with(&[
        "--rename-command",
        "CONFIG",
        "",
        "--maxmemory-policy",
        "allkeys-lru",
    ]);
    let s = &store(&r, "renamed").await.redis_settings().await.unwrap()[0];
    assert!(!s.via_config, "{s:?}");
    let refused = s.config_refused.clone().unwrap();
    assert!(
        refused.to_lowercase().contains("unknown command"),
        "{refused}"
    );
    // INFO still tells the policy and AOF, not the RDB schedule.
    assert_eq!(s.maxmemory_policy.as_deref(), Some("allkeys-lru"));
    assert_eq!(s.appendonly, Some(false));
    assert_eq!(s.save, None);
    assert_eq!(s.persistent(), None);
    assert!(s.eviction_problem().unwrap().contains("allkeys-lru"));
    let summary = s.summary();
    assert!(
        summary.contains("read from INFO because CONFIG GET was refused")
            && summary.contains("RDB schedule"),
        "{summary}"
    );
}

#[tokio::test]
async fn an_acl_without_config_get_falls_back_to_info() {
    let r = redis::dedicated_with(&[]);
    assert_eq!(
        redis::cli(
            &r,
            &[
                "ACL",
                "SETUSER",
                "noconf",
                "on",
                ">pw",
                "~lk:*",
                "&lk:*",
                "-@all",
                "+@read",
                "+@write",
                "+@connection",
                "+info"
            ]
        )
        .trim(),
        "OK"
    );
    let url = format!("redis://noconf:pw@127.0.0.1:{}/", r.port);
    let st = Store::connect(&url, SetId::new("settings", "acl"), Default::default())
        .await
        .unwrap();
    let s = &st.redis_settings().await.unwrap()[0];
    assert!(!s.via_config, "{s:?}");
    assert!(
        s.config_refused.clone().unwrap().contains("no permissions"),
        "{s:?}"
    );
    assert_eq!(s.maxmemory_policy.as_deref(), Some("noeviction"));
    assert_eq!(s.eviction_problem(), None);
}

/// Start `lanekeeper <args>` with its log in a scratch file; (pid, log path).
fn spawn(args: &[&str]) -> (u32, std::path::PathBuf) {
    let dir = process::scratch_dir("settings");
    let log = dir.join("out.log");
    let mut cmd = Command::new(process::lanekeeper_bin());
    cmd.args(args).env("RUST_LOG", "info");
    (process::spawn_server(cmd, &log), log)
}

fn wait_for_log(log: &std::path::Path, want: &[&str], timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if want.iter().all(|w| text.contains(w)) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "the log never said {want:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test]
async fn workers_and_ingest_say_so_at_start_and_ingest_is_not_ready_under_eviction() {
    let r = redis::dedicated_with(&["--maxmemory-policy", "allkeys-lru"]);
    let st = store(&r, "start").await;
    st.set_shards(1).await.unwrap();
    let (worker, log) = spawn(&[
        "worker",
        "--redis",
        &r.url,
        "--shard-set",
        "settings/start",
        "--queue",
        "shard-00",
    ]);
    let text = wait_for_log(
        &log,
        &[
            "RedisEvictionPolicy",
            "maxmemory-policy allkeys-lru",
            "RedisNotPersistent",
        ],
        Duration::from_secs(20),
    );
    assert!(text.contains("worker started"), "{text}");
    process::signal(worker, libc::SIGTERM);

    // Ingest: logs it, and /readyz answers 503 naming the setting.
    let dir = process::scratch_dir("settings-keys");
    let keys = dir.join("keys.yaml");
    std::fs::write(&keys, "keys: []\n").unwrap();
    let port = process::free_port();
    let listen = format!("127.0.0.1:{port}");
    let keys_arg = keys.display().to_string();
    let (ingest, log) = spawn(&[
        "ingest",
        "--redis",
        &r.url,
        "--shard-set",
        "settings/start",
        "--listen",
        &listen,
        "--api-keys",
        &keys_arg,
    ]);
    wait_for_log(
        &log,
        &["RedisEvictionPolicy", "ingest API listening"],
        Duration::from_secs(20),
    );
    let http = reqwest::Client::new();
    let readyz = format!("http://{listen}/readyz");
    let res = http.get(&readyz).send().await.unwrap();
    assert_eq!(res.status(), 503);
    let body = res.text().await.unwrap();
    assert!(
        body.contains("maxmemory-policy allkeys-lru") && body.contains("noeviction"),
        "{body}"
    );
    // Fixed: ready again within the re-check period.
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).trim(),
        "OK"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let res = http.get(&readyz).send().await.unwrap();
        if res.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "ingest stayed not ready");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // And an evicting policy set while it runs takes it out again.
    assert_eq!(
        redis::cli(&r, &["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"]).trim(),
        "OK"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let res = http.get(&readyz).send().await.unwrap();
        if res.status() == 503 {
            assert!(res.text().await.unwrap().contains("volatile-ttl"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ingest stayed ready under volatile-ttl"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    process::signal(ingest, libc::SIGTERM);
}
