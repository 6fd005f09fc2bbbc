//! The `ShardSet` resource: its spec, each field's schema and CEL rules
//! (the messages name the field), defaults, and its status.
//!
//! Over 700 lines on purpose: it is one resource's API, and most lines are
//! field docs and validation attributes that `kubectl explain` and the API
//! server show; split across files it would be harder to review against
//! the generated `crds/shardset.yaml`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::core::Duration;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Desired state of one webhook-delivery pool: its shards, the Redis that
/// holds its queues, the workers that drain them, and the fairness and
/// promotion policy that keeps one tenant's flood from delaying the others.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "lanekeeper.io",
    version = "v1alpha1",
    kind = "ShardSet",
    plural = "shardsets",
    singular = "shardset",
    shortname = "shs",
    category = "lanekeeper",
    namespaced,
    status = "ShardSetStatus",
    derive = "PartialEq",
    validation = Rule::new("self.metadata.name.size() <= 52").message("metadata.name must be at most 52 characters: it prefixes the shard and lane Deployment names (<name>-shard-NNNN), which must fit a 63-character label"),
    doc = "A ShardSet is one webhook-delivery pool: envelopes are routed onto its shards by rendezvous hashing of the tenant, and each shard's workers serve tenants fairly by deficit round robin priced in worker-seconds. Hot tenants are promoted to DedicatedLanes.",
    printcolumn(
        name = "Shards",
        type_ = "integer",
        json_path = ".spec.shards",
        description = "Shards requested in spec"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.readySummary",
        description = "Shards whose worker Deployment is available, of those desired"
    ),
    printcolumn(
        name = "Lanes",
        type_ = "string",
        json_path = ".status.laneSummary",
        description = "Dedicated lanes admitted, of the cap"
    ),
    printcolumn(
        name = "Skew",
        type_ = "number",
        json_path = ".status.skewRatio",
        description = "Max/median shard throughput over the promotion window; 1.0 is perfectly even"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "The Ready condition"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("(has(self.isolation) ? self.isolation : 'Tenant') == (has(oldSelf.isolation) ? oldSelf.isolation : 'Tenant')").message("isolation is immutable: Tenant and Endpoint lay out the queues differently; create a new ShardSet instead").field_path(".isolation").reason(Reason::FieldValueForbidden))]
#[x_kube(validation = Rule::new("!has(self.scheduler) || !has(self.scheduler.maxInFlightPerEndpoint) || (has(self.isolation) && self.isolation == 'Endpoint')").message("scheduler.maxInFlightPerEndpoint needs isolation: Endpoint (under Tenant isolation a tenant has one cap, scheduler.maxInFlightPerTenant)").field_path(".scheduler.maxInFlightPerEndpoint").reason(Reason::FieldValueForbidden))]
#[serde(rename_all = "camelCase")]
pub struct ShardSetSpec {
    /// Number of shards (hash queues) tenants are spread over, 1 to 1024.
    /// Each shard gets its own worker Deployment named `<set>-shard-<NN>`.
    /// Changing it is a migration: only tenants whose rendezvous hash moves are
    /// relocated, one at a time, with drain-then-move so per-tenant order holds.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1024").message("shards must be between 1 and 1024"))]
    pub shards: i32,

    /// Where the queues live. All shards and lanes of this set share it.
    pub redis: RedisSpec,

    /// The worker pods that deliver webhooks, one Deployment per shard.
    pub worker: WorkerTemplate,

    /// Fairness policy inside each shard.
    #[serde(default)]
    pub scheduler: SchedulerSpec,

    /// What the fair scheduler isolates inside each queue: `Tenant`
    /// (default) or `Endpoint`. Fixed for the set's life: the API server
    /// refuses a change (adding or removing the field included, when that
    /// changes the value); create a new ShardSet instead.
    ///
    /// `Tenant`: one FIFO lane and one in-flight cap
    /// (`scheduler.maxInFlightPerTenant`) per tenant. A tenant's slow or
    /// failing endpoint can fill its cap and hold back its other endpoints.
    /// Order: with `ordering: PerTenant`, a tenant's deliveries happen
    /// strictly in enqueue order (one in flight); with `None`, they start in
    /// enqueue order but may overlap and finish out of order, and retries
    /// may pass later envelopes.
    ///
    /// `Endpoint`: one FIFO lane and one in-flight cap
    /// (`scheduler.maxInFlightPerEndpoint`; default half the tenant's cap,
    /// rounded up) per (tenant, endpoint). An open breaker, a receiver's
    /// Retry-After or an endpoint rate limit parks only that endpoint; the
    /// tenant's other endpoints keep flowing. The tenant's own cap still
    /// bounds it over all its endpoints. Fairness between tenants stays per
    /// tenant (deficit round robin in worker-seconds): a tenant's share does
    /// not grow with its number of endpoints; its endpoints share its turns
    /// by worker-seconds. Order: with `ordering: PerTenant`, strictly in
    /// enqueue order per (tenant, endpoint) (one in flight per endpoint, up
    /// to the tenant's cap across its endpoints), with no order between a
    /// tenant's different endpoints; with `None`, they start in enqueue
    /// order per (tenant, endpoint) and may overlap.
    ///
    /// Either way, order survives moves (promotion to a dedicated lane,
    /// reshard). Routing to shards stays by tenant.
    #[serde(default)]
    pub isolation: Isolation,

    /// How one webhook is delivered: timeouts, retries and the per-endpoint circuit breaker.
    #[serde(default)]
    pub delivery: DeliverySpec,

    /// When tenants are promoted to, and demoted from, dedicated lanes.
    #[serde(default)]
    pub promotion: PromotionSpec,

    /// How a tenant is moved between queues (lane promotion, demotion and resharding).
    #[serde(default)]
    pub relocation: RelocationSpec,

