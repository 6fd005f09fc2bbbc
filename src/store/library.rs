//! The Lua scripts as one Redis Functions library: which functions it has
//! ([`Func`]), how it is built from `lua/*.lua` and named by a hash of its
//! source, and how it is loaded into Redis.

use std::sync::LazyLock;

use redis::Value;

use super::conn::Conn;
use super::Result;

/// One data-plane operation: a function of the [`Library`].
#[derive(Clone, Copy, Debug)]
pub(super) enum Func {
    Enqueue,
    Lease,
    Ack,
    AckLease,
    LeaseBatch,
    Release,
    Nack,
    Maintain,
    Pause,
    Status,
    MarkMoved,
    Resume,
    ExportHold,
    Import,
    TrimHold,
    ReplayDead,
    Claims,
    RoutingUpdate,
    Gate,
    UserPause,
    Purge,
    Sweep,
}

impl Func {
    const ALL: [Func; 22] = [
        Func::Enqueue,
        Func::Lease,
        Func::Ack,
        Func::AckLease,
        Func::LeaseBatch,
        Func::Release,
        Func::Nack,
        Func::Maintain,
        Func::Pause,
        Func::Status,
        Func::MarkMoved,
        Func::Resume,
        Func::ExportHold,
        Func::Import,
        Func::TrimHold,
        Func::ReplayDead,
        Func::Claims,
        Func::RoutingUpdate,
        Func::Gate,
        Func::UserPause,
        Func::Purge,
        Func::Sweep,
    ];

    /// The function's name within the library, and its Lua body.
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Func::Enqueue => ("enqueue", include_str!("lua/enqueue.lua")),
            Func::Lease => ("lease", include_str!("lua/lease.lua")),
            Func::Ack => ("ack", include_str!("lua/ack.lua")),
            Func::AckLease => ("ack_lease", include_str!("lua/ack_lease.lua")),
            Func::LeaseBatch => ("lease_batch", include_str!("lua/lease_batch.lua")),
            Func::Release => ("release", include_str!("lua/release.lua")),
            Func::Nack => ("nack", include_str!("lua/nack.lua")),
            Func::Maintain => ("maintain", include_str!("lua/maintain.lua")),
            Func::Pause => ("pause", include_str!("lua/pause.lua")),
            Func::Status => ("status", include_str!("lua/status.lua")),
            Func::MarkMoved => ("mark_moved", include_str!("lua/mark_moved.lua")),
            Func::Resume => ("resume", include_str!("lua/resume.lua")),
            Func::ExportHold => ("export_hold", include_str!("lua/export_hold.lua")),
            Func::Import => ("import", include_str!("lua/import.lua")),
            Func::TrimHold => ("trim_hold", include_str!("lua/trim_hold.lua")),
            Func::ReplayDead => ("replay_dead", include_str!("lua/replay_dead.lua")),
            Func::Claims => ("claims", include_str!("lua/claims.lua")),
            Func::RoutingUpdate => ("routing_update", include_str!("lua/routing_update.lua")),
            Func::Gate => ("gate", include_str!("lua/gate.lua")),
            Func::UserPause => ("user_pause", include_str!("lua/user_pause.lua")),
            Func::Purge => ("purge", include_str!("lua/purge.lua")),
            Func::Sweep => ("sweep", include_str!("lua/sweep.lua")),
        }
    }

    /// Per-queue functions bind their queue first (`begin` in common.lua);
    /// `routing_update` works on the set's routing hash.
    pub(super) fn per_queue(self) -> bool {
        !matches!(self, Func::RoutingUpdate | Func::Gate)
    }

    pub(super) fn name(self, lib: &Library) -> String {
        lib.function_name(self.source().0)
    }
}

