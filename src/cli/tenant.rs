//! `lanekeeper tenant`: act on one tenant in an incident. `pause` stops its
//! deliveries (ingest keeps accepting, within its backlog limit), `resume`
//! restarts them in order, `purge` takes its queued envelopes out (to its
//! dead letters, or dropped), `replay` puts its dead letters back in order
//! at a rate, `show` prints where it lives and what it holds.
//! The same store calls as the ingest admin API, recorded in the same audit
//! trail (as `cli:<user>`).

use super::redis::RedisTarget;
use lanekeeper::store::{PauseOutcome, PurgeMode, ReplayFilter, ReplayPlan, TenantView};

#[derive(clap::Args, Debug)]
pub struct TenantArgs {
    #[command(subcommand)]
    command: TenantCommand,
}

#[derive(clap::Subcommand, Debug)]
enum TenantCommand {
    /// Stop the tenant's deliveries: leases skip it (deliveries in flight
    /// finish), ingest keeps accepting its events within its backlog limit.
    /// It stays paused when a lane or a reshard moves it.
    Pause(Change),
    /// Restart the tenant's deliveries, in its order.
    Resume(Change),
    /// Take the tenant's queued envelopes out of its queue: to its dead
    /// letters with cause `purged` (the default; they can be replayed), or
    /// dropped with `--drop`. What is in flight or waiting to retry is left
    /// to finish. Refused while a lane or a reshard moves the tenant.
    Purge {
        /// Delete them (counted) instead of dead-lettering them.
        #[arg(long)]
        drop: bool,
        #[command(flatten)]
        change: Change,
    },
    /// Put the tenant's dead letters back on its lane, oldest first, in
    /// bounded steps: all, or those dead since/until a time or to one endpoint.
    Replay {
        /// Only letters dead since this time: RFC 3339 (`2026-12-03T09:00:00Z`)
        /// or a duration ago (`2h`, `30m`).
        #[arg(long)]
        since: Option<String>,
        /// Only letters dead until this time (same forms).
        #[arg(long)]
        until: Option<String>,
        /// Only letters to this endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// Letters per second at most.
        #[arg(long)]
        max_per_second: Option<f64>,
        #[command(flatten)]
        change: Change,
    },
    /// Print where the tenant lives, whether it is paused, what it holds,
    /// and its latest audit entries.
    Show {
        tenant: String,
        /// `text` or `json`.
        #[arg(long, short = 'o', default_value = "text", value_parser = ["text", "json"])]
        output: String,
        #[command(flatten)]
        target: RedisTarget,
    },
}

#[derive(clap::Args, Debug)]
struct Change {
    tenant: String,
    /// Recorded in the audit trail with the operation (one line, at most 256 bytes).
    #[arg(long)]
    reason: Option<String>,
    #[command(flatten)]
    target: RedisTarget,
}

/// Who the audit trail says did it: `cli:<$USER>`.
fn who() -> String {
    let user = std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty() && u.len() <= 64 && !u.chars().any(char::is_control))
        .unwrap_or_else(|| "unknown".into());
    format!("cli:{user}")
}

pub async fn run(args: TenantArgs) -> anyhow::Result<()> {
    match args.command {
        TenantCommand::Pause(c) => change(c, true).await,
        TenantCommand::Resume(c) => change(c, false).await,
        TenantCommand::Purge { drop, change: c } => {
            check(&c)?;
            let mode = if drop {
                PurgeMode::Drop
            } else {
                PurgeMode::DeadLetter
            };
            let store = c.target.connect().await?;
            let o = store
                .purge_audited(&c.tenant, mode, &who(), c.reason.as_deref())
                .await?;
            println!(
                "{}: {} {} envelopes in {} ({} in flight and {} waiting to retry left to finish)",
                c.tenant,
                if drop { "dropped" } else { "dead-lettered" },
                o.purged,
                o.queue,
                o.in_flight,
                o.delayed
            );
            Ok(())
        }
        TenantCommand::Replay {
            since,
            until,
            endpoint,
            max_per_second,
            change: c,
        } => {
            check(&c)?;
            if let Some(e) = &endpoint {
                lanekeeper::endpoint::check_name(e)
                    .map_err(|e| anyhow::anyhow!("--endpoint: {e}"))?;
            }
            if let Some(r) = max_per_second {
                anyhow::ensure!(
                    r.is_finite() && r > 0.0,
                    "--max-per-second: must be a number above 0"
                );
            }
            let now = k8s_openapi::jiff::Timestamp::now();
            let since_ms = since
                .as_deref()
                .map(|s| time_ms(s, now).map_err(|e| anyhow::anyhow!("--since: {e}")))
                .transpose()?;
            let until_ms = until
                .as_deref()
                .map(|s| time_ms(s, now).map_err(|e| anyhow::anyhow!("--until: {e}")))
                .transpose()?;
            if let (Some(a), Some(b)) = (since_ms, until_ms) {
                anyhow::ensure!(a <= b, "--until is before --since");
            }
            let plan = ReplayPlan {
                filter: ReplayFilter {
                    since_ms,
                    until_ms,
                    endpoint,
                },
                max_per_second,
                budget: None,
                after: None,
            };
            let store = c.target.connect().await?;
            let o = store
                .replay_audited(&c.tenant, &plan, &who(), c.reason.as_deref())
                .await?;
            println!(
                "{}: replayed {} of {} dead letters examined in {}",
                c.tenant, o.replayed, o.examined, o.queue
            );
            Ok(())
        }
        TenantCommand::Show {
            tenant,
            output,
            target,
        } => {
            check_tenant(&tenant)?;
            let store = target.connect().await?;
            let view = store.tenant_view(&tenant, 10).await?;
            if output == "json" {
                println!("{}", serde_json::to_string_pretty(&view_json(&view))?);
            } else {
                print!("{}", view_text(&view));
            }
            Ok(())
        }
    }
}

