//! `lanekeeper simulate`: a capacity simulator that answers "how many
//! shards, what cap, what quantum?" for a tenant mix before anyone touches
//! production.
//!
//! It replays one generated workload (small tenants with power-law volumes,
//! one or more whale imports, sampled endpoint latencies) through four
//! strategies and reports, per strategy, the small tenants' wait
//! percentiles, each whale's drain time and the max/median skew of the
//! shards' worker-seconds, plus an SVG chart of the small tenants' wait over
//! time:
//!
//! - `fifo`: one FIFO queue served by every worker;
//! - `shards-fifo`: rendezvous-hashed shards, FIFO inside each;
//! - `shards-fair`: hashed shards with the production scheduler (deficit
//!   round robin in worker-seconds, per-tenant cap);
//! - `fair+lanes`: the same, and tenants the production promotion rule
//!   ([`crate::policy::promotion`]) finds hot get a dedicated lane.
//!
//! The fair strategies run **the production Lua scripts against a real
//! Redis**, with a virtual clock ([`crate::store::Store::set_virtual_clock`]):
//! virtual workers lease, and ack after a sampled latency, through the same
//! [`crate::store::Store`] calls the worker makes. Nothing here models the
//! scheduler; see docs/architecture.md for why.

mod engine;
mod report;
mod workload;

use std::path::PathBuf;

use anyhow::{bail, Context};
use kube::core::Duration;
use serde::{Deserialize, Serialize};

pub use engine::{purge, run, run_as, run_id, set_of, Report, Strategy, StrategyResult, WaitStats};
pub use report::{svg, table};
pub use workload::{Arrival, Workload};

/// An endpoint latency distribution: log-normal, given by its median and
/// 99th percentile.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Latency {
    pub median: Duration,
    pub p99: Duration,
}

impl Default for Latency {
    fn default() -> Self {
        Self {
            median: std::time::Duration::from_millis(50).into(),
            p99: std::time::Duration::from_millis(250).into(),
        }
    }
}

/// One tenant's bulk import.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Whale {
    pub tenant: String,
    /// Envelopes in the import.
    pub count: u64,
    /// When the import starts, from the beginning of the run.
    #[serde(default = "zero")]
    pub start: Duration,
    /// Envelopes per second the producer pushes (0: all at `start`).
    #[serde(default)]
    pub rate: f64,
    /// Its endpoint's latency; the small tenants' distribution if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
}

fn zero() -> Duration {
    std::time::Duration::ZERO.into()
}

/// Promotion to dedicated lanes (the `fair+lanes` strategy), as in a
/// ShardSet's `spec.promotion`, plus the loop's tick.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Promotion {
    pub enabled: bool,
    pub promote_share: f64,
    pub promote_after: Duration,
    pub window: Duration,
    /// How often the promotion loop looks (the controller's `--promotion-tick`).
    pub tick: Duration,
    pub max_lanes: u32,
    /// Promote on the trend too (`promotion.projectedWait`); off if absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub projected_wait: Option<Duration>,
    /// Workers of each lane; the shard's `workers` if absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane_workers: Option<u32>,
}

impl Default for Promotion {
    fn default() -> Self {
        let s = |secs| std::time::Duration::from_secs(secs).into();
        Self {
            enabled: true,
            promote_share: 0.30,
            promote_after: s(15 * 60),
            window: s(5 * 60),
            tick: s(30),
            max_lanes: 8,
            projected_wait: None,
            lane_workers: None,
        }
    }
}

/// The whole input: the tenant mix and the system that serves it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Mix {
    /// Seed of the workload generator: the same seed, the same workload.
    pub seed: u64,
    /// How long the small tenants send (the run lasts until all is delivered).
    pub duration: Duration,
    /// Number of small tenants.
    pub tenants: u32,
    /// Envelopes per second of all small tenants together (Poisson).
    pub rate: f64,
    /// Power-law exponent of the small tenants' volumes: tenant i sends in
    /// proportion to 1 / i^zipf (0: all equal).
    pub zipf: f64,
    /// The small tenants' endpoint latency.
    pub latency: Latency,
    pub whales: Vec<Whale>,
    /// Hash shards.
    pub shards: u16,
    /// Workers (delivery slots) per shard; the single FIFO queue gets
    /// `shards x workers`.
    pub workers: u32,
    /// Per-tenant in-flight cap (`maxInFlightPerTenant`).
    pub cap: u32,
    /// DRR quantum in worker-seconds (`quantumSeconds`).
    pub quantum_seconds: f64,
    pub promotion: Promotion,
}

impl Default for Mix {
    fn default() -> Self {
        Self {
            seed: 1,
            duration: std::time::Duration::from_secs(120).into(),
            tenants: 200,
            rate: 25.0,
            zipf: 1.0,
            latency: Latency::default(),
            whales: Vec::new(),
            shards: 8,
            workers: 2,
            cap: 8,
            quantum_seconds: 2.0,
            promotion: Promotion::default(),
        }
    }
}

