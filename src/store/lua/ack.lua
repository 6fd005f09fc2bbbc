-- ARGV: id, token, elapsed_us. Returns {'OK' | 'STALE', breaker change}.
local status, change = ack_one(ARGV[1], ARGV[2], tonumber(ARGV[3]), now_ms())
return { status, change }
