//! Environments: whole systems built from the infrastructure for one kind
//! of test, shared by tests, benches and the demo: one ShardSet with real
//! worker processes and a receiver (`scenario`), a ShardSet with its
//! controller on the control plane, a stand-in kubelet for lane Deployments
//! and numbered producers (`lanes`), and a reshard watched through status
//! (`reshard`).

pub mod lanes;
pub mod reshard;
pub mod scenario;
