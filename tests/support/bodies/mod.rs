//! Shared test bodies: tests that take a Redis URL, run by the single-server
//! test binaries and again by `tests/cluster.rs` on a Redis Cluster: the
//! data-plane fairness and relocation bodies (`dataplane`), store integrity
//! (`integrity`), endpoint isolation (`isolation`), the model property test
//! (`model`) and its rate-limit counterpart (`buckets`), and batched lease
//! and ack (`batch`).

pub mod batch;
pub mod buckets;
pub mod dataplane;
pub mod health;
pub mod integrity;
pub mod isolation;
pub mod model;
pub mod stored;
pub mod whole;
