-- Helpers (common.lua): hold, adopt
-- ARGV: tenant, limit. Returns the first `limit` held envelopes as a flat
-- list of id, seq, attempts, payload, enqueued_ms, endpoint ('' payload and
-- seq: the record is gone, and the target dead-letters it with that cause).
local t, limit = ARGV[1], tonumber(ARGV[2])
local ids = redis.call('LRANGE', hold(t), 0, limit - 1)
local out = {}
for _, id in ipairs(ids) do
  local ek = adopt(t, id)
  local m = redis.call('HMGET', ek, 's', 'a', 'p', 'n', 'ep')
  out[#out + 1] = id
  out[#out + 1] = m[1] or ''
  out[#out + 1] = m[2] or '0'
  out[#out + 1] = m[3] or ''
  out[#out + 1] = m[4] or '0'
  out[#out + 1] = m[5] or ''
end
return out
