-- Helpers (common.lua): now_ms
-- Helpers (deliver.lua): lease_next, ack_one
-- ARGV: id, token, elapsed_us (the delivery just finished), lease_ms,
-- new token, budget. Acks, then leases the next envelope, in one round trip
-- (what a worker does after each delivery). Returns the ack answer followed
-- and its breaker change by the lease answer.
local now = now_ms()
local acked, change = ack_one(ARGV[1], ARGV[2], tonumber(ARGV[3]), now)
local leased = lease_next(tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), now)
table.insert(leased, 1, change)
table.insert(leased, 1, acked)
return leased
