//! Attribution: per-tenant depth, delivered, failed and worker-seconds of a
//! queue, and one tenant's recent activity.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::Value;

use super::{keys, Result, Store, StoreError, TenantActivity, TenantStats};
use crate::policy::attribution;
use crate::routing::QueueId;

impl Store {
    /// Per-tenant depth, delivered, failed and worker-seconds over `window`
    /// in `q`, largest worker-seconds first.
    pub async fn tenant_stats(&self, q: QueueId, window: Duration) -> Result<Vec<TenantStats>> {
        let mut conn = self.conn.clone();
        let now_ms: u64 = {
            let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
            s * 1000 + us / 1000
        };
        self.tenant_stats_at(q, window, now_ms).await
    }

    /// [`Store::tenant_stats`] for the window that ends at `now_ms` instead
    /// of Redis's own time: the capacity simulator reads attribution at its
    /// virtual time (see [`Store::set_virtual_clock`]).
    pub async fn tenant_stats_at(
        &self,
        q: QueueId,
        window: Duration,
        now_ms: u64,
    ) -> Result<Vec<TenantStats>> {
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let newest = attribution::bucket_of(now_ms);
        let buckets = attribution::buckets(window);
        // The recent rate's buckets may reach further back than the window's.
        let recent = attribution::buckets(attribution::RECENT);
        let recent_secs = attribution::covered(attribution::RECENT, now_ms).as_secs_f64();
        let tenants: Vec<String> = redis::cmd("SMEMBERS")
            .arg(keys::tenants(&p))
            .query_async(&mut conn)
            .await?;
        let mut pipe = redis::pipe();
        for t in &tenants {
            pipe.cmd("HMGET")
                .arg(keys::tenant(&p, t))
                .arg(&["n", "ok", "ko", "e", "f", "w", "h", "tr", "up", "p"]);
        }
        for b in 0..buckets.max(recent) {
            pipe.hgetall(keys::worker_seconds(&p, newest.saturating_sub(b)));
        }
        let replies: Vec<Value> = pipe.query_async(&mut conn).await?;
        let (counters, windows) = replies.split_at(tenants.len().min(replies.len()));
        let mut by_tenant: BTreeMap<String, TenantStats> = BTreeMap::new();
        for (t, v) in tenants.iter().zip(counters) {
            let n: Vec<Option<String>> =
                redis::from_redis_value_ref(v).map_err(|e| StoreError::Protocol {
                    script: "tenant stats",
                    detail: format!("counters of {t}: {e}"),
                })?;
            // as the scripts read them: what is not a number counts as 0
            let number = |i: usize| {
                n.get(i)
                    .cloned()
                    .flatten()
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .unwrap_or(0.0)
            };
            let field = |i: usize| number(i) as u64;
            let set = |i: usize| n.get(i).cloned().flatten().filter(|v| !v.is_empty());
            let depth = field(0);
            by_tenant.insert(
                t.clone(),
                TenantStats {
                    tenant: t.clone(),
                    depth,
                    delivered: field(1),
                    failed: field(2),
                    worker_seconds: 0.0,
                    // whole microseconds in the tenant's state
                    cost_seconds: number(3) / 1e6,
                    in_flight: field(4),
                    // depth counts the delayed, the held and those in flight too
                    queued: depth.saturating_sub(field(4) + field(5) + field(6)),
                    tier: set(7),
                    // a user's pause ('1') or a relocation's (any value)
                    paused: set(8).is_some_and(|v| v == "1") || set(9).is_some(),
                    recent_rate: 0.0,
                },
            );
        }
        for (b, v) in windows.iter().enumerate() {
            let b = b as u64;
            let map: BTreeMap<String, f64> =
                redis::from_redis_value_ref(v).map_err(|e| StoreError::Protocol {
                    script: "tenant stats",
                    detail: format!("worker-seconds bucket: {e}"),
                })?;
            for (t, us) in map {
                let st = by_tenant.entry(t.clone()).or_insert_with(|| TenantStats {
                    tenant: t,
                    ..Default::default()
                });
                if b < buckets {
                    st.worker_seconds += us / 1e6;
                }
                if b < recent {
                    st.recent_rate += us / 1e6 / recent_secs;
                }
            }
        }
        by_tenant.retain(|_, s| s.depth + s.delivered + s.failed > 0 || s.worker_seconds > 0.0);
        let mut out: Vec<TenantStats> = by_tenant.into_values().collect();
        out.sort_by(|a, b| {
            b.worker_seconds
                .total_cmp(&a.worker_seconds)
                .then(b.depth.cmp(&a.depth))
        });
        Ok(out)
    }

