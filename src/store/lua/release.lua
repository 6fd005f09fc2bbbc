-- ARGV: id, token. Gives a leased envelope back undelivered (a worker
-- shutting down): it returns to the head of its lane in order, its slot is
-- freed and its charge refunded, and no attempt is counted.
-- Returns 'OK' or 'STALE'.
local id, token = ARGV[1], ARGV[2]
local charged, t = end_lease(id, token)
if not charged then return 'STALE' end
-- HINCRBYFLOAT, not HINCRBY: a deficit written by an older library version may be a fraction
redis.call('HINCRBYFLOAT', tkey(t), 'd', charged)
release(t)
return_to_head({ { t, tonumber(redis.call('HGET', ekey(id), 's')), id } })
return 'OK'
