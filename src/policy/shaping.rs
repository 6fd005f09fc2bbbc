//! Shaping at ingest (`promotion.atCap: ShapeAtIngest`), as pure rules: the
//! rate a hot tenant's fair share of its shard drains ([`fair_rate`]), and
//! which tenants are shaped this tick ([`decide`]).
//!
//! A tenant is shaped when it is hot (contended and at or above
//! `promoteShare`, as promotion measures it) and its DedicatedLane waits at
//! the lane cap (`Admitted=False`, `LaneCapReached`). Ingest then admits its
//! events at [`fair_rate`] (a token bucket in its queue state, spent by the
//! enqueue script) and answers 429 with `Retry-After` beyond it. Shaping is
//! lifted when its lane is admitted (or gone), or once ingest has refused
//! none of its events for the quiet time (the promotion window): a shaped
//! tenant's share is held at its fair share, so its share cannot say when
//! to stop, but its producer's refusals can.

use std::time::Duration;

use super::promotion::Observation;

/// The slowest a tenant is ever shaped to, in envelopes per second: a cost
/// estimate gone wild must not shut a tenant out.
pub const MIN_RATE: f64 = 1.0;

/// Most tenants shaped at once in one set (`status.shapedTenants`).
pub const MAX_SHAPED: usize = 64;

/// Another active tenant of the queue, as the rate sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Other {
    pub weight: f64,
    /// Delivery slots it kept busy over the window, on average.
    pub used_slots: f64,
}

/// The rate at which a tenant of weight `own_weight` drains its fair share
/// of a queue's `slots` delivery slots, in envelopes per second. The share
/// is the weighted max-min one a work-conserving scheduler gives: tenants
/// that used less than their weighted part keep what they used, and what
/// they leave is split by weight among the rest, the tenant among them. No
/// more than its in-flight cap, over its cost per delivery (`cost_s`
/// worker-seconds). At least [`MIN_RATE`], rounded to two places. Pure.
pub fn fair_rate(
    slots: f64,
    others: &[Other],
    own_weight: f64,
    in_flight_cap: f64,
    cost_s: f64,
) -> f64 {
    let sane = |w: f64| if w.is_finite() && w > 0.0 { w } else { 0.0 };
    let own = sane(own_weight).max(1e-6);
    let mut remaining = if slots.is_finite() {
        slots.max(0.0)
    } else {
        0.0
    };
    // Others still sharing (their use above their part so far).
    let mut sharing: Vec<(f64, f64)> = others
        .iter()
        .map(|o| (sane(o.weight), sane(o.used_slots)))
        .filter(|(w, _)| *w > 0.0)
        .collect();
    // Water-filling: at most one pass per other tenant.
    loop {
        let weights: f64 = own + sharing.iter().map(|(w, _)| w).sum::<f64>();
        let per_weight = remaining / weights;
        let (below, above): (Vec<_>, Vec<_>) =
            sharing.iter().partition(|(w, used)| *used < w * per_weight);
        if below.is_empty() {
            break;
        }
        remaining -= below.iter().map(|(_, used)| used).sum::<f64>();
        sharing = above;
    }
    let weights: f64 = own + sharing.iter().map(|(w, _)| w).sum::<f64>();
    let fair_slots = (remaining.max(0.0) * own / weights).min(in_flight_cap.max(1.0));
    let rate = fair_slots
        / if cost_s.is_finite() {
            cost_s.max(1e-3)
        } else {
            1.0
        };
    ((rate * 100.0).round() / 100.0).max(MIN_RATE)
}

/// The burst of a shaped tenant's bucket: one second of its rate, at least
/// one envelope.
pub fn burst(rate: f64) -> f64 {
    rate.max(1.0).ceil()
}

/// A tenant shaped at ingest.
#[derive(Clone, Debug, PartialEq)]
pub struct Shaped {
    pub tenant: String,
    /// The queue it is served from, as status names it.
    pub queue: String,
    pub per_second: f64,
    /// When it was first shaped, in Unix milliseconds.
    pub since_ms: i64,
}

/// A tenant whose lane waits at the cap, as measured this tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    pub observation: Observation,
    /// Its [`fair_rate`] now.
    pub rate: f64,
    /// When ingest last refused one of its events, in Unix milliseconds.
    pub last_refused_ms: Option<i64>,
}