    /// Per-tenant overrides kept in Git for known whales and VIPs, at most
    /// 1000, one entry per tenant: weight, tier, in-flight cap, delivery
    /// rate limit, paused. Each wins over the set-wide setting of the same
    /// thing (`scheduler.weights`, the tier ConfigMap, `scheduler.rateLimits`);
    /// a tier set through the admin API wins over this one. Applied at the
    /// next reconcile and shown in `status.tenantOverrides`. `paused: true`
    /// holds the tenant paused (a resume by hand is undone at the next
    /// reconcile, with an Event); removing it, or setting it false, resumes
    /// the tenant once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tenant".into()]))]
    #[schemars(length(max = 1000))]
    pub tenants: Vec<TenantOverride>,
}

/// One tenant's overrides (`spec.tenants[]`). Unset fields leave the
/// set-wide setting in force.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenantOverride {
    /// Tenant id.
    // A pattern, not CEL: a list of 1000 regex rules would blow the CEL cost budget.
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    )]
    pub tenant: String,
    /// Scheduling weight, 0.01 to 1000 (over `scheduler.weights`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.01 && self <= 1000.0").message("tenants[].weight must be at least 0.01 and at most 1000"))]
    pub weight: Option<f64>,
    /// Tier name (over the tier ConfigMap; the admin API's wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub tier: Option<String>,
    /// Deliveries in flight at once, 1 to 1000 (over
    /// `scheduler.maxInFlightPerTenant`; under `PerTenant` ordering with
    /// `Tenant` isolation every tenant's cap stays 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1000").message("tenants[].maxInFlight must be between 1 and 1000"))]
    pub max_in_flight: Option<i32>,
    /// Delivery rate limit (over `scheduler.rateLimits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitSpec>,
    /// Hold the tenant paused (`true`), as `lanekeeper tenant pause` does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
}

/// Connection to the Redis server or Redis Cluster that holds this set's
/// queues. Give exactly one of `url` and `urlSecretRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.url) != has(self.urlSecretRef)").message("redis: set exactly one of url and urlSecretRef"))]
#[x_kube(validation = Rule::new("!has(self.passwordSecretRef) || (has(self.urlSecretRef) && self.urlSecretRef.name == self.passwordSecretRef.name)").message("redis.passwordSecretRef must name the same Secret as redis.urlSecretRef: a password from a Secret goes only to the URL stored with it"))]
#[x_kube(validation = Rule::new("!has(self.username) || has(self.passwordSecretRef)").message("redis.username needs redis.passwordSecretRef: an ACL user authenticates with a password"))]
#[x_kube(validation = Rule::new("!has(self.tls) || !has(self.url) || self.url.startsWith('rediss')").message("redis.tls needs a rediss:// or rediss+cluster:// url"))]
#[serde(rename_all = "camelCase")]
pub struct RedisSpec {
    /// Redis URL without credentials, e.g. `redis://redis.lanekeeper.svc:6379/0`,
    /// or `rediss://` for TLS. For a Redis Cluster, list seed nodes after
    /// `redis+cluster://` (or `rediss+cluster://`), e.g.
    /// `redis+cluster://redis-0.redis:6379,redis-1.redis:6379` (database 0
    /// only), or set `cluster: true`. Put credentials in `passwordSecretRef`,
    /// or use `urlSecretRef` instead, never inline here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^rediss?([+]cluster)?://')").message("redis.url must start with redis://, rediss://, redis+cluster:// or rediss+cluster://"))]
    #[x_kube(validation = Rule::new("!self.matches('^rediss?([+]cluster)?://[^/@]*@')").message("redis.url must not carry credentials; use passwordSecretRef or urlSecretRef"))]
    #[schemars(length(max = 2048))]
    pub url: Option<String>,

    /// A key of a Secret in this namespace whose value is the full Redis URL,
    /// credentials included. The Secret is mounted into worker pods by
    /// reference; its value is never copied into a Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,

    /// A key of a Secret in this namespace holding the Redis password, for a
    /// URL without one. Must name the same Secret as `urlSecretRef`: a
    /// password goes only to the URL stored with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,

    /// Treat the endpoint as a Redis Cluster and connect with the cluster client,
    /// which follows MOVED/ASK redirects and failovers: `redis://host:port`
    /// is used as `redis+cluster://host:port`. Not needed with a
    /// `redis+cluster://` URL.
    #[serde(default)]
    pub cluster: bool,

    /// ACL user name (Redis 6+ `ACL SETUSER`), authenticated with the
    /// password of `passwordSecretRef`. Without it, the password is the
    /// `default` user's. See the README for the minimal ACL lanekeeper needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0 && !self.contains(' ')").message("redis.username must be non-empty, without spaces"))]
    #[schemars(length(max = 128))]
    pub username: Option<String>,

    /// TLS for a `rediss://` URL: the CA to verify the server with (instead
    /// of the system roots) and a client certificate. Without it a
    /// `rediss://` URL is verified against the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RedisTlsSpec>,

    /// What ingest's 202 means. `Fast` (default): the envelope is on the
    /// Redis primary; a failover before it reaches a replica loses it.
    /// `Replicated`: ingest waits until at least one replica has it (`WAIT 1`)
    /// and answers 503 when none acknowledges within `replicaAckTimeout`,
    /// at the cost measured in the README.
    #[serde(default)]
    pub durability: Durability,

    /// With `durability: Replicated`, the longest wait for a replica's
    /// acknowledgement before ingest answers 503, e.g. `1s`.
    #[serde(default = "default_replica_ack_timeout")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("redis.replicaAckTimeout must be a duration such as 1s or 500ms"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("redis.replicaAckTimeout must be positive"))]
    #[schemars(length(max = 32))]
    pub replica_ack_timeout: Duration,
}

fn default_replica_ack_timeout() -> Duration {
    secs(1)
}

impl Default for RedisSpec {
    fn default() -> Self {
        Self {
            url: None,
            url_secret_ref: None,
            password_secret_ref: None,
            cluster: false,
            username: None,
            tls: None,
            durability: Durability::Fast,
            replica_ack_timeout: default_replica_ack_timeout(),
        }
    }
}

/// What an accepted envelope survives.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum Durability {
    /// Acknowledged once the Redis primary holds it.
    #[default]
    Fast,
    /// Acknowledged once at least one replica holds it too.
    Replicated,
}

