//! The discrete-event loops. Each queue (shard or lane) is an event loop of
//! its own: its virtual time advances from event to event (an arrival, a
//! delivery finishing), and at each event its virtual workers call the real
//! store on a real Redis at that virtual time. A strategy's queues run side
//! by side and meet at promotion ticks; the four strategies run side by side.
//!
//! The fair strategies are the production scripts; the FIFO baselines model
//! no production code (nothing in production is a plain FIFO list), so their
//! lists are in-process queues: a Redis list there cost a round trip per
//! delivery and measured nothing.
//!
//! Over 700 lines on purpose: the event loop, its strategies and the
//! measurements are one piece of state (`Sim`) stepped in one place;
//! splitting the loop from what it measures would spread one invariant
//! (virtual time only moves forward, per queue) over files.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::pin::Pin;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::{Mix, Workload};
use crate::envelope::Envelope;
use crate::policy::promotion;
use crate::policy::QueuePolicy;
use crate::routing::{hash_shard, QueueId};
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
    /// One FIFO queue served by every worker (an in-process list).
    Fifo,
    /// Rendezvous-hashed shards (the production hash), a FIFO list each.
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
///
/// The four strategies run at the same time, each queue on its own connection,
/// and so do the queues of a strategy: each queue is its own event loop at
/// its own virtual time (its scripts' clock is its own), and the queues of
/// a strategy meet only at promotion ticks. Each queue's sequence of
/// script calls depends on its own events alone, so the results do not
/// depend on how the loops interleave: a seed gives the same report.
pub async fn run_as(
    url: &str,
    mix: &Mix,
    workload: &Workload,
    run_id: &str,
) -> anyhow::Result<Report> {
    mix.validate()?;
    let duration_s = Duration::from(mix.duration).as_secs_f64().max(0.001);
    let bucket_s = duration_s / CHART_BUCKETS as f64;
    // every tenant's home shard, hashed once
    let home: Vec<QueueId> = workload
        .tenants
        .iter()
        .map(|t| hash_shard(t, mix.shards))
        .collect();
    let home = &home;
    let one = |strategy: Strategy| async move {
        let set = set_of(run_id, strategy);
        let opts = ConnectOptions {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
        };
        let store = Store::connect(url, set, opts)
            .await
            .with_context(|| "connecting to the simulator's Redis (--redis)")?;
        let started = Instant::now();
        let outcome = Sim::new(url, store.clone(), mix, workload, home, strategy, bucket_s)
            .run()
            .await;
        let purged = store.purge_set().await;
        let mut result =
            outcome.with_context(|| format!("simulating strategy {}", strategy.name()))?;
        purged.context("deleting the simulator's keys")?;
        result.wall = started.elapsed();
        anyhow::Ok(result)
    };
    let results = futures::future::join_all(Strategy::ALL.map(one))
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<_>>>()?;
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

/// What a virtual worker is doing: delivering arrival `i` since `since`,
/// under a lease of the production scripts (the fair strategies).
struct Task {
    i: usize,
    since: u64,
    lease: Option<Box<Lease>>,
}

/// What every queue of a strategy shares.
struct Ctx<'a> {
    workload: &'a Workload,
    fair: bool,
}

/// One queue (a shard or a lane) and its workers: an event loop of its own.
struct QueueSim {
    id: QueueId,
    store: Store,
    /// Worker names, as the lease tokens carry them.
    names: Vec<String>,
    tasks: Vec<Option<Task>>,
    idle: Vec<usize>,
    /// (finish ms, sequence, worker)
    events: BinaryHeap<Reverse<(u64, u64, usize)>>,
    seq: u64,
    /// The virtual time this queue's scripts were last set to.
    clock: Option<u64>,
    /// Arrivals routed here and not yet enqueued, in time order.
    pending: VecDeque<usize>,
    /// The FIFO strategies' list.
    fifo: VecDeque<usize>,
    /// Arrivals enqueued while no worker was idle (their clock move, if
    /// any, and the batch): nothing waits for their answer, so they go out
    /// ahead of the next call whose answer is awaited, in the same round
    /// trip and in order.
    deferred: Vec<(Option<u64>, Vec<Envelope>)>,
    /// Worker-seconds delivered.
    worker_seconds: f64,
    /// (arrival, leased at, finished at) of every delivery.
    done: Vec<(usize, u64, u64)>,
}

