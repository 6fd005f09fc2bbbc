//! `cargo bench --bench ingest`: the ingest API over HTTP on loopback against
//! a real redis-server, with the raw pipelined enqueue rate (the data
//! plane's, as in the scheduler benchmark) measured in the same run.
//!
//! - batches: 4 clients posting JSON arrays of 1,000 events for 100 tenants;
//! - single events: wrk with 64 connections, one event per request, with
//!   p50 and p99 latency (wrk must be installed: `apt-get install wrk`);
//! - an import of 2,000,000 events for one tenant, timed.
//!
//! The server is the real `lanekeeper ingest` binary; the load generators
//! (this process for batches, wrk for single events) share its two cores.
//! The same wrk load also goes to an HTTP floor measured in the same run: a
//! minimal axum handler that reads the body and answers 202, with no auth,
//! parsing or Redis, on a thread of its own.
//! The last line is `RESULT batch_vs_raw=<x> single_per_s=<y> single_p99_ms=<z>
//! single_vs_http_floor=<single events/s over the floor's requests/s>`.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{connect, enqueue_all, env};
use lanekeeper::endpoint::Endpoint;
use lanekeeper::envelope::Envelope;

const BATCH: usize = 1000;
const BATCH_EVENTS: usize = 200_000;
const SINGLE_SECONDS: u64 = 15;
const CONNECTIONS: usize = 64;
const IMPORT: usize = 2_000_000;

/// The HTTP floor: POST /v1/events read whole and answered 202, nothing
/// else, served on a current-thread runtime of its own. Returns its base URL.
fn http_floor() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(format!("http://{}", listener.local_addr().unwrap()))
                .unwrap();
            let app = axum::Router::new().route(
                "/v1/events",
                axum::routing::post(|body: axum::body::Bytes| async move {
                    std::hint::black_box(body.len());
                    axum::http::StatusCode::ACCEPTED
                }),
            );
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

fn event(tenant: &str, i: usize) -> serde_json::Value {
    serde_json::json!({"tenant": tenant, "id": format!("{tenant}-{i}"), "payload": {"n": i, "body": "x".repeat(200)}})
}

