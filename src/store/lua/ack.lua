-- Helpers (common.lua): count_arg, now_ms
-- Helpers (deliver.lua): ack_one
-- ARGV: id, token, elapsed_us. Returns {'OK' | 'STALE', breaker change}.
local elapsed = count_arg(ARGV[3])
if not elapsed then return redis.error_reply('ack: elapsed_us must be a finite number from 0 up') end
local status, change = ack_one(ARGV[1], ARGV[2], elapsed, now_ms())
return { status, change }
