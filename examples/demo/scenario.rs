//! The local demo, shared by `examples/demo/main.rs` (the README's main command)
//! and its smoke test (`tests/demo.rs`, a shortened scenario in CI).
//!
//! It brings up a local Redis and the local Kubernetes control plane, installs
//! the CRDs and a 4-shard ShardSet, runs the controller, a worker process per
//! shard (and per dedicated lane, as the controller creates their
//! Deployments: kwok runs no images, so this stands in for the kubelet), the
//! ingest API, and a local webhook receiver that checks every signature. One
//! tenant then imports records through ingest while others send password
//! resets; progress is printed once a second, then a summary and a chart.
// The demo and its smoke test each read part of the summary.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanekeeper::routing::QueueId;

use crate::support::lanes::LaneEnv;
use crate::support::receiver::{now_ms, Receiver};

const SHARDS: u16 = 4;

fn say(s: &str) {
    println!("\x1b[1m==> {s}\x1b[0m");
}

/// The demo's scenario.
#[derive(Clone, Debug)]
pub struct Config {
    /// Records the whale imports, in batches of 1,000.
    pub import: u64,
    /// Between two batches of the import.
    pub import_pace: Duration,
    pub small_tenants: usize,
    /// Each small tenant sends one password reset this often.
    pub reset_every: Duration,
    pub give_up: Duration,
    /// Where to write the chart.
    pub chart: PathBuf,
}

impl Default for Config {
    /// The README's demo: 200,000 records at an import job's pace (4,000 a
    /// second), twelve shops sending password resets.
    fn default() -> Self {
        Self {
            import: 200_000,
            import_pace: Duration::from_millis(250),
            small_tenants: 12,
            reset_every: Duration::from_millis(400),
            give_up: Duration::from_secs(600),
            chart: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/demo/shops-wait.svg"),
        }
    }
}

/// What a run showed.
#[derive(Clone, Debug)]
pub struct Summary {
    pub whale_delivered: u64,
    pub resets_posted: u64,
    /// The shops' wait over the whole run, ms: p50, p95, p99.
    pub shops_wait: (u64, u64, u64),
    pub lane_phases: Vec<String>,
    pub bad_signatures: u64,
}

