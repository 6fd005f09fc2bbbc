//! What the store answers (the reply types of its operations), and one
//! decoder per script reply, with the small helpers they share to read a
//! Redis [`Value`].

use std::time::Duration;

use redis::Value;

use super::{Result, StoreError};
use crate::envelope::Envelope;
use crate::routing::QueueId;

/// Where an envelope went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnqueueOutcome {
    /// On the tenant's lane, with its sequence number in the queue.
    Queued { seq: u64 },
    /// In the tenant's hold buffer: the tenant is paused here while it moves.
    Held { seq: u64 },
    /// This id was stored before; nothing changed.
    Duplicate,
    /// The tenant has moved to another queue: refresh routing and retry there.
    Moved(QueueId),
    /// The tenant's backlog here (`depth`: queued, held, delayed and in
    /// flight) has reached the limit given; nothing was stored.
    Full { depth: u64 },
    /// The routing table the caller routed by is older than the queue's
    /// fence (a reshard changed the shard count): nothing was stored;
    /// refresh the table and route again.
    Stale { fence: u64 },
    /// The tenant is shaped at ingest (it is hot and its lane waits at the
    /// cap) and has no tokens for this call: nothing was stored; enough
    /// will be there after `retry_after`.
    Shaped { retry_after: Duration },
}

/// An envelope leased to a worker until `deadline_ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct Lease {
    pub queue: QueueId,
    pub id: String,
    pub tenant: String,
    /// The stored envelope, as enqueued. Decode with [`Lease::envelope`].
    pub payload: String,
    /// Attempts before this one.
    pub attempts: u32,
    /// Sequence number in this queue.
    pub seq: u64,
    /// The lease as the queue holds it (charge, start, id, tenant and a
    /// unique part): ack, nack and release present it.
    pub token: String,
    pub deadline_ms: u64,
    pub enqueued_ms: u64,
    /// This lease is the probe of a half-open breaker.
    pub breaker: Option<BreakerChange>,
}

impl Lease {
    /// Decode the stored envelope; a corrupt record is an error to dead-letter.
    /// Its tenant and id are the lease's, whatever the stored payload says:
    /// the queue names the envelope by both, so that is who it belongs to.
    pub fn envelope(&self) -> Result<Envelope, serde_json::Error> {
        let mut env: Envelope = serde_json::from_str(&self.payload)?;
        env.tenant.clone_from(&self.tenant);
        env.id.clone_from(&self.id);
        Ok(env)
    }
}

/// The answer to a lease request.
#[derive(Clone, Debug, PartialEq)]
pub enum LeaseOutcome {
    Leased(Lease),
    /// Nothing is eligible; look again after this long at the latest (the next
    /// retry or lease deadline falls due then; new work may come sooner).
    Empty {
        retry_after: Duration,
    },
    /// The scan budget ran out while crediting tenants; ask again at once.
    Again,
}

/// What happened to a failed delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NackOutcome {
    /// Back in the delayed set, due at `due_ms`.
    Retry {
        attempts: u32,
        due_ms: u64,
        breaker: Option<BreakerChange>,
    },
    /// On the dead-letter list.
    Dead {
        attempts: u32,
        breaker: Option<BreakerChange>,
    },
    /// The lease was gone already.
    Stale,
}

/// A failed delivery, as the worker reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure<'a> {
    /// What went wrong, for the dead letter and the logs.
    pub cause: &'a str,
    /// Retry after this long; `None` dead-letters now.
    pub retry_in: Option<Duration>,
    /// The endpoint is at fault (5xx, 429, timeout, connection error): counts
    /// against its circuit breaker.
    pub endpoint_fault: bool,
    /// The receiver asked for a pause (429 or 503 with `Retry-After`): its
    /// endpoint gets no request for this long (at most the queue's
    /// `maxRetryAfter`), the retry is due when it ends, and the breaker is
    /// not touched (`endpoint_fault` is then ignored).
    pub pace: Option<Duration>,
}

impl<'a> Failure<'a> {
    /// Retry after `after`.
    pub fn retry(cause: &'a str, after: Duration) -> Self {
        Self {
            cause,
            retry_in: Some(after),
            endpoint_fault: false,
            pace: None,
        }
    }

    /// Dead-letter now.
    pub fn dead(cause: &'a str) -> Self {
        Self {
            cause,
            retry_in: None,
            endpoint_fault: false,
            pace: None,
        }
    }

    /// Count this failure against the endpoint's circuit breaker.
    pub fn blame_endpoint(self) -> Self {
        Self {
            endpoint_fault: true,
            ..self
        }
    }

    /// The receiver asked for `pause`: its endpoint is paced (see [`Failure::pace`]).
    /// A zero pause is no pause.
    pub fn paced(self, pause: Duration) -> Self {
        Self {
            pace: (!pause.is_zero()).then_some(pause),
            ..self
        }
    }
}

