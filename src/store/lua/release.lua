-- ARGV: id, token. Gives a leased envelope back undelivered (a worker
-- shutting down): it returns to the head of its lane in order, its slot is
-- freed and its charge refunded, and no attempt is counted.
-- Returns 'OK' or 'STALE'.
local id, token = ARGV[1], ARGV[2]
local ek = ekey(id)
local m = redis.call('HMGET', ek, 't', 'l', 'c', 's')
if not m[1] or m[2] ~= token then return 'STALE' end
local t = m[1]
redis.call('ZREM', LEASES, id)
redis.call('HDEL', ek, 'l', 'c', 'at')
redis.call('HINCRBYFLOAT', tkey(t), 'd', tonumber(m[3]) or 0)
release(t)
return_to_head({ { t, tonumber(m[4]), id } })
return 'OK'
