-- ARGV: id, token, elapsed_us, delay_ms, dead (0|1), cause, endpoint failure (0|1:
-- counts against the endpoint's circuit breaker).
-- Returns {'RETRY', attempts, due_ms, breaker change} | {'DEAD', attempts, 0, breaker change} | {'STALE'}.
-- A retry waits in the delayed set; in PerTenant ordering it keeps the
-- tenant's only slot, so later envelopes of that tenant wait behind it.
local id, token, elapsed = ARGV[1], ARGV[2], tonumber(ARGV[3])
local delay, dead, cause, broken = tonumber(ARGV[4]), ARGV[5] == '1', ARGV[6], ARGV[7] == '1'
local ek = ekey(id)
local charged, t = end_lease(id, token)
if not charged then return { 'STALE' } end
local m = redis.call('HMGET', ek, 'p', 'ep')
local now = now_ms()
local a = redis.call('HINCRBY', ek, 'a', 1)
dead = dead or a >= MAX_ATTEMPTS
-- a retry under PerTenant ordering keeps the tenant's only slot
local bw = settle(t, charged, elapsed, now, dead or not ORDERED, dead and 'dead' or 'retry')
local change = breaker_record(t, m[2], broken, bw, now)
if dead then
  dead_letter(id, t, a, cause, now, m[1])
  return { 'DEAD', a, 0, change }
end
local due = now + delay
redis.call('ZADD', DELAYED, due, id)
if ORDERED then redis.call('HSET', ek, 'x', 1) end
return { 'RETRY', a, due, change }
