-- Helpers (common.lua): now_ms, end_lease, tkey, leased_record, release, dead_missing_lease, return_to_head
-- ARGV: id, token. Gives a leased envelope back undelivered (a worker
-- shutting down): it returns to the head of its lane in order, its slot is
-- freed and its charge refunded, and no attempt is counted. An envelope
-- whose record is gone is dead-lettered with that cause instead.
-- Returns 'OK' or 'STALE'.
local id, token = ARGV[1], ARGV[2]
local charged, t, ep = end_lease(id, token)
if not charged then return 'STALE' end
local ek, present = leased_record(t, id, token)
if not present then
  local now = now_ms()
  dead_missing_lease(t, id, charged, 0, now, ep)
  return 'OK'
end
-- HINCRBYFLOAT, not HINCRBY: a deficit written by an older library version may be a fraction
redis.call('HINCRBYFLOAT', tkey(t), 'd', charged)
release(t, ep, -charged)
local m = redis.call('HMGET', ek, 's', 'ep')
return_to_head({ { t, tonumber(m[1]) or 0, id, ep or m[2] } })
return 'OK'
