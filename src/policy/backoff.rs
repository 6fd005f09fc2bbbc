//! Backoff: one capped exponential rule, and the jittered form the worker
//! uses for retries. Every wait that grows with failures uses these.

use std::time::Duration;

/// The wait after the `attempt`th consecutive failure (1 for the first):
/// `initial` doubling, at most `max`.
pub fn capped_backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let factor = 1u32 << attempt.saturating_sub(1).min(31);
    initial.saturating_mul(factor).min(max)
}

/// Delay before retry number `attempt` (1 for the first retry): exponential
/// from `initial`, capped at `max`, with "equal jitter" (half fixed, half
/// random) so a burst of failures does not retry in lockstep. `unit` is a
/// random number in [0, 1).
pub fn retry_delay(attempt: u32, initial: Duration, max: Duration, unit: f64) -> Duration {
    let capped = capped_backoff(attempt, initial, max).as_secs_f64();
    Duration::from_secs_f64(capped / 2.0 + capped / 2.0 * unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_backoff_doubles_up_to_its_bound() {
        let s = Duration::from_secs;
        let waits: Vec<Duration> = (1..=7).map(|n| capped_backoff(n, s(5), s(60))).collect();
        assert_eq!(waits, [s(5), s(10), s(20), s(40), s(60), s(60), s(60)]);
        assert_eq!(capped_backoff(0, s(5), s(60)), s(5));
        assert_eq!(capped_backoff(u32::MAX, s(2), s(300)), s(300));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let i = Duration::from_secs(1);
        let m = Duration::from_secs(60);
        assert_eq!(retry_delay(1, i, m, 1.0), Duration::from_secs(1));
        assert_eq!(retry_delay(1, i, m, 0.0), Duration::from_millis(500));
        assert_eq!(retry_delay(4, i, m, 1.0), Duration::from_secs(8));
        assert_eq!(retry_delay(30, i, m, 1.0), Duration::from_secs(60));
        assert_eq!(retry_delay(30, i, m, 0.0), Duration::from_secs(30));
    }
}