impl QueueSim {
    fn new(id: QueueId, store: Store, workers: u32) -> Self {
        Self {
            id,
            store,
            names: (0..workers).map(|w| format!("sim-{id}-w{w}")).collect(),
            tasks: (0..workers).map(|_| None).collect(),
            idle: (0..workers as usize).rev().collect(),
            events: BinaryHeap::new(),
            seq: 0,
            clock: None,
            pending: VecDeque::new(),
            fifo: VecDeque::new(),
            deferred: Vec::new(),
            worker_seconds: 0.0,
            done: Vec::new(),
        }
    }

    /// Nothing queued, in flight or still to arrive here.
    fn quiet(&self) -> bool {
        self.events.is_empty() && self.pending.is_empty()
    }

    /// Point the scripts at virtual time `t`, if they are not there: one
    /// HSET, sent ahead of the script calls it precedes on the same
    /// connection (so Redis runs it first) and awaited with them.
    async fn clock_to(store: &Store, q: QueueId, t: Option<u64>) -> anyhow::Result<()> {
        if let Some(t) = t {
            store.set_virtual_clock(q, EPOCH_MS + t).await?;
        }
        Ok(())
    }

    /// Send the deferred enqueues (each after its clock move), in order,
    /// and check their answers. Call [`QueueSim::make_room`] first.
    async fn deferred(&self) -> anyhow::Result<()> {
        send_enqueues(&self.store, self.id, &self.deferred).await
    }

    /// Send deferred enqueues ahead, a group at a time, until the rest fits
    /// in one group with a call of `call` commands.
    async fn make_room(&mut self, call: usize) -> anyhow::Result<()> {
        while !self.deferred.is_empty() && 2 * self.deferred.len() + call > GROUP {
            let k = self.deferred.len().min(GROUP / 2);
            send_enqueues(&self.store, self.id, &self.deferred[..k]).await?;
            self.deferred.drain(..k);
        }
        Ok(())
    }

    /// The clock change needed at `t`, if any (and note it as made).
    fn move_clock(&mut self, t: u64) -> Option<u64> {
        (self.clock != Some(t)).then(|| {
            self.clock = Some(t);
            t
        })
    }

    /// Process this queue's events up to `limit` (virtual ms): deliveries
    /// finishing at or before it, arrivals routed here (all before it).
    async fn advance(&mut self, ctx: &Ctx<'_>, limit: u64) -> anyhow::Result<()> {
        let arrivals = &ctx.workload.arrivals;
        let mut batch = Vec::new();
        loop {
            let ta = self
                .pending
                .front()
                .map_or(u64::MAX, |i| arrivals[*i].at_ms);
            let td = self.events.peek().map_or(u64::MAX, |Reverse(e)| e.0);
            let t = ta.min(td);
            if t == u64::MAX || t > limit {
                if !self.deferred.is_empty() {
                    self.make_room(0).await?;
                    self.deferred().await?;
                    self.deferred.clear();
                }
                return Ok(());
            }
            if td == t {
                // deliveries finishing now, in the order they started
                while let Some(Reverse((ft, _, w))) = self.events.peek().copied() {
                    if ft != t {
                        break;
                    }
                    self.events.pop();
                    self.finish(ctx, w, t).await?;
                }
            } else {
                // every arrival at this instant, one batch
                batch.clear();
                while let Some(i) = self.pending.front().copied() {
                    if arrivals[i].at_ms != t {
                        break;
                    }
                    batch.push(i);
                    self.pending.pop_front();
                }
                self.arrive(ctx, &batch, t).await?;
            }
        }
    }

