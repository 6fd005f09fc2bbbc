//! The discrete-event loop. Virtual time advances from event to event
//! (an arrival, a delivery finishing, a promotion tick); at each event the
//! virtual workers call the real store on a real Redis at that virtual time.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::{Mix, Workload};
use crate::controller::promotion;
use crate::crd::PromotionCandidate;
use crate::envelope::Envelope;
use crate::routing::{hash_shard, QueueId};
use crate::scheduler::QueuePolicy;
use crate::store::{ConnectOptions, EnqueueOutcome, Lease, LeaseOutcome, SetId, Store};

/// Virtual time zero, as the scripts see it (ms since the Unix epoch): any
/// fixed instant works; this one keeps timestamps plausible.
const EPOCH_MS: u64 = 1_700_000_000_000;
/// Longer than any delivery: no lease expires in a run.
const LEASE_FOR: Duration = Duration::from_secs(3600);
/// A small envelope that waited longer than this counts as delayed.
pub const DELAYED: Duration = Duration::from_secs(1);
/// Points of the chart's time axis.
pub const CHART_BUCKETS: usize = 60;

/// A way of serving the same workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Strategy {
    /// One FIFO queue served by every worker (a plain Redis list).
    Fifo,
    /// Rendezvous-hashed shards, a plain FIFO list each.
    ShardsFifo,
    /// Hashed shards, production fair scheduling (the Lua scripts).
    ShardsFair,
    /// Hashed shards, fair, and dedicated lanes for hot tenants.
    FairLanes,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Fifo,
        Strategy::ShardsFifo,
        Strategy::ShardsFair,
        Strategy::FairLanes,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Fifo => "fifo",
            Strategy::ShardsFifo => "shards-fifo",
            Strategy::ShardsFair => "shards-fair",
            Strategy::FairLanes => "fair+lanes",
        }
    }

    fn fair(self) -> bool {
        matches!(self, Strategy::ShardsFair | Strategy::FairLanes)
    }
}

/// Wait (arrival to lease) of the small tenants' envelopes, seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WaitStats {
    pub count: usize,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    /// Share of them that waited longer than [`DELAYED`].
    pub delayed_share: f64,
}

impl WaitStats {
    fn of(mut waits_ms: Vec<u64>) -> Self {
        if waits_ms.is_empty() {
            return Self::default();
        }
        waits_ms.sort_unstable();
        let delayed = waits_ms
            .iter()
            .filter(|w| **w > DELAYED.as_millis() as u64)
            .count();
        Self {
            count: waits_ms.len(),
            p50: percentile(&waits_ms, 0.50),
            p95: percentile(&waits_ms, 0.95),
            p99: percentile(&waits_ms, 0.99),
            max: *waits_ms.last().unwrap_or(&0) as f64 / 1000.0,
            delayed_share: delayed as f64 / waits_ms.len() as f64,
        }
    }
}

/// Nearest-rank percentile of sorted milliseconds, in seconds.
fn percentile(sorted_ms: &[u64], p: f64) -> f64 {
    let rank = ((p * sorted_ms.len() as f64).ceil() as usize).clamp(1, sorted_ms.len());
    sorted_ms[rank - 1] as f64 / 1000.0
}

/// What one strategy did with the workload.
#[derive(Clone, Debug)]
pub struct StrategyResult {
    pub strategy: Strategy,
    pub small: WaitStats,
    /// Per whale: first arrival to last delivery finished, seconds.
    pub whale_drain: Vec<(String, f64)>,
    /// Max over median of the shards' worker-seconds (1 with one queue;
    /// infinite when the median shard did nothing).
    pub skew: f64,
    /// Small-tenant p99 wait (seconds) of the envelopes arriving in each
    /// [`Report::bucket_s`]-long bucket; None where none arrived.
    pub series: Vec<Option<f64>>,
    /// Tenants given a dedicated lane, and when (virtual seconds).
    pub promoted: Vec<(String, f64)>,
    /// Virtual seconds until the last delivery finished.
    pub makespan: f64,
    pub deliveries: u64,
    /// Wall time this strategy took to simulate.
    pub wall: Duration,
}

impl StrategyResult {
    /// The longest whale drain, if there is a whale.
    pub fn max_whale_drain(&self) -> Option<f64> {
        self.whale_drain.iter().map(|(_, s)| *s).reduce(f64::max)
    }
}

/// Every strategy on the same workload.
#[derive(Clone, Debug)]
pub struct Report {
    pub mix: Mix,
    pub envelopes: usize,
    pub bucket_s: f64,
    pub results: Vec<StrategyResult>,
}

