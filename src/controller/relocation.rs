//! The relocation protocol both movers use, DedicatedLanes
//! (`controller::lane`) and reshards (`controller::reshard`): one tenant
//! leaves a source queue for a target queue by
//!
//! 1. pausing it in the source (new envelopes wait in its hold buffer);
//! 2. waiting until the source is drained ([`DrainClock::verdict`]): past the
//!    drain timeout the move is *aborted* ([`abort`]: resumed in place, its
//!    hold buffer appended in order) and tried again after [`backoff`];
//! 3. pausing it in the target, pointing routing at the target, marking it
//!    moved in the source ([`hand_over`], refused if something arrived
//!    after all: drain again) and appending the source's hold buffer to the
//!    target;
//! 4. resuming it in the target (its own hold buffer follows).
//!
//! What differs is who keeps the record and how routing changes: a lane
//! records its phase and its [`DrainClock`] in its status and pins before
//! the mark; a reshard keeps the clock in the controller's memory (lost on
//! restart, which only restarts the drain) and removes its pin last.
//!
//! **One backoff, two caps.** Both wait the drain timeout doubling per
//! aborted attempt, at least [`MIN_DRAIN_BACKOFF`] (each abort of a lane
//! records an Event). A lane waits at most [`MAX_DRAIN_BACKOFF`] (10 min): a
//! lane's retry holds up only its own tenant, and each abort is a Warning
//! Event. A reshard waits at most [`MAX_RESHARD_BACKOFF`] (5 min): while one
//! mover backs off, the whole reshard stays unfinished (no retired shard is
//! pruned, and the set's lanes wait at the lane/reshard gate), so it tries
//! again sooner. Both caps are what they were before this module.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::policy::capped_backoff;
use crate::routing::QueueId;
use crate::store::{Store, StoreError};

/// Longest pause between two drain attempts of a lane after `DrainTimeout`s.
pub const MAX_DRAIN_BACKOFF: Duration = Duration::from_secs(600);
/// Longest pause between two drain attempts of a reshard's mover.
pub const MAX_RESHARD_BACKOFF: Duration = Duration::from_secs(300);
/// Shortest pause between two drain attempts: each abort records an Event.
pub const MIN_DRAIN_BACKOFF: Duration = Duration::from_secs(5);

/// What a drain check concludes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    Drained,
    Wait,
    /// Past the drain timeout: resume in place and retry later.
    Abort,
}

/// Wait before drain attempt `attempts + 1`: the drain timeout, doubling per
/// aborted attempt (`policy::capped_backoff`, the one capped backoff), at
/// least [`MIN_DRAIN_BACKOFF`] and at most `cap`
/// ([`MAX_DRAIN_BACKOFF`] for lanes, [`MAX_RESHARD_BACKOFF`] for reshards).
/// Pure.
pub fn backoff(timeout: Duration, attempts: u32, cap: Duration) -> Duration {
    capped_backoff(attempts, timeout, cap).max(MIN_DRAIN_BACKOFF)
}

/// One move's drain clock, on the wall clock: when the tenant was paused in
/// its source, how many drains timed out, and when the next attempt may
/// start. A lane keeps it in its status (`pausedAt`, `drainAttempts`,
/// `nextAttemptAt`), a reshard in memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainClock {
    pub paused_at: Option<Timestamp>,
    pub attempts: u32,
    pub retry_at: Option<Timestamp>,
}

impl DrainClock {
    /// How long the tenant has been paused at `now` (`None`: not paused, as
    /// far as this clock knows).
    pub fn paused_for(&self, now: Timestamp) -> Option<Duration> {
        self.paused_at.map(|t| since(t, now))
    }

    /// Is the paused source drained, still draining, or past `timeout`?
    /// A clock that never saw the pause is not past it. Pure.
    pub fn verdict(&self, drained: bool, now: Timestamp, timeout: Duration) -> Drain {
        if drained {
            Drain::Drained
        } else if self.paused_for(now).is_some_and(|d| d >= timeout) {
            Drain::Abort
        } else {
            Drain::Wait
        }
    }

    /// Is an attempt that timed out still waiting out its backoff at `now`?
    pub fn backing_off(&self, now: Timestamp) -> bool {
        self.retry_at.is_some_and(|t| t > now)
    }

    /// The drain was aborted at `now`: one more attempt counted, the pause
    /// forgotten, the next attempt after [`backoff`]. Returns the wait.
    pub fn abort(&mut self, now: Timestamp, timeout: Duration, cap: Duration) -> Duration {
        self.attempts = self.attempts.saturating_add(1);
        let wait = backoff(timeout, self.attempts, cap);
        self.paused_at = None;
        self.retry_at = Some(later(now, wait));
        wait
    }

