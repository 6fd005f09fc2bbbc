//! The workload every strategy replays: arrivals with their tenant and the
//! time their delivery will take, generated once from the mix's seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Latency, Mix};

/// Small tenants are named `t-0001`, `t-0002`, ... (whales by the mix).
pub const SMALL_PREFIX: &str = "t-";

/// One envelope: when it arrives, whose it is, how long delivering it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// Virtual milliseconds from the start of the run.
    pub at_ms: u64,
    /// Index into [`Workload::tenants`].
    pub tenant: u32,
    /// The endpoint's latency for this delivery, milliseconds (at least 1).
    pub service_ms: u64,
}

/// The generated workload, arrivals in time order.
#[derive(Clone, Debug)]
pub struct Workload {
    pub tenants: Vec<String>,
    /// Per tenant: a small tenant (not a whale).
    pub small: Vec<bool>,
    pub arrivals: Vec<Arrival>,
}

/// A log-normal sampler with the given median and 99th percentile.
struct LogNormal {
    mu: f64,
    sigma: f64,
}

impl LogNormal {
    fn new(l: &Latency) -> Self {
        let median = std::time::Duration::from(l.median).as_secs_f64() * 1000.0;
        let p99 = std::time::Duration::from(l.p99).as_secs_f64() * 1000.0;
        // z of the 99th percentile of the standard normal
        const Z99: f64 = 2.326_347_874;
        Self {
            mu: median.ln(),
            sigma: (p99 / median).ln().max(0.0) / Z99,
        }
    }

    /// One latency in milliseconds, at least 1, at most 10 minutes.
    fn sample(&self, rng: &mut StdRng) -> u64 {
        // Box-Muller
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        (self.mu + self.sigma * z)
            .exp()
            .round()
            .clamp(1.0, 600_000.0) as u64
    }
}

impl Workload {
    /// The workload of `mix`: deterministic in its seed.
    pub fn generate(mix: &Mix) -> Self {
        let mut rng = StdRng::seed_from_u64(mix.seed);
        let mut tenants: Vec<String> = (1..=mix.tenants)
            .map(|i| format!("{SMALL_PREFIX}{i:04}"))
            .collect();
        let mut small = vec![true; tenants.len()];
        let mut arrivals = Vec::new();

        // Small tenants: one Poisson stream at `rate`, each arrival's tenant
        // drawn with probability proportional to 1 / i^zipf.
        let duration_ms = std::time::Duration::from(mix.duration).as_secs_f64() * 1000.0;
        if mix.rate > 0.0 && mix.tenants > 0 {
            let mut cumulative = Vec::with_capacity(mix.tenants as usize);
            let mut total = 0.0;
            for i in 1..=mix.tenants {
                total += 1.0 / (i as f64).powf(mix.zipf);
                cumulative.push(total);
            }
            let latency = LogNormal::new(&mix.latency);
            let mean_gap_ms = 1000.0 / mix.rate;
            let mut t = 0.0;
            loop {
                let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                t += -u.ln() * mean_gap_ms;
                if t >= duration_ms {
                    break;
                }
                let pick = rng.random::<f64>() * total;
                let i = cumulative
                    .partition_point(|c| *c < pick)
                    .min(cumulative.len() - 1);
                arrivals.push(Arrival {
                    at_ms: t as u64,
                    tenant: i as u32,
                    service_ms: latency.sample(&mut rng),
                });
            }
        }

        // Whales: `count` envelopes from `start`, evenly spaced at `rate`.
        for w in &mix.whales {
            let index = tenants.len() as u32;
            tenants.push(w.tenant.clone());
            small.push(false);
            let latency = LogNormal::new(w.latency.as_ref().unwrap_or(&mix.latency));
            let start_ms = std::time::Duration::from(w.start).as_secs_f64() * 1000.0;
            for k in 0..w.count {
                let offset = if w.rate > 0.0 {
                    k as f64 * 1000.0 / w.rate
                } else {
                    0.0
                };
                arrivals.push(Arrival {
                    at_ms: (start_ms + offset) as u64,
                    tenant: index,
                    service_ms: latency.sample(&mut rng),
                });
            }
        }
        // stable: equal times keep generation order
        arrivals.sort_by_key(|a| a.at_ms);
        Self {
            tenants,
            small,
            arrivals,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::Whale;

    #[test]
    fn deterministic_power_law_and_latency() {
        let mut mix = Mix {
            rate: 200.0,
            tenants: 50,
            zipf: 1.0,
            ..Mix::default()
        };
        mix.whales.push(Whale {
            tenant: "whale".into(),
            count: 1000,
            start: std::time::Duration::from_secs(10).into(),
            rate: 100.0,
            latency: None,
        });
        let a = Workload::generate(&mix);
        let b = Workload::generate(&mix);
        assert_eq!(a.arrivals, b.arrivals);
        assert!(a.arrivals.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));

        // about rate x duration small arrivals (Poisson: within 5%)
        let smalls: Vec<&Arrival> = a
            .arrivals
            .iter()
            .filter(|x| a.small[x.tenant as usize])
            .collect();
        let expected = 200.0 * 120.0;
        assert!(
            (smalls.len() as f64 - expected).abs() < 0.05 * expected,
            "{}",
            smalls.len()
        );
        // power law: tenant 1 sends about twice tenant 2 and ten times tenant 10
        let count = |i: u32| smalls.iter().filter(|x| x.tenant == i).count() as f64;
        let r2 = count(0) / count(1);
        let r10 = count(0) / count(9);
        assert!((1.7..2.3).contains(&r2), "tenant 1 / tenant 2 = {r2}");
        assert!((8.0..12.5).contains(&r10), "tenant 1 / tenant 10 = {r10}");

        // log-normal latency: median 50 ms, p99 250 ms (within 10%)
        let mut lat: Vec<u64> = smalls.iter().map(|x| x.service_ms).collect();
        lat.sort_unstable();
        let median = lat[lat.len() / 2] as f64;
        let p99 = lat[lat.len() * 99 / 100] as f64;
        assert!((45.0..55.0).contains(&median), "median {median}");
        assert!((225.0..275.0).contains(&p99), "p99 {p99}");

        // the whale: 1000 envelopes from 10 s at 100/s
        let whale: Vec<&Arrival> = a.arrivals.iter().filter(|x| x.tenant == 50).collect();
        assert_eq!(whale.len(), 1000);
        assert_eq!(whale.first().unwrap().at_ms, 10_000);
        assert_eq!(whale.last().unwrap().at_ms, 10_000 + 9_990);
    }
}