    /// Enqueue `batch` at `t` and let idle workers take it.
    async fn arrive(&mut self, ctx: &Ctx<'_>, batch: &[usize], t: u64) -> anyhow::Result<()> {
        if !ctx.fair {
            self.fifo.extend(batch);
            while !self.fifo.is_empty() {
                let Some(w) = self.idle.pop() else { break };
                let i = self.fifo.pop_front().expect("not empty");
                self.start(ctx, w, i, None, t);
            }
            return Ok(());
        }
        let q = self.id;
        let clock = self.move_clock(t);
        let envs: Vec<Envelope> = batch
            .iter()
            .map(|i| Envelope {
                id: i.to_string(),
                tenant: ctx.workload.tenants[ctx.workload.arrivals[*i].tenant as usize].clone(),
                endpoint: None,
                event_type: None,
                payload: serde_json::Value::Null,
            })
            .collect();
        if self.idle.is_empty() {
            self.deferred.push((clock, envs));
            return Ok(());
        }
        // Idle workers exist only when the last lease found nothing
        // eligible; the batch makes at most `batch.len()` envelopes
        // eligible, so that many idle workers lease, in the same round trip
        // as the clock and the enqueue (one pipeline, in this order).
        let eligible = self.idle.len().min(batch.len());
        let n = eligible.min(GROUP - 2);
        self.make_room(2 + n).await?;
        let takers: Vec<usize> = (0..n).filter_map(|_| self.idle.pop()).collect();
        let store = &self.store;
        let names = &self.names;
        let (earlier, (c, enqueued, leases)) = futures::future::join(
            self.deferred(),
            futures::future::join3(
                Self::clock_to(store, q, clock),
                store.enqueue_batch(q, &envs),
                in_order(takers.iter().map(|w| store.lease(q, &names[*w], LEASE_FOR))),
            ),
        )
        .await;
        earlier?;
        self.deferred.clear();
        c?;
        check_enqueued(q, &envs, enqueued?)?;
        let mut again = false;
        let mut empty = false;
        for (w, outcome) in takers.iter().zip(leases) {
            match outcome? {
                LeaseOutcome::Leased(lease) => self.start_lease(ctx, *w, lease, t)?,
                LeaseOutcome::Again => {
                    again = true;
                    self.idle.push(*w);
                }
                LeaseOutcome::Empty { .. } => {
                    empty = true;
                    self.idle.push(*w);
                }
            }
        }
        // A lease that ran out of scan budget answered AGAIN, or there were
        // more idle workers and envelopes than one group takes: lease on,
        // one at a time, until nothing is eligible (an EMPTY answer above
        // already said so).
        if (again || n < eligible) && !empty {
            self.wake(ctx, t).await?;
        }
        Ok(())
    }

    /// Idle workers lease, one at a time, until nothing is eligible.
    async fn wake(&mut self, ctx: &Ctx<'_>, t: u64) -> anyhow::Result<()> {
        while let Some(w) = self.idle.pop() {
            if !self.lease_for(ctx, w, t).await? {
                self.idle.push(w);
                break;
            }
        }
        Ok(())
    }

    /// Worker `w` leases (the clock is at `t`); false if nothing is eligible.
    async fn lease_for(&mut self, ctx: &Ctx<'_>, w: usize, t: u64) -> anyhow::Result<bool> {
        loop {
            match self.store.lease(self.id, &self.names[w], LEASE_FOR).await? {
                LeaseOutcome::Again => continue,
                LeaseOutcome::Empty { .. } => return Ok(false),
                LeaseOutcome::Leased(lease) => {
                    self.start_lease(ctx, w, lease, t)?;
                    return Ok(true);
                }
            }
        }
    }