/// Post `total` events as batches of BATCH from `clients` concurrent clients.
/// With `prebuilt`, every request body is serialized before the clock
/// starts, so the load generator's JSON work is not timed (it shares the two
/// cores with the server and Redis).
async fn post_batches(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    clients: usize,
    total: usize,
    prebuilt: bool,
    tenant_of: impl Fn(usize) -> String + Send + Sync + 'static,
) -> f64 {
    let next = Arc::new(AtomicU64::new(0));
    let body = move |b: usize| -> Vec<u8> {
        let items: Vec<serde_json::Value> = (b * BATCH..((b + 1) * BATCH).min(total))
            .map(|i| event(&tenant_of(i), i))
            .collect();
        serde_json::to_vec(&items).unwrap()
    };
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new(if prebuilt {
        (0..total.div_ceil(BATCH)).map(&body).collect()
    } else {
        Vec::new()
    });
    let body = Arc::new(body);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (http, url, key, next, bodies, body) = (
            http.clone(),
            url.to_string(),
            key.to_string(),
            next.clone(),
            bodies.clone(),
            body.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let b = next.fetch_add(1, Ordering::Relaxed) as usize;
                if b * BATCH >= total {
                    break;
                }
                let body = match bodies.get(b) {
                    Some(prebuilt) => prebuilt.clone(),
                    None => body(b),
                };
                let res = http
                    .post(format!("{url}/v1/events:batch"))
                    .bearer_auth(&key)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert!(res.status().is_success(), "{}", res.status());
                let v: serde_json::Value =
                    serde_json::from_slice(&res.bytes().await.unwrap()).unwrap();
                assert_eq!(v["rejected"], 0, "{}", v["items"][0]);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// Post single events with wrk for SINGLE_SECONDS: each request a new id,
/// spread over CONNECTIONS tenants. Returns events/s, p50 and p99 in ms.
fn wrk_single_events(base: &str, key: &str, dir: &std::path::Path) -> (f64, f64, f64) {
    let wrk = support::process::require_program(
        "wrk",
        "install it with `apt-get install wrk` (the ingest benchmark's load generator)",
    );
    let script = dir.join("single.lua");
    std::fs::write(
        &script,
        format!(
            r#"wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
local n = 0
local body = string.rep("x", 200)
request = function()
  n = n + 1
  return wrk.format(nil, "/v1/events", nil,
    '{{"tenant":"single' .. (n % {CONNECTIONS}) .. '","id":"w-' .. n .. '","payload":{{"n":' .. n .. ',"body":"' .. body .. '"}}}}')
end
response = function(status, headers, body)
  if status ~= 202 then error("status " .. status .. ": " .. body) end
end
"#
        ),
    )
    .unwrap();
    let out = std::process::Command::new(wrk)
        .args([
            "-t1",
            &format!("-c{CONNECTIONS}"),
            &format!("-d{SINGLE_SECONDS}s"),
            "--latency",
            "-s",
        ])
        .arg(&script)
        .arg(base)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("Non-2xx"),
        "some posts were refused:\n{text}"
    );
    let field = |prefix: &str| -> String {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {prefix:?} in wrk's output:\n{text}"))
    };
    let ms = |v: String| -> f64 {
        if let Some(x) = v.strip_suffix("ms") {
            x.parse().unwrap()
        } else if let Some(x) = v.strip_suffix("us") {
            x.parse::<f64>().unwrap() / 1000.0
        } else if let Some(x) = v.strip_suffix('s') {
            x.parse::<f64>().unwrap() * 1000.0
        } else {
            panic!("latency {v:?}")
        }
    };
    let rate: f64 = field("Requests/sec:").parse().unwrap();
    (rate, ms(field("50%")), ms(field("99%")))
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let redis = support::redis::shared();
    let url = redis.url.clone();
    rt.block_on(async {
        // The baseline: the data plane's pipelined batch enqueue, no HTTP.
        let store = connect(&url, "raw").await;
        let envs: Vec<Envelope> = (0..BATCH_EVENTS as u64)
            .map(|i| env(&format!("imp{}", i % 100), i))
            .collect();
        let raw = enqueue_all(&store, envs).await;
        println!("raw pipelined enqueue (data plane, 4 producers): {raw:.0} envelopes/s");

        // The real binary, with one admin key and endpoints for every tenant.
        let set = lanekeeper::store::SetId::new("bench", "ingest");
        let target = lanekeeper::store::Store::connect(&url, set, Default::default())
            .await
            .unwrap();
        target.set_shards(4).await.unwrap();
        let ep = Endpoint {
            url: "https://example.com/hooks".into(),
            secrets: vec![lanekeeper::signing::Secret::generate()],
            enabled: true,
            event_types: vec![],
        };
        for t in (0..100).map(|i| format!("imp{i}")).chain(["importer".to_string()]) {
            target.put_endpoint(&t, "default", &ep).await.unwrap();
        }
        for c in 0..CONNECTIONS {
            target.put_endpoint(&format!("single{c}"), "default", &ep).await.unwrap();
        }
        let ingest = support::workers::Ingest::spawn(&url, "bench/ingest", &["--backlog-limit", "0"]);
        let (pid, base, key, dir) = (ingest.pid, ingest.base(), ingest.key.clone(), ingest.dir.clone());
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(CONNECTIONS)
            .build()
            .unwrap();

        let batch = post_batches(&http, &base, &key, 4, BATCH_EVENTS, true, |i| format!("imp{}", i % 100)).await;
        println!(
            "batch ingest over HTTP ({BATCH} per request, 4 clients, 100 tenants): {batch:.0} envelopes/s ({:.2}x raw)",
            batch / raw
        );

        // Single events: wrk (one thread, CONNECTIONS connections), which
        // costs the shared cores far less than an in-process client would.
        let (single, p50, p99) = wrk_single_events(&base, &key, &dir);
        println!(
            "single events (wrk, {CONNECTIONS} connections, {}s): {single:.0} events/s, p50 {p50:.2} ms, p99 {p99:.2} ms",
            SINGLE_SECONDS
        );

        // The same wrk load against the floor, right after.
        let (floor, _, floor_p99) = wrk_single_events(&http_floor(), &key, &dir);
        println!(
            "HTTP floor (wrk, {CONNECTIONS} connections, {}s, 202 with no work): {floor:.0} requests/s, p99 {floor_p99:.2} ms; single events {:.3}x the floor",
            SINGLE_SECONDS,
            single / floor
        );

        let started = Instant::now();
        post_batches(&http, &base, &key, 4, IMPORT, false, |_| "importer".to_string()).await;
        let took = started.elapsed().as_secs_f64();
        let q = target.routing().await.unwrap().route("importer");
        let depth = target.tenant_state(q, "importer").await.unwrap().queued;
        assert_eq!(depth, IMPORT as u64, "every imported envelope is queued");
        println!(
            "import of {IMPORT} events for one tenant: {took:.1} s ({:.0} envelopes/s), all {depth} queued",
            IMPORT as f64 / took
        );
        support::process::signal(pid, libc::SIGTERM);
        let _ = support::process::wait_exit(pid, Duration::from_secs(10));
        println!(
            "RESULT batch_vs_raw={:.3} single_per_s={single:.0} single_p99_ms={p99:.2} single_vs_http_floor={:.3}",
            batch / raw,
            single / floor
        );
    });
    support::process::stop_all();
}