/// Every script, as one Redis Functions library (Redis 7+). Its helpers'
/// closures are built once, when the library loads, instead of on every call
/// as with EVALSHA (that cost about 4 µs per call, a tenth of a lease+ack).
///
/// The library's name carries a hash of its source, so two lanekeeper
/// versions sharing one Redis during a rolling upgrade each call their own
/// functions. It is loaded on first use and again whenever Redis answers
/// that a function is missing (after a restart without persistence, or on a
/// new cluster node); on a cluster it is loaded on every primary.
///
/// There are two variants of the library, differing only in how a queue
/// wakes idle workers: on one server `PUBLISH`, on a cluster `SPUBLISH`
/// (sharded pub/sub: the message stays within the shard that owns the
/// queue's slot instead of crossing the whole cluster bus). A Redis is either
/// a cluster or not, so the two never meet on one server.
pub(super) struct Library {
    name: String,
    code: String,
}

impl Library {
    /// The function of script `script` in this library.
    pub(super) fn function_name(&self, script: &str) -> String {
        format!("{}_{script}", self.name)
    }
}

const COMMON: &str = include_str!("lua/common.lua");
const DELIVER: &str = include_str!("lua/deliver.lua");

/// The suffix of the second key every per-queue call declares: a key of the
/// queue's slot that no script ever writes (see the module documentation).
pub const SLOT_GUARD: &str = ":~slotguard";

fn build_library(cluster: bool) -> Library {
    use blake2::digest::{Update, VariableOutput};
    let common = if cluster {
        COMMON.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    } else {
        COMMON.to_string()
    };
    let mut hasher = blake2::Blake2bVar::new(8).expect("8 is a valid blake2b output size");
    hasher.update(common.as_bytes());
    hasher.update(DELIVER.as_bytes());
    for f in Func::ALL {
        let (name, body) = f.source();
        hasher.update(name.as_bytes());
        hasher.update(body.as_bytes());
    }
    let mut digest = [0u8; 8];
    hasher
        .finalize_variable(&mut digest)
        .expect("the buffer has the output size");
    let name = format!("lanekeeper_{:016x}", u64::from_be_bytes(digest));
    let mut code = format!("#!lua name={name}\n{common}\n{DELIVER}\n");
    for f in Func::ALL {
        let (fname, body) = f.source();
        let begin = if f.per_queue() { "begin(KEYS)\n" } else { "" };
        code.push_str(&format!(
            "redis.register_function('{name}_{fname}', function(KEYS, ARGV)\n{begin}{body}\nend)\n"
        ));
    }
    Library { name, code }
}

pub(super) static LIBRARY: LazyLock<Library> = LazyLock::new(|| build_library(false));
pub(super) static CLUSTER_LIBRARY: LazyLock<Library> = LazyLock::new(|| build_library(true));

/// Redis answered that the called function does not exist (yet).
pub(super) fn function_missing(e: &redis::RedisError) -> bool {
    e.to_string().contains("Function not found")
}