/// TLS material of a `rediss://` connection, from Secrets in the ShardSet's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RedisTlsSpec {
    /// A key of a Secret holding the PEM CA certificate(s) that signed the
    /// Redis server's certificate (e.g. key `ca.crt`), trusted instead of the
    /// system roots. Mounted into worker pods; never copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,

    /// A Secret of type `kubernetes.io/tls` (keys `tls.crt` and `tls.key`)
    /// holding the client certificate for a Redis that asks for one
    /// (`tls-auth-clients yes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<SecretNameRef>,
}

/// A Secret in the ShardSet's namespace, by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretNameRef {
    /// Name of the Secret.
    #[x_kube(validation = Rule::new("self != ''").message("secret name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// A reference to one key of a Secret in the ShardSet's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[x_kube(validation = Rule::new("self != ''").message("secret name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
    /// Key within the Secret.
    #[x_kube(validation = Rule::new("self != ''").message("secret key must not be empty"))]
    #[schemars(length(max = 253))]
    pub key: String,
}

/// The worker pod template for every shard Deployment of the set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("!(self.autoscaled && has(self.replicas))").message("worker.replicas must be omitted when worker.autoscaled is true: the autoscaler owns replicas"))]
#[serde(rename_all = "camelCase")]
pub struct WorkerTemplate {
    /// Container image that runs `lanekeeper worker`, pinned by tag or digest.
    #[x_kube(validation = Rule::new("self != ''").message("worker.image must not be empty"))]
    #[schemars(length(max = 1024))]
    pub image: String,

    /// Image pull policy for the worker container (Always, IfNotPresent or Never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self in ['Always', 'IfNotPresent', 'Never']").message("worker.imagePullPolicy must be Always, IfNotPresent or Never"))]
    pub image_pull_policy: Option<String>,

    /// Worker pods per shard. Omit it when an autoscaler (KEDA, an HPA) owns
    /// replicas and set `autoscaled: true`; the operator then never writes
    /// `spec.replicas` and does not fight the autoscaler. Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("worker.replicas must not be negative"))]
    pub replicas: Option<i32>,

    /// True when an external autoscaler owns the replica count of shard Deployments.
    #[serde(default)]
    pub autoscaled: bool,

    /// Deliveries in flight per worker pod (tokio tasks). Total shard
    /// concurrency is replicas x concurrency.
    #[serde(default = "default_concurrency")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1024").message("worker.concurrency must be between 1 and 1024"))]
    pub concurrency: i32,

    /// Compute resources of the worker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Extra environment variables for the worker container. Not
    /// `LANEKEEPER_*` or `POD_NAME` (the controller sets those), nor the
    /// proxy variables or Secrets the operator does not allow (README,
    /// "Security model").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(e, !e.name.startsWith('LANEKEEPER_') && e.name != 'POD_NAME')").message("worker.env must not set LANEKEEPER_* or POD_NAME: the controller sets them"))]
    #[schemars(length(max = 256))]
    pub env: Vec<EnvVar>,

    /// Node labels the worker pods must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Tolerations of the worker pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// Affinity rules of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    /// PriorityClass of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,

    /// ServiceAccount the worker pods run as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

fn default_concurrency() -> i32 {
    16
}

/// Delivery order guarantee within one tenant.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum Ordering {
    /// Envelopes of one tenant may be delivered concurrently, up to `maxInFlightPerTenant`.
    #[default]
    None,
    /// Strict per-tenant order: one envelope in flight per tenant; a failing
    /// head envelope blocks only its own tenant.
    PerTenant,
}

/// What the fairness and the in-flight cap isolate inside a queue (`spec.isolation`).
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum Isolation {
    /// One FIFO lane and one in-flight cap per tenant; order per tenant.
    #[default]
    Tenant,
    /// One FIFO lane and one in-flight cap per (tenant, endpoint) inside
    /// the tenant's turns; fairness between tenants stays per tenant; order
    /// per (tenant, endpoint).
    Endpoint,
}

