//! The ingest API against a real redis-server, over real HTTP on loopback:
//! every status code it answers, fan-out, idempotency under concurrency,
//! backpressure isolation, a Redis outage, key rotation, and the binary's
//! start and graceful stop.

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lanekeeper::ingest::{auth, BacklogLimits, Config, Ingest};
use lanekeeper::routing::QueueId;
use lanekeeper::store::{ConnectOptions, Failure, LeaseOutcome, SetId, Store};
use lanekeeper::telemetry::IngestMetrics;
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Api {
    base: String,
    http: reqwest::Client,
    store: Store,
    acme: String,
    globex: String,
    admin: String,
    keys_file: std::path::PathBuf,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn key_entry(name: &str, key: &str, scope: &str) -> String {
    format!(
        "  - {{name: {name}, sha256: {}, {scope}}}\n",
        auth::hash_key_hex(key)
    )
}

async fn api_on(redis_url: &str, config: Config) -> Api {
    static N: AtomicU32 = AtomicU32::new(0);
    let set = SetId::new("ingest", format!("s{}", N.fetch_add(1, Ordering::Relaxed)));
    let store = Store::connect(
        redis_url,
        set,
        ConnectOptions {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
        },
    )
    .await
    .unwrap();
    store.set_shards(4).await.unwrap();
    let (acme, globex, admin) = (
        auth::generate_key(),
        auth::generate_key(),
        auth::generate_key(),
    );
    let dir = support::process::scratch_dir("ingest");
    let keys_file = dir.join("keys.yaml");
    std::fs::write(
        &keys_file,
        format!(
            "keys:\n{}{}{}",
            key_entry("acme", &acme, "tenant: acme"),
            key_entry("globex", &globex, "tenant: globex"),
            key_entry("ops", &admin, "admin: true")
        ),
    )
    .unwrap();
    let keys = auth::Keys::load(&keys_file).unwrap();
    keys.watch(Duration::from_millis(100));
    let ingest = Ingest::new(store.clone(), keys, config, IngestMetrics::default());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (addr, _task) = lanekeeper::ingest::serve("127.0.0.1:0".parse().unwrap(), ingest, async {
        let _ = rx.await;
    })
    .await
    .unwrap();
    Api {
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        store,
        acme,
        globex,
        admin,
        keys_file,
        _stop: tx,
    }
}

async fn api(config: Config) -> Api {
    api_on(&support::redis::shared().url, config).await
}

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value, reqwest::header::HeaderMap) {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let res = req.send().await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.unwrap();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, v, headers)
    }

    async fn post(&self, key: &str, body: Value) -> (StatusCode, Value) {
        let (s, v, _) = self
            .call(reqwest::Method::POST, "/v1/events", Some(key), Some(body))
            .await;
        (s, v)
    }

    async fn raw(
        &self,
        key: &str,
        path: &str,
        content_type: &str,
        body: &str,
    ) -> (StatusCode, Value) {
        let res = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(key)
            .header("content-type", content_type)
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = res.status();
        let text = res.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn endpoint(&self, tenant: &str, name: &str, event_types: &[&str]) {
        let (s, v, _) = self
            .call(
                reqwest::Method::PUT,
                &format!("/v1/tenants/{tenant}/endpoints/{name}"),
                Some(&self.admin),
                Some(json!({"url": format!("https://{tenant}.example/{name}"), "eventTypes": event_types})),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }

    async fn queue_of(&self, tenant: &str) -> QueueId {
        self.store.routing().await.unwrap().route(tenant)
    }
}

fn err_field(v: &Value) -> &str {
    v["field"].as_str().unwrap_or("")
}

/// Every route of the API's one route list (`ROUTES`, which the router is
/// built from) refuses a caller without a key (401), a key of another
/// tenant (403, with nothing written), and, for `/v1/tenants/{tenant}/...`,
/// an invalid tenant even with the admin key (400 naming `tenant`): a tenant
/// handler written without the `Tenant` extractor fails here.
#[tokio::test]
async fn every_route_refuses_a_caller_without_a_key_or_for_another_tenant() {
    let a = api(Config::default()).await;
    assert_eq!(lanekeeper::ingest::ROUTES.len(), 18);
    for (method, path) in lanekeeper::ingest::ROUTES.iter() {
        let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let body = match (*method, path.as_str()) {
            (_, "/v1/events") => Some(json!({"tenant": "acme", "payload": {}})),
            (_, "/v1/events:batch") => Some(json!([{"tenant": "acme", "payload": {}}])),
            ("put", _) => Some(json!({"url": "https://acme.example/hook"})),
            ("post", _) => Some(json!({})),
            _ => None,
        };
        let at = |tenant: &str| {
            path.replace("{tenant}", tenant)
                .replace("{endpoint}", "default")
        };
        let (s, v, _) = a.call(m.clone(), &at("acme"), None, body.clone()).await;
        assert_eq!(
            s,
            StatusCode::UNAUTHORIZED,
            "{method} {path} without a key: {v}"
        );
        assert_eq!(v["code"], "unauthorized", "{method} {path}: {v}");
        let (s, v, _) = a
            .call(m.clone(), &at("acme"), Some(&a.globex), body.clone())
            .await;
        if path == "/v1/events:batch" {
            assert_eq!(s, StatusCode::OK, "{method} {path}: {v}");
            assert_eq!(v["items"][0]["status"], 403, "{method} {path}: {v}");
        } else {
            assert_eq!(
                s,
                StatusCode::FORBIDDEN,
                "{method} {path} for another tenant: {v}"
            );
            assert_eq!(v["code"], "forbidden", "{method} {path}: {v}");
        }
        if path.contains("{tenant}") {
            let (s, v, _) = a.call(m, &at("-acme"), Some(&a.admin), body).await;
            assert_eq!(
                s,
                StatusCode::BAD_REQUEST,
                "{method} {path} for tenant -acme: {v}"
            );
            assert_eq!(err_field(&v), "tenant", "{method} {path}: {v}");
        }
    }
    // Nothing of it was written.
    assert!(a.store.endpoints("acme").await.unwrap().is_empty());
}

#[tokio::test]
async fn events_are_validated_authorized_and_enqueued() {
    let a = api(Config {
        max_payload_bytes: 1024,
        ..Default::default()
    })
    .await;
    a.endpoint("acme", "default", &[]).await;

    // 202: stored where the tenant routes, with its id.
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "payload": {"n": 1}, "id": "evt-1"}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let q = a.queue_of("acme").await;
    assert_eq!(v["id"], "evt-1");
    assert_eq!(v["queue"], q.to_string());
    assert_eq!(v["envelopes"][0]["status"], "queued");
    // The same id again: accepted, stored once.
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "payload": {"n": 1}, "id": "evt-1"}),
        )
        .await;
    assert_eq!(
        (s, v["envelopes"][0]["status"].as_str()),
        (StatusCode::ACCEPTED, Some("duplicate"))
    );
    assert_eq!(a.store.tenant_state(q, "acme").await.unwrap().queued, 1);

    // 401: no key, a malformed header, an unknown key.
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/events",
            None,
            Some(json!({"tenant": "acme", "payload": {}})),
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (s, _) = a
        .post("lk_not_a_key", json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // 403: a tenant key used for another tenant.
    let (s, v) = a
        .post(&a.globex, json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert!(v["message"]
        .as_str()
        .unwrap()
        .contains("may not act for tenant \"acme\""));

    // 400, naming the field: malformed JSON, unknown field, missing or bad tenant.
    let (s, v) = a
        .raw(&a.acme, "/v1/events", "application/json", "{\"tenant\": ")
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("malformed_json")),
        "{v}"
    );
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "payload": {}, "colour": "red"}),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("unknown field `colour`"),
        "{v}"
    );
    let (s, v) = a.post(&a.admin, json!({"payload": {}})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("missing field `tenant`"),
        "{v}"
    );
    let (s, v) = a
        .post(&a.admin, json!({"tenant": "ac\u{7}me", "payload": {}}))
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::BAD_REQUEST, "tenant"),
        "{v}"
    );
    let (s, v) = a
        .post(&a.admin, json!({"tenant": "x".repeat(300), "payload": {}}))
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::BAD_REQUEST, "tenant"),
        "{v}"
    );
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "payload": {}, "id": "has space"}),
        )
        .await;
    assert_eq!((s, err_field(&v)), (StatusCode::BAD_REQUEST, "id"), "{v}");
    // 413: payload over the limit.
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "payload": {"big": "x".repeat(2000)}}),
        )
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::PAYLOAD_TOO_LARGE, "payload"),
        "{v}"
    );
    // 422: an endpoint the tenant does not have.
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "endpoint": "nope", "payload": {}}),
        )
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "endpoint"),
        "{v}"
    );
    // Nothing half-written by any of the refusals.
    assert_eq!(a.store.tenant_state(q, "acme").await.unwrap().depth, 1);
}

