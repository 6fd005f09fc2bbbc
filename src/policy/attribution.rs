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
}

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
}