/// Fairness policy inside each queue: deficit round robin over the active
/// tenants, priced in worker-seconds.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerSpec {
    /// Worker-seconds of credit an active tenant of weight 1 earns per round.
    /// Larger quanta mean fewer ring rotations, coarser interleaving.
    #[serde(default = "default_quantum")]
    #[x_kube(validation = Rule::new("self >= 0.01 && self <= 3600.0").message("scheduler.quantumSeconds must be at least 0.01 (10 ms) and at most 3600: a smaller quantum takes thousands of ring turns per lease"))]
    pub quantum_seconds: f64,

    /// Most envelopes of one tenant leased at once in one queue. A tenant at its
    /// cap is skipped until one of its leases is acked. With `isolation:
    /// Endpoint` it bounds the tenant over all its endpoints, and each
    /// endpoint has its own cap too (`maxInFlightPerEndpoint`).
    #[serde(default = "default_max_in_flight")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 10000").message("scheduler.maxInFlightPerTenant must be between 1 and 10000"))]
    pub max_in_flight_per_tenant: i32,

    /// Only with `isolation: Endpoint` (refused otherwise): most envelopes
    /// of one (tenant, endpoint) leased at once in one queue, 1 to 10000.
    /// An endpoint at its cap is skipped while the tenant's other endpoints
    /// go on. Unset: half the tenant's cap (`maxInFlightPerTenant`, or the
    /// tenant's `tenants[].maxInFlight`), rounded up, so one slow endpoint
    /// can never hold all of its tenant's slots. Never above the tenant's
    /// cap: the smaller of the two applies. Under `ordering: PerTenant` it
    /// is 1 (strict order per endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 10000").message("scheduler.maxInFlightPerEndpoint must be between 1 and 10000"))]
    pub max_in_flight_per_endpoint: Option<i32>,

    /// Weight of tenants not listed in `weights` or `tierWeights`.
    #[serde(default = "default_weight")]
    #[x_kube(validation = Rule::new("self >= 0.01 && self <= 1000.0").message("scheduler.defaultWeight must be at least 0.01 and at most 1000"))]
    pub default_weight: f64,

    /// Per-tenant weights; a tenant's quantum is scaled by its weight.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tenant".into()]))]
    #[schemars(length(max = 10000))]
    pub weights: Vec<TenantWeight>,

    /// Per-tier weights. A tenant's tier comes from the ingest admin API
    /// (`PUT /v1/admin/tiers/{tenant}`, bulk `POST /v1/admin/tiers`) or from
    /// `tierAssignments`; the API's wins. A per-tenant weight wins over its
    /// tier's; a tenant with no tier, or a tier not listed here, gets
    /// `defaultWeight`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tier".into()]))]
    #[schemars(length(max = 64))]
    pub tier_weights: Vec<TierWeight>,

    /// `None` (default): up to `maxInFlightPerTenant` in flight per tenant.
    /// `PerTenant`: strict per-tenant order, one in flight per tenant; with
    /// `isolation: Endpoint`, strict order per (tenant, endpoint), one in
    /// flight per endpoint (see `spec.isolation`).
    #[serde(default)]
    pub ordering: Ordering,

    /// Delivery rate limits: token buckets per tenant and per tenant
    /// endpoint, checked when a worker leases, so a tenant out of tokens
    /// steps aside and its share of the workers goes to the others. A
    /// tenant's own entry wins over its tier's, which wins over `default`.
    /// Dedicated lanes apply their tenant's limits. Applied at the next
    /// lease after a change.
    #[serde(default, skip_serializing_if = "RateLimitsSpec::is_empty")]
    pub rate_limits: RateLimitsSpec,

    /// Tenants' tiers in bulk, from a ConfigMap in the set's namespace: one
    /// `<tenant> <tier>` line each (`#` comments and blank lines ignored),
    /// up to 100,000. Synced into Redis at each reconcile when the
    /// ConfigMap changed, all or nothing: a bad line keeps the last good
    /// assignments and says which line in an Event and in status. The
    /// controller reads only the ConfigMap names its RBAC allows (chart
    /// value `controller.tierConfigMapNames`). Unset: the ConfigMap's
    /// assignments are dropped (the admin API's stay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_assignments: Option<TierAssignmentsSpec>,

    /// How long a tenant may have no work and no traffic in a queue before
    /// its state there (counters, cost estimate, attribution entry, expired
    /// id claims) is swept, so tenants that come and go leave nothing
    /// behind (default `24h`; `0s`: never; else at least `1m`). Workers
    /// sweep in bounded steps; a tenant's dead letters, pause, weight and
    /// tier assignment are never swept, and a tenant that sends again starts
    /// from the defaults. Counted by `lanekeeper_tenants_swept_total`.
    #[serde(default = "default_sweep_idle")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("scheduler.sweepIdleTenantsAfter must be a duration such as 24h"))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || duration(self) == duration('0s') || (duration(self) >= duration('1m') && duration(self) <= duration('8760h'))").message("scheduler.sweepIdleTenantsAfter must be 0s (never) or between 1m and 8760h"))]
    #[schemars(length(max = 32))]
    pub sweep_idle_tenants_after: Duration,
}

/// Where `scheduler.tierAssignments` are read from.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TierAssignmentsSpec {
    /// ConfigMap name, in the set's namespace.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub config_map_name: String,
    /// Key of the ConfigMap's data holding the lines.
    #[serde(default = "default_tiers_key")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

fn default_tiers_key() -> String {
    "tiers".to_string()
}

/// Delivery rate limits (see `scheduler.rateLimits`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitsSpec {
    /// The limit of every tenant without one of its own or of its tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<RateLimitSpec>,
    /// Per-tier limits, for tenants assigned a tier.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tier".into()]))]
    #[schemars(length(max = 64))]
    pub tiers: Vec<TierRateLimit>,
    /// Per-tenant limits (an entry with no rate lifts the tier's and the
    /// default limit for that tenant).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tenant".into()]))]
    #[schemars(length(max = 10000))]
    pub tenants: Vec<TenantRateLimit>,
}

impl RateLimitsSpec {
    fn is_empty(&self) -> bool {
        self.default.is_none() && self.tiers.is_empty() && self.tenants.is_empty()
    }
}

/// One delivery rate limit. An absent (or zero) rate leaves that half unlimited.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitSpec {
    /// Deliveries per second the tenant may start, over all its endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1000000.0").message("rateLimits perSecond must be between 0 (unlimited) and 1000000"))]
    pub per_second: Option<f64>,
    /// Deliveries the tenant may start at once after a quiet spell
    /// (default: one second's worth, at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1.0 && self <= 1000000.0").message("rateLimits burst must be between 1 and 1000000"))]
    pub burst: Option<f64>,
    /// Deliveries per second to each one of the tenant's endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1000000.0").message("rateLimits endpointPerSecond must be between 0 (unlimited) and 1000000"))]
    pub endpoint_per_second: Option<f64>,
    /// Burst of each endpoint's bucket (default: one second's worth, at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1.0 && self <= 1000000.0").message("rateLimits endpointBurst must be between 1 and 1000000"))]
    pub endpoint_burst: Option<f64>,
}

impl RateLimitSpec {
    fn to_policy(&self) -> crate::policy::RateLimit {
        crate::policy::RateLimit {
            per_second: self.per_second.unwrap_or(0.0),
            burst: self.burst.unwrap_or(0.0),
            endpoint_per_second: self.endpoint_per_second.unwrap_or(0.0),
            endpoint_burst: self.endpoint_burst.unwrap_or(0.0),
        }
    }
}

/// A tier's delivery rate limit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TierRateLimit {
    /// Tier name.
    #[schemars(
        length(max = 63),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub tier: String,
    #[serde(flatten)]
    pub limit: RateLimitSpec,
}

/// A tenant's own delivery rate limit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TenantRateLimit {
    /// Tenant id.
    // A pattern, not CEL: a list of 10,000 regex rules would blow the CEL cost budget.
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    )]
    pub tenant: String,
    #[serde(flatten)]
    pub limit: RateLimitSpec,
}

fn default_quantum() -> f64 {
    2.0
}
fn default_max_in_flight() -> i32 {
    8
}
fn default_weight() -> f64 {
    1.0
}

