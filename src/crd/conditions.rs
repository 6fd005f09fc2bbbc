//! Every condition type and reason lanekeeper writes to status (and the
//! reasons of its Events): part of the API, spelt once. Tests that pin the
//! wire values spell them out on purpose.

// Condition types of ShardSets and DedicatedLanes.

pub const READY: &str = "Ready";
pub const DEGRADED: &str = "Degraded";
pub const PROGRESSING: &str = "Progressing";
pub const LANE_CAP_REACHED: &str = "LaneCapReached";
pub const RESHARDING: &str = "Resharding";
pub const SCALED_TO_ZERO: &str = "ScaledToZero";
pub const REDIS_NOT_PERSISTENT: &str = "RedisNotPersistent";
pub const REDIS_CHECKED: &str = "RedisChecked";
pub const REDIS_STATE_LOST: &str = "RedisStateLost";
pub const ADMITTED: &str = "Admitted";
pub const RELOCATING: &str = "Relocating";
pub const DRAINING: &str = "Draining";

// Reasons.
pub const INVALID_SPEC: &str = "InvalidSpec";
pub const DEPLOYMENT_FAILED: &str = "DeploymentFailed";
pub const WAITING_FOR_LANES: &str = "WaitingForLanes";
pub const IDLE: &str = "Idle";
pub const WAITING_FOR_SHARDS: &str = "WaitingForShards";
pub const MOVING_TENANTS: &str = "MovingTenants";
pub const REDIS_UNAVAILABLE: &str = "RedisUnavailable";
pub const REDIS_EVICTION_POLICY: &str = "RedisEvictionPolicy";
pub const AS_EXPECTED: &str = "AsExpected";
pub const ALL_SHARDS_AVAILABLE: &str = "AllShardsAvailable";
pub const NO_WORKERS: &str = "NoWorkers";
pub const SHARDS_UNAVAILABLE: &str = "ShardsUnavailable";
pub const ROLLING_OUT: &str = "RollingOut";
pub const COMPLETE: &str = "Complete";
pub const OVER_CAP: &str = "OverCap";
pub const UNDER_CAP: &str = "UnderCap";
pub const BELOW_CAP: &str = "BelowCap";
pub const AUTOSCALED_TO_ZERO: &str = "AutoscaledToZero";
pub const SERVING: &str = "Serving";
pub const NO_PERSISTENCE: &str = "NoPersistence";
pub const PERSISTENT: &str = "Persistent";
pub const PERSISTENCE_UNKNOWN: &str = "PersistenceUnknown";
pub const CONFIG_GET: &str = "ConfigGet";
pub const CONFIG_GET_REFUSED: &str = "ConfigGetRefused";
pub const READ_FAILED: &str = "ReadFailed";
pub const ROUTING_TABLE_MISSING: &str = "RoutingTableMissing";
pub const STATE_PRESENT: &str = "StatePresent";
pub const RESHARDED: &str = "Resharded";
pub const DRAIN_TIMEOUT: &str = "DrainTimeout";
pub const REPINNED: &str = "Repinned";
pub const PASSWORD_NOT_WITH_URL: &str = "PasswordNotWithURL";
pub const ENV_NOT_ALLOWED: &str = "EnvNotAllowed";
pub const TOLERATION_NOT_ALLOWED: &str = "TolerationNotAllowed";
pub const SERVICE_ACCOUNT_NOT_ALLOWED: &str = "ServiceAccountNotAllowed";
pub const SECRET_NOT_ALLOWED: &str = "SecretNotAllowed";
pub const IMAGE_NOT_ALLOWED: &str = "ImageNotAllowed";
pub const PRIORITY_CLASS_NOT_ALLOWED: &str = "PriorityClassNotAllowed";
pub const DUPLICATE_TENANT: &str = "DuplicateTenant";
pub const WAITING_FOR_RESHARD: &str = "WaitingForReshard";
pub const SHARD_SET_NOT_FOUND: &str = "ShardSetNotFound";
pub const TIER_ASSIGNMENTS_SYNCED: &str = "TierAssignmentsSynced";
/// Event: `spec.tenants[].paused` paused or resumed a tenant.
pub const PAUSED_BY_SPEC: &str = "PausedBySpec";
pub const RESUMED_BY_SPEC: &str = "ResumedBySpec";
/// Event: a pause or resume `spec.tenants` asks for could not be applied.
pub const TENANT_OVERRIDE_FAILED: &str = "TenantOverrideFailed";
pub const INVALID_TIER_ASSIGNMENTS: &str = "InvalidTierAssignments";
pub const TIER_CONFIG_MAP_NOT_FOUND: &str = "TierConfigMapNotFound";
pub const TIER_CONFIG_MAP_NOT_ALLOWED: &str = "TierConfigMapNotAllowed";