/// Load the library; a copy already there (another process won) is fine.
/// On a cluster, `FUNCTION LOAD` goes to every primary (the cluster client
/// routes it so); `REPLACE` makes a primary that has it already (identical
/// code: the name is its hash) no error.
pub(super) async fn load_library(conn: &mut Conn, lib: &Library) -> Result<()> {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD");
    if matches!(conn, Conn::Cluster(_)) {
        cmd.arg("REPLACE");
    }
    let loaded: redis::RedisResult<Value> = cmd.arg(&lib.code).query_async(conn).await;
    match loaded {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("already exists") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_bucket_width_is_the_policys() {
        let line = format!(
            "local BUCKET_MS = {}\n",
            crate::policy::attribution::BUCKET_SECONDS * 1000
        );
        assert!(include_str!("lua/common.lua").contains(&line), "{line}");
    }

    #[test]
    fn the_batch_scripts_bound_is_the_stores() {
        let src = include_str!("lua/lease_batch.lua");
        let max = super::super::LEASE_BATCH_MAX;
        for bound in [format!("k > {max}"), format!("n > {max}")] {
            assert!(src.contains(&bound), "lease_batch.lua checks {bound}");
        }
    }

    #[test]
    fn the_cluster_library_wakes_workers_by_sharded_publish() {
        assert!(LIBRARY.code.contains("redis.call('PUBLISH',"));
        assert!(!LIBRARY.code.contains("redis.call('SPUBLISH',"));
        assert!(CLUSTER_LIBRARY.code.contains("redis.call('SPUBLISH',"));
        assert!(!CLUSTER_LIBRARY.code.contains("redis.call('PUBLISH',"));
        assert_ne!(LIBRARY.name, CLUSTER_LIBRARY.name);
    }

    /// The `local function` names a helper file defines, in order.
    fn helpers_of(src: &str) -> Vec<&str> {
        src.lines()
            .filter_map(|l| l.strip_prefix("local function "))
            .filter_map(|r| r.split(|c: char| !(c.is_alphanumeric() || c == '_')).next())
            .collect()
    }

    /// A script's code without its comments (string literals kept).
    fn code(src: &str) -> String {
        let mut out = String::new();
        for line in src.lines() {
            let mut quote: Option<char> = None;
            let mut chars = line.chars().peekable();
            while let Some(c) = chars.next() {
                match quote {
                    Some(_) if c == '\\' => {
                        out.push(c);
                        if let Some(n) = chars.next() {
                            out.push(n);
                        }
                    }
                    Some(q) => {
                        if c == q {
                            quote = None;
                        }
                        out.push(c);
                    }
                    None => {
                        if c == '-' && chars.peek() == Some(&'-') {
                            break;
                        }
                        if c == '\'' || c == '"' {
                            quote = Some(c);
                        }
                        out.push(c);
                    }
                }
            }
            out.push('\n');
        }
        out
    }

    /// Does `code` call `name` (`name(`, not `xname(`, `x.name(` or `x:name(`)?
    fn calls(code: &str, name: &str) -> bool {
        code.match_indices(name).any(|(i, _)| {
            let before = code[..i].chars().next_back();
            code[i + name.len()..].trim_start().starts_with('(')
                && !before.is_some_and(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | ':'))
        })
    }

    /// The helpers a script's header lists after `-- Helpers (<file>): `
    /// (continued on lines starting `--   `); `None` without such a line.
    fn listed(src: &str, file: &str) -> Option<Vec<String>> {
        let tag = format!("-- Helpers ({file}): ");
        let mut text: Option<String> = None;
        for l in src.lines().take_while(|l| l.starts_with("--")) {
            if let Some(rest) = l.strip_prefix(&tag) {
                text = Some(rest.to_string());
            } else if let (Some(t), Some(rest)) = (text.as_mut(), l.strip_prefix("--   ")) {
                t.push(' ');
                t.push_str(rest);
            } else if text.is_some() {
                break;
            }
        }
        let text = text?;
        if text.trim() == "none" {
            return Some(Vec::new());
        }
        Some(text.split(',').map(|n| n.trim().to_string()).collect())
    }

    #[test]
    fn every_script_header_names_the_helpers_it_calls() {
        let common = helpers_of(COMMON);
        let deliver = helpers_of(DELIVER);
        assert!(common.contains(&"tkey") && deliver.contains(&"lease_next"));
        let mut scripts: Vec<(&str, &str)> = Func::ALL.iter().map(|f| f.source()).collect();
        scripts.push(("deliver", DELIVER));
        for (name, src) in scripts {
            let body = code(src);
            let called = |helpers: &[&str]| -> Vec<String> {
                helpers
                    .iter()
                    .filter(|h| calls(&body, h))
                    .map(|h| h.to_string())
                    .collect()
            };
            let header = listed(src, "common.lua")
                .unwrap_or_else(|| panic!("{name}.lua: no `-- Helpers (common.lua):` header"));
            assert_eq!(header, called(&common), "{name}.lua: helpers of common.lua");
            if name != "deliver" {
                assert_eq!(
                    listed(src, "deliver.lua").unwrap_or_default(),
                    called(&deliver),
                    "{name}.lua: helpers of deliver.lua"
                );
            }
        }
    }
}
