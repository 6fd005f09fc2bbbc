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
}

impl<'a> Failure<'a> {
    /// Retry after `after`.
    pub fn retry(cause: &'a str, after: Duration) -> Self {
        Self {
            cause,
            retry_in: Some(after),
            endpoint_fault: false,
        }
    }

    /// Dead-letter now.
    pub fn dead(cause: &'a str) -> Self {
        Self {
            cause,
            retry_in: None,
            endpoint_fault: false,
        }
    }

    /// Count this failure against the endpoint's circuit breaker.
    pub fn blame_endpoint(self) -> Self {
        Self {
            endpoint_fault: true,
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
}

impl TenantQueueState {
    /// Nothing of the tenant is queued, in flight or waiting to retry here.
    pub fn drained(&self) -> bool {
        self.queued == 0 && self.in_flight == 0 && self.delayed == 0
    }
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

/// Per-tenant attribution in one queue.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantStats {
    pub tenant: String,
    /// Outstanding: queued, held, waiting to retry or in flight.
    pub depth: u64,
    pub delivered: u64,
    pub failed: u64,
    /// Worker-seconds consumed over the window asked for.
    pub worker_seconds: f64,
}

pub(super) fn parse_lease(q: QueueId, items: &[Value]) -> Result<LeaseOutcome> {
    match tag(items).as_deref() {
        Some("LEASED") if items.len() == 10 => Ok(LeaseOutcome::Leased(Lease {
            queue: q,
            id: string(&items[1]),
            tenant: string(&items[2]),
            payload: string(&items[3]),
            attempts: int(&items[4]) as u32,
            seq: int(&items[5]),
            token: string(&items[6]),
            deadline_ms: int(&items[7]),
            enqueued_ms: int(&items[8]),
            breaker: BreakerChange::parse(items.get(9)),
        })),
        Some("EMPTY") => Ok(LeaseOutcome::Empty {
            retry_after: Duration::from_millis(items.get(1).map(int).unwrap_or(1000)),
        }),
        Some("AGAIN") => Ok(LeaseOutcome::Again),
        _ => Err(unexpected("lease", items)),
    }
}

pub(super) fn parse_enqueue(tag: &Value, value: &Value) -> Result<EnqueueOutcome> {
    match string(tag).as_str() {
        "OK" => Ok(EnqueueOutcome::Queued { seq: int(value) }),
        "HELD" => Ok(EnqueueOutcome::Held { seq: int(value) }),
        "DUP" => Ok(EnqueueOutcome::Duplicate),
        "FULL" => Ok(EnqueueOutcome::Full { depth: int(value) }),
        "STALE" => Ok(EnqueueOutcome::Stale { fence: int(value) }),
        "MOVED" => string(value)
            .parse()
            .map(EnqueueOutcome::Moved)
            .map_err(|e| StoreError::Protocol {
                script: "enqueue",
                detail: format!("MOVED to {e}"),
            }),
        _ => Err(unexpected("enqueue", &[tag.clone(), value.clone()])),
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
