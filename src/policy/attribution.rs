//! Worker-seconds attribution: each ack adds the delivery's time to its
//! tenant in a [`BUCKET_SECONDS`]-wide bucket (`settle` in the store's
//! `common.lua`, which spells the same width: a store test checks the two
//! agree). A window is read as whole buckets plus the current, partial one,
//! enough of them that the time covered is never less than the window.

use std::time::Duration;

/// Width of a worker-seconds bucket, in seconds.
pub const BUCKET_SECONDS: u64 = 10;

const BUCKET_MS: u64 = BUCKET_SECONDS * 1000;

/// Per-tenant attribution in one queue.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantStats {
    pub tenant: String,
    /// Outstanding: queued, held, waiting to retry or in flight.
    pub depth: u64,
    pub delivered: u64,
    pub failed: u64,
    /// Worker-seconds consumed over the window asked for.
    pub worker_seconds: f64,
    /// Its measured mean worker-seconds per delivery (0: none measured).
    pub cost_seconds: f64,
    /// Deliveries in flight now.
    pub in_flight: u64,
    /// Waiting for a slot now: outstanding, less those in flight, waiting
    /// to retry or held.
    pub queued: u64,
    /// Its tier, as enqueue recorded it (weights may come from the tier).
    pub tier: Option<String>,
    /// Paused, by a user or by a relocation: its queued work waits on
    /// purpose.
    pub paused: bool,
    /// Worker-seconds per second it has had over the last [`RECENT`].
    pub recent_rate: f64,
}

/// How far back [`TenantStats::recent_rate`] looks: short enough to follow
/// a backlog as it builds, long enough to hold a few deliveries of a slow
/// endpoint.
pub const RECENT: Duration = Duration::from_secs(30);

/// The bucket that `now_ms` (Unix milliseconds) falls in.
pub fn bucket_of(now_ms: u64) -> u64 {
    now_ms / BUCKET_MS
}

/// How many buckets, the current one included, a window of `window` is read
/// from: enough whole ones to cover it even just after a bucket turns over,
/// plus the current, partial one.
pub fn buckets(window: Duration) -> u64 {
    window.as_secs().div_ceil(BUCKET_SECONDS).max(1) + 1
}

/// The time the [`buckets`] of `window` read at `now_ms` cover: the whole
/// buckets before the current one and the part of it gone by. Never less
/// than `window` (rounded up to whole buckets).
pub fn covered(window: Duration, now_ms: u64) -> Duration {
    Duration::from_millis((buckets(window) - 1) * BUCKET_MS + now_ms % BUCKET_MS)
}

/// Skew of a set's shards: the busiest shard's worker-seconds over the
/// median shard's (as ShardSet status and the simulator report it). `None`
/// with no shard, or when the median shard did nothing.
pub fn skew(per_shard: &[f64]) -> Option<f64> {
    let mut sorted = per_shard.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let max = *sorted.last()?;
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    (median > 0.0).then(|| max / median)
}

/// What a queue's attribution says about its backlog and its fairness now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueHealth {
    /// Worker-seconds of work outstanding: each tenant's outstanding
    /// envelopes at its measured mean delivery cost (a tenant with none
    /// measured yet at the policy's initial estimate, as the scheduler
    /// charges it). A paused tenant's backlog is left out: it waits on
    /// purpose, and no worker added would deliver it.
    pub backlog_worker_seconds: f64,
    /// Worker-seconds per second the queue delivered over the last
    /// [`RECENT`]: its capacity while it has a backlog. 0: nothing served.
    pub served_rate: f64,
    /// Estimated seconds to deliver the backlog: backlog over the served
    /// rate, taken as at least one worker-second per second (one slot
    /// busy). A queue that served next to nothing recently (no workers yet,
    /// its endpoints failing) would otherwise show a drain time that blows
    /// up as the rate nears 0 and jumps back at 0; with the floor it stays
    /// finite, continuous, and still grows with the backlog.
    pub drain_seconds: f64,
    /// Jain's index over the tenants waiting for a slot now (queued, not
    /// paused) of their recent worker-seconds per second over their
    /// weights: 1 when every tenant that wants more has had the same per
    /// unit of weight, falling to 1/n when one of n had it all. 1 with
    /// fewer than two such tenants: nobody is contending.
    pub fairness: f64,
    /// The tenants that index is over.
    pub contending: usize,
}

/// The least capacity a drain time assumes, in worker-seconds per second.
pub const MIN_CAPACITY: f64 = 1.0;

/// Pure: [`QueueHealth`] of one queue from its tenants' stats, weighing
/// each by `weight(tenant, tier)` (the scheduler's weights).
pub fn queue_health(
    stats: &[TenantStats],
    initial_estimate_seconds: f64,
    weight: impl Fn(&str, Option<&str>) -> f64,
) -> QueueHealth {
    let backlog_worker_seconds: f64 = stats
        .iter()
        .filter(|t| !t.paused)
        .map(|t| {
            let cost = if t.cost_seconds > 0.0 {
                t.cost_seconds
            } else {
                initial_estimate_seconds
            };
            t.depth as f64 * cost
        })
        .sum();
    let served_rate: f64 = stats.iter().map(|t| t.recent_rate).sum();
    let drain_seconds = backlog_worker_seconds / served_rate.max(MIN_CAPACITY);
    let shares: Vec<f64> = stats
        .iter()
        .filter(|t| t.queued > 0 && !t.paused)
        .map(|t| t.recent_rate / weight(&t.tenant, t.tier.as_deref()).max(f64::MIN_POSITIVE))
        .collect();
    QueueHealth {
        backlog_worker_seconds,
        served_rate,
        drain_seconds,
        fairness: jain(&shares),
        contending: shares.len(),
    }
}

