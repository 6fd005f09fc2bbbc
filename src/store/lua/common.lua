-- Shared prelude of every per-queue script. KEYS[1] is the queue prefix,
-- `lk:{<namespace>/<set>/<queue>}`: every key below starts with it, so all
-- keys of a queue share one hash tag and each script touches one slot.
--
--   P:conf            HASH  policy: "key=value" pairs (quantum, cap, ordered, weight, est0,
--                           maxatt, idttl; bratio, bmin, bwin ms, bopen ms: the circuit breaker),
--                           also written one field each for library versions before this one;
--                           clock (virtual ms, simulator only); minroute (oldest routing-table
--                           version a producer may enqueue with: a reshard's fence, see
--                           enqueue.lua); mnext (next time a lease does maintenance)
--   P:weights         HASH  tenant -> weight
--   P:ring            LIST  active tenants in DRR order (the head is served); a tenant that
--                           just became active goes to the head for one turn (see activate_fresh)
--   P:t:<tenant>      HASH  d deficit, f in flight, r on the ring, k parked at cap,
--                           e estimate, b what the fresh turn may still charge, p paused, m moved-to queue,
--                           w delayed, h held, n depth (queued, held, delayed or in flight),
--                           ok delivered, ko dead-lettered, bw breakers in use, bl blocked.
--                           d, e and b are worker-time in whole microseconds, as are a lease's
--                           charge and the worker-second buckets: integers are far cheaper for
--                           Redis and Lua to format and parse than 17-digit fractions
--   P:tenants         SET   every tenant that has had work here (for attribution)
--   P:q:<tenant>      LIST  the tenant's lane: envelope ids, head first
--   P:h:<tenant>      LIST  hold buffer while paused
--   P:e:<id>          HASH  t tenant, s seq, a attempts (absent: 0), p payload, n enqueued ms,
--                           ep endpoint, x holds slot
--   P:ids:<period>    SET   envelope ids first seen in that idttl-long period: an id is a
--                           duplicate while it is in this period's set or the previous one
--                           (so it is remembered for at least idttl seconds, at most twice that)
--   P:seq             STRING enqueue sequence
--   P:leases          ZSET  lease -> deadline ms. A lease is the string
--                           "<charged us>\n<leased ms>\n<id>\n<tenant>\n<worker token>" (no part
--                           holds a control character); it is also the token the worker holds,
--                           so ack, nack and release prove the lease with one ZREM
--   P:delayed         ZSET  id -> retry due ms
--   P:dead            LIST  dead letters (JSON)
--   P:wsu:<bucket>    HASH  tenant -> worker-microseconds (integer) in a 10 s bucket (expires);
--                           library versions before it kept seconds in P:ws:<bucket> with
--                           HINCRBYFLOAT: a new name, so the two never meet in one field
--   P:br:<len>:<tenant>:<endpoint>
--                     HASH  circuit breaker: s closed|open|half, u until ms, ws window start,
--                           n requests, x failures (absent while closed and healthy)
--   P:blocked         ZSET  tenant -> ms: tenants whose head envelope's breaker is open
--   P:wake            CHANNEL published when a tenant becomes active (wakes idle workers);
--                           on Redis Cluster the library is loaded with SPUBLISH here
--                           (sharded pub/sub, see `store::build_library`)
--   P:~slotguard      never written: every call declares it as its second key, so a
--                           call meets TRYAGAIN while the queue's slot is migrating
--                           instead of running on half-moved keys (see `store`)
--
-- This file, deliver.lua and every script body make one Redis Functions
-- library (see `store::library`). Closures are created once, when the
-- library loads; each call only binds the queue below (`begin`).

