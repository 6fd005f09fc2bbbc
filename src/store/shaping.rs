//! Shaping at ingest: the controller writes a shaped tenant's rate (`sr`,
//! envelopes per second) and burst (`sb`) into its state in its queue
//! (`P:t:<tenant>`), where the enqueue script spends its tokens (`sl` at
//! `su` ms) and counts its refusals (`sd`, the last at `sx` ms). The rules
//! are in [`crate::policy::shaping`].

use super::{keys, Result, Store};
use crate::routing::QueueId;

/// A tenant's shaping as its queue state holds it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shaping {
    /// Envelopes per second ingest admits; `None`: not shaped.
    pub per_second: Option<f64>,
    pub burst: Option<f64>,
    /// Envelopes refused since shaping was last set up.
    pub refused: u64,
    /// When the enqueue script last refused one, in Unix milliseconds.
    pub last_refused_ms: Option<i64>,
}

impl Store {
    /// Shape `tenant` in `q` to `per_second` with `burst` (its bucket's level
    /// is kept across changes of rate), or, with `None`, lift it (its bucket
    /// and refusal counts go too). One command either way, idempotent: the
    /// promotion loop rewrites it every tick, so a Redis that lost it gets
    /// it back.
    pub async fn set_shaping(
        &self,
        q: QueueId,
        tenant: &str,
        shape: Option<(f64, f64)>,
    ) -> Result<()> {
        let key = keys::tenant(&self.queue_prefix(q), tenant);
        let mut conn = self.conn.clone();
        match shape {
            Some((rate, burst)) => {
                let _: () = redis::cmd("HSET")
                    .arg(&key)
                    .arg("sr")
                    .arg(rate.max(0.0).to_string())
                    .arg("sb")
                    .arg(burst.max(1.0).to_string())
                    .query_async(&mut conn)
                    .await?;
            }
            None => {
                let _: () = redis::cmd("HDEL")
                    .arg(&key)
                    .arg(&["sr", "sb", "sl", "su", "sd", "sx"])
                    .query_async(&mut conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// `tenant`'s shaping in `q`.
    pub async fn shaping(&self, q: QueueId, tenant: &str) -> Result<Shaping> {
        let key = keys::tenant(&self.queue_prefix(q), tenant);
        let mut conn = self.conn.clone();
        let v: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&key)
            .arg(&["sr", "sb", "sd", "sx"])
            .query_async(&mut conn)
            .await?;
        let f = |i: usize| {
            v.get(i)
                .cloned()
                .flatten()
                .and_then(|s| s.parse::<f64>().ok())
        };
        Ok(Shaping {
            per_second: f(0).filter(|r| *r > 0.0),
            burst: f(1),
            refused: f(2).map(|x| x.max(0.0) as u64).unwrap_or(0),
            last_refused_ms: f(3).map(|x| x as i64),
        })
    }
}
