//! Queue operations: a queue's policy, enqueue (one, many, limited, routed),
//! lease, ack, nack, release, maintenance and wake-ups.

use std::time::Duration;

use redis::Value;

use super::conn::{cluster_builder, PubSubSource};
use super::keys;
use super::library::{function_missing, load_library, Func};
use super::reply::{
    ack_lease_reply, ack_reply, enqueue_reply, lease_batch_reply, lease_reply, maintain_reply,
    nack_reply, release_reply, sweep_reply,
};
use super::{
    Acked, EnqueueOutcome, Failure, Lease, LeaseBatch, LeaseOutcome, NackOutcome, Result, Store,
    StoreError, SweepStep,
};
use crate::envelope::Envelope;
use crate::policy::QueuePolicy;
use crate::routing::QueueId;

/// Tenants a worker's step of the idle-tenant sweep looks at: one step
/// per maintenance tick (500 ms), so 100 tenants a second per worker. A
/// step of 200 took up to 6.5 ms of Redis time on a 2-core machine, and
/// one of 100 up to 14 ms once (usually 1.5): 50 keeps far under 10.
pub const SWEEP_STEP: u32 = 50;

/// The most acks, and the most leases, one [`Store::lease_batch`] call
/// carries (the script refuses more).
pub const LEASE_BATCH_MAX: usize = 64;

/// Envelopes per enqueue script call in a batch.
pub const ENQUEUE_CHUNK: usize = 200;

/// What an enqueue tells the queue about its tenant's tier (`tr` in the
/// tenant's state, which picks the tier weight).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TierUpdate {
    /// Not known to the caller: the tenant keeps what it has.
    #[default]
    Keep,
    /// The tenant has no tier (any it had is cleared).
    Clear,
    /// The tenant's tier.
    Set(std::sync::Arc<str>),
}

impl TierUpdate {
    /// The script argument: '' keep, '-' clear, else the name (a tier name
    /// never starts with '-').
    fn arg(&self) -> &str {
        match self {
            TierUpdate::Keep => "",
            TierUpdate::Clear => "-",
            TierUpdate::Set(t) => t,
        }
    }
}

/// What one enqueue call says about a tenant besides its envelopes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantTerms {
    /// Envelopes are refused FULL once the tenant's depth reaches this.
    pub backlog_limit: Option<u64>,
    pub tier: TierUpdate,
}

impl TenantTerms {
    /// A backlog limit only; the tier is kept.
    pub fn limit(backlog_limit: Option<u64>) -> Self {
        Self {
            backlog_limit,
            tier: TierUpdate::Keep,
        }
    }
}

/// Tenants a lease may credit and rotate before it answers `Again`.
const LEASE_SCAN_BUDGET: u32 = 256;

