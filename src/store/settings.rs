//! The Redis settings that decide whether lanekeeper's data survives:
//! the eviction policy, persistence and, on a cluster, whether one failed
//! primary stops every queue. Read with `CONFIG GET` where the server lets
//! us; managed Redis often refuses it (renamed command, or an ACL without
//! `+config|get`), and then `INFO` tells part of the story, said so.

use redis::Value;

use super::{Result, Store};

/// What one Redis server (or cluster primary) says about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisSettings {
    /// `host:port` of a cluster primary; empty on one server.
    pub node: String,
    /// Read with `CONFIG GET` (else from `INFO`).
    pub via_config: bool,
    /// Why `CONFIG GET` was not used: its error, when it failed.
    pub config_refused: Option<String>,
    pub version: Option<String>,
    pub maxmemory_policy: Option<String>,
    /// Bytes; 0: no limit.
    pub maxmemory: Option<u64>,
    pub appendonly: Option<bool>,
    /// The RDB snapshot schedule (`save`); empty: none. `None`: unknown
    /// (INFO does not show it).
    pub save: Option<String>,
    /// On a cluster: `cluster-require-full-coverage` (unknown from INFO).
    pub cluster_require_full_coverage: Option<bool>,
    pub cluster: bool,
}

/// The one policy under which Redis never drops a key to make room.
pub const SAFE_POLICY: &str = "noeviction";

impl RedisSettings {
    fn at(&self) -> String {
        if self.node.is_empty() {
            String::new()
        } else {
            format!(" on {}", self.node)
        }
    }

    /// Why the eviction policy loses data, when it does: a message naming
    /// the setting and the fix.
    pub fn eviction_problem(&self) -> Option<String> {
        let policy = self.maxmemory_policy.as_deref()?;
        if policy == SAFE_POLICY {
            return None;
        }
        let what = if policy.starts_with("volatile-") {
            "evicts keys that have a TTL first: the idempotency records, so producer retries are delivered twice, and then lease and breaker keys"
        } else {
            "may evict any key: a queued envelope, a tenant's ring entry or lease, or the routing table, which stalls tenants for good"
        };
        Some(format!(
            "Redis{} has maxmemory-policy {policy}, which {what}; set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, or the parameter group / Helm value of a managed Redis) and size maxmemory for the backlog",
            self.at()
        ))
    }

    /// `Some(false)`: neither AOF nor RDB snapshots, so a restart loses
    /// every queued envelope. `None`: cannot tell (INFO without CONFIG GET
    /// shows AOF but not the RDB schedule).
    pub fn persistent(&self) -> Option<bool> {
        match (self.appendonly, self.save.as_deref()) {
            (Some(true), _) => Some(true),
            (_, Some(s)) if !s.trim().is_empty() => Some(true),
            (Some(false), Some(_)) => Some(false),
            _ => None,
        }
    }

    /// One line of what was read and how, for a condition message and logs.
    pub fn summary(&self) -> String {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
        let flag = |v: Option<bool>| match v {
            Some(true) => "yes".to_string(),
            Some(false) => "no".to_string(),
            None => "unknown".to_string(),
        };
        let mut s = format!(
            "Redis {}{}: maxmemory-policy {}, appendonly {}, save {}",
            show(&self.version),
            self.at(),
            show(&self.maxmemory_policy),
            flag(self.appendonly),
            match &self.save {
                Some(v) if v.trim().is_empty() => "\"\" (no RDB snapshots)".to_string(),
                Some(v) => format!("{v:?}"),
                None => "unknown".into(),
            }
        );
        if self.cluster {
            s.push_str(&format!(
                ", cluster-require-full-coverage {}",
                flag(self.cluster_require_full_coverage)
            ));
            if self.cluster_require_full_coverage == Some(true) {
                s.push_str(" (one primary down with no replica stops every queue of the set; no keeps the other queues running)");
            }
        }
        match &self.config_refused {
            Some(e) => s.push_str(&format!(
                "; read from INFO because CONFIG GET was refused ({e}): the RDB schedule{} cannot be checked",
                if self.cluster { " and cluster-require-full-coverage" } else { "" }
            )),
            None => s.push_str("; read with CONFIG GET"),
        }
        s
    }
}

/// The most important finding over every node: an evicting node first,
/// then one without persistence, then one whose persistence is unknown.
pub fn worst(all: &[RedisSettings]) -> Option<&RedisSettings> {
    all.iter()
        .find(|s| s.eviction_problem().is_some())
        .or_else(|| all.iter().find(|s| s.persistent() == Some(false)))
        .or_else(|| all.iter().find(|s| s.persistent().is_none()))
        .or_else(|| all.first())
}

/// Read the settings once at start and log what they mean: a warning for
/// an evicting policy or a Redis without persistence, a note when
/// `CONFIG GET` is refused. Never fails: a Redis that cannot tell is logged.
pub async fn log_at_start(store: &Store, component: &str) -> Vec<RedisSettings> {
    match store.redis_settings().await {
        Ok(all) => {
            for s in &all {
                if let Some(problem) = s.eviction_problem() {
                    tracing::warn!(component, reason = "RedisEvictionPolicy", "{problem}");
                }
                match s.persistent() {
                    Some(false) => tracing::warn!(
                        component,
                        reason = "RedisNotPersistent",
                        "{}: a restart of Redis loses every queued envelope",
                        s.summary()
                    ),
                    _ => tracing::info!(component, "{}", s.summary()),
                }
            }
            all
        }
        Err(e) => {
            tracing::warn!(component, error = %e, "cannot read the Redis settings (eviction policy, persistence)");
            Vec::new()
        }
    }
}