/// Jain's fairness index of `x`: (Σx)² / (n·Σx²), from 1/n (one has all)
/// to 1 (all equal). 1 for fewer than two, or when nobody had anything
/// (all equal at 0).
pub fn jain(x: &[f64]) -> f64 {
    let (sum, squares) = x.iter().fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
    if x.len() < 2 || squares <= 0.0 {
        return 1.0;
    }
    sum * sum / (x.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_covered_in_full_whenever_it_is_read() {
        for window in [1, 10, 25, 300] {
            let window = Duration::from_secs(window);
            let whole = Duration::from_secs(window.as_secs().div_ceil(BUCKET_SECONDS) * 10);
            // Just after a turnover, mid-bucket and just before the next.
            for now_ms in [1_000_000_000, 1_000_004_000, 1_000_009_999] {
                let c = covered(window, now_ms);
                assert!(c >= window && c >= whole, "{window:?} at {now_ms}: {c:?}");
                assert!(c < whole + Duration::from_secs(BUCKET_SECONDS));
            }
        }
        assert_eq!(buckets(Duration::from_secs(300)), 31);
        assert_eq!(
            covered(Duration::from_secs(30), 1_000_004_000),
            Duration::from_secs(34)
        );
        assert_eq!(bucket_of(1_000_004_000), 100_000);
    }

    #[test]
    fn skew_is_the_busiest_shard_over_the_median() {
        assert_eq!(skew(&[]), None);
        assert_eq!(skew(&[5.0]), Some(1.0));
        assert_eq!(skew(&[1.0, 9.0, 3.0]), Some(3.0));
        assert_eq!(skew(&[2.0, 4.0, 6.0, 12.0]), Some(2.4));
        assert_eq!(skew(&[0.0, 0.0, 7.0]), None, "the median shard did nothing");
    }

    fn st(t: &str, depth: u64, queued: u64, cost: f64, rate: f64) -> TenantStats {
        TenantStats {
            tenant: t.into(),
            depth,
            queued,
            cost_seconds: cost,
            recent_rate: rate,
            ..Default::default()
        }
    }

    #[test]
    fn drain_time_is_the_backlog_at_measured_costs_over_the_served_rate() {
        let one = |_: &str, _: Option<&str>| 1.0;
        // 1,000 of the whale at 0.2 s, 10 of a tenant never measured (est 1 s),
        // served at 4 worker-seconds per second: (200 + 10) / 4.
        let h = queue_health(
            &[
                st("whale", 1000, 990, 0.2, 3.0),
                st("new", 10, 10, 0.0, 1.0),
            ],
            1.0,
            one,
        );
        assert!((h.backlog_worker_seconds - 210.0).abs() < 1e-9, "{h:?}");
        assert!((h.drain_seconds - 52.5).abs() < 1e-9, "{h:?}");
        // Nothing served (no workers), or next to nothing (failing
        // endpoints): one worker-second per second, not a blow-up.
        for rate in [0.0, 1e-6, 0.5, 1.0] {
            let h = queue_health(&[st("whale", 1000, 1000, 0.2, rate)], 1.0, one);
            assert_eq!(h.drain_seconds, 200.0, "served {rate}");
        }
        // A paused tenant's backlog waits on purpose: no drain time for it.
        let mut paused = st("paused", 5000, 5000, 0.2, 0.0);
        paused.paused = true;
        let h = queue_health(&[paused, st("live", 10, 10, 0.5, 2.0)], 1.0, one);
        assert_eq!((h.backlog_worker_seconds, h.drain_seconds), (5.0, 2.5));
        // Nothing outstanding: nothing to drain, however slow.
        let h = queue_health(&[st("idle", 0, 0, 0.2, 0.0)], 1.0, one);
        assert_eq!((h.drain_seconds, h.fairness), (0.0, 1.0));
    }

    #[test]
    fn fairness_is_jains_index_over_the_waiting_tenants_shares_per_weight() {
        assert_eq!(jain(&[]), 1.0);
        assert_eq!(jain(&[5.0]), 1.0);
        assert_eq!(jain(&[2.0, 2.0, 2.0]), 1.0);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert_eq!(jain(&[0.0, 0.0]), 1.0, "equal at nothing");
        let one = |_: &str, _: Option<&str>| 1.0;
        // The whale has had 7.9 slots, three waiting tenants 0.02 each.
        let hog = [
            st("whale", 500, 492, 0.4, 7.9),
            st("a", 1, 1, 0.02, 0.02),
            st("b", 2, 2, 0.02, 0.02),
            st("c", 1, 1, 0.02, 0.02),
        ];
        let h = queue_health(&hog, 1.0, one);
        assert_eq!(h.contending, 4);
        assert!(h.fairness < 0.3, "{h:?}");
        // A tenant served well but not waiting now does not count; nor does
        // a paused one, whose queue waits on purpose.
        let mut calm = hog.clone();
        for t in &mut calm[1..] {
            t.queued = 0;
        }
        assert_eq!(queue_health(&calm, 1.0, one).fairness, 1.0);
        let mut paused = hog.clone();
        paused[0].paused = true;
        assert_eq!(queue_health(&paused, 1.0, one).contending, 3);
        // Weights: 3:1 service for weights 3:1 is fair.
        let weighted = [st("gold", 9, 9, 0.1, 3.0), st("std", 9, 9, 0.1, 1.0)];
        let w = |t: &str, _: Option<&str>| if t == "gold" { 3.0 } else { 1.0 };
        assert!((queue_health(&weighted, 1.0, w).fairness - 1.0).abs() < 1e-12);
        assert!(queue_health(&weighted, 1.0, one).fairness < 0.85);
    }
}