fn check_tenant(tenant: &str) -> anyhow::Result<()> {
    lanekeeper::envelope::validate_tenant(tenant)
        .map_err(|e| anyhow::anyhow!("tenant: {}", e.reason))
}

/// The tenant and the reason of a change, checked before anything is done.
fn check(c: &Change) -> anyhow::Result<()> {
    check_tenant(&c.tenant)?;
    if let Some(r) = &c.reason {
        lanekeeper::store::check_reason(r).map_err(|e| anyhow::anyhow!("--reason: {e}"))?;
    }
    Ok(())
}

/// A time as ms since the epoch: RFC 3339, or a Go duration before `now`.
pub fn time_ms(s: &str, now: k8s_openapi::jiff::Timestamp) -> Result<u64, String> {
    if let Ok(t) = s.parse::<k8s_openapi::jiff::Timestamp>() {
        return u64::try_from(t.as_millisecond()).map_err(|_| format!("{s:?} is before 1970"));
    }
    if s.starts_with('-') {
        return Err(format!("{s:?}: a duration ago is not negative"));
    }
    let ago: kube::core::Duration = s.parse().map_err(|_| {
        format!("{s:?} is neither an RFC 3339 time (2026-12-03T09:00:00Z) nor a duration ago (2h)")
    })?;
    let ago: std::time::Duration = ago.into();
    let ms = now.as_millisecond() - ago.as_millis().min(i64::MAX as u128) as i64;
    u64::try_from(ms).map_err(|_| format!("{s:?} ago is before 1970"))
}

async fn change(c: Change, paused: bool) -> anyhow::Result<()> {
    check(&c)?;
    let store = c.target.connect().await?;
    let o = store
        .user_pause_audited(&c.tenant, paused, &who(), c.reason.as_deref())
        .await?;
    println!("{}", outcome_line(&c.tenant, &o));
    Ok(())
}

/// One line saying what a pause or resume did.
pub fn outcome_line(tenant: &str, o: &PauseOutcome) -> String {
    let state = if o.paused { "paused" } else { "resumed" };
    let already = if o.changed { "" } else { "already " };
    format!(
        "{tenant}: {already}{state} in {} ({} outstanding)",
        o.queue, o.depth
    )
}

/// `show` as JSON, the field names the admin API uses.
fn view_json(v: &TenantView) -> serde_json::Value {
    serde_json::json!({
        "tenant": v.tenant,
        "queue": v.queue.to_string(),
        "hashShard": v.hash_shard.to_string(),
        "paused": v.state.user_paused,
        "moving": v.state.paused,
        "movedTo": v.state.moved_to.map(|q| q.to_string()),
        "depth": v.state.depth,
        "queued": v.state.queued,
        "inFlight": v.state.in_flight,
        "delayed": v.state.delayed,
        "held": v.state.held,
        "deadLetters": v.dead_letters,
        "audit": v.audit.iter().map(|e| serde_json::json!({
            "atMs": e.at_ms, "who": e.who, "operation": e.operation, "outcome": e.outcome,
        })).collect::<Vec<_>>(),
    })
}

fn view_text(v: &TenantView) -> String {
    let s = &v.state;
    let mut out = format!(
        "tenant\t{}\nqueue\t{}{}\npaused\t{}\nmoving\t{}\ndepth\t{} (queued {}, in flight {}, delayed {}, held {})\ndead letters\t{}\n",
        v.tenant,
        v.queue,
        if v.queue == v.hash_shard {
            String::new()
        } else {
            format!(" (hash shard {})", v.hash_shard)
        },
        if s.user_paused { "yes" } else { "no" },
        if s.paused { "yes (a lane or reshard is moving it)" } else { "no" },
        s.depth,
        s.queued,
        s.in_flight,
        s.delayed,
        s.held,
        v.dead_letters,
    );
    if !v.audit.is_empty() {
        out.push_str("audit\n");
        for e in &v.audit {
            out.push_str(&format!(
                "  {}\t{}\t{}\t{}\n",
                format_ms(e.at_ms),
                e.who,
                e.operation,
                e.outcome
            ));
        }
    }
    out
}

fn format_ms(ms: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(ms as i64)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| ms.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_a_duration_ago() {
        let now = k8s_openapi::jiff::Timestamp::from_millisecond(1_800_000_000_000).unwrap();
        assert_eq!(time_ms("2h", now), Ok(1_800_000_000_000 - 7_200_000));
        assert_eq!(time_ms("2026-12-03T09:00:00Z", now), Ok(1_796_288_400_000));
        assert!(time_ms("yesterday", now).unwrap_err().contains("RFC 3339"));
        assert!(time_ms("1969-01-01T00:00:00Z", now)
            .unwrap_err()
            .contains("1970"));
    }
}
