-- Helpers (common.lua): hold, adopt, parse_item
-- ARGV: tenant, limit. Returns the first `limit` held envelopes as a flat
-- list of id, seq, attempts, payload, enqueued_ms, endpoint ('' payload and
-- seq: the record is gone, and the target dead-letters it with that cause).
-- An envelope stored whole in the buffer (see lane_item) is read from it.
local t, limit = ARGV[1], tonumber(ARGV[2])
local items = redis.call('LRANGE', hold(t), 0, limit - 1)
local out = {}
for _, item in ipairs(items) do
  local id, seq, at, ep, payload = parse_item(item)
  local m
  if seq then
    m = { seq, '0', payload, at, ep }
  else
    m = redis.call('HMGET', adopt(t, id), 's', 'a', 'p', 'n', 'ep')
  end
  out[#out + 1] = id
  out[#out + 1] = m[1] or ''
  out[#out + 1] = m[2] or '0'
  out[#out + 1] = m[3] or ''
  out[#out + 1] = m[4] or '0'
  out[#out + 1] = m[5] or ''
end
return out
