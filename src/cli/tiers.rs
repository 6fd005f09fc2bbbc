//! `lanekeeper tiers`: assign tenants' tiers in bulk from a file of
//! `<tenant> <tier>` lines (the ingest admin API's bulk format, parsed by the
//! same `policy::tiers` rules and written by the same store call), and show
//! one tenant's tier and where it comes from.

use std::path::PathBuf;

use super::redis::RedisTarget;
use lanekeeper::policy::tiers::parse_assignments;

/// Most assignments one `tiers apply` takes (the ingest API takes 100,000
/// per call; a file is not held by a request).
pub const MAX_FILE_ASSIGNMENTS: usize = 1_000_000;

/// Largest file `tiers apply` reads.
pub const MAX_FILE_BYTES: u64 = 128 << 20;

#[derive(clap::Args, Debug)]
pub struct TiersArgs {
    #[command(subcommand)]
    command: TiersCommand,
}

#[derive(clap::Subcommand, Debug)]
enum TiersCommand {
    /// Assign tiers from a file of `<tenant> <tier>` lines (`<tenant> -`
    /// clears; blank lines and `#` comments are skipped). All or nothing: a
    /// bad line fails the command, naming the line, and nothing is written.
    /// Written as the ingest admin API writes (it wins over the ConfigMap's
    /// assignments); ingest processes see it within their cache TTL (1 s).
    Apply {
        /// The file; `-` reads stdin.
        #[arg(long, short = 'f', value_name = "PATH")]
        file: PathBuf,
        #[command(flatten)]
        target: RedisTarget,
    },
    /// Print a tenant's tier in force and its sources.
    Get {
        tenant: String,
        #[command(flatten)]
        target: RedisTarget,
    },
}

pub async fn run(args: TiersArgs) -> anyhow::Result<()> {
    match args.command {
        TiersCommand::Apply { file, target } => {
            let text = super::read_input(&file, MAX_FILE_BYTES)?;
            let (good, bad) = parse_assignments(&text, true, MAX_FILE_ASSIGNMENTS, |t| {
                lanekeeper::envelope::validate_tenant(t).map_err(|e| e.reason)
            });
            if let Some(first) = bad.first() {
                let more: Vec<String> = bad[1..]
                    .iter()
                    .take(5)
                    .map(|b| format!("line {}: {}", b.line, b.reason))
                    .collect();
                anyhow::bail!(
                    "{}: line {}: {}{}; nothing was written",
                    file.display(),
                    first.line,
                    first.reason,
                    if more.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " (and {} more bad lines, first: {})",
                            bad.len() - 1,
                            more.join("; ")
                        )
                    }
                );
            }
            let store = target.connect().await?;
            store.put_api_tiers(&good).await?;
            let cleared = good.iter().filter(|(_, t)| t.is_none()).count();
            println!("set {}, cleared {cleared}", good.len() - cleared);
        }
        TiersCommand::Get { tenant, target } => {
            lanekeeper::envelope::validate_tenant(&tenant)
                .map_err(|e| anyhow::anyhow!("tenant: {}", e.reason))?;
            let store = target.connect().await?;
            let s = store.tier_sources(&tenant).await?;
            let show = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".into());
            println!(
                "tenant\t{tenant}\ntier\t{}\napi\t{}\nshardSet\t{}\nconfigMap\t{}",
                s.effective().unwrap_or("-"),
                show(&s.api),
                show(&s.spec),
                show(&s.config_map)
            );
        }
    }
    Ok(())
}
