//! Promotion and demotion with hysteresis, as pure rules: which tenants
//! deserve a dedicated lane ([`evaluate`]) from this tick's observations
//! ([`shard_observations`], [`lane_share`]). The controller's promotion loop
//! (`controller::promotion`) and the capacity simulator both run these.
//!
//! A tenant on a hash shard is *hot* while its share of the shard's
//! worker-seconds over the window is at least `promoteShare` **and** the shard
//! is contended: another tenant is waiting, or another tenant is active and
//! the shard is busy (its workers were at least 80% in use over the window,
//! or more is outstanding than it has delivery slots). It is promoted once hot for `promoteAfter`
//! without a break. A tenant on an Active lane is *cold* while the share it
//! would have of its hash shard (its lane's worker-seconds over those plus
//! the shard's) is below `demoteShare`; it is demoted once cold for
//! `demoteAfter` without a break. Either timer resets as soon as its
//! condition breaks, so a tenant that oscillates is neither promoted nor
//! demoted over and over.
//!
//! With `projectedWait` set, a tenant on a contended shard is also hot on
//! the *trend*: its backlog, at the rate it has been draining over the
//! window, would take at least that long to deliver ([`projected_wait`]).
//! Such a tenant does not wait out `promoteAfter`: it is promoted at the
//! next tick that still finds it hot (one tick of confirmation), so its
//! lane exists while the backlog is still building, not after it has
//! built. A backlog that large cannot vanish between two ticks, so the
//! confirmation is enough hysteresis; share-hot tenants keep the timer.

use std::collections::BTreeSet;
use std::time::Duration;

use super::TenantStats;
use crate::routing::QueueId;

/// Utilisation of a shard's workers above which it counts as contended even
/// when no other tenant is waiting at the instant it is sampled.
pub const BUSY_UTILISATION: f64 = 0.8;

/// One tenant as measured this tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub tenant: String,
    /// The queue it is served from now.
    pub queue: QueueId,
    /// Share of worker-seconds: of its shard, or (on a lane) of its hash shard plus its lane.
    pub share: f64,
    /// Its shard is contended (meaningless on a lane).
    pub contended: bool,
    /// On an Active lane: a demotion candidate, not a promotion one.
    pub laned: bool,
    /// How long its backlog would take at its measured drain rate
    /// ([`projected_wait`]); `None` with nothing queued or nothing measured.
    pub projected_wait: Option<Duration>,
}

/// A tenant hot (a promotion candidate) or cold (a demotion candidate):
/// what status shows, and what the next tick's timers start from.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub tenant: String,
    /// The queue it is served from, as status names it.
    pub queue: String,
    /// Latest measured share, rounded to three places.
    pub share: f64,
    /// When it became hot (or cold), in Unix milliseconds.
    pub since_ms: i64,
    /// Hot on the trend: its projected wait in seconds (rounded), when it
    /// passed `projectedWait`.
    pub projected_wait_s: Option<f64>,
}

/// The thresholds and timers of promotion (a ShardSet's `spec.promotion`).
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    pub promote_share: f64,
    pub promote_after: Duration,
    pub demote_share: f64,
    pub demote_after: Duration,
    /// Promote on the trend: a tenant whose projected wait reaches this
    /// (`promotion.projectedWait`); `None`: on the share only.
    pub projected_wait: Option<Duration>,
}

/// What to do this tick, and the candidate lists for status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    pub hot: Vec<Candidate>,
    pub cold: Vec<Candidate>,
    pub promote: Vec<String>,
    pub demote: Vec<String>,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn elapsed(since_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis((now_ms - since_ms).max(0) as u64)
}

/// Apply the hysteresis timers to this tick's observations. Pure.
pub fn evaluate(
    spec: &Thresholds,
    now_ms: i64,
    prev_hot: &[Candidate],
    prev_cold: &[Candidate],
    observations: &[Observation],
) -> Decision {
    let (promote_after, demote_after) = (spec.promote_after, spec.demote_after);
    let mut d = Decision::default();
    for o in observations {
        if o.laned {
            if o.share < spec.demote_share {
                let since = prev_cold
                    .iter()
                    .find(|c| c.tenant == o.tenant)
                    .map(|c| c.since_ms)
                    .unwrap_or(now_ms);
                if elapsed(since, now_ms) >= demote_after {
                    d.demote.push(o.tenant.clone());
                }
                d.cold.push(Candidate {
                    tenant: o.tenant.clone(),
                    queue: o.queue.to_string(),
                    share: round3(o.share),
                    since_ms: since,
                    projected_wait_s: None,
                });
            }
        } else if o.contended {
            let trend = match (spec.projected_wait, o.projected_wait) {
                (Some(limit), Some(wait)) => wait >= limit,
                _ => false,
            };
            if !trend && o.share < spec.promote_share {
                continue;
            }
            let since = prev_hot
                .iter()
                .find(|c| c.tenant == o.tenant)
                .map(|c| c.since_ms)
                .unwrap_or(now_ms);
            // on the trend: confirmed by a second tick; else the timer
            if elapsed(since, now_ms) >= promote_after || (trend && since < now_ms) {
                d.promote.push(o.tenant.clone());
            }
            d.hot.push(Candidate {
                tenant: o.tenant.clone(),
                queue: o.queue.to_string(),
                share: round3(o.share),
                since_ms: since,
                projected_wait_s: trend
                    .then(|| o.projected_wait.map(|w| w.as_secs_f64().round()))
                    .flatten(),
            });
        }
    }
    d.hot.sort_by(|a, b| b.share.total_cmp(&a.share));
    d.hot.truncate(64);
    d.cold.truncate(64);
    d
}

