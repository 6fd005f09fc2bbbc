//! Property test against a simple model: random sequences of enqueue, lease,
//! ack, nack, lease expiry and reap. Nothing is lost, nothing is acked twice,
//! and under PerTenant ordering each tenant's envelopes are acked in order,
//! with leases and acks one per call and in batches of 16.

mod support;

use lanekeeper::policy::Isolation;
use proptest::prelude::*;
use support::model::{op, run, run_batched, run_isolated};

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

    /// The same with batched leases and acks (k = 16), under both isolations.
    #[test]
    fn no_loss_no_double_ack_in_order_batched(ops in prop::collection::vec(op(), 1..60), ordered in any::<bool>(), endpoint in any::<bool>()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let isolation = if endpoint { Isolation::Endpoint } else { Isolation::Tenant };
        rt.block_on(run_batched(&support::redis::shared().url, ops, ordered, isolation, 16))?;
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