/// This tick's shaping: who is shaped, and who starts and stops.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    pub shaped: Vec<Shaped>,
    pub started: Vec<String>,
    pub lifted: Vec<String>,
}

/// Apply the rules of the module to this tick's waiting tenants. `prev` is
/// the last tick's shaped list (from status), `promote_share` the share at
/// which a contended tenant is hot, `quiet` how long without a refusal lifts
/// the shaping. Pure.
pub fn decide(
    prev: &[Shaped],
    waiting: &[Waiting],
    promote_share: f64,
    quiet: Duration,
    now_ms: i64,
) -> Decision {
    let mut d = Decision::default();
    for w in waiting {
        let o = &w.observation;
        let was = prev.iter().find(|s| s.tenant == o.tenant);
        let keep = match was {
            Some(s) => {
                let last = w.last_refused_ms.unwrap_or(s.since_ms).max(s.since_ms);
                now_ms.saturating_sub(last) < quiet.as_millis() as i64
            }
            None => o.contended && o.share >= promote_share,
        };
        if !keep {
            continue;
        }
        if d.shaped.len() >= MAX_SHAPED && was.is_none() {
            continue;
        }
        if was.is_none() {
            d.started.push(o.tenant.clone());
        }
        d.shaped.push(Shaped {
            tenant: o.tenant.clone(),
            queue: o.queue.to_string(),
            per_second: w.rate,
            since_ms: was.map(|s| s.since_ms).unwrap_or(now_ms),
        });
    }
    d.shaped.truncate(MAX_SHAPED);
    for s in prev {
        if !d.shaped.iter().any(|x| x.tenant == s.tenant) {
            d.lifted.push(s.tenant.clone());
        }
    }
    d
}