/// Run the demo, printing progress; returns what it showed.
pub async fn run(cfg: Config) -> Summary {
    let (import_total, small_count) = (cfg.import, cfg.small_tenants);
    say("control plane: etcd, kube-apiserver, kube-controller-manager and a kwok node (the first run builds them from Go modules, about 9 minutes on 2 cores; then cached in ~/.cache/lanekeeper)");
    let started = Instant::now();
    let cp = tokio::task::spawn_blocking(crate::support::controlplane::full)
        .await
        .unwrap();
    println!(
        "    up in {:.1}s: kubeconfig {}",
        started.elapsed().as_secs_f64(),
        cp.kubeconfig.display()
    );
    say("redis-server on a free loopback port");
    let redis = crate::support::redis::shared();
    println!("    {}", redis.url);
    say("CRDs, a 4-shard ShardSet, the controller, one worker per shard, a stand-in kubelet for lanes");
    tokio::task::spawn_blocking(move || cp.install_crds())
        .await
        .unwrap();
    // The whale may fill every delivery slot of its shard (cap = concurrency)
    // and its endpoint takes 5 ms, so its shard is busy: the promotion loop
    // counts a tenant as hot only while its shard is contended (others
    // waiting, or the workers' time over 80% used).
    let spec = "  worker: {image: \"lanekeeper:demo\", replicas: 1, concurrency: 8}\n  \
                scheduler: {maxInFlightPerTenant: 8}\n  \
                promotion: {promoteShare: 0.5, demoteShare: 0.05, promoteAfter: 10s, demoteAfter: 1h, window: 10s, maxLanes: 2}\n  \
                relocation: {drainTimeout: 10m}\n";
    let env = LaneEnv::start(
        cp,
        "demo",
        SHARDS,
        spec,
        &["--promotion-tick", "2s"],
        &["--concurrency", "8"],
    )
    .await;
    println!(
        "    namespace {}: kubectl --kubeconfig {} get shs,dl,deploy -n {}",
        env.ns,
        cp.kubeconfig.display(),
        env.ns
    );

    say("ingest API and a webhook receiver");
    let ingest = crate::support::workers::Ingest::spawn(
        &env.redis_url,
        &format!("{}/{}", env.ns, env.set),
        &[],
    );
    let (base, key) = (ingest.base(), ingest.key.clone());
    println!("    ingest {base}, receiver http://{}", env.receiver.addr);
    let http = reqwest::Client::new();
    let whale = env.tenant_on("bigcorp-", 1);
    let smalls: Vec<String> = (0..small_count)
        .map(|i| env.tenant_on(&format!("shop{i}-"), (i % SHARDS as usize) as u16))
        .collect();
    // The whale's endpoint takes 5 ms, the shops' answer at once.
    register(&http, &base, &key, &env.receiver, &whale, "delay-5").await;
    for t in &smalls {
        register(&http, &base, &key, &env.receiver, t, "ok").await;
    }
    println!(
        "    whale {whale} (hash shard-01, like {} of the shops), {} shops sending password resets",
        smalls
            .iter()
            .filter(|t| lanekeeper::routing::hash_shard(t, SHARDS) == QueueId::Shard(1))
            .count(),
        smalls.len()
    );

    say(&format!(
        "the story: {whale} imports {import_total} records while the shops send password resets"
    ));
    let t0 = now_ms();
    let stop = Arc::new(AtomicBool::new(false));
    let resets = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in smalls.clone() {
        let (http, base, key, stop, resets) = (
            http.clone(),
            base.clone(),
            key.clone(),
            stop.clone(),
            resets.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let ev = serde_json::json!({"tenant": t, "eventType": "user.password_reset", "endpoint": "default",
                    "id": format!("{t}-{seq}"), "payload": {"seq": seq, "sent_ms": now_ms(), "user": format!("u{seq}")}});
                if post(&http, &format!("{base}/v1/events"), &key, ev.to_string()).await == 202 {
                    resets.fetch_add(1, Ordering::Relaxed);
                }
                seq += 1;
                tokio::time::sleep(cfg.reset_every).await;
            }
        }));
    }
    let imported = Arc::new(AtomicU64::new(0));
    let import = {
        let (http, base, key, whale, imported) = (
            http.clone(),
            base.clone(),
            key.clone(),
            whale.clone(),
            imported.clone(),
        );
        tokio::spawn(async move {
            for b in 0..import_total / 1000 {
                let items: Vec<serde_json::Value> = (b * 1000..(b + 1) * 1000)
                    .map(|i| {
                        serde_json::json!({"tenant": whale, "id": format!("{whale}-{i}"),
                        "payload": {"seq": i, "sent_ms": now_ms(), "record": format!("row {i}")}})
                    })
                    .collect();
                let body = serde_json::to_string(&items).unwrap();
                loop {
                    let status = post(
                        &http,
                        &format!("{base}/v1/events:batch"),
                        &key,
                        body.clone(),
                    )
                    .await;
                    if status == 200 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                imported.fetch_add(1000, Ordering::Relaxed);
                // An import job's pace: 4,000 records a second, for 50 s.
                tokio::time::sleep(cfg.import_pace).await;
            }
        })
    };

    // Live progress, once a second, until the whale is delivered.
    let mut promoted_at: Option<u64> = None;
    let mut active_at: Option<u64> = None;
    let mut phases: Vec<String> = Vec::new();
    let deadline = Instant::now() + cfg.give_up;
    let mut series: Vec<(f64, u64)> = Vec::new();
    println!();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = now_ms();
        let arrivals = env.receiver.arrivals();
        let whale_done = arrivals
            .iter()
            .filter(|a| a.accepted && a.tenant == whale)
            .count() as u64;
        let mut recent: Vec<u64> = arrivals
            .iter()
            .filter(|a| a.accepted && a.tenant.starts_with("shop") && a.at_ms + 5_000 >= now)
            .map(|a| a.at_ms.saturating_sub(a.sent_ms))
            .collect();
        recent.sort_unstable();
        let p95 = recent.get(recent.len() * 95 / 100).copied().unwrap_or(0);
        series.push(((now - t0) as f64 / 1000.0, p95));
        let mut depth = Vec::new();
        for n in 0..SHARDS {
            let q = QueueId::Shard(n);
            let d: u64 = env
                .store
                .tenant_stats(q, Duration::from_secs(10))
                .await
                .map(|s| s.iter().map(|t| t.depth).sum())
                .unwrap_or(0);
            depth.push(format!("{q} {d:>6}"));
        }
        let lanes = env.lanes().await;
        let mut lane_depth = Vec::new();
        for l in &lanes {
            let index = l.status.as_ref().and_then(|s| s.lane_index);
            let depth = match index {
                Some(i) => env
                    .store
                    .tenant_state(QueueId::Lane(i as u8), &l.spec.tenant)
                    .await
                    .map(|st| st.depth)
                    .unwrap_or(0),
                None => 0,
            };
            lane_depth.push((index, depth));
        }
        let lane_text: Vec<String> = lanes
            .iter()
            .zip(&lane_depth)
            .map(|(l, (index, depth))| {
                let phase = l
                    .status
                    .as_ref()
                    .map(|s| format!("{:?}", s.phase))
                    .unwrap_or_else(|| "new".into());
                if phases.last() != Some(&phase) {
                    phases.push(phase.clone());
                }
                if phase == "Active" && active_at.is_none() {
                    active_at = Some(now);
                }
                match index {
                    Some(i) => format!("lane-{i} {depth:>6} ({}) {phase}", l.spec.tenant),
                    None => format!("({}) {phase}", l.spec.tenant),
                }
            })
            .collect();
        if !lanes.is_empty() && promoted_at.is_none() {
            promoted_at = Some(now);
        }
        println!(
            "t={:>4.0}s | {} | {:<34} | shops' wait p95 (5 s) {:>5} ms | import posted {:>6}, delivered {:>6}",
            (now - t0) as f64 / 1000.0,
            depth.join("  "),
            if lane_text.is_empty() { "no lanes".to_string() } else { lane_text.join(", ") },
            p95,
            imported.load(Ordering::Relaxed),
            whale_done
        );
        let _ = std::io::stdout().flush();
        if whale_done >= import_total || Instant::now() > deadline {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let _ = import.await;
    let end = now_ms();

    // Summary.
    let arrivals = env.receiver.arrivals();
    let whale_done = arrivals
        .iter()
        .filter(|a| a.accepted && a.tenant == whale)
        .count() as u64;
    let waits = |from: u64, to: u64| -> Vec<u64> {
        let mut w: Vec<u64> = arrivals
            .iter()
            .filter(|a| {
                a.accepted && a.tenant.starts_with("shop") && a.sent_ms >= from && a.sent_ms < to
            })
            .map(|a| a.at_ms.saturating_sub(a.sent_ms))
            .collect();
        w.sort_unstable();
        w
    };
    let pct = |w: &[u64], p: usize| {
        w.get((w.len() * p / 100).min(w.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let split = active_at.unwrap_or(end);
    println!();
    say("summary");
    println!(
        "{:<44} {:>8} {:>8} {:>8} {:>8}",
        "shops' password resets, wait (ms)", "count", "p50", "p95", "p99"
    );
    for (label, w) in [
        ("while the whale shares shard-01", waits(t0, split)),
        ("after the whale's lane is Active", waits(split, end)),
        ("whole run", waits(t0, end)),
    ] {
        println!(
            "{label:<44} {:>8} {:>8} {:>8} {:>8}",
            w.len(),
            pct(&w, 50),
            pct(&w, 95),
            pct(&w, 99)
        );
    }
    println!(
        "whale {whale}: {whale_done} of {import_total} delivered in {:.1}s; lane created {}; Active {}; phases {}",
        (end - t0) as f64 / 1000.0,
        promoted_at.map(|t| format!("at {:.0}s", (t - t0) as f64 / 1000.0)).unwrap_or_else(|| "never".into()),
        active_at.map(|t| format!("at {:.0}s", (t - t0) as f64 / 1000.0)).unwrap_or_else(|| "never".into()),
        if phases.is_empty() { "-".to_string() } else { phases.join(" -> ") }
    );
    println!(
        "password resets posted {}; signatures rejected by the receiver: {}",
        resets.load(Ordering::Relaxed),
        env.receiver.bad_signatures()
    );
    let chart = &cfg.chart;
    std::fs::create_dir_all(chart.parent().unwrap()).unwrap();
    std::fs::write(
        chart,
        svg(
            &series,
            import_total,
            promoted_at.map(|t| (t - t0) as f64 / 1000.0),
            active_at.map(|t| (t - t0) as f64 / 1000.0),
        ),
    )
    .unwrap();
    println!("chart of the shops' wait over time: {}", chart.display());
    let all = waits(t0, end);
    Summary {
        whale_delivered: whale_done,
        resets_posted: resets.load(Ordering::Relaxed),
        shops_wait: (pct(&all, 50), pct(&all, 95), pct(&all, 99)),
        lane_phases: phases,
        bad_signatures: env.receiver.bad_signatures(),
    }
}

async fn post(http: &reqwest::Client, url: &str, key: &str, body: String) -> u16 {
    match http
        .post(url)
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
    {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}

/// Register `tenant`'s `default` endpoint at the receiver through ingest.
async fn register(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    receiver: &Receiver,
    tenant: &str,
    mode: &str,
) {
    let secret = lanekeeper::signing::Secret::generate();
    receiver.expect_secrets(tenant, std::slice::from_ref(&secret));
    let res = http
        .put(format!("{base}/v1/tenants/{tenant}/endpoints/default"))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(serde_json::json!({"url": receiver.url(tenant, mode), "secret": secret}).to_string())
        .send()
        .await
        .unwrap();
    assert!(
        res.status().is_success(),
        "endpoint for {tenant}: {}",
        res.status()
    );
}

/// An SVG line chart of (seconds, p95 ms), with markers at promotion and Active.
fn svg(
    series: &[(f64, u64)],
    import_total: u64,
    promoted: Option<f64>,
    active: Option<f64>,
) -> String {
    let (w, h, m) = (800.0, 320.0, 50.0);
    let tmax = series.last().map(|p| p.0).unwrap_or(1.0).max(1.0);
    let vmax = series.iter().map(|p| p.1).max().unwrap_or(1).max(10) as f64 * 1.1;
    let x = |t: f64| m + (w - 2.0 * m) * t / tmax;
    let y = |v: f64| h - m - (h - 2.0 * m) * v / vmax;
    let points: Vec<String> = series
        .iter()
        .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v as f64)))
        .collect();
    let mut out = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="{w}" height="{h}" fill="white"/>
<text x="{m}" y="20" font-size="14">Password resets: wait p95 over the last 5 s (ms), while one tenant imports {import_total} records</text>
<line x1="{m}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{b}" stroke="black"/>
<text x="{m}" y="{tl}">0 s</text><text x="{r}" y="{tl}" text-anchor="end">{tmax:.0} s</text>
<text x="{ml}" y="{yt}" text-anchor="end">{vmax:.0}</text><text x="{ml}" y="{b}" text-anchor="end">0</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{}"/>
"##,
        points.join(" "),
        b = h - m,
        r = w - m,
        tl = h - m + 16.0,
        ml = m - 4.0,
        yt = m + 4.0,
    );
    for (label, at, colour) in [
        ("lane created", promoted, "#ff7f0e"),
        ("lane Active", active, "#2ca02c"),
    ] {
        if let Some(t) = at {
            out.push_str(&format!(
                r#"<line x1="{0:.1}" y1="{m}" x2="{0:.1}" y2="{1}" stroke="{colour}" stroke-dasharray="4"/><text x="{0:.1}" y="{2}" fill="{colour}">{label}</text>
"#,
                x(t),
                h - m,
                m - 6.0
            ));
        }
    }
    out.push_str("</svg>\n");
    out
}