    /// Check that the scripts ran at the virtual time: the envelope was
    /// enqueued at its arrival, and leased at `t`.
    fn start_lease(&mut self, ctx: &Ctx<'_>, w: usize, lease: Lease, t: u64) -> anyhow::Result<()> {
        let i: usize = lease.id.parse().context("a leased id")?;
        let arrival = ctx.workload.arrivals.get(i).context("a leased id")?;
        if lease.enqueued_ms != EPOCH_MS + arrival.at_ms {
            bail!(
                "envelope {i} was enqueued at {} by the scripts' clock, not at its arrival {}",
                lease.enqueued_ms,
                EPOCH_MS + arrival.at_ms
            );
        }
        if lease.deadline_ms != EPOCH_MS + t + LEASE_FOR.as_millis() as u64 {
            bail!(
                "envelope {i} was leased at {} by the scripts' clock, not at {}",
                lease.deadline_ms - LEASE_FOR.as_millis() as u64,
                EPOCH_MS + t
            );
        }
        self.start(ctx, w, i, Some(Box::new(lease)), t);
        Ok(())
    }

    fn start(&mut self, ctx: &Ctx<'_>, w: usize, i: usize, lease: Option<Box<Lease>>, t: u64) {
        self.tasks[w] = Some(Task { i, since: t, lease });
        self.seq += 1;
        let done = t + ctx.workload.arrivals[i].service_ms;
        self.events.push(Reverse((done, self.seq, w)));
    }

    /// Worker `w` finished its delivery at `t`: ack it and take the next.
    async fn finish(&mut self, ctx: &Ctx<'_>, w: usize, t: u64) -> anyhow::Result<()> {
        let task = self.tasks[w].take().context("a busy worker")?;
        let i = task.i;
        let service = ctx.workload.arrivals[i].service_ms;
        self.done.push((i, task.since, t));
        self.worker_seconds += service as f64 / 1000.0;
        let Some(lease) = task.lease else {
            match self.fifo.pop_front() {
                Some(next) => self.start(ctx, w, next, None, t),
                None => self.idle.push(w),
            }
            return Ok(());
        };
        let q = self.id;
        let clock = self.move_clock(t);
        self.make_room(2).await?;
        let (earlier, (c, acked)) = futures::future::join(
            self.deferred(),
            futures::future::join(
                Self::clock_to(&self.store, q, clock),
                self.store.ack_and_lease(
                    &lease,
                    Duration::from_millis(service),
                    &self.names[w],
                    LEASE_FOR,
                ),
            ),
        )
        .await;
        earlier?;
        self.deferred.clear();
        c?;
        let (acked, mut next) = acked?;
        if !acked.acked {
            bail!("the ack of envelope {i} in {q} was refused (lease lost)");
        }
        while next == LeaseOutcome::Again {
            next = self.store.lease(q, &self.names[w], LEASE_FOR).await?;
        }
        // No other idle worker needs waking: idle workers mean nothing was
        // eligible, and the one envelope this ack can make eligible (of a
        // tenant parked at its cap) is the one this lease just took.
        match next {
            LeaseOutcome::Leased(l) => self.start_lease(ctx, w, l, t)?,
            _ => self.idle.push(w),
        }
        Ok(())
    }
}

