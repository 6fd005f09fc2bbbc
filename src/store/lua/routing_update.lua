-- Helpers (common.lua): none
-- KEYS[1]: the set's routing hash. ARGV: op (shards | pin | unpin), a, b.
-- Changes the table and bumps its version in one step; returns the version.
local key, op, a, b = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local changed = false
if op == 'shards' then
  if redis.call('HGET', key, 'shards') ~= a then redis.call('HSET', key, 'shards', a); changed = true end
elseif op == 'pin' then
  if redis.call('HGET', key, 'pin:' .. a) ~= b then redis.call('HSET', key, 'pin:' .. a, b); changed = true end
elseif op == 'unpin' then
  changed = redis.call('HDEL', key, 'pin:' .. a) == 1
else
  return redis.error_reply('unknown routing op ' .. op)
end
if changed then return redis.call('HINCRBY', key, 'version', 1) end
return tonumber(redis.call('HGET', key, 'version')) or 0
