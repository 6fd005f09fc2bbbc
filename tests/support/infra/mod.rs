//! Infrastructure: the real parts a test starts, each on free loopback
//! ports for the life of one test binary: child processes that die with it
//! (`process`), `redis-server` and a Redis Cluster (`redis`), the Kubernetes
//! control plane (`controlplane`), `lanekeeper worker` and `lanekeeper
//! ingest` processes (`workers`), a webhook receiver that checks every
//! signature (`receiver`), and the pinned third-party tools (`tools`).

pub mod controlplane;
pub mod process;
pub mod receiver;
pub mod redis;
pub mod tools;
pub mod workers;
