-- Helpers (common.lua): now_ms
-- Helpers (deliver.lua): ack_one
-- ARGV: id, token, elapsed_us. Returns {'OK' | 'STALE', breaker change}.
local status, change = ack_one(ARGV[1], ARGV[2], tonumber(ARGV[3]), now_ms())
return { status, change }
