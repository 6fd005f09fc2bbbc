-- Helpers (common.lua): now_ms, unblock_due, dl_expire, promote_due, reap
-- ARGV: limit. Promotes due retries, reaps expired leases, lifts breaker
-- blocks that have run out, and ages out old dead letters (of at most 8
-- tenants). Returns {promoted, reaped}.
local limit = tonumber(ARGV[1])
local now = now_ms()
unblock_due(now, limit)
dl_expire(8)
return { promote_due(now, limit), reap(now, limit) }