#[tokio::test]
async fn an_event_type_fans_out_to_the_endpoints_that_take_it() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "billing", &["invoice.paid"]).await;
    a.endpoint("acme", "audit", &[]).await;
    a.endpoint("acme", "users", &["user.created"]).await;
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "acme", "eventType": "invoice.paid", "payload": {}, "id": "inv-9"}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let mut got: Vec<(String, String)> = v["envelopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["endpoint"].as_str().unwrap().to_string(),
                e["id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("audit".to_string(), "inv-9.audit".to_string()),
            ("billing".to_string(), "inv-9.billing".to_string())
        ]
    );
    assert_eq!(v["id"], "inv-9");
    // No endpoint takes this type: 422 naming eventType.
    let (s, v) = a
        .post(
            &a.acme,
            json!({"tenant": "globex", "eventType": "x", "payload": {}}),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (s, v) = a
        .post(
            &a.admin,
            json!({"tenant": "globex", "eventType": "x", "payload": {}}),
        )
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "eventType"),
        "{v}"
    );
}

#[tokio::test]
async fn the_same_id_posted_concurrently_is_stored_once() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    let posts = (0..20).map(|_| {
        a.post(
            &a.acme,
            json!({"tenant": "acme", "payload": {}, "id": "once"}),
        )
    });
    let results = futures::future::join_all(posts).await;
    let statuses: Vec<&str> = results
        .iter()
        .map(|(s, v)| {
            assert_eq!(*s, StatusCode::ACCEPTED, "{v}");
            v["envelopes"][0]["status"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == "queued").count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == "duplicate").count(), 19);
    let q = a.queue_of("acme").await;
    assert_eq!(a.store.tenant_state(q, "acme").await.unwrap().queued, 1);
}

#[tokio::test]
async fn a_whale_over_its_backlog_limit_gets_429_and_small_tenants_do_not_notice() {
    let mut backlog = BacklogLimits {
        default: Some(1000),
        ..Default::default()
    };
    backlog.overrides.insert("whale".into(), 50);
    let a = api(Config {
        backlog,
        ..Default::default()
    })
    .await;
    a.endpoint("whale", "default", &[]).await;
    a.endpoint("small", "default", &[]).await;
    // Baseline, in this test on this machine: the small tenant's posts alone.
    let mut alone = Vec::new();
    for i in 0..200 {
        let started = Instant::now();
        let (s, v) = a
            .post(
                &a.admin,
                json!({"tenant": "small", "payload": {"alone": i}}),
            )
            .await;
        alone.push(started.elapsed());
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    alone.sort();
    let (alone50, alone99) = (alone[alone.len() / 2], alone[alone.len() * 99 / 100]);
    let batch: Vec<Value> = (0..50)
        .map(|i| json!({"tenant": "whale", "payload": {"n": i}}))
        .collect();
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/events:batch",
            Some(&a.admin),
            Some(Value::Array(batch)),
        )
        .await;
    assert_eq!(
        (s, v["accepted"].as_u64()),
        (StatusCode::OK, Some(50)),
        "{v}"
    );
    let (s, v, headers) = a
        .call(
            reqwest::Method::POST,
            "/v1/events",
            Some(&a.admin),
            Some(json!({"tenant": "whale", "payload": {}})),
        )
        .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["code"], "backlog_full");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=3600).contains(&retry), "{retry}");
    // The whale keeps hammering; the small tenant's posts all succeed.
    let mut small = Vec::new();
    let mut refused = 0;
    for i in 0..200 {
        let (s, _) = a
            .post(&a.admin, json!({"tenant": "whale", "payload": {}}))
            .await;
        refused += (s == StatusCode::TOO_MANY_REQUESTS) as u32;
        let started = Instant::now();
        let (s, v) = a
            .post(&a.admin, json!({"tenant": "small", "payload": {"i": i}}))
            .await;
        small.push(started.elapsed());
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    assert_eq!(refused, 200);
    small.sort();
    let p50 = small[small.len() / 2];
    let p99 = small[small.len() * 99 / 100];
    eprintln!("small tenant's posts while the whale is refused: p50 {p50:?}, p99 {p99:?} (alone: p50 {alone50:?}, p99 {alone99:?})");
    // The whale's refusals are answered in between, never in front of the
    // small tenant's posts: the typical post is no slower, and the tail may
    // meet a few refreshes of the routing and endpoint caches (a Redis round
    // trip each, the p50's order): bounds in the machine's own units, not in
    // milliseconds tuned on one machine.
    assert!(
        p50 <= alone50 * 2,
        "p50 {p50:?} beside the whale vs {alone50:?} alone"
    );
    assert!(
        p99 <= (alone99 + alone50 * 10) * 2,
        "p99 {p99:?} beside the whale vs {alone99:?} alone (p50 {alone50:?})"
    );
    // Nothing of the refused posts was stored.
    let q = a.queue_of("whale").await;
    assert_eq!(a.store.tenant_state(q, "whale").await.unwrap().depth, 50);
}