impl Mix {
    /// Refuse a mix the simulator cannot serve, naming the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        let max = crate::routing::MAX_SHARDS;
        if !(1..=max).contains(&self.shards) {
            bail!("shards must be between 1 and {max}, not {}", self.shards);
        }
        if self.workers == 0 || self.cap == 0 {
            bail!("workers and cap must be at least 1");
        }
        if !positive(self.quantum_seconds) {
            bail!("quantumSeconds must be positive");
        }
        if !non_negative(self.rate) || !non_negative(self.zipf) {
            bail!("rate and zipf must not be negative");
        }
        if self.rate > 0.0 && self.tenants == 0 {
            bail!("a positive rate needs at least one small tenant");
        }
        let check_latency = |what: &str, l: &Latency| -> anyhow::Result<()> {
            let (m, p): (std::time::Duration, std::time::Duration) =
                (l.median.into(), l.p99.into());
            if m.is_zero() || p < m {
                bail!("{what}: median must be positive and p99 at least the median");
            }
            Ok(())
        };
        check_latency("latency", &self.latency)?;
        for w in &self.whales {
            crate::envelope::validate_tenant(&w.tenant)
                .map_err(|e| anyhow::anyhow!("whale {:?}: {e}", w.tenant))?;
            if w.tenant.starts_with(workload::SMALL_PREFIX) {
                bail!(
                    "whale {:?}: names starting with {:?} are the small tenants'",
                    w.tenant,
                    workload::SMALL_PREFIX
                );
            }
            if w.count == 0 || !non_negative(w.rate) {
                bail!(
                    "whale {:?}: count must be positive, rate not negative",
                    w.tenant
                );
            }
            if let Some(l) = &w.latency {
                check_latency(&format!("whale {:?} latency", w.tenant), l)?;
            }
        }
        let p = &self.promotion;
        if !(1..=8).contains(&p.max_lanes) {
            bail!("promotion.maxLanes must be between 1 and 8");
        }
        if !(p.promote_share > 0.0 && p.promote_share <= 1.0) {
            bail!("promotion.promoteShare must be in (0, 1]");
        }
        let tick: std::time::Duration = p.tick.into();
        let window: std::time::Duration = p.window.into();
        if tick.as_millis() == 0 || window.as_secs() == 0 {
            bail!("promotion.tick must be positive and promotion.window at least 1s");
        }
        if p.projected_wait
            .is_some_and(|w| std::time::Duration::from(w).is_zero())
        {
            bail!("promotion.projectedWait must be positive");
        }
        if p.lane_workers == Some(0) {
            bail!("promotion.laneWorkers must be at least 1");
        }
        Ok(())
    }
}

/// False for NaN too.
fn positive(x: f64) -> bool {
    x > 0.0
}

/// False for NaN too.
fn non_negative(x: f64) -> bool {
    x >= 0.0
}

/// `--whale TENANT:COUNT[:START[:RATE]]`, e.g. `acme:20000:10s:500`.
fn parse_whale(s: &str) -> Result<Whale, String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() < 2 || parts.len() > 4 {
        return Err(format!("{s:?}: expected TENANT:COUNT[:START[:RATE]]"));
    }
    let count = parts[1]
        .parse()
        .map_err(|e| format!("{s:?}: count {:?}: {e}", parts[1]))?;
    let start = match parts.get(2) {
        Some(v) => v.parse().map_err(|e| format!("{s:?}: start {v:?}: {e}"))?,
        None => zero(),
    };
    let rate = match parts.get(3) {
        Some(v) => v.parse().map_err(|e| format!("{s:?}: rate {v:?}: {e}"))?,
        None => 0.0,
    };
    Ok(Whale {
        tenant: parts[0].to_string(),
        count,
        start,
        rate,
        latency: None,
    })
}