/// A state change of an endpoint's circuit breaker, shared by every worker of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerChange {
    /// Tripped: the endpoint's envelopes are not leased until it cools down.
    Opened,
    /// Cooled down: one probe request goes out.
    HalfOpen,
    /// The probe succeeded.
    Closed,
}

impl BreakerChange {
    pub(super) fn parse(v: Option<&Value>) -> Option<Self> {
        match v.map(string).as_deref() {
            Some("open") => Some(BreakerChange::Opened),
            Some("half-open") => Some(BreakerChange::HalfOpen),
            Some("closed") => Some(BreakerChange::Closed),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerChange::Opened => "open",
            BreakerChange::HalfOpen => "half-open",
            BreakerChange::Closed => "closed",
        }
    }
}

/// The answer to an ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acked {
    /// False when the lease was gone (already acked, or expired and moved on).
    pub acked: bool,
    /// The ack closed the endpoint's breaker (a successful probe).
    pub breaker: Option<BreakerChange>,
}

/// The answer to a batched ack and lease ([`Store::lease_batch`](super::Store::lease_batch)).
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseBatch {
    /// One answer per ack, in the order given.
    pub acked: Vec<Acked>,
    /// The envelopes leased, in the order deficit round robin served them.
    pub leased: Vec<Lease>,
    /// Why fewer than the `k` asked for were leased: [`LeaseOutcome::Empty`]
    /// or [`LeaseOutcome::Again`], as a single lease would have answered;
    /// `None` when all `k` were.
    pub short: Option<LeaseOutcome>,
}

/// A tenant's state in one queue, as the relocation phases need it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantQueueState {
    pub queued: u64,
    pub in_flight: u64,
    pub delayed: u64,
    pub held: u64,
    pub paused: bool,
    pub moved_to: Option<QueueId>,
    pub depth: u64,
    /// Paused by a user (`lanekeeper tenant pause`): leases skip it.
    pub user_paused: bool,
}

impl TenantQueueState {
    /// Ready to move: nothing of the tenant is in flight or waiting to
    /// retry here, and nothing is queued, or what is queued waits for a
    /// user's resume (the move takes it along in order: mark_moved.lua puts
    /// it at the head of the hold buffer).
    pub fn drained(&self) -> bool {
        (self.queued == 0 || self.user_paused) && self.in_flight == 0 && self.delayed == 0
    }
}

/// One step of the sweep of idle tenants ([`Store::sweep`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStep {
    /// Tenants looked at.
    pub scanned: u64,
    /// Tenants whose state was deleted.
    pub swept: u64,
    /// This step finished a pass over the queue's tenants.
    pub pass_ended: bool,
    /// No pass is due yet (or the queue's policy never sweeps): nothing was
    /// looked at.
    pub waiting: bool,
}

/// One tenant's recent activity in one queue ([`Store::tenant_activity`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TenantActivity {
    pub state: TenantQueueState,
    pub delivered: u64,
    pub failed: u64,
    /// Worker-seconds per delivery, as the scheduler estimates it.
    pub estimate_s: Option<f64>,
    /// The tenant's worker-seconds over the window.
    pub worker_seconds: f64,
    /// Every tenant's worker-seconds in this queue over the window.
    pub queue_worker_seconds: f64,
    pub oldest_enqueued_ms: Option<u64>,
    /// Redis server time of the reading.
    pub now_ms: u64,
    pub window: Duration,
}

impl TenantActivity {
    /// The tenant's share of the queue's worker-seconds over the window.
    pub fn capacity_share(&self) -> f64 {
        if self.queue_worker_seconds > 0.0 {
            self.worker_seconds / self.queue_worker_seconds
        } else {
            0.0
        }
    }

    /// Deliveries per second over the window (worker-seconds spent divided by
    /// the cost of one delivery).
    pub fn drain_rate(&self) -> f64 {
        let per = self.estimate_s.unwrap_or(1.0).max(1e-3);
        self.worker_seconds / self.window.as_secs_f64().max(1.0) / per
    }

    /// How long the oldest queued envelope has waited.
    pub fn oldest_wait(&self) -> Option<Duration> {
        self.oldest_enqueued_ms
            .map(|n| Duration::from_millis(self.now_ms.saturating_sub(n)))
    }
}

/// One of a tenant's dead letters.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    pub id: String,
    pub tenant: String,
    pub attempts: u32,
    pub cause: String,
    pub at: u64,
    /// The stored envelope (empty when its record was missing).
    pub envelope: String,
    /// Where it is in the tenant's dead letters: a page that ends here
    /// continues after it.
    pub cursor: String,
}