impl Default for SchedulerSpec {
    fn default() -> Self {
        Self {
            quantum_seconds: default_quantum(),
            max_in_flight_per_tenant: default_max_in_flight(),
            max_in_flight_per_endpoint: None,
            default_weight: default_weight(),
            weights: Vec::new(),
            tier_weights: Vec::new(),
            ordering: Ordering::None,
            rate_limits: RateLimitsSpec::default(),
            tier_assignments: None,
            sweep_idle_tenants_after: default_sweep_idle(),
        }
    }
}

fn default_sweep_idle() -> Duration {
    secs(24 * 3600)
}

/// A tenant's scheduling weight, at least 0.01: no tenant starves to zero, and
/// its quantum (quantumSeconds x weight) is at least 100 µs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TenantWeight {
    /// Tenant id.
    #[x_kube(validation = Rule::new("self != ''").message("tenant must not be empty"))]
    // A pattern, not CEL: a list of 10,000 regex rules would blow the CEL cost budget.
    #[schemars(length(max = 128), regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"))]
    pub tenant: String,
    /// Weight, at least 0.01 and at most 1000.
    #[x_kube(validation = Rule::new("self >= 0.01 && self <= 1000.0").message("weight must be at least 0.01 and at most 1000"))]
    pub weight: f64,
}

/// A tier's scheduling weight.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TierWeight {
    /// Tier name: a letter or digit, then up to 62 letters, digits, '.', '_' or '-'.
    #[x_kube(validation = Rule::new("self != ''").message("tier must not be empty"))]
    #[schemars(
        length(max = 63),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub tier: String,
    /// Weight, at least 0.01 and at most 1000.
    #[x_kube(validation = Rule::new("self >= 0.01 && self <= 1000.0").message("weight must be at least 0.01 and at most 1000"))]
    pub weight: f64,
}

/// How one webhook is delivered.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("!self.initialBackoff.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || !self.maxBackoff.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || duration(self.initialBackoff) <= duration(self.maxBackoff)").message("delivery.initialBackoff must not exceed delivery.maxBackoff"))]
#[serde(rename_all = "camelCase")]
pub struct DeliverySpec {
    /// Total time allowed for one HTTP delivery attempt, e.g. `30s`.
    #[serde(default = "default_timeout")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.timeout must be a duration such as 30s or 1m"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.timeout must be positive"))]
    #[schemars(length(max = 32))]
    pub timeout: Duration,

    /// Time allowed to establish the TCP/TLS connection, e.g. `5s`.
    #[serde(default = "default_connect_timeout")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.connectTimeout must be a duration such as 5s"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.connectTimeout must be positive"))]
    #[schemars(length(max = 32))]
    pub connect_timeout: Duration,

    /// Delay before the first retry; it doubles per attempt (with jitter) up to `maxBackoff`.
    #[serde(default = "default_initial_backoff")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.initialBackoff must be a duration such as 1s"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.initialBackoff must be positive"))]
    #[schemars(length(max = 32))]
    pub initial_backoff: Duration,

    /// Longest delay between two attempts.
    #[serde(default = "default_max_backoff")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.maxBackoff must be a duration such as 1h"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.maxBackoff must be positive"))]
    #[schemars(length(max = 32))]
    pub max_backoff: Duration,

    /// Attempts before an envelope is dead-lettered (first attempt included).
    #[serde(default = "default_max_attempts")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("delivery.maxAttempts must be between 1 and 100"))]
    pub max_attempts: i32,

    /// Per-endpoint circuit breaker, shared by all workers through Redis.
    #[serde(default)]
    pub breaker: BreakerSpec,

    /// How many dead letters each tenant keeps per queue, and for how long.
    #[serde(default)]
    pub dead_letters: DeadLetterSpec,

    /// The longest pause a receiver may ask for: a 429 or 503 with
    /// `Retry-After` pauses that endpoint (not only that envelope) until the
    /// time it asked, at most this long (default `10m`, between `1s` and `24h`).
    #[serde(default = "default_max_retry_after")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.maxRetryAfter must be a duration such as 10m"))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || (duration(self) >= duration('1s') && duration(self) <= duration('24h'))").message("delivery.maxRetryAfter must be between 1s and 24h"))]
    #[schemars(length(max = 32))]
    pub max_retry_after: Duration,
}

/// Retention of dead letters, per tenant and queue: the oldest go first once
/// a tenant has `maxPerTenant`, and any older than `maxAge`. What retention
/// drops is counted (`lanekeeper_dead_letters_dropped`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSpec {
    /// Most dead letters one tenant keeps in one queue (default 100000).
    #[serde(default = "default_dead_letters_max")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 10000000").message("delivery.deadLetters.maxPerTenant must be between 1 and 10000000"))]
    pub max_per_tenant: i64,

    /// How long a dead letter is kept (default `168h`, seven days).
    #[serde(default = "default_dead_letters_age")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.deadLetters.maxAge must be a duration such as 168h"))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || duration(self) >= duration('1m')").message("delivery.deadLetters.maxAge must be at least 1m"))]
    #[schemars(length(max = 32))]
    pub max_age: Duration,
}

fn default_dead_letters_max() -> i64 {
    100_000
}
fn default_dead_letters_age() -> Duration {
    secs(7 * 24 * 3600)
}

impl Default for DeadLetterSpec {
    fn default() -> Self {
        Self {
            max_per_tenant: default_dead_letters_max(),
            max_age: default_dead_letters_age(),
        }
    }
}

fn default_timeout() -> Duration {
    secs(30)
}
fn default_connect_timeout() -> Duration {
    secs(5)
}
fn default_initial_backoff() -> Duration {
    secs(1)
}
fn default_max_backoff() -> Duration {
    secs(3600)
}
fn default_max_attempts() -> i32 {
    10
}
fn default_max_retry_after() -> Duration {
    secs(600)
}

pub(crate) fn secs(s: u64) -> Duration {
    std::time::Duration::from_secs(s).into()
}

