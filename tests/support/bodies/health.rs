//! What the controller exports of a queue's health, from real attribution:
//! the estimated time to drain rises while a whale's backlog grows and falls
//! while it drains, and Jain's fairness index falls when an in-flight cap
//! raised to the number of slots lets one tenant take every slot. Driven in
//! virtual time ([`Store::set_virtual_clock`]): the scripts settle
//! worker-seconds into the buckets of the virtual clock, and
//! [`Store::tenant_stats_at`] reads them as the controller does at its
//! reconcile (through [`queue_health`], the function it exports).

use std::collections::BTreeMap;
use std::time::Duration;

use lanekeeper::policy::attribution::{queue_health, QueueHealth};
use lanekeeper::policy::QueuePolicy;
use lanekeeper::store::{Lease, LeaseOutcome, Store};

use super::dataplane::{env, store, LEASE, Q};

const EPOCH_MS: u64 = 1_700_000_000_000;
/// The controller's default promotion window: what it reads stats over.
const WINDOW: Duration = Duration::from_secs(300);

/// A queue served by `slots` workers in virtual milliseconds: deliveries
/// take `cost(tenant)`, arrivals are enqueued when due, and every free slot
/// leases as soon as something is due.
struct Sim {
    store: Store,
    policy: QueuePolicy,
    now: u64,
    slots: Vec<Option<(Lease, u64)>>,
    cost: fn(&str) -> u64,
    seq: BTreeMap<String, u64>,
}

impl Sim {
    async fn new(url: &str, policy: QueuePolicy, slots: usize, cost: fn(&str) -> u64) -> Self {
        let store = store(url, policy.clone()).await;
        store.set_virtual_clock(Q, EPOCH_MS).await.unwrap();
        Self {
            store,
            policy,
            now: 0,
            slots: (0..slots).map(|_| None).collect(),
            cost,
            seq: BTreeMap::new(),
        }
    }

    async fn clock(&mut self, t: u64) {
        self.now = t;
        self.store.set_virtual_clock(Q, EPOCH_MS + t).await.unwrap();
    }

    async fn arrive(&mut self, tenant: &str, n: u64) {
        let start = *self.seq.get(tenant).unwrap_or(&0);
        let envs: Vec<_> = (start..start + n).map(|i| env(tenant, i)).collect();
        for r in self.store.enqueue_batch(Q, &envs).await.unwrap() {
            r.unwrap();
        }
        self.seq.insert(tenant.to_string(), start + n);
    }

    /// Finish what is due by `t`, then fill the free slots.
    async fn run_to(&mut self, t: u64) {
        loop {
            let next = self
                .slots
                .iter()
                .flatten()
                .map(|(_, at)| *at)
                .min()
                .filter(|at| *at <= t);
            let Some(at) = next else { break };
            self.clock(at).await;
            for slot in &mut self.slots {
                if slot.as_ref().is_some_and(|(_, end)| *end == at) {
                    let (lease, _) = slot.take().unwrap();
                    let took = Duration::from_millis((self.cost)(&lease.tenant));
                    assert!(self.store.ack(&lease, took).await.unwrap());
                }
            }
            self.fill().await;
        }
        self.clock(t).await;
        self.fill().await;
    }

    async fn fill(&mut self) {
        for i in 0..self.slots.len() {
            if self.slots[i].is_some() {
                continue;
            }
            match self.store.lease(Q, "w", LEASE).await.unwrap() {
                LeaseOutcome::Leased(l) => {
                    let end = self.now + (self.cost)(&l.tenant);
                    self.slots[i] = Some((l, end));
                }
                _ => return,
            }
        }
    }

    async fn health(&self) -> QueueHealth {
        let stats = self
            .store
            .tenant_stats_at(Q, WINDOW, EPOCH_MS + self.now)
            .await
            .unwrap();
        queue_health(&stats, self.policy.initial_estimate_seconds, |t, tier| {
            self.policy.weight(t, tier)
        })
    }
}

fn whale_slow(t: &str) -> u64 {
    if t == "whale" {
        400
    } else {
        20
    }
}