/// One page of a tenant's dead letters, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterPage {
    pub letters: Vec<DeadLetter>,
    /// Pass as `after` for the next page; `None` when this was the last.
    pub next: Option<String>,
}

/// What one replay step did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayPage {
    pub replayed: u64,
    /// Letters looked at (replayed or not).
    pub examined: u64,
    /// Where the next step starts; `None` when the tenant's letters are done.
    pub next: Option<String>,
}

pub use crate::policy::TenantStats;

/// A LEASED reply names the envelope's payload, attempts, seq and enqueue
/// time; an envelope stored whole in its lane comes as its lane item in
/// the payload's place with no seq (the script reads only its id), and its
/// parts are read here.
pub(super) fn parse_lease(q: QueueId, items: &[Value]) -> Result<LeaseOutcome> {
    match tag(items).as_deref() {
        Some("LEASED") if items.len() == 10 => {
            let (payload, seq, enqueued_ms) = match (&items[3], &items[5]) {
                (Value::BulkString(item), Value::Nil) => whole_item(item),
                _ => (string(&items[3]), int(&items[5]), int(&items[8])),
            };
            Ok(LeaseOutcome::Leased(Lease {
                queue: q,
                id: string(&items[1]),
                tenant: string(&items[2]),
                payload,
                attempts: int(&items[4]) as u32,
                seq,
                token: string(&items[6]),
                deadline_ms: int(&items[7]),
                enqueued_ms,
                breaker: BreakerChange::parse(items.get(9)),
            }))
        }
        Some("EMPTY") => Ok(LeaseOutcome::Empty {
            retry_after: Duration::from_millis(items.get(1).map(int).unwrap_or(1000)),
        }),
        Some("AGAIN") => Ok(LeaseOutcome::Again),
        _ => Err(unexpected("lease", items)),
    }
}

/// The payload, seq and enqueue time of an envelope leased while stored
/// whole, read from its lane item; one that does not parse is handed on
/// whole as a payload that does not decode (the worker dead-letters it with
/// its bytes).
fn whole_item(item: &[u8]) -> (String, u64, u64) {
    match super::keys::lane_item(item) {
        super::keys::LaneItem::Whole {
            seq,
            enqueued_ms,
            payload,
            ..
        } => (
            String::from_utf8_lossy(payload).into_owned(),
            seq,
            enqueued_ms,
        ),
        super::keys::LaneItem::Bare(raw) => (String::from_utf8_lossy(raw).into_owned(), 0, 0),
    }
}

/// One envelope's outcome in an enqueue reply: its code, its seq when
/// stored, and the value that goes with the code (see `enqueue_reply`).
fn parse_enqueue(code: u8, seq: u64, value: Option<&Value>) -> Result<EnqueueOutcome> {
    let need = || {
        value.ok_or_else(|| StoreError::Protocol {
            script: "enqueue",
            detail: format!("code {:?} without its value", code as char),
        })
    };
    match code {
        b'O' => Ok(EnqueueOutcome::Queued { seq }),
        b'H' => Ok(EnqueueOutcome::Held { seq }),
        b'D' => Ok(EnqueueOutcome::Duplicate),
        b'F' => Ok(EnqueueOutcome::Full {
            depth: int(need()?),
        }),
        b'T' => Ok(EnqueueOutcome::Stale {
            fence: int(need()?),
        }),
        b'S' => Ok(EnqueueOutcome::Shaped {
            retry_after: Duration::from_millis(int(need()?)),
        }),
        b'M' => string(need()?)
            .parse()
            .map(EnqueueOutcome::Moved)
            .map_err(|e| StoreError::Protocol {
                script: "enqueue",
                detail: format!("MOVED to {e}"),
            }),
        _ => Err(StoreError::Protocol {
            script: "enqueue",
            detail: format!("unknown code {:?}", code as char),
        }),
    }
}

// ---- one decoder per script reply ------------------------------------

/// enqueue.lua: `{seq0, codes, values...}` for `n` envelopes, one code
/// letter each, in order: 'O' queued and 'H' held (seq: seq0 plus its
/// place, from 1), 'D' a duplicate, and 'M' moved, 'F' full, 'T' stale and
/// 'S' shaped, each taking the next of the values. A reply whose codes are
/// not `n` is an error of the whole call; a code that does not decode is an
/// error of its envelope.
pub(super) fn enqueue_reply(v: Value, n: usize) -> Result<Vec<Result<EnqueueOutcome>>> {
    let items = array("enqueue", v)?;
    let codes = match items.get(1) {
        Some(Value::BulkString(c)) if c.len() == n => c.clone(),
        _ => return Err(unexpected("enqueue", &items)),
    };
    let seq0 = int(&items[0]);
    let mut values = items[2..].iter();
    Ok(codes
        .iter()
        .enumerate()
        .map(|(k, &code)| {
            let value = matches!(code, b'M' | b'F' | b'T' | b'S')
                .then(|| values.next())
                .flatten();
            parse_enqueue(code, seq0 + k as u64 + 1, value)
        })
        .collect())
}

