//! Operations on one tenant, as a platform engineer runs them in an incident
//! (`lanekeeper tenant ...` and the ingest admin API call these same
//! functions): a user's pause and resume, the tenant's view where it lives
//! (`show`), and the set's audit trail, which both write.
//!
//! A user pause is kept in the queue the tenant lives in (`up` in its state,
//! see user_pause.lua), where the lease reads it for free, and it travels
//! with the tenant when a lane or a reshard moves it (import.lua). Each
//! operation takes a version from the set's counter, so whichever of a move
//! and an operation reaches the new queue first, the newer operation wins.

use redis::Value;

use std::time::{Duration, Instant};

use super::library::Func;
use super::reply::{array, int, string, unexpected};
use super::{keys, ReplayFilter, Result, Store, StoreError, TenantQueueState};
use crate::routing::{hash_shard, QueueId};

/// Envelopes one purge step takes, and dead letters one replay step of an
/// operator examines: a millisecond or two of Redis work (each is a record
/// read or written, a stream entry added or deleted), so queues that share
/// the Redis never wait long behind it, even on a busy server.
pub const PURGE_PAGE: usize = 100;

/// The audit trail keeps about this many entries (the stream is trimmed
/// approximately, so a few more may be there).
pub const AUDIT_MAX: usize = 10_000;

/// How many recent entries [`Store::audit_entries`] reads at most to find a
/// tenant's: bounded work whatever the trail holds.
const AUDIT_SCAN: usize = 1_000;

/// A move can hand the tenant on while an operation follows it: this many
/// hops at most before the operation gives up (a move takes seconds).
const MAX_HOPS: usize = 8;

/// The longest reason an operation may record.
pub const MAX_REASON_BYTES: usize = 256;

/// Is `reason` fit for the audit trail: at most [`MAX_REASON_BYTES`], one
/// line, no control characters? The error says what is wrong.
pub fn check_reason(reason: &str) -> std::result::Result<(), String> {
    if reason.len() > MAX_REASON_BYTES {
        return Err(format!(
            "is {} bytes; the limit is {MAX_REASON_BYTES}",
            reason.len()
        ));
    }
    if let Some(c) = reason.chars().find(|c| c.is_control()) {
        return Err(format!("contains the control character {c:?}"));
    }
    Ok(())
}

fn valid_reason(reason: Option<&str>) -> Result<()> {
    match reason.map(check_reason) {
        Some(Err(reason)) => Err(StoreError::Invalid(crate::envelope::InvalidEnvelope {
            field: "reason",
            reason,
        })),
        _ => Ok(()),
    }
}

/// What a pause or resume did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PauseOutcome {
    /// The queue the tenant lives in, where the state was set.
    pub queue: QueueId,
    /// Paused by a user now.
    pub paused: bool,
    /// False when it already was in that state.
    pub changed: bool,
    /// The operation's version (see the module documentation).
    pub version: u64,
    /// The tenant's envelopes outstanding in that queue.
    pub depth: u64,
}

/// One entry of the audit trail: who did what to which tenant, when, and
/// how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditEntry {
    /// Redis time, ms since the epoch (0 when recording: Redis sets it).
    pub at_ms: u64,
    /// The api key's name (`key:<name>`) or the CLI's user (`cli:<user>`).
    pub who: String,
    /// `pause`, `resume`, ...
    pub operation: String,
    pub tenant: String,
    /// What it did, one line (`paused in shard-03`, `already paused`, ...).
    pub outcome: String,
}

/// One tenant where it lives: what `lanekeeper tenant show` prints.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantView {
    pub tenant: String,
    /// The queue the routing table sends it to now.
    pub queue: QueueId,
    /// Its hash shard (differs from `queue` while it is pinned to a lane or
    /// mid-move).
    pub hash_shard: QueueId,
    /// Its state in `queue`.
    pub state: TenantQueueState,
    /// Its dead letters in `queue` and, if different, its hash shard.
    pub dead_letters: u64,
    /// Its latest audit entries, newest first.
    pub audit: Vec<AuditEntry>,
}

/// Where a purge puts a tenant's queued envelopes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PurgeMode {
    /// To its dead letters, cause `purged` (they can be replayed).
    DeadLetter,
    /// Deleted, counted.
    Drop,
}

