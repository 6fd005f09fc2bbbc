//! The set's routing table in Redis: reading it, the epoch mark and
//! durability, shard count and pins, a queue's routing fence, and the
//! tenants resident in a queue.

use std::collections::BTreeMap;
use std::time::Duration;

use super::library::{function_missing, load_library, Func};
use super::reply::routing_update_reply;
use super::{keys, Result, Store, StoreError};
use crate::routing::{QueueId, RoutingTable};

impl Store {
    /// Read the set's routing table.
    pub async fn routing(&self) -> Result<RoutingTable> {
        let mut conn = self.conn.clone();
        let fields: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(self.routing_key())
            .query_async(&mut conn)
            .await?;
        let mut table = RoutingTable::default();
        for (k, v) in fields {
            let bad = |detail: String| StoreError::Protocol {
                script: "routing table",
                detail,
            };
            match k.as_str() {
                "shards" => table.shards = v.parse().map_err(|_| bad(format!("shards = {v:?}")))?,
                "version" => {
                    table.version = v.parse().map_err(|_| bad(format!("version = {v:?}")))?
                }
                "epoch" => table.epoch = Some(v),
                "replicated" => {
                    let ms: u64 = v.parse().map_err(|_| bad(format!("replicated = {v:?}")))?;
                    table.replicated = (ms > 0).then(|| Duration::from_millis(ms));
                }
                _ => {
                    if let Some(tenant) = k.strip_prefix("pin:") {
                        let q = v
                            .parse()
                            .map_err(|e| bad(format!("pin of {tenant}: {e}")))?;
                        table.pins.insert(tenant.to_string(), q);
                    }
                }
            }
        }
        Ok(table)
    }

    async fn routing_update(&self, op: &str, a: &str, b: &str) -> Result<u64> {
        let v = self
            .call(
                Func::RoutingUpdate,
                &self.routing_key(),
                &[op.as_bytes(), a.as_bytes(), b.as_bytes()],
            )
            .await?;
        Ok(routing_update_reply(&v))
    }

    /// Mark this Redis's state with `epoch` unless it is marked already;
    /// returns the mark Redis holds. The controller writes it last when it
    /// writes (or restores) a routing table, so a table without it is one
    /// Redis lost.
    pub async fn mark_epoch(&self, epoch: &str) -> Result<String> {
        let mut conn = self.conn.clone();
        let (_, held): (u8, String) = redis::pipe()
            .atomic()
            .cmd("HSETNX")
            .arg(self.routing_key())
            .arg("epoch")
            .arg(epoch)
            .cmd("HGET")
            .arg(self.routing_key())
            .arg("epoch")
            .query_async(&mut conn)
            .await?;
        Ok(held)
    }

    /// Write the set's durability into its routing table, where producers
    /// read it: `Some(timeout)` for `Replicated` (wait up to `timeout` for a
    /// replica), `None` for `Fast`. Not a routing change: the version stays.
    pub async fn set_durability(&self, replicated: Option<Duration>) -> Result<()> {
        let ms = replicated.map(|d| d.as_millis().max(1) as u64).unwrap_or(0);
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(self.routing_key())
            .arg("replicated")
            .arg(ms)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Is the routing table there (a shard count written)? One HEXISTS,
    /// cheap enough to poll.
    pub async fn routing_present(&self) -> Result<bool> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("HEXISTS")
            .arg(self.routing_key())
            .arg("shards")
            .query_async(&mut conn)
            .await?)
    }

    /// Set the shard count; returns the new version (unchanged if equal).
    pub async fn set_shards(&self, shards: u16) -> Result<u64> {
        self.routing_update("shards", &shards.to_string(), "").await
    }

    /// Pin a tenant to a queue; returns the new version.
    pub async fn pin(&self, tenant: &str, q: QueueId) -> Result<u64> {
        self.routing_update("pin", tenant, &q.to_string()).await
    }

    /// Remove a tenant's pin; returns the new version.
    pub async fn unpin(&self, tenant: &str) -> Result<u64> {
        self.routing_update("unpin", tenant, "").await
    }

    /// Fence `q` at routing version `version`: from now on an enqueue routed
    /// by an older table answers STALE (the caller refreshes its table). A
    /// reshard fences every shard queue before it changes the shard count,
    /// so no producer still hashing by the old count can enqueue anywhere.
    /// Never lowers an existing fence.
    pub async fn fence_routing(&self, q: QueueId, version: u64) -> Result<()> {
        let key = keys::conf(&self.queue_prefix(q));
        let mut conn = self.conn.clone();
        let current: Option<u64> = redis::cmd("HGET")
            .arg(&key)
            .arg("minroute")
            .query_async(&mut conn)
            .await?;
        if current.unwrap_or(0) < version {
            redis::cmd("HSET")
                .arg(&key)
                .arg("minroute")
                .arg(version)
                .query_async::<()>(&mut conn)
                .await?;
        }
        Ok(())
    }

    /// Pin many tenants at once (one pipelined round trip per chunk); each
    /// pin is its own idempotent update, so a partial run can be repeated.
    pub async fn pin_many(&self, pins: &[(String, QueueId)]) -> Result<()> {
        for chunk in pins.chunks(500) {
            let mut pipe = redis::pipe();
            for (tenant, q) in chunk {
                pipe.cmd("FCALL")
                    .arg(Func::RoutingUpdate.name(self.lib))
                    .arg(1)
                    .arg(self.routing_key())
                    .arg("pin")
                    .arg(tenant)
                    .arg(q.to_string())
                    .ignore();
            }
            let mut conn = self.conn.clone();
            match pipe.query_async::<()>(&mut conn).await {
                Err(e) if function_missing(&e) => {
                    load_library(&mut conn, self.lib).await?;
                    pipe.query_async::<()>(&mut conn).await?
                }
                other => other?,
            }
        }
        Ok(())
    }

    /// The tenants that live in `q`: they have had work here and are not
    /// marked as moved away (a reshard plans its moves from these).
    pub async fn residents(&self, q: QueueId) -> Result<Vec<String>> {
        let p = self.queue_prefix(q);
        let mut conn = self.conn.clone();
        let tenants: Vec<String> = redis::cmd("SMEMBERS")
            .arg(keys::tenants(&p))
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(tenants.len());
        for chunk in tenants.chunks(1000) {
            let mut pipe = redis::pipe();
            for t in chunk {
                pipe.hget(keys::tenant(&p, t), "m");
            }
            let moved: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
            out.extend(
                chunk
                    .iter()
                    .zip(moved)
                    .filter(|(_, m)| m.as_deref().unwrap_or("").is_empty())
                    .map(|(t, _)| t.clone()),
            );
        }
        Ok(out)
    }
}
