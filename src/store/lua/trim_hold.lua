-- ARGV: tenant, ids... Removes these ids from the head of the hold buffer
-- once the target queue has them. Idempotent. Returns the count removed.
local t = ARGV[1]
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('LINDEX', hold(t), 0) == id then
    redis.call('LPOP', hold(t))
    redis.call('DEL', ekey(id))
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', tkey(t), 'h', -n)
  redis.call('HINCRBY', tkey(t), 'n', -n)
end
return n
