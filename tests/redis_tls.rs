//! Redis over TLS (`rediss://`) and with an ACL user, against real
//! redis-server processes started with `--tls-port` and a certificate
//! authority made here, at test time (rcgen).

mod support;

use std::process::Command;
use std::time::Duration;

use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{ConnectOptions, LeaseOutcome, SetId, Store};
use support::redis::{self, TlsRedis};

fn opts() -> ConnectOptions {
    ConnectOptions {
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(3),
    }
}

/// `lanekeeper <args>` with a clean TLS environment; (success, stdout + stderr).
fn lanekeeper(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(support::process::lanekeeper_bin());
    cmd.args(args)
        .env_remove("SSL_CERT_FILE")
        .env_remove("SSL_CERT_DIR")
        .env_remove("LANEKEEPER_REDIS_PASSWORD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run lanekeeper");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Enqueue, lease and ack one envelope, and see a wake-up arrive over the
/// store's own pub/sub connection: the whole data plane on this connection.
async fn round_trip(store: &Store) {
    use futures::StreamExt;
    let q = QueueId::Shard(0);
    store
        .configure_queue(q, &QueuePolicy::default())
        .await
        .unwrap();
    let wakeups = store.wakeups(q).await.expect("subscribe over TLS");
    let mut wakeups = std::pin::pin!(wakeups);
    // The subscription is in place once SUBSCRIBE answered; enqueue wakes it.
    let out = store
        .enqueue(q, &support::dataplane::env("acme", 1))
        .await
        .unwrap();
    assert!(
        matches!(out, lanekeeper::store::EnqueueOutcome::Queued { .. }),
        "{out:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), wakeups.next())
        .await
        .expect("a wake-up within 5 s")
        .expect("the wake-up stream is open");
    let lease = match store.lease(q, "w", Duration::from_secs(30)).await.unwrap() {
        LeaseOutcome::Leased(l) => l,
        other => panic!("expected a lease, got {other:?}"),
    };
    assert_eq!(lease.tenant, "acme");
    assert!(store.ack(&lease, Duration::from_millis(5)).await.unwrap());
}

#[tokio::test]
async fn rediss_with_a_ca_from_a_file_carries_the_whole_data_plane() {
    let r = TlsRedis::start("no", &[]);
    let store = Store::connect_tls(
        &r.url(""),
        SetId::new("tls", "ca-file"),
        opts(),
        Some(r.pki.tls(false)),
    )
    .await
    .expect("connect with the test CA");
    round_trip(&store).await;
    // The TLS port really is TLS: the plain-text client cannot talk to it.
    let plain = Store::connect(
        &format!("redis://127.0.0.1:{}/", r.tls_port),
        SetId::new("tls", "plain"),
        opts(),
    )
    .await;
    let refused = match plain {
        Err(_) => true,
        Ok(s) => s.ping().await.is_err(),
    };
    assert!(refused, "a plain-text client spoke to the TLS port");
}

#[tokio::test]
async fn an_untrusted_server_certificate_is_refused_and_the_error_keeps_the_password() {
    let r = TlsRedis::start("no", &[]);
    // No CA: the system roots, which do not hold the test CA.
    let err = match Store::connect_tls(
        &r.url(":s3cret-pw@"),
        SetId::new("tls", "untrusted"),
        opts(),
        None,
    )
    .await
    {
        Err(e) => e.to_string(),
        Ok(s) => match s.ping().await {
            Err(e) => e.to_string(),
            Ok(()) => panic!("connected to a server whose CA is not trusted"),
        },
    };
    assert!(
        err.to_lowercase().contains("certificate") || err.contains("UnknownIssuer"),
        "{err}"
    );
    assert!(!err.contains("s3cret-pw"), "the password leaked: {err}");

    // A CA for a plain-text URL is a mistake, said so.
    let err = Store::connect_tls(
        "redis://127.0.0.1:1/",
        SetId::new("tls", "mismatch"),
        opts(),
        Some(r.pki.tls(false)),
    )
    .await
    .err()
    .expect("a CA with redis:// is refused")
    .to_string();
    assert!(err.contains("not a rediss:// URL"), "{err}");
}

#[tokio::test]
async fn the_binary_trusts_the_system_roots_or_a_ca_file() {
    let r = TlsRedis::start("no", &[]);
    let store = Store::connect_tls(
        &r.url(""),
        SetId::new("tls", "cli"),
        opts(),
        Some(r.pki.tls(false)),
    )
    .await
    .unwrap();
    store.set_shards(8).await.unwrap();
    let url = r.url("");
    let ca = r.pki.ca.display().to_string();
    let route = ["route", "--redis", &url, "--shard-set", "tls/cli", "acme"];
    let want = format!("acme\t{}", lanekeeper::routing::hash_shard("acme", 8));

    // The system roots alone do not trust the test CA: refused, saying why.
    let (ok, out) = lanekeeper(&route, &[]);
    assert!(!ok, "{out}");
    assert!(out.to_lowercase().contains("certificate"), "{out}");
    // The system roots as the platform configures them (SSL_CERT_FILE, as a
    // distroless image's /etc/ssl/certs would be): trusted.
    let (ok, out) = lanekeeper(&route, &[("SSL_CERT_FILE", &ca)]);
    assert!(ok && out.contains(&want), "{out}");
    // A CA file (a ShardSet's tls.caSecretRef, mounted): trusted.
    let mut with_ca = route.to_vec();
    with_ca.extend(["--redis-ca-file", &ca]);
    let (ok, out) = lanekeeper(&with_ca, &[]);
    assert!(ok && out.contains(&want), "{out}");
    // A file that is no PEM: named.
    let not_pem = r.pki.dir.join("not-a-ca.txt");
    std::fs::write(&not_pem, "hello").unwrap();
    let bad = not_pem.display().to_string();
    let mut with_bad = route.to_vec();
    with_bad.extend(["--redis-ca-file", &bad]);
    let (ok, out) = lanekeeper(&with_bad, &[]);
    assert!(
        !ok && out.contains("not-a-ca.txt") && out.contains("PEM"),
        "{out}"
    );
}

#[tokio::test]
async fn a_client_certificate_is_presented_when_redis_asks_for_one() {
    let r = TlsRedis::start("yes", &[]);
    let without = Store::connect_tls(
        &r.url(""),
        SetId::new("tls", "mtls"),
        opts(),
        Some(r.pki.tls(false)),
    )
    .await;
    let refused = match without {
        Err(_) => true,
        Ok(s) => s.ping().await.is_err(),
    };
    assert!(refused, "a client without a certificate was let in");
    let store = Store::connect_tls(
        &r.url(""),
        SetId::new("tls", "mtls"),
        opts(),
        Some(r.pki.tls(true)),
    )
    .await
    .expect("connect with the client certificate");
    round_trip(&store).await;
    store.set_shards(2).await.unwrap();
    let url = r.url("");
    let (ca, cert, key) = (
        r.pki.ca.display().to_string(),
        r.pki.client_cert.display().to_string(),
        r.pki.client_key.display().to_string(),
    );
    let (ok, out) = lanekeeper(
        &[
            "route",
            "--redis",
            &url,
            "--shard-set",
            "tls/mtls",
            "--redis-ca-file",
            &ca,
            "--redis-client-cert-file",
            &cert,
            "--redis-client-key-file",
            &key,
            "acme",
        ],
        &[],
    );
    assert!(ok, "{out}");
    // A certificate without its key is refused before any connection.
    let (ok, out) = lanekeeper(
        &[
            "route",
            "--redis",
            &url,
            "--shard-set",
            "tls/mtls",
            "--redis-client-cert-file",
            &cert,
            "acme",
        ],
        &[],
    );
    assert!(!ok && out.contains("redis-client-key-file"), "{out}");
}

/// The ACL line of the README's Redis section, with `password` in it.
pub fn readme_acl(password: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.trim_start().starts_with("ACL SETUSER lanekeeper "))
        .expect("README.md gives the lanekeeper ACL as one `ACL SETUSER lanekeeper ...` line");
    line.split_whitespace()
        .map(|w| {
            if w == ">CHANGE-ME" {
                format!(">{password}")
            } else {
                w.to_string()
            }
        })
        .collect()
}

#[tokio::test]
async fn the_readme_acl_is_all_ingest_workers_and_the_controller_need() {
    let r = TlsRedis::start("no", &[]);
    let acl = readme_acl("acl-pw");
    let args: Vec<&str> = acl.iter().map(String::as_str).collect();
    assert_eq!(redis::cli(&r.redis, &args).trim(), "OK");
    assert_eq!(redis::cli(&r.redis, &["ACL", "LOG", "RESET"]).trim(), "OK");

    // The store as the ACL user, over TLS, as the controller uses it.
    let url = lanekeeper::store::with_password(
        &lanekeeper::store::with_username(&r.url(""), "lanekeeper").unwrap(),
        "acl-pw",
    )
    .unwrap();
    let store = Store::connect_tls(
        &url,
        SetId::new("acl", "hooks"),
        opts(),
        Some(r.pki.tls(false)),
    )
    .await
    .expect("connect as the ACL user");
    store.set_shards(1).await.unwrap();
    store.pin("pinned", QueueId::Lane(0)).await.unwrap();
    store.unpin("pinned").await.unwrap();
    round_trip(&store).await;
    store
        .tenant_stats(QueueId::Shard(0), Duration::from_secs(60))
        .await
        .unwrap();
    // Dead letters (a stream per tenant, retention) and their replay.
    store
        .enqueue(QueueId::Shard(0), &support::dataplane::env("dl", 1))
        .await
        .unwrap();
    if let LeaseOutcome::Leased(l) = store
        .lease(QueueId::Shard(0), "w", Duration::from_secs(30))
        .await
        .unwrap()
    {
        store
            .nack(
                &l,
                Duration::ZERO,
                &lanekeeper::store::Failure::dead("gone"),
            )
            .await
            .unwrap();
    }
    store
        .dead_letters(QueueId::Shard(0), "dl", None, 10)
        .await
        .unwrap();
    store
        .replay_dead(QueueId::Shard(0), "dl", &[])
        .await
        .unwrap()
        .unwrap();
    store.maintain(QueueId::Shard(0), 32).await.unwrap();
    store.dead_letters_dropped(QueueId::Shard(0)).await.unwrap();
    // Lane moves and reshards take turns (the gate in the routing hash).
    assert!(store.lane_move_begin(0, "lane").await.unwrap());
    store.lane_move_end(0, "lane").await.unwrap();
    assert_eq!(store.reshard_begin(&[]).await.unwrap(), Ok(()));
    store.reshard_end().await.unwrap();
    // What the relocation phases and a reshard do.
    let (s0, l0) = (QueueId::Shard(0), QueueId::Lane(0));
    store
        .configure_queue(l0, &QueuePolicy::default())
        .await
        .unwrap();
    store.fence_routing(s0, 1).await.unwrap();
    store.residents(s0).await.unwrap();
    store.pause(s0, "mover").await.unwrap();
    store.tenant_state(s0, "mover").await.unwrap();
    store
        .tenant_activity(s0, "acme", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(store.mark_moved(s0, "mover", l0).await.unwrap());
    store.move_hold(s0, l0, "mover").await.unwrap();
    store.resume(l0, "mover").await.unwrap();
    let settings = store.redis_settings().await.unwrap();
    assert!(settings[0].via_config, "{settings:?}");

    // Ingest and a worker as the ACL user over TLS, delivering to a receiver.
    let setup = support::scenario::Setup {
        store: store.clone(),
        set: "acl/hooks".into(),
        redis_url: r.url(""),
        receiver: support::receiver::Receiver::start(),
    };
    setup.endpoint("acme", "ok", 1).await;
    let ca = r.pki.ca.display().to_string();
    let plain_url = r.url("");
    let flags = [
        "--redis-username",
        "lanekeeper",
        "--redis-password",
        "acl-pw",
        "--redis-ca-file",
        &ca,
    ];
    let ingest = support::workers::Ingest::spawn(&plain_url, "acl/hooks", &flags);
    let mut wflags = support::workers::LOCAL_ARGS.to_vec();
    wflags.extend(flags);
    let worker = support::workers::spawn(&plain_url, "acl/hooks", "shard-00", &wflags);
    let http = reqwest::Client::new();
    for n in 0..20 {
        let res = http
            .post(format!("{}/v1/events", ingest.base()))
            .bearer_auth(&ingest.key)
            .header("content-type", "application/json")
            .body(
                serde_json::json!({"tenant": "acme", "id": format!("acl-{n}"), "payload": {"seq": n, "sent_ms": 0}})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    }
    setup.wait_for_accepted(20, Duration::from_secs(30)).await;
    support::scenario::stop(worker);
    support::scenario::stop(ingest.pid);

    // Nothing lanekeeper did was refused...
    let log = redis::cli(&r.redis, &["ACL", "LOG"]);
    assert!(
        log.trim().is_empty(),
        "the README's ACL refused something lanekeeper did:\n{log}"
    );
    // ...and the user can do little else: no other keys, no FLUSHALL, no CONFIG SET.
    let as_user = |args: &[&str]| {
        let mut a = vec![
            "--user",
            "lanekeeper",
            "--pass",
            "acl-pw",
            "--no-auth-warning",
        ];
        a.extend_from_slice(args);
        redis::cli(&r.redis, &a)
    };
    assert!(as_user(&["GET", "other:key"]).contains("NOPERM"));
    assert!(as_user(&["FLUSHALL"]).contains("NOPERM"));
    assert!(as_user(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]).contains("NOPERM"));
    assert!(as_user(&["KEYS", "*"]).contains("NOPERM"));
    assert!(as_user(&["FUNCTION", "FLUSH"]).contains("NOPERM"));
    assert!(as_user(&["PUBLISH", "other", "x"]).contains("NOPERM"));
}

#[test]
fn no_openssl_comes_in() {
    // TLS is rustls (ring) only: nothing links OpenSSL or a native TLS stack.
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap();
    for crate_name in [
        "openssl-sys",
        "openssl",
        "native-tls",
        "aws-lc-sys",
        "aws-lc-rs",
    ] {
        assert!(
            !lock.contains(&format!("name = \"{crate_name}\"\n")),
            "Cargo.lock has {crate_name}"
        );
    }
    assert!(lock.contains("name = \"tokio-rustls\"\n"));
}