impl Default for DeliverySpec {
    fn default() -> Self {
        Self {
            timeout: default_timeout(),
            connect_timeout: default_connect_timeout(),
            initial_backoff: default_initial_backoff(),
            max_backoff: default_max_backoff(),
            max_attempts: default_max_attempts(),
            breaker: BreakerSpec::default(),
            dead_letters: DeadLetterSpec::default(),
            max_retry_after: default_max_retry_after(),
        }
    }
}

/// Circuit breaker per endpoint. While open, the endpoint's envelopes are not
/// leased, so its tenant's share goes to everyone else.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BreakerSpec {
    /// Failure ratio over `window` at or above which the breaker opens.
    #[serde(default = "default_failure_ratio")]
    #[x_kube(validation = Rule::new("self > 0.0 && self <= 1.0").message("delivery.breaker.failureRatio must be in (0, 1]"))]
    pub failure_ratio: f64,

    /// Fewest requests in `window` before the ratio is trusted.
    #[serde(default = "default_min_requests")]
    #[x_kube(validation = Rule::new("self >= 1").message("delivery.breaker.minRequests must be at least 1"))]
    pub min_requests: i32,

    /// Sliding window the failure ratio is measured over.
    #[serde(default = "default_breaker_window")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.breaker.window must be a duration such as 60s"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.breaker.window must be positive"))]
    #[schemars(length(max = 32))]
    pub window: Duration,

    /// How long the breaker stays open before one half-open probe is let through.
    #[serde(default = "default_open_for")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("delivery.breaker.openFor must be a duration such as 30s"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("delivery.breaker.openFor must be positive"))]
    #[schemars(length(max = 32))]
    pub open_for: Duration,
}

fn default_failure_ratio() -> f64 {
    0.5
}
fn default_min_requests() -> i32 {
    20
}
fn default_breaker_window() -> Duration {
    secs(60)
}
fn default_open_for() -> Duration {
    secs(30)
}

impl Default for BreakerSpec {
    fn default() -> Self {
        Self {
            failure_ratio: default_failure_ratio(),
            min_requests: default_min_requests(),
            window: default_breaker_window(),
            open_for: default_open_for(),
        }
    }
}

/// When a tenant earns a dedicated lane, and when it gives it back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.demoteShare < self.promoteShare").message("promotion.demoteShare must be less than promotion.promoteShare (hysteresis)"))]
#[serde(rename_all = "camelCase")]
pub struct PromotionSpec {
    /// Let the controller create and retire DedicatedLanes on its own.
    /// Manually created lanes are honoured either way.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// Share of its queue's worker-seconds over `window`, while the queue is
    /// contended, at or above which a tenant is hot.
    #[serde(default = "default_promote_share")]
    #[x_kube(validation = Rule::new("self > 0.0 && self <= 1.0").message("promotion.promoteShare must be in (0, 1]"))]
    pub promote_share: f64,

    /// Share below which a tenant on a lane is cold.
    #[serde(default = "default_demote_share")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self < 1.0").message("promotion.demoteShare must be in [0, 1)"))]
    pub demote_share: f64,

    /// How long a tenant must stay hot before it is promoted.
    #[serde(default = "default_promote_after")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("promotion.promoteAfter must be a duration such as 15m"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("promotion.promoteAfter must be positive"))]
    #[schemars(length(max = 32))]
    pub promote_after: Duration,

    /// How long a promoted tenant must stay cold before it is demoted.
    #[serde(default = "default_demote_after")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("promotion.demoteAfter must be a duration such as 60m"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("promotion.demoteAfter must be positive"))]
    #[schemars(length(max = 32))]
    pub demote_after: Duration,

    /// Sliding window over which worker-second shares are measured.
    #[serde(default = "default_window")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("promotion.window must be a duration such as 5m"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("promotion.window must be positive"))]
    #[schemars(length(max = 32))]
    pub window: Duration,

    /// Promote on the trend as well as on the share: a tenant on a contended
    /// shard whose backlog, at the rate it drained over `window`, would take
    /// at least this long to deliver (its projected wait) is hot, and is
    /// promoted at the next tick that still finds it so, without waiting out
    /// `promoteAfter`: the lane exists while an import is still arriving.
    /// Unset: on the share only. Between `1m` and `24h`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("promotion.projectedWait must be a duration such as 10m"))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || (duration(self) >= duration('1m') && duration(self) <= duration('24h'))").message("promotion.projectedWait must be between 1m and 24h"))]
    #[schemars(length(max = 32))]
    pub projected_wait: Option<Duration>,

    /// Most dedicated lanes admitted at once, manual ones included, 1 to 8.
    /// At the cap the set reports `LaneCapReached`: shape ingest instead.
    /// Lowered below the lanes admitted, the lanes with an index at or above
    /// it retire (tenants back to their hash shards) and wait for an index
    /// under it (`LaneCapReached`, reason `OverCap`, until they are out).
    #[serde(default = "default_max_lanes")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 8").message("promotion.maxLanes must be between 1 and 8"))]
    pub max_lanes: i32,

    /// Worker settings for lane Deployments, over the set's `worker` template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_worker: Option<WorkerOverrides>,

    /// What happens to a hot tenant whose lane waits at the cap
    /// (`Admitted=False`, `LaneCapReached`): `Wait` (it keeps its fair share
    /// of its shard and ingest keeps accepting, within its backlog limit) or
    /// `ShapeAtIngest` (ingest admits its events at the rate its fair share
    /// drains and answers 429 with `Retry-After` beyond it; listed in
    /// `status.shapedTenants`).
    #[serde(default)]
    pub at_cap: AtCap,
}

/// `spec.promotion.atCap`: what a hot tenant that cannot get a lane gets.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum AtCap {
    /// Nothing changes at ingest: the tenant keeps its fair share of its
    /// shard, and its producer is refused only at its backlog limit.
    #[default]
    Wait,
    /// Ingest shapes the tenant to the rate its fair share drains.
    ShapeAtIngest,
}