#[tokio::test]
async fn batches_answer_per_item_as_a_json_array_or_ndjson() {
    let a = api(Config {
        max_batch_items: 5,
        ..Default::default()
    })
    .await;
    a.endpoint("acme", "default", &[]).await;
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/events:batch",
            Some(&a.acme),
            Some(json!([
                {"tenant": "acme", "payload": {"n": 0}, "id": "b-0"},
                {"tenant": "acme", "payload": {"n": 1}, "wat": true},
                {"tenant": "globex", "payload": {}},
                {"tenant": "acme", "endpoint": "nope", "payload": {}},
                {"tenant": "acme", "payload": {"n": 4}, "id": "b-4"}
            ])),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let statuses: Vec<u64> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, vec![202, 400, 403, 422, 202], "{v}");
    assert_eq!(v["items"][1]["error"]["field"], "items[1].wat", "{v}");
    assert_eq!(v["items"][3]["error"]["field"], "items[3].endpoint", "{v}");
    assert_eq!(
        (v["accepted"].as_u64(), v["rejected"].as_u64()),
        (Some(2), Some(3))
    );

    let nd = "{\"tenant\":\"acme\",\"payload\":{\"n\":5},\"id\":\"b-5\"}\n\n{\"tenant\":\"acme\",\"payload\":\n{\"tenant\":\"acme\",\"payload\":{},\"id\":\"b-0\"}\n";
    let (s, v) = a
        .raw(&a.acme, "/v1/events:batch", "application/x-ndjson", nd)
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 3, "{v}");
    assert_eq!(items[0]["envelopes"][0]["status"], "queued");
    assert_eq!(items[1]["error"]["code"], "malformed_json");
    assert_eq!(items[2]["envelopes"][0]["status"], "duplicate");

    // Not an array; too many items.
    let (s, v) = a
        .raw(
            &a.acme,
            "/v1/events:batch",
            "application/json",
            "{\"tenant\":\"acme\"}",
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let six = Value::Array(
        (0..6)
            .map(|_| json!({"tenant": "acme", "payload": {}}))
            .collect(),
    );
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/events:batch",
            Some(&a.acme),
            Some(six),
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
}

#[tokio::test]
async fn endpoints_are_managed_and_their_secret_shown_once() {
    let a = api(Config::default()).await;
    let path = "/v1/tenants/acme/endpoints/main";
    let (s, v, _) = a
        .call(
            reqwest::Method::PUT,
            path,
            Some(&a.acme),
            Some(json!({"url": "https://acme.example/hooks"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let secret = v["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"), "{secret}");
    let (s, v, _) = a
        .call(reqwest::Method::GET, path, Some(&a.acme), None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.get("secret").is_none(), "{v}");
    assert_eq!(
        (v["url"].as_str(), v["secrets"].as_u64()),
        (Some("https://acme.example/hooks"), Some(1))
    );
    let stored = a.store.endpoint("acme", "main").await.unwrap().unwrap();
    assert_eq!(stored.secrets, vec![secret]);
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/endpoints",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(
        (s, v.as_array().map(|l| l.len())),
        (StatusCode::OK, Some(1))
    );
    // Bad definitions name the field.
    let (s, v, _) = a
        .call(
            reqwest::Method::PUT,
            path,
            Some(&a.acme),
            Some(json!({"url": "ftp://acme.example"})),
        )
        .await;
    assert_eq!((s, err_field(&v)), (StatusCode::BAD_REQUEST, "url"), "{v}");
    let (s, v, _) = a
        .call(
            reqwest::Method::PUT,
            path,
            Some(&a.acme),
            Some(json!({"url": "https://a.example", "secret": "nope"})),
        )
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::BAD_REQUEST, "secret"),
        "{v}"
    );
    let (s, v, _) = a
        .call(
            reqwest::Method::PUT,
            "/v1/tenants/acme/endpoints/bad%20name",
            Some(&a.acme),
            Some(json!({"url": "https://a.example"})),
        )
        .await;
    assert_eq!(
        (s, err_field(&v)),
        (StatusCode::BAD_REQUEST, "endpoint"),
        "{v}"
    );
    // Another tenant's key may not touch it.
    let (s, _, _) = a
        .call(reqwest::Method::GET, path, Some(&a.globex), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, _) = a
        .call(reqwest::Method::DELETE, path, Some(&a.acme), None)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = a
        .call(reqwest::Method::DELETE, path, Some(&a.acme), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, _, _) = a
        .call(reqwest::Method::GET, path, Some(&a.acme), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn held_while_paused_and_routed_after_a_move() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    let q = a.queue_of("acme").await;
    a.store.pause(q, "acme").await.unwrap();
    let (s, v) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {"n": 1}}))
        .await;
    assert_eq!(
        (s, v["envelopes"][0]["status"].as_str()),
        (StatusCode::ACCEPTED, Some("held")),
        "{v}"
    );
    // Moved to lane 0: ingest's cached route answers MOVED and it follows.
    let lane = QueueId::Lane(0);
    a.store.pause(lane, "acme").await.unwrap();
    a.store.pin("acme", lane).await.unwrap();
    assert!(a.store.mark_moved(q, "acme", lane).await.unwrap());
    assert_eq!(a.store.move_hold(q, lane, "acme").await.unwrap(), 1);
    a.store.resume(lane, "acme").await.unwrap();
    let (s, v) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {"n": 2}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(
        (v["queue"].as_str(), v["envelopes"][0]["status"].as_str()),
        (Some("lane-0"), Some("queued"))
    );
    assert_eq!(a.store.tenant_state(lane, "acme").await.unwrap().queued, 2);
}

