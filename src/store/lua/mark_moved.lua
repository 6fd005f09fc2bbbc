-- Helpers (common.lua): num, tkey, lane, hold, eplane, ezkey, epskey, queued_of
-- ARGV: tenant, target queue. Refuses unless the tenant is paused and drained
-- here: a lane that is still busy is never moved; and, once its claims are
-- being copied (claims.lua `begin`), unless every id claimed since has been
-- copied too, so that at the moment the mark is set the target knows every
-- id this queue ever claimed for the tenant (after it, none is claimed here).
-- A tenant a user paused (up) never drains its lane: once nothing of it is in
-- flight or delayed, its lane goes to the head of its hold buffer (older
-- first, so its order holds), at most 1000 envelopes per call, and the move
-- takes it along. The tenant leaves this queue's list of paused tenants.
-- Returns {'OK', held} | {'BUSY', queued, in_flight, delayed} | {'CLAIMS', uncopied}
--       | {'MERGE', still queued} (call again: a user-paused lane is moving to the hold buffer).
local t, target = ARGV[1], ARGV[2]
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'f', 'w', 'p', 'xc', 'up', 'h')
local q, h = lane(t), hold(t)
local queued, f, w = queued_of(t), tonumber(st[1]) or 0, tonumber(st[2]) or 0
if st[3] ~= '1' or f > 0 or w > 0 or (queued > 0 and st[5] ~= '1') then return { 'BUSY', queued, f, w } end
if queued > 0 and ISO_EP then
  -- endpoint isolation: one endpoint's lane after another goes to the head
  -- of the hold buffer (each endpoint's order holds; a tenant's endpoints
  -- have none between them), at most 1000 envelopes per call
  local moved = 0
  for _, ep in ipairs(redis.call('SRANDMEMBER', epskey(t), 100)) do
    local el = eplane(t, ep)
    while moved < 1000 and redis.call('LMOVE', el, h, 'RIGHT', 'LEFT') do moved = moved + 1 end
    if redis.call('LLEN', el) > 0 then break end
    redis.call('SREM', epskey(t), ep)
    redis.call('ZREM', ezkey(t), ep)
    redis.call('HDEL', tk, 'es:' .. ep, 'ev:' .. ep)
  end
  redis.call('HSET', tk, 'h', num(st[6], 0) + moved)
  if redis.call('EXISTS', epskey(t)) == 1 then return { 'MERGE', queued_of(t) } end
elseif queued > 0 then
  -- lane ++ hold, moving the shorter side one end at a time; the rest waits
  -- for the next call. An empty hold buffer takes the lane whole.
  local held, moved = redis.call('LLEN', h), 0
  if held == 0 then
    redis.call('RENAME', q, h)
    moved = queued
  elseif queued <= held then
    while moved < 1000 and redis.call('LMOVE', q, h, 'RIGHT', 'LEFT') do moved = moved + 1 end
  else
    local back = 0
    while back < 1000 and redis.call('LMOVE', h, q, 'LEFT', 'RIGHT') do back = back + 1 end
    if redis.call('LLEN', h) == 0 then
      redis.call('RENAME', q, h)
      moved = queued + back
    end
    moved = moved - back
  end
  redis.call('HSET', tk, 'h', num(st[6], 0) + moved)
  local left = redis.call('LLEN', q)
  if left > 0 then return { 'MERGE', left } end
end
local delta = P .. ':idsx:' .. t
if st[4] == '1' then
  local uncopied = redis.call('SCARD', delta)
  if uncopied > 0 then return { 'CLAIMS', uncopied } end
end
redis.call('HSET', tk, 'm', target)
redis.call('HDEL', tk, 'xc')
-- a user's pause is listed where the tenant lives (import.lua lists it there)
redis.call('SREM', P .. ':paused', t)
return { 'OK', redis.call('LLEN', hold(t)) }