fn default_true() -> bool {
    true
}
fn default_promote_share() -> f64 {
    0.30
}
fn default_demote_share() -> f64 {
    0.10
}
fn default_promote_after() -> Duration {
    secs(15 * 60)
}
fn default_demote_after() -> Duration {
    secs(60 * 60)
}
fn default_window() -> Duration {
    secs(5 * 60)
}
fn default_max_lanes() -> i32 {
    super::MAX_LANES
}

impl Default for PromotionSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            promote_share: default_promote_share(),
            demote_share: default_demote_share(),
            promote_after: default_promote_after(),
            demote_after: default_demote_after(),
            window: default_window(),
            projected_wait: None,
            max_lanes: default_max_lanes(),
            lane_worker: None,
            at_cap: AtCap::Wait,
        }
    }
}

/// Worker settings that override the set's `worker` template for a lane.
/// Unset fields inherit.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkerOverrides {
    /// Worker pods for the lane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("replicas must not be negative"))]
    pub replicas: Option<i32>,

    /// Deliveries in flight per lane worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1024").message("concurrency must be between 1 and 1024"))]
    pub concurrency: Option<i32>,

    /// Compute resources of the lane worker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Node labels the lane worker pods must match (replaces the set's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
}

/// How tenants are moved between queues.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RelocationSpec {
    /// Longest wait for a paused tenant's source queue to drain. Past it the
    /// move aborts (the tenant is unpaused in place, reason `DrainTimeout`) and
    /// is retried later with backoff: a busy lane is never moved.
    #[serde(default = "default_drain_timeout")]
    #[x_kube(validation = Rule::new(super::DURATION_SYNTAX).message("relocation.drainTimeout must be a duration such as 120s"))]
    #[x_kube(validation = Rule::new(super::DURATION_POSITIVE).message("relocation.drainTimeout must be positive"))]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|ms|s|m|h))+$') || duration(self) >= duration('1s')").message("relocation.drainTimeout must be at least 1s: every timeout aborts the move, records an Event and retries"))]
    #[schemars(length(max = 32))]
    pub drain_timeout: Duration,

    /// Tenants with work outstanding that a reshard pauses and drains at
    /// once; tenants with nothing queued or in flight move without a slot.
    #[serde(default = "default_max_concurrent_moves")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 64").message("relocation.maxConcurrentMoves must be between 1 and 64"))]
    pub max_concurrent_moves: i32,
}

/// The shortest drain timeout the controller uses, whatever a stored object
/// says (objects stored before the CEL floor keep their value).
pub const MIN_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl RelocationSpec {
    /// `drainTimeout`, at least [`MIN_DRAIN_TIMEOUT`].
    pub fn drain_timeout(&self) -> std::time::Duration {
        std::time::Duration::from(self.drain_timeout).max(MIN_DRAIN_TIMEOUT)
    }
}

fn default_drain_timeout() -> Duration {
    secs(120)
}
fn default_max_concurrent_moves() -> i32 {
    1
}

impl Default for RelocationSpec {
    fn default() -> Self {
        Self {
            drain_timeout: default_drain_timeout(),
            max_concurrent_moves: default_max_concurrent_moves(),
        }
    }
}

/// Observed state of a ShardSet, written by the controller.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ShardSetStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Ready`, `Progressing`, `Degraded`, `LaneCapReached` and `Resharding`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// Shards the spec asks for.
    #[serde(default)]
    pub shards_desired: i32,

    /// Shards whose worker Deployment has all its replicas available.
    #[serde(default)]
    pub shards_ready: i32,

    /// `ready/desired`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_summary: Option<String>,

    /// Dedicated lanes admitted.
    #[serde(default)]
    pub lanes_used: i32,

    /// The lane cap in force (`spec.promotion.maxLanes`).
    #[serde(default)]
    pub lanes_max: i32,

    /// `used/max`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane_summary: Option<String>,

    /// Max over median of per-shard worker-seconds in the promotion window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skew_ratio: Option<f64>,

    /// Tenants with the largest share of their queue's worker-seconds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub top_tenants: Vec<TenantShare>,

    /// Tenants currently hot and the time they became so; promoted once hot for `promoteAfter`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub promotion_candidates: Vec<PromotionCandidate>,

    /// Tenants on a dedicated lane whose share has fallen below `demoteShare`,
    /// and since when; demoted once cold for `demoteAfter`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub demotion_candidates: Vec<DemotionCandidate>,

    /// Hot tenants that cannot get a lane (the set is at its lane cap) and
    /// that ingest shapes (`promotion.atCap: ShapeAtIngest`): the rate ingest
    /// admits their events at, and since when.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub shaped_tenants: Vec<ShapedTenant>,

    /// Tenants a user paused (`lanekeeper tenant pause`, the ingest admin
    /// API): their deliveries wait until resumed. At most 64 are listed,
    /// by name; `tenantsPaused` counts them all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub paused_tenants: Vec<PausedTenant>,

    /// How many tenants a user paused, all queues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants_paused: Option<i32>,

    /// Progress of a shard-count change, while one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resharding: Option<ReshardProgress>,

    /// The mark the controller wrote into Redis with the routing table. A
    /// routing table without it means Redis lost the set's state (a restart
    /// without persistence, a flush): the controller then rewrites routing,
    /// queue policies and lane pins and reports `RedisStateLost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub redis_epoch: Option<String>,

    /// The tier assignments read from `scheduler.tierAssignments`' ConfigMap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_assignments: Option<TierAssignmentsStatus>,

    /// What the controller applied of `spec.tenants`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_overrides: Option<TenantOverridesStatus>,
}

/// What the controller applied of `spec.tenants` at its last reconcile.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenantOverridesStatus {
    /// Tenants with overrides in force.
    pub tenants: i32,
    /// Tenants the spec holds paused (`paused: true`), by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000))]
    pub paused: Vec<String>,
    /// What could not be applied this time (a pause or resume that failed);
    /// the next reconcile tries again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
}

