//! lanekeeper: a Kubernetes operator and the webhook-delivery data plane it
//! runs, built so that one tenant's flood cannot delay every other tenant's
//! webhooks. See `docs/architecture.md` for the module map.

pub mod controller;
pub mod crd;
pub mod endpoint;
pub mod envelope;
pub mod ingest;
pub mod policy;
pub mod producer;
pub mod routing;
pub mod signing;
pub mod simulate;
pub mod store;
pub mod telemetry;
pub mod worker;