impl Report {
    pub fn get(&self, s: Strategy) -> &StrategyResult {
        self.results
            .iter()
            .find(|r| r.strategy == s)
            .expect("every strategy runs")
    }
}

/// A name for one run's throwaway sets, unique per process and time.
pub fn run_id() -> String {
    format!(
        "sim-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros()
            & 0xffff_ffff
    )
}

/// The throwaway ShardSet of `strategy` in the run `run_id`.
pub fn set_of(run_id: &str, strategy: Strategy) -> SetId {
    SetId::new("simulate", format!("{run_id}-{}", strategy as u8))
}

/// Run every strategy on `workload` against the Redis at `url`. Each
/// strategy works in its own throwaway ShardSet (namespace `simulate`),
/// whose keys are deleted afterwards, whether it succeeded or not.
pub async fn run(url: &str, mix: &Mix, workload: &Workload) -> anyhow::Result<Report> {
    run_as(url, mix, workload, &run_id()).await
}

/// [`run`] in the sets of `run_id` (see [`set_of`]), so that a caller
/// interrupted midway can delete them ([`purge`]).
pub async fn run_as(
    url: &str,
    mix: &Mix,
    workload: &Workload,
    run_id: &str,
) -> anyhow::Result<Report> {
    mix.validate()?;
    let duration_s = Duration::from(mix.duration).as_secs_f64().max(0.001);
    let bucket_s = duration_s / CHART_BUCKETS as f64;
    let mut results = Vec::new();
    for strategy in Strategy::ALL {
        let set = set_of(run_id, strategy);
        let opts = ConnectOptions {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
        };
        let store = Store::connect(url, set, opts)
            .await
            .with_context(|| "connecting to the simulator's Redis (--redis)")?;
        let started = Instant::now();
        let outcome = Sim::new(store.clone(), mix, workload, strategy, bucket_s)
            .run()
            .await;
        let purged = store.purge_set().await;
        let mut result =
            outcome.with_context(|| format!("simulating strategy {}", strategy.name()))?;
        purged.context("deleting the simulator's keys")?;
        result.wall = started.elapsed();
        results.push(result);
    }
    Ok(Report {
        mix: mix.clone(),
        envelopes: workload.arrivals.len(),
        bucket_s,
        results,
    })
}

/// Delete the keys of every set of the run `run_id` (after an interruption).
pub async fn purge(url: &str, run_id: &str) -> anyhow::Result<u64> {
    let mut removed = 0;
    for strategy in Strategy::ALL {
        let store =
            Store::connect(url, set_of(run_id, strategy), ConnectOptions::default()).await?;
        removed += store.purge_set().await?;
    }
    Ok(removed)
}

/// What a virtual worker is doing.
enum Task {
    /// An envelope popped from a FIFO list (index into the arrivals).
    Fifo(usize),
    /// A lease from the production scripts.
    Fair(Box<Lease>),
}

struct Queue {
    id: QueueId,
    tasks: Vec<Option<Task>>,
    idle: Vec<usize>,
    /// Worker-seconds delivered.
    worker_seconds: f64,
}

struct Sim<'a> {
    store: Store,
    mix: &'a Mix,
    workload: &'a Workload,
    strategy: Strategy,
    bucket_s: f64,
    policy: QueuePolicy,
    queues: Vec<Queue>,
    index: HashMap<QueueId, usize>,
    /// The virtual time each queue's scripts were last set to.
    clocks: HashMap<QueueId, u64>,
    /// (finish ms, sequence, queue, worker)
    events: BinaryHeap<Reverse<(u64, u64, usize, usize)>>,
    seq: u64,
    leased_at: Vec<u64>,
    finished_at: Vec<u64>,
    pins: HashMap<u32, QueueId>,
    promoted: Vec<(String, f64)>,
    hot: Vec<PromotionCandidate>,
    deliveries: u64,
}

impl<'a> Sim<'a> {
    fn new(
        store: Store,
        mix: &'a Mix,
        workload: &'a Workload,
        strategy: Strategy,
        bucket_s: f64,
    ) -> Self {
        let policy = QueuePolicy {
            quantum_seconds: mix.quantum_seconds,
            max_in_flight: mix.cap,
            // the first estimate: the small tenants' median latency
            initial_estimate_seconds: Duration::from(mix.latency.median).as_secs_f64(),
            ..QueuePolicy::default()
        };
        let n = workload.arrivals.len();
        Self {
            store,
            mix,
            workload,
            strategy,
            bucket_s,
            policy,
            queues: Vec::new(),
            index: HashMap::new(),
            clocks: HashMap::new(),
            events: BinaryHeap::new(),
            seq: 0,
            leased_at: vec![u64::MAX; n],
            finished_at: vec![u64::MAX; n],
            pins: HashMap::new(),
            promoted: Vec::new(),
            hot: Vec::new(),
            deliveries: 0,
        }
    }