/// What the controller synced from the tier ConfigMap.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TierAssignmentsStatus {
    /// The ConfigMap named in the spec.
    pub config_map: String,
    /// The ConfigMap whose assignments are in force, as
    /// `<name>/<resourceVersion>` (none: nothing has been synced yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synced: Option<String>,
    /// Tenants assigned a tier by the assignments in force.
    pub tenants: i64,
    /// Why the ConfigMap as it is now is not in force (not found, not
    /// allowed, a bad line); the last good assignments stay meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A tenant a user paused.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PausedTenant {
    /// Tenant id.
    pub tenant: String,
    /// Queue it is paused in (`shard-07`, `lane-3`).
    pub queue: String,
}

/// A tenant shaped at ingest.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ShapedTenant {
    /// Tenant id.
    pub tenant: String,
    /// Queue the tenant is served from (`shard-07`).
    pub queue: String,
    /// Envelopes per second ingest admits for it: the rate its fair share
    /// of the queue's workers drains at its measured cost per delivery.
    pub per_second: f64,
    /// When it was first shaped.
    pub since: Time,
}

/// One tenant's share of its queue's capacity.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenantShare {
    /// Tenant id.
    pub tenant: String,
    /// Queue the tenant is served from (`shard-07`, `lane-3`).
    pub queue: String,
    /// Share of the queue's worker-seconds over the window, 0 to 1.
    pub share: f64,
    /// Envelopes waiting or in flight.
    #[serde(default)]
    pub depth: i64,
}

/// A tenant on its way to a dedicated lane.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PromotionCandidate {
    /// Tenant id.
    pub tenant: String,
    /// Queue the tenant is served from.
    pub queue: String,
    /// Latest measured share of the queue's worker-seconds.
    pub share: f64,
    /// When the tenant became hot; it is promoted at `hotSince + promoteAfter`,
    /// or at the next tick when it is hot on the trend.
    pub hot_since: Time,
    /// Hot on the trend (`promotion.projectedWait`): how long its backlog
    /// would take at its measured drain rate, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projected_wait_seconds: Option<f64>,
}

/// A tenant on a dedicated lane on its way back to its hash shard.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DemotionCandidate {
    /// Tenant id.
    pub tenant: String,
    /// The lane the tenant is served from (`lane-3`).
    pub queue: String,
    /// Latest share the tenant would have of its hash shard's worker-seconds.
    pub share: f64,
    /// When the tenant became cold; it is demoted at `coldSince + demoteAfter`.
    pub cold_since: Time,
}

/// Progress of a reshard from `fromShards` to `toShards`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReshardProgress {
    /// Shard count before the change.
    pub from_shards: i32,
    /// Shard count being moved to.
    pub to_shards: i32,
    /// Tenants whose hash queue changes.
    pub to_move: i32,
    /// Tenants already on their new queue.
    pub moved: i32,
    /// Tenants whose move failed and will be retried.
    pub failed: i32,
}

impl crate::policy::QueuePolicy {
    /// The policy a ShardSet asks for.
    pub fn from_spec(spec: &ShardSetSpec) -> Self {
        use crate::policy::{BreakerPolicy, DeadLetterPolicy};
        let s = &spec.scheduler;
        let ordered = s.ordering == Ordering::PerTenant;
        let isolation = match spec.isolation {
            Isolation::Tenant => crate::policy::Isolation::Tenant,
            Isolation::Endpoint => crate::policy::Isolation::Endpoint,
        };
        // Only endpoint isolation has endpoint caps (the API server refuses
        // the field otherwise); strict order keeps each endpoint at 1. The
        // scripts take the smaller of it and each tenant's own cap, since
        // a tenant's cap may be overridden above the set-wide one.
        let max_in_flight_per_endpoint = match spec.isolation {
            Isolation::Tenant => None,
            Isolation::Endpoint if ordered => Some(1),
            Isolation::Endpoint => s.max_in_flight_per_endpoint.map(|n| n.max(1) as u32),
        };
        Self {
            quantum_seconds: s.quantum_seconds,
            max_in_flight: s.max_in_flight_per_tenant.max(1) as u32,
            ordered,
            default_weight: s.default_weight,
            weights: s
                .weights
                .iter()
                .map(|w| (w.tenant.clone(), w.weight))
                .chain(
                    spec.tenants
                        .iter()
                        .filter_map(|o| Some((o.tenant.clone(), o.weight?))),
                )
                .collect(),
            caps: spec
                .tenants
                .iter()
                .filter_map(|o| Some((o.tenant.clone(), o.max_in_flight?.max(1) as u32)))
                .collect(),
            tier_weights: s
                .tier_weights
                .iter()
                .map(|w| (w.tier.clone(), w.weight))
                .collect(),
            max_attempts: spec.delivery.max_attempts.max(1) as u32,
            breaker: BreakerPolicy {
                failure_ratio: spec.delivery.breaker.failure_ratio,
                min_requests: spec.delivery.breaker.min_requests.max(1) as u32,
                window: spec.delivery.breaker.window.into(),
                open_for: spec.delivery.breaker.open_for.into(),
            },
            dead_letters: DeadLetterPolicy {
                max_per_tenant: spec.delivery.dead_letters.max_per_tenant.max(1) as u64,
                max_age: spec.delivery.dead_letters.max_age.into(),
            },
            max_retry_after: spec.delivery.max_retry_after.into(),
            sweep_idle_after: {
                let d: std::time::Duration = s.sweep_idle_tenants_after.into();
                (!d.is_zero()).then_some(d)
            },
            rate_limits: crate::policy::RateLimits {
                default: s.rate_limits.default.as_ref().map(RateLimitSpec::to_policy),
                tiers: s
                    .rate_limits
                    .tiers
                    .iter()
                    .map(|t| (t.tier.clone(), t.limit.to_policy()))
                    .collect(),
                tenants: s
                    .rate_limits
                    .tenants
                    .iter()
                    .map(|t| (t.tenant.clone(), t.limit.to_policy()))
                    .chain(spec.tenants.iter().filter_map(|o| {
                        Some((o.tenant.clone(), o.rate_limit.as_ref()?.to_policy()))
                    }))
                    .collect(),
            },
            isolation,
            max_in_flight_per_endpoint,
            ..Self::default()
        }
    }
}
