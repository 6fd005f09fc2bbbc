-- Shared prelude of every per-queue script. KEYS[1] is the queue prefix,
-- `lk:{<namespace>/<set>/<queue>}`: every key below starts with it, so all
-- keys of a queue share one hash tag and each script touches one slot.
--
--   P:conf            HASH  quantum, cap, ordered, weight, est0, maxatt, idttl,
--                           mnext (next time a lease does maintenance),
--                           bratio, bmin, bwin (ms), bopen (ms): the circuit breaker
--   P:weights         HASH  tenant -> weight
--   P:fresh           LIST  tenants that just became active (served first, one turn)
--   P:ring            LIST  backlogged tenants, DRR order (head is served)
--   P:t:<tenant>      HASH  d deficit (worker-s), f in flight, r on fresh/ring, k parked at cap,
--                           e estimate (s), b fresh-turn budget, p paused, m moved-to queue,
--                           w delayed, h held, n depth (queued, held, delayed or in flight),
--                           ok delivered, ko dead-lettered, bw breakers in use, bl blocked
--   P:tenants         SET   every tenant that has had work here (for attribution)
--   P:q:<tenant>      LIST  the tenant's lane: envelope ids, head first
--   P:h:<tenant>      LIST  hold buffer while paused
--   P:e:<id>          HASH  t tenant, s seq, a attempts, p payload, n enqueued ms, ep endpoint,
--                           l lease token, c charged s, at leased ms, x holds slot
--   P:id:<id>         STRING idempotency marker (expires after idttl seconds)
--   P:seq             STRING enqueue sequence
--   P:leases          ZSET  id -> lease deadline ms
--   P:delayed         ZSET  id -> retry due ms
--   P:dead            LIST  dead letters (JSON)
--   P:ws:<bucket>     HASH  tenant -> worker-seconds in a 10 s bucket (expires)
--   P:br:<len>:<tenant>:<endpoint>
--                     HASH  circuit breaker: s closed|open|half, u until ms, ws window start,
--                           n requests, x failures (absent while closed and healthy)
--   P:blocked         ZSET  tenant -> ms: tenants whose head envelope's breaker is open
--   P:wake            CHANNEL published when a tenant becomes active (wakes idle workers)
local P = KEYS[1]
local RING = P .. ':ring'
local FRESH = P .. ':fresh'
local LEASES = P .. ':leases'
local DELAYED = P .. ':delayed'

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function tkey(t) return P .. ':t:' .. t end
local function lane(t) return P .. ':q:' .. t end
local function hold(t) return P .. ':h:' .. t end
local function ekey(id) return P .. ':e:' .. id end

local CONF = redis.call('HMGET', P .. ':conf', 'quantum', 'cap', 'ordered', 'weight', 'est0', 'maxatt', 'idttl',
  'mnext', 'bratio', 'bmin', 'bwin', 'bopen')
local QUANTUM = tonumber(CONF[1]) or 2.0
local ORDERED = CONF[3] == '1'
local CAP = ORDERED and 1 or (tonumber(CONF[2]) or 8)
local DEFAULT_WEIGHT = tonumber(CONF[4]) or 1.0
local EST0 = tonumber(CONF[5]) or 1.0
local MAX_ATTEMPTS = tonumber(CONF[6]) or 10
local ID_TTL = tonumber(CONF[7]) or 86400
local MAINT_NEXT = tonumber(CONF[8]) or 0
local BR_RATIO = tonumber(CONF[9]) or 0.5
local BR_MIN = tonumber(CONF[10]) or 20
local BR_WINDOW = tonumber(CONF[11]) or 60000
local BR_OPEN = tonumber(CONF[12]) or 30000
local BLOCKED = P .. ':blocked'

local function weight(t)
  return tonumber(redis.call('HGET', P .. ':weights', t)) or DEFAULT_WEIGHT
end

-- Put a tenant with queued work at the tail of the ring, unless it is on
-- the ring or the fresh list already, or parked at its cap.
local function activate(t)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'bl')
  if st[1] == '1' or st[2] == '1' or st[3] == '1' then return end
  if redis.call('LLEN', lane(t)) == 0 then return end
  redis.call('RPUSH', RING, t)
  redis.call('HSET', tk, 'r', 1)
  redis.call('PUBLISH', P .. ':wake', t)
end

