-- Shared prelude of every per-queue script. KEYS[1] is the queue prefix,
-- `lk:{<namespace>/<set>/<queue>}`: every key below starts with it, so all
-- keys of a queue share one hash tag and each script touches one slot.
--
--   P:conf            HASH  policy: "key=value" pairs (quantum, cap, ordered, weight, est0,
--                           maxatt, idttl; bratio, bmin, bwin ms, bopen ms: the circuit breaker),
--                           also written one field each for library versions before this one;
--                           rl, rl.<tier>, rln: delivery rate limits (see parse_policy);
--                           iso=ep, capep: endpoint isolation and its endpoint cap;
--                           clock (virtual ms, simulator only); swc/swn the sweep's SSCAN cursor
--                           and when its next pass may start (see sweep.lua); minroute (oldest routing-table
--                           version a producer may enqueue with: a reshard's fence, see
--                           enqueue.lua); mnext (next time a lease does maintenance)
--   P:weights         HASH  tenant -> weight
--   P:caps            HASH  tenant -> its own in-flight cap (a ShardSet's spec.tenants[].maxInFlight),
--                           read only when the policy says capn=1; ignored under strict order
--   P:limits          HASH  tenant -> "<rate> <burst> <erate> <eburst>": a tenant's own delivery
--                           rate limit (per second; a rate of 0 is unlimited), read only when the
--                           policy says rln=1
--   P:ring            LIST  active tenants in DRR order (the head is served); a tenant that
--                           just became active goes to the head for one turn (see activate_fresh)
--   P:t:<tenant>      HASH  d deficit, f in flight, r on the ring, k parked at cap,
--                           e estimate, b what the fresh turn may still charge, p paused, m moved-to queue,
--                           w delayed, h held, n depth (queued, held, delayed or in flight),
--                           ok delivered, ko dead-lettered, dx dead letters dropped by retention,
--                           bw breakers in use, bl blocked, ip newest idempotency period claimed in, ia the one before,
--                           xc its claims are being copied to another queue (a move; see claims.lua),
--                           isrc/isq the queue and last sequence number imported from during a move,
--                           pz the latest paced-until ms of any of its endpoints (0/absent: none,
--                           see P:pace:<tenant>),
--                           tr tier name (absent: none; written by enqueue from what ingest resolved
--                           in the set's lk:{ns/set}:tiers:api and lk:{ns/set}:tiers hashes),
--                           tk/tu its delivery token bucket (micro-tokens as of ms tu; absent: full),
--                           ee/ek the slot: one endpoint ee whose delivery token bucket ek
--                           ('<micro-tokens>:<ms>'; absent: full) lives here rather than in
--                           P:rl:... (see endpoint_gate),
--                           up paused by a user ('1': leases skip it, see user_pause.lua; distinct from
--                           p, the relocation pause, and composed with it), upv the version of the
--                           user operation that last set up (from lk:{ns/set}:pausev),
--                           la the last time it had activity here (ms: an enqueue, an import, or
--                           a sweep that found it busy; see sweep.lua);
--                           under endpoint isolation, per endpoint: ef:<ep> in flight, es:<ep>
--                           its state ('r' ready, 'k' parked at its cap, 'b' blocked), ev:<ep>
--                           its virtual time while not ready; evc the tenant's virtual clock.
--                           d, e and b are worker-time in whole microseconds, as are a lease's
--                           charge and the worker-second buckets: integers are far cheaper for
--                           Redis and Lua to format and parse than 17-digit fractions
--   P:tenants         SET   every tenant that has had work here (for attribution)
--   P:paused          SET   tenants paused by a user here (up = '1'), for listing
--   P:q:<tenant>      LIST  the tenant's lane, head first (tenant isolation): its queued envelopes,
--                           each stored whole in the lane as enqueue wrote it,
--                           "\1<id>\n<endpoint>\n<seq>\n<enqueued ms>\n<payload>" (no record of its
--                           own), or a bare id whose record P:e:<ref> holds it (a retry, a replay, a
--                           move's import, an envelope of a library version before this one). No id
--                           starts with "\1" (ids hold no control character), so the two never meet.
--                           Hold buffers and endpoint lanes hold the same two kinds (see lane_item)
--   P:qe:<len>:<tenant>:<endpoint>
--                     LIST  under endpoint isolation, the lane of one of the tenant's endpoints
--   P:ez:<tenant>     ZSET  under endpoint isolation, the tenant's ready endpoints -> virtual time
--                           (worker-us charged); the least is served next
--   P:eps:<tenant>    SET   under endpoint isolation, the tenant's endpoints whose lane holds work
--   P:isq:<tenant>    HASH  under endpoint isolation, a move's import marks: s the source queue,
--                           e:<endpoint> the last source seq imported to it (see import.lua)
--   P:h:<tenant>      LIST  hold buffer while paused (items as in the lane)
--   P:e:<ref>         HASH  t tenant, s seq, a attempts (absent: 0), p payload, n enqueued ms,
--                           ep endpoint, x holds slot. <ref> is "<#tenant>:<tenant>:<id>": an
--                           envelope is named by its tenant and its id together, so two tenants'
--                           ids never meet (library versions before this one used P:e:<id>;
--                           such a record is adopted under its new name when first met)
--   P:ids:<period>:<tenant>
--                     SET   the tenant's envelope ids first seen in that idttl-long period: an id
--                           is a duplicate while it is in this period's set or the previous one
--                           (so it is remembered for at least idttl seconds, at most twice that).
--                           Per tenant, so a move can copy a tenant's claims (claims.lua)
--   P:idsx:<tenant>   SET   ids claimed while the tenant's claims are being copied (xc set)
--   P:seq             STRING enqueue sequence
--   P:leased          HASH  lease (as in P:leases) -> the lane item of an envelope leased while
--                           stored whole: its body while it is in flight. Named by the lease, which
--                           every call that ends one holds already. An ack deletes the field; a lease that
--                           ends any other way (nack, release, expiry) writes the envelope's
--                           record from it first (leased_record) and goes on as with any record
--   P:leases          ZSET  lease -> deadline ms. A lease is the string
--                           "<charged us>\n<leased ms>\n<id>\n<tenant>\n<worker token>" (no part
--                           holds a control character; under endpoint isolation "\n<endpoint>"
--                           follows, the lane it was leased from); it is also the token the worker holds,
--                           so ack, nack and release prove the lease with one ZREM
--   P:delayed         ZSET  "<x><ref>" -> retry due ms, x '1' when the retry keeps its tenant's
--                           only slot (PerTenant ordering), '0' otherwise: the member names the
--                           tenant, so a retry whose record is gone still settles its tenant;
--                           under endpoint isolation "<X><len>:<endpoint><ref>", X 'E' for '1'
--                           and 'e' for '0', so it settles and returns to its endpoint too
--   P:dl:<tenant>     STREAM the tenant's dead letters, oldest first: id, a attempts, c cause,
--                           at ms, p payload, ep endpoint. Bounded by the policy's dlmax (count)
--                           and dlage (seconds), see dl_retain; what retention drops is counted
--                           in the tenant's dx and the queue's P:dlx
--   P:dlx             STRING dead letters dropped by retention, all tenants
--   P:dlq             ZSET  tenant -> ms of its oldest dead letter (maintenance ages them out)
--   P:dead            LIST  dead letters of library versions before per-tenant streams (read only)
--   P:wsu:<bucket>    HASH  tenant -> worker-microseconds (integer) in a 10 s bucket (expires);
--                           library versions before it kept seconds in P:ws:<bucket> with
--                           HINCRBYFLOAT: a new name, so the two never meet in one field
--   P:br:<len>:<tenant>:<endpoint>
--                     HASH  circuit breaker: s closed|open|half, u until ms, ws window start,
--                           n requests, x failures (absent while closed and healthy)
--   P:blocked         ZSET  tenant -> ms: tenants whose head envelope's breaker is open, or
--                           (PerTenant ordering) whose head envelope's endpoint is paced
--   P:pace:<tenant>   HASH  endpoint -> paced-until ms: the receiver answered 429 or 503 with
--                           Retry-After (bounded by the policy's pmax). Read by a lease only
--                           while now < the tenant's pz; an entry found expired is deleted,
--                           the whole hash once now >= pz (it also expires in Redis just after
--                           pz, except under the simulator's virtual clock)
--   P:rl:<len>:<tenant>:<endpoint>
--                     STRING "<micro-tokens>:<ms>": the endpoint's delivery token bucket, while
--                           the endpoint is not in its tenant's slot (ee) (absent: full;
--                           expires once it would be full again)
--   P:blocked         ZSET  tenant -> ms: tenants off the ring until then: their head envelope's
--                           breaker is open, or they (or that envelope's endpoint) are out of tokens;
--                           under endpoint isolation also "<tenant>\n<endpoint>" -> ms: that
--                           endpoint is out of its tenant's ready set until then (breaker, pace
--                           or its tokens)
--   P:wake            CHANNEL published when a tenant becomes active (wakes idle workers);
--                           on Redis Cluster the library is loaded with SPUBLISH here
--                           (sharded pub/sub, see `store::library::build_library`)
--   P:~slotguard      never written: every call declares it as its second key, so a
--                           call meets TRYAGAIN while the queue's slot is migrating
--                           instead of running on half-moved keys (see `store`)
--
-- This file, deliver.lua and every script body make one Redis Functions
-- library (see `store::library`). Closures are created once, when the
-- library loads; each call only binds the queue below (`begin`, which the
-- library runs before every per-queue script).
--
-- Which helpers of this file (and of deliver.lua) a script calls is kept in
-- the script's header, its first lines: `-- Helpers (common.lua): ...` and
-- `-- Helpers (deliver.lua): ...`. A unit test in `store::library` checks
-- every header against the calls in its script, so keep them true.

-- Width of a worker-seconds bucket in ms: policy::attribution::BUCKET_SECONDS
-- x 1000 (a store unit test checks the two agree).
local BUCKET_MS = 10000

-- The queue this call works on, and its policy: bound by `begin`.
local P, RING, LEASES, DELAYED, BLOCKED, LEASED
local QUANTUM, ORDERED, CAP, DEFAULT_WEIGHT, EST0, MAX_ATTEMPTS, ID_TTL, MAINT_NEXT, TIER_WEIGHTS
local BR_RATIO, BR_MIN, BR_WINDOW, BR_OPEN, DL_MAX, DL_AGE_MS
-- The longest pause (ms) a receiver's Retry-After may put on its endpoint.
local PACE_MAX
-- Idle time (ms) after which a tenant's state is swept (0: never; sweep.lua).
local SWEEP_MS
-- Delivery rate limits: the default (false: none), per tier, whether
-- P:limits has entries, and whether any of them is set at all.
local RL_DEFAULT, RL_TIERS, RL_TENANTS, RL_ANY
-- Whether P:caps holds tenants' own in-flight caps (policy capn=1).
local CAP_TENANTS
-- Endpoint isolation (policy iso=ep; see "Endpoint isolation" below) and
-- the endpoint cap it sets (capep; 0: half the tenant's cap, rounded up).
local ISO_EP, EP_CAP
-- A virtual clock (ms), set only by the capacity simulator (`lanekeeper
-- simulate`, through Store::set_virtual_clock); nil means Redis TIME.
local CLOCK
-- The oldest routing-table version a routed enqueue may carry (0: any),
-- as stored: only enqueue reads it.
local MIN_ROUTE_RAW
-- Worker-us per tenant that `settle` gathers instead of writing, while a
-- batched call runs (tenant -> us; nil otherwise: each settle writes its
-- own). Reset by `begin`, written by attribute_flush.
local ATTR

-- Times (ms) as strings, each formatted once per call: a batch puts the
-- same time into every lease it makes, and a number handed to redis.call
-- is formatted by Redis each time. Reset by `begin`.
local MS_TEXT = {}
-- Per call (begin empties it): the prefix of each tenant's record keys (see ekey).
local EKEY_PREFIX = {}

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

-- A number argument as its digits: a whole number goes as an integer's
-- digits, any other (a fraction, nan, inf, or past 2^53, where %d and
-- %.17g differ) as it is, for Redis to format. Worth it only for large
-- numbers: Redis formats a number argument with "%.17g", which costs some
-- 2,300 instructions for a deficit or a counter (string.format's '%d'
-- costs about as much) and well over 3,000 for a bucket level of 10^12
-- micro-tokens.
local EXACT = 2 ^ 53
local function int_text(x)
  if x % 1 == 0 and x < EXACT and x > -EXACT then return string.format('%d', x) end
  return x
end

-- A stored number, or `default` when absent or not a finite number (nan
-- or inf written behind the scripts' back must neither fail a later
-- command nor wedge a comparison). Absent and '0' (most counters and
-- flags) skip `tonumber`, which runs strtod twice.
-- (math is not reachable while the library loads; 1/0 is its huge)
local HUGE = 1 / 0
local function num(s, default)
  if s == nil or s == false then return default end
  if s == '0' then return 0 end
  local x = tonumber(s)
  if x == nil or x ~= x or x == HUGE or x == -HUGE then return default end
  return x
end

-- The names of each queue's fixed keys, made once per queue (a few
-- hundred at most) instead of on every call.
local QUEUE_KEYS = {}

-- A queue's policy is one field of its conf hash, `policy`, written by
-- `Store::configure_queue` as space-separated key=value pairs (quantum, cap,
-- ordered, weight, est0, maxatt, idttl, bratio, bmin, bwin, bopen, dlmax, dlage, pmax, sweep; an absent
-- one takes its default). Each distinct string is parsed once and kept here:
-- reading one field and looking it up costs a call a fraction of reading
-- eleven fields and converting each to a number.
local POLICIES, POLICY_COUNT = {}, 0

-- A delivery rate limit, "rate,burst,erate,eburst" in the policy or
-- "rate burst erate eburst" in P:limits (per second and tokens), in the
-- scripts' units: micro-tokens per ms and micro-tokens. false when neither
-- half limits anything (a rate of 0 is unlimited).
local function parse_limit(raw)
  local r, b, er, eb = string.match(raw, '^(%S-)[, ](%S-)[, ](%S-)[, ](%S+)$')
  r, b, er, eb = tonumber(r) or 0, tonumber(b) or 0, tonumber(er) or 0, tonumber(eb) or 0
  if not (r > 0) and not (er > 0) then return false end
  return { rate = math.max(r, 0) * 1000, cap = math.max(b, 1) * 1e6, erate = math.max(er, 0) * 1000,
    ecap = math.max(eb, 1) * 1e6 }
end

local function parse_policy(raw)
  local v = {}
  -- tier weights: 'tw.<tier>=<weight>' (tier names carry '.', '_' and '-')
  -- and rate limits per tier, 'rl.<tier>=...'
  local tw, rlt = {}, {}
  for k, x in string.gmatch(raw, '([%w%._%-]+)=(%S+)') do
    v[k] = x
    local tier = string.match(k, '^tw%.(.+)$')
    if tier then tw[tier] = tonumber(x) end
    tier = string.match(k, '^rl%.(.+)$')
    if tier then rlt[tier] = parse_limit(x) end
  end
  local field = function(k, default) return tonumber(v[k]) or default end
  local ordered = v.ordered == '1'
  return {
    -- seconds in the policy, whole microseconds in the scripts
    quantum = math.floor(field('quantum', 2.0) * 1e6 + 0.5), ordered = ordered,
    -- strict order's cap of 1 is the tenant's under tenant isolation, each endpoint's under endpoint isolation
    cap = (ordered and v.iso ~= 'ep') and 1 or field('cap', 8),
    weight = field('weight', 1.0), est0 = math.floor(field('est0', 1.0) * 1e6 + 0.5), maxatt = field('maxatt', 10),
    idttl = math.max(field('idttl', 86400), 1), bratio = field('bratio', 0.5), bmin = field('bmin', 20),
    bwin = field('bwin', 60000), bopen = field('bopen', 30000),
    -- dead-letter retention per tenant: a count (at least 1) and an age in seconds
    dlmax = math.max(math.floor(field('dlmax', 100000)), 1), dlage = math.max(field('dlage', 604800), 1) * 1000,
    -- the longest receiver-asked pause, ms (delivery.maxRetryAfter; default 10 minutes)
    pmax = math.max(math.floor(field('pmax', 600000)), 1),
    -- idle tenants' state is swept after this many seconds (0: never)
    sweep = math.max(math.floor(field('sweep', 0) * 1000), 0),
    tw = tw,
    rl = v.rl and parse_limit(v.rl) or false, rlt = rlt, rln = v.rln == '1',
    rlany = (v.rl ~= nil) or (next(rlt) ~= nil) or v.rln == '1',
    capn = v.capn == '1',
    -- endpoint isolation (iso=ep) and its endpoint cap (capep; 0: half the tenant's cap)
    iso = v.iso == 'ep', capep = math.max(math.floor(field('capep', 0)), 0),
  }
end

-- The first step of every per-queue function: KEYS[1] is the queue prefix.
local function begin(keys)
  P = keys[1]
  local qk = QUEUE_KEYS[P]
  if not qk then
    qk = { P .. ':ring', P .. ':leases', P .. ':delayed', P .. ':blocked', P .. ':conf', P .. ':leased' }
    QUEUE_KEYS[P] = qk
  end
  RING, LEASES, DELAYED, BLOCKED, LEASED = qk[1], qk[2], qk[3], qk[4], qk[6]
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
  TIER_WEIGHTS = pol.tw
  MAX_ATTEMPTS, ID_TTL = pol.maxatt, pol.idttl
  BR_RATIO, BR_MIN, BR_WINDOW, BR_OPEN = pol.bratio, pol.bmin, pol.bwin, pol.bopen
  DL_MAX, DL_AGE_MS = pol.dlmax, pol.dlage
  PACE_MAX = pol.pmax
  SWEEP_MS = pol.sweep
  RL_DEFAULT, RL_TIERS, RL_TENANTS, RL_ANY = pol.rl, pol.rlt, pol.rln, pol.rlany
  CAP_TENANTS = pol.capn
  ISO_EP, EP_CAP = pol.iso, pol.capep
  MAINT_NEXT = num(conf[2], 0)
  CLOCK = conf[3] and tonumber(conf[3])
  MIN_ROUTE_RAW = conf[4]
  ATTR = nil
  MS_TEXT = {}
  EKEY_PREFIX = {}
end

-- A time (ms) as a string, formatted once per call (see MS_TEXT).
local function ms_text(n)
  local s = MS_TEXT[n]
  if not s then
    -- a whole number as an integer: no floating-point formatting
    s = string.format(n % 1 == 0 and '%d' or '%.17g', n)
    MS_TEXT[n] = s
  end
  return s
end

-- A number argument of a call (an elapsed time, a lease or delay length,
-- a scan budget): a finite number from 0 up, else nil. Lua's tonumber
-- takes 'nan' and 'inf'; a script checks its numbers with this before its
-- first write, so a malformed call changes nothing.
local function count_arg(s)
  local x = tonumber(s)
  if x == nil or x ~= x or x < 0 or x == HUGE then return nil end
  return x
end

-- The lease length and token of a call that leases: the length a count_arg
-- of at most 2^40 ms (34 years: a deadline past what a score and the reply's
-- integer hold exactly would wrap, and the lease be reaped at once and its
-- envelope handed to a second worker), the token without a newline (the
-- lease's parts are separated by newlines: one in the token would be read as
-- the endpoint under endpoint isolation, and free another endpoint's slot).
-- Each nil when not so; a script checks them before its first write.
local MAX_LEASE_MS = 2 ^ 40
local function lease_args(ms, token)
  local x = count_arg(ms)
  if x and x > MAX_LEASE_MS then x = nil end
  if string.find(token, '\n', 1, true) then token = nil end
  return x, token
end

local function now_ms()
  if CLOCK then return CLOCK end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A lease as stored in P:leases and handed to the worker (see the key
-- layout). Under endpoint isolation the endpoint it was leased from follows
-- the token, so whatever becomes of the record, its slot is freed.
local function lease_member(charged, at, id, t, token, ep)
  local m = charged .. '\n' .. at .. '\n' .. id .. '\n' .. t .. '\n' .. token
  if ep then return m .. '\n' .. ep end
  return m
end

-- Where the first four newlines of lease `member` are (nil if it is not
-- one), and under endpoint isolation its endpoint (nil in a lease without
-- one). Plain finds, not a pattern: Lua's matcher steps a character class
-- through every byte, and a batch parses 64 leases.
local function lease_split(member)
  local a = string.find(member, '\n', 1, true)
  local b = a and string.find(member, '\n', a + 1, true)
  local c = b and string.find(member, '\n', b + 1, true)
  local d = c and string.find(member, '\n', c + 1, true)
  if not d then return nil end
  local ep = nil
  if ISO_EP then
    local e = string.find(member, '\n', d + 1, true)
    if e then ep = string.sub(member, e + 1) end
  end
  return a, b, c, d, ep
end

-- The parts of a lease: charged (us), at (ms, as stored), id, tenant, and
-- under endpoint isolation its endpoint; nil if it is not one.
local function parse_lease(member)
  local a, b, c, d, ep = lease_split(member)
  if not a then return nil end
  return num(string.sub(member, 1, a - 1), 0), string.sub(member, a + 1, b - 1), string.sub(member, b + 1, c - 1),
    string.sub(member, c + 1, d - 1), ep
end

-- Take the lease `member` of envelope `id` out of P:leases. Returns its
-- charge, tenant and endpoint (endpoint isolation only), or nil when it is
-- not (or no longer) held: acked already, or expired and handed to someone else.
local function end_lease(id, member)
  local c, _, lid, t, ep = parse_lease(member)
  if not c or lid ~= id or redis.call('ZREM', LEASES, member) == 0 then return nil end
  return c, t, ep
end

-- The charge, tenant and (endpoint isolation only) endpoint of lease
-- `member`, what an ack needs of it: parse_lease without the two fields an
-- ack does not read (each string.sub makes a string Lua hashes whole).
local function lease_head(member)
  local a, _, c, d, ep = lease_split(member)
  if not a then return nil end
  return num(string.sub(member, 1, a - 1), 0), string.sub(member, c + 1, d - 1), ep
end

-- Take the leases `members` (at most 64) out of P:leases in two calls
-- whatever their number. A lease names its envelope: the member is all an
-- ack carries. Returns a table with, at each i whose lease was held, what
-- end_lease answers for one: {charge, tenant, endpoint}; a lease named
-- twice is held at most once.
local function end_leases(members)
  local valid, at, parts, seen = {}, {}, {}, {}
  for i = 1, #members do
    local m = members[i]
    local c, t, ep = lease_head(m)
    if c and not seen[m] then
      seen[m] = true
      valid[#valid + 1] = m
      at[#at + 1] = i
      parts[#parts + 1] = { c, t, ep }
    end
  end
  local held = {}
  if #valid == 0 then return held end
  local scores = redis.call('ZMSCORE', LEASES, unpack(valid))
  local gone = {}
  for j = 1, #valid do
    if scores[j] then
      held[at[j]] = parts[j]
      gone[#gone + 1] = valid[j]
    end
  end
  if #gone > 0 then redis.call('ZREM', LEASES, unpack(gone)) end
  return held
end

local function tkey(t) return P .. ':t:' .. t end
local function lane(t) return P .. ':q:' .. t end
local function hold(t) return P .. ':h:' .. t end
local function dlkey(t) return P .. ':dl:' .. t end
-- Endpoint isolation's keys (see "Endpoint isolation" below): the lane of
-- (t, ep), the tenant's ready endpoints, and its endpoints with a lane.
local function eplane(t, ep) return P .. ':qe:' .. istr(#t) .. ':' .. t .. ':' .. ep end
local function ezkey(t) return P .. ':ez:' .. t end
local function epskey(t) return P .. ':eps:' .. t end
-- Under endpoint isolation, what a move imported per endpoint (import.lua).
local function importkey(t) return P .. ':isq:' .. t end
-- Tenant `t`'s idempotency claims of period `period`, and the period of a
-- time `ms`: ids are remembered in idttl-long periods (see claim_ids).
local function claims_key(period, t) return P .. ':ids:' .. period .. ':' .. t end
local function id_period(ms) return math.floor(ms / 1000 / ID_TTL) end

-- Whether tenant `t` has work it may lease (what keeps it on the ring):
-- a queued envelope, or under endpoint isolation a ready endpoint.
local function has_ready(t)
  if ISO_EP then return redis.call('ZCARD', ezkey(t)) > 0 end
  return redis.call('LLEN', lane(t)) > 0
end

-- How many envelopes tenant `t` has queued (not held, delayed or in
-- flight). Under endpoint isolation, the lanes of at most 1000 of its
-- endpoints are counted, and each one past those as one envelope.
local function queued_of(t)
  if not ISO_EP then return redis.call('LLEN', lane(t)) end
  local n = 0
  local eps = redis.call('SRANDMEMBER', epskey(t), 1000)
  for _, ep in ipairs(eps) do
    n = n + redis.call('LLEN', eplane(t, ep))
  end
  if #eps == 1000 then n = n + redis.call('SCARD', epskey(t)) - 1000 end
  return n
end
-- An envelope is named by its tenant and its id together (see P:e:<ref>).
local function eref(t, id) return istr(#t) .. ':' .. t .. ':' .. id end
-- (Each tenant's prefix is made once per call: a batch names many of its
-- records. begin() empties EKEY_PREFIX, so it never outlives its P.)
local function ekey(t, id)
  local pfx = EKEY_PREFIX[t]
  if not pfx then
    pfx = P .. ':e:' .. istr(#t) .. ':' .. t .. ':'
    EKEY_PREFIX[t] = pfx
  end
  return pfx .. id
end
-- The tenant and id a ref names.
local function parse_ref(ref)
  local len, rest = string.match(ref, '^(%d+):(.*)$')
  len = tonumber(len)
  if not len or #rest < len + 1 then return nil end
  return string.sub(rest, 1, len), string.sub(rest, len + 2)
end

-- The record of (t, id), adopting one a library version before this one
-- stored as P:e:<id> (same tenant only) under its new name. Returns its key,
-- and whether it exists. Only a miss costs more than the caller's read.
local function adopt(t, id)
  local k = ekey(t, id)
  if redis.call('EXISTS', k) == 1 then return k, true end
  local old = P .. ':e:' .. id
  if redis.call('HGET', old, 't') == t then
    redis.call('RENAME', old, k)
    return k, true
  end
  return k, false
end

-- ---- envelopes stored whole in their lane (see P:q:<tenant>) -----------
-- Enqueue writes no record: the lane item is the envelope, and a lease
-- takes it whole with the LPOP that takes it off the lane. While it is in
-- flight its item waits in P:leased; only a lease that does not end in an
-- ack writes its record (leased_record), as does a lease path that sends
-- it to a state that keeps records (the delayed set).

-- The lane item of an envelope stored whole. `id` and `ep` hold no
-- control character; `seq` and `at` (enqueued ms) are strings of digits.
-- The id comes first: a lease reads only it (item_id), and hands the item
-- to the worker, which reads the rest (`store::keys::lane_item`).
local function lane_item(id, ep, seq, at, payload)
  return '\1' .. id .. '\n' .. ep .. '\n' .. seq .. '\n' .. at .. '\n' .. payload
end

-- Three-digit groups ('007'), each made once and kept; and the thousands
-- of the last seq seq_text wrote, with their digits.
local DIGITS3 = {}
local SEQ_HI, SEQ_HI_TEXT = -1, ''

-- Seq `seq` (a whole number from 0) as its digits. Lua's '..' formats a
-- number with printf's '%.14g', and string.format's '%d' is hardly
-- cheaper: some 2,000 instructions a number, as much as the rest of an
-- envelope's work in enqueue. A batch's seqs are consecutive and share
-- their thousands, so those are formatted once a thousand and the last
-- three digits come from DIGITS3.
local function seq_text(seq)
  local lo = seq % 1000
  local hi = (seq - lo) / 1000
  if hi < 1 or seq >= 1e14 then return string.format('%d', seq) end
  if hi ~= SEQ_HI then SEQ_HI, SEQ_HI_TEXT = hi, string.format('%d', hi) end
  local d = DIGITS3[lo]
  if not d then
    d = string.format('%03d', lo)
    DIGITS3[lo] = d
  end
  return SEQ_HI_TEXT .. d
end

-- The id of lane item `item` when it holds an envelope whole (else nil),
-- and with `ep` its endpoint. Only as far as those is it read: a lease
-- hands the item to the worker, whose reading of it
-- (`store::keys::lane_item`) takes one that does not parse as a payload
-- that does not decode, and dead-letters it so.
local function item_id(item, ep)
  if string.byte(item, 1) ~= 1 then return nil end
  local a = string.find(item, '\n', 2, true)
  if not a then return nil end
  if not ep then return string.sub(item, 2, a - 1) end
  local b = string.find(item, '\n', a + 1, true)
  if b then return string.sub(item, 2, a - 1), string.sub(item, a + 1, b - 1) end
end

-- The id of lane item `item`, then, for an envelope stored whole, its seq,
-- enqueued ms, endpoint and payload (strings); a bare id comes back alone.
-- A whole item that does not parse (written behind the scripts' back) comes
-- back alone too: read as a bare id, it has no record, and is dead-lettered
-- as missing. Plain finds, not a pattern (see parse_lease).
local function parse_item(item)
  if string.byte(item, 1) ~= 1 then return item end
  local a = string.find(item, '\n', 2, true)
  local b = a and string.find(item, '\n', a + 1, true)
  local c = b and string.find(item, '\n', b + 1, true)
  local d = c and string.find(item, '\n', c + 1, true)
  if not d then return item end
  return string.sub(item, 2, a - 1), string.sub(item, b + 1, c - 1), string.sub(item, c + 1, d - 1),
    string.sub(item, a + 1, b - 1), string.sub(item, d + 1)
end

-- Write the record of envelope `id` of tenant `t` from its whole lane item
-- `item`, the fields enqueue wrote before envelopes were stored whole. An
-- item that does not parse (written behind the scripts' back; a lease hands
-- it to the worker as a payload that does not decode) is kept whole as the
-- payload, so a dead letter keeps its bytes. Cannot fail.
local function item_record(t, id, item)
  local _, seq, at, ep, payload = parse_item(item)
  if not seq then seq, at, ep, payload = '0', '0', '', item end
  redis.call('HSET', ekey(t, id), 't', t, 's', seq, 'p', payload, 'n', at, 'ep', ep)
end

-- The record of envelope `id` of tenant `t`, leased as `lease`: one leased
-- while stored whole has its record written from P:leased (and its field
-- there deleted); else as adopt finds it. Returns the record's key and
-- whether it exists. A P:leased of the wrong type counts as holding
-- nothing: the callers have written before they ask, and must not fail.
local function leased_record(t, id, lease)
  local item = redis.pcall('HGET', LEASED, lease)
  if type(item) == 'string' then
    redis.call('HDEL', LEASED, lease)
    item_record(t, id, item)
    return ekey(t, id), true
  end
  return adopt(t, id)
end

-- The endpoint of the envelope leased as `lease` (record key `ek`), ''
-- when it names none.
local function leased_endpoint(lease, ek)
  local item = redis.pcall('HGET', LEASED, lease)
  if type(item) == 'string' then
    local _, seq, _, ep = parse_item(item)
    if seq then return ep end
  end
  return redis.call('HGET', ek, 'ep') or ''
end

-- Forget the bodies of acked deliveries, named by their leases (at most
-- 64, each parsed by end_lease already): those leased whole are fields of
-- P:leased, the others records. One call when all were leased whole.
-- Cannot fail.
local function forget_bodies(leases)
  if #leases == 0 then return end
  if redis.pcall('HDEL', LEASED, unpack(leases)) == #leases then return end
  local keys = {}
  for i, m in ipairs(leases) do
    local _, _, id, t = parse_lease(m)
    keys[i] = ekey(t, id)
  end
  redis.call('DEL', unpack(keys))
end

-- Tenant `t` claimed in period `period` for the first time, its newest
-- before that `was`: the set expires after three windows as a safety net,
-- the one from two periods back is freed in the background, and the
-- tenant's fields say which sets exist (see claim_ids). Cannot fail once
-- the set was written.
local function claims_advance(t, period, was)
  redis.call('EXPIRE', claims_key(period, t), 3 * ID_TTL, 'NX')
  redis.call('UNLINK', claims_key(period - 2, t))
  redis.call('HSET', tkey(t), 'ip', period, 'ia', was)
end

-- The places (from 1) of the ids of `list[from..]`, `count` of them, that
-- were not claimed before (known[k] ~= 1; known nil: none was), each id at
-- its first place only: a table with `true` at those places, and the ids
-- there, in order (see claim_ids).
local function first_places(list, from, count, known)
  local places, ids, seen = {}, {}, {}
  for k = 1, count do
    local id = list[from + k - 1]
    if not (known and known[k] == 1) and not seen[id] then
      seen[id] = true
      places[k] = true
      ids[#ids + 1] = id
    end
  end
  return places, ids
end

-- Idempotency: which of tenant `t`'s ids `list[from..to]` (at most 1000)
-- are new to this queue? An id is new when it was seen neither in this
-- idttl-long period nor the one before (so it is remembered for at least
-- idttl seconds, at most twice that); the new ones are claimed. `ip` and
-- `ia` are the tenant's fields as read by the caller: the newest period it
-- claimed in, and the one before that (so which of the two sets exist is
-- known without asking), `xc` its flag for claims being copied by a move
-- (new claims also go to P:idsx:<t>). Returns `true` when every id is new
-- and named once, else a table with `true` at each new id's place (from 1;
-- an id named twice is new at its first place only); then the tenant's
-- `ip` and `ia` after the call. The ids go to Redis straight from `list`
-- (no table is built per id unless some are not new): a batch costs the
-- tenant one set lookup per set it has (none when it has none, nor for
-- now's set when it is one id: the SADD both checks and claims) and one
-- SADD. The current period's set expires
-- after three windows as a safety net; the set from two periods back is
-- freed in the background (UNLINK) when the tenant first claims in a new
-- period.
local function claim_ids(t, list, from, to, now, ip, ia, xc)
  local period = id_period(now)
  local last, before = tonumber(ip) or -1, tonumber(ia) or -1
  local cur, prev = claims_key(period, t), claims_key(period - 1, t)
  -- Renumbered: a newest period far past now (a longer window numbers the
  -- periods anew, hundreds of thousands lower at today's clock) or one
  -- that is not a number (written behind the scripts' back): both of now's
  -- sets are checked, and the fields rewritten as if the tenant had
  -- claimed in both. Behind: the clock stepped back (by fewer than a
  -- thousand windows), so the tenant's newest set is ahead of now: it is
  -- checked too, and stays the newest until the clock is back there.
  local renumbered = (ip and not tonumber(ip)) or last > period + 1000
  local behind = not renumbered and last > period
  local count = to - from + 1
  -- the SMISMEMBER answer of the first set checked, the others' claims
  -- merged into it: known[k] == 1 when the id at place k was claimed before
  local known
  local function check(key)
    local r = redis.call('SMISMEMBER', key, unpack(list, from, to))
    if not known then
      known = r
    else
      for k = 1, count do
        if r[k] == 1 then known[k] = 1 end
      end
    end
  end
  if renumbered or behind or last == period - 1 or (last == period and before == period - 1) then check(prev) end
  -- one id alone needs no lookup of now's set: its SADD answers that
  if (renumbered or behind or last == period) and count > 1 then check(cur) end
  if behind then check(claims_key(last, t)) end
  local fresh = true
  for k = 1, known and count or 0 do
    if known[k] == 1 then
      fresh = false
      break
    end
  end
  if fresh then
    -- none claimed before: one SADD of them as they came, and its count
    -- says whether one was named twice (one id alone that it finds
    -- claimed was in a set the fields do not account for: claimed, as a
    -- single post always answered)
    if redis.call('SADD', cur, unpack(list, from, to)) < count then
      fresh = count > 1 and first_places(list, from, count) or {}
    end
    if xc == '1' then redis.call('SADD', P .. ':idsx:' .. t, unpack(list, from, to)) end
  else
    local claim
    fresh, claim = first_places(list, from, count, known)
    if #claim == 0 then return fresh, ip, ia end
    redis.call('SADD', cur, unpack(claim))
    if xc == '1' then redis.call('SADD', P .. ':idsx:' .. t, unpack(claim)) end
  end
  if behind then
    -- a set that may be new; the fields keep the newest, and the one
    -- before it when that is now's (checked when the clock is back there)
    redis.call('EXPIRE', cur, 3 * ID_TTL, 'NX')
    if period == last - 1 and before ~= period then
      redis.call('HSET', tkey(t), 'ia', period)
      return fresh, ip, period
    end
    return fresh, ip, ia
  end
  if last < period or renumbered then
    local was = renumbered and period - 1 or last
    claims_advance(t, period, was)
    return fresh, period, was
  end
  return fresh, ip, ia
end

-- A tenant's weight: its own (P:weights) wins over its tier's (`tr`, as the
-- caller read it with the tenant's state: no extra call), then the queue's
-- default. A tier the policy has no weight for gets the default.
local function weight(t, tr)
  local w = tonumber(redis.call('HGET', P .. ':weights', t))
  if w then return w end
  if tr then w = TIER_WEIGHTS[tr] end
  return w or DEFAULT_WEIGHT
end

-- The tenant's quantum (us): the queue's, scaled by its weight.
-- At least 100 us (the smallest product of the CRD's floors on quantumSeconds
-- and weights): a quantum that rounds to nothing would never bring a tenant
-- back into credit, and every lease would answer AGAIN.
local MIN_QUANTUM = 100
local function quantum(t, tr)
  return math.max(math.floor(QUANTUM * weight(t, tr) + 0.5), MIN_QUANTUM)
end

-- A tenant's in-flight cap: 1 under strict order (under tenant isolation;
-- under endpoint isolation it is each endpoint's cap that is 1), else its
-- own (P:caps, only looked up when the policy says some tenant has one),
-- else the queue's. A stored cap that is not a number from 1 to 100,000 is ignored
-- (a fraction is rounded down).
local function cap_of(t)
  if ORDERED and not ISO_EP then return 1 end
  if CAP_TENANTS then
    local c = tonumber(redis.call('HGET', P .. ':caps', t))
    if c and c >= 1 and c <= 100000 then return math.floor(c) end
  end
  return CAP
end

-- ---- endpoint isolation (policy iso=ep) ---------------------------------
-- A tenant's envelopes wait in one lane per endpoint, P:qe:<#t>:<t>:<ep>.
-- Its ready endpoints (work queued, under their cap, not blocked) are the
-- ZSET P:ez:<t>, scored by virtual time: the worker-us each endpoint has
-- been charged (start-time fair queuing). The tenant is on the ring while it
-- has a ready endpoint, and the ring's deficit round robin between tenants
-- is unchanged; each lease of the tenant serves its ready endpoint with the
-- least virtual time, charging it the tenant's estimate, settled at ack
-- like the tenant's deficit. Per endpoint, fields of P:t:<t>: ef:<ep> in
-- flight, es:<ep> 'r' ready, 'k' parked at its cap, 'b' blocked (breaker,
-- pace or tokens; its member in P:blocked is "<t>\n<ep>"), absent idle;
-- ev:<ep> its virtual time while not ready. evc: the tenant's virtual clock
-- (the start of its last lease), which an endpoint that becomes ready
-- catches up to, so an idle endpoint hoards nothing. P:eps:<t> SET: the
-- endpoints whose lane holds envelopes.

-- The in-flight cap of each of a tenant's endpoints, given the tenant's:
-- 1 under strict order, else the policy's (never above the tenant's), else
-- half the tenant's rounded up, so no one endpoint can fill its tenant's slots.
local function ep_cap(tcap)
  if ORDERED then return 1 end
  if EP_CAP > 0 then return math.min(EP_CAP, tcap) end
  return math.max(math.floor((tcap + 1) / 2), 1)
end

-- What a block of tenant `t`'s endpoint `ep` is called in P:blocked: the
-- endpoint under endpoint isolation, else the tenant.
local function block_of(t, ep)
  if ISO_EP then return t .. '\n' .. ep end
  return t
end

-- Make endpoint `ep` of tenant `t` ready, if its lane holds work and it is
-- neither ready, parked at its cap nor blocked. Returns true when it became
-- ready (its tenant may then need to join the ring: activate).
local function ep_ready(t, ep)
  local tk = tkey(t)
  local s = redis.call('HMGET', tk, 'es:' .. ep, 'ev:' .. ep, 'evc', 'ef:' .. ep)
  -- its state holds only while the keys agree (a ready set, a block or a
  -- lane lost behind the scripts' back must not strand the endpoint)
  if s[1] == 'r' and redis.call('ZSCORE', ezkey(t), ep) then return false end
  if s[1] == 'b' and redis.call('ZSCORE', BLOCKED, block_of(t, ep)) then return false end
  if s[1] == 'k' and num(s[4], 0) >= ep_cap(cap_of(t)) then return false end
  if redis.call('LLEN', eplane(t, ep)) == 0 then
    redis.call('SREM', epskey(t), ep)
    if s[1] then redis.call('HDEL', tk, 'es:' .. ep) end
    return false
  end
  redis.call('ZADD', ezkey(t), math.max(num(s[2], 0), num(s[3], 0)), ep)
  redis.call('HSET', tk, 'es:' .. ep, 'r')
  if s[2] then redis.call('HDEL', tk, 'ev:' .. ep) end
  return true
end

-- Append `ids` (at most a page) to tenant `t`'s lane in order; under
-- endpoint isolation each to the lane of its endpoint (`eps[i]`), those
-- endpoints made ready. The caller activates the tenant.
local function lane_append(t, ids, eps)
  if #ids == 0 then return end
  if not ISO_EP then
    redis.call('RPUSH', lane(t), unpack(ids))
    return
  end
  local groups, order = {}, {}
  for i, id in ipairs(ids) do
    local ep = eps[i] or ''
    local g = groups[ep]
    if not g then
      g = {}
      groups[ep] = g
      order[#order + 1] = ep
    end
    g[#g + 1] = id
  end
  for _, ep in ipairs(order) do redis.call('RPUSH', eplane(t, ep), unpack(groups[ep])) end
  redis.call('SADD', epskey(t), unpack(order))
  for _, ep in ipairs(order) do ep_ready(t, ep) end
end

-- After endpoint `ep` of tenant `t` served a lease (or found nothing to
-- serve), with its virtual time now `v` and `f` in flight: it stays ready,
-- is parked at its cap, or goes idle (its lane empty). `tcap` is the
-- tenant's cap. Cannot fail.
local function ep_after(t, ep, v, f, tcap)
  local tk = tkey(t)
  if redis.call('LLEN', eplane(t, ep)) == 0 then
    redis.call('ZREM', ezkey(t), ep)
    redis.call('SREM', epskey(t), ep)
    -- idle: it keeps its virtual time only while a delivery may still
    -- settle against it, so a one-off endpoint leaves nothing behind
    if f > 0 then
      redis.call('HSET', tk, 'ev:' .. ep, v)
      redis.call('HDEL', tk, 'es:' .. ep)
    else
      redis.call('HDEL', tk, 'es:' .. ep, 'ev:' .. ep)
    end
  elseif f >= ep_cap(tcap) then
    redis.call('ZREM', ezkey(t), ep)
    redis.call('HSET', tk, 'es:' .. ep, 'k', 'ev:' .. ep, v)
  else
    redis.call('ZADD', ezkey(t), v, ep)
  end
end

-- Settle endpoint `ep`'s part of a delivery of tenant `t`: its virtual time
-- takes the difference between what was used and what was charged (us),
-- and with `free_slot` one of its slots is freed, so an endpoint parked at
-- its cap becomes ready again. Returns true when it became ready.
local function ep_settle(t, ep, delta, free_slot)
  local tk = tkey(t)
  local s = redis.call('HMGET', tk, 'es:' .. ep, 'ev:' .. ep, 'ef:' .. ep)
  if delta ~= 0 then
    if s[1] == 'r' then
      redis.call('ZINCRBY', ezkey(t), delta, ep)
    elseif s[2] then
      redis.call('HSET', tk, 'ev:' .. ep, num(s[2], 0) + delta)
    end
  end
  if not free_slot then return false end
  local f = num(s[3], 1) - 1
  if f > 0 then
    redis.call('HSET', tk, 'ef:' .. ep, f)
  else
    redis.call('HDEL', tk, 'ef:' .. ep)
    -- an idle endpoint's last delivery settled: its virtual time goes too
    if not s[1] and s[2] then redis.call('HDEL', tk, 'ev:' .. ep) end
  end
  if s[1] == 'k' and f < ep_cap(cap_of(t)) then
    redis.call('HDEL', tk, 'es:' .. ep)
    return ep_ready(t, ep)
  end
  return false
end

-- ---- delivery rate limits: token buckets checked at lease ---------------
-- A tenant's limit is its own entry in P:limits (only looked up when the
-- policy says some tenant has one), else its tier's, else the queue's
-- default; false when it has none. Parsed entries are kept like policies.
local LIMITS, LIMIT_COUNT = {}, 0
local function limit_of(t, tr)
  if RL_TENANTS then
    local raw = redis.call('HGET', P .. ':limits', t)
    if raw then
      local l = LIMITS[raw]
      if l == nil then
        if LIMIT_COUNT >= 1024 then LIMITS, LIMIT_COUNT = {}, 0 end
        l = parse_limit(raw)
        LIMITS[raw], LIMIT_COUNT = l, LIMIT_COUNT + 1
      end
      return l
    end
  end
  if tr and RL_TIERS[tr] ~= nil then return RL_TIERS[tr] end
  return RL_DEFAULT
end

-- The micro-tokens in a bucket of `cap` refilled at `rate` per ms that
-- held `tokens` at `at` (absent: full). A clock that steps back adds nothing.
local ONE_TOKEN = 1000000
local function bucket_level(tokens, at, rate, cap, now)
  if not tokens then return cap end
  local x = math.floor(tokens + math.max(now - at, 0) * rate)
  if x > cap then return cap end
  return x
end

-- When a bucket at `level` next holds a whole token (ms, at least now + 1).
local function token_due(level, rate, now)
  return now + math.max(math.ceil((ONE_TOKEN - level) / rate), 1)
end

-- The level of an endpoint bucket as it is kept, '<micro-tokens>:<ms>'
-- (spend_endpoint), under limit `lim` at `now`. Absent, or not two whole
-- numbers from 0 up (written behind the scripts' back), it reads as a full
-- bucket. A plain find, not a pattern.
local function endpoint_level(raw, lim, now)
  local tokens, at
  if type(raw) == 'string' then
    local c = string.find(raw, ':', 1, true)
    if c then
      tokens, at = tonumber(string.sub(raw, 1, c - 1)), tonumber(string.sub(raw, c + 1))
      if not (tokens and at and tokens >= 0 and at >= 0 and tokens % 1 == 0 and at % 1 == 0
          and tokens < HUGE and at < HUGE) then
        tokens, at = nil, nil
      end
    end
  end
  return bucket_level(tokens, at or now, lim.erate, lim.ecap, now)
end

-- The endpoint bucket of (t, ep): may a delivery start now? One endpoint's
-- bucket lives in the tenant's own hash, the slot (ee its endpoint, ek the
-- bucket, both read with the lease's HMGET); any other endpoint's is a key
-- of its own (P:rl:...), read and written at each lease. The slot changes
-- hands only while it is free (no ee, or its bucket full again, which reads
-- the same as none) and only to an endpoint whose key holds no bucket short
-- of full, so one endpoint's bucket is never in two places. `ee`, `ek`: the
-- slot as the lease read it. Returns true, the key to spend from (nil: the
-- slot) and the level; or the time the next token is due.
local function endpoint_gate(t, ep, lim, now, ee, ek)
  local k, level
  if ep == ee then
    level = endpoint_level(ek, lim, now)
  else
    k = P .. ':rl:' .. #t .. ':' .. t .. ':' .. ep
    -- a key of the wrong type (written behind the scripts' back) reads as a
    -- full bucket: a lease has written before it asks, and must not fail
    level = endpoint_level(redis.pcall('GET', k), lim, now)
    if level >= lim.ecap and (not ee or endpoint_level(ek, lim, now) >= lim.ecap) then k = nil end
  end
  if level < ONE_TOKEN then return token_due(level, lim.erate, now) end
  return true, k, level
end

-- Spend one token of the endpoint bucket at `level` (endpoint_gate): in
-- its key, which goes once it would be full again, or in the slot, whose
-- fields join the lease's own in `set` (taking the slot when `ee` is
-- another endpoint's).
local function spend_endpoint(k, level, lim, now, ep, ee, set)
  local left = level - ONE_TOKEN
  local px = math.ceil((lim.ecap - left) / lim.erate) + 1000
  -- a bucket past what a double holds exactly, or a time that is not a
  -- number (a limit written behind the scripts' back) is not kept: SET
  -- would refuse it after this lease's writes
  if not (left >= 0 and left < 9007199254740992 and px >= 1 and px < 9007199254740992) then return end
  -- whole numbers, formatted as such (not by '..' and Redis's '%.17g')
  local v = string.format('%d:%d', left, now)
  if k then
    redis.call('SET', k, v, 'PX', string.format('%d', px))
  else
    local n = #set
    if ee ~= ep then set[n + 1] = 'ee'; set[n + 2] = ep; n = n + 2 end
    set[n + 1] = 'ek'; set[n + 2] = v
  end
end

-- Wake idle workers for tenant `t`: each message rouses one idle task of
-- each worker (workers call notify_one per message).
local function wake(t)
  redis.call('PUBLISH', P .. ':wake', t)
end
-- Put a tenant on the ring, at the head (a fresh turn) or the tail. Every
-- activation publishes, so one per tenant made active brings as many idle
-- tasks as there is new work (a batch's acks publish once: see ack_batch).
local function push_active(t, front)
  redis.call(front and 'LPUSH' or 'RPUSH', RING, t)
  wake(t)
end

-- Put a tenant with queued work at the tail of the ring, unless it is on
-- the ring already, parked at its cap, blocked, or paused by a user.
local function activate(t)
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'bl', 'up')
  if st[1] == '1' or st[2] == '1' or st[3] == '1' or st[4] == '1' then return end
  if not has_ready(t) then return end
  push_active(t, false)
  redis.call('HSET', tk, 'r', 1)
end

-- A tenant that was idle and has new work: it earns its quantum now and, if
-- that leaves it in credit (no unpaid debt), goes to the head of the ring
-- for one turn (at most one quantum), ahead of the backlogged tenants, like
-- a sparse flow in FQ-CoDel. This is what lets a password reset overtake a
-- whale's turn; the interrupted turn resumes after it.
local function activate_fresh(t)
  if ISO_EP and not has_ready(t) then return end
  local tk = tkey(t)
  local st = redis.call('HMGET', tk, 'r', 'k', 'd', 'bl', 'tr', 'up')
  if st[1] == '1' or st[2] == '1' or st[4] == '1' or st[6] == '1' then return end
  local q = quantum(t, st[5] or nil)
  local d = num(st[3], 0) + q
  -- b: what the fresh turn may still charge; refunds at ack do not extend it
  redis.call('HSET', tk, 'r', 1, 'd', d, 'b', q)
  push_active(t, d > 0)
end

-- Free one in-flight slot (and, under endpoint isolation, one of endpoint
-- `ep`'s, whose virtual time takes `delta` us: a refund is negative); a
-- tenant parked at its cap rejoins the ring if it has work.
local function release(t, ep, delta)
  local tk = tkey(t)
  local f = redis.call('HINCRBY', tk, 'f', -1)
  if f < 0 then redis.call('HSET', tk, 'f', 0); f = 0 end
  local again = ISO_EP and ep and ep_settle(t, ep, delta or 0, true)
  if redis.call('HGET', tk, 'k') == '1' and f < cap_of(t) then
    redis.call('HSET', tk, 'k', 0)
    again = true
  end
  if again then activate(t) end
end

-- ---- circuit breaker, per tenant and endpoint --------------------------
-- Healthy endpoints cost nothing: a breaker hash exists only from an
-- endpoint's first failure in a window, and the tenant's `bw` count (read
-- with state the scripts read anyway) says whether to look.

local function bkey(t, ep) return P .. ':br:' .. #t .. ':' .. t .. ':' .. ep end

-- Lift a block (a member of P:blocked: a tenant, or "<t>\n<ep>" for an
-- endpoint under endpoint isolation) and put what it held back on the ring.
local function unblock(member)
  redis.call('ZREM', BLOCKED, member)
  local t, ep = string.match(member, '^([^\n]*)\n(.*)$')
  if t then
    local tk = tkey(t)
    if redis.call('HGET', tk, 'es:' .. ep) == 'b' then
      redis.call('HDEL', tk, 'es:' .. ep)
      if ep_ready(t, ep) then activate(t) end
    end
    return
  end
  redis.call('HSET', tkey(member), 'bl', 0)
  activate(member)
end

-- May a request to `ep` go out now? Returns true, or the time until which
-- it is blocked, and the state change ('half-open' or '').
local function breaker_gate(t, ep, now)
  local k = bkey(t, ep)
  -- a key of the wrong type (written behind the scripts' back) reads as a
  -- closed breaker: a lease has written before it asks, and must not fail
  local b = redis.pcall('HMGET', k, 's', 'u')
  if b.err or (b[1] ~= 'open' and b[1] ~= 'half') then return true, '' end
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
  -- a key of the wrong type (written behind the scripts' back) is a closed
  -- breaker starting over: an ack or nack has written before it asks
  local b = redis.pcall('HMGET', k, 's', 'ws', 'n', 'x')
  if b.err then
    redis.call('DEL', k)
    b = {}
  end
  local s = b[1]
  if s == 'half' then
    if failed then
      redis.call('HSET', k, 's', 'open', 'u', now + BR_OPEN)
      return 'open'
    end
    redis.call('DEL', k)
    redis.call('HINCRBY', tk, 'bw', -1)
    unblock(block_of(t, ep))
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

-- Tenants (and endpoints) whose block has run out go back on the ring. Returns when the
-- next one is due (ms; nil when none is blocked).
local function unblock_due(now, limit)
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', BLOCKED, '-inf', now, 'LIMIT', 0, limit)) do
    unblock(member)
  end
  local first = redis.call('ZRANGE', BLOCKED, 0, 0, 'WITHSCORES')
  return first[2] and tonumber(first[2])
end

-- ---- receiver pacing, per tenant and endpoint -------------------------
-- A 429 or 503 with Retry-After pauses the endpoint until the time asked
-- (at most PACE_MAX from now). The tenant's `pz` (read with state the lease
-- reads anyway) says whether any of its endpoints may be paced, so a tenant
-- that was never paced pays nothing.

local function pacekey(t) return P .. ':pace:' .. t end

-- Pause `ep` of tenant `t` for `ms` (capped at PACE_MAX) from `now`; the
-- later of an existing pause and this one wins. Returns the paced-until ms.
-- Does not touch the circuit breaker. Cannot fail.
local function pace_endpoint(t, ep, ms, now)
  local until_ms = now + math.min(ms, PACE_MAX)
  local k, tk = pacekey(t), tkey(t)
  local old = tonumber(redis.call('HGET', k, ep)) or 0
  if until_ms > old then redis.call('HSET', k, ep, until_ms) else until_ms = old end
  if until_ms > num(redis.call('HGET', tk, 'pz'), 0) then
    redis.call('HSET', tk, 'pz', until_ms)
    -- a tenant that never leases again leaves nothing behind (Redis time only)
    if not CLOCK then redis.call('PEXPIREAT', k, until_ms + 1000) end
  end
  return until_ms
end

-- Is `ep` of tenant `t` paced at `now`? `pz` is the tenant's field, known
-- to be > now. Returns its paced-until ms, or nil (an expired entry is deleted).
local function paced_until(t, ep, now)
  local k = pacekey(t)
  -- a key of the wrong type (written behind the scripts' back) reads as no
  -- pause: a lease has written before it asks, and must not fail
  local v = redis.pcall('HGET', k, ep)
  local u = type(v) == 'string' and tonumber(v)
  if not u then return nil end
  if u > now then return u end
  redis.call('HDEL', k, ep)
  return nil
end

-- Every pause of tenant `t` is over (now >= its pz): forget them, once.
local function pace_clear(t)
  redis.call('DEL', pacekey(t))
  redis.call('HDEL', tkey(t), 'pz')
end

-- The most worker-us one share holds (2^52: a whole number a double
-- carries exactly, and '%d' formats). An ack adds at most this, so a
-- share never passes what HINCRBY can add to.
local MAX_SHARE = 4503599627370496

-- A tenant's share of a worker-seconds bucket as stored, when it is one
-- attribute keeps adding to: an integer as Redis writes one (no leading
-- zero or '+'), within MAX_SHARE either way. Else nil: garbage written
-- behind the scripts' back starts over, rather than failing the ack that
-- adds to it.
local function share_of(s)
  if s == '0' then return 0 end
  if not s or #s > 17 or not string.find(s, '^%-?[1-9]%d*$') then return nil end
  local x = tonumber(s)
  if x > MAX_SHARE or x < -MAX_SHARE then return nil end
  return x
end

-- The worker-seconds bucket of `now` (P:wsu:<bucket>).
local function wsu_bucket(now) return P .. ':wsu:' .. math.floor(now / BUCKET_MS) end

-- Add `us` worker-microseconds to tenant `t`'s share of the bucket of
-- `now` (P:wsu:<bucket>), and the batch's `gathered` (tenant -> us) the
-- same way. Cannot fail: a share that is not a whole number is replaced
-- (HINCRBY would raise after the ack's writes), and a bucket that is not a
-- hash (HINCRBY, HMGET and HSET all raise) loses this call's worker-seconds
-- instead of the ack failing.
local function attribute(t, us, now)
  local bucket = wsu_bucket(now)
  -- at most MAX_SHARE (a worker's elapsed time is checked finite, not
  -- sensible), as an integer's digits
  us = math.min(us, MAX_SHARE)
  local add = string.format('%d', us)
  local r = redis.pcall('HINCRBY', bucket, t, add)
  if type(r) == 'table' or r > MAX_SHARE or r < -MAX_SHARE then
    -- not an integer, or past MAX_SHARE (as share_of reads it): it starts over
    if type(redis.pcall('HSET', bucket, t, add)) == 'table' then return end
    r = us
  end
  -- the first write to a bucket is always a tenant's first in it: set the TTL then
  if r == us then redis.call('EXPIRE', bucket, 7200) end
end

-- From now until attribute_flush, `settle` gathers worker-us per tenant
-- instead of writing each delivery's (a batched call).
local function attribute_gather()
  ATTR = {}
end

-- Write what attribute_gather gathered: one tenant's with its HINCRBY,
-- several tenants' with one HMGET and one HSET of the bucket whatever
-- their number. Cannot fail (see attribute).
local function attribute_flush(now)
  local gathered = ATTR
  ATTR = nil
  if not gathered then return end
  local ts = {}
  for t in pairs(gathered) do ts[#ts + 1] = t end
  if #ts == 0 then return end
  if #ts == 1 then return attribute(ts[1], gathered[ts[1]], now) end
  local bucket = wsu_bucket(now)
  local had = redis.pcall('HMGET', bucket, unpack(ts))
  if had.err then return end
  local set, fresh = {}, false
  for i, t in ipairs(ts) do
    local share = share_of(had[i])
    -- a new share (or one started over) sets the TTL, as in attribute
    if not share then fresh = true end
    set[2 * i - 1] = t
    set[2 * i] = string.format('%d', (share or 0) + math.min(gathered[t], MAX_SHARE))
  end
  redis.call('HSET', bucket, unpack(set))
  if fresh then redis.call('EXPIRE', bucket, 7200) end
end

-- A tenant's cost estimate (us) after a delivery that took `actual`: a
-- moving average, whole microseconds. Shared by settle and a batch's acks.
local function estimate_after(e, actual)
  return math.floor(e + 0.3 * (actual - e) + 0.5)
end

-- The counter each outcome adds one to.
local OUTCOME_COUNTER = { delivered = 'ok', dead = 'ko', retry = 'w' }

-- Settle the worker-time actually used (us) against the estimate charged at
-- lease, in one read and one write of the tenant's state. With `free_slot`
-- the in-flight slot is released (a tenant parked at its cap then rejoins
-- the ring if it has work). `outcome` counts the envelope: 'delivered',
-- 'dead' (both leave the depth), 'retry' (waits in the delayed set) or nil.
-- `ep` is the endpoint it was leased from under endpoint isolation (nil
-- otherwise), whose virtual time and slot are settled too; with `keep_ep`
-- the endpoint keeps its slot (a strict-order retry) while the tenant's is freed.
local function settle(t, charged, actual, now, free_slot, outcome, ep, keep_ep)
  local tk = tkey(t)
  local counter = OUTCOME_COUNTER[outcome]
  local st = redis.call('HMGET', tk, 'e', 'f', 'k', 'd', 'n', 'bw', 'bl', counter or 'e', 'up')
  local e, f = num(st[1], EST0), num(st[2], 0)
  -- only the fields that change are written
  local set = { 'e', estimate_after(e, actual), 'd', num(st[4], 0) + charged - actual }
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
  -- blocks it or a user paused it) in this same write. It was parked with work queued; should
  -- its lane be empty now, its next turn finds that and takes it off.
  local rejoin = false
  if free_slot and st[3] == '1' and f < cap_of(t) then
    set[n + 1] = 'k'; set[n + 2] = '0'; n = n + 2
    if st[7] ~= '1' and st[9] ~= '1' then
      set[n + 1] = 'r'; set[n + 2] = '1'; n = n + 2
      rejoin = true
    end
  end
  redis.call('HSET', tk, unpack(set))
  if rejoin then push_active(t, false) end
  if ISO_EP and ep and ep_settle(t, ep, actual - charged, free_slot and not keep_ep) and not rejoin then
    activate(t)
  end
  local us = math.floor(actual + 0.5)
  if us > 0 then
    if ATTR then
      ATTR[t] = (ATTR[t] or 0) + us
    else
      attribute(t, us, now)
    end
  end
  return num(st[6], 0)
end

-- Delete the oldest entries of stream `k` up to and including stream id
-- `last` ('+' for any), at most `n` (at most 100) of them. Returns the count.
local function xdel_oldest(k, last, n)
  if n <= 0 then return 0 end
  local old = redis.call('XRANGE', k, '-', last, 'COUNT', math.min(n, 100))
  if #old == 0 then return 0 end
  local ids = {}
  for i, e in ipairs(old) do ids[i] = e[1] end
  return redis.call('XDEL', k, unpack(ids))
end

-- Apply the retention bound to tenant `t`'s dead letters: the oldest go once
-- it has more than DL_MAX, and any older than DL_AGE_MS (Redis time; not
-- under the simulator's virtual clock). Bounded work per call whatever the
-- stream holds: whole stream nodes first (at most 1000 entries), then at
-- most 100 single entries; what is left over goes at the next call. What
-- is dropped is counted in the tenant's dx and the queue's P:dlx. Keeps
-- the tenant's entry in P:dlq (tenant -> ms of its oldest letter), which
-- maintenance reads to age out letters of tenants that add no more.
local function dl_retain(t)
  local k = dlkey(t)
  local dropped = 0
  local len = redis.call('XLEN', k)
  if len > DL_MAX then
    dropped = redis.call('XTRIM', k, 'MAXLEN', '~', DL_MAX, 'LIMIT', 1000)
    dropped = dropped + xdel_oldest(k, '+', len - dropped - DL_MAX)
  end
  if not CLOCK then
    local tm = redis.call('TIME')
    local since = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000) - DL_AGE_MS
    if since > 1 then
      local d = redis.call('XTRIM', k, 'MINID', '~', since, 'LIMIT', 1000)
      dropped = dropped + d + xdel_oldest(k, since - 1, 100)
    end
  end
  if dropped > 0 then
    redis.call('HINCRBY', tkey(t), 'dx', dropped)
    redis.call('INCRBY', P .. ':dlx', dropped)
  end
  local first = redis.call('XRANGE', k, '-', '+', 'COUNT', 1)[1]
  if first then
    redis.call('ZADD', P .. ':dlq', tonumber(string.match(first[1], '^(%d+)')), t)
  else
    redis.call('ZREM', P .. ':dlq', t)
  end
  return dropped
end

-- Record a dead letter of tenant `t` in its stream, apply the retention
-- bound, and delete the envelope's record. `enq` is when the envelope was
-- enqueued (ms, as stored; nil when unknown): replay_dead tells its id's
-- own claim from a later envelope's by it. The caller has counted it
-- (settle 'dead'). Cannot fail.
local function dead_letter(t, id, attempts, cause, now, payload, ep, enq)
  redis.call('XADD', dlkey(t), '*', 'id', id, 'a', istr(attempts), 'c', cause, 'at', now, 'p', payload or '',
    'ep', ep or '', 'n', enq or '')
  dl_retain(t)
  redis.call('DEL', ekey(t, id))
end

-- Age out the dead letters of up to `limit` tenants whose oldest letter is
-- past DL_AGE_MS (maintenance: a tenant that adds no letters still loses
-- its old ones).
local function dl_expire(limit)
  if CLOCK then return end
  local tm = redis.call('TIME')
  local since = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000) - DL_AGE_MS
  if since <= 1 then return end
  for _, t in ipairs(redis.call('ZRANGEBYSCORE', P .. ':dlq', '-inf', '(' .. since, 'LIMIT', 0, limit)) do
    dl_retain(t)
  end
end

-- The cause given when an envelope's record is gone (evicted, deleted by
-- hand, a bug): it cannot be delivered, and saying so beats losing it quietly.
local MISSING = 'envelope record missing from the queue (evicted or deleted): nothing to deliver'

-- A leased envelope whose record is gone: its tenant is settled as for a
-- dead letter (slot freed, depth down) and the letter says why.
local function dead_missing_lease(t, id, charged, used, now, ep)
  settle(t, charged, used, now, true, 'dead', ep)
  dead_letter(t, id, 0, MISSING, now, '', '')
end

-- Return envelopes to the head of their tenants' lanes in original (seq) order.
-- `items` is a list of {tenant, seq, id, endpoint}; the endpoint names the
-- lane under endpoint isolation.
local function return_to_head(items)
  table.sort(items, function(a, b) return a[2] > b[2] end)
  local touched, eps = {}, {}
  for _, it in ipairs(items) do
    local t = it[1]
    if ISO_EP then
      local ep = it[4] or ''
      redis.call('LPUSH', eplane(t, ep), it[3])
      eps[block_of(t, ep)] = { t, ep }
    else
      redis.call('LPUSH', lane(t), it[3])
    end
    touched[t] = true
  end
  for _, te in pairs(eps) do
    redis.call('SADD', epskey(te[1]), te[2])
    ep_ready(te[1], te[2])
  end
  for t, _ in pairs(touched) do activate(t) end
end

-- A delayed entry: "<x><ref>" (see P:delayed); under endpoint isolation
-- "<X><#ep>:<ep><ref>", X 'E' where x is '1' and 'e' where it is '0'.
local function delayed_member(t, id, slot, ep)
  if ISO_EP then return (slot and 'E' or 'e') .. istr(#ep) .. ':' .. ep .. eref(t, id) end
  return (slot and '1' or '0') .. eref(t, id)
end

-- The parts of a delayed entry: tenant, id (nil, nil when it has no ref),
-- whether it keeps its tenant's slot, and its endpoint (nil when it names none).
local function parse_delayed(member)
  local x, rest, ep = string.sub(member, 1, 1), string.sub(member, 2), nil
  if x == 'e' or x == 'E' then
    local len, r = string.match(rest, '^(%d+):(.*)$')
    len = tonumber(len)
    if len and #r >= len then ep, rest = string.sub(r, 1, len), string.sub(r, len + 1) end
  end
  local t, id = parse_ref(rest)
  return t, id, x == '1' or x == 'E', ep
end

-- Move due retries back to the head of their lanes. A retry whose record is
-- gone is dead-lettered with its tenant settled (its delayed count, depth
-- and, when it kept one, its slot), so the tenant is never wedged.
local function promote_due(now, limit)
  local members = redis.call('ZRANGEBYSCORE', DELAYED, '-inf', now, 'LIMIT', 0, limit)
  local items = {}
  for _, member in ipairs(members) do
    redis.call('ZREM', DELAYED, member)
    local t, id, slot, ep = parse_delayed(member)
    if not t then
      -- a member of a library version before this one: the bare id
      id = member
      local m = redis.call('HMGET', P .. ':e:' .. id, 't', 'x')
      t, slot = m[1], m[2] == '1'
    end
    if t then
      local ek, present = adopt(t, id)
      local tk = tkey(t)
      redis.call('HINCRBY', tk, 'w', -1)
      if slot then
        redis.call('HDEL', ek, 'x')
        -- under endpoint isolation the retry kept only its endpoint's slot
        if ISO_EP and ep then
          if ep_settle(t, ep, 0, true) then activate(t) end
        else
          release(t, ep)
        end
      end
      if present then
        local m = redis.call('HMGET', ek, 's', 'ep')
        items[#items + 1] = { t, tonumber(m[1]) or 0, id, ep or m[2] }
      else
        local st = redis.call('HMGET', tk, 'n', 'ko')
        redis.call('HSET', tk, 'n', math.max(num(st[1], 0) - 1, 0), 'ko', num(st[2], 0) + 1)
        dead_letter(t, id, 0, MISSING, now, '', '')
      end
    end
  end
  return_to_head(items)
  return #members
end

-- Return expired leases to the head of their lanes; a worker that died loses
-- nothing. A reap is the worker's failure, not the endpoint's: it counts as
-- an attempt (so a poison envelope that kills workers is dead-lettered) but
-- not against the endpoint's circuit breaker. A lease whose record is gone
-- settles its tenant and becomes a dead letter.
local function reap(now, limit)
  local leases = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, limit)
  local items = {}
  for _, member in ipairs(leases) do
    redis.call('ZREM', LEASES, member)
    local c, at, id, t, ep = parse_lease(member)
    if c then
      local ek, present = leased_record(t, id, member)
      local used = (now - num(at, now)) * 1000
      if not present then
        dead_missing_lease(t, id, c, used, now, ep)
      else
        local m = redis.call('HMGET', ek, 's', 'p', 'ep', 'n')
        local a = redis.call('HINCRBY', ek, 'a', 1)
        local dead = a >= MAX_ATTEMPTS
        settle(t, c, used, now, true, dead and 'dead' or nil, ep)
        if dead then
          dead_letter(t, id, a, 'lease expired ' .. a .. ' times without an ack (worker died or hung)', now, m[2], m[3],
            m[4])
        else
          items[#items + 1] = { t, tonumber(m[1]) or 0, id, ep or m[3] }
        end
      end
    end
  end
  return_to_head(items)
  return #leases
end
