-- ARGV: limit. Promotes due retries and reaps expired leases.
-- Returns {promoted, reaped}.
local limit = tonumber(ARGV[1])
local now = now_ms()
return { promote_due(now, limit), reap(now, limit) }