    fn worker_name(q: QueueId, w: usize) -> String {
        format!("sim-{q}-w{w}")
    }

    async fn add_queue(&mut self, id: QueueId, workers: u32) -> anyhow::Result<()> {
        if self.strategy.fair() {
            self.store.configure_queue(id, &self.policy).await?;
        }
        self.index.insert(id, self.queues.len());
        self.queues.push(Queue {
            id,
            tasks: (0..workers).map(|_| None).collect(),
            idle: (0..workers as usize).rev().collect(),
            worker_seconds: 0.0,
        });
        Ok(())
    }

    /// The queue `tenant`'s new envelopes go to.
    fn route(&self, tenant: u32) -> QueueId {
        match self.strategy {
            Strategy::Fifo => QueueId::Shard(0),
            _ => self.pins.get(&tenant).copied().unwrap_or_else(|| {
                hash_shard(&self.workload.tenants[tenant as usize], self.mix.shards)
            }),
        }
    }

    /// Point `q`'s scripts at virtual time `t` (one HSET when it moved).
    async fn at(&mut self, q: QueueId, t: u64) -> anyhow::Result<()> {
        if self.clocks.get(&q) != Some(&t) {
            self.store.set_virtual_clock(q, EPOCH_MS + t).await?;
            self.clocks.insert(q, t);
        }
        Ok(())
    }

    async fn run(mut self) -> anyhow::Result<StrategyResult> {
        match self.strategy {
            Strategy::Fifo => {
                let all = self.mix.workers * self.mix.shards as u32;
                self.add_queue(QueueId::Shard(0), all).await?;
            }
            _ => {
                for s in 0..self.mix.shards {
                    self.add_queue(QueueId::Shard(s), self.mix.workers).await?;
                }
            }
        }
        let promoting = self.strategy == Strategy::FairLanes && self.mix.promotion.enabled;
        let tick_ms = Duration::from(self.mix.promotion.tick).as_millis().max(1) as u64;
        let mut next_tick = if promoting { tick_ms } else { u64::MAX };
        let arrivals = &self.workload.arrivals;
        let mut next = 0usize;
        loop {
            let ta = arrivals.get(next).map_or(u64::MAX, |a| a.at_ms);
            let td = self.events.peek().map_or(u64::MAX, |Reverse(e)| e.0);
            if ta == u64::MAX && td == u64::MAX {
                break;
            }
            let t = ta.min(td).min(next_tick);
            if td == t {
                // deliveries finishing now
                while let Some(Reverse((ft, _, q, w))) = self.events.peek().copied() {
                    if ft != t {
                        break;
                    }
                    self.events.pop();
                    self.finish(q, w, t).await?;
                }
            } else if next_tick == t {
                self.promotion_tick(t).await?;
                next_tick += tick_ms;
            } else {
                // every arrival at this instant, one batch per queue
                let mut batches: BTreeMap<QueueId, Vec<usize>> = BTreeMap::new();
                while next < arrivals.len() && arrivals[next].at_ms == t {
                    let q = self.route(arrivals[next].tenant);
                    batches.entry(q).or_default().push(next);
                    next += 1;
                }
                for (q, batch) in batches {
                    self.enqueue(q, &batch, t).await?;
                    self.wake(q, t).await?;
                }
            }
        }
        self.result()
    }

    async fn enqueue(&mut self, q: QueueId, batch: &[usize], t: u64) -> anyhow::Result<()> {
        if !self.strategy.fair() {
            let ids: Vec<String> = batch.iter().map(|i| i.to_string()).collect();
            self.store.fifo_push(q, &ids).await?;
            return Ok(());
        }
        self.at(q, t).await?;
        let envs: Vec<Envelope> = batch
            .iter()
            .map(|i| Envelope {
                id: i.to_string(),
                tenant: self.workload.tenants[self.workload.arrivals[*i].tenant as usize].clone(),
                endpoint: None,
                event_type: None,
                payload: serde_json::Value::Null,
            })
            .collect();
        for (outcome, env) in self
            .store
            .enqueue_batch(q, &envs)
            .await?
            .into_iter()
            .zip(&envs)
        {
            match outcome? {
                EnqueueOutcome::Queued { .. } => {}
                other => bail!("enqueue of {} into {q} answered {other:?}", env.id),
            }
        }
        Ok(())
    }

