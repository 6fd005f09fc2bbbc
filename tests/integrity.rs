//! Store integrity (issue 17) against a real redis-server: tenants cannot
//! touch each other's envelopes, dead letters are per tenant, bounded and
//! replayed in bounded steps, and lost or evicted state never wedges a
//! tenant. The bodies live in `support::integrity`; the cluster-relevant
//! ones also run on the Redis Cluster harness (`tests/cluster.rs`).

mod support;

use support::integrity as body;

fn url() -> &'static str {
    &support::redis::shared().url
}

#[tokio::test]
async fn same_id_in_two_tenants_is_two_envelopes() {
    body::same_id_in_two_tenants_is_two_envelopes(url()).await;
}

#[tokio::test]
async fn the_lease_not_the_payload_names_the_tenant() {
    body::the_lease_not_the_payload_names_the_tenant(url()).await;
}

#[tokio::test]
async fn a_move_keeps_envelopes_whose_id_another_tenant_used() {
    body::a_move_keeps_envelopes_whose_id_another_tenant_used(url()).await;
}

#[tokio::test]
async fn idempotency_survives_a_move() {
    body::idempotency_survives_a_move(url()).await;
}

#[tokio::test]
async fn claims_made_during_the_copy_travel_too() {
    body::claims_made_during_the_copy_travel_too(url()).await;
}

#[tokio::test]
async fn replaying_ten_thousand_dead_letters_loses_none() {
    body::replaying_ten_thousand_dead_letters_loses_none(url()).await;
}

#[tokio::test]
async fn dead_letters_are_per_tenant() {
    body::dead_letters_are_per_tenant(url()).await;
}

#[tokio::test]
async fn dead_letter_retention_is_bounded_and_counted() {
    body::dead_letter_retention_is_bounded_and_counted(url()).await;
}

#[tokio::test]
async fn dead_letters_age_out() {
    body::dead_letters_age_out(url()).await;
}

#[tokio::test]
async fn a_missing_record_never_wedges_its_tenant() {
    body::a_missing_record_never_wedges_its_tenant(url()).await;
}

#[tokio::test]
async fn reaped_leases_do_not_open_the_breaker() {
    body::reaped_leases_do_not_open_the_breaker(url()).await;
}

#[tokio::test]
async fn a_tiny_quantum_does_not_livelock() {
    body::a_tiny_quantum_does_not_livelock(url()).await;
}

#[tokio::test]
async fn lane_moves_and_reshards_take_turns() {
    body::lane_moves_and_reshards_take_turns(url()).await;
}

#[tokio::test]
async fn claims_span_two_periods() {
    body::claims_span_two_periods(url()).await;
}

// ---- envelopes stored whole in their lane (support::whole) ----

#[tokio::test]
async fn an_envelope_is_stored_whole_until_its_lease_ends_otherwise() {
    support::whole::an_envelope_is_stored_whole_until_its_lease_ends_otherwise(url()).await;
}

#[tokio::test]
async fn a_lane_of_records_is_served_in_order_beside_whole_items() {
    support::whole::a_lane_of_records_is_served_in_order_beside_whole_items(url()).await;
}

#[tokio::test]
async fn hostile_whole_items_fail_no_lease_and_lose_nothing_quietly() {
    support::whole::hostile_whole_items_fail_no_lease_and_lose_nothing_quietly(url()).await;
}

#[tokio::test]
async fn a_foreign_leased_key_fails_no_lease_or_ack() {
    support::whole::a_foreign_leased_key_fails_no_lease_or_ack(url()).await;
}

#[tokio::test]
async fn a_malformed_enqueue_fails_before_its_first_write() {
    support::whole::a_malformed_enqueue_fails_before_its_first_write(url()).await;
}

#[tokio::test]
async fn a_replay_waits_while_its_id_is_live_again() {
    support::whole::a_replay_waits_while_its_id_is_live_again(url()).await;
}

#[tokio::test]
async fn a_batch_claims_each_id_once_and_its_items_carry_their_seqs() {
    support::whole::a_batch_claims_each_id_once_and_its_items_carry_their_seqs(url()).await;
}

#[tokio::test]
async fn claims_hold_when_the_window_grows_or_the_clock_steps_back() {
    support::whole::claims_hold_when_the_window_grows_or_the_clock_steps_back(url()).await;
}

#[tokio::test]
async fn foreign_gate_keys_fail_no_lease() {
    support::whole::foreign_gate_keys_fail_no_lease(url()).await;
}
