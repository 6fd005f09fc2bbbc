-- Helpers (common.lua): istr, num, now_ms, tkey, lane, dlkey, eplane, ezkey, epskey, queued_of,
--   ekey, parse_item, dl_retain
-- ARGV: tenant, mode ('dead': to its dead letters with cause `purged`;
-- 'drop': deleted, counted), limit (at most 1000).
-- A user's purge of one tenant's queued envelopes in this queue, one step:
-- takes up to `limit` envelopes from the head of its lane. What is in flight
-- or waiting to retry is left to finish (the reply says how much), and so is
-- a tenant being moved (its lane is in two places: nothing changes, call
-- again once the move is over). Every read comes before the first write,
-- and nothing after it can fail.
-- Returns {'OK', purged, still queued, in_flight, delayed} | {'MOVED', queue}
--       | {'MOVING'}.
local t, mode, limit = ARGV[1], ARGV[2], math.min(math.max(math.floor(tonumber(ARGV[3]) or 100), 1), 1000)
if mode ~= 'dead' and mode ~= 'drop' then
  return redis.error_reply('purge: mode must be dead or drop')
end
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'm', 'p', 'n', 'ko', 'px', 'f', 'w')
if st[1] then return { 'MOVED', st[1] } end
if st[2] == '1' then return { 'MOVING' } end
-- the lanes taken from, and how many of each: under endpoint isolation up
-- to 100 of the tenant's endpoints' lanes, whole lanes while they fit
local lanes, ids = {}, {}
if ISO_EP then
  for _, ep in ipairs(redis.call('SRANDMEMBER', epskey(t), 100)) do
    if #ids >= limit then break end
    local got = redis.call('LRANGE', eplane(t, ep), 0, limit - #ids - 1)
    for _, id in ipairs(got) do ids[#ids + 1] = id end
    lanes[#lanes + 1] = { eplane(t, ep), #got, ep }
  end
else
  ids = redis.call('LRANGE', lane(t), 0, limit - 1)
  lanes[1] = { lane(t), #ids }
end
-- lane items (see lane_item): an envelope stored whole is read from its
-- item, any other from its record (deleted below)
local recs, bare = {}, {}
for i, item in ipairs(ids) do
  local id, seq, at, ep, payload = parse_item(item)
  ids[i] = id
  if seq then
    recs[i] = { payload, '0', ep, at }
  else
    bare[i] = true
    if mode == 'dead' then recs[i] = redis.call('HMGET', ekey(t, id), 'p', 'a', 'ep', 'n') end
  end
end
-- writes
local n = #ids
if n > 0 then
  for _, l in ipairs(lanes) do
    redis.call('LTRIM', l[1], l[2], -1)
    -- an endpoint whose lane is now empty is no longer ready
    if l[3] and redis.call('LLEN', l[1]) == 0 then
      redis.call('SREM', epskey(t), l[3])
      if redis.call('ZREM', ezkey(t), l[3]) == 1 then redis.call('HDEL', tk, 'es:' .. l[3]) end
    end
  end
  local now = now_ms()
  for i, id in ipairs(ids) do
    if mode == 'dead' then
      local r = recs[i]
      redis.call('XADD', dlkey(t), '*', 'id', id, 'a', istr(num(r[2], 0)), 'c', 'purged', 'at', now,
        'p', r[1] or '', 'ep', r[3] or '', 'n', r[4] or '')
    end
    if bare[i] then redis.call('DEL', ekey(t, id)) end
  end
  local set = { 'n', math.max(num(st[3], 0) - n, 0) }
  if mode == 'dead' then
    set[3] = 'ko'; set[4] = num(st[4], 0) + n
  else
    set[3] = 'px'; set[4] = num(st[5], 0) + n
  end
  redis.call('HSET', tk, unpack(set))
  if mode == 'dead' then dl_retain(t) end
end
return { 'OK', n, queued_of(t), num(st[6], 0), num(st[7], 0) }