/// lease.lua (see [`parse_lease`]).
pub(super) fn lease_reply(q: QueueId, v: Value) -> Result<LeaseOutcome> {
    parse_lease(q, &array("lease", v)?)
}

/// ack_lease.lua: the ack's status and breaker change, then a lease reply.
pub(super) fn ack_lease_reply(q: QueueId, v: Value) -> Result<(Acked, LeaseOutcome)> {
    let items = array("ack_lease", v)?;
    match items.as_slice() {
        [acked, change, lease @ ..] => Ok((
            Acked {
                acked: string(acked) == "OK",
                breaker: BreakerChange::parse(Some(change)),
            },
            parse_lease(q, lease)?,
        )),
        _ => Err(unexpected("ack_lease", &items)),
    }
}

/// lease_batch.lua, one flat array: `n`; the acks' statuses, a letter each
/// (`O` acked, `S` stale); Nil, or the `n` breaker changes; `m` (at most
/// `k`); the leases' deadline; then three items per lease: the lease (which
/// names the envelope's id and tenant), the payload (an envelope stored
/// whole: its lane item), and Nil (stored whole, no breaker change) or
/// `{attempts, seq, enqueued ms, change}`; then the answer that stopped the
/// batch short (`EMPTY`, wait or `AGAIN`; nothing when it did not).
pub(super) fn lease_batch_reply(q: QueueId, v: Value, n: usize, k: usize) -> Result<LeaseBatch> {
    const LEASED: usize = 3;
    let items = array("lease_batch", v)?;
    let bad = |items: &[Value]| unexpected("lease_batch", items);
    if items.len() < 5 || items.first().map(int) != Some(n as u64) {
        return Err(bad(&items));
    }
    let codes = bytes(&items[1]);
    let changes = match &items[2] {
        Value::Nil => None,
        Value::Array(c) if c.len() == n => Some(c),
        _ => return Err(bad(&items)),
    };
    if codes.len() != n {
        return Err(bad(&items));
    }
    let acked = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| Acked {
            acked: c == b'O',
            breaker: changes.and_then(|c| BreakerChange::parse(c.get(i))),
        })
        .collect();
    let m = int(&items[3]) as usize;
    let deadline_ms = int(&items[4]);
    let leases_at = 5;
    if m > k || items.len() < leases_at + LEASED * m {
        return Err(bad(&items));
    }
    let mut leased = Vec::with_capacity(m);
    for chunk in items[leases_at..leases_at + LEASED * m].chunks(LEASED) {
        leased.push(batch_lease(q, chunk, deadline_ms).ok_or_else(|| bad(&items))?);
    }
    let tail = &items[leases_at + LEASED * m..];
    let short = if tail.is_empty() {
        None
    } else {
        Some(parse_lease(q, tail)?)
    };
    Ok(LeaseBatch {
        acked,
        leased,
        short,
    })
}

/// One lease of a batch (see [`lease_batch_reply`]): `[lease, payload, extra]`.
fn batch_lease(q: QueueId, items: &[Value], deadline_ms: u64) -> Option<Lease> {
    let Value::BulkString(member) = &items[0] else {
        return None;
    };
    let (id, tenant) = super::keys::lease_names(member)?;
    let (extra, breaker) = match &items[2] {
        Value::Nil => (None, None),
        Value::Array(x) if x.len() == 4 => (Some(x), BreakerChange::parse(x.get(3))),
        _ => return None,
    };
    // a record's lease comes with its seq; one stored whole (no seq) is read
    // from its item, as parse_lease reads it
    let (payload, attempts, seq, enqueued_ms) =
        match (&items[1], extra.filter(|x| x[1] != Value::Nil)) {
            (body, Some(x)) => (string(body), int(&x[0]) as u32, int(&x[1]), int(&x[2])),
            (Value::BulkString(item), None) => {
                let (payload, seq, enqueued_ms) = whole_item(item);
                (payload, 0, seq, enqueued_ms)
            }
            _ => return None,
        };
    Some(Lease {
        queue: q,
        id: String::from_utf8_lossy(id).into_owned(),
        tenant: String::from_utf8_lossy(tenant).into_owned(),
        payload,
        attempts,
        seq,
        token: String::from_utf8_lossy(member).into_owned(),
        deadline_ms,
        enqueued_ms,
        breaker,
    })
}

