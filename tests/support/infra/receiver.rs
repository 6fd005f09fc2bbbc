//! A local webhook receiver for tests and benchmarks. It checks every
//! signature with its own implementation of the Standard Webhooks scheme
//! (HMAC-SHA256 over "id.timestamp.body", written here from the spec, not by
//! calling lanekeeper's signer), records what arrived, and misbehaves on
//! request: `POST /t/<tenant>/<mode>` where mode is `ok`, `delay-<ms>`,
//! `flaky-<percent>` (500 at random), `fail` (always 500), `gate` (500
//! while the gate is closed) or `retry-<status>-<n>-<value>` (the first `n`
//! requests of that tenant and mode answered `<status>` with a `Retry-After`
//! of `<value>`: delta-seconds as given, `date<ms>` an HTTP-date that many ms
//! ahead rounded up to the next second, or a hostile value: `big` 10 kB of
//! digits, `huge` a number past any integer, `neg` -5, `bin` non-ASCII bytes).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// One request that arrived with valid signatures.
#[derive(Clone, Debug)]
pub struct Arrival {
    pub id: String,
    pub tenant: String,
    pub mode: String,
    pub seq: u64,
    /// When the producer enqueued it (from the payload), ms since the epoch.
    pub sent_ms: u64,
    pub at_ms: u64,
    /// The receiver answered 2xx.
    pub accepted: bool,
    /// The `Retry-After` it answered with (lossy UTF-8), if any.
    pub retry_after: Option<String>,
}

#[derive(Default)]
struct Inner {
    keys: Mutex<HashMap<String, Vec<Vec<u8>>>>,
    arrivals: Mutex<Vec<Arrival>>,
    bad_signatures: AtomicU64,
    gate_open: AtomicBool,
    /// Requests seen per "<tenant>/<mode>" (the `retry-` modes).
    counts: Mutex<HashMap<String, u64>>,
}

/// A running receiver.
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

impl Receiver {
    /// Start on a free loopback port, on a runtime of its own.
    pub fn start() -> Receiver {
        let inner = Arc::new(Inner::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let state = inner.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = axum::Router::new()
                    .route("/t/{tenant}/{mode}", axum::routing::post(hook))
                    .with_state(state);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        Receiver {
            addr: rx.recv().unwrap(),
            inner,
        }
    }

    /// The URL for `tenant` with behaviour `mode`.
    pub fn url(&self, tenant: &str, mode: &str) -> String {
        format!("http://{}/t/{tenant}/{mode}", self.addr)
    }

    /// Trust these `whsec_` secrets for `tenant`: every one must have signed.
    pub fn expect_secrets(&self, tenant: &str, secrets: &[String]) {
        let keys = secrets
            .iter()
            .map(|s| STANDARD.decode(s.strip_prefix("whsec_").unwrap()).unwrap())
            .collect();
        self.inner
            .keys
            .lock()
            .unwrap()
            .insert(tenant.to_string(), keys);
    }

    pub fn open_gate(&self) {
        self.inner.gate_open.store(true, Ordering::SeqCst);
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.inner.arrivals.lock().unwrap().clone()
    }

    pub fn bad_signatures(&self) -> u64 {
        self.inner.bad_signatures.load(Ordering::SeqCst)
    }

    /// Requests seen for `tenant` (accepted or not).
    pub fn requests_for(&self, tenant: &str) -> usize {
        self.inner
            .arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.tenant == tenant)
            .count()
    }
}

