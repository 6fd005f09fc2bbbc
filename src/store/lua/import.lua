-- ARGV: tenant, then id, attempts, payload, enqueued_ms, endpoint per envelope.
-- Appends envelopes moved from another queue's hold buffer to this lane, in
-- order. Idempotent: an id already seen here is skipped, so a move that died
-- halfway can be repeated. Returns the count appended.
local t = ARGV[1]
local n = 0
local now = now_ms()
local ids = {}
for i = 2, #ARGV, 5 do ids[#ids + 1] = ARGV[i] end
local fresh_id = claim_ids(ids, now)
for i = 2, #ARGV, 5 do
  local id = ARGV[i]
  if fresh_id[id] then
    fresh_id[id] = nil
    local seq = redis.call('INCR', P .. ':seq')
    redis.call('HSET', ekey(id), 't', t, 's', seq, 'a', ARGV[i + 1], 'p', ARGV[i + 2], 'n', ARGV[i + 3],
      'ep', ARGV[i + 4])
    redis.call('RPUSH', lane(t), id)
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', tkey(t), 'n', n)
  redis.call('SADD', P .. ':tenants', t)
end
activate(t)
return n
