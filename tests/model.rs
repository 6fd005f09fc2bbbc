//! Property test against a simple model: random sequences of enqueue, lease,
//! ack, nack, lease expiry and reap. Nothing is lost, nothing is acked twice,
//! and under PerTenant ordering each tenant's envelopes are acked in order.

mod support;

use proptest::prelude::*;
use support::model::{op, run};

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn no_loss_no_double_ack_in_order(ops in prop::collection::vec(op(), 1..60), ordered in any::<bool>()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(&support::redis::shared().url, ops, ordered))?;
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
