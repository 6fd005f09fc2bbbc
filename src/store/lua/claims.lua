-- Helpers (common.lua): now_ms, tkey, claims_key, id_period, claims_advance
-- The tenant's idempotency claims travel with it when it moves (see
-- Store::mark_moved): a producer's retry of an id delivered before the move
-- is still a duplicate after it. ARGV: op, tenant, then by op:
--   begin                  mark the tenant's claims as being copied (xc): from now on
--                          its new claims also go to P:idsx:<t>. Returns the periods
--                          it has claim sets for (this one and the one before).
--   scan period cursor n   SSCAN of that period's set: {next cursor, ids...}
--   delta n                up to n ids claimed since `begin` (SRANDMEMBER)
--   done ids...            those delta ids are copied (SREM)
--   import ids...          claim these ids here, in the current period (the target side)
-- Every op reads or writes a bounded number of members: n and the ids are at
-- most 1000, checked before any write.
local op, t = ARGV[1], ARGV[2]
if #ARGV > 1002 then return redis.error_reply('claims: at most 1000 ids per call') end
local delta = P .. ':idsx:' .. t
if op == 'begin' then
  redis.call('HSET', tkey(t), 'xc', 1)
  local period = id_period(now_ms())
  local out = {}
  for _, p in ipairs({ period, period - 1 }) do
    if redis.call('EXISTS', claims_key(p, t)) == 1 then out[#out + 1] = p end
  end
  return out
elseif op == 'scan' then
  local r = redis.call('SSCAN', claims_key(ARGV[3], t), ARGV[4], 'COUNT', math.min(tonumber(ARGV[5]) or 100, 1000))
  local out = { r[1] }
  for _, id in ipairs(r[2]) do out[#out + 1] = id end
  return out
elseif op == 'delta' then
  return redis.call('SRANDMEMBER', delta, math.min(tonumber(ARGV[3]) or 100, 1000))
elseif op == 'done' then
  if #ARGV < 3 then return 0 end
  return redis.call('SREM', delta, unpack(ARGV, 3))
elseif op == 'import' then
  if #ARGV < 3 then return 0 end
  local period = id_period(now_ms())
  local cur = claims_key(period, t)
  local added = redis.call('SADD', cur, unpack(ARGV, 3))
  local last = tonumber(redis.call('HGET', tkey(t), 'ip')) or -1
  if last < period then claims_advance(t, period, last) end
  return added
end
return redis.error_reply('claims: unknown op ' .. tostring(op))