/// Await `futures` together, polling every one that is not done, in order,
/// each time: their commands go out in that order on the connection they
/// share. (`join_all` of many, like `FuturesUnordered`, polls only those
/// woken and may yield partway through, which would let a later command
/// overtake an earlier one: a script call could then run before the clock
/// move meant for it.)
async fn in_order<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    use std::future::Future;
    let mut all: Vec<Pin<Box<futures::future::MaybeDone<F>>>> = futures
        .into_iter()
        .map(|f| Box::pin(futures::future::maybe_done(f)))
        .collect();
    std::future::poll_fn(|cx| {
        let mut ready = true;
        for f in all.iter_mut() {
            ready &= f.as_mut().poll(cx).is_ready();
        }
        if ready {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    all.iter_mut()
        .map(|f| f.as_mut().take_output().expect("done"))
        .collect()
}

/// Most commands a queue has on its connection at once. Commands sent
/// together go out in the order they are first polled only while the
/// client's send buffer (redis-rs: 50 commands per connection) has room:
/// when it is full, a later command can overtake an earlier one. So each
/// queue has a connection of its own and sends at most this many at a time
/// (the lease checks in [`QueueSim::start_lease`] would catch a clock move
/// overtaken by the call it was for).
const GROUP: usize = 32;

/// Send `items` (clock move, then enqueue, each) in order on `store`, and
/// check every envelope was queued.
async fn send_enqueues(
    store: &Store,
    q: QueueId,
    items: &[(Option<u64>, Vec<Envelope>)],
) -> anyhow::Result<()> {
    let sends = items.iter().map(|(clock, envs)| async move {
        let (c, enqueued) = futures::future::join(
            QueueSim::clock_to(store, q, *clock),
            store.enqueue_batch(q, envs),
        )
        .await;
        c?;
        check_enqueued(q, envs, enqueued?)
    });
    in_order(sends).await.into_iter().collect()
}

/// Every envelope of a batch was queued.
fn check_enqueued(
    q: QueueId,
    envs: &[Envelope],
    outcomes: Vec<Result<EnqueueOutcome, crate::store::StoreError>>,
) -> anyhow::Result<()> {
    for (outcome, env) in outcomes.into_iter().zip(envs) {
        match outcome? {
            EnqueueOutcome::Queued { .. } => {}
            other => bail!("enqueue of {} into {q} answered {other:?}", env.id),
        }
    }
    Ok(())
}

struct Sim<'a> {
    url: &'a str,
    store: Store,
    mix: &'a Mix,
    workload: &'a Workload,
    /// Every tenant's hashed shard.
    home: &'a [QueueId],
    strategy: Strategy,
    bucket_s: f64,
    policy: QueuePolicy,
    queues: Vec<QueueSim>,
    index: HashMap<QueueId, usize>,
    pins: HashMap<u32, QueueId>,
    promoted: Vec<(String, f64)>,
    hot: Vec<promotion::Candidate>,
}

impl<'a> Sim<'a> {
    fn new(
        url: &'a str,
        store: Store,
        mix: &'a Mix,
        workload: &'a Workload,
        home: &'a [QueueId],
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
        Self {
            url,
            store,
            mix,
            workload,
            home,
            strategy,
            bucket_s,
            policy,
            queues: Vec::new(),
            index: HashMap::new(),
            pins: HashMap::new(),
            promoted: Vec::new(),
            hot: Vec::new(),
        }
    }

    async fn add_queue(&mut self, id: QueueId, workers: u32) -> anyhow::Result<()> {
        if self.strategy.fair() {
            self.store.configure_queue(id, &self.policy).await?;
        }
        self.index.insert(id, self.queues.len());
        let opts = ConnectOptions {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
        };
        let store = Store::connect(self.url, self.store.set().clone(), opts).await?;
        self.queues.push(QueueSim::new(id, store, workers));
        Ok(())
    }

    /// The queue `tenant`'s new envelopes go to.
    fn route(&self, tenant: u32) -> QueueId {
        match self.strategy {
            Strategy::Fifo => QueueId::Shard(0),
            _ => self
                .pins
                .get(&tenant)
                .copied()
                .unwrap_or(self.home[tenant as usize]),
        }
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
        if self.strategy.fair() {
            // load the scripts now (a no-op call), not on the first call of
            // a pipeline, where the reload would reorder it
            self.store.maintain(QueueId::Shard(0), 1).await?;
        }
        let promoting = self.strategy == Strategy::FairLanes && self.mix.promotion.enabled;
        let tick_ms = Duration::from(self.mix.promotion.tick).as_millis().max(1) as u64;
        let mut next_tick = if promoting { tick_ms } else { u64::MAX };
        let arrivals = &self.workload.arrivals;
        let mut routed = 0usize;
        let ctx = Ctx {
            workload: self.workload,
            fair: self.strategy.fair(),
        };
        loop {
            // route the arrivals before the next tick (the tick may pin a tenant)
            while routed < arrivals.len() && arrivals[routed].at_ms < next_tick {
                let q = self.route(arrivals[routed].tenant);
                self.queues[self.index[&q]].pending.push_back(routed);
                routed += 1;
            }
            // every queue up to the tick (its deliveries finishing at the
            // tick included, as the tick sees them)
            futures::future::try_join_all(
                self.queues.iter_mut().map(|q| q.advance(&ctx, next_tick)),
            )
            .await?;
            if next_tick == u64::MAX
                || (routed == arrivals.len() && self.queues.iter().all(QueueSim::quiet))
            {
                break;
            }
            self.promotion_tick(next_tick).await?;
            next_tick += tick_ms;
        }
        self.result()
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
        // controller's promotion loop computes it, and no more than the run so far
        let covered =
            crate::policy::attribution::covered(window, EPOCH_MS + t).min(Duration::from_millis(t));
        let skip: BTreeSet<String> = self
            .pins
            .keys()
            .map(|i| self.workload.tenants[*i as usize].clone())
            .collect();
        let stats = futures::future::try_join_all((0..self.mix.shards).map(|s| {
            self.store
                .tenant_stats_at(QueueId::Shard(s), window, EPOCH_MS + t)
        }))
        .await?;
        let mut observations = Vec::new();
        for (s, stats) in stats.iter().enumerate() {
            observations.extend(promotion::shard_observations(
                QueueId::Shard(s as u16),
                stats,
                self.mix.workers as f64,
                covered,
                &skip,
            ));
        }
        let defaults = crate::crd::PromotionSpec::default();
        let thresholds = promotion::Thresholds {
            promote_share: p.promote_share,
            promote_after: p.promote_after.into(),
            demote_share: defaults.demote_share,
            demote_after: defaults.demote_after.into(),
            projected_wait: p.projected_wait.map(Into::into),
        };
        let decision = promotion::evaluate(
            &thresholds,
            (EPOCH_MS + t) as i64,
            &self.hot,
            &[],
            &observations,
        );
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
        let n = arrivals.len();
        let mut leased_at = vec![u64::MAX; n];
        let mut finished_at = vec![u64::MAX; n];
        let mut deliveries = 0u64;
        for q in &self.queues {
            for (i, leased, finished) in &q.done {
                leased_at[*i] = *leased;
                finished_at[*i] = *finished;
                deliveries += 1;
            }
        }
        if let Some(i) = finished_at.iter().position(|f| *f == u64::MAX) {
            bail!("envelope {i} was never delivered");
        }
        // small tenants' waits, and per arrival-time bucket for the chart
        let mut waits = Vec::new();
        let mut buckets: Vec<Vec<u64>> = vec![Vec::new(); CHART_BUCKETS];
        for (a, l) in arrivals.iter().zip(&leased_at) {
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
                .zip(&finished_at)
                .filter(|(a, _)| a.tenant as usize == ti);
            let first = mine.clone().map(|(a, _)| a.at_ms).min();
            let last = mine.map(|(_, f)| *f).max();
            if let (Some(first), Some(last)) = (first, last) {
                whale_drain.push((name.clone(), (last - first) as f64 / 1000.0));
            }
        }
        let per_shard: Vec<f64> = self
            .queues
            .iter()
            .filter(|q| matches!(q.id, QueueId::Shard(_)))
            .map(|q| q.worker_seconds)
            .collect();
        let skew = crate::policy::attribution::skew(&per_shard).unwrap_or(f64::INFINITY);
        let makespan = finished_at.iter().copied().max().unwrap_or(0) as f64 / 1000.0;
        Ok(StrategyResult {
            strategy: self.strategy,
            small: WaitStats::of(waits),
            whale_drain,
            skew,
            series,
            promoted: self.promoted,
            makespan,
            deliveries,
            wall: Duration::ZERO,
        })
    }
}