/// The longest projected wait reported (a tenant with a backlog and next
/// to no drain rate): about 31 years.
const MAX_PROJECTED_WAIT: Duration = Duration::from_secs(1 << 30);

/// How long `t`'s backlog would take to deliver at the rate it drained over
/// the `covered` time: its depth times its mean cost per delivery, over the
/// worker-seconds it got per second. `None` with nothing queued, no cost
/// measured, or nothing delivered over the window (no rate to project at).
pub fn projected_wait(t: &TenantStats, covered: Duration) -> Option<Duration> {
    let per_second = t.worker_seconds / covered.as_secs_f64().max(1.0);
    // (NaN fails both tests: written so, not as `<= 0.0`)
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if t.depth == 0 || !positive(t.cost_seconds) || !positive(per_second) {
        return None;
    }
    let secs = t.depth as f64 * t.cost_seconds / per_second;
    Some(
        Duration::try_from_secs_f64(secs).map_or(MAX_PROJECTED_WAIT, |d| d.min(MAX_PROJECTED_WAIT)),
    )
}

/// Observations for the tenants of one hash shard. `workers` is the shard's
/// delivery slots (replicas × concurrency) and `covered` the time the
/// worker-seconds were summed over. Tenants in `skip` (they have a lane, or
/// are on their way to one) are left out.
pub fn shard_observations(
    q: QueueId,
    stats: &[TenantStats],
    workers: f64,
    covered: Duration,
    skip: &BTreeSet<String>,
) -> Vec<Observation> {
    let total: f64 = stats.iter().map(|t| t.worker_seconds).sum();
    let capacity = workers * covered.as_secs_f64().max(1.0);
    // Busy: the workers were mostly in use over the window, or more is
    // outstanding right now than there are delivery slots (a backlog).
    let outstanding: u64 = stats.iter().map(|t| t.depth).sum();
    let busy = (capacity > 0.0 && total / capacity >= BUSY_UTILISATION)
        || (workers > 0.0 && outstanding as f64 > workers);
    stats
        .iter()
        .filter(|t| !skip.contains(&t.tenant))
        .map(|t| {
            let others = stats.iter().filter(|u| u.tenant != t.tenant);
            let others_waiting = others.clone().any(|u| u.depth > 0);
            let others_active = others
                .clone()
                .any(|u| u.worker_seconds > 0.0 || u.depth > 0);
            Observation {
                tenant: t.tenant.clone(),
                queue: q,
                share: if total > 0.0 {
                    t.worker_seconds / total
                } else {
                    0.0
                },
                contended: others_waiting || (others_active && busy),
                laned: false,
                projected_wait: projected_wait(t, covered),
            }
        })
        .collect()
}

