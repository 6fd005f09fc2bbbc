-- ARGV: id, tenant, endpoint, payload, repeated for each envelope of the
-- batch (one or many). Returns a flat list with a {tag, value} pair per envelope, in order:
-- 'OK' seq | 'HELD' seq | 'DUP' 0 | 'MOVED' queue.
-- Per-tenant state is read once per batch and counters are written once per
-- tenant, so an import costs a few commands per envelope.
local now = now_ms()
local n = #ARGV / 4
-- one sequence block for the batch; ids that turn out duplicate leave gaps
local seq0 = redis.call('INCRBY', P .. ':seq', n) - n
local out = {}
local tenants = {} -- tenant -> {paused, moved, added, held}
local order = {}
for k = 1, n do
  local i = 4 * k - 3
  local id, t, ep, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local ts = tenants[t]
  if not ts then
    local st = redis.call('HMGET', tkey(t), 'p', 'm')
    ts = { paused = st[1] == '1', moved = st[2] or '', added = 0, held = 0 }
    tenants[t] = ts
    order[#order + 1] = t
  end
  if ts.moved ~= '' then
    out[#out + 1] = 'MOVED'; out[#out + 1] = ts.moved
  elseif not redis.call('SET', P .. ':id:' .. id, 1, 'NX', 'EX', ID_TTL) then
    out[#out + 1] = 'DUP'; out[#out + 1] = 0
  else
    local seq = seq0 + k
    redis.call('HSET', ekey(id), 't', t, 's', seq, 'a', 0, 'p', payload, 'n', now, 'ep', ep)
    ts.added = ts.added + 1
    if ts.paused then
      redis.call('RPUSH', hold(t), id)
      ts.held = ts.held + 1
      out[#out + 1] = 'HELD'
    else
      redis.call('RPUSH', lane(t), id)
      out[#out + 1] = 'OK'
    end
    out[#out + 1] = seq
  end
end
for _, t in ipairs(order) do
  local ts = tenants[t]
  if ts.added > 0 then
    redis.call('HINCRBY', tkey(t), 'n', ts.added)
    redis.call('SADD', P .. ':tenants', t)
  end
  if ts.held > 0 then redis.call('HINCRBY', tkey(t), 'h', ts.held) end
  if ts.added > ts.held then activate_fresh(t) end
end
return out