#[tokio::test]
async fn dead_letters_are_listed_and_replayed_and_stats_show_the_tenant() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    for i in 0..3 {
        let (s, v) = a
            .post(
                &a.acme,
                json!({"tenant": "acme", "payload": {"n": i}, "id": format!("d-{i}")}),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    let q = a.queue_of("acme").await;
    // Two fail for good, one is delivered.
    for i in 0..3 {
        let l = match a
            .store
            .lease(q, "t", Duration::from_secs(30))
            .await
            .unwrap()
        {
            LeaseOutcome::Leased(l) => l,
            other => panic!("{other:?}"),
        };
        if i < 2 {
            let f = Failure {
                cause: "HTTP 410 Gone",
                retry_in: None,
                endpoint_fault: false,
                pace: None,
            };
            a.store
                .nack(&l, Duration::from_millis(5), &f)
                .await
                .unwrap();
        } else {
            assert!(a.store.ack(&l, Duration::from_millis(5)).await.unwrap());
        }
    }
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/dead-letters",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let dead = v["items"].as_array().unwrap();
    assert_eq!(dead.len(), 2, "{v}");
    assert!(v.get("nextCursor").is_none(), "{v}");
    assert_eq!(dead[0]["cause"], "HTTP 410 Gone");
    let first = dead[0]["id"].as_str().unwrap().to_string();
    // Paged: one at a time, following nextCursor, oldest first.
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/dead-letters?limit=1",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["items"][0]["id"], first.as_str(), "{v}");
    let cursor = v["nextCursor"].as_str().unwrap().to_string();
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            &format!("/v1/tenants/acme/dead-letters?limit=1&cursor={cursor}"),
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["items"].as_array().unwrap().len(), 1, "{v}");
    assert_ne!(v["items"][0]["id"], first.as_str(), "{v}");
    // A cursor that no listing gave is a 400 naming the field.
    for bad in ["nonsense", "shard-00@1-x", "lane-9@-"] {
        let (s, v, _) = a
            .call(
                reqwest::Method::GET,
                &format!("/v1/tenants/acme/dead-letters?cursor={bad}"),
                Some(&a.acme),
                None,
            )
            .await;
        assert_eq!(
            (s, v["field"].as_str()),
            (StatusCode::BAD_REQUEST, Some("cursor")),
            "{bad}: {v}"
        );
    }
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/stats",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["delivered"].as_u64(),
            v["failed"].as_u64(),
            v["depth"].as_u64()
        ),
        (Some(1), Some(2), Some(0)),
        "{v}"
    );
    assert!(v["capacityShare"].as_f64().unwrap() > 0.99, "{v}");

    // Replay one by id, then the rest.
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/tenants/acme/dead-letters:replay",
            Some(&a.acme),
            Some(json!({"ids": [first]})),
        )
        .await;
    assert_eq!(
        (s, v["replayed"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{v}"
    );
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/tenants/acme/dead-letters:replay",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(
        (s, v["replayed"].as_u64()),
        (StatusCode::OK, Some(1)),
        "{v}"
    );
    let st = a.store.tenant_state(q, "acme").await.unwrap();
    assert_eq!((st.queued, st.depth), (2, 2));
    let l = match a
        .store
        .lease(q, "t", Duration::from_secs(30))
        .await
        .unwrap()
    {
        LeaseOutcome::Leased(l) => l,
        other => panic!("{other:?}"),
    };
    assert_eq!((l.id.as_str(), l.attempts), (first.as_str(), 0));
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/stats?window=60",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(
        (s, v["inFlight"].as_u64(), v["queued"].as_u64()),
        (StatusCode::OK, Some(1), Some(1)),
        "{v}"
    );
    assert!(v["oldestWaitMs"].as_u64().is_some(), "{v}");
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/stats?colour=1",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
}

