-- ARGV: tenant, limit, then ids (none: all of the tenant's dead letters).
-- Moves up to `limit` of the tenant's dead letters in this queue back to the
-- tail of its lane (its hold buffer while paused), oldest first, as new
-- deliveries: attempts start again. The id stays claimed, so a producer's
-- retry of it is still a duplicate. Returns {'OK', count} or, when the
-- tenant has moved to another queue, {'MOVED', queue} and nothing changes.
local t, limit = ARGV[1], tonumber(ARGV[2])
local st = redis.call('HMGET', tkey(t), 'p', 'm')
if st[2] then return { 'MOVED', st[2] } end
local want = nil
if #ARGV > 2 then
  want = {}
  for i = 3, #ARGV do want[ARGV[i]] = true end
end
local DEAD = P .. ':dead'
local now = now_ms()
local ids = {}
for _, raw in ipairs(redis.call('LRANGE', DEAD, 0, -1)) do
  if #ids >= limit then break end
  local ok, d = pcall(cjson.decode, raw)
  if ok and type(d) == 'table' and d.tenant == t and (not want or want[d.id]) and d.envelope and d.envelope ~= '' then
    local eok, env = pcall(cjson.decode, d.envelope)
    local ep = (eok and type(env) == 'table' and type(env.endpoint) == 'string') and env.endpoint or 'default'
    redis.call('LREM', DEAD, 1, raw)
    redis.call('HSET', ekey(d.id), 't', t, 's', redis.call('INCR', P .. ':seq'), 'p', d.envelope, 'n', now, 'ep', ep)
    ids[#ids + 1] = d.id
  end
end
if #ids > 0 then
  redis.call('HINCRBY', tkey(t), 'n', #ids)
  if st[1] == '1' then
    redis.call('RPUSH', hold(t), unpack(ids))
    redis.call('HINCRBY', tkey(t), 'h', #ids)
  else
    redis.call('RPUSH', lane(t), unpack(ids))
    activate(t)
  end
end
return { 'OK', #ids }
