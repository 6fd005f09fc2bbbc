-- Helpers (common.lua): num, now_ms, tkey, hold, epskey, lane_item, seq_text, claim_ids, lane_append,
--   activate, activate_fresh
-- ARGV: the version of the routing table the caller routed by (0: none,
-- nothing is checked), then the batch's envelopes (one or many) grouped by
-- tenant: per group the tenant, its count of envelopes, its backlog limit
-- (0: none) and its tier ('': unknown, keep what the tenant has; '-': none,
-- clear it; else the tier name), then its envelopes' ids, then per envelope
-- its endpoint and payload (the ids side by side go to the claims' set
-- commands as they came, with no table built of them). A tenant's tier
-- (tr) is written only when it changes (the last non-empty tier of its
-- groups in the call wins), also when they are refused FULL.
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
-- Per batch: tenant state is read once per tenant, each group's ids are
-- checked in at most two set lookups and claimed in one (claim_ids), and
-- each tenant's lane gets one RPUSH, which stores its envelopes whole
-- (lane_item, its seq written by seq_text): an envelope costs no call of
-- its own.
-- Every check comes before the first write: a call that does not parse
-- changes nothing.
local routed = tonumber(ARGV[1])
-- a version is a whole number from 0 (nan, inf or a fraction would pass
-- the fence's comparison unchecked)
if routed and (routed ~= routed or routed < 0 or routed % 1 ~= 0 or routed >= 2 ^ 53) then routed = nil end
-- each group's place in ARGV (its tenant's) and its count of envelopes
local gpos, gcount, n, at = {}, {}, 0, 2
while routed and at <= #ARGV do
  local count = tonumber(ARGV[at + 1])
  if not count or count < 1 or count % 1 ~= 0 or at + 3 + 3 * count > #ARGV then
    routed = nil
  else
    gpos[#gpos + 1] = at
    gcount[#gpos] = count
    n = n + count
    at = at + 4 + 3 * count
  end
end
-- the caller sends at most ENQUEUE_CHUNK (200) envelopes a call
if not routed or n < 1 or n > 1000 then
  return redis.error_reply('enqueue: ARGV must be the routing version, then per tenant its name, count, limit '
    .. 'and tier, its count of ids and count (endpoint, payload) pairs, at most 1000 envelopes')
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
local tenants = {} -- tenant -> {paused, moved, known, active, ip, ia, xc, count, lane = {items}, held = {items}}
local order = {}
local full = {} -- group -> true: over the tenant's backlog limit
for g, i in ipairs(gpos) do
  local t = ARGV[i]
  local ts = tenants[t]
  if not ts then
    -- paused, moved, and whether activation can be skipped (already on the
    -- ring, parked at its cap, or blocked by a breaker); the rest of a
    -- shaped tenant's bucket and a paused one's held count are read when
    -- they are needed
    local st = redis.call('HMGET', tkey(t), 'p', 'm', 'r', 'k', 'bl', 'n', 'ip', 'ia', 'xc', 'tr', 'sr')
    ts = { paused = st[1] == '1', moved = st[2] or '', known = st[6] ~= false, depth = tonumber(st[6]) or 0,
      active = st[3] == '1' or st[4] == '1' or st[5] == '1', ip = st[7], ia = st[8], xc = st[9], tr = st[10] or '',
      sr = num(st[11], 0), count = 0, lane = {}, held = {},
      -- the endpoint of each item in lane (endpoint isolation)
      lane_eps = {} }
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
      ts.count = ts.count + gcount[g]
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
  local count = ts.count
  local rate = finite(ts.sr, 0)
  if rate > 0 and count > 0 then
    local b = redis.call('HMGET', tkey(t), 'sb', 'sl', 'su', 'sd')
    local burst = math.max(finite(num(b[1], 0), 1), 1)
    local su, sd = num(b[3], 0), num(b[4], 0)
    -- debt is at most one call's envelopes; a level past it is garbage
    local level = finite(tonumber(b[2]), burst)
    if level < -1000 then level = burst end
    if su > 0 and now > su then level = level + (now - su) * rate / 1000 end
    level = math.min(level, burst)
    local need = math.min(count, burst)
    if level < need then
      ts.shaped = math.min(math.max(math.ceil((need - level) * 1000 / rate), 1), 3600000)
      redis.call('HSET', tkey(t), 'sl', tostring(level), 'su', now, 'sd', sd + count, 'sx', now)
    else
      redis.call('HSET', tkey(t), 'sl', tostring(level - count), 'su', now)
    end
  end
end
-- formatted once for the batch, not by Redis for every envelope
local now_s = tostring(now)

local codes, out, k = {}, { seq0, false }, 0
for g, i in ipairs(gpos) do
  local t = ARGV[i]
  local ts = tenants[t]
  local count = gcount[g]
  local code, value
  if ts.moved ~= '' then
    code, value = 'M', ts.moved
  elseif full[g] then
    code, value = 'F', ts.depth
  elseif ts.shaped then
    code, value = 'S', ts.shaped
  end
  if code then
    for _ = 1, count do
      k = k + 1
      codes[k] = code
      out[#out + 1] = value
    end
  else
    -- the group's ids, then its (endpoint, payload) pairs
    local ids, pairs_at = i + 4, i + 4 + count
    local fresh
    fresh, ts.ip, ts.ia = claim_ids(t, ARGV, ids, ids + count - 1, now, ts.ip, ts.ia, ts.xc)
    for j = 1, count do
      k = k + 1
      if fresh == true or fresh[j] then
        local b = pairs_at + 2 * j - 2
        -- attempts are none until the first failure, which writes a record
        local item = lane_item(ARGV[ids + j - 1], ARGV[b], seq_text(seq0 + k), now_s, ARGV[b + 1])
        if ts.paused then
          ts.held[#ts.held + 1] = item
          codes[k] = 'H'
        else
          ts.lane[#ts.lane + 1] = item
          if ISO_EP then ts.lane_eps[#ts.lane] = ARGV[b] end
          codes[k] = 'O'
        end
      else
        codes[k] = 'D'
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
      local h = num(redis.call('HGET', tkey(t), 'h'), 0)
      redis.call('HSET', tkey(t), 'n', ts.depth + added, 'h', h + #ts.held, 'la', now_s)
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
