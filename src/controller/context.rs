//! The reconcilers' shared state: the API client, the Event recorders, the
//! per-set Redis connections, backoff and memos.

use super::connections::CachedStore;
use super::shardset::{Applied, ReshardMemory};
use crate::controller::build::WorkerPolicy;
use crate::controller::build::FIELD_MANAGER;
use crate::crd::ShardSet;
use crate::store::SetId;
use kube::runtime::events::Event;
use kube::runtime::events::EventType;
use kube::runtime::events::Recorder;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ObjectRef;
use kube::Client;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use tracing::{info, warn};

/// Shared state of the reconcilers.
pub struct Context {
    pub client: Client,
    /// Event recorders, one per note: kube-runtime aggregates a repeated
    /// Event into a series only within one Recorder (a Recorder per Event
    /// made every repeat a new Event), and its series key leaves the note
    /// out, so a different note would update the first Event's count and
    /// keep its old note. One Recorder per note repeats what client-go does
    /// (its key includes the note): the same Event again is a series, a new
    /// note a new Event.
    pub(crate) recorders: Mutex<HashMap<u64, Recorder>>,
    /// Per set, its Redis connection (or connect failure), reused across
    /// reconciles; pruned when the set goes, replaced when its target changes.
    pub(crate) stores: Mutex<HashMap<SetId, CachedStore>>,
    /// Consecutive failures per object, for bounded exponential backoff.
    pub(crate) failures: Mutex<HashMap<ObjectRef<ShardSet>, u32>>,
    /// What this process last applied to each shard Deployment, so an
    /// unchanged one is not applied again at every resync.
    pub(crate) applied: Mutex<HashMap<(String, String), Applied>>,
    /// Lane indexes are handed out one at a time.
    pub(crate) admission: tokio::sync::Mutex<()>,
    /// Per set: the reshard under way, as this process last decided it.
    pub(crate) reshards:
        Mutex<HashMap<ObjectRef<ShardSet>, Arc<tokio::sync::Mutex<ReshardMemory>>>>,
    pub metrics: crate::telemetry::ControllerMetrics,
    /// What the operator lets a ShardSet's worker template ask for.
    pub worker_policy: WorkerPolicy,
}

impl Context {
    pub fn new(client: Client, metrics: crate::telemetry::ControllerMetrics) -> Self {
        Self {
            recorders: Mutex::default(),
            client,
            stores: Mutex::default(),
            failures: Mutex::default(),
            applied: Mutex::default(),
            admission: tokio::sync::Mutex::new(()),
            reshards: Mutex::default(),
            metrics,
            worker_policy: WorkerPolicy::default(),
        }
    }

    /// The operator's limits on worker templates.
    pub fn with_worker_policy(mut self, policy: WorkerPolicy) -> Self {
        self.worker_policy = policy;
        self
    }

    /// Drop the connections of sets not in `live` (the promotion loop's
    /// list of every set in scope).
    pub(crate) fn prune_stores(&self, live: &std::collections::HashSet<SetId>) {
        self.stores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, _| {
                let keep = live.contains(id);
                if !keep {
                    info!(namespace = %id.namespace, set = %id.name, "the set is gone: its Redis connection is closed");
                }
                keep
            });
    }
}

/// Distinct Event notes remembered for aggregation.
const MAX_RECORDERS: usize = 4096;
impl Context {
    /// Record an Event about `object` through the shared recorder (repeats
    /// aggregate); a failure to record is logged, never the reconcile's.
    pub async fn event(
        &self,
        object: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note.chars().take(1000).collect()),
            action: action.to_string(),
            secondary: None,
        };
        let recorder = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            event.note.hash(&mut h);
            let mut all = self.recorders.lock().unwrap_or_else(|e| e.into_inner());
            if all.len() >= MAX_RECORDERS {
                // Bounded: forgetting only costs a new Event for a repeat.
                all.clear();
            }
            all.entry(h.finish())
                .or_insert_with(|| {
                    Recorder::new(self.client.clone(), Reporter::from(FIELD_MANAGER))
                })
                .clone()
        };
        if let Err(e) = recorder.publish(&event, object).await {
            warn!(error = %e, reason, "cannot record an event");
        }
    }
}