/// Arguments of `lanekeeper simulate`. Flags override the mix file.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Redis to run the production scripts on (required). The simulator
    /// works in a throwaway ShardSet `simulate/sim-<unique>` and deletes its
    /// keys when it ends; any Redis 7+ will do, a local one is fastest.
    #[arg(long, env = "LANEKEEPER_REDIS_URL", value_name = "URL")]
    pub redis: String,
    /// Tenant mix and system as YAML (see config/simulate/mix.yaml); flags
    /// below override its fields.
    #[arg(long, value_name = "FILE")]
    pub mix: Option<PathBuf>,
    /// Where to write the SVG chart of small-tenant wait over time.
    #[arg(long, value_name = "FILE", default_value = "simulate.svg")]
    pub svg: PathBuf,
    /// Seed of the workload generator.
    #[arg(long)]
    pub seed: Option<u64>,
    /// How long the small tenants send, e.g. 2m.
    #[arg(long)]
    pub duration: Option<Duration>,
    /// Number of small tenants.
    #[arg(long)]
    pub tenants: Option<u32>,
    /// Small tenants' envelopes per second, all together.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Power-law exponent of small tenants' volumes (1 / i^zipf).
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Median endpoint latency, e.g. 50ms.
    #[arg(long)]
    pub latency_median: Option<Duration>,
    /// 99th-percentile endpoint latency, e.g. 250ms.
    #[arg(long)]
    pub latency_p99: Option<Duration>,
    /// A whale import, TENANT:COUNT[:START[:RATE]] (e.g. acme:20000:10s:500);
    /// repeat for several. Replaces the file's whales.
    #[arg(long, value_parser = parse_whale)]
    pub whale: Vec<Whale>,
    /// Hash shards.
    #[arg(long)]
    pub shards: Option<u16>,
    /// Workers per shard (and per lane unless --lane-workers).
    #[arg(long)]
    pub workers: Option<u32>,
    /// Per-tenant in-flight cap.
    #[arg(long)]
    pub cap: Option<u32>,
    /// DRR quantum, worker-seconds.
    #[arg(long)]
    pub quantum: Option<f64>,
    /// Share of its shard's worker-seconds at which a tenant is hot.
    #[arg(long)]
    pub promote_share: Option<f64>,
    /// How long a tenant must stay hot before it gets a lane, e.g. 15m.
    #[arg(long)]
    pub promote_after: Option<Duration>,
    /// Window over which shares are measured, e.g. 5m.
    #[arg(long)]
    pub promotion_window: Option<Duration>,
    /// How often the promotion loop looks, e.g. 30s.
    #[arg(long)]
    pub promotion_tick: Option<Duration>,
    /// Most dedicated lanes (1 to 8).
    #[arg(long)]
    pub max_lanes: Option<u32>,
    /// Workers per dedicated lane.
    #[arg(long)]
    pub lane_workers: Option<u32>,
    /// Promote on the trend too: a tenant whose backlog would take this
    /// long at its measured drain rate, e.g. 10m (`promotion.projectedWait`).
    #[arg(long)]
    pub projected_wait: Option<Duration>,
    /// Never promote (the fair+lanes strategy then equals shards-fair).
    #[arg(long)]
    pub no_promotion: bool,
}

impl SimulateArgs {
    /// The mix: the file (or the defaults), then the flags.
    pub fn mix(&self) -> anyhow::Result<Mix> {
        let mut m = match &self.mix {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                serde_yaml::from_str(&text)
                    .with_context(|| format!("parsing {}", path.display()))?
            }
            None => Mix::default(),
        };
        macro_rules! set {
            ($($flag:ident => $($field:ident).+),* $(,)?) => {
                $(if let Some(v) = self.$flag.clone() { m.$($field).+ = v; })*
            };
        }
        set!(seed => seed, duration => duration, tenants => tenants, rate => rate,
            zipf => zipf, latency_median => latency.median, latency_p99 => latency.p99,
            shards => shards, workers => workers, cap => cap, quantum => quantum_seconds,
            promote_share => promotion.promote_share, promote_after => promotion.promote_after,
            promotion_window => promotion.window, promotion_tick => promotion.tick,
            max_lanes => promotion.max_lanes);
        if let Some(v) = self.lane_workers {
            m.promotion.lane_workers = Some(v);
        }
        if let Some(v) = self.projected_wait {
            m.promotion.projected_wait = Some(v);
        }
        if !self.whale.is_empty() {
            m.whales = self.whale.clone();
        }
        if self.no_promotion {
            m.promotion.enabled = false;
        }
        m.validate()?;
        Ok(m)
    }
}

/// `lanekeeper simulate`: run, print the table, write the chart; when
/// `interrupted` resolves first (the binary's SIGINT/SIGTERM), delete the
/// run's keys and fail.
pub async fn run_cli(
    args: SimulateArgs,
    interrupted: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let mix = args.mix()?;
    let workload = Workload::generate(&mix);
    eprintln!(
        "simulating {} envelopes ({} small tenants, {} whale(s)) on {} shards x {} workers, 4 strategies",
        workload.arrivals.len(),
        mix.tenants,
        mix.whales.len(),
        mix.shards,
        mix.workers,
    );
    // Ctrl-C (or SIGTERM) midway: delete the run's keys, then stop.
    let id = run_id();
    let report = tokio::select! {
        r = run_as(&args.redis, &mix, &workload, &id) => r?,
        _ = interrupted => {
            let removed = purge(&args.redis, &id).await?;
            bail!("interrupted; deleted the run's {removed} keys");
        }
    };
    print!("{}", table(&report));
    std::fs::write(&args.svg, svg(&report))
        .with_context(|| format!("writing {}", args.svg.display()))?;
    println!("chart: {}", args.svg.display());
    Ok(())
}