/// ack.lua: `{'OK' | 'STALE', breaker change}`; true when acked.
pub(super) fn ack_reply(v: Value) -> Result<bool> {
    let items = array("ack", v)?;
    Ok(tag(&items).as_deref() == Some("OK"))
}

/// nack.lua: `{'RETRY', attempts, due_ms, change} | {'DEAD', attempts, 0, change} | {'STALE'}`.
pub(super) fn nack_reply(v: Value) -> Result<NackOutcome> {
    let items = array("nack", v)?;
    match tag(&items).as_deref() {
        Some("RETRY") => Ok(NackOutcome::Retry {
            attempts: items.get(1).map(int).unwrap_or(0) as u32,
            due_ms: items.get(2).map(int).unwrap_or(0),
            breaker: BreakerChange::parse(items.get(3)),
        }),
        Some("DEAD") => Ok(NackOutcome::Dead {
            attempts: items.get(1).map(int).unwrap_or(0) as u32,
            breaker: BreakerChange::parse(items.get(3)),
        }),
        Some("STALE") => Ok(NackOutcome::Stale),
        _ => Err(unexpected("nack", &items)),
    }
}

/// release.lua: `'OK'` (given back) or `'STALE'`.
pub(super) fn release_reply(v: &Value) -> bool {
    string(v) == "OK"
}

/// maintain.lua: `{promoted, reaped}`.
pub(super) fn maintain_reply(v: Value) -> Result<(u64, u64)> {
    let items = array("maintain", v)?;
    Ok((
        items.first().map(int).unwrap_or(0),
        items.get(1).map(int).unwrap_or(0),
    ))
}

/// sweep.lua: `{scanned, swept, state}` (state 0 mid-pass, 1 pass ended, 2 waiting).
pub(super) fn sweep_reply(v: Value) -> Result<SweepStep> {
    let items = array("sweep", v)?;
    if items.len() != 3 {
        return Err(unexpected("sweep", &items));
    }
    let state = int(&items[2]);
    Ok(SweepStep {
        scanned: int(&items[0]),
        swept: int(&items[1]),
        pass_ended: state == 1,
        waiting: state == 2,
    })
}

/// status.lua: `{queued, in_flight, delayed, held, paused, moved_to, depth, user_paused}`.
pub(super) fn status_reply(v: Value) -> Result<TenantQueueState> {
    let items = array("status", v)?;
    if items.len() != 8 {
        return Err(unexpected("status", &items));
    }
    let moved = string(&items[5]);
    Ok(TenantQueueState {
        queued: int(&items[0]),
        in_flight: int(&items[1]),
        delayed: int(&items[2]),
        held: int(&items[3]),
        paused: int(&items[4]) == 1,
        moved_to: if moved.is_empty() {
            None
        } else {
            moved.parse().ok()
        },
        depth: int(&items[6]),
        user_paused: int(&items[7]) == 1,
    })
}

/// claims.lua `begin`: the periods the tenant has claims in.
pub(super) fn claims_periods_reply(v: Value) -> Result<Vec<u64>> {
    Ok(array("claims", v)?.iter().map(int).collect())
}

/// claims.lua `scan`: the next SSCAN cursor (`"0"`: done) and the ids of this step.
pub(super) fn claims_scan_reply(v: Value) -> Result<(String, Vec<Vec<u8>>)> {
    let page = array("claims", v)?;
    let Some((next, ids)) = page.split_first() else {
        return Err(unexpected("claims", &page));
    };
    Ok((string(next), ids.iter().map(bytes).collect()))
}

/// claims.lua `delta`: ids claimed since the copy began and not yet copied.
pub(super) fn claims_delta_reply(v: Value) -> Result<Vec<Vec<u8>>> {
    Ok(array("claims", v)?.iter().map(bytes).collect())
}

/// What mark_moved.lua answered.
pub(super) enum MarkMovedReply {
    /// The tenant is marked as moved.
    Marked,
    /// Not paused and drained here: refused.
    Busy,
    /// Ids claimed since the claims copy began are still to be copied.
    Claims,
    /// A user-paused tenant's lane is moving to its hold buffer: call again.
    Merge,
}

/// mark_moved.lua: `{'OK'} | {'BUSY'} | {'CLAIMS'} | {'MERGE'}`.
pub(super) fn mark_moved_reply(v: Value) -> Result<MarkMovedReply> {
    let items = array("mark_moved", v)?;
    match tag(&items).as_deref() {
        Some("OK") => Ok(MarkMovedReply::Marked),
        Some("BUSY") => Ok(MarkMovedReply::Busy),
        Some("CLAIMS") => Ok(MarkMovedReply::Claims),
        Some("MERGE") => Ok(MarkMovedReply::Merge),
        _ => Err(unexpected("mark_moved", &items)),
    }
}