/// A whale sends 40 envelopes a second of 400 ms each while its cap of 4
/// lets it drain 10 a second: for a minute its backlog grows, then it stops
/// sending and the backlog drains. The drain time sampled every 10 s rises
/// through the first phase and falls through the second, and it tracks the
/// truth: the backlog over the 4 worker-seconds per second the whale gets.
pub async fn drain_time_follows_a_whales_backlog(url: &str) {
    let policy = QueuePolicy {
        max_in_flight: 4,
        ..Default::default()
    };
    let mut sim = Sim::new(url, policy, 8, whale_slow).await;
    let mut rising = Vec::new();
    for step in 1..=600u64 {
        // 4 every 100 ms, and a small tenant's 1 every 100 ms beside it
        sim.arrive("whale", 4).await;
        sim.arrive("small", 1).await;
        sim.run_to(step * 100).await;
        if step % 100 == 0 {
            rising.push(sim.health().await);
        }
    }
    let mut falling = Vec::new();
    for step in 601..=3000u64 {
        sim.arrive("small", 1).await;
        sim.run_to(step * 100).await;
        if step % 100 == 0 {
            falling.push(sim.health().await);
        }
    }
    let drain = |h: &[QueueHealth]| h.iter().map(|h| h.drain_seconds).collect::<Vec<_>>();
    println!("rising: {:?}", drain(&rising));
    println!("falling: {:?}", drain(&falling));
    // Growing: each sample above the one before (the first ones measure a
    // served rate still climbing to full, so start from the third).
    for w in rising[2..].windows(2) {
        assert!(
            w[1].drain_seconds > w[0].drain_seconds,
            "drain time fell while the backlog grew: {:?}",
            drain(&rising)
        );
    }
    // After a minute: about 1,800 of the whale's behind, 720 worker-seconds
    // at 4.2 worker-seconds per second (the whale's 4 and the small one's
    // 0.2): about 170 s.
    let peak = rising.last().unwrap();
    assert!(
        (120.0..240.0).contains(&peak.drain_seconds),
        "at the peak: {peak:?}"
    );
    // Draining: it falls, sample after sample, until the backlog is gone.
    let draining: Vec<_> = falling
        .iter()
        .take_while(|h| h.backlog_worker_seconds > 1.0)
        .collect();
    assert!(draining.len() >= 10, "{:?}", drain(&falling));
    for w in draining.windows(2) {
        assert!(
            w[1].drain_seconds < w[0].drain_seconds,
            "drain time rose while the backlog drained: {:?}",
            drain(&falling)
        );
    }
    assert!(
        falling.last().unwrap().drain_seconds < 1.0,
        "drained: {:?}",
        falling.last()
    );
}

/// Mean fairness over 30 s, sampled every 250 ms, of 8 slots shared by a
/// whale with a standing backlog of 400 ms deliveries and three small
/// tenants sending 20 ms ones at odd moments.
async fn fairness_with_cap(url: &str, cap: u32) -> (f64, usize) {
    let policy = QueuePolicy {
        max_in_flight: cap,
        ..Default::default()
    };
    let mut sim = Sim::new(url, policy, 8, whale_slow).await;
    sim.arrive("whale", 3000).await;
    // A fixed pseudo-random sequence of arrival times, so that samples do
    // not fall in step with them.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |bound: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % bound
    };
    let (mut sum, mut n, mut contending) = (0.0, 0, 0);
    let mut t = 0;
    while t < 60_000 {
        let step = 10 + next(60);
        t += step;
        let small = ["a", "b", "c"][next(3) as usize];
        sim.run_to(t).await;
        sim.arrive(small, 1).await;
        sim.fill().await;
        // samples in the second half, every 250 ms
        if t > 30_000 && t / 250 != (t - step) / 250 {
            let h = sim.health().await;
            sum += h.fairness;
            n += 1;
            contending = contending.max(h.contending);
        }
    }
    (sum / n as f64, contending)
}

/// With a cap of 2 of 8 slots the small tenants find a free slot when they
/// send, and the index stays near 1; with the cap raised to 8 the whale
/// holds every slot, the small tenants wait behind it with next to no
/// worker-seconds, and the index falls.
pub async fn fairness_falls_when_the_cap_lets_one_tenant_take_every_slot(url: &str) {
    let (capped, _) = fairness_with_cap(url, 2).await;
    let (hogged, contending) = fairness_with_cap(url, 8).await;
    println!("mean fairness: cap 2 {capped:.3}, cap 8 {hogged:.3} (up to {contending} contending)");
    assert!(capped > 0.95, "cap 2: {capped}");
    assert!(
        hogged < capped - 0.25,
        "cap 8: {hogged} against {capped} with cap 2"
    );
    assert!(contending >= 2, "nobody waited beside the whale");
}