-- A tenant that was idle and has new work: it earns its quantum now and, if
-- that leaves it in credit (no unpaid debt), is served ahead of the
-- backlogged ring for one turn, like a sparse flow in FQ-CoDel. This is what
-- lets a password reset overtake a whale's turn.
local function activate_fresh(t)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'd', 'bl')
  if st[1] == '1' or st[2] == '1' or st[4] == '1' then return end
  local q = QUANTUM * weight(t)
  local d = (tonumber(st[3]) or 0) + q
  -- b: what the fresh turn may still charge; refunds at ack do not extend it
  redis.call('HSET', tk, 'r', 1, 'd', d, 'b', q)
  if d > 0 then redis.call('RPUSH', FRESH, t) else redis.call('RPUSH', RING, t) end
  redis.call('PUBLISH', P .. ':wake', t)
end

-- Free one in-flight slot; a tenant parked at its cap rejoins the ring if it has work.
local function release(t)
  local tk = tkey(t)
  local f = redis.call('HINCRBY', tk, 'f', -1)
  if f < 0 then redis.call('HSET', tk, 'f', 0); f = 0 end
  if redis.call('HGET', tk, 'k') == '1' and f < CAP then
    redis.call('HSET', tk, 'k', 0)
    activate(t)
  end
end

-- ---- circuit breaker, per tenant and endpoint --------------------------
-- Healthy endpoints cost nothing: a breaker hash exists only from an
-- endpoint's first failure in a window, and the tenant's `bw` count (read
-- with state the scripts read anyway) says whether to look.

local function bkey(t, ep) return P .. ':br:' .. #t .. ':' .. t .. ':' .. ep end

-- Lift a tenant's block and put it back on the ring.
local function unblock(t)
  redis.call('ZREM', BLOCKED, t)
  redis.call('HSET', tkey(t), 'bl', 0)
  activate(t)
end

-- May a request to `ep` go out now? Returns true, or the time until which
-- it is blocked, and the state change ('half-open' or '').
local function breaker_gate(t, ep, now)
  local k = bkey(t, ep)
  local b = redis.call('HMGET', k, 's', 'u')
  if b[1] ~= 'open' and b[1] ~= 'half' then return true, '' end
  local u = tonumber(b[2]) or 0
  if now < u then return u, '' end
  -- open and cooled down, or a half-open probe that never reported: one probe goes out
  redis.call('HSET', k, 's', 'half', 'u', now + BR_OPEN)
  return true, (b[1] == 'open') and 'half-open' or ''
end

-- Count one delivery result against `ep`'s breaker. `bw` is the tenant's
-- breaker count. Returns the state change ('open', 'closed' or '').
local function breaker_record(t, ep, failed, bw, now)
  if ep == nil or ep == '' or (not failed and bw <= 0) then return '' end
  local k = bkey(t, ep)
  local tk = tkey(t)
  local b = redis.call('HMGET', k, 's', 'ws', 'n', 'x')
  local s = b[1]
  if s == 'half' then
    if failed then
      redis.call('HSET', k, 's', 'open', 'u', now + BR_OPEN)
      return 'open'
    end
    redis.call('DEL', k)
    redis.call('HINCRBY', tk, 'bw', -1)
    unblock(t)
    return 'closed'
  end
  if s == 'open' then return '' end -- a result from before it opened
  local ws, n, x = tonumber(b[2]) or now, tonumber(b[3]) or 0, tonumber(b[4]) or 0
  if not s then
    if not failed then return '' end
    redis.call('HINCRBY', tk, 'bw', 1)
  end
  if now - ws > BR_WINDOW then
    if not failed then
      redis.call('DEL', k)
      redis.call('HINCRBY', tk, 'bw', -1)
      return ''
    end
    ws, n, x = now, 0, 0
  end
  n = n + 1
  if failed then x = x + 1 end
  if n >= BR_MIN and x / n >= BR_RATIO then
    redis.call('HSET', k, 's', 'open', 'u', now + BR_OPEN, 'ws', ws, 'n', n, 'x', x)
    return 'open'
  end
  redis.call('HSET', k, 's', 'closed', 'ws', ws, 'n', n, 'x', x)
  return ''
end

-- Tenants whose block has run out go back on the ring.
local function unblock_due(now, limit)
  for _, t in ipairs(redis.call('ZRANGEBYSCORE', BLOCKED, '-inf', now, 'LIMIT', 0, limit)) do
    unblock(t)
  end
end

