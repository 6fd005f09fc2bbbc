-- Helpers (common.lua): count_arg, lease_args, now_ms
-- Helpers (deliver.lua): lease_next
-- ARGV: lease_ms, token (unique per lease, made by the caller), budget.
-- (the parentheses keep the answer alone: the steps taken are not part of it)
local lease_ms, token = lease_args(ARGV[1], ARGV[2])
local budget = count_arg(ARGV[3])
if not (lease_ms and token and budget) then
  return redis.error_reply('lease: lease_ms must be a number from 0 to 2^40, budget a finite number from 0 up, '
    .. 'and the token must hold no newline')
end
return (lease_next(lease_ms, token, budget, now_ms()))