impl PurgeMode {
    fn arg(self) -> &'static [u8] {
        match self {
            PurgeMode::DeadLetter => b"dead",
            PurgeMode::Drop => b"drop",
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            PurgeMode::DeadLetter => "deadLetter",
            PurgeMode::Drop => "drop",
        }
    }
}

/// What a purge did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PurgeOutcome {
    pub queue: QueueId,
    pub mode: PurgeMode,
    /// Envelopes taken from the tenant's lane.
    pub purged: u64,
    /// Left to finish: in flight, and waiting to retry (a retry comes back
    /// to the lane when due; purge again to take it).
    pub in_flight: u64,
    pub delayed: u64,
}

/// How a replay paces itself and where it stops.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayPlan {
    pub filter: ReplayFilter,
    /// Letters per second at most (`None`: as fast as the steps go).
    pub max_per_second: Option<f64>,
    /// Stop after this long, with a cursor to go on from (`None`: run to the end).
    pub budget: Option<Duration>,
    /// Go on from a cursor an earlier replay gave.
    pub after: Option<String>,
}

/// What a replay did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayOutcome {
    pub queue: QueueId,
    pub replayed: u64,
    /// Letters looked at (replayed or filtered out).
    pub examined: u64,
    /// Where to go on from when the budget ran out first (`None`: done).
    pub next: Option<String>,
}

/// user_pause.lua's answer.
enum PauseReply {
    Done {
        paused: bool,
        changed: bool,
        depth: u64,
    },
    Moved(QueueId),
    Stale(u64),
}

fn pause_reply(v: Value) -> Result<PauseReply> {
    let items = array("user_pause", v)?;
    match items.first().map(string).as_deref() {
        Some("OK") if items.len() == 4 => Ok(PauseReply::Done {
            paused: string(&items[1]) == "1",
            changed: int(&items[2]) == 1,
            depth: int(&items[3]),
        }),
        Some("MOVED") if items.len() == 2 => string(&items[1])
            .parse()
            .map(PauseReply::Moved)
            .map_err(|_| unexpected("user_pause", &items)),
        Some("STALE") if items.len() == 2 => Ok(PauseReply::Stale(int(&items[1]))),
        _ => Err(unexpected("user_pause", &items)),
    }
}

impl Store {
    /// Pause (`true`) or resume (`false`) `tenant` for a user, in the queue
    /// it lives in. Paused, its envelopes are not leased (those in flight
    /// finish) while ingest keeps accepting them, within its backlog limit;
    /// resumed, it is served again, in its order. Follows the tenant when a
    /// move hands it on meanwhile.
    pub async fn set_user_pause(&self, tenant: &str, paused: bool) -> Result<PauseOutcome> {
        crate::envelope::validate_tenant(tenant)?;
        let table = self.routing().await?;
        if !table.present() {
            return Err(StoreError::RoutingMissing(self.set.clone()));
        }
        let mut q = table.route(tenant);
        let mut version = self.next_pause_version(0).await?;
        let state: &[u8] = if paused { b"1" } else { b"0" };
        for _ in 0..MAX_HOPS {
            let v = version.to_string();
            let reply = self
                .run(
                    Func::UserPause,
                    q,
                    &[tenant.as_bytes(), v.as_bytes(), state],
                )
                .await?;
            match pause_reply(reply)? {
                PauseReply::Done {
                    paused,
                    changed,
                    depth,
                } => {
                    return Ok(PauseOutcome {
                        queue: q,
                        paused,
                        changed,
                        version,
                        depth,
                    })
                }
                PauseReply::Moved(to) => q = to,
                // The set's counter was lost (its node restarted empty):
                // take a version past the queue's.
                PauseReply::Stale(have) => version = self.next_pause_version(have).await?,
            }
        }
        Err(StoreError::Protocol {
            script: "user_pause",
            detail: format!("{tenant} moved {MAX_HOPS} times during the operation; try again"),
        })
    }

