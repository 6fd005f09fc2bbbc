//! Administration: ping, the cluster's primaries, running a command on one
//! node, and the capacity simulator's hooks (its virtual clock, and purging
//! its throwaway set). The simulator hooks are used only by `lanekeeper
//! simulate`), on a throwaway set.

use std::collections::BTreeMap;

use redis::Value;

use super::conn::Conn;
use super::reply::{array, int, string};
use super::{keys, Result, Store, StoreError};
use crate::routing::QueueId;

impl Store {
    /// Is Redis answering?
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }

    /// Run `q`'s scripts at the virtual time `ms` instead of Redis TIME,
    /// until [`Store::clear_virtual_clock`]. The scripts read the clock with
    /// the queue's policy (one HMGET they do anyway), so this costs them
    /// nothing; it exists for the capacity simulator, which replays a day
    /// of traffic through the production scripts in seconds. Never set it
    /// on a live queue: leases, retries and breakers would stop aging.
    pub async fn set_virtual_clock(&self, q: QueueId, ms: u64) -> Result<()> {
        let mut conn = self.conn.clone();
        redis::cmd("HSET")
            .arg(keys::conf(&self.queue_prefix(q)))
            .arg("clock")
            .arg(ms)
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Back to Redis TIME for `q`.
    pub async fn clear_virtual_clock(&self, q: QueueId) -> Result<()> {
        let mut conn = self.conn.clone();
        redis::cmd("HDEL")
            .arg(keys::conf(&self.queue_prefix(q)))
            .arg("clock")
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// Delete every key of this set (its queues and its routing table):
    /// the simulator's cleanup of its throwaway set. Returns how many.
    pub async fn purge_set(&self) -> Result<u64> {
        let mut removed = 0u64;
        // `lk:{ns/name/<queue>}...` and `lk:{ns/name}:...`
        for pattern in [
            keys::set_queues_pattern(&self.set),
            keys::set_keys_pattern(&self.set),
        ] {
            for node in self.scan_targets().await? {
                let mut cursor = 0u64;
                loop {
                    let mut scan = redis::cmd("SCAN");
                    scan.arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000);
                    let (next, keys): (u64, Vec<String>) = redis::from_redis_value(
                        self.on_node(node.as_ref(), scan).await?,
                    )
                    .map_err(|e| StoreError::Protocol {
                        script: "scan",
                        detail: e.to_string(),
                    })?;
                    if !keys.is_empty() {
                        // The cluster client splits a many-key UNLINK by
                        // slot and adds up the counts.
                        let mut conn = self.conn.clone();
                        let n: u64 = redis::cmd("UNLINK")
                            .arg(&keys)
                            .query_async(&mut conn)
                            .await?;
                        removed += n;
                    }
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
        }
        Ok(removed)
    }

    /// The primaries of the cluster as (host, port), from `CLUSTER SLOTS`;
    /// on one server, that server (`None`). A key-space walk (SCAN) has to
    /// visit each of them.
    async fn scan_targets(&self) -> Result<Vec<Option<(String, u16)>>> {
        if !self.is_cluster() {
            return Ok(vec![None]);
        }
        Ok(self
            .cluster_primaries()
            .await?
            .into_iter()
            .map(|(host, port, _)| Some((host, port)))
            .collect())
    }

    /// The cluster's primaries as (host, port, slots owned), from `CLUSTER
    /// SLOTS`; empty on one server.
    pub async fn cluster_primaries(&self) -> Result<Vec<(String, u16, u32)>> {
        if !self.is_cluster() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let ranges: Vec<Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await?;
        let mut primaries: BTreeMap<(String, u16), u32> = BTreeMap::new();
        for range in ranges {
            let items = array("cluster slots", range)?;
            if let [start, end, primary, ..] = items.as_slice() {
                let node = array("cluster slots", primary.clone())?;
                if let [host, port, ..] = node.as_slice() {
                    let key = (string(host), int(port) as u16);
                    *primaries.entry(key).or_default() += (int(end) + 1 - int(start)) as u32;
                }
            }
        }
        Ok(primaries.into_iter().map(|((h, p), n)| (h, p, n)).collect())
    }

    /// Run `cmd` on one cluster node (`Some((host, port))`) or, with
    /// `None`, on the server.
    pub(super) async fn on_node(
        &self,
        node: Option<&(String, u16)>,
        cmd: redis::Cmd,
    ) -> Result<Value> {
        match (&self.conn, node) {
            (Conn::Cluster(c), Some((host, port))) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                Ok(c.clone().route_command(cmd, route).await?)
            }
            _ => {
                let mut conn = self.conn.clone();
                Ok(cmd.query_async(&mut conn).await?)
            }
        }
    }
}
