-- Helpers (common.lua): count_arg, now_ms, end_lease, leased_record, breaker_record, pace_endpoint, settle,
--   dead_letter, dead_missing_lease, delayed_member
-- ARGV: id, token, elapsed_us, delay_ms, dead (0|1), cause, endpoint failure (0|1:
-- counts against the endpoint's circuit breaker), pace ms (0 or absent: none).
-- With a pace (the receiver answered 429 or 503 with Retry-After), the
-- envelope's endpoint is paused for that long from now, at most the policy's
-- pmax (the later of an existing pause and this one wins); the retry is due
-- when the pause ends (it counts as an attempt, so maxatt still bounds a
-- receiver that paces forever), and the breaker is not touched.
-- Returns {'RETRY', attempts, due_ms, breaker change} | {'DEAD', attempts, 0, breaker change} | {'STALE'}.
-- A retry waits in the delayed set; in PerTenant ordering it keeps the
-- tenant's only slot (under endpoint isolation, its endpoint's only slot,
-- the tenant's being freed), so later envelopes of that tenant (endpoint)
-- wait behind it.
-- An envelope whose record is gone is dead-lettered with that cause, its
-- tenant settled: nothing half-done is left behind.
local id, token, elapsed = ARGV[1], ARGV[2], count_arg(ARGV[3])
local delay, dead, cause, broken = count_arg(ARGV[4]), ARGV[5] == '1', ARGV[6], ARGV[7] == '1'
local pace = count_arg(ARGV[8] or '0')
if not (elapsed and delay and pace) then
  return redis.error_reply('nack: elapsed_us, delay_ms and pace_ms must be finite numbers from 0 up')
end
local charged, t, ep = end_lease(id, token)
if not charged then return { 'STALE' } end
local now = now_ms()
local ek, present = leased_record(t, id, token)
if not present then
  dead_missing_lease(t, id, charged, elapsed, now, ep)
  return { 'DEAD', 0, 0, '' }
end
local m = redis.call('HMGET', ek, 'p', 'ep', 'n')
local a = redis.call('HINCRBY', ek, 'a', 1)
dead = dead or a >= MAX_ATTEMPTS
-- a retry under PerTenant ordering keeps the tenant's only slot; under
-- endpoint isolation its endpoint's only slot, and the tenant's is freed
local keep = ORDERED and not dead
local bw = settle(t, charged, elapsed, now, not keep or (ISO_EP and ep ~= nil), dead and 'dead' or 'retry', ep, keep)
local change, paced = '', nil
if pace > 0 and m[2] and m[2] ~= '' then
  paced = pace_endpoint(t, m[2], pace, now)
else
  change = breaker_record(t, m[2], broken, bw, now)
end
if dead then
  dead_letter(t, id, a, cause, now, m[1], m[2], m[3])
  return { 'DEAD', a, 0, change }
end
local due = paced or now + delay
redis.call('ZADD', DELAYED, due, delayed_member(t, id, ORDERED, ep or m[2] or ''))
if ORDERED then redis.call('HSET', ek, 'x', 1) end
return { 'RETRY', a, due, change }
