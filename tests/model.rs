//! Property test against a simple model: random sequences of enqueue, lease,
//! ack, nack, lease expiry and reap. Nothing is lost, nothing is acked twice,
//! and under PerTenant ordering each tenant's envelopes are acked in order.

mod support;

use lanekeeper::policy::Isolation;
use proptest::prelude::*;
use support::model::{op, run, run_isolated};

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn no_loss_no_double_ack_in_order(ops in prop::collection::vec(op(), 1..60), ordered in any::<bool>()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(&support::redis::shared().url, ops, ordered))?;
    }

    /// The same under endpoint isolation: each tenant sends to two
    /// endpoints, and under PerTenant ordering each (tenant, endpoint)'s
    /// envelopes are acked in order.
    #[test]
    fn no_loss_no_double_ack_in_order_per_endpoint(ops in prop::collection::vec(op(), 1..60), ordered in any::<bool>()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run_isolated(&support::redis::shared().url, ops, ordered, Isolation::Endpoint))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Rate limits: no lease while a tenant or an endpoint is out of tokens,
    /// nothing lost, order kept under PerTenant.
    #[test]
    fn buckets_never_outrun_their_limits(ops in prop::collection::vec(support::buckets::op(), 1..80), ordered in any::<bool>()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(support::buckets::run(&support::redis::shared().url, ops, ordered))?;
    }
}
