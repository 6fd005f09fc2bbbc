-- ARGV: id, tenant, payload. Returns {'OK', seq} | {'HELD', seq} | {'DUP'} | {'MOVED', queue}.
local id, t, payload = ARGV[1], ARGV[2], ARGV[3]
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'p', 'm')
if st[2] and st[2] ~= '' then return { 'MOVED', st[2] } end
if not redis.call('SET', P .. ':id:' .. id, 1, 'NX', 'EX', ID_TTL) then return { 'DUP' } end
local seq = redis.call('INCR', P .. ':seq')
redis.call('HSET', ekey(id), 't', t, 's', seq, 'a', 0, 'p', payload, 'n', now_ms())
redis.call('HINCRBY', P .. ':depth', t, 1)
if st[1] == '1' then
  redis.call('RPUSH', hold(t), id)
  redis.call('HINCRBY', tk, 'h', 1)
  return { 'HELD', seq }
end
redis.call('RPUSH', lane(t), id)
activate_fresh(t)
return { 'OK', seq }
