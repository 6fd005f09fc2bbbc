//! `cargo bench --bench delivery`: webhooks delivered per second end to end
//! (real worker processes, signed HTTP POSTs to a local receiver that
//! answers at once and checks every signature), against the store-level
//! lease+ack rate measured in the same run, then the whale-and-small
//! scenario. The workers' CPU per delivery is set against an HTTP floor
//! measured in the same run: a minimal client loop (64 in flight, on a
//! thread of its own, its CPU read from the thread's clock) posting signed
//! webhooks of the same kind to the same receiver, with no Redis and no
//! lease. The last line is
//! `RESULT deliveries_per_s=<x> deliveries_vs_lease_ack=<y> small_p99_whale_vs_alone=<z>
//! worker_cpu_vs_http_floor=<worker CPU per delivery over the floor's CPU per request>`.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use lanekeeper::policy::QueuePolicy;
use support::scenario::{setup, small_tenant_scenario, stop};

const TENANTS: u64 = 20;
const PER_TENANT: u64 = 2_500;
const WORKERS: usize = 2;

/// CPU seconds of the calling thread.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The HTTP floor: `n` signed POSTs to `url`, 64 in flight, from a
/// current-thread runtime on a thread of its own. Returns the thread's CPU
/// microseconds per request.
fn http_floor(url: String, secret: String, n: u64) -> f64 {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let secrets = vec![lanekeeper::signing::Secret::parse(&secret).unwrap()];
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .unwrap();
        let cpu0 = thread_cpu_seconds();
        rt.block_on(async {
            let next = std::rc::Rc::new(std::cell::Cell::new(0u64));
            let mut tasks = Vec::new();
            let local = tokio::task::LocalSet::new();
            for _ in 0..64 {
                let (http, url, secrets, next) =
                    (http.clone(), url.clone(), secrets.clone(), next.clone());
                tasks.push(local.spawn_local(async move {
                    loop {
                        let i = next.get();
                        if i >= n {
                            break;
                        }
                        next.set(i + 1);
                        let id = format!("floor-{i}");
                        let body = serde_json::to_vec(&serde_json::json!({
                            "tenant": "floor", "seq": i, "sent_ms": support::receiver::now_ms()
                        }))
                        .unwrap();
                        let ts = (support::receiver::now_ms() / 1000) as i64;
                        let sig = lanekeeper::signing::signature_header(&secrets, &id, ts, &body);
                        let r = http
                            .post(&url)
                            .header("content-type", "application/json")
                            .header("webhook-id", &id)
                            .header("webhook-timestamp", ts.to_string())
                            .header("webhook-signature", sig)
                            .body(body)
                            .send()
                            .await
                            .unwrap();
                        assert!(r.status().is_success(), "the receiver said {}", r.status());
                    }
                }));
            }
            local
                .run_until(async {
                    for t in tasks {
                        t.await.unwrap();
                    }
                })
                .await;
        });
        (thread_cpu_seconds() - cpu0) * 1e6 / n as f64
    })
    .join()
    .unwrap()
}

/// Deliveries per second, the CPU seconds each part used meanwhile, and the
/// workers' CPU microseconds per delivery against the HTTP floor's per
/// request.
async fn end_to_end() -> (f64, String, f64, f64) {
    let s = setup(QueuePolicy {
        max_in_flight: 64,
        ..Default::default()
    })
    .await;
    for t in 0..TENANTS {
        let tenant = format!("t{t}");
        s.endpoint(&tenant, "ok", 1).await;
        s.send(&tenant, 0..PER_TENANT).await;
    }
    let total = (TENANTS * PER_TENANT) as usize;
    let redis_pid = support::redis::shared().pid;
    let me = std::process::id();
    let (redis0, me0) = (
        support::process::cpu_seconds(redis_pid),
        support::process::cpu_seconds(me),
    );
    let started = Instant::now();
    let pids: Vec<u32> = (0..WORKERS)
        .map(|_| s.worker(&["--concurrency", "64"]))
        .collect();
    s.wait_for_accepted(total, Duration::from_secs(600)).await;
    let wall = started.elapsed().as_secs_f64();
    let rate = total as f64 / wall;
    let workers: f64 = pids.iter().map(|p| support::process::cpu_seconds(*p)).sum();
    let cpu = format!(
        "CPU seconds over {wall:.1} s wall (2 cores): redis-server {:.1}, worker processes {workers:.1}, receiver {:.1}",
        support::process::cpu_seconds(redis_pid) - redis0,
        support::process::cpu_seconds(me) - me0,
    );
    assert_eq!(s.receiver.bad_signatures(), 0);
    for pid in pids {
        stop(pid);
    }
    let worker_us = workers * 1e6 / total as f64;
    let secret = lanekeeper::signing::Secret::generate();
    s.receiver
        .expect_secrets("floor", std::slice::from_ref(&secret));
    let url = s.receiver.url("floor", "ok");
    let floor_us = tokio::task::spawn_blocking(move || http_floor(url, secret, 20_000))
        .await
        .unwrap();
    assert_eq!(s.receiver.bad_signatures(), 0);
    (rate, cpu, worker_us, floor_us)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = support::redis::shared().url.clone();
    rt.block_on(async {
        let store_rate = common::fair(&url, 10).await;
        let lease_ack = store_rate.per_s;
        println!(
            "store lease+ack (ack_and_lease), {} clients, 10 tenants: {lease_ack:.0} cycles/s (Redis CPU {:.1} us/cycle)",
            common::CLIENTS,
            store_rate.redis_us
        );
        let (delivered, cpu, worker_us, floor_us) = end_to_end().await;
        println!(
            "end to end: {WORKERS} worker processes x 64 in flight, {} envelopes, receiver answers at once: {delivered:.0} deliveries/s ({:.2}x lease+ack)",
            TENANTS * PER_TENANT,
            delivered / lease_ack
        );
        println!("where the time goes: {cpu}");
        println!(
            "worker CPU per delivery {worker_us:.0} us; HTTP floor (a client loop posting signed webhooks to the same receiver) {floor_us:.0} us per request: {:.2}x",
            worker_us / floor_us
        );
        let (alone50, alone99, _) = small_tenant_scenario(0, false).await;
        let (fair50, fair99, drain) = small_tenant_scenario(100_000, false).await;
        println!(
            "small tenant wait, ms (p50 / p99): alone {alone50} / {alone99}; behind a 100000-envelope whale {fair50} / {fair99} (whale drained in {:.1} s)",
            drain.as_secs_f64()
        );
        println!(
            "RESULT deliveries_per_s={delivered:.0} deliveries_vs_lease_ack={:.3} small_p99_whale_vs_alone={:.3} worker_cpu_vs_http_floor={:.3}",
            delivered / lease_ack,
            fair99 as f64 / alone99.max(1) as f64,
            worker_us / floor_us
        );
    });
    support::process::stop_all();
}