fn verify(keys: &[Vec<u8>], headers: &HeaderMap, body: &[u8]) -> Result<String, String> {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| format!("missing {name}"))
    };
    let id = get("webhook-id")?;
    let ts = get("webhook-timestamp")?;
    let sigs = get("webhook-signature")?;
    let ts_n: i64 = ts.parse().map_err(|_| "bad timestamp".to_string())?;
    let now = (now_ms() / 1000) as i64;
    if (now - ts_n).abs() > 300 {
        return Err(format!("timestamp {ts_n} too far from now {now}"));
    }
    let given: Vec<&str> = sigs
        .split(' ')
        .map(|s| s.strip_prefix("v1,").ok_or("signature without v1,"))
        .collect::<Result<_, _>>()?;
    for key in keys {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
        mac.update(format!("{id}.{ts}.").as_bytes());
        mac.update(body);
        let want = STANDARD.encode(mac.finalize().into_bytes());
        if !given.contains(&want.as_str()) {
            return Err("no signature matches a trusted secret".to_string());
        }
    }
    Ok(id)
}

async fn hook(
    State(state): State<Arc<Inner>>,
    Path((tenant, mode)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let keys = state
        .keys
        .lock()
        .unwrap()
        .get(&tenant)
        .cloned()
        .unwrap_or_default();
    let id = match verify(&keys, &headers, &body) {
        Ok(id) if !keys.is_empty() => id,
        _ => {
            state.bad_signatures.fetch_add(1, Ordering::SeqCst);
            return StatusCode::UNAUTHORIZED.into_response();
        }
    };
    let payload: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let mut answer: Option<(StatusCode, axum::http::HeaderValue)> = None;
    if let Some(spec) = mode.strip_prefix("retry-") {
        let mut parts = spec.splitn(3, '-');
        let status = parts.next().and_then(|s| s.parse::<u16>().ok());
        let n = parts
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        let value = parts.next().unwrap_or("");
        let seen = {
            let mut counts = state.counts.lock().unwrap();
            let c = counts.entry(format!("{tenant}/{mode}")).or_default();
            *c += 1;
            *c
        };
        if seen <= n {
            let status = StatusCode::from_u16(status.unwrap_or(429)).unwrap();
            answer = Some((status, retry_after_value(value)));
        }
    }
    let accepted = if answer.is_some() {
        false
    } else if mode.starts_with("retry-") {
        true
    } else if let Some(ms) = mode.strip_prefix("delay-") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(0))).await;
        true
    } else if let Some(pct) = mode.strip_prefix("flaky-") {
        rand::random::<f64>() * 100.0 >= pct.parse::<f64>().unwrap_or(0.0)
    } else if mode == "fail" {
        false
    } else if mode == "gate" {
        state.gate_open.load(Ordering::SeqCst)
    } else {
        true
    };
    state.arrivals.lock().unwrap().push(Arrival {
        id,
        tenant,
        mode,
        seq: payload["seq"].as_u64().unwrap_or(0),
        sent_ms: payload["sent_ms"].as_u64().unwrap_or(0),
        at_ms: now_ms(),
        accepted,
        retry_after: answer
            .as_ref()
            .map(|(_, v)| String::from_utf8_lossy(v.as_bytes()).into_owned()),
    });
    if let Some((status, value)) = answer {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::RETRY_AFTER, value);
        return (status, h).into_response();
    }
    if accepted {
        StatusCode::NO_CONTENT.into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

/// The `Retry-After` value a `retry-` mode asks for (see the module doc).
fn retry_after_value(value: &str) -> axum::http::HeaderValue {
    use axum::http::HeaderValue;
    if let Some(ms) = value.strip_prefix("date") {
        let at = now_ms() + ms.parse::<u64>().unwrap_or(0);
        let secs = at.div_ceil(1000);
        let when = UNIX_EPOCH + Duration::from_secs(secs);
        return HeaderValue::from_str(&httpdate::fmt_http_date(when)).unwrap();
    }
    match value {
        "big" => HeaderValue::from_str(&"9".repeat(10 * 1024)).unwrap(),
        "huge" => HeaderValue::from_static("99999999999999999999999999999999999999"),
        "neg" => HeaderValue::from_static("-5"),
        "bin" => HeaderValue::from_bytes(b"\xff\xfe2").unwrap(),
        v => HeaderValue::from_str(v).unwrap(),
    }
}