/// The share a laned tenant would have of its hash shard: its lane's
/// worker-seconds over those plus the shard's. An idle lane is cold.
pub fn lane_share(lane_seconds: f64, home_seconds: f64) -> f64 {
    let total = lane_seconds + home_seconds;
    if total > 0.0 {
        lane_seconds / total
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Thresholds {
        Thresholds {
            promote_share: 0.3,
            promote_after: Duration::from_secs(15),
            demote_share: 0.1,
            demote_after: Duration::from_secs(60),
            projected_wait: None,
        }
    }

    fn at(s: i64) -> i64 {
        (1_000_000 + s) * 1000
    }

    fn shard(tenant: &str, share: f64, contended: bool) -> Observation {
        Observation {
            tenant: tenant.into(),
            queue: QueueId::Shard(3),
            share,
            contended,
            laned: false,
            projected_wait: None,
        }
    }

    fn laned(tenant: &str, share: f64) -> Observation {
        Observation {
            tenant: tenant.into(),
            queue: QueueId::Lane(1),
            share,
            contended: false,
            laned: true,
            projected_wait: None,
        }
    }

    type Moves = Vec<(i64, String)>;

    /// Feed (second, observation) pairs through `evaluate` as the loop does.
    fn run(samples: &[(i64, Observation)]) -> (Moves, Moves) {
        let (mut hot, mut cold) = (Vec::new(), Vec::new());
        let (mut promoted, mut demoted) = (Vec::new(), Vec::new());
        for (t, o) in samples {
            let d = evaluate(&spec(), at(*t), &hot, &cold, std::slice::from_ref(o));
            promoted.extend(d.promote.iter().map(|x| (*t, x.clone())));
            demoted.extend(d.demote.iter().map(|x| (*t, x.clone())));
            hot = d.hot;
            cold = d.cold;
        }
        (promoted, demoted)
    }

    #[test]
    fn promoted_after_promote_after_and_not_before() {
        let samples: Vec<_> = (0..=20).map(|t| (t, shard("whale", 0.9, true))).collect();
        let (promoted, _) = run(&samples);
        assert_eq!(promoted.first(), Some(&(15, "whale".to_string())));
    }

    #[test]
    fn a_lone_tenant_in_a_quiet_shard_is_not_hot() {
        let samples: Vec<_> = (0..=60).map(|t| (t, shard("lone", 1.0, false))).collect();
        let (promoted, _) = run(&samples);
        assert!(promoted.is_empty());
        let d = evaluate(&spec(), at(0), &[], &[], &[shard("lone", 1.0, false)]);
        assert!(d.hot.is_empty());
    }

    #[test]
    fn flapping_around_the_thresholds_never_promotes_or_demotes() {
        // Hot for 10 s, cool for 2 s, over and over: the timer resets each time.
        let samples: Vec<_> = (0..300)
            .map(|t| {
                (
                    t,
                    shard("flap", if t % 12 < 10 { 0.35 } else { 0.29 }, true),
                )
            })
            .collect();
        let (promoted, _) = run(&samples);
        assert!(promoted.is_empty(), "{promoted:?}");
        // On a lane: cold for 50 s, warm for 1 s (the seed's defect kept
        // cold_since across the warm-up, so the next dip demoted at once).
        let samples: Vec<_> = (0..600)
            .map(|t| (t, laned("flap", if t % 51 < 50 { 0.05 } else { 0.5 })))
            .collect();
        let (_, demoted) = run(&samples);
        assert!(demoted.is_empty(), "{demoted:?}");
    }

    #[test]
    fn demoted_after_demote_after_of_uninterrupted_cold() {
        let mut samples: Vec<_> = (0..30).map(|t| (t, laned("x", 0.05))).collect();
        samples.push((30, laned("x", 0.2)));
        samples.extend((31..=100).map(|t| (t, laned("x", 0.05))));
        let (_, demoted) = run(&samples);
        assert_eq!(demoted.first(), Some(&(91, "x".to_string())));
    }

    #[test]
    fn between_the_thresholds_nothing_moves() {
        // 0.2 is below promoteShare and above demoteShare: neither timer runs.
        let d = evaluate(
            &spec(),
            at(0),
            &[],
            &[],
            &[shard("a", 0.2, true), laned("b", 0.2)],
        );
        assert_eq!(d, Decision::default());
    }

    #[test]
    fn contention_needs_another_tenant_waiting_or_busy_workers() {
        let st = |t: &str, ws: f64, depth: u64| TenantStats {
            tenant: t.into(),
            worker_seconds: ws,
            depth,
            ..Default::default()
        };
        let none = BTreeSet::new();
        let covered = Duration::from_secs(10);
        // Another tenant is waiting.
        let o = shard_observations(
            QueueId::Shard(0),
            &[st("whale", 50.0, 900), st("small", 1.0, 2)],
            8.0,
            covered,
            &none,
        );
        assert!(o[0].contended);
        assert!((o[0].share - 50.0 / 51.0).abs() < 1e-9);
        // Alone: not contended, however busy.
        let o = shard_observations(
            QueueId::Shard(0),
            &[st("whale", 80.0, 900)],
            8.0,
            covered,
            &none,
        );
        assert!(!o[0].contended);
        // Others active but nobody waiting: contended only when workers are busy.
        let quiet = [st("a", 10.0, 0), st("b", 2.0, 0)];
        assert!(!shard_observations(QueueId::Shard(0), &quiet, 8.0, covered, &none)[0].contended);
        let busy = [st("a", 60.0, 0), st("b", 10.0, 0)];
        assert!(shard_observations(QueueId::Shard(0), &busy, 8.0, covered, &none)[0].contended);
        // Others active and a backlog beyond the delivery slots: contended.
        let backlog = [st("whale", 5.0, 400), st("small", 0.5, 0)];
        assert!(shard_observations(QueueId::Shard(0), &backlog, 8.0, covered, &none)[0].contended);
        // A backlog alone in its shard is still not contended.
        let lone = [st("whale", 5.0, 400)];
        assert!(!shard_observations(QueueId::Shard(0), &lone, 8.0, covered, &none)[0].contended);
        // Tenants with a lane are not candidates.
        let skip = BTreeSet::from(["a".to_string()]);
        let o = shard_observations(QueueId::Shard(0), &busy, 8.0, covered, &skip);
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].tenant, "b");
    }

    #[test]
    fn projected_wait_is_the_backlog_at_the_measured_drain_rate() {
        let st = |depth: u64, ws: f64, cost: f64| TenantStats {
            tenant: "whale".into(),
            depth,
            worker_seconds: ws,
            cost_seconds: cost,
            ..Default::default()
        };
        let covered = Duration::from_secs(100);
        // 2 worker-seconds a second at 0.05 s each: 40 deliveries a second,
        // so 12,000 queued take 300 s
        assert_eq!(
            projected_wait(&st(12_000, 200.0, 0.05), covered),
            Some(Duration::from_secs(300))
        );
        // nothing queued, no cost measured, nothing delivered: no projection
        assert_eq!(projected_wait(&st(0, 200.0, 0.05), covered), None);
        assert_eq!(projected_wait(&st(10, 200.0, 0.0), covered), None);
        assert_eq!(projected_wait(&st(10, 0.0, 0.05), covered), None);
        assert_eq!(projected_wait(&st(10, f64::NAN, 0.05), covered), None);
        // next to no drain rate: capped, not an overflow
        assert_eq!(
            projected_wait(&st(u64::MAX, 1e-300, 1e300), covered),
            Some(MAX_PROJECTED_WAIT)
        );
        // the observation carries it
        let o = shard_observations(
            QueueId::Shard(0),
            &[st(12_000, 200.0, 0.05)],
            8.0,
            covered,
            &BTreeSet::new(),
        );
        assert_eq!(o[0].projected_wait, Some(Duration::from_secs(300)));
    }

    fn trending(tenant: &str, share: f64, wait_s: u64) -> Observation {
        Observation {
            projected_wait: Some(Duration::from_secs(wait_s)),
            ..shard(tenant, share, true)
        }
    }

    #[test]
    fn a_growing_backlog_is_promoted_on_the_trend_before_its_share_would_be() {
        let on_trend = Thresholds {
            projected_wait: Some(Duration::from_secs(600)),
            ..spec()
        };
        // A share well under promoteShare, and a backlog of 20 minutes at
        // its drain rate: hot at once, promoted at the next tick.
        let d0 = evaluate(&on_trend, at(0), &[], &[], &[trending("import", 0.1, 1200)]);
        assert!(d0.promote.is_empty(), "one tick is not enough");
        assert_eq!(d0.hot[0].projected_wait_s, Some(1200.0));
        let d1 = evaluate(
            &on_trend,
            at(5),
            &d0.hot,
            &[],
            &[trending("import", 0.12, 1500)],
        );
        assert_eq!(d1.promote, vec!["import".to_string()]);
        // Without projectedWait the same tenant is not even hot.
        let d = evaluate(&spec(), at(0), &[], &[], &[trending("import", 0.1, 1200)]);
        assert!(d.hot.is_empty());
        // Under the threshold, or on a shard nobody else wants: not hot.
        let d = evaluate(&on_trend, at(0), &[], &[], &[trending("import", 0.1, 599)]);
        assert!(d.hot.is_empty());
        let alone = Observation {
            contended: false,
            ..trending("import", 1.0, 5000)
        };
        assert!(evaluate(&on_trend, at(0), &[], &[], &[alone])
            .hot
            .is_empty());
        // A backlog that dips under the threshold resets the confirmation.
        let d1 = evaluate(
            &on_trend,
            at(5),
            &d0.hot,
            &[],
            &[trending("import", 0.1, 100)],
        );
        assert!(d1.hot.is_empty() && d1.promote.is_empty());
        // Share-hot but not trending keeps the promoteAfter timer.
        let d1 = evaluate(
            &on_trend,
            at(5),
            &d0.hot,
            &[],
            &[trending("import", 0.5, 10)],
        );
        assert!(d1.promote.is_empty());
        assert_eq!(d1.hot[0].projected_wait_s, None);
    }

    #[test]
    fn lane_share_is_the_lanes_part_of_lane_and_home() {
        assert_eq!(lane_share(0.0, 0.0), 0.0);
        assert_eq!(lane_share(30.0, 70.0), 0.3);
    }
}