fn text(v: &Value) -> String {
    super::string(v)
}

/// `CONFIG GET a b c` as (name, value) pairs (RESP2 flat list or RESP3 map).
fn pairs(v: Value) -> Vec<(String, String)> {
    match v {
        Value::Array(items) => items
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| (text(&c[0]), text(&c[1])))
            .collect(),
        Value::Map(items) => items.iter().map(|(k, v)| (text(k), text(v))).collect(),
        _ => Vec::new(),
    }
}

/// The `field:value` lines of an INFO reply.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::trim)
    })
}

impl Store {
    /// The settings of the Redis server, or of every primary of a cluster.
    /// An error only when neither `CONFIG GET` nor `INFO` answered.
    pub async fn redis_settings(&self) -> Result<Vec<RedisSettings>> {
        let nodes: Vec<Option<(String, u16)>> = if self.is_cluster() {
            self.cluster_primaries()
                .await?
                .into_iter()
                .map(|(h, p, _)| Some((h, p)))
                .collect()
        } else {
            vec![None]
        };
        let mut out = Vec::with_capacity(nodes.len());
        for node in nodes {
            out.push(self.node_settings(node.as_ref()).await?);
        }
        Ok(out)
    }

    async fn node_settings(&self, node: Option<&(String, u16)>) -> Result<RedisSettings> {
        let mut s = RedisSettings {
            node: node.map(|(h, p)| format!("{h}:{p}")).unwrap_or_default(),
            cluster: self.is_cluster(),
            ..Default::default()
        };
        // INFO first: the version, and the fallback for everything else.
        let mut info_cmd = redis::cmd("INFO");
        info_cmd.arg("server").arg("memory").arg("persistence");
        let info = self.on_node(node, info_cmd).await.map(|v| text(&v));
        if let Ok(info) = &info {
            s.version = info_field(info, "redis_version").map(str::to_string);
        }
        let mut config = redis::cmd("CONFIG");
        config
            .arg("GET")
            .arg("maxmemory-policy")
            .arg("maxmemory")
            .arg("appendonly")
            .arg("save")
            .arg("cluster-require-full-coverage");
        match self.on_node(node, config).await {
            Ok(v) => {
                s.via_config = true;
                for (k, v) in pairs(v) {
                    match k.as_str() {
                        "maxmemory-policy" => s.maxmemory_policy = Some(v),
                        "maxmemory" => s.maxmemory = v.parse().ok(),
                        "appendonly" => s.appendonly = Some(v == "yes"),
                        "save" => s.save = Some(v),
                        "cluster-require-full-coverage" if s.cluster => {
                            s.cluster_require_full_coverage = Some(v == "yes")
                        }
                        _ => {}
                    }
                }
            }
            Err(e) => {
                // Renamed away (ElastiCache, Memorystore) or not in the ACL.
                let info = info.map_err(|_| e.clone_message())?;
                s.config_refused = Some(e.short());
                s.maxmemory_policy = info_field(&info, "maxmemory_policy").map(str::to_string);
                s.maxmemory = info_field(&info, "maxmemory").and_then(|v| v.parse().ok());
                s.appendonly = info_field(&info, "aof_enabled").map(|v| v == "1");
            }
        }
        Ok(s)
    }
}

trait ShortError {
    fn short(&self) -> String;
    fn clone_message(&self) -> super::StoreError;
}

impl ShortError for super::StoreError {
    /// The server's answer, without the client's decoration.
    fn short(&self) -> String {
        let s = self.to_string();
        let s = s.strip_prefix("redis: ").unwrap_or(&s).to_string();
        s.chars().take(200).collect()
    }

    fn clone_message(&self) -> super::StoreError {
        super::StoreError::Protocol {
            script: "redis settings",
            detail: format!("neither CONFIG GET nor INFO answered: {}", self.short()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(policy: &str, aof: Option<bool>, save: Option<&str>) -> RedisSettings {
        RedisSettings {
            maxmemory_policy: Some(policy.into()),
            appendonly: aof,
            save: save.map(str::to_string),
            via_config: true,
            ..Default::default()
        }
    }

    #[test]
    fn only_noeviction_is_safe_and_the_message_names_setting_and_fix() {
        assert_eq!(
            with("noeviction", Some(true), None).eviction_problem(),
            None
        );
        for p in [
            "volatile-lru",
            "allkeys-lru",
            "allkeys-random",
            "volatile-ttl",
        ] {
            let m = with(p, Some(true), None).eviction_problem().unwrap();
            assert!(m.contains(&format!("maxmemory-policy {p}")), "{m}");
            assert!(m.contains("set maxmemory-policy noeviction"), "{m}");
        }
        assert!(with("volatile-lfu", None, None)
            .eviction_problem()
            .unwrap()
            .contains("idempotency"));
    }

    #[test]
    fn persistence_is_aof_or_a_snapshot_schedule_and_unknown_is_said() {
        assert_eq!(
            with("noeviction", Some(true), Some("")).persistent(),
            Some(true)
        );
        assert_eq!(
            with("noeviction", Some(false), Some("3600 1")).persistent(),
            Some(true)
        );
        assert_eq!(
            with("noeviction", Some(false), Some("")).persistent(),
            Some(false)
        );
        // From INFO: AOF off, the RDB schedule unknown.
        let mut s = with("noeviction", Some(false), None);
        s.config_refused = Some("ERR unknown command 'CONFIG'".into());
        assert_eq!(s.persistent(), None);
        assert!(
            s.summary().contains("CONFIG GET was refused"),
            "{}",
            s.summary()
        );
    }
}