-- The queue this call works on, and its policy: bound by `begin`.
local P, RING, LEASES, DELAYED, BLOCKED
local QUANTUM, ORDERED, CAP, DEFAULT_WEIGHT, EST0, MAX_ATTEMPTS, ID_TTL, MAINT_NEXT
local BR_RATIO, BR_MIN, BR_WINDOW, BR_OPEN
-- A virtual clock (ms), set only by the capacity simulator (`lanekeeper
-- simulate`, through Store::set_virtual_clock); nil means Redis TIME.
local CLOCK
-- The oldest routing-table version a routed enqueue may carry (0: any),
-- as stored: only enqueue reads it.
local MIN_ROUTE_RAW

-- A small whole number (a count or a flag) as a string argument, made once
-- and kept. Redis formats every number argument of a call with "%.17g",
-- which costs more than many commands; any other number goes as it is
-- (formatting it in Lua costs as much).
local SMALL_INT = {}
local function istr(n)
  local s = SMALL_INT[n]
  if s then return s end
  if n < 0 or n > 4096 or n % 1 ~= 0 then return n end
  s = tostring(n)
  SMALL_INT[n] = s
  return s
end

-- A stored number, or `default` when absent. Absent and '0' (most counters
-- and flags) skip `tonumber`, which runs strtod twice.
local function num(s, default)
  if s == nil or s == false then return default end
  if s == '0' then return 0 end
  return tonumber(s) or default
end

-- The names of each queue's fixed keys, made once per queue (a few
-- hundred at most) instead of on every call.
local QUEUE_KEYS = {}

-- A queue's policy is one field of its conf hash, `policy`, written by
-- `Store::configure_queue` as space-separated key=value pairs (quantum, cap,
-- ordered, weight, est0, maxatt, idttl, bratio, bmin, bwin, bopen; an absent
-- one takes its default). Each distinct string is parsed once and kept here:
-- reading one field and looking it up costs a call a fraction of reading
-- eleven fields and converting each to a number.
local POLICIES, POLICY_COUNT = {}, 0
local function parse_policy(raw)
  local v = {}
  for k, x in string.gmatch(raw, '(%w+)=(%S+)') do v[k] = x end
  local field = function(k, default) return tonumber(v[k]) or default end
  local ordered = v.ordered == '1'
  return {
    -- seconds in the policy, whole microseconds in the scripts
    quantum = math.floor(field('quantum', 2.0) * 1e6 + 0.5), ordered = ordered, cap = ordered and 1 or field('cap', 8),
    weight = field('weight', 1.0), est0 = math.floor(field('est0', 1.0) * 1e6 + 0.5), maxatt = field('maxatt', 10),
    idttl = field('idttl', 86400), bratio = field('bratio', 0.5), bmin = field('bmin', 20),
    bwin = field('bwin', 60000), bopen = field('bopen', 30000),
  }
end

-- The first step of every per-queue function: KEYS[1] is the queue prefix.
local function begin(keys)
  P = keys[1]
  local qk = QUEUE_KEYS[P]
  if not qk then
    qk = { P .. ':ring', P .. ':leases', P .. ':delayed', P .. ':blocked', P .. ':conf' }
    QUEUE_KEYS[P] = qk
  end
  RING, LEASES, DELAYED, BLOCKED = qk[1], qk[2], qk[3], qk[4]
  local conf = redis.call('HMGET', qk[5], 'policy', 'mnext', 'clock', 'minroute')
  local raw = conf[1] or ''
  local pol = POLICIES[raw]
  if not pol then
    -- a handful of distinct policies at a time; start over rather than grow
    if POLICY_COUNT >= 256 then POLICIES, POLICY_COUNT = {}, 0 end
    pol = parse_policy(raw)
    POLICIES[raw], POLICY_COUNT = pol, POLICY_COUNT + 1
  end
  QUANTUM, ORDERED, CAP, DEFAULT_WEIGHT, EST0 = pol.quantum, pol.ordered, pol.cap, pol.weight, pol.est0
  MAX_ATTEMPTS, ID_TTL = pol.maxatt, pol.idttl
  BR_RATIO, BR_MIN, BR_WINDOW, BR_OPEN = pol.bratio, pol.bmin, pol.bwin, pol.bopen
  MAINT_NEXT = num(conf[2], 0)
  CLOCK = conf[3] and tonumber(conf[3])
  MIN_ROUTE_RAW = conf[4]
