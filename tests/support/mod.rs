//! Test support: real servers started on free loopback ports for the life of
//! one test binary. Each test binary compiles this module on its own and uses
//! only part of it. Three groups, re-exported here so that tests name
//! `support::redis`, `support::lanes`, ... directly:
//!
//! - `infra/`: the real parts (processes, Redis, control plane, lanekeeper
//!   processes, receiver);
//! - `env/`: whole environments built from them (`scenario`, `lanes`,
//!   `reshard`);
//! - `bodies/`: test bodies shared by the single-server and the Redis
//!   Cluster binaries (`batch`, `dataplane`, `integrity`, `isolation`, `model`).
//!
//! The demo's scenario is the example's own (`examples/demo/scenario.rs`),
//! which `tests/demo.rs` includes.
//!
//! Which test binary starts which real part (`redis` = `redis::shared()` or
//! a dedicated `redis-server`; `cluster` = `redis::TestCluster`, six
//! `redis-server --cluster-enabled` nodes and `redis-cli`; `apiserver` =
//! `controlplane::api_server()`, etcd and kube-apiserver; `full` =
//! `controlplane::full()`, also kube-controller-manager, kube-scheduler and
//! a kwok node; `lanekeeper` = the binary as a process, subcommands named):
//!
//! | test binary | real parts |
//! | --- | --- |
//! | cluster | cluster; lanekeeper worker, ingest, top, simulate; receiver |
//! | dataplane | redis |
//! | dataplane_apply | redis (dedicated, restarted); lanekeeper dataplane apply, ingest-key, worker, ingest, tiers; receiver (no Kubernetes) |
//! | demo | full, redis; lanekeeper controller, worker, ingest; receiver |
//! | e2e_apiload | full, redis; lanekeeper controller |
//! | e2e_cluster | full |
//! | e2e_controller | full, redis (shared, dedicated, restarted), cluster; lanekeeper controller (two replicas: leader election) |
//! | e2e_crds | apiserver |
//! | e2e_lanes | full, redis; lanekeeper controller, worker; receiver |
//! | e2e_lifecycle | full, redis; lanekeeper controller |
//! | e2e_redis | full, redis (dedicated: settings, TLS, ACL); lanekeeper controller, worker; receiver |
//! | e2e_reshard | full, redis; lanekeeper controller, worker; receiver |
//! | e2e_security | full, redis; lanekeeper controller (own RBAC identities) |
//! | generated | lanekeeper crds (no server) |
//! | hostile | redis (and a locked-down one); lanekeeper worker, ingest, route, top, simulate; receiver; python3 with schemathesis |
//! | ingest | redis (shared, dedicated, restarted); lanekeeper ingest |
//! | integrity | redis |
//! | isolation_attacks | redis |
//! | model | redis |
//! | monitoring | apiserver (with prometheus-operator's and KEDA's CRDs, `tests/monitoring/crds.sh`); helm, kubectl, promtool (`tests/promtool/install.sh`) |
//! | packaging | full, redis; helm (`tests/helm/install.sh`), kubectl; lanekeeper controller (as the chart's ServiceAccount), worker; receiver |
//! | redis_cluster_prod | cluster (TLS, from `redis-server`/`redis-cli` on PATH) |
//! | redis_durability | redis (a primary and a replica); lanekeeper worker, ingest; receiver |
//! | redis_harness | redis |
//! | redis_settings | redis (dedicated, with settings); lanekeeper worker, ingest |
//! | redis_state | redis; lanekeeper worker; receiver |
//! | redis_tls | redis-server with `--tls-port` (certificates from `redis::Pki`); lanekeeper worker, ingest, route; receiver |
//! | routing | redis; lanekeeper route, top |
//! | simulate | redis; lanekeeper simulate |
//! | worker | redis; lanekeeper worker; receiver |
#![allow(dead_code)]
#![allow(unused_imports)]

pub mod bodies;
pub mod env;
pub mod infra;

pub use bodies::{batch, buckets, dataplane, health, integrity, isolation, model, stored, whole};
pub use env::{lanes, reshard, scenario};
pub use infra::{controlplane, process, receiver, redis, tools, workers};
