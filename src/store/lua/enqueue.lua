-- Helpers (common.lua): num, now_ms, tkey, hold, epskey, lane_item, claim_ids, lane_append, activate,
--   activate_fresh
-- ARGV: id, tenant, endpoint, payload, backlog limit (0: none), tier ('':
-- unknown, keep what the tenant has; '-': none, clear it; else the tier
-- name), repeated for each envelope of the batch (one or many), then
-- optionally the version of the routing table the caller routed by. A
-- tenant's tier (tr) is written only when it changes (the last non-empty
-- tier of its envelopes in the call wins), also when they are refused FULL. Returns a flat list with a
-- {tag, value} pair per envelope, in order:
-- 'OK' seq | 'HELD' seq | 'DUP' 0 | 'MOVED' queue | 'FULL' depth | 'STALE' fence
-- | 'SHAPED' ms.
-- SHAPED: the tenant is shaped at ingest (sr, its rate per second, and sb,
-- its burst, in its state, written by the controller's promotion loop when
-- it is hot and its lane waits at the cap) and its bucket (sl tokens at su
-- ms) holds too few tokens for this call's envelopes: none is stored, and
-- ms says when enough will be there. A call needs min(its envelopes, burst)
-- tokens and spends one per envelope, so a call larger than the burst is
-- taken from a full bucket and leaves it in debt: the rate holds on average.
-- Refusals are counted (sd) and the last one's time kept (sx) for the
-- controller, which lifts the shaping once none has come for a while.
-- FULL: the tenant's depth here (queued, held, delayed and in flight) had
-- reached the limit before this call; the envelope is not stored and its id
-- not claimed. The check is per call, so a tenant's envelopes in one call
-- are all taken or all refused (a call may overshoot by its own size).
-- Ids are the tenant's own: two tenants may use the same id (see P:e:<ref>).
-- Per batch: tenant state is read once per tenant, each tenant's ids are
-- checked in two set lookups and claimed in one, and each tenant's lane gets
-- one RPUSH, which stores its envelopes whole (lane_item): an envelope costs
-- no call of its own.
local n = math.floor(#ARGV / 6)
-- the caller sends at most ENQUEUE_CHUNK (200); refuse, before any write,
-- what could not be unpacked
if n > 1000 then return redis.error_reply('enqueue: at most 1000 envelopes per call, got ' .. n) end
-- A producer that routed by a table appends its version: one older than the
-- queue's fence (set by a reshard before it changes the shard count) is
-- refused whole with 'STALE' and the fence, and the producer refreshes its
-- table. Without it (tests, the simulator, a hold buffer's import) nothing
-- is checked.
local routed = tonumber(ARGV[6 * n + 1]) or 0
local min_route = num(MIN_ROUTE_RAW, 0)
if routed > 0 and routed < min_route then
  local out = {}
  for k = 1, n do out[#out + 1] = 'STALE'; out[#out + 1] = min_route end
  return out
end
local now = now_ms()
-- one sequence block for the batch; ids that turn out duplicate leave gaps
local seq0 = redis.call('INCRBY', P .. ':seq', n) - n
local tenants = {} -- tenant -> {paused, moved, known, active, ip, xc, ids = {candidates}, lane = {ids}, held = {ids}}
local order = {}
local full = {} -- k -> true: over the tenant's backlog limit
for k = 1, n do
  local i = 6 * k - 5
  local t = ARGV[i + 1]
  local ts = tenants[t]
  if not ts then
    -- paused, moved, and whether activation can be skipped (already on the
    -- ring, parked at its cap, or blocked by a breaker)
    local st = redis.call('HMGET', tkey(t), 'p', 'm', 'r', 'k', 'bl', 'n', 'ip', 'ia', 'xc', 'h', 'tr', 'sr', 'sb', 'sl', 'su', 'sd')
    ts = { paused = st[1] == '1', moved = st[2] or '', known = st[6] ~= false, depth = tonumber(st[6]) or 0,
      active = st[3] == '1' or st[4] == '1' or st[5] == '1', ip = st[7], ia = st[8], xc = st[9], h = num(st[10], 0), tr = st[11] or '', ids = {}, lane = {}, held = {},
      -- the endpoint of each id in lane (endpoint isolation)
      lane_eps = {},
      sr = num(st[12], 0), sb = num(st[13], 0), sl = tonumber(st[14]), su = num(st[15], 0), sd = num(st[16], 0) }
    tenants[t] = ts
    order[#order + 1] = t
  end
  local limit = tonumber(ARGV[i + 4]) or 0
  local tier = ARGV[i + 5]
  if tier ~= nil and tier ~= '' then ts.tier = (tier == '-') and '' or tier end
  if ts.moved == '' then
    if limit > 0 and ts.depth >= limit then
      full[k] = true
    else
      ts.ids[#ts.ids + 1] = ARGV[i]
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

local out = {}
for k = 1, n do
  local i = 6 * k - 5
  local id, t, ep, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local ts = tenants[t]
  if ts.moved ~= '' then
    out[#out + 1] = 'MOVED'; out[#out + 1] = ts.moved
  elseif full[k] then
    out[#out + 1] = 'FULL'; out[#out + 1] = ts.depth
  elseif ts.shaped then
    out[#out + 1] = 'SHAPED'; out[#out + 1] = ts.shaped
  elseif not ts.fresh[id] then
    out[#out + 1] = 'DUP'; out[#out + 1] = 0
  else
    ts.fresh[id] = nil -- the same id twice in one batch is stored once
    local seq = seq0 + k
    -- attempts are none until the first failure, which writes a record
    local item = lane_item(id, ep, string.format('%d', seq), now_s, payload)
    if ts.paused then
      ts.held[#ts.held + 1] = item
      out[#out + 1] = 'HELD'
    else
      ts.lane[#ts.lane + 1] = item
      if ISO_EP then ts.lane_eps[#ts.lane] = ep end
      out[#out + 1] = 'OK'
    end
    out[#out + 1] = seq
  end
end
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