    /// Idle workers of `q` lease until nothing is eligible.
    async fn wake(&mut self, q: QueueId, t: u64) -> anyhow::Result<()> {
        let qi = self.index[&q];
        while let Some(w) = self.queues[qi].idle.pop() {
            if !self.take_next(qi, w, t).await? {
                self.queues[qi].idle.push(w);
                break;
            }
        }
        Ok(())
    }

    /// Worker `w` of queue `qi` takes its next envelope; false if none.
    async fn take_next(&mut self, qi: usize, w: usize, t: u64) -> anyhow::Result<bool> {
        let q = self.queues[qi].id;
        if !self.strategy.fair() {
            return Ok(match self.store.fifo_pop(q).await? {
                Some(id) => {
                    let i: usize = id.parse().context("a FIFO id")?;
                    self.start(qi, w, Task::Fifo(i), i, t);
                    true
                }
                None => false,
            });
        }
        self.at(q, t).await?;
        let worker = Self::worker_name(q, w);
        loop {
            match self.store.lease(q, &worker, LEASE_FOR).await? {
                LeaseOutcome::Again => continue,
                LeaseOutcome::Empty { .. } => return Ok(false),
                LeaseOutcome::Leased(lease) => {
                    self.start_lease(qi, w, lease, t)?;
                    return Ok(true);
                }
            }
        }
    }

    fn start_lease(&mut self, qi: usize, w: usize, lease: Lease, t: u64) -> anyhow::Result<()> {
        let i: usize = lease.id.parse().context("a leased id")?;
        if lease.enqueued_ms != EPOCH_MS + self.workload.arrivals[i].at_ms {
            bail!(
                "envelope {i} was enqueued at {} by the scripts' clock, not at its arrival",
                lease.enqueued_ms
            );
        }
        self.start(qi, w, Task::Fair(Box::new(lease)), i, t);
        Ok(())
    }

    fn start(&mut self, qi: usize, w: usize, task: Task, i: usize, t: u64) {
        self.leased_at[i] = t;
        self.queues[qi].tasks[w] = Some(task);
        self.seq += 1;
        let done = t + self.workload.arrivals[i].service_ms;
        self.events.push(Reverse((done, self.seq, qi, w)));
    }

    /// Worker `w` of queue `qi` finished its delivery at `t`: ack it and take the next.
    async fn finish(&mut self, qi: usize, w: usize, t: u64) -> anyhow::Result<()> {
        let task = self.queues[qi].tasks[w].take().context("a busy worker")?;
        let q = self.queues[qi].id;
        let i = match &task {
            Task::Fifo(i) => *i,
            Task::Fair(l) => l.id.parse().context("a leased id")?,
        };
        let service = self.workload.arrivals[i].service_ms;
        self.finished_at[i] = t;
        self.queues[qi].worker_seconds += service as f64 / 1000.0;
        self.deliveries += 1;
        let lease = match task {
            Task::Fifo(_) => {
                if !self.take_next(qi, w, t).await? {
                    self.queues[qi].idle.push(w);
                }
                return Ok(());
            }
            Task::Fair(lease) => lease,
        };
        self.at(q, t).await?;
        let worker = Self::worker_name(q, w);
        let (acked, mut next) = self
            .store
            .ack_and_lease(&lease, Duration::from_millis(service), &worker, LEASE_FOR)
            .await?;
        if !acked.acked {
            bail!("the ack of envelope {i} in {q} was refused (lease lost)");
        }
        while next == LeaseOutcome::Again {
            next = self.store.lease(q, &worker, LEASE_FOR).await?;
        }
        match next {
            LeaseOutcome::Leased(l) => {
                self.start_lease(qi, w, l, t)?;
                // the ack freed a slot: a tenant parked at its cap may be
                // eligible again for the workers that found nothing before
                if (self.mix.cap as usize) < self.queues[qi].tasks.len() {
                    self.wake(q, t).await?;
                }
            }
            _ => self.queues[qi].idle.push(w),
        }
        Ok(())
    }

