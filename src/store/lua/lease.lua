-- Helpers (common.lua): now_ms
-- Helpers (deliver.lua): lease_next
-- ARGV: lease_ms, token (unique per lease, made by the caller), budget.
-- (the parentheses keep the answer alone: the steps taken are not part of it)
return (lease_next(tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), now_ms()))