impl Store {
    /// Write the fairness policy a queue's scripts read.
    pub async fn configure_queue(&self, q: QueueId, policy: &QueuePolicy) -> Result<()> {
        let p = self.queue_prefix(q);
        let fields = [
            ("quantum", policy.quantum_seconds.to_string()),
            ("cap", policy.max_in_flight.to_string()),
            (
                "ordered",
                if policy.ordered { "1" } else { "0" }.to_string(),
            ),
            ("weight", policy.default_weight.to_string()),
            ("est0", policy.initial_estimate_seconds.to_string()),
            ("maxatt", policy.max_attempts.to_string()),
            (
                "idttl",
                policy.idempotency_window.as_secs().max(1).to_string(),
            ),
            ("bratio", policy.breaker.failure_ratio.to_string()),
            ("bmin", policy.breaker.min_requests.to_string()),
            ("bwin", policy.breaker.window.as_millis().to_string()),
            ("bopen", policy.breaker.open_for.as_millis().to_string()),
            (
                "dlmax",
                policy.dead_letters.max_per_tenant.max(1).to_string(),
            ),
            (
                "dlage",
                policy.dead_letters.max_age.as_secs().max(1).to_string(),
            ),
            (
                "pmax",
                policy.max_retry_after.as_millis().max(1).to_string(),
            ),
            (
                "sweep",
                policy
                    .sweep_idle_after
                    .map_or(0, |d| d.as_secs().max(1))
                    .to_string(),
            ),
        ];
        // The scripts read the policy as one field (see common.lua); the
        // fields one by one are what library versions before it read, kept
        // while such workers may still run during a rolling upgrade.
        // Tier weights go only in the packed string, as `tw.<tier>=<weight>`
        // (a tier name holds no space or '=').
        let packed = fields
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .chain(
                policy
                    .tier_weights
                    .iter()
                    .map(|(tier, w)| format!("tw.{tier}={w}")),
            )
            .chain(rate_limit_entries(&policy.rate_limits))
            .chain((!policy.caps.is_empty()).then(|| "capn=1".to_string()))
            .chain(isolation_entries(policy))
            .collect::<Vec<_>>()
            .join(" ");
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset_multiple(keys::conf(&p), &fields)
            .ignore()
            .hset(keys::conf(&p), "policy", packed)
            .ignore()
            .del(keys::weights(&p))
            .ignore()
            .del(keys::limits(&p))
            .ignore()
            .del(keys::caps(&p))
            .ignore();
        // bounded by the CRD (10,000 entries each); written in chunks so no
        // one command carries them all
        let weights: Vec<(String, String)> = policy
            .weights
            .iter()
            .map(|(t, w)| (t.clone(), w.to_string()))
            .collect();
        for chunk in weights.chunks(1000) {
            pipe.hset_multiple(keys::weights(&p), chunk).ignore();
        }
        let limits: Vec<(String, String)> = policy
            .rate_limits
            .tenants
            .iter()
            .map(|(t, l)| (t.clone(), l.encode(' ')))
            .collect();
        for chunk in limits.chunks(1000) {
            pipe.hset_multiple(keys::limits(&p), chunk).ignore();
        }
        let caps: Vec<(String, String)> = policy
            .caps
            .iter()
            .map(|(t, c)| (t.clone(), c.max(&1).to_string()))
            .collect();
        for chunk in caps.chunks(1000) {
            pipe.hset_multiple(keys::caps(&p), chunk).ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    /// Enqueue one envelope into `q` (one script call). The script decides,
    /// atomically, whether it is queued, held (tenant paused) or refused with
    /// MOVED (tenant gone); the caller routes, this does not.
    pub async fn enqueue(&self, q: QueueId, env: &Envelope) -> Result<EnqueueOutcome> {
        self.enqueue_limited(q, env, None).await
    }

    /// Enqueue one envelope unless its tenant's backlog in `q` has reached
    /// `limit` (then [`EnqueueOutcome::Full`], and nothing is stored).
    pub async fn enqueue_limited(
        &self,
        q: QueueId,
        env: &Envelope,
        limit: Option<u64>,
    ) -> Result<EnqueueOutcome> {
        let payload = encode(env)?;
        let limit = limit.unwrap_or(0).to_string();
        // see enqueue.lua: not routed, then one tenant's group of one
        let v = self
            .run(
                Func::Enqueue,
                q,
                &[
                    b"0",
                    env.tenant.as_bytes(),
                    b"1",
                    limit.as_bytes(),
                    TierUpdate::Keep.arg().as_bytes(),
                    env.id.as_bytes(),
                    env.endpoint_name().as_bytes(),
                    &payload,
                ],
            )
            .await?;
        enqueue_reply(v, 1)?
            .pop()
            .expect("a reply of one pair has one outcome")
    }

    /// Enqueue many envelopes into `q`: up to [`ENQUEUE_CHUNK`] per script
    /// call, all calls in one pipeline (one round trip). Invalid envelopes get
    /// their error; the others are stored. Safe to repeat: ids are
    /// idempotency keys.
    pub async fn enqueue_batch(
        &self,
        q: QueueId,
        envs: &[Envelope],
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        self.enqueue_batch_limited(q, envs, |_| None).await
    }

    /// [`Store::enqueue_batch`] with a backlog limit per tenant: envelopes of
    /// a tenant whose depth in `q` has reached `limit(tenant)` answer
    /// [`EnqueueOutcome::Full`] and are not stored.
    pub async fn enqueue_batch_limited(
        &self,
        q: QueueId,
        envs: &[Envelope],
        limit: impl Fn(&str) -> Option<u64>,
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        self.enqueue_batch_routed(q, envs, |t| TenantTerms::limit(limit(t)), 0)
            .await
    }

    /// [`Store::enqueue_batch_limited`] with each tenant's terms (backlog
    /// limit and tier), by a caller that routed with the routing table of
    /// version `routed` (0: not routed): if the queue's fence is newer, every
    /// envelope answers [`EnqueueOutcome::Stale`] and nothing is stored.
    pub async fn enqueue_batch_routed(
        &self,
        q: QueueId,
        envs: &[Envelope],
        terms: impl Fn(&str) -> TenantTerms,
        routed: u64,
    ) -> Result<Vec<Result<EnqueueOutcome>>> {
        let prefix = self.queue_prefix(q);
        let guard = keys::slot_guard(&prefix);
        let function = Func::Enqueue.name(self.lib);
        let mut results: Vec<Option<Result<EnqueueOutcome>>> = Vec::with_capacity(envs.len());
        let mut valid: Vec<(usize, Vec<u8>)> = Vec::with_capacity(envs.len());
        for (i, env) in envs.iter().enumerate() {
            match encode(env) {
                Err(e) => results.push(Some(Err(e))),
                Ok(payload) => {
                    results.push(None);
                    valid.push((i, payload));
                }
            }
        }
        // Each tenant's envelopes side by side (a stable sort: a tenant's
        // order is kept), so a call carries few tenants: the script's work is
        // per tenant as well as per envelope (state, claims, lane push).
        valid.sort_by(|a, b| envs[a.0].tenant.cmp(&envs[b.0].tenant));
        let mut pipe = redis::pipe();
        for chunk in valid.chunks(ENQUEUE_CHUNK) {
            let cmd = pipe
                .cmd("FCALL")
                .arg(&function)
                .arg(2)
                .arg(&prefix)
                .arg(&guard)
                .arg(routed);
            // per run of a tenant's envelopes (see enqueue.lua): the tenant,
            // their count and its terms (asked for once), then their ids
            // side by side, then each one's endpoint and payload
            for run in chunk.chunk_by(|a, b| envs[a.0].tenant == envs[b.0].tenant) {
                let tenant = &envs[run[0].0].tenant;
                let tt = terms(tenant);
                cmd.arg(tenant)
                    .arg(run.len())
                    .arg(tt.backlog_limit.unwrap_or(0))
                    .arg(tt.tier.arg());
                for (i, _) in run {
                    cmd.arg(&envs[*i].id);
                }
                for (i, payload) in run {
                    cmd.arg(envs[*i].endpoint_name()).arg(payload);
                }
            }
        }
        if !valid.is_empty() {
            let mut conn = self.conn.clone();
            let replies: Vec<Value> = match pipe.query_async(&mut conn).await {
                Ok(r) => r,
                Err(e) if function_missing(&e) => {
                    load_library(&mut conn, self.lib).await?;
                    pipe.query_async(&mut conn).await?
                }
                Err(e) => return Err(e.into()),
            };
            for (chunk, reply) in valid.chunks(ENQUEUE_CHUNK).zip(replies) {
                for ((i, _), outcome) in chunk.iter().zip(enqueue_reply(reply, chunk.len())?) {
                    results[*i] = Some(outcome);
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every slot filled"))
            .collect())
    }

    /// Lease the next envelope of `q` by deficit round robin (one script call).
    pub async fn lease(
        &self,
        q: QueueId,
        worker: &str,
        lease_for: Duration,
    ) -> Result<LeaseOutcome> {
        let ms = lease_for.as_millis().max(1).to_string();
        let budget = LEASE_SCAN_BUDGET.to_string();
        let token = lease_token(worker);
        let v = self
            .run(
                Func::Lease,
                q,
                &[ms.as_bytes(), token.as_bytes(), budget.as_bytes()],
            )
            .await?;
        lease_reply(q, v)
    }

    /// Acknowledge `done` and lease the next envelope of the same queue in
    /// one script call: the worker's loop after each delivery, at one round
    /// trip instead of two. The bool is what [`Store::ack`] would return.
    pub async fn ack_and_lease(
        &self,
        done: &Lease,
        elapsed: Duration,
        worker: &str,
        lease_for: Duration,
    ) -> Result<(Acked, LeaseOutcome)> {
        let us = elapsed.as_micros().to_string();
        let ms = lease_for.as_millis().max(1).to_string();
        let budget = LEASE_SCAN_BUDGET.to_string();
        let token = lease_token(worker);
        let v = self
            .run(
                Func::AckLease,
                done.queue,
                &[
                    done.id.as_bytes(),
                    done.token.as_bytes(),
                    us.as_bytes(),
                    ms.as_bytes(),
                    token.as_bytes(),
                    budget.as_bytes(),
                ],
            )
            .await?;
        ack_lease_reply(done.queue, v)
    }

    /// Acknowledge the deliveries in `done` (each with the time it took)
    /// and lease up to `k` envelopes of `q`, in one script call: a worker
    /// with `k` free slots. Each lease is its own turn of deficit round
    /// robin (the tenants served are those `k` calls of [`Store::lease`] in
    /// a row would serve), so caps, rate limits and fairness hold per
    /// envelope, and each lease has its own deadline. At most
    /// [`LEASE_BATCH_MAX`] each way; every lease in `done` must be of `q`.
    pub async fn lease_batch(
        &self,
        q: QueueId,
        done: &[(&Lease, Duration)],
        k: usize,
        worker: &str,
        lease_for: Duration,
    ) -> Result<LeaseBatch> {
        if k > LEASE_BATCH_MAX || done.len() > LEASE_BATCH_MAX {
            return Err(StoreError::InvalidBatch(format!(
                "it carries at most {LEASE_BATCH_MAX} acks and {LEASE_BATCH_MAX} leases (asked: {} acks, {k} leases)",
                done.len()
            )));
        }
        if let Some((l, _)) = done.iter().find(|(l, _)| l.queue != q) {
            return Err(StoreError::InvalidBatch(format!(
                "it acks leases of its own queue only ({q}); envelope {} is of {}",
                l.id, l.queue
            )));
        }
        let ms = lease_for.as_millis().max(1).to_string();
        let budget = LEASE_SCAN_BUDGET.to_string();
        let token = lease_token(worker);
        let (k_s, n_s) = (k.to_string(), done.len().to_string());
        let us: Vec<String> = done
            .iter()
            .map(|(_, e)| e.as_micros().to_string())
            .collect();
        let mut args: Vec<&[u8]> = vec![
            ms.as_bytes(),
            token.as_bytes(),
            budget.as_bytes(),
            k_s.as_bytes(),
            n_s.as_bytes(),
        ];
        for ((lease, _), us) in done.iter().zip(&us) {
            args.extend([lease.token.as_bytes(), us.as_bytes()]);
        }
        let v = self.run(Func::LeaseBatch, q, &args).await?;
        lease_batch_reply(q, v, done.len(), k)
    }

    /// Acknowledge a delivery that took `elapsed`. Idempotent: a second ack,
    /// or an ack for a lease that expired and moved on, returns false.
    pub async fn ack(&self, lease: &Lease, elapsed: Duration) -> Result<bool> {
        let us = elapsed.as_micros().to_string();
        let v = self
            .run(
                Func::Ack,
                lease.queue,
                &[lease.id.as_bytes(), lease.token.as_bytes(), us.as_bytes()],
            )
            .await?;
        ack_reply(v)
    }

    /// Report a failed delivery. With `retry_in`, the envelope waits in the
    /// delayed set and then returns to the head of its lane; with `None`, or
    /// after the last attempt, it is dead-lettered with the cause.
    pub async fn nack(
        &self,
        lease: &Lease,
        elapsed: Duration,
        failure: &Failure<'_>,
    ) -> Result<NackOutcome> {
        let us = elapsed.as_micros().to_string();
        let delay = failure.retry_in.unwrap_or_default().as_millis().to_string();
        let flag = |b: bool| if b { "1" } else { "0" };
        // at least 1 ms: 0 means no pause
        let pace = failure
            .pace
            .map_or(0, |p| p.as_millis().clamp(1, u64::MAX as u128) as u64)
            .to_string();
        let v = self
            .run(
                Func::Nack,
                lease.queue,
                &[
                    lease.id.as_bytes(),
                    lease.token.as_bytes(),
                    us.as_bytes(),
                    delay.as_bytes(),
                    flag(failure.retry_in.is_none()).as_bytes(),
                    failure.cause.as_bytes(),
                    flag(failure.endpoint_fault).as_bytes(),
                    pace.as_bytes(),
                ],
            )
            .await?;
        nack_reply(v)
    }

    /// Give a leased envelope back undelivered (a worker shutting down): it
    /// returns to the head of its lane, no attempt counted. False if the
    /// lease was gone.
    pub async fn release(&self, lease: &Lease) -> Result<bool> {
        let v = self
            .run(
                Func::Release,
                lease.queue,
                &[lease.id.as_bytes(), lease.token.as_bytes()],
            )
            .await?;
        Ok(release_reply(&v))
    }

    /// Promote due retries and reap expired leases, up to `limit` of each.
    /// Returns (promoted, reaped). Leases do a little of this on every call;
    /// workers also run it on a timer so an idle queue still recovers.
    pub async fn maintain(&self, q: QueueId, limit: u32) -> Result<(u64, u64)> {
        let v = self
            .run(Func::Maintain, q, &[limit.to_string().as_bytes()])
            .await?;
        maintain_reply(v)
    }

    /// One bounded step of the sweep of idle tenants in `q` (see
    /// sweep.lua): looks at about `count` tenants (at most 500) and deletes
    /// the state of those idle longer than the queue's
    /// [`QueuePolicy::sweep_idle_after`]. Workers call it on a timer; a
    /// pass over all the queue's tenants takes as many steps as it needs,
    /// and the next pass waits a quarter of the idle time.
    pub async fn sweep(&self, q: QueueId, count: u32) -> Result<SweepStep> {
        let v = self
            .run(Func::Sweep, q, &[count.to_string().as_bytes()])
            .await?;
        sweep_reply(v)
    }

    /// A stream that yields whenever a tenant becomes active in `q` (new
    /// work for idle workers), from the queue's pub/sub channel. It ends
    /// when the connection drops; workers then fall back to polling and
    /// subscribe again.
    pub async fn wakeups(
        &self,
        q: QueueId,
    ) -> Result<impl futures::Stream<Item = ()> + Send + use<>> {
        use futures::StreamExt;
        let channel = keys::wake(&self.queue_prefix(q));
        match &self.pubsub {
            PubSubSource::Single(client) => {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(channel).await?;
                Ok(pubsub.into_on_message().map(|_| ()).boxed())
            }
            PubSubSource::Cluster(nodes, opts, tls) => {
                // Sharded pub/sub (the cluster library SPUBLISHes): the
                // cluster client sends SSUBSCRIBE to the node owning the
                // channel's slot and passes messages on as RESP3 pushes.
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let client = cluster_builder(nodes, opts, tls.as_ref())
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(tx)
                    .build()?;
                let mut conn = client.get_async_connection().await?;
                conn.ssubscribe(&channel).await?;
                Ok(
                    futures::stream::unfold((rx, conn), |(mut rx, conn)| async move {
                        loop {
                            match rx.recv().await?.kind {
                                redis::PushKind::SMessage => return Some(((), (rx, conn))),
                                // The node dropped the subscription (its slot
                                // moved away) or the connection: end, and the
                                // worker subscribes again where the slot is now.
                                redis::PushKind::SUnsubscribe | redis::PushKind::Disconnection => {
                                    return None
                                }
                                _ => continue,
                            }
                        }
                    })
                    .boxed(),
                )
            }
        }
    }
}

/// A lease token, unique per lease, so a late ack from an expired holder is told apart.
///
/// 128 random bits make every lease as stored (charge, start, id, tenant
/// and this) longer than Redis's 64-byte listpack limit for ZSET members,
/// so the `leases` ZSET is a skiplist at any number in flight, as it is
/// anyway with the long worker names of a Kubernetes deployment. As a
/// listpack (short names, a benchmark's) each insert and removal scans and
/// moves the whole list: at 64 leases in flight that was 7% of the
/// instructions of a batched delivery (`cargo bench --bench profile`).
fn lease_token(worker: &str) -> String {
    // The lease as stored separates its parts by newlines (see common.lua).
    let worker: String = worker.chars().filter(|c| !c.is_control()).collect();
    format!("{worker}:{:032x}", rand::random::<u128>())
}

/// Validate an envelope and encode it as stored.
fn encode(env: &Envelope) -> Result<Vec<u8>> {
    env.validate()?;
    serde_json::to_vec(env).map_err(|e| StoreError::Protocol {
        script: "enqueue",
        detail: format!("cannot encode envelope {}: {e}", env.id),
    })
}

/// The rate-limit entries of a queue's packed policy (see common.lua's
/// `parse_policy`): the default as `rl=rate,burst,erate,eburst`, each tier's
/// as `rl.<tier>=...`, and `rln=1` when some tenant has an entry of its own
/// in `P:limits`, so a queue without any pays no lookup per lease.
fn rate_limit_entries(l: &crate::policy::RateLimits) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(d) = l.default.filter(|d| d.is_limited()) {
        out.push(format!("rl={}", d.encode(',')));
    }
    for (tier, t) in &l.tiers {
        out.push(format!("rl.{tier}={}", t.encode(',')));
    }
    if !l.tenants.is_empty() {
        out.push("rln=1".to_string());
    }
    out
}

/// The packed policy's isolation entries (see common.lua `parse_policy`):
/// `iso=ep` under endpoint isolation, with `capep=<n>` when the set gives
/// an endpoint cap; nothing under tenant isolation, so its queues pay
/// nothing for it.
fn isolation_entries(policy: &QueuePolicy) -> Vec<String> {
    if policy.isolation != crate::policy::Isolation::Endpoint {
        return Vec::new();
    }
    let mut out = vec!["iso=ep".to_string()];
    if let Some(n) = policy.max_in_flight_per_endpoint {
        out.push(format!("capep={}", n.max(1)));
    }
    out
}
