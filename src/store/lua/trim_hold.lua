-- Helpers (common.lua): num, tkey, hold, ekey, parse_item
-- ARGV: tenant, ids... Removes these ids from the head of the hold buffer
-- once the target queue has them (with their records; an envelope stored
-- whole has none). Idempotent. Returns the count removed.
local t = ARGV[1]
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local head = redis.call('LINDEX', hold(t), 0)
  if head and parse_item(head) == id then
    redis.call('LPOP', hold(t))
    if head == id then redis.call('DEL', ekey(t, id)) end
    n = n + 1
  end
end
if n > 0 then
  local st = redis.call('HMGET', tkey(t), 'h', 'n')
  redis.call('HSET', tkey(t), 'h', math.max(num(st[1], 0) - n, 0), 'n', math.max(num(st[2], 0) - n, 0))
end
return n