#[tokio::test]
async fn a_redis_outage_answers_503_quickly_and_readyz_follows() {
    let redis = support::redis::dedicated();
    let a = api_on(
        &redis.url,
        Config {
            redis_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .await;
    a.endpoint("acme", "default", &[]).await;
    let (s, _, _) = a.call(reqwest::Method::GET, "/readyz", None, None).await;
    assert_eq!(s, StatusCode::OK);
    support::redis::kill(&redis);
    let started = Instant::now();
    let (s, v, headers) = a
        .call(
            reqwest::Method::POST,
            "/v1/events",
            Some(&a.acme),
            Some(json!({"tenant": "acme", "endpoint": "default", "payload": {}})),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(headers["retry-after"], "1");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    let (s, _, _) = a.call(reqwest::Method::GET, "/readyz", None, None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let (s, _, _) = a.call(reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);
    // Back up: ready again, and posts succeed.
    let _again = support::redis::start_on(redis.port);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, _, _) = a.call(reqwest::Method::GET, "/readyz", None, None).await;
        if s == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "not ready again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn keys_rotate_without_a_restart() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    let new_key = auth::generate_key();
    std::fs::write(
        &a.keys_file,
        format!("keys:\n{}", key_entry("acme-2", &new_key, "tenant: acme")),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, _) = a
            .post(&new_key, json!({"tenant": "acme", "payload": {}}))
            .await;
        if s == StatusCode::ACCEPTED {
            break;
        }
        assert!(Instant::now() < deadline, "the new key never worked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (s, _) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "the removed key still works");
    // A broken file keeps the keys in force.
    std::fs::write(&a.keys_file, "keys: [oops").unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, _) = a
        .post(&new_key, json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
}

#[tokio::test]
async fn openapi_and_metrics_are_served() {
    let a = api(Config::default()).await;
    let (s, v, _) = a
        .call(reqwest::Method::GET, "/v1/openapi.json", None, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["paths"]["/v1/events"]["post"].is_object(), "{v}");
    assert!(v["components"]["schemas"]["EventIn"].is_object());
    let _ = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {}}))
        .await;
    let (s, v, _) = a.call(reqwest::Method::GET, "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let text = v.as_str().unwrap();
    assert!(
        text.contains(r#"lanekeeper_ingest_requests_total{route="post /v1/events",code="422"} 1"#),
        "{text}"
    );
}

#[test]
fn the_binary_serves_until_sigterm_then_exits_cleanly() {
    let redis = support::redis::shared();
    let ingest = support::workers::Ingest::spawn(
        &redis.url,
        "ingest/bin",
        &["--backlog-limit-for", "whale=10"],
    );
    let (pid, log) = (ingest.pid, &ingest.log);
    support::process::signal(pid, libc::SIGTERM);
    let exit = support::process::wait_exit(pid, Duration::from_secs(10));
    assert_eq!(exit, Some(Some(0)), "{}", support::process::tail(log, 20));
}

/// The tier a tenant's queue state holds (`tr`), as enqueue wrote it.
async fn queue_tier(a: &Api, tenant: &str) -> Option<String> {
    let q = a.queue_of(tenant).await;
    let p = lanekeeper::store::keys::queue_prefix(a.store.set(), q);
    let client = redis::Client::open(support::redis::shared().url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("HGET")
        .arg(lanekeeper::store::keys::tenant(&p, tenant))
        .arg("tr")
        .query_async(&mut conn)
        .await
        .unwrap()
}

impl Api {
    async fn tiers(&self, key: &str, body: &str) -> (StatusCode, Value) {
        self.raw(key, "/v1/admin/tiers", "text/plain", body).await
    }
}

/// The ConfigMap's assignments (as the controller syncs them) reach a
/// tenant's queue with its next event; the API's win over them, and
/// clearing the API's gives the ConfigMap's back.
#[tokio::test]
async fn config_map_tiers_reach_the_queue_and_the_api_wins() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    let synced = a
        .store
        .sync_config_tiers(
            "lanekeeper-tiers/1",
            &std::collections::BTreeMap::from([("acme".to_string(), "silver".to_string())]),
        )
        .await
        .unwrap();
    assert_eq!((synced.set, synced.removed), (1, 0));
    let post = || async {
        let (s, _) = a
            .post(&a.acme, json!({"tenant": "acme", "payload": {}}))
            .await;
        assert_eq!(s, StatusCode::ACCEPTED);
    };
    post().await;
    assert_eq!(queue_tier(&a, "acme").await.as_deref(), Some("silver"));
    let (s, _) = a.tiers(&a.admin, "acme gold\n").await;
    assert_eq!(s, StatusCode::OK);
    post().await;
    assert_eq!(queue_tier(&a, "acme").await.as_deref(), Some("gold"));
    let (s, _) = a.tiers(&a.admin, "acme -\n").await;
    assert_eq!(s, StatusCode::OK);
    post().await;
    assert_eq!(queue_tier(&a, "acme").await.as_deref(), Some("silver"));
    // The ConfigMap drops it: after the cache's second, the queue has none.
    a.store
        .sync_config_tiers("lanekeeper-tiers/2", &Default::default())
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    post().await;
    assert_eq!(queue_tier(&a, "acme").await, None);
}

/// The admin tier API: one tenant's tier set, read and cleared, many at
/// once, each reaching the tenant's queue with its next event; tenant keys
/// refused, bad names refused naming the line with nothing written.
#[tokio::test]
async fn tiers_are_set_read_cleared_and_bulk_set_by_admin_keys_only() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    a.endpoint("globex", "default", &[]).await;
    let put = |key: &str, tenant: &str, tier: &str| {
        let (key, tenant, tier) = (key.to_string(), tenant.to_string(), tier.to_string());
        let a = &a;
        async move {
            let (s, v, _) = a
                .call(
                    reqwest::Method::PUT,
                    &format!("/v1/admin/tiers/{tenant}"),
                    Some(&key),
                    Some(json!({ "tier": tier })),
                )
                .await;
            (s, v)
        }
    };
    // a tenant key may not set a tier, not even its own tenant's
    for key in [&a.acme, &a.globex] {
        let (s, v) = put(key, "acme", "gold").await;
        assert_eq!(
            (s, v["code"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden")),
            "{v}"
        );
        let (s, _) = a.tiers(key, "acme gold\n").await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let (s, _, _) = a
            .call(
                reqwest::Method::GET,
                "/v1/admin/tiers/acme",
                Some(key),
                None,
            )
            .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    assert_eq!(
        a.store.tier_sources("acme").await.unwrap(),
        Default::default()
    );

    let (s, v) = put(&a.admin, "acme", "gold").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["tier"].as_str(), v["api"].as_str()),
        (Some("gold"), Some("gold")),
        "{v}"
    );
    let (s, _) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(queue_tier(&a, "acme").await.as_deref(), Some("gold"));
    // a tenant with no tier has none in its queue
    let (s, _) = a
        .post(&a.globex, json!({"tenant": "globex", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(queue_tier(&a, "globex").await, None);

    // odd tier names: 400 naming the field, nothing written
    for bad in [
        "",
        "-gold",
        "gold tier",
        "x=4",
        &"t".repeat(64),
        "g\u{202e}",
    ] {
        let (s, v) = put(&a.admin, "acme", bad).await;
        assert_eq!(
            (s, err_field(&v)),
            (StatusCode::BAD_REQUEST, "tier"),
            "{bad:?}: {v}"
        );
    }
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/admin/tiers/acme",
            Some(&a.admin),
            None,
        )
        .await;
    assert_eq!(
        (s, v["tier"].as_str()),
        (StatusCode::OK, Some("gold")),
        "{v}"
    );

    // clear: the tenant has no tier, and its queue follows at its next event
    let (s, v, _) = a
        .call(
            reqwest::Method::DELETE,
            "/v1/admin/tiers/acme",
            Some(&a.admin),
            None,
        )
        .await;
    assert_eq!((s, v["tier"].clone()), (StatusCode::OK, Value::Null), "{v}");
    let (s, _) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(queue_tier(&a, "acme").await, None);

    // bulk: many at once, '-' clears, the later line wins
    let (s, v) = a
        .tiers(
            &a.admin,
            "# tiers\nacme silver\n\nglobex gold\nglobex\tbronze\n",
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["set"].as_u64(), v["cleared"].as_u64()),
        (Some(3), Some(0)),
        "{v}"
    );
    assert_eq!(
        a.store.tier_sources("globex").await.unwrap().api.as_deref(),
        Some("bronze")
    );
    let (s, v) = a.tiers(&a.admin, "acme -\n").await;
    assert_eq!((s, v["cleared"].as_u64()), (StatusCode::OK, Some(1)), "{v}");
    assert_eq!(a.store.tier_sources("acme").await.unwrap().api, None);

    // a bad line refuses the call, naming the line and what is wrong; nothing is written
    for (body, line, says) in [
        ("acme gold\nglobex tier!x\n", "line 2", "tier \"tier!x\""),
        ("acme gold\n\n-x gold\n", "line 3", "tenant \"-x\""),
        ("acme gold silver\n", "line 1", "expected `<tenant> <tier>`"),
        ("acme\n", "line 1", "expected `<tenant> <tier>`"),
    ] {
        let (s, v) = a.tiers(&a.admin, body).await;
        assert_eq!(
            (s, err_field(&v)),
            (StatusCode::BAD_REQUEST, line),
            "{body:?}: {v}"
        );
        let m = v["message"].as_str().unwrap();
        assert!(
            m.contains(says) && m.contains("nothing was written"),
            "{body:?}: {m}"
        );
        assert_eq!(
            a.store.tier_sources("acme").await.unwrap().api,
            None,
            "{body:?}"
        );
    }
    let (s, v) = a.raw(&a.admin, "/v1/admin/tiers", "text/plain", "").await;
    assert_eq!((s, v["set"].as_u64()), (StatusCode::OK, Some(0)), "{v}");
}

/// 40,000 assignments in one bulk call: answered in seconds, and no Redis
/// call it makes takes 10 ms or more (SLOWLOG, calls on this set's keys).
#[tokio::test]
async fn forty_thousand_tiers_in_one_bulk_call_and_no_redis_call_over_10ms() {
    let a = api(Config::default()).await;
    let client = redis::Client::open(support::redis::shared().url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(1000)
        .arg("slowlog-max-len")
        .arg(4096)
        .query_async(&mut conn)
        .await
        .unwrap();
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 1;
    let tiers = ["free", "pro", "enterprise", "gold.eu", "tier_2"];
    let body: String = (0..40_000)
        .map(|i| format!("tenant-{i:05} {}\n", tiers[i % tiers.len()]))
        .collect();
    let started = Instant::now();
    let (s, v) = a.tiers(&a.admin, &body).await;
    let took = started.elapsed();
    assert_eq!(
        (s, v["set"].as_u64()),
        (StatusCode::OK, Some(40_000)),
        "{v}"
    );
    let key = lanekeeper::store::keys::tiers_api(a.store.set());
    let n: u64 = redis::cmd("HLEN")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 40_000);
    assert_eq!(
        a.store
            .tier_sources("tenant-00003")
            .await
            .unwrap()
            .api
            .as_deref(),
        Some("gold.eu")
    );
    // every slow call on this set's keys, from the log
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(4096)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut worst_us = 0i64;
    for entry in log {
        let redis::Value::Array(e) = entry else {
            continue;
        };
        let (
            Some(redis::Value::Int(at)),
            Some(redis::Value::Int(us)),
            Some(redis::Value::Array(args)),
        ) = (e.get(1), e.get(2), e.get(3))
        else {
            continue;
        };
        let ours = args
            .iter()
            .any(|a| matches!(a, redis::Value::BulkString(b) if b == key.as_bytes()));
        if ours && *at as u64 >= since {
            worst_us = worst_us.max(*us);
        }
    }
    eprintln!("bulk tiers: 40000 assignments in {took:?}; slowest Redis call on the set's keys {worst_us} us (0: none over 1 ms)");
    assert!(worst_us < 10_000, "a Redis call took {worst_us} us");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// A 100 MB body to the bulk call is refused 413 without being read.
#[tokio::test]
async fn a_100mb_tier_body_is_refused_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = api(Config::default()).await;
    let addr = a.base.trim_start_matches("http://").to_string();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST /v1/admin/tiers HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
        a.admin,
        100 * 1024 * 1024
    );
    wr.write_all(head.as_bytes()).await.unwrap();
    let writer = tokio::spawn(async move {
        let chunk = "tenant gold\n".repeat(87_382).into_bytes(); // about 1 MiB
        for _ in 0..100 {
            if wr.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(30), rd.read(&mut answer))
        .await
        .expect("an answer before the body is sent")
        .unwrap();
    let text = String::from_utf8_lossy(&answer[..n]).to_string();
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");
    writer.abort();
    assert_eq!(
        a.store.tier_sources("tenant").await.unwrap(),
        Default::default()
    );
}

#[tokio::test]
async fn a_shaped_tenant_gets_429_with_retry_after_and_a_reason_and_others_do_not() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    a.endpoint("globex", "default", &[]).await;
    let q = a.queue_of("acme").await;
    // What the promotion loop writes for a hot tenant whose lane waits at
    // the cap: 2 per second, a burst of 2.
    a.store
        .set_shaping(q, "acme", Some((2.0, 2.0)))
        .await
        .unwrap();
    for i in 0..2 {
        let (s, v) = a
            .post(&a.acme, json!({"tenant": "acme", "payload": {"i": i}}))
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    let (s, v, headers) = a
        .call(
            reqwest::Method::POST,
            "/v1/events",
            Some(&a.acme),
            Some(json!({"tenant": "acme", "payload": {"i": 2}})),
        )
        .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(
        (v["code"].as_str(), err_field(&v)),
        (Some("shaped"), "tenant"),
        "{v}"
    );
    assert!(
        v["message"].as_str().unwrap().contains("shaped at ingest"),
        "{v}"
    );
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert_eq!(
        retry, 1,
        "half a second at 2/s, rounded up to whole seconds"
    );
    // A batch: the tenant's items are refused, another tenant's taken.
    let (s, v, _) = a
        .call(
            reqwest::Method::POST,
            "/v1/events:batch",
            Some(&a.admin),
            Some(json!([{"tenant": "acme", "payload": {}}, {"tenant": "globex", "payload": {}}])),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["items"][0]["status"], 429, "{v}");
    assert_eq!(v["items"][0]["error"]["code"], "shaped", "{v}");
    assert_eq!(v["items"][1]["status"], 202, "{v}");
    // The refused event was not stored: after Retry-After it goes in.
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let (s, v) = a
        .post(&a.acme, json!({"tenant": "acme", "payload": {"i": 2}}))
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(a.store.tenant_state(q, "acme").await.unwrap().queued, 3);
    // Counted per tenant.
    let (_, v, _) = a.call(reqwest::Method::GET, "/metrics", None, None).await;
    let text = v.as_str().unwrap();
    assert!(
        text.contains(r#"lanekeeper_ingest_shaped_total{tenant="acme"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"lanekeeper_ingest_envelopes_total{outcome="shaped"} 2"#),
        "{text}"
    );
    // Lifted: taken at once.
    a.store.set_shaping(q, "acme", None).await.unwrap();
    for i in 0..20 {
        let (s, v) = a
            .post(&a.acme, json!({"tenant": "acme", "payload": {"n": i}}))
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
}

/// `lanekeeper tiers` with `args`, against the shared Redis and `set`.
fn tiers_cli(
    set: &lanekeeper::store::SetId,
    args: &[&str],
    stdin: Option<&str>,
) -> std::process::Output {
    use std::io::Write;
    let mut cmd = std::process::Command::new(support::process::lanekeeper_bin());
    cmd.arg("tiers")
        .args(args)
        .args([
            "--redis",
            &support::redis::shared().url,
            "--shard-set",
            &set.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    {
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).unwrap();
        }
    }
    child.wait_with_output().unwrap()
}

#[tokio::test]
async fn the_tiers_cli_applies_a_file_of_40000_all_or_nothing_and_ingest_sees_it() {
    let a = api(Config::default()).await;
    let set = a.store.set().clone();
    let dir = support::process::scratch_dir("tiers-cli");
    let file = dir.join("tiers.txt");
    let mut text = String::from("# tiers of every customer\n\n");
    for i in 0..40_000 {
        text.push_str(&format!(
            "cust-{i:05} {}\n",
            if i % 4 == 0 { "gold" } else { "free" }
        ));
    }
    std::fs::write(&file, &text).unwrap();
    let started = Instant::now();
    let out = tiers_cli(&set, &["apply", "--file", file.to_str().unwrap()], None);
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "set 40000, cleared 0"
    );
    eprintln!(
        "lanekeeper tiers apply: 40000 assignments from a file in {took:?}, process start included"
    );
    let s = a.store.tier_sources("cust-00004").await.unwrap();
    assert_eq!(s.api.as_deref(), Some("gold"));
    // `get` shows it and its source.
    let out = tiers_cli(&set, &["get", "cust-00004"], None);
    let shown = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        shown.contains("tier\tgold")
            && shown.contains("api\tgold")
            && shown.contains("configMap\t-"),
        "{shown}"
    );
    // The ingest admin API reads the same assignment.
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/admin/tiers/cust-00004",
            Some(&a.admin),
            None,
        )
        .await;
    assert_eq!(
        (s, v["tier"].as_str()),
        (StatusCode::OK, Some("gold")),
        "{v}"
    );
    // A bad line: the command fails naming the line, nothing is written
    // (cust-00001 keeps its tier though the file's first line clears it).
    let bad = "cust-00001 -\ncust-00002 platinum\nnot a line\ncust-00003 bad/tier\n";
    let out = tiers_cli(&set, &["apply", "--file", "-"], Some(bad));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("line 3") && err.contains("nothing was written") && err.contains("line 4"),
        "{err}"
    );
    assert_eq!(
        a.store
            .tier_sources("cust-00001")
            .await
            .unwrap()
            .api
            .as_deref(),
        Some("free")
    );
    assert_eq!(
        a.store
            .tier_sources("cust-00002")
            .await
            .unwrap()
            .api
            .as_deref(),
        Some("free")
    );
    // From stdin, a clear.
    let out = tiers_cli(
        &set,
        &["apply", "-f", "-"],
        Some("cust-00001 -\ncust-00002 platinum\n"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "set 1, cleared 1"
    );
    assert_eq!(a.store.tier_sources("cust-00001").await.unwrap().api, None);
    // A missing file names itself.
    let out = tiers_cli(&set, &["apply", "--file", "/nonexistent/tiers.txt"], None);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/tiers.txt"));
}

/// The admin pause routes (issue 21): a tenant key is refused, a bad tenant
/// or reason is refused naming the field with nothing done, a pause stops
/// leases while events are still accepted, show and stats say so, each
/// change is counted, logged and in the audit trail under the key's name,
/// and a resume serves the tenant again in order.
#[tokio::test]
async fn admin_keys_pause_show_and_resume_a_tenant_audited() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    let op = |key: String, path: String, body: Option<Value>| {
        let a = &a;
        async move {
            let (s, v, _) = a.call(reqwest::Method::POST, &path, Some(&key), body).await;
            (s, v)
        }
    };
    for key in [&a.acme, &a.globex] {
        let (s, v) = op(key.clone(), "/v1/admin/tenants/acme/pause".into(), None).await;
        assert_eq!(
            (s, v["code"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden")),
            "{v}"
        );
        let (s, _, _) = a
            .call(
                reqwest::Method::GET,
                "/v1/admin/tenants/acme",
                Some(key),
                None,
            )
            .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    let (s, v) = op(
        a.admin.clone(),
        "/v1/admin/tenants/bad%20tenant/pause".into(),
        None,
    )
    .await;
    assert_eq!(
        (s, v["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant")),
        "{v}"
    );
    let long = "x".repeat(300);
    for (reason, why) in [
        (long.as_str(), "300 bytes"),
        ("two\nlines", "control character"),
    ] {
        let (s, v) = op(
            a.admin.clone(),
            "/v1/admin/tenants/acme/pause".into(),
            Some(json!({ "reason": reason })),
        )
        .await;
        assert_eq!(
            (s, v["field"].as_str()),
            (StatusCode::BAD_REQUEST, Some("reason")),
            "{why}: {v}"
        );
    }
    let (s, v) = op(
        a.admin.clone(),
        "/v1/admin/tenants/acme/pause".into(),
        Some(json!({ "reasn": "typo" })),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "unknown field: {v}");
    let q = a.queue_of("acme").await;
    assert!(
        !a.store.tenant_state(q, "acme").await.unwrap().user_paused,
        "nothing was done by a refused call"
    );

    let (s, v) = op(
        a.admin.clone(),
        "/v1/admin/tenants/acme/pause".into(),
        Some(json!({ "reason": "endpoint down" })),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["paused"].as_bool(), v["changed"].as_bool()),
        (Some(true), Some(true)),
        "{v}"
    );
    assert_eq!(v["queue"], q.to_string());
    // Accepted while paused, not leased.
    for i in 0..3 {
        let (s, v) = a
            .post(
                &a.acme,
                json!({"tenant": "acme", "id": format!("p{i}"), "payload": {"seq": i}}),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    assert!(matches!(
        a.store
            .lease(q, "w", Duration::from_secs(30))
            .await
            .unwrap(),
        lanekeeper::store::LeaseOutcome::Empty { .. }
    ));
    let (s, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/admin/tenants/acme",
            Some(&a.admin),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["paused"].as_bool(), v["queued"].as_u64()),
        (Some(true), Some(3)),
        "{v}"
    );
    assert_eq!(v["audit"][0]["who"], "key:ops");
    assert_eq!(v["audit"][0]["operation"], "pause");
    let outcome = v["audit"][0]["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("endpoint down") && outcome.contains(&q.to_string()),
        "{outcome}"
    );
    let (_, v, _) = a
        .call(
            reqwest::Method::GET,
            "/v1/tenants/acme/stats",
            Some(&a.acme),
            None,
        )
        .await;
    assert_eq!(v["userPaused"], true, "{v}");

    let (s, v) = op(a.admin.clone(), "/v1/admin/tenants/acme/pause".into(), None).await;
    assert_eq!(
        (s, v["changed"].as_bool()),
        (StatusCode::OK, Some(false)),
        "{v}"
    );
    let (s, v) = op(
        a.admin.clone(),
        "/v1/admin/tenants/acme/resume".into(),
        None,
    )
    .await;
    assert_eq!(
        (s, v["paused"].as_bool(), v["changed"].as_bool()),
        (StatusCode::OK, Some(false), Some(true)),
        "{v}"
    );
    let mut seqs = Vec::new();
    while let lanekeeper::store::LeaseOutcome::Leased(l) = a
        .store
        .lease(q, "w", Duration::from_secs(30))
        .await
        .unwrap()
    {
        seqs.push(l.envelope().unwrap().payload["seq"].as_u64().unwrap());
        a.store.ack(&l, Duration::from_millis(1)).await.unwrap();
    }
    assert_eq!(seqs, vec![0, 1, 2]);

    let audit = a.store.audit_entries(Some("acme"), 10).await.unwrap();
    let ops: Vec<&str> = audit.iter().map(|e| e.operation.as_str()).collect();
    assert_eq!(
        ops,
        vec!["resume", "pause", "pause"],
        "refused calls are not recorded"
    );
    let (_, v, _) = a.call(reqwest::Method::GET, "/metrics", None, None).await;
    let text = v.as_str().unwrap();
    for line in [
        r#"lanekeeper_ingest_admin_operations_total{operation="pause",outcome="changed"} 1"#,
        r#"lanekeeper_ingest_admin_operations_total{operation="pause",outcome="unchanged"} 1"#,
        r#"lanekeeper_ingest_admin_operations_total{operation="resume",outcome="changed"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing: {text}");
    }
}

/// Purge and replay through the admin API: a tenant key is refused, bad
/// fields are named, a purge dead-letters the backlog (or drops it), a
/// replay brings it back in order, a purge mid-move is 409 and changes
/// nothing, and each is audited.
#[tokio::test]
async fn admin_purge_and_replay_name_bad_fields_refuse_mid_move_and_are_audited() {
    let a = api(Config::default()).await;
    a.endpoint("acme", "default", &[]).await;
    for i in 0..20 {
        let (s, v) = a
            .post(
                &a.acme,
                json!({"tenant": "acme", "id": format!("e{i}"), "payload": {"seq": i}}),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    }
    let op = |key: String, what: &'static str, body: Option<Value>| {
        let a = &a;
        async move {
            let (s, v, _) = a
                .call(
                    reqwest::Method::POST,
                    &format!("/v1/admin/tenants/acme/{what}"),
                    Some(&key),
                    body,
                )
                .await;
            (s, v)
        }
    };
    let (s, _) = op(a.acme.clone(), "purge", None).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, v) = op(a.admin.clone(), "purge", Some(json!({"mode": "shred"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    for (body, field) in [
        (json!({"maxPerSecond": 0}), "maxPerSecond"),
        (json!({"maxPerSecond": -5}), "maxPerSecond"),
        (json!({"sinceMs": 10, "untilMs": 5}), "untilMs"),
        (json!({"endpoint": "no/such"}), "endpoint"),
        (json!({"cursor": "not-a-cursor"}), "cursor"),
    ] {
        let (s, v) = op(a.admin.clone(), "replay", Some(body.clone())).await;
        assert_eq!(
            (s, v["field"].as_str()),
            (StatusCode::BAD_REQUEST, Some(field)),
            "{body}: {v}"
        );
    }
    let q = a.queue_of("acme").await;
    assert_eq!(
        a.store.tenant_state(q, "acme").await.unwrap().queued,
        20,
        "nothing done yet"
    );

    let (s, v) = op(a.admin.clone(), "purge", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["mode"].as_str(), v["purged"].as_u64()),
        (Some("deadLetter"), Some(20)),
        "{v}"
    );
    let (s, v) = op(
        a.admin.clone(),
        "replay",
        Some(json!({"maxPerSecond": 1000, "reason": "fixed"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["replayed"].as_u64(), v["nextCursor"].as_str()),
        (Some(20), None),
        "{v}"
    );
    let mut seqs = Vec::new();
    while let lanekeeper::store::LeaseOutcome::Leased(l) = a
        .store
        .lease(q, "w", Duration::from_secs(30))
        .await
        .unwrap()
    {
        seqs.push(l.envelope().unwrap().payload["seq"].as_u64().unwrap());
        if seqs.len() == 5 {
            break;
        }
    }
    assert_eq!(seqs, vec![0, 1, 2, 3, 4], "replayed in order");

    // mid-move: refused, nothing changes
    a.store.pause(q, "acme").await.unwrap();
    let (s, v) = op(a.admin.clone(), "purge", Some(json!({"mode": "drop"}))).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::CONFLICT, Some("moving")),
        "{v}"
    );
    assert_eq!(a.store.tenant_state(q, "acme").await.unwrap().queued, 15);
    a.store.resume(q, "acme").await.unwrap();
    let (s, v) = op(a.admin.clone(), "purge", Some(json!({"mode": "drop"}))).await;
    assert_eq!(
        (s, v["purged"].as_u64(), v["inFlight"].as_u64()),
        (StatusCode::OK, Some(15), Some(5)),
        "{v}"
    );

    let audit = a.store.audit_entries(Some("acme"), 10).await.unwrap();
    let ops: Vec<(&str, &str)> = audit
        .iter()
        .map(|e| (e.operation.as_str(), e.outcome.as_str()))
        .collect();
    assert_eq!(ops.len(), 4, "{ops:?}");
    assert!(ops[0].1.starts_with("dropped 15"), "{ops:?}");
    assert!(ops[1].1.starts_with("failed: tenant moving"), "{ops:?}");
    assert!(ops[2].1.contains("reason: fixed"), "{ops:?}");
    assert!(ops[3].1.starts_with("dead-lettered 20"), "{ops:?}");
}

/// `ingest-key --output json|yaml` prints `{key, entry}` for a script: the
/// entry goes into the api keys file as it is, and the key then
/// authenticates as the tenant (or admin) asked for. The text form still
/// says the key is stored nowhere.
#[test]
fn ingest_key_prints_machine_readable_entries_the_keys_file_accepts() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lanekeeper"))
            .arg("ingest-key")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let tenant: Value = serde_json::from_str(&run(&[
        "--name",
        "acme-prod",
        "--tenant",
        "acme",
        "-o",
        "json",
    ]))
    .expect("--output json is JSON");
    let admin: serde_yaml::Value =
        serde_yaml::from_str(&run(&["--name", "ops", "--admin", "--output", "yaml"]))
            .expect("--output yaml is YAML");
    let admin: Value = serde_json::to_value(admin).unwrap();
    for made in [&tenant, &admin] {
        let fields: Vec<_> = made.as_object().unwrap().keys().cloned().collect();
        assert_eq!(fields, ["entry", "key"], "{made}");
    }
    let file =
        serde_yaml::to_string(&json!({ "keys": [tenant["entry"], admin["entry"]] })).unwrap();
    let ring = auth::KeyRing::parse(&file, "keys.yaml").expect("the keys file takes the entries");
    let acme = ring
        .lookup(tenant["key"].as_str().unwrap())
        .expect("the tenant key");
    assert_eq!(
        (acme.name.as_str(), &acme.scope),
        ("acme-prod", &auth::Scope::Tenant("acme".into()))
    );
    let ops = ring
        .lookup(admin["key"].as_str().unwrap())
        .expect("the admin key");
    assert_eq!(
        (ops.name.as_str(), &ops.scope),
        ("ops", &auth::Scope::Admin)
    );
    assert!(ring.lookup("lk_not-a-key").is_none());
    let text = run(&["--name", "k", "--tenant", "acme"]);
    assert!(
        text.contains("it is not stored anywhere") && text.contains("tenant: \"acme\""),
        "{text}"
    );
}
