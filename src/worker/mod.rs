//! `lanekeeper worker`: lease, deliver, ack or nack, for one queue of a
//! ShardSet. Every shard and lane Deployment runs it; several processes on
//! one queue cooperate through the queue's scripts alone.

mod batcher;
pub mod delivery;
pub mod env;
pub mod ssrf;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::endpoint::Endpoint;
use crate::policy::retry_delay;
use crate::routing::QueueId;
use crate::store::{
    Acked, BreakerChange, Failure, Lease, LeaseOutcome, NackOutcome, Store, TtlCache,
};
use crate::telemetry::{BreakerLabels, OutcomeLabels, QueueLabels, TenantLabels, WorkerMetrics};
use delivery::{Deliverer, Outcome};

/// Everything a worker process needs, from flags and environment.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub queue: QueueId,
    /// Deliveries in flight in this process.
    pub concurrency: usize,
    pub connect_timeout: Duration,
    /// Total time for one HTTP attempt.
    pub delivery_timeout: Duration,
    /// Added to the delivery timeout for the lease: past it the reaper
    /// assumes this worker died and hands the envelope to another.
    pub lease_margin: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Non-global CIDRs deliveries may reach anyway.
    pub allow: Vec<ipnet::IpNet>,
    /// After SIGTERM: time to finish deliveries in flight before they are released.
    pub grace: Duration,
    /// How long a looked-up endpoint is reused.
    pub endpoint_cache: Duration,
    /// Identity in lease tokens and logs.
    pub worker_id: String,
    pub metrics_addr: Option<SocketAddr>,
    pub tenant_label_cap: usize,
    /// HTTP proxy for every delivery. `None` (the default): no proxy, and
    /// `HTTP_PROXY`/`HTTPS_PROXY`/`ALL_PROXY` in the environment are ignored.
    pub proxy: Option<reqwest::Url>,
}

impl WorkerConfig {
    fn lease_for(&self) -> Duration {
        self.delivery_timeout + self.connect_timeout + self.lease_margin
    }
}

/// (tenant, endpoint name) -> what the registry said, reused for
/// `endpoint_cache`.
type EndpointCache = TtlCache<(String, String), Option<Endpoint>>;

/// Endpoints a worker remembers at most.
const ENDPOINT_CACHE_CAPACITY: usize = 65_536;

struct Shared {
    store: Store,
    config: WorkerConfig,
    deliverer: Deliverer,
    endpoints: EndpointCache,
    metrics: WorkerMetrics,
    queue_label: String,
    /// Woken when a tenant becomes active in the queue (Redis pub/sub).
    wake: tokio::sync::Notify,
    /// The set's routing table is in Redis. False while Redis has lost its
    /// state and the controller has not restored it: the queue's policy is
    /// gone too, so this worker leases nothing until it is back.
    routing: watch::Sender<bool>,
    /// Gathers the delivery tasks' acks and leases into batched calls.
    batcher: batcher::Batcher,
}

