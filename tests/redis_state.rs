//! A set whose routing table is missing (a Redis restarted empty, or a set
//! the controller has not written yet): nobody routes by the empty table.
//! Ingest answers 503 "routing table missing" instead of hashing every
//! tenant to shard-00, and a worker leases nothing until the table is back.

mod support;

use std::time::{Duration, Instant};

use lanekeeper::ingest::{auth, Config, Ingest};
use lanekeeper::policy::QueuePolicy;
use lanekeeper::routing::QueueId;
use lanekeeper::store::{SetId, Store};
use lanekeeper::telemetry::IngestMetrics;

#[tokio::test]
async fn ingest_refuses_to_route_by_a_missing_table() {
    let redis = support::redis::shared();
    let store = Store::connect(
        &redis.url,
        SetId::new("state", "ingest"),
        Default::default(),
    )
    .await
    .unwrap();
    let key = auth::generate_key();
    let dir = support::process::scratch_dir("state-keys");
    let keys_file = dir.join("keys.yaml");
    std::fs::write(
        &keys_file,
        format!(
            "keys:\n  - {{name: ops, sha256: {}, admin: true}}\n",
            auth::hash_key_hex(&key)
        ),
    )
    .unwrap();
    let keys = auth::Keys::load(&keys_file).unwrap();
    let ingest = Ingest::new(
        store.clone(),
        keys,
        Config::default(),
        IngestMetrics::default(),
    );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (addr, _task) = lanekeeper::ingest::serve("127.0.0.1:0".parse().unwrap(), ingest, async {
        let _ = rx.await;
    })
    .await
    .unwrap();
    let ep = lanekeeper::endpoint::Endpoint {
        url: "https://example.com/hook".into(),
        secrets: vec![lanekeeper::signing::Secret::generate()],
        enabled: true,
        event_types: vec![],
    };
    store.put_endpoint("acme", "default", &ep).await.unwrap();
    let http = reqwest::Client::new();
    let post = || {
        http.post(format!("http://{addr}/v1/events"))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(serde_json::json!({"tenant": "acme", "id": "e1", "payload": {}}).to_string())
            .send()
    };
    let res = post().await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(
        res.headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    let body = res.text().await.unwrap();
    assert!(body.contains("routing table missing"), "{body}");
    // Nothing was stored anywhere, shard-00 included.
    let st = store.tenant_state(QueueId::Shard(0), "acme").await.unwrap();
    assert_eq!(st.queued, 0);
    // Dead letters and stats do not guess a queue either.
    let res = http
        .get(format!("http://{addr}/v1/tenants/acme/dead-letters"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 503);

    // The controller writes the table: accepted, where it routes.
    store.set_shards(4).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await; // ingest's routing cache
    let res = post().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let _ = tx.send(());
}

#[tokio::test]
async fn a_worker_leases_nothing_while_the_table_is_missing() {
    let redis = support::redis::shared();
    let s =
        support::scenario::setup_named(&redis.url, "state-worker", QueuePolicy::default()).await;
    s.endpoint("acme", "ok", 1).await;
    // The table goes (as after FLUSHALL), but an envelope is in the queue
    // (a producer whose cached table was still good put it there).
    let mut conn = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let routing_key = lanekeeper::store::keys::routing(&SetId::new("worker", "state-worker"));
    let _: () = redis::cmd("DEL")
        .arg(routing_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    s.send("acme", 0..3).await;
    let pid = s.worker(&[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        s.accepted().is_empty(),
        "the worker delivered while the routing table was missing"
    );
    // Restored: delivered.
    s.store.set_shards(1).await.unwrap();
    let started = Instant::now();
    s.wait_for_accepted(3, Duration::from_secs(10)).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    support::scenario::stop(pid);
}