/// resume.lua: `{'MORE', moved} | {'DONE', moved}`, as (done, moved).
pub(super) fn resume_reply(v: Value) -> Result<(bool, u64)> {
    let items = array("resume", v)?;
    let moved = items.get(1).map(int).unwrap_or(0);
    match tag(&items).as_deref() {
        Some("DONE") => Ok((true, moved)),
        Some("MORE") => Ok((false, moved)),
        _ => Err(unexpected("resume", &items)),
    }
}

/// export_hold.lua: the held envelopes, each as its six fields (id, seq,
/// attempts, payload, enqueued_ms, endpoint) as import.lua takes them.
pub(super) fn export_hold_reply(v: Value) -> Result<Vec<Vec<Vec<u8>>>> {
    let items = array("export_hold", v)?;
    Ok(items
        .chunks(6)
        .map(|chunk| chunk.iter().map(bytes).collect())
        .collect())
}

/// import.lua: the count appended.
pub(super) fn import_reply(v: &Value) -> u64 {
    int(v)
}

/// replay_dead.lua: `{'OK', replayed, next cursor, examined} | {'MOVED', queue}`.
pub(super) fn replay_dead_reply(v: Value) -> Result<std::result::Result<ReplayPage, QueueId>> {
    let items = array("replay_dead", v)?;
    match (tag(&items).as_deref(), items.as_slice()) {
        (Some("OK"), [_, n, next, examined]) => {
            let next = string(next);
            Ok(Ok(ReplayPage {
                replayed: int(n),
                examined: int(examined),
                next: (!next.is_empty()).then_some(next),
            }))
        }
        (Some("MOVED"), [_, to]) => string(to)
            .parse()
            .map(Err)
            .map_err(|e| StoreError::Protocol {
                script: "replay_dead",
                detail: format!("MOVED to {e}"),
            }),
        _ => Err(unexpected("replay_dead", &items)),
    }
}

/// routing_update.lua: the table's version after the update.
pub(super) fn routing_update_reply(v: &Value) -> u64 {
    int(v)
}

/// gate.lua `lane_begin`: `'OK'` (the lane may move) or `'WAIT'`.
pub(super) fn gate_lane_begin_reply(v: &Value) -> bool {
    string(v) == "OK"
}

/// gate.lua `reshard_begin`: `{'OK'}`, or `{'WAIT', lane...}` naming the
/// lanes still moving.
pub(super) fn gate_reshard_begin_reply(v: Value) -> Result<std::result::Result<(), Vec<String>>> {
    let items = array("gate", v)?;
    match tag(&items).as_deref() {
        Some("OK") => Ok(Ok(())),
        Some("WAIT") => Ok(Err(items[1..].iter().map(string).collect())),
        _ => Err(unexpected("gate", &items)),
    }
}

pub(super) fn unexpected(script: &'static str, items: &[Value]) -> StoreError {
    StoreError::Protocol {
        script,
        detail: format!("{items:?}"),
    }
}

pub(super) fn array(script: &'static str, v: Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(items) => Ok(items),
        Value::ServerError(e) => Err(StoreError::Redis(e.into())),
        other => Err(StoreError::Protocol {
            script,
            detail: format!("expected an array, got {other:?}"),
        }),
    }
}

pub(super) fn tag(items: &[Value]) -> Option<String> {
    items.first().map(string)
}

pub(super) fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b.clone(),
        Value::SimpleString(s) => s.as_bytes().to_vec(),
        Value::Int(i) => i.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

