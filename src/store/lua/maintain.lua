-- ARGV: limit. Promotes due retries, reaps expired leases and lifts
-- breaker blocks that have run out. Returns {promoted, reaped}.
local limit = tonumber(ARGV[1])
local now = now_ms()
unblock_due(now, limit)
return { promote_due(now, limit), reap(now, limit) }
