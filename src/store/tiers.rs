//! Tier assignments of a set's tenants, in three set-level hashes (tenant ->
//! tier): `lk:{<namespace>/<set>}:tiers:api`, written by the ingest admin
//! API; `lk:{<namespace>/<set>}:tiers:spec`, written by the controller from
//! the ShardSet's `spec.tenants[].tier`; and `lk:{<namespace>/<set>}:tiers`,
//! synced by the controller from the ShardSet's ConfigMap
//! (`scheduler.tierAssignments`). The API's wins, then the spec's.
//! Ingest reads a tenant's tier here (cached) and passes it with each
//! enqueue, which keeps it in the tenant's queue state (`tr`), where the
//! scheduler reads it with the state it reads anyway.
//!
//! Every write is chunked ([`TIER_CHUNK`] fields per command) and a sync
//! reads the hash with HSCAN, so no call holds Redis for long at 40,000
//! tenants.

use std::collections::{BTreeMap, HashMap};

use super::{keys, Result, Store};

/// Fields per HSET, HDEL or HSCAN page of the tier hashes.
pub const TIER_CHUNK: usize = 1000;

/// Where a tenant's tier comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierSources {
    /// Set through the ingest admin API.
    pub api: Option<String>,
    /// From the ShardSet's `spec.tenants[].tier`.
    pub spec: Option<String>,
    /// From the ShardSet's tier ConfigMap.
    pub config_map: Option<String>,
}

impl TierSources {
    /// The tier in force: the API's, else the spec's, else the ConfigMap's.
    pub fn effective(&self) -> Option<&str> {
        self.api
            .as_deref()
            .or(self.spec.as_deref())
            .or(self.config_map.as_deref())
    }
}

/// What a ConfigMap sync changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierSync {
    /// The source was already synced: nothing was read or written.
    pub unchanged: bool,
    pub set: usize,
    pub removed: usize,
}

impl Store {
    /// The tier sources of one tenant.
    pub async fn tier_sources(&self, tenant: &str) -> Result<TierSources> {
        let mut conn = self.conn.clone();
        let (api, spec, config_map): (Option<String>, Option<String>, Option<String>) =
            redis::pipe()
                .hget(keys::tiers_api(&self.set), tenant)
                .hget(keys::tiers_spec(&self.set), tenant)
                .hget(keys::tiers(&self.set), tenant)
                .query_async(&mut conn)
                .await?;
        Ok(TierSources {
            api,
            spec,
            config_map,
        })
    }

    /// The tier in force of each of `tenants` (the API's, else the spec's,
    /// else the ConfigMap's), in order: three HMGETs in one round trip.
    pub async fn tenant_tiers(&self, tenants: &[&str]) -> Result<Vec<Option<String>>> {
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET")
            .arg(keys::tiers_api(&self.set))
            .arg(tenants);
        pipe.cmd("HMGET")
            .arg(keys::tiers_spec(&self.set))
            .arg(tenants);
        pipe.cmd("HMGET").arg(keys::tiers(&self.set)).arg(tenants);
        type Column = Vec<Option<String>>;
        let (api, spec, cm): (Column, Column, Column) = pipe.query_async(&mut conn).await?;
        Ok(api
            .into_iter()
            .zip(spec)
            .zip(cm)
            .map(|((a, s), c)| a.or(s).or(c))
            .collect())
    }

