-- Helpers (common.lua): num, tkey, hold, ekey
-- ARGV: tenant, ids... Removes these ids from the head of the hold buffer
-- once the target queue has them. Idempotent. Returns the count removed.
local t = ARGV[1]
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('LINDEX', hold(t), 0) == id then
    redis.call('LPOP', hold(t))
    redis.call('DEL', ekey(t, id))
    n = n + 1
  end
end
if n > 0 then
  local st = redis.call('HMGET', tkey(t), 'h', 'n')
  redis.call('HSET', tkey(t), 'h', math.max(num(st[1], 0) - n, 0), 'n', math.max(num(st[2], 0) - n, 0))
end
return n
