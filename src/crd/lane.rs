use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::WorkerOverrides;

/// Desired state of one tenant on a lane of its own.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "lanekeeper.io",
    version = "v1alpha1",
    kind = "DedicatedLane",
    plural = "dedicatedlanes",
    singular = "dedicatedlane",
    shortname = "dl",
    category = "lanekeeper",
    namespaced,
    status = "DedicatedLaneStatus",
    derive = "PartialEq",
    validation = Rule::new("self.metadata.name.size() <= 230").message("metadata.name must be at most 230 characters: Events about the lane are named <name>.<16 hex digits> and an object name may have at most 253"),
    doc = "A DedicatedLane moves one hot tenant of a ShardSet onto a worker Deployment of its own (`<set>-lane-<i>`), with pause, drain and repin so the tenant's order holds. The promotion controller creates them; you may too, for a known whale.",
    printcolumn(
        name = "ShardSet",
        type_ = "string",
        json_path = ".spec.shardSet",
        priority = 1
    ),
    printcolumn(
        name = "Tenant",
        type_ = "string",
        json_path = ".spec.tenant",
        description = "The tenant on this lane"
    ),
    printcolumn(
        name = "Lane",
        type_ = "integer",
        json_path = ".status.laneIndex",
        description = "Lane index under the set's cap"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Relocation phase"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "The Ready condition"
    ),
    printcolumn(
        name = "Held",
        type_ = "integer",
        json_path = ".status.heldEnvelopes",
        priority = 1,
        description = "Envelopes in the hold buffer while paused"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct DedicatedLaneSpec {
    /// Name of the ShardSet, in this namespace, whose tenant this lane serves.
    /// Immutable.
    #[x_kube(validation = Rule::new("self != ''").message("shardSet must not be empty"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("shardSet is immutable; create a new DedicatedLane instead"))]
    #[schemars(length(max = 253))]
    pub shard_set: String,

    /// The tenant moved onto this lane. Immutable.
    #[x_kube(validation = Rule::new("self != ''").message("tenant must not be empty"))]
    #[x_kube(validation = Rule::new(super::TENANT_SYNTAX).message("tenant must start with a letter or digit and contain only letters, digits, '.', '_', ':' and '-'"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("tenant is immutable; create a new DedicatedLane instead"))]
    #[schemars(length(max = 128))]
    pub tenant: String,

    /// Worker settings for this lane, over the set's lane template and worker template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerOverrides>,

    /// Set to true to demote: the tenant is drained back to its hash shard,
    /// then the lane Deployment is removed and its index freed.
    #[serde(default)]
    pub retire: bool,
}

/// Where a DedicatedLane is in its relocation.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum LanePhase {
    /// Waiting for a lane index under the cap.
    #[default]
    Pending,
    /// The tenant is being paused in its source queue; new envelopes go to its hold buffer.
    Pausing,
    /// Waiting until nothing of the tenant is queued or in flight in the source queue.
    Draining,
    /// Routing pin moved to the target queue; the source answers MOVED.
    Repinning,
    /// The target's worker Deployment is being created and made available.
    Scaling,
    /// The tenant is served by its lane.
    Active,
    /// The tenant is being moved back to its hash shard.
    Retiring,
    /// The tenant is back on its hash shard, the lane Deployment removed and
    /// its index freed. A lane the promotion controller made is then deleted.
    Retired,
    /// Relocation cannot proceed; see the conditions.
    Failed,
}

/// Observed state of a DedicatedLane, written by the controller.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DedicatedLaneStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Relocation phase. Each step is idempotent, so a restarted controller resumes here.
    #[serde(default)]
    pub phase: LanePhase,

    /// Lane index (0 to 7) under the set's cap, once admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_index: Option<i32>,

    /// Queue the tenant is moving out of (`shard-07` on promotion, `lane-3` on retirement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_queue: Option<String>,

    /// Queue the tenant is moving into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_queue: Option<String>,

    /// Envelopes held while the tenant is paused; appended in order on resume.
    #[serde(default)]
    pub held_envelopes: i64,

    /// When the current phase began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_since: Option<Time>,

    /// When the tenant was paused for the current move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<Time>,

    /// When the tenant last became Active on its lane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_since: Option<Time>,

    /// Aborted drains since the last successful move; drives retry backoff.
    #[serde(default)]
    pub drain_attempts: i32,

    /// Earliest time the next drain is attempted after a `DrainTimeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Time>,

    /// The move waits for a reshard of the set to finish (lane moves and
    /// reshards of one set take turns, so they never interleave).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub waiting_for_reshard: bool,

    /// `Ready`, `Relocating` and `Admitted`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}