    /// The clock a lane keeps in its status.
    pub fn of_status(paused_at: Option<&Time>, attempts: i32, next: Option<&Time>) -> Self {
        DrainClock {
            paused_at: paused_at.map(|t| t.0),
            attempts: attempts.max(0) as u32,
            retry_at: next.map(|t| t.0),
        }
    }
}

/// `now - then`, never negative.
pub fn since(then: Timestamp, now: Timestamp) -> Duration {
    Duration::from_millis((now.as_millisecond() - then.as_millisecond()).max(0) as u64)
}

/// `now + wait` (saturating at `now` if out of range).
pub fn later(now: Timestamp, wait: Duration) -> Timestamp {
    now.checked_add(SignedDuration::try_from(wait).unwrap_or_default())
        .unwrap_or(now)
}

/// Step 2's abort: resume the tenant where it was (its hold buffer is
/// appended in order and it is unpaused). The one way every mover backs out
/// of a move before the mark.
pub async fn abort(store: &Store, source: QueueId, tenant: &str) -> Result<(), StoreError> {
    store.resume(source, tenant).await?;
    Ok(())
}

/// Step 3 after the target holds the tenant and routing points at it: mark
/// it moved in `source` (refused, `false`, unless paused and drained there)
/// and append the source's hold buffer to `target`. Both may be repeated.
pub async fn hand_over(
    store: &Store,
    tenant: &str,
    source: QueueId,
    target: QueueId,
) -> Result<bool, StoreError> {
    if !store.mark_moved(source, tenant, target).await? {
        return Ok(false);
    }
    store.move_hold(source, target, tenant).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_between_the_floor_and_each_cap() {
        let timeout = Duration::from_secs(10);
        assert_eq!(backoff(timeout, 1, MAX_DRAIN_BACKOFF), timeout);
        assert_eq!(backoff(timeout, 2, MAX_DRAIN_BACKOFF), 2 * timeout);
        assert_eq!(backoff(timeout, 3, MAX_DRAIN_BACKOFF), 4 * timeout);
        assert_eq!(backoff(timeout, 30, MAX_DRAIN_BACKOFF), MAX_DRAIN_BACKOFF);
        assert_eq!(
            backoff(Duration::from_secs(60), 10, MAX_RESHARD_BACKOFF),
            MAX_RESHARD_BACKOFF
        );
        // attempts 0 (never stored as such) waits the timeout too.
        assert_eq!(backoff(timeout, 0, MAX_DRAIN_BACKOFF), timeout);
        // A tiny timeout (stored before the CEL floor) still waits the floor.
        let tiny = Duration::from_nanos(1);
        assert_eq!(backoff(tiny, 1, MAX_DRAIN_BACKOFF), MIN_DRAIN_BACKOFF);
        assert_eq!(backoff(tiny, 40, MAX_RESHARD_BACKOFF), MIN_DRAIN_BACKOFF);
        assert_eq!(
            backoff(tiny, u32::MAX, MAX_DRAIN_BACKOFF),
            MIN_DRAIN_BACKOFF
        );
    }

    #[test]
    fn the_drain_clock_judges_and_aborts() {
        let at = |s: i64| Timestamp::from_second(1_000 + s).unwrap();
        let timeout = Duration::from_secs(10);
        let mut clock = DrainClock {
            paused_at: Some(at(0)),
            ..Default::default()
        };
        assert_eq!(clock.verdict(true, at(100), timeout), Drain::Drained);
        assert_eq!(clock.verdict(false, at(9), timeout), Drain::Wait);
        assert_eq!(clock.verdict(false, at(10), timeout), Drain::Abort);
        // A clock from the future (another controller's) is not negative.
        assert_eq!(clock.paused_for(at(-5)), Some(Duration::ZERO));
        // Never saw the pause: not past the timeout.
        assert_eq!(
            DrainClock::default().verdict(false, at(1_000), timeout),
            Drain::Wait
        );

        assert_eq!(clock.abort(at(10), timeout, MAX_DRAIN_BACKOFF), timeout);
        assert_eq!(clock.attempts, 1);
        assert_eq!(clock.paused_at, None);
        assert_eq!(clock.retry_at, Some(at(20)));
        assert!(clock.backing_off(at(19)) && !clock.backing_off(at(20)));
        assert_eq!(clock.abort(at(30), timeout, MAX_DRAIN_BACKOFF), 2 * timeout);
        assert_eq!(clock.retry_at, Some(at(50)));

        let status = DrainClock::of_status(Some(&Time(at(3))), 2, Some(&Time(at(7))));
        assert_eq!(
            status,
            DrainClock {
                paused_at: Some(at(3)),
                attempts: 2,
                retry_at: Some(at(7)),
            }
        );
        assert_eq!(DrainClock::of_status(None, -1, None).attempts, 0);
    }
}