pub(super) fn string(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Okay => "OK".to_string(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

pub(super) fn int(v: &Value) -> u64 {
    match v {
        Value::Int(i) => (*i).max(0) as u64,
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_lease_of_an_envelope_stored_whole_is_read_from_its_item() {
        let leased = |payload: Value, seq: Value| {
            let items = vec![
                bulk("LEASED"),
                bulk("ord-7"),
                bulk("acme"),
                payload,
                Value::Nil,
                seq,
                bulk("tok"),
                Value::Int(99),
                Value::Nil,
                bulk(""),
            ];
            match parse_lease(QueueId::Shard(0), &items).unwrap() {
                LeaseOutcome::Leased(l) => (l.payload, l.seq, l.enqueued_ms, l.attempts),
                o => panic!("{o:?}"),
            }
        };
        let item = Value::BulkString(b"\x01ord-7\nmain\n42\n1700\n{\"x\":1}".to_vec());
        assert_eq!(
            leased(item.clone(), Value::Nil),
            ("{\"x\":1}".into(), 42, 1700, 0)
        );
        // a record's payload comes with its seq
        assert_eq!(leased(bulk("{}"), Value::Int(5)), ("{}".into(), 5, 0, 0));
        // an item that does not parse is a payload that does not decode
        let garbage = Value::BulkString(b"\x01ord-7".to_vec());
        assert_eq!(leased(garbage, Value::Nil), ("\u{1}ord-7".into(), 0, 0, 0));
    }

    #[test]
    fn a_batch_reply_names_each_lease_by_its_lease_and_reads_the_rest_from_its_item() {
        let q = QueueId::Shard(0);
        let lease = |id: &str| bulk(&format!("20000\n1700\n{id}\nacme\nw.1"));
        let v = Value::Array(vec![
            Value::Int(3),
            bulk("OSO"),
            Value::Nil,
            Value::Int(3),
            Value::Int(61_700),
            // stored whole
            lease("a-1"),
            Value::BulkString(b"\x01a-1\nmain\n42\n1700\n{\"x\":1}".to_vec()),
            Value::Nil,
            // a record's (a retry), a probe of a half-open breaker
            lease("a-2"),
            bulk("{}"),
            Value::Array(vec![bulk("2"), bulk("43"), bulk("1600"), bulk("half-open")]),
            // stored whole, with a breaker change
            lease("a-3"),
            Value::BulkString(b"\x01a-3\nmain\n44\n1800\n{}".to_vec()),
            Value::Array(vec![Value::Nil, Value::Nil, Value::Nil, bulk("half-open")]),
            bulk("EMPTY"),
            Value::Int(250),
        ]);
        let b = lease_batch_reply(q, v, 3, 4).unwrap();
        assert_eq!(
            b.acked.iter().map(|a| a.acked).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert!(b.acked.iter().all(|a| a.breaker.is_none()));
        let got: Vec<_> = b
            .leased
            .iter()
            .map(|l| {
                (
                    l.id.as_str(),
                    l.tenant.as_str(),
                    l.payload.as_str(),
                    l.attempts,
                    l.seq,
                    l.enqueued_ms,
                    l.deadline_ms,
                    l.breaker,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("a-1", "acme", "{\"x\":1}", 0, 42, 1700, 61_700, None),
                (
                    "a-2",
                    "acme",
                    "{}",
                    2,
                    43,
                    1600,
                    61_700,
                    Some(BreakerChange::HalfOpen)
                ),
                (
                    "a-3",
                    "acme",
                    "{}",
                    0,
                    44,
                    1800,
                    61_700,
                    Some(BreakerChange::HalfOpen)
                ),
            ]
        );
        assert_eq!(b.leased[0].token, "20000\n1700\na-1\nacme\nw.1");
        assert_eq!(
            b.short,
            Some(LeaseOutcome::Empty {
                retry_after: Duration::from_millis(250)
            })
        );
        // the acks' breaker changes, when one changed
        let v = Value::Array(vec![
            Value::Int(2),
            bulk("OO"),
            Value::Array(vec![bulk(""), bulk("closed")]),
            Value::Int(0),
            Value::Int(1),
        ]);
        let b = lease_batch_reply(q, v, 2, 1).unwrap();
        assert_eq!(b.acked[1].breaker, Some(BreakerChange::Closed));
        assert_eq!(b.acked[0].breaker, None);
        assert!(b.leased.is_empty() && b.short.is_none());
    }

    #[test]
    fn a_batch_reply_of_the_wrong_shape_is_a_protocol_error() {
        let q = QueueId::Shard(0);
        let ok_lease = || {
            vec![
                bulk("1\n2\nid\nt\nw.1"),
                bulk("\x01id\nmain\n1\n2\n{}"),
                Value::Nil,
            ]
        };
        let head = |n: i64, codes: &str, m: i64| {
            vec![
                Value::Int(n),
                bulk(codes),
                Value::Nil,
                Value::Int(m),
                Value::Int(9),
            ]
        };
        let with = |mut h: Vec<Value>, rest: Vec<Value>| {
            h.extend(rest);
            Value::Array(h)
        };
        for (what, v, n, k) in [
            ("codes shorter than n", with(head(2, "O", 0), vec![]), 2, 1),
            ("n not the acks sent", with(head(1, "O", 0), vec![]), 2, 1),
            (
                "more leases than asked",
                with(head(0, "", 1), ok_lease()),
                0,
                0,
            ),
            (
                "a lease cut short",
                with(head(0, "", 1), ok_lease()[..2].to_vec()),
                0,
                1,
            ),
            (
                "a lease that names nothing",
                with(
                    head(0, "", 1),
                    vec![bulk("no-newlines"), bulk("{}"), Value::Nil],
                ),
                0,
                1,
            ),
            (
                "extra of the wrong shape",
                with(
                    head(0, "", 1),
                    vec![bulk("1\n2\nid\nt\nw"), bulk("{}"), bulk("x")],
                ),
                0,
                1,
            ),
            (
                "changes of the wrong length",
                {
                    let mut h = head(2, "OO", 0);
                    h[2] = Value::Array(vec![bulk("")]);
                    Value::Array(h)
                },
                2,
                1,
            ),
            (
                "too short for its header",
                Value::Array(vec![Value::Int(0), bulk("")]),
                0,
                1,
            ),
        ] {
            assert!(
                matches!(
                    lease_batch_reply(q, v, n, k),
                    Err(StoreError::Protocol { .. })
                ),
                "{what}"
            );
        }
    }

    #[test]
    fn an_enqueue_reply_of_the_wrong_length_fails_the_call_and_a_bad_code_its_envelope() {
        let v = Value::Array(vec![
            Value::Int(6),
            bulk("OHDFTSMX"),
            Value::Int(9),
            Value::Int(42),
            bulk("250"),
            bulk(&QueueId::Shard(1).to_string()),
        ]);
        let out = enqueue_reply(v, 8).unwrap();
        let ok: Vec<_> = out[..7]
            .iter()
            .map(|o| o.as_ref().unwrap().clone())
            .collect();
        assert_eq!(
            ok,
            [
                EnqueueOutcome::Queued { seq: 7 },
                EnqueueOutcome::Held { seq: 8 },
                EnqueueOutcome::Duplicate,
                EnqueueOutcome::Full { depth: 9 },
                EnqueueOutcome::Stale { fence: 42 },
                EnqueueOutcome::Shaped {
                    retry_after: Duration::from_millis(250)
                },
                EnqueueOutcome::Moved(QueueId::Shard(1)),
            ]
        );
        assert!(matches!(
            out[7],
            Err(StoreError::Protocol {
                script: "enqueue",
                ..
            })
        ));
        // a code without its value is its envelope's error
        let v = Value::Array(vec![Value::Int(0), bulk("OF")]);
        let out = enqueue_reply(v, 2).unwrap();
        assert!(out[0].is_ok() && out[1].is_err());
        let short = Value::Array(vec![Value::Int(0), bulk("O")]);
        assert!(matches!(
            enqueue_reply(short, 2),
            Err(StoreError::Protocol {
                script: "enqueue",
                ..
            })
        ));
    }

    #[test]
    fn a_nack_reply_carries_attempts_due_time_and_breaker_change() {
        let v = Value::Array(vec![
            bulk("RETRY"),
            Value::Int(3),
            bulk("1234"),
            bulk("open"),
        ]);
        assert_eq!(
            nack_reply(v).unwrap(),
            NackOutcome::Retry {
                attempts: 3,
                due_ms: 1234,
                breaker: Some(BreakerChange::Opened)
            }
        );
        let dead = Value::Array(vec![bulk("DEAD"), Value::Int(5), Value::Int(0), bulk("")]);
        assert_eq!(
            nack_reply(dead).unwrap(),
            NackOutcome::Dead {
                attempts: 5,
                breaker: None
            }
        );
        assert!(nack_reply(Value::Array(vec![bulk("?")])).is_err());
    }

    #[test]
    fn a_status_reply_has_eight_fields() {
        let mut fields = vec![1, 2, 3, 4, 1]
            .into_iter()
            .map(Value::Int)
            .collect::<Vec<_>>();
        fields.push(bulk(""));
        fields.push(Value::Int(10));
        fields.push(Value::Int(0));
        let state = status_reply(Value::Array(fields.clone())).unwrap();
        assert_eq!(
            state,
            TenantQueueState {
                queued: 1,
                in_flight: 2,
                delayed: 3,
                held: 4,
                paused: true,
                moved_to: None,
                depth: 10,
                user_paused: false,
            }
        );
        fields.pop();
        assert!(status_reply(Value::Array(fields)).is_err());
    }

    #[test]
    fn a_gate_that_makes_a_reshard_wait_names_the_moving_lanes() {
        let wait = Value::Array(vec![bulk("WAIT"), bulk("lane-a"), bulk("lane-b")]);
        assert_eq!(
            gate_reshard_begin_reply(wait).unwrap(),
            Err(vec!["lane-a".to_string(), "lane-b".to_string()])
        );
        assert_eq!(
            gate_reshard_begin_reply(Value::Array(vec![bulk("OK")])).unwrap(),
            Ok(())
        );
        assert!(gate_reshard_begin_reply(Value::Array(vec![])).is_err());
    }

    #[test]
    fn export_hold_rows_are_six_fields_each() {
        let v = Value::Array(
            ["a", "1", "0", "{}", "5", "", "b", "2", "1", "{}", "6", "ep"]
                .iter()
                .map(|s| bulk(s))
                .collect(),
        );
        let rows = export_hold_reply(v).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1][0], b"b".to_vec());
        assert_eq!(rows[1][5], b"ep".to_vec());
    }
}
