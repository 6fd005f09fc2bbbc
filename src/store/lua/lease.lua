-- ARGV: lease_ms, token (unique per lease, made by the caller), budget.
return lease_next(tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), now_ms())