    /// [`Store::set_user_pause`], recorded in the audit trail as done by
    /// `who` (with `reason`, if given), whether it succeeded or not.
    pub async fn user_pause_audited(
        &self,
        tenant: &str,
        paused: bool,
        who: &str,
        reason: Option<&str>,
    ) -> Result<PauseOutcome> {
        let operation = if paused { "pause" } else { "resume" };
        valid_reason(reason)?;
        let result = self.set_user_pause(tenant, paused).await;
        self.audit(who, operation, tenant, reason, &result, |o| {
            if o.changed {
                format!("{operation}d in {}", o.queue)
            } else {
                format!("already {operation}d in {}", o.queue)
            }
        })
        .await?;
        result
    }

    /// [`Store::purge_tenant`], audited as [`Store::user_pause_audited`] is.
    pub async fn purge_audited(
        &self,
        tenant: &str,
        mode: PurgeMode,
        who: &str,
        reason: Option<&str>,
    ) -> Result<PurgeOutcome> {
        valid_reason(reason)?;
        let result = self.purge_tenant(tenant, mode).await;
        self.audit(who, "purge", tenant, reason, &result, |o| {
            format!(
                "{} {} envelopes in {} ({} in flight and {} retrying left)",
                match o.mode {
                    PurgeMode::DeadLetter => "dead-lettered",
                    PurgeMode::Drop => "dropped",
                },
                o.purged,
                o.queue,
                o.in_flight,
                o.delayed
            )
        })
        .await?;
        result
    }

    /// [`Store::replay_tenant`], audited as [`Store::user_pause_audited`] is.
    pub async fn replay_audited(
        &self,
        tenant: &str,
        plan: &ReplayPlan,
        who: &str,
        reason: Option<&str>,
    ) -> Result<ReplayOutcome> {
        valid_reason(reason)?;
        if let Some(e) = &plan.filter.endpoint {
            crate::endpoint::check_name(e).map_err(|reason| {
                StoreError::Invalid(crate::envelope::InvalidEnvelope {
                    field: "endpoint",
                    reason,
                })
            })?;
        }
        let result = self.replay_tenant(tenant, plan).await;
        self.audit(who, "replay", tenant, reason, &result, |o| {
            format!(
                "replayed {} of {} dead letters examined in {}{}",
                o.replayed,
                o.examined,
                o.queue,
                if o.next.is_some() {
                    " (more to go)"
                } else {
                    ""
                }
            )
        })
        .await?;
        result
    }

    /// Take `tenant`'s queued envelopes out of the queue it lives in, in
    /// steps of [`PURGE_PAGE`]: to its dead letters (cause `purged`) or
    /// deleted, as `mode` says. Takes what is queued when it starts, not
    /// what its producer sends meanwhile; leaves what is in flight or
    /// waiting to retry. Refused with [`StoreError::TenantMoving`] while a
    /// lane or a reshard moves the tenant (nothing changed).
    pub async fn purge_tenant(&self, tenant: &str, mode: PurgeMode) -> Result<PurgeOutcome> {
        crate::envelope::validate_tenant(tenant)?;
        let mut q = self.route_of(tenant).await?;
        let limit = PURGE_PAGE.to_string();
        let mut purged = 0u64;
        let mut hops = 0;
        // what was queued at the first step: more may arrive, not taken
        let mut goal: Option<u64> = None;
        loop {
            let v = self
                .run(
                    Func::Purge,
                    q,
                    &[tenant.as_bytes(), mode.arg(), limit.as_bytes()],
                )
                .await?;
            let items = array("purge", v)?;
            match items.first().map(string).as_deref() {
                Some("OK") if items.len() == 5 => {
                    let (n, left) = (int(&items[1]), int(&items[2]));
                    purged += n;
                    let goal = *goal.get_or_insert(n + left);
                    if n == 0 || left == 0 || purged >= goal {
                        return Ok(PurgeOutcome {
                            queue: q,
                            mode,
                            purged,
                            in_flight: int(&items[3]),
                            delayed: int(&items[4]),
                        });
                    }
                }
                Some("MOVED") if items.len() == 2 && purged == 0 && hops < MAX_HOPS => {
                    hops += 1;
                    q = string(&items[1])
                        .parse()
                        .map_err(|_| unexpected("purge", &items))?;
                }
                Some("MOVING") if purged == 0 => {
                    return Err(StoreError::TenantMoving(tenant.to_string()))
                }
                // moved or moving after some steps: what was taken is said
                Some("MOVED") | Some("MOVING") => {
                    return Ok(PurgeOutcome {
                        queue: q,
                        mode,
                        purged,
                        in_flight: 0,
                        delayed: 0,
                    })
                }
                _ => return Err(unexpected("purge", &items)),
            }
        }
    }

