-- Helpers (common.lua): tkey, lane, hold, adopt, parse_item, lane_append, activate
-- ARGV: tenant, limit. Appends the hold buffer to the lane in order and
-- unpauses (and stops copying its claims, should a move have begun). A long buffer is moved in steps of `limit` (the tenant stays
-- paused meanwhile, so order holds): returns {'MORE', moved} until {'DONE', moved}.
local t, limit = ARGV[1], tonumber(ARGV[2])
local tk = tkey(t)
local h, q = hold(t), lane(t)
local moved = 0
if ISO_EP then
  -- each held envelope to the lane of its endpoint, in order (at most a
  -- page: the endpoint of each is read from it when it is stored whole,
  -- else from its record)
  limit = math.min(math.max(math.floor(limit or 500), 1), 1000)
  local ids = redis.call('LRANGE', h, 0, limit - 1)
  local eps = {}
  for i, item in ipairs(ids) do
    local id, seq, _, ep = parse_item(item)
    eps[i] = seq and ep or redis.call('HGET', adopt(t, id), 'ep') or ''
  end
  moved = #ids
  lane_append(t, ids, eps)
  if moved > 0 then redis.call('LTRIM', h, moved, -1) end
  if redis.call('LLEN', h) > 0 then
    redis.call('HINCRBY', tk, 'h', -moved)
    return { 'MORE', moved }
  end
elseif redis.call('EXISTS', h) == 1 and redis.call('LLEN', q) == 0 then
  moved = redis.call('LLEN', h)
  redis.call('RENAME', h, q)
else
  while moved < limit and redis.call('LMOVE', h, q, 'LEFT', 'RIGHT') do moved = moved + 1 end
  if redis.call('LLEN', h) > 0 then
    redis.call('HINCRBY', tk, 'h', -moved)
    return { 'MORE', moved }
  end
end
redis.call('HSET', tk, 'p', 0, 'h', 0)
-- a move that ends here (or was given up) no longer copies claims
redis.call('HDEL', tk, 'm', 'xc')
redis.call('UNLINK', P .. ':idsx:' .. t)
activate(t)
return { 'DONE', moved }