    /// One tenant's recent activity in `q`: what [`Store::tenant_state`]
    /// says, plus delivered and failed counts, its worker-seconds and the
    /// queue's over `window`, its cost estimate per delivery, and when its
    /// oldest queued envelope was enqueued.
    pub async fn tenant_activity(
        &self,
        q: QueueId,
        tenant: &str,
        window: Duration,
    ) -> Result<TenantActivity> {
        let state = self.tenant_state(q, tenant).await?;
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        let now_ms = s * 1000 + us / 1000;
        let newest = attribution::bucket_of(now_ms);
        let buckets = attribution::buckets(window);
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(keys::tenant(&p, tenant))
            .arg(&["ok", "ko", "e"]);
        pipe.cmd("LINDEX").arg(keys::lane(&p, tenant)).arg(0);
        // under endpoint isolation its lanes are per endpoint (at most 100 looked at)
        pipe.cmd("SRANDMEMBER")
            .arg(keys::queued_endpoints(&p, tenant))
            .arg(100);
        for b in 0..buckets {
            pipe.hgetall(keys::worker_seconds(&p, newest.saturating_sub(b)));
        }
        let replies: Vec<Value> = pipe.query_async(&mut conn).await?;
        let bad = |detail: String| StoreError::Protocol {
            script: "tenant activity",
            detail,
        };
        let counters: Vec<Option<String>> =
            redis::from_redis_value_ref(&replies[0]).map_err(|e| bad(e.to_string()))?;
        let num = |i: usize| {
            counters
                .get(i)
                .cloned()
                .flatten()
                .and_then(|v| v.parse::<f64>().ok())
        };
        let mut activity = TenantActivity {
            state,
            delivered: num(0).unwrap_or(0.0) as u64,
            failed: num(1).unwrap_or(0.0) as u64,
            estimate_s: num(2).map(|us| us / 1e6),
            worker_seconds: 0.0,
            queue_worker_seconds: 0.0,
            oldest_enqueued_ms: None,
            now_ms,
            window,
        };
        for v in &replies[3..] {
            let map: BTreeMap<String, f64> =
                redis::from_redis_value_ref(v).map_err(|e| bad(e.to_string()))?;
            activity.queue_worker_seconds += map.values().sum::<f64>() / 1e6;
            activity.worker_seconds += map.get(tenant).copied().unwrap_or(0.0) / 1e6;
        }
        // lane heads: an envelope stored whole says when it was enqueued,
        // a bare id's record does
        let mut heads: Vec<Vec<u8>> = Vec::new();
        if let Value::BulkString(item) = &replies[1] {
            heads.push(item.clone());
        } else {
            let endpoints: Vec<String> =
                redis::from_redis_value_ref(&replies[2]).map_err(|e| bad(e.to_string()))?;
            if !endpoints.is_empty() {
                let mut pipe = redis::pipe();
                for ep in &endpoints {
                    pipe.cmd("LINDEX")
                        .arg(keys::endpoint_lane(&p, tenant, ep))
                        .arg(0);
                }
                let items: Vec<Option<Vec<u8>>> = pipe.query_async(&mut conn).await?;
                heads.extend(items.into_iter().flatten());
            }
        }
        let mut enqueued: Vec<u64> = Vec::new();
        let mut pipe = redis::pipe();
        let mut bare = 0;
        for item in &heads {
            match keys::lane_item(item) {
                keys::LaneItem::Whole { enqueued_ms, .. } => enqueued.push(enqueued_ms),
                keys::LaneItem::Bare(id) => {
                    bare += 1;
                    pipe.cmd("HGET")
                        .arg(keys::envelope(&p, tenant, &String::from_utf8_lossy(id)))
                        .arg("n");
                }
            }
        }
        if bare > 0 {
            let got: Vec<Option<u64>> = pipe.query_async(&mut conn).await?;
            enqueued.extend(got.into_iter().flatten());
        }
        activity.oldest_enqueued_ms = enqueued.into_iter().min();
        Ok(activity)
    }
}
