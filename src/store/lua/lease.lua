-- Helpers (common.lua): count_arg, now_ms
-- Helpers (deliver.lua): lease_next
-- ARGV: lease_ms, token (unique per lease, made by the caller), budget.
-- (the parentheses keep the answer alone: the steps taken are not part of it)
local lease_ms, budget = count_arg(ARGV[1]), count_arg(ARGV[3])
if not (lease_ms and budget) then
  return redis.error_reply('lease: lease_ms and budget must be finite numbers from 0 up')
end
return (lease_next(lease_ms, ARGV[2], budget, now_ms()))