    /// The promotion loop's tick: the production attribution
    /// (`tenant_stats` at virtual time) and the production promotion rule
    /// (`promotion::shard_observations` and `evaluate`). A promoted tenant's
    /// new envelopes go to its lane, served by its own workers; what it had
    /// queued on its shard drains there.
    async fn promotion_tick(&mut self, t: u64) -> anyhow::Result<()> {
        let p = &self.mix.promotion;
        let window: Duration = p.window.into();
        // the time the worker-second buckets read at `t` span, as the
        // controller's promotion loop computes it (whole buckets before the
        // current, partial one), and no more than the run so far
        let bucket_ms = crate::store::WORKER_SECONDS_BUCKET * 1000;
        let buckets = window
            .as_secs()
            .div_ceil(crate::store::WORKER_SECONDS_BUCKET)
            .max(1);
        let covered =
            Duration::from_millis(((buckets - 1) * bucket_ms + (EPOCH_MS + t) % bucket_ms).min(t));
        let skip: BTreeSet<String> = self
            .pins
            .keys()
            .map(|i| self.workload.tenants[*i as usize].clone())
            .collect();
        let mut observations = Vec::new();
        for s in 0..self.mix.shards {
            let q = QueueId::Shard(s);
            let stats = self.store.tenant_stats_at(q, window, EPOCH_MS + t).await?;
            observations.extend(promotion::shard_observations(
                q,
                &stats,
                self.mix.workers as f64,
                covered,
                &skip,
            ));
        }
        let spec = crate::crd::PromotionSpec {
            enabled: true,
            promote_share: p.promote_share,
            promote_after: p.promote_after,
            window: p.window,
            max_lanes: p.max_lanes as i32,
            ..Default::default()
        };
        let now = k8s_openapi::jiff::Timestamp::from_millisecond((EPOCH_MS + t) as i64)
            .context("virtual time as a timestamp")?;
        let decision = promotion::evaluate(&spec, now, &self.hot, &[], &observations);
        tracing::debug!(
            t_ms = t,
            hot = ?decision.hot,
            promote = ?decision.promote,
            "simulated promotion tick"
        );
        self.hot = decision.hot;
        for tenant in decision.promote {
            let used = self.pins.len();
            if used >= p.max_lanes as usize {
                break;
            }
            let Some(i) = self.workload.tenants.iter().position(|x| *x == tenant) else {
                continue;
            };
            let lane = QueueId::Lane(used as u8);
            let workers = p.lane_workers.unwrap_or(self.mix.workers);
            self.add_queue(lane, workers).await?;
            self.pins.insert(i as u32, lane);
            self.promoted.push((tenant, t as f64 / 1000.0));
        }
        Ok(())
    }

    fn result(self) -> anyhow::Result<StrategyResult> {
        let arrivals = &self.workload.arrivals;
        if let Some(i) = self.finished_at.iter().position(|f| *f == u64::MAX) {
            bail!("envelope {i} was never delivered");
        }
        // small tenants' waits, and per arrival-time bucket for the chart
        let mut waits = Vec::new();
        let mut buckets: Vec<Vec<u64>> = vec![Vec::new(); CHART_BUCKETS];
        for (a, l) in arrivals.iter().zip(&self.leased_at) {
            if self.workload.small[a.tenant as usize] {
                let wait = l - a.at_ms;
                waits.push(wait);
                let b = (a.at_ms as f64 / 1000.0 / self.bucket_s) as usize;
                buckets[b.min(CHART_BUCKETS - 1)].push(wait);
            }
        }
        let series = buckets
            .into_iter()
            .map(|mut b| {
                b.sort_unstable();
                (!b.is_empty()).then(|| percentile(&b, 0.99))
            })
            .collect();
        let mut whale_drain = Vec::new();
        for (ti, name) in self.workload.tenants.iter().enumerate() {
            if self.workload.small[ti] {
                continue;
            }
            let mine = arrivals
                .iter()
                .zip(&self.finished_at)
                .filter(|(a, _)| a.tenant as usize == ti);
            let first = mine.clone().map(|(a, _)| a.at_ms).min();
            let last = mine.map(|(_, f)| *f).max();
            if let (Some(first), Some(last)) = (first, last) {
                whale_drain.push((name.clone(), (last - first) as f64 / 1000.0));
            }
        }
        let mut per_shard: Vec<f64> = self
            .queues
            .iter()
            .filter(|q| matches!(q.id, QueueId::Shard(_)))
            .map(|q| q.worker_seconds)
            .collect();
        per_shard.sort_by(f64::total_cmp);
        let n = per_shard.len();
        let median = if n % 2 == 1 {
            per_shard[n / 2]
        } else {
            (per_shard[n / 2 - 1] + per_shard[n / 2]) / 2.0
        };
        let skew = if median > 0.0 {
            per_shard[n - 1] / median
        } else {
            f64::INFINITY
        };
        let makespan = self.finished_at.iter().copied().max().unwrap_or(0) as f64 / 1000.0;
        Ok(StrategyResult {
            strategy: self.strategy,
            small: WaitStats::of(waits),
            whale_drain,
            skew,
            series,
            promoted: self.promoted,
            makespan,
            deliveries: self.deliveries,
            wall: Duration::ZERO,
        })
    }
}
