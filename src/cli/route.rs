//! `lanekeeper route`: print the queue each tenant routes to.

use std::io::{BufRead, Write};

use super::redis::RedisTarget;

#[derive(clap::Args, Debug)]
// The routing table is read from Redis only without --shards.
#[command(
    mut_arg("redis", |a| a.required(false).required_unless_present("shards")),
    mut_arg("shard_set", |a| a.required(false).required_unless_present("shards"))
)]
pub struct RouteArgs {
    /// Shard count to hash over, instead of reading the routing table.
    #[arg(long, conflicts_with = "redis")]
    shards: Option<u16>,
    #[command(flatten)]
    target: RedisTarget,
    /// Tenant ids; with none, one per line is read from stdin.
    tenants: Vec<String>,
}

pub async fn run(args: RouteArgs) -> anyhow::Result<()> {
    let RouteArgs {
        shards,
        target,
        mut tenants,
    } = args;
    if tenants.is_empty() {
        for line in std::io::stdin().lock().lines() {
            let line = line?;
            if !line.trim().is_empty() {
                tenants.push(line.trim().to_string());
            }
        }
    }
    let table = match shards {
        Some(n) if (1..=1024).contains(&n) => lanekeeper::routing::RoutingTable {
            shards: n,
            ..Default::default()
        },
        Some(n) => anyhow::bail!("--shards {n}: must be between 1 and 1024"),
        None => target.connect().await?.routing().await?,
    };
    anyhow::ensure!(
        table.shards > 0,
        "the routing table has no shard count yet; is the controller running?"
    );
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for t in tenants {
        lanekeeper::envelope::validate_tenant(&t)?;
        writeln!(out, "{t}\t{}", table.route(&t))?;
    }
    out.flush()?;
    Ok(())
}
