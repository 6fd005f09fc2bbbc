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

/// The rate at which `own_weight`'s fair share of a queue's `slots`
/// delivery slots drains, in envelopes per second: its weighted share of
/// the slots among the active tenants (`weights`, its own included), no more
/// than its in-flight cap, over its cost per delivery (`cost_s`
/// worker-seconds). At least [`MIN_RATE`], rounded to two places. Pure.
pub fn fair_rate(
    slots: f64,
    weights: &[f64],
    own_weight: f64,
    in_flight_cap: f64,
    cost_s: f64,
) -> f64 {
    let total: f64 = weights.iter().filter(|w| w.is_finite() && **w > 0.0).sum();
    let own = if own_weight.is_finite() && own_weight > 0.0 {
        own_weight
    } else {
        0.0
    };
    let share = if total > 0.0 {
        (own / total).min(1.0)
    } else {
        1.0
    };
    let fair_slots = (slots.max(0.0) * share).min(in_flight_cap.max(1.0));
    let rate = fair_slots / cost_s.max(1e-3);
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
            },
            rate: 12.5,
            last_refused_ms: refused,
        }
    }

    #[test]
    fn the_fair_rate_is_the_weighted_share_of_the_slots_over_the_cost() {
        // 16 slots, 4 equal tenants, 100 ms a delivery: 4 slots, 40/s.
        assert_eq!(fair_rate(16.0, &[1.0; 4], 1.0, 16.0, 0.1), 40.0);
        // Weight 2 of 1+1+2: half the slots.
        assert_eq!(fair_rate(16.0, &[1.0, 1.0, 2.0], 2.0, 16.0, 0.1), 80.0);
        // The in-flight cap bounds it (PerTenant: one in flight).
        assert_eq!(fair_rate(16.0, &[1.0; 2], 1.0, 1.0, 0.1), 10.0);
        // Alone: every slot.
        assert_eq!(fair_rate(8.0, &[1.0], 1.0, 8.0, 0.5), 16.0);
        // Nonsense never shuts a tenant out, nor divides by zero.
        assert_eq!(fair_rate(0.0, &[], 0.0, 0.0, 0.0), MIN_RATE);
        assert_eq!(
            fair_rate(16.0, &[f64::NAN], f64::INFINITY, 4.0, 1e9),
            MIN_RATE
        );
        assert!(fair_rate(16.0, &[1.0], 1.0, 16.0, 0.0).is_finite());
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
    fn at_most_max_shaped_are_shaped() {
        let many: Vec<Waiting> = (0..100)
            .map(|i| waiting(&format!("t{i}"), 0.5, true, None))
            .collect();
        let d = decide(&[], &many, 0.3, Duration::from_secs(60), 0);
        assert_eq!(d.shaped.len(), MAX_SHAPED);
        assert_eq!(d.started.len(), MAX_SHAPED);
    }
}