    /// Put `tenant`'s dead letters in the queue it lives in back on its
    /// lane, oldest first, those `plan.filter` takes, in steps of at most
    /// [`PURGE_PAGE`], at most `plan.max_per_second`, until done or
    /// `plan.budget` runs out (then `next` says where to go on from).
    pub async fn replay_tenant(&self, tenant: &str, plan: &ReplayPlan) -> Result<ReplayOutcome> {
        crate::envelope::validate_tenant(tenant)?;
        let q = self.route_of(tenant).await?;
        let started = Instant::now();
        // a step is about a tenth of a second of the rate: the rate holds
        // over any second, not only on average
        let page = match plan.max_per_second {
            Some(r) if r > 0.0 => ((r / 10.0).ceil() as usize).clamp(1, PURGE_PAGE),
            _ => PURGE_PAGE,
        };
        let mut out = ReplayOutcome {
            queue: q,
            replayed: 0,
            examined: 0,
            next: plan.after.clone(),
        };
        loop {
            let step = self
                .replay_dead_page_filtered(q, tenant, out.next.as_deref(), page, &[], &plan.filter)
                .await?;
            let Ok(step) = step else {
                // moved away meanwhile: what was replayed is said; the rest
                // is replayed once it is back, or from its new queue
                out.next = None;
                return Ok(out);
            };
            out.replayed += step.replayed;
            out.examined += step.examined;
            out.next = step.next;
            if out.next.is_none() {
                return Ok(out);
            }
            if let Some(rate) = plan.max_per_second.filter(|r| *r > 0.0) {
                let due = Duration::from_secs_f64(out.replayed as f64 / rate);
                let elapsed = started.elapsed();
                if due > elapsed {
                    tokio::time::sleep(due - elapsed).await;
                }
            }
            if plan.budget.is_some_and(|b| started.elapsed() >= b) {
                return Ok(out);
            }
        }
    }

    /// The queue routing sends `tenant` to.
    async fn route_of(&self, tenant: &str) -> Result<QueueId> {
        let table = self.routing().await?;
        if !table.present() {
            return Err(StoreError::RoutingMissing(self.set.clone()));
        }
        Ok(table.route(tenant))
    }

    /// Record `operation` on `tenant` by `who` in the audit trail: its
    /// outcome, or the kind of its failure, and the reason if given.
    pub async fn audit<T>(
        &self,
        who: &str,
        operation: &str,
        tenant: &str,
        reason: Option<&str>,
        result: &Result<T>,
        outcome: impl FnOnce(&T) -> String,
    ) -> Result<()> {
        // An invalid tenant or argument is not recorded: nothing was done.
        if matches!(
            result,
            Err(StoreError::Invalid(_)
                | StoreError::InvalidCursor
                | StoreError::InvalidEndpoint(_))
        ) {
            return Ok(());
        }
        let mut line = match result {
            Ok(v) => outcome(v),
            Err(e) => format!("failed: {}", e.kind()),
        };
        if let Some(r) = reason.filter(|r| !r.is_empty()) {
            line = format!("{line}; reason: {r}");
        }
        self.record_audit(&AuditEntry {
            at_ms: 0,
            who: who.to_string(),
            operation: operation.to_string(),
            tenant: tenant.to_string(),
            outcome: line,
        })
        .await
    }

    /// The next operation version, above `floor`. Never lowers the counter,
    /// so concurrent operations each get their own.
    async fn next_pause_version(&self, floor: u64) -> Result<u64> {
        let key = keys::pause_version(&self.set);
        let mut conn = self.conn.clone();
        if floor > 0 {
            let now: Option<u64> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
            let now = now.unwrap_or(0);
            if now < floor {
                let _: u64 = redis::cmd("INCRBY")
                    .arg(&key)
                    .arg(floor - now)
                    .query_async(&mut conn)
                    .await?;
            }
        }
        Ok(redis::cmd("INCR").arg(&key).query_async(&mut conn).await?)
    }