end

local function now_ms()
  if CLOCK then return CLOCK end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A lease as stored in P:leases and handed to the worker (see the key layout).
local function lease_member(charged, at, id, t, token)
  return charged .. '\n' .. at .. '\n' .. id .. '\n' .. t .. '\n' .. token
end

-- The parts of a lease: charged (us), at (ms, as stored), id, tenant; nil
-- if it is not one.
local function parse_lease(member)
  local c, at, id, t = string.match(member, '^([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n')
  if not c then return nil end
  return num(c, 0), at, id, t
end

-- Take the lease `member` of envelope `id` out of P:leases. Returns its
-- charge and tenant, or nil when it is not (or no longer) held: acked
-- already, or expired and handed to someone else.
local function end_lease(id, member)
  local c, _, lid, t = parse_lease(member)
  if not c or lid ~= id or redis.call('ZREM', LEASES, member) == 0 then return nil end
  return c, t
end

local function tkey(t) return P .. ':t:' .. t end
local function lane(t) return P .. ':q:' .. t end
local function hold(t) return P .. ':h:' .. t end
local function ekey(id) return P .. ':e:' .. id end

-- Idempotency: which of `ids` are new to this queue? Returns a table with
-- `true` for each id seen neither in this idttl-long period nor the one
-- before (so an id is remembered for at least idttl seconds, at most twice
-- that), and claims them. A batch costs three set commands, however long.
-- The current period's set expires after three windows as a safety net;
-- the set from two periods back is no longer read and is freed in the
-- background (UNLINK) rather than by a blocking expiry of a large set.
local function claim_ids(ids, now)
  local fresh = {}
  if #ids == 0 then return fresh end
  local period = math.floor(now / 1000 / ID_TTL)
  local cur, prev = P .. ':ids:' .. period, P .. ':ids:' .. (period - 1)
  local in_prev = redis.call('SMISMEMBER', prev, unpack(ids))
  local in_cur = redis.call('SMISMEMBER', cur, unpack(ids))
  local claim = {}
  for k, id in ipairs(ids) do
    if in_prev[k] == 0 and in_cur[k] == 0 and not fresh[id] then
      fresh[id] = true
      claim[#claim + 1] = id
    end
  end
  if #claim > 0 then
    redis.call('SADD', cur, unpack(claim))
    redis.call('EXPIRE', cur, 3 * ID_TTL, 'NX')
    redis.call('UNLINK', P .. ':ids:' .. (period - 2))
  end
  return fresh
end

local function weight(t)
  return tonumber(redis.call('HGET', P .. ':weights', t)) or DEFAULT_WEIGHT
end

-- The tenant's quantum (us): the queue's, scaled by its weight.
local function quantum(t)
  return math.floor(QUANTUM * weight(t) + 0.5)
end

-- Put a tenant on the ring, at the head (a fresh turn) or the tail. Every
-- activation publishes: each wake-up rouses one idle worker task (workers
-- call notify_one per message), so one per tenant made active brings as
-- many idle tasks as there is new work.
local function push_active(t, front)
  redis.call(front and 'LPUSH' or 'RPUSH', RING, t)
  redis.call('PUBLISH', P .. ':wake', t)
end

-- Put a tenant with queued work at the tail of the ring, unless it is on
-- the ring already, parked at its cap, or blocked.
local function activate(t)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'bl')
  if st[1] == '1' or st[2] == '1' or st[3] == '1' then return end
  if redis.call('LLEN', lane(t)) == 0 then return end
  push_active(t, false)
  redis.call('HSET', tk, 'r', 1)
end

