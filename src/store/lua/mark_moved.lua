-- Helpers (common.lua): tkey, lane, hold
-- ARGV: tenant, target queue. Refuses unless the tenant is paused and drained
-- here: a lane that is still busy is never moved; and, once its claims are
-- being copied (claims.lua `begin`), unless every id claimed since has been
-- copied too, so that at the moment the mark is set the target knows every
-- id this queue ever claimed for the tenant (after it, none is claimed here).
-- Returns {'OK', held} | {'BUSY', queued, in_flight, delayed} | {'CLAIMS', uncopied}.
local t, target = ARGV[1], ARGV[2]
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'f', 'w', 'p', 'xc')
local queued, f, w = redis.call('LLEN', lane(t)), tonumber(st[1]) or 0, tonumber(st[2]) or 0
if st[3] ~= '1' or queued > 0 or f > 0 or w > 0 then return { 'BUSY', queued, f, w } end
local delta = P .. ':idsx:' .. t
if st[4] == '1' then
  local uncopied = redis.call('SCARD', delta)
  if uncopied > 0 then return { 'CLAIMS', uncopied } end
end
redis.call('HSET', tk, 'm', target)
redis.call('HDEL', tk, 'xc')
return { 'OK', redis.call('LLEN', hold(t)) }
