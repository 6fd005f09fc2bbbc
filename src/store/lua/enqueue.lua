-- Helpers (common.lua): num, now_ms, tkey, hold, epskey, lane_item, claim_ids, lane_append, activate,
--   activate_fresh
-- ARGV: the version of the routing table the caller routed by (0: none,
-- nothing is checked), then the batch's envelopes (one or many) grouped by
-- tenant: per group the tenant, its count of envelopes, its backlog limit
-- (0: none) and its tier ('': unknown, keep what the tenant has; '-': none,
-- clear it; else the tier name), then per envelope its id, endpoint and
-- payload. A tenant's tier (tr) is written only when it changes (the last
-- non-empty tier of its groups in the call wins), also when they are
-- refused FULL.
-- Returns {seq0, codes, values...}: codes has one letter per envelope, in
-- order, 'O' queued and 'H' held (its seq is seq0 plus its place in the
-- call, from 1), 'D' a duplicate, and, each with the next of the values,
-- 'M' moved (the queue), 'F' full (the depth), 'T' stale (the fence) and
-- 'S' shaped (ms): two reply elements per call, not two per envelope.
-- Shaped ('S'): the tenant is shaped at ingest (sr, its rate per second, and sb,
-- its burst, in its state, written by the controller's promotion loop when
-- it is hot and its lane waits at the cap) and its bucket (sl tokens at su
-- ms) holds too few tokens for this call's envelopes: none is stored, and
-- ms says when enough will be there. A call needs min(its envelopes, burst)
-- tokens and spends one per envelope, so a call larger than the burst is
-- taken from a full bucket and leaves it in debt: the rate holds on average.
-- Refusals are counted (sd) and the last one's time kept (sx) for the
-- controller, which lifts the shaping once none has come for a while.
-- Full ('F'): the tenant's depth here (queued, held, delayed and in flight) had
-- reached the limit before this call; the envelope is not stored and its id
-- not claimed. The check is per call, so a tenant's envelopes in one call
-- are all taken or all refused (a call may overshoot by its own size).
-- Ids are the tenant's own: two tenants may use the same id (see P:e:<ref>).
-- Per batch: tenant state is read once per tenant, each tenant's ids are
-- checked in two set lookups and claimed in one, and each tenant's lane gets
-- one RPUSH, which stores its envelopes whole (lane_item): an envelope costs
-- no call of its own.
-- Every check comes before the first write: a call that does not parse
-- changes nothing.
local routed = tonumber(ARGV[1])
-- a version is a whole number from 0 (nan, inf or a fraction would pass
-- the fence's comparison unchecked)
if routed and (routed ~= routed or routed < 0 or routed % 1 ~= 0 or routed >= 2 ^ 53) then routed = nil end
-- each group's place in ARGV (its tenant's) and its last envelope's id's
local gpos, glast, n, at = {}, {}, 0, 2
while routed and at <= #ARGV do
  local count = tonumber(ARGV[at + 1])
  if not count or count < 1 or count % 1 ~= 0 or at + 3 + 3 * count > #ARGV then
    routed = nil
  else
    gpos[#gpos + 1] = at
    glast[#gpos] = at + 1 + 3 * count
    n = n + count
    at = at + 4 + 3 * count
  end
end
-- the caller sends at most ENQUEUE_CHUNK (200) envelopes a call
if not routed or n < 1 or n > 1000 then
  return redis.error_reply('enqueue: ARGV must be the routing version, then per tenant its name, count, limit '
    .. 'and tier and count (id, endpoint, payload) triples, at most 1000 envelopes')
end
-- A producer that routed by a table sends its version: one older than the
-- queue's fence (set by a reshard before it changes the shard count) is
-- refused whole with 'T' and the fence, and the producer refreshes its
-- table. Without it (tests, the simulator) nothing is checked.
local min_route = num(MIN_ROUTE_RAW, 0)
if routed > 0 and routed < min_route then
  local out = { 0, string.rep('T', n) }
  for k = 1, n do out[k + 2] = min_route end
  return out
end
local now = now_ms()
-- one sequence block for the batch; ids that turn out duplicate leave gaps
local seq0 = redis.call('INCRBY', P .. ':seq', n) - n
local tenants = {} -- tenant -> {paused, moved, known, active, ip, xc, ids = {candidates}, lane = {items}, held = {items}}
local order = {}
local full = {} -- group -> true: over the tenant's backlog limit
for g, i in ipairs(gpos) do
  local t = ARGV[i]
  local ts = tenants[t]
  if not ts then
    -- paused, moved, and whether activation can be skipped (already on the
    -- ring, parked at its cap, or blocked by a breaker)
    local st = redis.call('HMGET', tkey(t), 'p', 'm', 'r', 'k', 'bl', 'n', 'ip', 'ia', 'xc', 'h', 'tr', 'sr', 'sb', 'sl', 'su', 'sd')
    ts = { paused = st[1] == '1', moved = st[2] or '', known = st[6] ~= false, depth = tonumber(st[6]) or 0,
      active = st[3] == '1' or st[4] == '1' or st[5] == '1', ip = st[7], ia = st[8], xc = st[9], h = num(st[10], 0), tr = st[11] or '', ids = {}, lane = {}, held = {},
      -- the endpoint of each item in lane (endpoint isolation)
      lane_eps = {},
      sr = num(st[12], 0), sb = num(st[13], 0), sl = tonumber(st[14]), su = num(st[15], 0), sd = num(st[16], 0) }
    tenants[t] = ts
    order[#order + 1] = t
  end
  local limit = tonumber(ARGV[i + 2]) or 0
  local tier = ARGV[i + 3]
  if tier ~= '' then ts.tier = (tier == '-') and '' or tier end
  if ts.moved == '' then
    if limit > 0 and ts.depth >= limit then
      full[g] = true
    else
      local ids = ts.ids
      for b = i + 4, glast[g], 3 do ids[#ids + 1] = ARGV[b] end
    end
  end
end
-- A finite number, else d: state written behind the scripts' back (nan,
-- inf) must neither fail a call nor shape a tenant for ever.
local function finite(x, d)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return d end
  return x
end
-- Shaping (see SHAPED above), per tenant and before any id is claimed.
for _, t in ipairs(order) do
  local ts = tenants[t]
  local count = #ts.ids
  local rate = finite(ts.sr, 0)
  if rate > 0 and count > 0 then
    local burst = math.max(finite(ts.sb, 1), 1)
    -- debt is at most one call's envelopes; a level past it is garbage
    local level = finite(ts.sl, burst)
    if level < -1000 then level = burst end
    ts.sr = rate
    if ts.su > 0 and now > ts.su then level = level + (now - ts.su) * ts.sr / 1000 end
    level = math.min(level, burst)
    local need = math.min(count, burst)
    if level < need then
      ts.shaped = math.min(math.max(math.ceil((need - level) * 1000 / ts.sr), 1), 3600000)
      ts.ids = {}
      redis.call('HSET', tkey(t), 'sl', tostring(level), 'su', now, 'sd', ts.sd + count, 'sx', now)
    else
      redis.call('HSET', tkey(t), 'sl', tostring(level - count), 'su', now)
    end
  end
end
for _, t in ipairs(order) do
  local ts = tenants[t]
  ts.fresh = claim_ids(t, ts.ids, now, ts.ip, ts.ia, ts.xc)
end
-- formatted once for the batch, not by Redis for every envelope
local now_s = tostring(now)

-- a seq as the item holds it: Lua writes a number below 10^14 as its
-- digits, and only one past it (state written behind the scripts' back)
-- needs formatting
local big = seq0 + n >= 1e14
local codes, out, k = {}, { seq0, false }, 0
for g, i in ipairs(gpos) do
  local ts = tenants[ARGV[i]]
  for b = i + 4, glast[g], 3 do
    k = k + 1
    local id = ARGV[b]
    if ts.moved ~= '' then
      codes[k] = 'M'; out[#out + 1] = ts.moved
    elseif full[g] then
      codes[k] = 'F'; out[#out + 1] = ts.depth
    elseif ts.shaped then
      codes[k] = 'S'; out[#out + 1] = ts.shaped
    elseif not ts.fresh[id] then
      codes[k] = 'D'
    else
      ts.fresh[id] = nil -- the same id twice in one batch is stored once
      local seq = seq0 + k
      -- attempts are none until the first failure, which writes a record
      local item = lane_item(id, ARGV[b + 1], big and string.format('%d', seq) or seq, now_s, ARGV[b + 2])
      if ts.paused then
        ts.held[#ts.held + 1] = item
        codes[k] = 'H'
      else
        ts.lane[#ts.lane + 1] = item
        if ISO_EP then ts.lane_eps[#ts.lane] = ARGV[b + 1] end
        codes[k] = 'O'
      end
    end
  end
end
out[2] = table.concat(codes)
for _, t in ipairs(order) do
  local ts = tenants[t]
  local added = #ts.lane + #ts.held
  -- the tier, when the caller said one and it differs from the stored one
  -- (before activation, which reads it for the tenant's quantum)
  if ts.moved == '' and ts.tier and ts.tier ~= ts.tr then
    if ts.tier == '' then redis.call('HDEL', tkey(t), 'tr') else redis.call('HSET', tkey(t), 'tr', ts.tier) end
  end
  if added > 0 then
    -- depth (and held count) as read at the start plus what this call added:
    -- one write, and nothing else in this call changes them
    -- (and its last activity, for the sweep of idle tenants)
    if #ts.held > 0 then
      redis.call('HSET', tkey(t), 'n', ts.depth + added, 'h', ts.h + #ts.held, 'la', now_s)
    else
      redis.call('HSET', tkey(t), 'n', ts.depth + added, 'la', now_s)
    end
    -- a tenant's hash keeps its depth counter once it exists
    if not ts.known then redis.call('SADD', P .. ':tenants', t) end
  end
  if #ts.held > 0 then
    redis.call('RPUSH', hold(t), unpack(ts.held))
  end
  if #ts.lane > 0 then
    -- under endpoint isolation, a tenant whose endpoints have work already
    -- (parked at their cap, or blocked) is not idle: no fresh turn
    local had = ts.active or (ISO_EP and redis.call('EXISTS', epskey(t)) == 1)
    lane_append(t, ts.lane, ts.lane_eps)
    if not had then activate_fresh(t) elseif ISO_EP then activate(t) end
  end
end
return out
