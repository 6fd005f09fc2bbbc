-- Helpers (common.lua): count_arg, lease_args, now_ms
-- Helpers (deliver.lua): lease_next, ack_one
-- ARGV: id, token, elapsed_us (the delivery just finished), lease_ms,
-- new token, budget. Acks, then leases the next envelope, in one round trip
-- (what a worker does after each delivery). Returns the ack answer followed
-- and its breaker change by the lease answer.
local elapsed, budget = count_arg(ARGV[3]), count_arg(ARGV[6])
local lease_ms, token = lease_args(ARGV[4], ARGV[5])
if not (elapsed and lease_ms and token and budget) then
  return redis.error_reply('ack_lease: elapsed_us and budget must be finite numbers from 0 up, lease_ms a number '
    .. 'from 0 to 2^40, and the new token must hold no newline')
end
local now = now_ms()
local acked, change = ack_one(ARGV[1], ARGV[2], elapsed, now)
local leased = lease_next(lease_ms, token, budget, now)
table.insert(leased, 1, change)
table.insert(leased, 1, acked)
return leased