/// Run the worker until `stop` turns true (SIGTERM), then drain: stop
/// leasing, let deliveries in flight finish within the grace period, and
/// give back (release) whatever is still in flight after it.
pub async fn run(
    store: Store,
    config: WorkerConfig,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let deliverer = Deliverer::new(
        ssrf::Guard::new(config.allow.clone()),
        config.connect_timeout,
        config.delivery_timeout,
        config.proxy.as_ref(),
    )?;
    if let Some(p) = &config.proxy {
        warn!(proxy = %crate::store::redact(p.as_str()), "deliveries go through an HTTP proxy: the SSRF guard checks each URL's host before the request, but the proxy resolves it again; its own access rules must refuse internal addresses");
    }
    let metrics = WorkerMetrics::new(config.tenant_label_cap);
    if let Some(addr) = config.metrics_addr {
        let mut s = stop.clone();
        let bound = crate::telemetry::serve(addr, metrics.clone(), async move {
            let _ = s.wait_for(|v| *v).await;
        })
        .await?;
        info!(%bound, "serving /metrics and /healthz");
    }
    // Before the first lease: is there a routing table to work for?
    let present = store.routing_present().await.unwrap_or(true);
    if !present {
        warn!(set = %store.set(), "the routing table is missing from Redis (Redis lost its state, or the set is new): not leasing until the controller writes it");
    }
    let queue_label = config.queue.to_string();
    let batcher = batcher::Batcher::start(
        store.clone(),
        config.queue,
        config.worker_id.clone(),
        config.lease_for(),
        metrics
            .lease_batch
            .get_or_create(&QueueLabels {
                queue: queue_label.clone(),
            })
            .clone(),
    );
    let shared = Arc::new(Shared {
        queue_label,
        batcher,
        store,
        deliverer,
        endpoints: EndpointCache::new(config.endpoint_cache, ENDPOINT_CACHE_CAPACITY),
        metrics,
        config,
        wake: tokio::sync::Notify::new(),
        routing: watch::Sender::new(present),
    });
    info!(
        queue = %shared.config.queue,
        set = %shared.store.set(),
        concurrency = shared.config.concurrency,
        worker = %shared.config.worker_id,
        "worker started"
    );

    // Past the grace period, deliveries still running are cancelled and released.
    let (abandon_tx, abandon_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..shared.config.concurrency {
        let (shared, stop, abandon) = (shared.clone(), stop.clone(), abandon_rx.clone());
        tasks.spawn(async move { delivery_loop(shared, stop, abandon).await });
    }
    {
        let (shared, mut stop) = (shared.clone(), stop.clone());
        tasks.spawn(async move {
            // Idle delivery tasks sleep until a tenant becomes active; polling
            // (at most every second) covers a dropped subscription.
            use futures::StreamExt;
            loop {
                match shared.store.wakeups(shared.config.queue).await {
                    Ok(stream) => {
                        let mut stream = std::pin::pin!(stream);
                        loop {
                            tokio::select! {
                                m = stream.next() => match m {
                                    Some(()) => shared.wake.notify_one(),
                                    None => break,
                                },
                                _ = stop.wait_for(|v| *v) => return,
                            }
                        }
                    }
                    Err(e) => warn!(error = %e, "cannot subscribe to wake-ups; polling"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.wait_for(|v| *v) => return,
                }
            }
        });
    }
    {
        let (shared, mut stop) = (shared.clone(), stop.clone());
        tasks.spawn(async move {
            // Is the routing table there? Redis restarted empty (no
            // persistence) or flushed: wait for the controller to restore it.
            loop {
                match shared.store.routing_present().await {
                    Ok(present) => {
                        let was = *shared.routing.borrow();
                        if was && !present {
                            warn!(set = %shared.store.set(), "the routing table is missing from Redis (Redis lost its state, or the set is new): not leasing until the controller writes it");
                        } else if !was && present {
                            info!(set = %shared.store.set(), "the routing table is back: leasing again");
                        }
                        shared.routing.send_replace(present);
                    }
                    Err(e) => warn!(error = %e, "cannot read the routing table; retrying"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.wait_for(|v| *v) => return,
                }
            }
        });
    }
    {
        let (shared, mut stop) = (shared.clone(), stop.clone());
        tasks.spawn(async move {
            // Reaper and retry promoter, so an idle queue still recovers.
            loop {
                if !*shared.routing.borrow() {
                    // Nothing to reap in a Redis that lost its state.
                } else {
                    if let Err(e) = shared.store.maintain(shared.config.queue, 500).await {
                        warn!(error = %e, "maintenance failed; retrying");
                    }
                    // One bounded step of the idle-tenant sweep (a no-op
                    // between passes and when the policy never sweeps).
                    match shared
                        .store
                        .sweep(shared.config.queue, crate::store::SWEEP_STEP)
                        .await
                    {
                        Ok(step) if step.swept > 0 => {
                            shared
                                .metrics
                                .tenants_swept
                                .get_or_create(&QueueLabels {
                                    queue: shared.queue_label.clone(),
                                })
                                .inc_by(step.swept);
                        }
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "sweeping idle tenants failed; retrying"),
                    }
                }
                if let Ok(n) = shared.store.dead_letters_dropped(shared.config.queue).await {
                    shared
                        .metrics
                        .dead_letters_dropped
                        .get_or_create(&QueueLabels {
                            queue: shared.queue_label.clone(),
                        })
                        .set(n as i64);
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.wait_for(|v| *v) => return,
                }
            }
        });
    }

    let _ = stop.wait_for(|v| *v).await;
    info!(grace = ?shared.config.grace, "stopping: no new leases; finishing deliveries in flight");
    let drained = tokio::time::timeout(shared.config.grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!("grace period over: releasing deliveries still in flight");
        let _ = abandon_tx.send(true);
        while tasks.join_next().await.is_some() {}
    }
    info!("worker stopped");
    Ok(())
}

async fn delivery_loop(
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    abandon: watch::Receiver<bool>,
) {
    let stopping = || *stop.borrow();
    let mut next: Option<LeaseOutcome> = None;
    let mut backoff = Duration::from_millis(50);
    // Consecutive AGAIN answers: the first few are asked again at once, then
    // with a growing pause, so a queue whose tenants all need many turns to
    // earn credit is not hammered in a hot loop.
    let mut again = 0u32;
    loop {
        // Armed before leasing, so a wake-up between an empty answer and the wait is not lost.
        let mut woken = Box::pin(shared.wake.notified());
        woken.as_mut().enable();
        let outcome = match next.take() {
            Some(o) => o,
            None => {
                if stopping() {
                    return;
                }
                if !*shared.routing.borrow() {
                    let mut routing = shared.routing.subscribe();
                    let mut stop = stop.clone();
                    tokio::select! {
                        _ = routing.wait_for(|present| *present) => {}
                        _ = stop.wait_for(|v| *v) => {}
                    }
                    continue;
                }
                match shared.batcher.next(None).await {
                    Ok((_, o)) => o,
                    Err(e) => {
                        warn!(error = %e, "lease failed; backing off");
                        sleep_or_stop(backoff, &stop).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                }
            }
        };
        backoff = Duration::from_millis(50);
        match outcome {
            LeaseOutcome::Leased(lease) => {
                // Not waiting any more: a wake-up handed to this listener
                // passes to an idle task now, instead of waiting out this
                // delivery (a slow endpoint's 30 s).
                drop(woken);
                let stopping = stopping();
                next = handle(&shared, lease, stopping, abandon.clone()).await;
            }
            LeaseOutcome::Empty { retry_after } => {
                let mut stop = stop.clone();
                tokio::select! {
                    _ = tokio::time::sleep(retry_after.min(Duration::from_secs(1))) => {}
                    _ = woken.as_mut() => {}
                    _ = stop.wait_for(|v| *v) => {}
                }
            }
            LeaseOutcome::Again => {
                again += 1;
                if let Some(pause) = again_pause(again) {
                    sleep_or_stop(pause, &stop).await;
                }
                continue;
            }
        }
        again = 0;
    }
}

/// The pause before asking again after `n` AGAIN answers in a row: none for
/// the first four, then 1 ms doubling to at most 64 ms.
fn again_pause(n: u32) -> Option<Duration> {
    (n > 4).then(|| Duration::from_millis(1 << (n - 5).min(6)))
}

async fn sleep_or_stop(d: Duration, stop: &watch::Receiver<bool>) {
    let mut stop = stop.clone();
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.wait_for(|v| *v) => {}
    }
}

/// Deliver one leased envelope and report the result. Returns the next
/// lease when the ack could carry one (`ack_and_lease`).
/// One leased envelope: deliver, then ack, nack or release. A span per
/// envelope at debug level (off by default: the hot path pays a check).
#[tracing::instrument(name = "deliver", level = "debug", skip_all, fields(queue = %lease.queue, tenant = %lease.tenant, id = %lease.id, attempt = lease.attempts + 1))]
async fn handle(
    shared: &Shared,
    lease: Lease,
    stopping: bool,
    mut abandon: watch::Receiver<bool>,
) -> Option<LeaseOutcome> {
    let m = &shared.metrics;
    let leased_at_ms = lease
        .deadline_ms
        .saturating_sub(shared.config.lease_for().as_millis() as u64);
    let wait = Duration::from_millis(leased_at_ms.saturating_sub(lease.enqueued_ms));
    m.queue_wait
        .get_or_create(&TenantLabels {
            queue: shared.queue_label.clone(),
            tenant: m.tenant_label(&lease.tenant),
        })
        .observe(wait.as_secs_f64());
    if let Some(change) = lease.breaker {
        breaker_changed(shared, &lease.tenant, &lease.id, change);
    }
    let in_flight = m
        .in_flight
        .get_or_create(&QueueLabels {
            queue: shared.queue_label.clone(),
        })
        .clone();
    in_flight.inc();
    let _guard = DecOnDrop(in_flight);

    let env = match lease.envelope() {
        Ok(env) => env,
        Err(e) => {
            let cause = format!("corrupt envelope: {e}");
            warn!(tenant = %lease.tenant, envelope = %lease.id, %cause, "dead-lettering");
            report(
                shared,
                &lease,
                Duration::ZERO,
                "corrupt",
                &Failure::dead(&cause),
            )
            .await;
            return None;
        }
    };
    let endpoint_name = env
        .endpoint
        .clone()
        .unwrap_or_else(|| "default".to_string());
    let endpoint = match shared
        .endpoints
        .get_or_load(
            (env.tenant.clone(), endpoint_name.clone()),
            shared.store.endpoint(&env.tenant, &endpoint_name),
        )
        .await
    {
        Ok(ep) => ep,
        Err(e) => {
            warn!(tenant = %env.tenant, endpoint = %endpoint_name, error = %e, "endpoint lookup failed; retrying later");
            let failure = Failure::retry("endpoint registry unavailable", Duration::from_secs(1));
            report(shared, &lease, Duration::ZERO, "registry_error", &failure).await;
            return None;
        }
    };

    let started = Instant::now();
    let outcome = tokio::select! {
        o = shared.deliverer.deliver(&env, endpoint.as_ref()) => o,
        _ = async { let _ = abandon.wait_for(|v| *v).await; } => {
            // Shutting down past the grace period: give it back untried.
            if let Err(e) = shared.store.release(&lease).await {
                warn!(envelope = %lease.id, error = %e, "release failed; the reaper will return it");
            }
            return None;
        }
    };
    let elapsed = started.elapsed();
    m.delivery_duration
        .get_or_create(&OutcomeLabels {
            queue: shared.queue_label.clone(),
            class: outcome.class().to_string(),
        })
        .observe(elapsed.as_secs_f64());

    match outcome {
        Outcome::Delivered { .. } => {
            count(shared, "delivered");
            if stopping {
                if let Err(e) = shared.store.ack(&lease, elapsed).await {
                    warn!(envelope = %lease.id, error = %e, "ack failed; it will be delivered again");
                }
                return None;
            }
            // the ack and the next lease go in the worker's next batched
            // call, which takes the lease (its id is the envelope's)
            match shared.batcher.next(Some((lease, elapsed))).await {
                Ok((acked, next)) => {
                    if let Some(Acked {
                        breaker: Some(change),
                        ..
                    }) = acked
                    {
                        breaker_changed(shared, &env.tenant, &env.id, change);
                    }
                    Some(next)
                }
                Err(e) => {
                    warn!(envelope = %env.id, error = %e, "ack failed; it will be delivered again");
                    None
                }
            }
        }
        Outcome::Retry {
            class,
            cause,
            retry_after,
            pace,
            endpoint_fault,
        } => {
            let backoff = retry_delay(
                lease.attempts + 1,
                shared.config.initial_backoff,
                shared.config.max_backoff,
                rand::random::<f64>(),
            );
            let mut failure = Failure::retry(&cause, backoff);
            match retry_after {
                // The receiver paces its endpoint: no request to it until the
                // time it asked for (the queue bounds it by maxRetryAfter),
                // and not a fault of the endpoint.
                Some(ra) if pace && !ra.is_zero() => {
                    failure = Failure::retry(&cause, ra).paced(ra);
                }
                Some(ra) => {
                    failure.retry_in = Some(ra.min(shared.config.max_backoff).max(backoff / 2));
                }
                None => {}
            }
            if endpoint_fault {
                failure = failure.blame_endpoint();
            }
            let paced = failure.pace.is_some();
            let outcome = report(shared, &lease, elapsed, class, &failure).await;
            let retry_in = match outcome {
                // due in Redis time: close enough to this clock for a log line
                Some(NackOutcome::Retry { due_ms, .. }) => Duration::from_millis(
                    due_ms.saturating_sub(
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_millis() as u64),
                    ),
                ),
                _ => failure.retry_in.unwrap_or_default(),
            };
            if paced {
                warn!(
                    tenant = %env.tenant, endpoint = %endpoint_name, envelope = %lease.id,
                    attempt = lease.attempts + 1, %cause, paused_for = ?retry_in,
                    "the receiver asked for a pause (Retry-After): its endpoint gets no request until then"
                );
            } else {
                warn!(
                    tenant = %env.tenant, endpoint = %endpoint_name, envelope = %lease.id,
                    attempt = lease.attempts + 1, %cause, retry_in = ?retry_in, "delivery failed"
                );
            }
            None
        }
        Outcome::Refused { class, cause } => {
            warn!(tenant = %env.tenant, endpoint = %endpoint_name, envelope = %lease.id, %cause, "refused; dead-lettering");
            report(shared, &lease, elapsed, class, &Failure::dead(&cause)).await;
            None
        }
    }
}

/// Nack and count the result; log the breaker change and a dead letter.
/// Returns what the nack answered (`None` when it failed).
async fn report(
    shared: &Shared,
    lease: &Lease,
    elapsed: Duration,
    class: &str,
    failure: &Failure<'_>,
) -> Option<NackOutcome> {
    count(shared, class);
    let outcome = shared.store.nack(lease, elapsed, failure).await;
    match &outcome {
        Ok(NackOutcome::Retry { breaker, .. }) => {
            if let Some(change) = *breaker {
                breaker_changed(shared, &lease.tenant, &lease.id, change);
            }
        }
        Ok(NackOutcome::Dead { attempts, breaker }) => {
            count(shared, "dead");
            warn!(tenant = %lease.tenant, envelope = %lease.id, attempts, cause = %failure.cause, "dead-lettered");
            if let Some(change) = *breaker {
                breaker_changed(shared, &lease.tenant, &lease.id, change);
            }
        }
        Ok(NackOutcome::Stale) => {}
        Err(e) => warn!(envelope = %lease.id, error = %e, "nack failed; the reaper will return it"),
    }
    outcome.ok()
}

fn count(shared: &Shared, class: &str) {
    shared
        .metrics
        .deliveries
        .get_or_create(&OutcomeLabels {
            queue: shared.queue_label.clone(),
            class: class.to_string(),
        })
        .inc();
}

fn breaker_changed(shared: &Shared, tenant: &str, envelope: &str, change: BreakerChange) {
    warn!(
        tenant,
        envelope,
        state = change.as_str(),
        "circuit breaker changed state"
    );
    shared
        .metrics
        .breaker_changes
        .get_or_create(&BreakerLabels {
            queue: shared.queue_label.clone(),
            state: change.as_str().to_string(),
        })
        .inc();
}

struct DecOnDrop(prometheus_client::metrics::gauge::Gauge);

impl Drop for DecOnDrop {
    fn drop(&mut self) {
        self.0.dec();
    }
}