    /// The tenants the ShardSet's spec paused (its record, see
    /// [`keys::paused_by_spec`]), by name.
    pub async fn paused_by_spec(&self) -> Result<Vec<String>> {
        let mut conn = self.conn.clone();
        let mut out: Vec<String> = redis::cmd("SMEMBERS")
            .arg(keys::paused_by_spec(&self.set))
            .query_async(&mut conn)
            .await?;
        out.sort();
        Ok(out)
    }

    /// Record (or forget) that the spec paused `tenant`.
    pub async fn mark_paused_by_spec(&self, tenant: &str, paused: bool) -> Result<()> {
        let mut conn = self.conn.clone();
        let cmd = if paused { "SADD" } else { "SREM" };
        let _: u64 = redis::cmd(cmd)
            .arg(keys::paused_by_spec(&self.set))
            .arg(tenant)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// The tenants a user paused in `q`.
    pub async fn user_paused(&self, q: QueueId) -> Result<Vec<String>> {
        let mut conn = self.conn.clone();
        let mut out: Vec<String> = redis::cmd("SMEMBERS")
            .arg(keys::paused(&self.queue_prefix(q)))
            .query_async(&mut conn)
            .await?;
        out.sort();
        Ok(out)
    }

    /// `tenant` where it lives: its queue, its state there, its dead
    /// letters, and its latest audit entries (at most `audit` of them).
    pub async fn tenant_view(&self, tenant: &str, audit: usize) -> Result<TenantView> {
        crate::envelope::validate_tenant(tenant)?;
        let table = self.routing().await?;
        if !table.present() {
            return Err(StoreError::RoutingMissing(self.set.clone()));
        }
        let queue = table.route(tenant);
        let shard = hash_shard(tenant, table.shards);
        let state = self.tenant_state(queue, tenant).await?;
        let mut conn = self.conn.clone();
        let mut dead_letters = 0;
        for q in [queue, shard]
            .iter()
            .take(if queue == shard { 1 } else { 2 })
        {
            let n: u64 = redis::cmd("XLEN")
                .arg(keys::dead_letters(&self.queue_prefix(*q), tenant))
                .query_async(&mut conn)
                .await?;
            dead_letters += n;
        }
        Ok(TenantView {
            tenant: tenant.to_string(),
            queue,
            hash_shard: shard,
            state,
            dead_letters,
            audit: self.audit_entries(Some(tenant), audit).await?,
        })
    }

    /// Append an entry to the set's audit trail (Redis stamps the time),
    /// keeping about [`AUDIT_MAX`].
    pub async fn record_audit(&self, e: &AuditEntry) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("XADD")
            .arg(keys::audit(&self.set))
            .arg("MAXLEN")
            .arg("~")
            .arg(AUDIT_MAX)
            .arg("*")
            .arg("who")
            .arg(&e.who)
            .arg("op")
            .arg(&e.operation)
            .arg("tenant")
            .arg(&e.tenant)
            .arg("outcome")
            .arg(&e.outcome)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// The latest audit entries, newest first: at most `limit`, of `tenant`
    /// only when given (found among the latest [`AUDIT_SCAN`] entries).
    pub async fn audit_entries(
        &self,
        tenant: Option<&str>,
        limit: usize,
    ) -> Result<Vec<AuditEntry>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let scan = if tenant.is_some() { AUDIT_SCAN } else { limit };
        let raw: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
            .arg(keys::audit(&self.set))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(scan.min(AUDIT_SCAN))
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::new();
        for (id, fields) in raw {
            let mut e = AuditEntry {
                at_ms: id
                    .split_once('-')
                    .and_then(|(ms, _)| ms.parse().ok())
                    .unwrap_or(0),
                who: String::new(),
                operation: String::new(),
                tenant: String::new(),
                outcome: String::new(),
            };
            for (k, v) in fields {
                match k.as_str() {
                    "who" => e.who = v,
                    "op" => e.operation = v,
                    "tenant" => e.tenant = v,
                    "outcome" => e.outcome = v,
                    _ => {}
                }
            }
            if tenant.is_none_or(|t| t == e.tenant) {
                out.push(e);
                if out.len() == limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}
