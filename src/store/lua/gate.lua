-- Helpers (common.lua): none
-- KEYS[1]: the set's routing hash. Lane moves and reshards of one set take
-- turns (they would otherwise interleave: a reshard re-hashing a tenant a
-- promotion is draining, or a retire landing on a shard a shrink prunes).
-- A lane records itself in `gate:lane:<index>` (at most 8: one per admitted
-- lane index) while it moves its tenant; a reshard holds `gate:reshard`.
-- ARGV: op, then by op:
--   lane_begin index name  'OK' (recorded, or already) | 'WAIT' (a reshard runs or waits)
--   lane_end index name    a finished move leaves (only its own record)
--   reshard_begin names..  the set's existing DedicatedLanes (records of lanes that no
--                          longer exist are dropped); {'OK'} | {'WAIT', moving lanes...}:
--                          the reshard then waits for those, and no new lane move starts
--   reshard_end            the reshard is done
-- Each op reads and writes at most the eight lane records and the reshard field.
local key, op = KEYS[1], ARGV[1]
local RESHARD = 'gate:reshard'
if op == 'lane_begin' then
  local f = 'gate:lane:' .. ARGV[2]
  if redis.call('HGET', key, f) == ARGV[3] then return 'OK' end
  if redis.call('HEXISTS', key, RESHARD) == 1 then return 'WAIT' end
  redis.call('HSET', key, f, ARGV[3])
  return 'OK'
elseif op == 'lane_end' then
  local f = 'gate:lane:' .. ARGV[2]
  if redis.call('HGET', key, f) == ARGV[3] then redis.call('HDEL', key, f) end
  return 'OK'
elseif op == 'reshard_begin' then
  local live = {}
  for i = 2, #ARGV do live[ARGV[i]] = true end
  local busy = {}
  for i = 0, 7 do
    local f = 'gate:lane:' .. i
    local name = redis.call('HGET', key, f)
    if name then
      if live[name] then busy[#busy + 1] = name else redis.call('HDEL', key, f) end
    end
  end
  if #busy > 0 then
    redis.call('HSETNX', key, RESHARD, 'wanted')
    local out = { 'WAIT' }
    for _, n in ipairs(busy) do out[#out + 1] = n end
    return out
  end
  redis.call('HSET', key, RESHARD, 'on')
  return { 'OK' }
elseif op == 'reshard_end' then
  redis.call('HDEL', key, RESHARD)
  return 'OK'
end
return redis.error_reply('gate: unknown op ' .. tostring(op))