/// The (tenant, queue) pairs whose shaping state must go after `d`: every
/// lifted tenant's, and the old queue of a tenant still shaped that a
/// reshard moved (a stale bucket there would shape it again, unseen, if it
/// ever came back). Pure.
pub fn to_clear(prev: &[Shaped], d: &Decision) -> Vec<(String, String)> {
    prev.iter()
        .filter(|p| {
            !d.shaped
                .iter()
                .any(|s| s.tenant == p.tenant && s.queue == p.queue)
        })
        .map(|p| (p.tenant.clone(), p.queue.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::QueueId;

    fn waiting(tenant: &str, share: f64, contended: bool, refused: Option<i64>) -> Waiting {
        Waiting {
            observation: Observation {
                tenant: tenant.into(),
                queue: QueueId::Shard(3),
                share,
                contended,
                laned: false,
                projected_wait: None,
            },
            rate: 12.5,
            last_refused_ms: refused,
        }
    }

    #[test]
    fn the_fair_rate_is_the_max_min_share_of_the_slots_over_the_cost() {
        let busy = |w: f64| Other {
            weight: w,
            used_slots: 100.0,
        };
        // 16 slots, 4 equal busy tenants, 100 ms a delivery: 4 slots, 40/s.
        assert_eq!(fair_rate(16.0, &[busy(1.0); 3], 1.0, 16.0, 0.1), 40.0);
        // Weight 2 of 1+1+2: half the slots.
        assert_eq!(fair_rate(16.0, &[busy(1.0); 2], 2.0, 16.0, 0.1), 80.0);
        // Light tenants keep what they use; the rest is the tenant's:
        // 3 of them use 0.5 slot each, so 14.5 slots are left for it.
        let light = Other {
            weight: 1.0,
            used_slots: 0.5,
        };
        assert_eq!(fair_rate(16.0, &[light; 3], 1.0, 16.0, 0.1), 145.0);
        // One light, one busy: the busy one and the tenant split 15.5.
        assert_eq!(fair_rate(16.0, &[light, busy(1.0)], 1.0, 16.0, 0.1), 77.5);
        // The in-flight cap bounds it (PerTenant: one in flight).
        assert_eq!(fair_rate(16.0, &[busy(1.0)], 1.0, 1.0, 0.1), 10.0);
        // Alone: every slot.
        assert_eq!(fair_rate(8.0, &[], 1.0, 8.0, 0.5), 16.0);
        // Nonsense never shuts a tenant out, nor divides by zero.
        assert_eq!(fair_rate(0.0, &[], 0.0, 0.0, 0.0), MIN_RATE);
        let odd = Other {
            weight: f64::NAN,
            used_slots: f64::INFINITY,
        };
        assert_eq!(fair_rate(16.0, &[odd], f64::INFINITY, 4.0, 1e9), MIN_RATE);
        assert!(fair_rate(f64::INFINITY, &[odd], 1.0, 16.0, f64::NAN).is_finite());
        assert_eq!(burst(0.3), 1.0);
        assert_eq!(burst(40.2), 41.0);
    }

    #[test]
    fn a_hot_waiting_tenant_is_shaped_and_keeps_it_while_it_is_refused() {
        let quiet = Duration::from_secs(60);
        let d = decide(&[], &[waiting("w", 0.6, true, None)], 0.3, quiet, 1_000_000);
        assert_eq!(d.started, vec!["w".to_string()]);
        assert_eq!(d.shaped.len(), 1);
        assert_eq!(d.shaped[0].queue, "shard-03");
        assert_eq!(d.shaped[0].since_ms, 1_000_000);
        // Not hot (or not contended): not shaped.
        let cold = decide(&[], &[waiting("w", 0.2, true, None)], 0.3, quiet, 1_000_000);
        assert!(cold.shaped.is_empty());
        let alone = decide(
            &[],
            &[waiting("w", 0.9, false, None)],
            0.3,
            quiet,
            1_000_000,
        );
        assert!(alone.shaped.is_empty());

        // Shaped, its share falls to its fair share: it stays shaped while
        // its producer is still refused, since unchanged.
        let prev = d.shaped;
        let later = 1_000_000 + 120_000;
        let d = decide(
            &prev,
            &[waiting("w", 0.1, true, Some(later - 5_000))],
            0.3,
            quiet,
            later,
        );
        assert_eq!(d.shaped.len(), 1);
        assert!(d.started.is_empty() && d.lifted.is_empty());
        assert_eq!(d.shaped[0].since_ms, 1_000_000);
        // No refusal for the quiet time: lifted.
        let d2 = decide(
            &prev,
            &[waiting("w", 0.1, true, Some(later - 60_000))],
            0.3,
            quiet,
            later,
        );
        assert!(d2.shaped.is_empty());
        assert_eq!(d2.lifted, vec!["w".to_string()]);
        // Never refused since it was shaped, quiet time not yet over: kept.
        let d3 = decide(
            &prev,
            &[waiting("w", 0.1, true, None)],
            0.3,
            quiet,
            1_000_000 + 30_000,
        );
        assert_eq!(d3.shaped.len(), 1);
        // Its lane was admitted (it no longer waits): lifted.
        let d4 = decide(&prev, &[], 0.3, quiet, later);
        assert_eq!(d4.lifted, vec!["w".to_string()]);
    }

    #[test]
    fn a_lifted_or_moved_tenants_old_bucket_is_cleared() {
        let shaped = |t: &str, q: &str| Shaped {
            tenant: t.into(),
            queue: q.into(),
            per_second: 5.0,
            since_ms: 0,
        };
        let prev = vec![
            shaped("stays", "shard-01"),
            shaped("moved", "shard-02"),
            shaped("lifted", "shard-03"),
        ];
        let d = Decision {
            shaped: vec![shaped("stays", "shard-01"), shaped("moved", "shard-05")],
            started: vec![],
            lifted: vec!["lifted".into()],
        };
        assert_eq!(
            to_clear(&prev, &d),
            vec![
                ("moved".to_string(), "shard-02".to_string()),
                ("lifted".to_string(), "shard-03".to_string())
            ]
        );
    }

    #[test]
    fn at_most_max_shaped_are_shaped() {
        let many: Vec<Waiting> = (0..100)
            .map(|i| waiting(&format!("t{i}"), 0.5, true, None))
            .collect();
        let d = decide(&[], &many, 0.3, Duration::from_secs(60), 0);
        assert_eq!(d.shaped.len(), MAX_SHAPED);
        assert_eq!(d.started.len(), MAX_SHAPED);
    }
}