-- A tenant that was idle and has new work: it earns its quantum now and, if
-- that leaves it in credit (no unpaid debt), goes to the head of the ring
-- for one turn (at most one quantum), ahead of the backlogged tenants, like
-- a sparse flow in FQ-CoDel. This is what lets a password reset overtake a
-- whale's turn; the interrupted turn resumes after it.
local function activate_fresh(t)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'd', 'bl')
  if st[1] == '1' or st[2] == '1' or st[4] == '1' then return end
  local q = quantum(t)
  local d = num(st[3], 0) + q
  -- b: what the fresh turn may still charge; refunds at ack do not extend it
  redis.call('HSET', tk, 'r', 1, 'd', d, 'b', q)
  push_active(t, d > 0)
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

-- The counter each outcome adds one to.
local OUTCOME_COUNTER = { delivered = 'ok', dead = 'ko', retry = 'w' }

-- Settle the worker-time actually used (us) against the estimate charged at
-- lease, in one read and one write of the tenant's state. With `free_slot`
-- the in-flight slot is released (a tenant parked at its cap then rejoins
-- the ring if it has work). `outcome` counts the envelope: 'delivered',
-- 'dead' (both leave the depth), 'retry' (waits in the delayed set) or nil.
local function settle(t, charged, actual, now, free_slot, outcome)
  local tk = tkey(t)
  local counter = OUTCOME_COUNTER[outcome]
  local st = redis.call('HMGET', tk, 'e', 'f', 'k', 'd', 'n', 'bw', 'bl', counter or 'e')
  local e, f = num(st[1], EST0), num(st[2], 0)
  -- only the fields that change are written
  local set = { 'e', math.floor(e + 0.3 * (actual - e) + 0.5), 'd', num(st[4], 0) + charged - actual }
  local n = #set
  if free_slot then
    f = math.max(f - 1, 0)
    set[n + 1] = 'f'; set[n + 2] = istr(f); n = n + 2
  end
  if counter then
    set[n + 1] = counter; set[n + 2] = num(st[8], 0) + 1; n = n + 2
    -- delivered and dead-lettered envelopes leave the depth
    if counter ~= 'w' then set[n + 1] = 'n'; set[n + 2] = math.max(num(st[5], 0) - 1, 0); n = n + 2 end
  end
  -- a tenant parked at its cap rejoins the ring's tail (unless a breaker
  -- blocks it) in this same write. It was parked with work queued; should
  -- its lane be empty now, its next turn finds that and takes it off.
  local rejoin = false
  if free_slot and st[3] == '1' and f < CAP then
    set[n + 1] = 'k'; set[n + 2] = '0'; n = n + 2
    if st[7] ~= '1' then
      set[n + 1] = 'r'; set[n + 2] = '1'; n = n + 2
      rejoin = true
    end
  end
  redis.call('HSET', tk, unpack(set))
  if rejoin then push_active(t, false) end
  local us = math.floor(actual + 0.5)
  if us > 0 then
    local bucket = P .. ':wsu:' .. math.floor(now / 10000)
    -- the first write to a bucket is always a tenant's first in it: set the TTL then
    if redis.call('HINCRBY', bucket, t, us) == us then redis.call('EXPIRE', bucket, 7200) end
  end
  return num(st[6], 0)
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
  local leases = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, limit)
  local items = {}
  for _, member in ipairs(leases) do
    redis.call('ZREM', LEASES, member)
    local c, at, id, t = parse_lease(member)
    local ek = id and ekey(id)
    local m = ek and redis.call('HMGET', ek, 's', 'p', 'ep')
    if m and m[2] then
      local a = redis.call('HINCRBY', ek, 'a', 1)
      local dead = a >= MAX_ATTEMPTS
      local bw = settle(t, c, (now - num(at, now)) * 1000, now, true, dead and 'dead' or nil)
      breaker_record(t, m[3], true, bw, now)
      if dead then
        dead_letter(id, t, a, 'lease expired ' .. a .. ' times without an ack (worker died or hung)', now, m[2])
      else
        items[#items + 1] = { t, tonumber(m[1]), id }
      end
    end
  end
  return_to_head(items)
  return #leases
end
