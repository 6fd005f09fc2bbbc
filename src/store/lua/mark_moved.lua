-- ARGV: tenant, target queue. Refuses unless the tenant is paused and drained
-- here: a lane that is still busy is never moved. Returns {'OK', held} or {'BUSY', queued, in_flight, delayed}.
local t, target = ARGV[1], ARGV[2]
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'f', 'w', 'p')
local queued, f, w = redis.call('LLEN', lane(t)), tonumber(st[1]) or 0, tonumber(st[2]) or 0
if st[3] ~= '1' or queued > 0 or f > 0 or w > 0 then return { 'BUSY', queued, f, w } end
redis.call('HSET', tk, 'm', target)
return { 'OK', redis.call('LLEN', hold(t)) }
