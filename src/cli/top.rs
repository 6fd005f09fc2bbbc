//! `lanekeeper top`: which tenants own each queue's backlog and capacity.

use super::redis::RedisTarget;

#[derive(clap::Args, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    target: RedisTarget,
    /// Window for worker-second shares (Go duration: 5m, 90s).
    #[arg(long, default_value = "5m")]
    window: kube::core::Duration,
    /// Rows per queue.
    #[arg(long, default_value_t = 10)]
    limit: usize,
}

pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    let TopArgs {
        target,
        window,
        limit,
    } = args;
    let window: std::time::Duration = window.into();
    let store = target.connect().await?;
    let table = store.routing().await?;
    let mut queues: Vec<lanekeeper::routing::QueueId> = (0..table.shards)
        .map(lanekeeper::routing::QueueId::Shard)
        .collect();
    queues.extend(
        table
            .pins
            .values()
            .copied()
            .filter(|q| matches!(q, lanekeeper::routing::QueueId::Lane(_))),
    );
    queues.sort();
    queues.dedup();
    println!(
        "{:<10} {:<32} {:>10} {:>8} {:>10}  STATE",
        "QUEUE", "TENANT", "DEPTH", "DEPTH%", "CAPACITY%"
    );
    for q in queues {
        let stats = store.tenant_stats(q, window).await?;
        let paused = store.user_paused(q).await?;
        let depth: u64 = stats.iter().map(|s| s.depth).sum();
        let secs: f64 = stats.iter().map(|s| s.worker_seconds).sum();
        // The top `limit`, and every tenant a user paused (so a pause is
        // never out of sight).
        let shown = stats
            .iter()
            .enumerate()
            .filter(|(i, s)| *i < limit || paused.binary_search(&s.tenant).is_ok());
        for (_, s) in shown {
            let pct = |part: f64, whole: f64| {
                if whole > 0.0 {
                    100.0 * part / whole
                } else {
                    0.0
                }
            };
            println!(
                "{:<10} {:<32} {:>10} {:>7.1}% {:>9.1}%  {}",
                q.to_string(),
                s.tenant,
                s.depth,
                pct(s.depth as f64, depth as f64),
                pct(s.worker_seconds, secs),
                if paused.binary_search(&s.tenant).is_ok() {
                    "paused"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}