    /// Make the spec's tier hash hold exactly `want` (the ShardSet's
    /// `spec.tenants[].tier`, at most 1000): replaced in one MULTI, so
    /// ingest never reads it half written.
    pub async fn put_spec_tiers(&self, want: &BTreeMap<String, String>) -> Result<()> {
        let key = keys::tiers_spec(&self.set);
        let mut pipe = redis::pipe();
        pipe.atomic().del(&key).ignore();
        let pairs: Vec<(&str, &str)> = want.iter().map(|(t, v)| (t.as_str(), v.as_str())).collect();
        for chunk in pairs.chunks(TIER_CHUNK) {
            pipe.hset_multiple(&key, chunk).ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    /// Write API assignments in order (`None` clears the tenant's API
    /// assignment; its ConfigMap one, if any, then applies): a later entry
    /// for the same tenant wins. Chunked, one pipeline.
    pub async fn put_api_tiers(&self, assignments: &[(String, Option<String>)]) -> Result<()> {
        if assignments.is_empty() {
            return Ok(());
        }
        // the last word on each tenant, so the chunks' order does not matter
        let mut last: HashMap<&str, Option<&str>> = HashMap::with_capacity(assignments.len());
        for (t, tier) in assignments {
            last.insert(t, tier.as_deref());
        }
        let (set, clear): (Vec<_>, Vec<_>) = last.into_iter().partition(|(_, v)| v.is_some());
        let key = keys::tiers_api(&self.set);
        let mut pipe = redis::pipe();
        for chunk in set.chunks(TIER_CHUNK) {
            let pairs: Vec<(&str, &str)> = chunk
                .iter()
                .map(|(t, v)| (*t, v.expect("partitioned")))
                .collect();
            pipe.hset_multiple(&key, &pairs).ignore();
        }
        for chunk in clear.chunks(TIER_CHUNK) {
            let tenants: Vec<&str> = chunk.iter().map(|(t, _)| *t).collect();
            pipe.hdel(&key, tenants).ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }

    /// Make the ConfigMap hash hold exactly `want`, unless `source` (the
    /// ConfigMap's name and resourceVersion) is what was synced last. Reads
    /// the hash a page at a time (HSCAN), then writes what changed and
    /// removes what is no longer listed, in chunks; the source is recorded
    /// last, so a sync that died halfway runs again.
    pub async fn sync_config_tiers(
        &self,
        source: &str,
        want: &BTreeMap<String, String>,
    ) -> Result<TierSync> {
        let key = keys::tiers(&self.set);
        let marker = keys::tiers_synced(&self.set);
        let mut conn = self.conn.clone();
        let synced: Option<String> = redis::cmd("GET")
            .arg(&marker)
            .query_async(&mut conn)
            .await?;
        if synced.as_deref() == Some(source) {
            return Ok(TierSync {
                unchanged: true,
                ..Default::default()
            });
        }
        let mut have: HashMap<String, String> = HashMap::new();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                .arg(&key)
                .arg(cursor)
                .arg("COUNT")
                .arg(TIER_CHUNK)
                .query_async(&mut conn)
                .await?;
            have.extend(page);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        let changed: Vec<(&str, &str)> = want
            .iter()
            .filter(|(t, v)| have.get(t.as_str()) != Some(*v))
            .map(|(t, v)| (t.as_str(), v.as_str()))
            .collect();
        let removed: Vec<&str> = have
            .keys()
            .filter(|t| !want.contains_key(t.as_str()))
            .map(String::as_str)
            .collect();
        let mut pipe = redis::pipe();
        for chunk in changed.chunks(TIER_CHUNK) {
            pipe.hset_multiple(&key, chunk).ignore();
        }
        for chunk in removed.chunks(TIER_CHUNK) {
            pipe.hdel(&key, chunk).ignore();
        }
        pipe.set(&marker, source).ignore();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(TierSync {
            unchanged: false,
            set: changed.len(),
            removed: removed.len(),
        })
    }

    /// The source (`<ConfigMap>/<resourceVersion>`) last synced into the
    /// ConfigMap hash, and how many tenants that hash holds.
    pub async fn config_tiers_state(&self) -> Result<(Option<String>, u64)> {
        let mut conn = self.conn.clone();
        let state: (Option<String>, u64) = redis::pipe()
            .get(keys::tiers_synced(&self.set))
            .hlen(keys::tiers(&self.set))
            .query_async(&mut conn)
            .await?;
        Ok(state)
    }

    /// Drop the ConfigMap hash and its sync record (the set no longer names
    /// a ConfigMap): UNLINK frees it off Redis's main thread. False if there
    /// was nothing to drop.
    pub async fn clear_config_tiers(&self) -> Result<bool> {
        let mut conn = self.conn.clone();
        let n: u64 = redis::cmd("UNLINK")
            .arg(keys::tiers(&self.set))
            .arg(keys::tiers_synced(&self.set))
            .query_async(&mut conn)
            .await?;
        Ok(n > 0)
    }
}
