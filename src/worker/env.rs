//! The worker's environment contract: the names of the variables
//! `lanekeeper worker` reads (its clap `env = ...`) and the controller sets
//! on every worker container (`controller::build::worker_deployment`). Both
//! use these constants, so the two cannot drift apart.
//!
//! A ShardSet's `spec.worker.env` may set none of them: every name here
//! starts with [`PREFIX`] or is [`POD_NAME`], which the CRD's CEL rule and
//! `controller::build::controller_env_name` refuse.

/// Prefix of every variable lanekeeper reads.
pub const PREFIX: &str = "LANEKEEPER_";

/// Redis URL of the ShardSet.
pub const REDIS_URL: &str = "LANEKEEPER_REDIS_URL";
/// The ShardSet, as `<namespace>/<name>`.
pub const SHARD_SET: &str = "LANEKEEPER_SHARD_SET";
/// `true`: the Redis is a Redis Cluster.
pub const REDIS_CLUSTER: &str = "LANEKEEPER_REDIS_CLUSTER";
/// Password for the Redis URL.
pub const REDIS_PASSWORD: &str = "LANEKEEPER_REDIS_PASSWORD";
/// ACL user name for the Redis URL.
pub const REDIS_USERNAME: &str = "LANEKEEPER_REDIS_USERNAME";
/// PEM CA bundle for a `rediss://` server.
pub const REDIS_CA_FILE: &str = "LANEKEEPER_REDIS_CA_FILE";
/// PEM client certificate for Redis.
pub const REDIS_CLIENT_CERT_FILE: &str = "LANEKEEPER_REDIS_CLIENT_CERT_FILE";
/// PEM private key of the Redis client certificate.
pub const REDIS_CLIENT_KEY_FILE: &str = "LANEKEEPER_REDIS_CLIENT_KEY_FILE";
/// The queue to serve: `shard-<N>` or `lane-<N>`.
pub const QUEUE: &str = "LANEKEEPER_QUEUE";
/// Deliveries in flight in one process.
pub const CONCURRENCY: &str = "LANEKEEPER_CONCURRENCY";
/// Total time for one delivery attempt.
pub const DELIVERY_TIMEOUT: &str = "LANEKEEPER_DELIVERY_TIMEOUT";
/// Time to connect to an endpoint.
pub const CONNECT_TIMEOUT: &str = "LANEKEEPER_CONNECT_TIMEOUT";
/// First retry delay.
pub const INITIAL_BACKOFF: &str = "LANEKEEPER_INITIAL_BACKOFF";
/// Longest retry delay.
pub const MAX_BACKOFF: &str = "LANEKEEPER_MAX_BACKOFF";
/// Lease margin past connect and delivery timeouts.
pub const LEASE_MARGIN: &str = "LANEKEEPER_LEASE_MARGIN";
/// Non-global CIDRs deliveries may reach (the operator's `--worker-allow-cidr`).
pub const ALLOW_CIDRS: &str = "LANEKEEPER_ALLOW_CIDRS";
/// HTTP proxy for every delivery.
pub const PROXY: &str = "LANEKEEPER_PROXY";
/// After SIGTERM, time for deliveries in flight to finish.
pub const GRACE_PERIOD: &str = "LANEKEEPER_GRACE_PERIOD";
/// Address for /metrics and /healthz (the controller's too).
pub const METRICS_ADDR: &str = "LANEKEEPER_METRICS_ADDR";
/// Tenants with their own metric labels.
pub const TENANT_LABEL_CAP: &str = "LANEKEEPER_TENANT_LABEL_CAP";
/// Log format, `text` or `json` (every subcommand's).
pub const LOG_FORMAT: &str = "LANEKEEPER_LOG_FORMAT";
/// The pod's name (the downward API), the worker's identity.
pub const POD_NAME: &str = "POD_NAME";

/// Every name of the contract.
pub const ALL: [&str; 22] = [
    REDIS_URL,
    SHARD_SET,
    REDIS_CLUSTER,
    REDIS_PASSWORD,
    REDIS_USERNAME,
    REDIS_CA_FILE,
    REDIS_CLIENT_CERT_FILE,
    REDIS_CLIENT_KEY_FILE,
    QUEUE,
    CONCURRENCY,
    DELIVERY_TIMEOUT,
    CONNECT_TIMEOUT,
    INITIAL_BACKOFF,
    MAX_BACKOFF,
    LEASE_MARGIN,
    ALLOW_CIDRS,
    PROXY,
    GRACE_PERIOD,
    METRICS_ADDR,
    TENANT_LABEL_CAP,
    LOG_FORMAT,
    POD_NAME,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_set_can_set_no_name_of_the_contract() {
        for name in ALL {
            assert!(
                name.starts_with(PREFIX) || name == POD_NAME,
                "{name} is outside what the CRD refuses"
            );
            assert!(
                crate::controller::build::controller_env_name(name),
                "{name} is not refused in a worker template"
            );
        }
    }

    #[test]
    fn the_crd_refuses_the_prefix_and_pod_name_in_worker_env() {
        let yaml = crate::crd::all_yaml().unwrap();
        let rule = format!("!e.name.startsWith('{PREFIX}') && e.name != '{POD_NAME}'");
        assert!(yaml.contains(&rule), "no CEL rule {rule:?} in the CRDs");
    }
}
