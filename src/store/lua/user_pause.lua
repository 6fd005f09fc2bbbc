-- Helpers (common.lua): num, tkey, activate
-- ARGV: tenant, version, state ('1' pause, '0' resume).
-- A user's pause of one tenant in this queue (`lanekeeper tenant pause`, the
-- admin API): while its `up` is '1' leases skip it (it steps off the ring at
-- its next turn, see lease_next) and ingest keeps accepting into its lane;
-- a resume puts it back on the ring, its order as it was. Distinct from the
-- relocation pause (`p`, pause.lua) and composed with it: a move carries
-- `up` to the tenant's new queue (import.lua).
-- Every user operation has a version, from the set's counter
-- (lk:{ns/set}:pausev): a queue takes a state only with a newer version than
-- the one it has (`upv`), so a move's import of an older state never undoes
-- a newer operation that reached the new queue first.
-- Returns {'OK', state now ('1'/'0'), changed (1/0), depth}
--       | {'MOVED', queue} (the tenant lives elsewhere now; nothing changed)
--       | {'STALE', upv} (this queue has a newer version: the set's counter
--         was lost; nothing changed, the caller asks again with a higher one).
-- Nothing can fail after the first write.
local t, v, state = ARGV[1], tonumber(ARGV[2]), ARGV[3]
if not v or v < 1 or v ~= math.floor(v) or (state ~= '1' and state ~= '0') then
  return redis.error_reply('user_pause: tenant, version (a whole number from 1), state 1 or 0')
end
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'm', 'upv', 'up', 'n')
if st[1] then return { 'MOVED', st[1] } end
local have = num(st[2], 0)
if v <= have then
  if (st[3] == '1') == (state == '1') then return { 'OK', state, 0, num(st[4], 0) } end
  return { 'STALE', have }
end
redis.call('HSET', tk, 'up', state, 'upv', v)
-- listed among the queue's tenants, so a reshard moves it (and its pause)
-- even when it has never had work here or its state was swept
redis.call('SADD', P .. ':tenants', t)
if state == '1' then
  redis.call('SADD', P .. ':paused', t)
else
  redis.call('SREM', P .. ':paused', t)
  activate(t)
end
return { 'OK', state, (st[3] == '1') == (state == '1') and 0 or 1, num(st[4], 0) }