-- Settle the worker-seconds actually used against the estimate charged at
-- lease, in one read and one write of the tenant's state. With `free_slot`
-- the in-flight slot is released (a tenant parked at its cap then rejoins
-- the ring if it has work). `outcome` counts the envelope: 'delivered',
-- 'dead' (both leave the depth), 'retry' (waits in the delayed set) or nil.
local function settle(t, charged, actual, now, free_slot, outcome)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'e', 'f', 'k', 'd', 'n', 'ok', 'ko', 'w', 'bw')
  local e, f = tonumber(st[1]) or EST0, tonumber(st[2]) or 0
  if free_slot then f = math.max(f - 1, 0) end
  local n, ok, ko, w = tonumber(st[5]) or 0, tonumber(st[6]) or 0, tonumber(st[7]) or 0, tonumber(st[8]) or 0
  if outcome == 'delivered' then n, ok = n - 1, ok + 1
  elseif outcome == 'dead' then n, ko = n - 1, ko + 1
  elseif outcome == 'retry' then w = w + 1 end
  redis.call('HSET', tk, 'e', e + 0.3 * (actual - e), 'f', f, 'd', (tonumber(st[4]) or 0) + charged - actual,
    'n', math.max(n, 0), 'ok', ok, 'ko', ko, 'w', w)
  local bucket = P .. ':ws:' .. math.floor(now / 10000)
  local total = tonumber(redis.call('HINCRBYFLOAT', bucket, t, actual))
  -- the first write to a bucket is always a tenant's first in it: set the TTL then
  if math.abs(total - actual) < 1e-9 then redis.call('EXPIRE', bucket, 7200) end
  if free_slot and st[3] == '1' and f < CAP then
    redis.call('HSET', tk, 'k', 0)
    activate(t)
  end
  return tonumber(st[9]) or 0
end

-- Record the dead letter; the caller has counted it (settle 'dead').
local function dead_letter(id, t, attempts, cause, now, payload)
  redis.call('RPUSH', P .. ':dead', cjson.encode({
    id = id, tenant = t, attempts = attempts, cause = cause, at = now, envelope = payload or '' }))
  redis.call('DEL', ekey(id))
end

-- Return envelopes to the head of their tenants' lanes in original (seq) order.
-- `items` is a list of {tenant, seq, id}.
local function return_to_head(items)
  table.sort(items, function(a, b) return a[2] > b[2] end)
  local touched = {}
  for _, it in ipairs(items) do
    redis.call('LPUSH', lane(it[1]), it[3])
    touched[it[1]] = true
  end
  for t, _ in pairs(touched) do activate(t) end
end

-- Move due retries back to the head of their lanes.
local function promote_due(now, limit)
  local ids = redis.call('ZRANGEBYSCORE', DELAYED, '-inf', now, 'LIMIT', 0, limit)
  local items = {}
  for _, id in ipairs(ids) do
    redis.call('ZREM', DELAYED, id)
    local m = redis.call('HMGET', ekey(id), 't', 's', 'x')
    if m[1] then
      redis.call('HINCRBY', tkey(m[1]), 'w', -1)
      items[#items + 1] = { m[1], tonumber(m[2]), id }
      if m[3] == '1' then
        redis.call('HDEL', ekey(id), 'x')
        release(m[1])
      end
    end
  end
  return_to_head(items)
  return #ids
end

-- Return expired leases to the head of their lanes; a worker that died loses nothing.
local function reap(now, limit)
  local ids = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, limit)
  local items = {}
  for _, id in ipairs(ids) do
    redis.call('ZREM', LEASES, id)
    local ek = ekey(id)
    local m = redis.call('HMGET', ek, 't', 's', 'c', 'at', 'p', 'ep')
    if m[1] then
      local t = m[1]
      local a = redis.call('HINCRBY', ek, 'a', 1)
      local dead = a >= MAX_ATTEMPTS
      local bw = settle(t, tonumber(m[3]) or 0, (now - (tonumber(m[4]) or now)) / 1000, now, true, dead and 'dead' or nil)
      breaker_record(t, m[6], true, bw, now)
      redis.call('HDEL', ek, 'l', 'c', 'at')
      if dead then
        dead_letter(id, t, a, 'lease expired ' .. a .. ' times without an ack (worker died or hung)', now, m[5])
      else
        items[#items + 1] = { t, tonumber(m[2]), id }
      end
    end
  end
  return_to_head(items)
  return #ids
end
