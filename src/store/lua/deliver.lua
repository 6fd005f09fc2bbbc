-- Helpers (common.lua): istr, int_text, num, ms_text, lease_member, parse_lease, end_lease, end_leases, tkey, lane,
--   eplane, ezkey, has_ready, ekey, adopt, item_id, item_record, leased_endpoint, forget_bodies, quantum,
--   cap_of, ep_cap, block_of, ep_after, limit_of, bucket_level, token_due, endpoint_gate, spend_endpoint,
--   wake, breaker_gate, breaker_record, unblock_due, paced_until, pace_clear, estimate_after, settle,
--   dead_letter, delayed_member, promote_due, reap
-- Lease and ack, shared by the lease, ack and ack_lease scripts.

-- After a lease (charging `charged`) or a skip (charging 0), put the
-- tenant at the head of the ring where it belongs. `budget` is what its
-- fresh turn may still charge (0 outside one). `set` holds the tenant
-- fields the caller has changed; they are written with this step's in one HSET.
-- `tr` is the tenant's tier as the caller read it (nil: none), `cap` its
-- in-flight cap (cap_of). With `drained`, the caller knows its lane is
-- empty (a run's LPOP found fewer than it asked for): no need to ask.
local function reposition(t, tk, d, f, charged, budget, set, tr, cap, drained)
  local n = #set
  if drained or not has_ready(t) then
    -- idle (under endpoint isolation: no endpoint ready): leaves the ring
    -- and keeps no credit (debt stays)
    redis.call('LPOP', RING)
    set[n + 1] = 'r'; set[n + 2] = '0'; set[n + 3] = 'd'; set[n + 4] = math.min(d, 0)
    set[n + 5] = 'b'; set[n + 6] = '0'
  elseif f >= cap then
    -- at its cap: parked off the ring until a slot frees, so it is not rescanned
    redis.call('LPOP', RING)
    set[n + 1] = 'r'; set[n + 2] = '0'; set[n + 3] = 'k'; set[n + 4] = '1'; set[n + 5] = 'b'; set[n + 6] = '0'
  elseif d <= 0 then
    -- turn over: next turn's quantum, to the tail of the ring
    redis.call('LMOVE', RING, RING, 'LEFT', 'RIGHT')
    set[n + 1] = 'd'; set[n + 2] = d + quantum(t, tr); set[n + 3] = 'b'; set[n + 4] = '0'
  elseif budget > 0 and charged > 0 then
    -- a fresh turn: spent (refunds do not extend it), it goes on to the
    -- ring's tail with the credit it has left
    local b = budget - charged
    set[n + 1] = 'b'; set[n + 2] = math.max(b, 0)
    if b <= 0 then redis.call('LMOVE', RING, RING, 'LEFT', 'RIGHT') end
  end
  -- later pairs win: Redis applies HSET's pairs in order
  if #set > 0 then redis.call('HSET', tk, unpack(set)) end
end

-- Due retries, expired leases and lifted blocks (see lease_next). The next
-- maintenance is due in 100 ms, or sooner when a blocked tenant's time
-- comes first: a tenant out of tokens waits for its next token, not for
-- the next 100 ms.
local function maintain_queue(now)
  promote_due(now, 32)
  reap(now, 32)
  local due = unblock_due(now, 32) or (now + 100)
  MAINT_NEXT = math.min(now + 100, math.max(due, now + 1))
  redis.call('HSET', P .. ':conf', 'mnext', MAINT_NEXT)
end

-- Maintenance is due no later than `due` (ms): a block runs out then.
local function maintain_by(due)
  if due < MAINT_NEXT then
    MAINT_NEXT = due
    redis.call('HSET', P .. ':conf', 'mnext', due)
  end
end

-- Under endpoint isolation, take endpoint `ep` (virtual time `v`) of tenant
-- `t` out of its ready set until `due` (ms): its breaker is open, its
-- receiver asked for a pause, or it is out of tokens. The tenant's other
-- endpoints keep its turns; maintenance puts it back (see unblock_due).
local function ep_block(t, ep, v, due)
  redis.call('ZREM', ezkey(t), ep)
  redis.call('HSET', tkey(t), 'es:' .. ep, 'b', 'ev:' .. ep, v)
  redis.call('ZADD', BLOCKED, due, block_of(t, ep))
  maintain_by(due)
end

-- Take tenant `t` off the ring until `due` (ms): its head envelope's
-- breaker is open, or it or that endpoint is out of tokens. Its share goes
-- to the others; maintenance puts it back (see unblock_due). `extra` holds
-- tenant fields to write with the step's own.
local function park(t, tk, due, now, extra)
  redis.call('LPOP', RING)
  local set = { 'r', 0, 'bl', 1, 'b', 0 }
  for i = 1, #extra do set[#set + 1] = extra[i] end
  redis.call('HSET', tk, unpack(set))
  redis.call('ZADD', BLOCKED, due, t)
  maintain_by(due)
end

-- Keep the bodies of envelopes leased whole (lease, item pairs, at most
-- 64) in P:leased, in one call. Cannot fail: should P:leased be of the
-- wrong type (written behind the scripts' back), each gets its record
-- instead, as a nack would write it, and the lease goes on as one of a record.
local function keep_bodies(bodies)
  if type(redis.pcall('HSET', LEASED, unpack(bodies))) == 'number' then return end
  for i = 1, #bodies, 2 do
    local _, _, id, t = parse_lease(bodies[i])
    item_record(t, id, bodies[i + 1])
  end
end

-- Add the leases a batch gathered (score, member pairs, at most 64) to
-- P:leases in one call, and the bodies of those leased whole (lease, item
-- pairs) to P:leased in one more (keep_bodies), and empty both lists.
local function leases_flush(pending, bodies)
  if #pending > 0 then
    redis.call('ZADD', LEASES, unpack(pending))
    for i = #pending, 1, -1 do pending[i] = nil end
  end
  if bodies and #bodies > 0 then
    keep_bodies(bodies)
    for i = #bodies, 1, -1 do bodies[i] = nil end
  end
end

-- The record's fields a lease reads, without and with its endpoint.
local RECORD, RECORD_EP = { 'p', 'a', 's', 'n' }, { 'p', 'a', 's', 'n', 'ep' }

-- What a lease reads of lane item `item` of tenant `t`: the id, the
-- envelope as {payload, attempts, seq, enqueued ms, endpoint} (payload nil:
-- its record is gone), and the item when the envelope is stored whole
-- (nil: it has a record). `fields` are the record's fields to read. An
-- envelope stored whole comes as {item, nil, nil, nil, endpoint}: the
-- worker reads the rest from the item (a LEASED reply with no seq and an
-- item for payload), and the endpoint is read only when `fields` asks.
local function lane_envelope(t, item, fields)
  local id, ep = item_id(item, fields == RECORD_EP)
  if id then return id, { item, false, false, false, ep }, item end
  id = item
  local ek = ekey(t, id)
  local env = redis.call('HMGET', ek, unpack(fields))
  if not env[1] and select(2, adopt(t, id)) then env = redis.call('HMGET', ek, unpack(fields)) end
  return id, env, nil
end

-- How many envelopes in a row the tenant at the ring's head leases before
-- one of them moves it (see reposition), at most `want`: it stays while it
-- is in credit (`d`, charged `e` a lease), has a slot (`room` left) and
-- its fresh turn lasts (`b`; 0: not in one). Stepped, not divided, so the
-- count is the one lease after lease gives whatever the numbers.
local function run_length(d, e, b, room, want)
  local n = math.min(room, want)
  for j = 1, n - 1 do
    d = d - e
    if d <= 0 then return j end
    if b > 0 and e > 0 then
      b = b - e
      if b <= 0 then return j end
    end
  end
  return n
end

-- Put `ids[j]` and those after it (the unleased rest of a run, lane items
-- as popped) back at the head of tenant `t`'s lane, in order. Cannot fail.
local function lane_return(t, ids, j)
  local back = {}
  for x = #ids, j, -1 do back[#back + 1] = ids[x] end
  if #back > 0 then redis.call('LPUSH', lane(t), unpack(back)) end
end

-- Lease the next envelope by deficit round robin, looking at most `budget`
-- tenants at the ring's head.
-- Returns {'LEASED', id, tenant, payload, attempts, seq, token, deadline_ms, enqueued_ms}
--       | {'EMPTY', wait_ms} (nothing eligible; wait_ms until the next retry or lease deadline is due)
--       | {'AGAIN'} (the scan budget ran out while crediting tenants; call again at once),
-- and, second, how many of the budget's steps it took.
-- Due retries and expired leases are handled here at most every 100 ms while
-- the queue is busy (workers also call `maintain` on a timer), and always
-- before answering EMPTY, so an idle queue recovers at once.
-- With `batch` (see lease_batch.lua: {pending, bodies, token, at, want,
-- out}), the lease goes to `batch.pending` (and the body of an envelope
-- stored whole to `batch.bodies`), for leases_flush, instead of into
-- P:leases at once, its token is `batch.token` followed by '.' and its
-- place in the batch (`at`), and a tenant that would stay at the ring's
-- head lease after lease is served a run of up to `want` envelopes in this
-- one step (see run_length): three items per envelope (lease, payload or
-- item, and false or {attempts, seq, enqueued ms, breaker change}: see
-- lease_batch.lua) are appended to `batch.out` (the batch's own answer:
-- nothing to copy), which is what is returned, with the steps (one per
-- lease, as single calls would count) and, third, how many envelopes were
-- leased.
local function lease_next(lease_ms, token, budget, now, batch)
  local pending, bodies = batch and batch.pending, batch and batch.bodies
  local maintained = false
  if now >= MAINT_NEXT then
    maintain_queue(now)
    maintained = true
  end

  for step = 1, budget do
    local t = redis.call('LINDEX', RING, '0')
    if not t and not maintained then
      maintain_queue(now)
      maintained = true
      t = redis.call('LINDEX', RING, '0')
    end
    if not t then
      -- the batch's leases count for the wait
      if pending then leases_flush(pending, bodies) end
      local wait = 1000
      local due = redis.call('ZRANGE', DELAYED, 0, 0, 'WITHSCORES')
      if due[2] then wait = math.min(wait, tonumber(due[2]) - now) end
      for _, z in ipairs({ LEASES, BLOCKED }) do
        local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
        if first[2] then wait = math.min(wait, tonumber(first[2]) - now) end
      end
      return { 'EMPTY', math.max(wait, 1) }, step
    end
    local tk = tkey(t)
    -- the token buckets' fields (the tenant's, and its endpoint slot's: see
    -- endpoint_gate) only where rate limits are in use: each field HMGET
    -- asks for costs a scan of the hash
    local st
    if RL_ANY then
      st = redis.call('HMGET', tk, 'd', 'f', 'e', 'bw', 'b', 'pz', 'tr', 'up', 'tk', 'tu', 'ee', 'ek')
    else
      st = redis.call('HMGET', tk, 'd', 'f', 'e', 'bw', 'b', 'pz', 'tr', 'up')
    end
    -- paused by a user since it joined the ring (see the end of this step)
    local upaused = st[8] == '1'
    local tr = st[7] or nil
    local d, f, e, b = num(st[1], 0), num(st[2], 0), num(st[3], EST0), num(st[5], 0)
    -- pz: the latest pause of any of the tenant's endpoints (0: none)
    local pz = num(st[6], 0)
    if pz > 0 and now >= pz then
      pace_clear(t)
      pz = 0
    end
    local cap = cap_of(t)
    local ready = d > 0 and f < cap and not upaused
    -- the tenant's token bucket, checked with its credit and cap: out of
    -- tokens, it steps off the ring until the next one is due
    local lim = ready and RL_ANY and limit_of(t, tr)
    local level, throttled = nil, false
    if lim and lim.rate > 0 then
      level = bucket_level(tonumber(st[9]), num(st[10], now), lim.rate, lim.cap, now)
      if level < ONE_TOKEN then
        throttled = true
        park(t, tk, token_due(level, lim.rate, now), now, { 'tk', int_text(level), 'tu', ms_text(now) })
      end
    end
    -- item: the lane item popped (see lane_item); ids: the run popped (nil:
    -- one envelope), run: how many it asked for
    local item, ids, run = false, nil, nil
    -- under endpoint isolation: the endpoint served (least virtual time),
    -- its virtual time and its in-flight count
    local lep, lv, lf
    if ready and not throttled then
      if ISO_EP then
        local z = redis.call('ZRANGE', ezkey(t), 0, 0, 'WITHSCORES')
        lep, lv = z[1], tonumber(z[2]) or 0
        if lep then
          lf = num(redis.call('HGET', tk, 'ef:' .. lep), 0)
          if lf < ep_cap(cap) then item = redis.call('LPOP', eplane(t, lep)) end
          -- at its cap or its lane empty: parked or idle, and the scan goes on
          if not item then ep_after(t, lep, lv, lf, cap) end
        end
      else
        -- a run needs every envelope of it to pass the checks the first
        -- does: no breaker in use, no pause, no rate limit
        run = batch and not lim and num(st[4], 0) == 0 and pz == 0
          and run_length(d, e, b, cap - f, math.min(batch.want, budget - step + 1))
        if run and run > 1 then
          ids = redis.call('LPOP', lane(t), run)
          item = ids and ids[1]
        else
          item = redis.call('LPOP', lane(t))
        end
      end
    end
    -- id: the envelope's; whole: its item when it is stored whole (see lane_item)
    local id, env, whole, pass, change, paced = false, nil, nil, true, '', nil
    local ekk, elevel, eep
    if item then
      -- the endpoint matters only to a tenant with breakers in use, a pause
      -- in force or an endpoint limit: then it is read with the record
      local bw = num(st[4], 0)
      local limited = lim and lim.erate > 0
      local gated = bw > 0 or pz > 0 or limited
      id, env, whole = lane_envelope(t, item, (gated and not lep) and RECORD_EP or RECORD)
      if env[1] and gated then
        local ep = lep or env[5] or ''
        if ep ~= '' then
          if pz > 0 then paced = paced_until(t, ep, now) end
          if not paced and bw > 0 then pass, change = breaker_gate(t, ep, now) end
        end
        if not paced and pass == true and limited then
          pass, ekk, elevel = endpoint_gate(t, ep, lim, now, st[11], st[12])
          eep = ep
        end
      end
    end
    if upaused then
      -- it steps off the ring (lazily: a pause never scans the ring) and the
      -- scan goes on; a resume puts it back (user_pause.lua)
      redis.call('LPOP', RING)
      redis.call('HSET', tk, 'r', 0, 'b', 0)
    elseif throttled then
      -- parked above
    elseif id and lep and (paced or pass ~= true) then
      -- endpoint isolation: only this endpoint waits (its order holds),
      -- the tenant's others keep its turn
      redis.call('LPUSH', eplane(t, lep), item)
      ep_block(t, lep, lv, paced or pass)
      reposition(t, tk, d, f, 0, b, {}, tr, cap)
    elseif id and paced then
      if ORDERED then
        -- order forbids passing it: the tenant steps off the ring until the
        -- pause is over (unblock_due lifts it), like a breaker block
        redis.call('LPUSH', lane(t), item)
        park(t, tk, paced, now, {})
      else
        -- this envelope waits out its endpoint's pause in the delayed set (a
        -- retry without an attempt, no slot kept); the tenant's other
        -- endpoints keep flowing. The delayed set names records.
        if whole then item_record(t, id, whole) end
        redis.call('ZADD', DELAYED, paced, delayed_member(t, id, false))
        redis.call('HINCRBY', tk, 'w', 1)
        reposition(t, tk, d, f, 0, b, {}, tr, cap)
      end
    elseif id and pass ~= true then
      -- the head envelope's endpoint is broken or out of tokens: the tenant
      -- steps off the ring until a probe or a token may go, and its share
      -- goes to the others
      redis.call('LPUSH', lane(t), item)
      park(t, tk, pass, now, {})
    elseif id then
      if not env[1] then
        -- an id without its record cannot be delivered; say so instead of
        -- dropping it silently. The rest of a run goes back for the next steps.
        if ids then lane_return(t, ids, 2) end
        local c = redis.call('HMGET', tk, 'n', 'ko')
        dead_letter(t, id, 0, MISSING, now, '', '')
        if lep then ep_after(t, lep, lv, lf, cap) end
        reposition(t, tk, d, f, 0, b, { 'n', math.max(num(c[1], 0) - 1, 0), 'ko', num(c[2], 0) + 1 }, tr, cap)
      else
        local deadline = now + lease_ms
        -- the estimate as stored, when it is: no number to format
        local charge = st[3] or e
        -- a batch's answer, or one sized for one lease
        local out, base = nil, 0
        if batch then
          out = batch.out
          base = #out
        else
          out = { false, false, false, false, false, false, false, false, false, false }
        end
        -- a run that popped fewer than it asked for emptied the lane
        local drained = ids and #ids < run
        -- a batch's lease members differ only by id and place: the rest is made once
        local head, tail
        if batch then
          head = charge .. '\n' .. ms_text(now) .. '\n'
          tail = '\n' .. t .. '\n' .. batch.token .. '.'
        end
        local m = 0
        -- each envelope of a run is leased as its own step would lease it;
        -- the budget of a fresh turn is spent by all but the last here, and
        -- by the last in reposition
        for j = 1, ids and #ids or 1 do
          local jid = id
          if j > 1 then
            jid, env, whole = lane_envelope(t, ids[j], RECORD)
            -- its record is missing: it and the rest go back, for the next step
            if not env[1] then
              lane_return(t, ids, j)
              drained = false
              break
            end
            d, f = d - e, f + 1
            if b > 0 and e > 0 then b = b - e end
          end
          local member
          if batch and not lep then
            -- lease_member's layout, its constant parts made once above
            member = head .. jid .. tail .. istr(batch.at + j - 1)
          else
            member = lease_member(charge, ms_text(now), jid, t, batch and (batch.token .. '.' .. istr(batch.at + j - 1)) or token, lep)
          end
          if pending then
            pending[#pending + 1] = ms_text(deadline)
            pending[#pending + 1] = member
            if whole then
              bodies[#bodies + 1] = member
              bodies[#bodies + 1] = whole
            end
          else
            redis.call('ZADD', LEASES, ms_text(deadline), member)
            if whole then keep_bodies({ member, whole }) end
          end
          m = j
          if batch then
            -- three items (see lease_batch.lua): the lease names the id and
            -- tenant, and an item stored whole the rest
            local o = base + 3 * (j - 1)
            out[o + 1] = member; out[o + 2] = env[1]
            if whole and change == '' then
              out[o + 3] = false
            else
              out[o + 3] = { env[2], env[3], env[4], change }
            end
          else
            out[1] = 'LEASED'; out[2] = jid; out[3] = t; out[4] = env[1]; out[5] = env[2]
            out[6] = env[3]; out[7] = member; out[8] = deadline; out[9] = env[4]; out[10] = change
          end
        end
        d = d - e
        f = f + 1
        local set = { 'd', d, 'f', istr(f) }
        if level then set[5] = 'tk'; set[6] = int_text(level - ONE_TOKEN); set[7] = 'tu'; set[8] = ms_text(now) end
        if elevel then spend_endpoint(ekk, elevel, lim, now, eep, st[11], set) end
        if lep then
          -- the endpoint's slot, and the tenant's virtual clock at this lease's start
          local n = #set
          set[n + 1] = 'ef:' .. lep; set[n + 2] = istr(lf + 1); set[n + 3] = 'evc'; set[n + 4] = lv
          ep_after(t, lep, lv + e, lf + 1, cap)
        end
        reposition(t, tk, d, f, e, b, set, tr, cap, drained)
        return out, step + m - 1, m
      end
    else
      reposition(t, tk, d, f, 0, b, {}, tr, cap)
    end
  end
  return { 'AGAIN' }, budget
end

-- Acknowledge a delivery. Returns 'OK', or 'STALE' when the lease is gone
-- (already acked, or expired and handed to another worker): ack is idempotent.
-- The second value is the breaker's state change ('closed' after a probe).
-- In a batch (see lease_batch.lua), `held` is end_leases' answer for
-- this lease ({charge, tenant, endpoint} when it was held and is taken,
-- false when not), and the lease is added to `dels` for the caller to
-- forget the envelope's body (forget_bodies), once for the batch.
local function ack_one(id, lease, elapsed, now, dels, held)
  local c, t, ep
  if held == nil then
    c, t, ep = end_lease(id, lease)
  elseif held then
    c, t, ep = held[1], held[2], held[3]
  end
  if not c then return 'STALE', '' end
  local bw = settle(t, c, elapsed, now, true, 'delivered', ep)
  local change = ''
  -- the endpoint matters only to a tenant with breakers in use
  if bw > 0 then change = breaker_record(t, ep or leased_endpoint(lease, ekey(t, id)), false, bw, now) end
  if dels then dels[#dels + 1] = lease else forget_bodies({ lease }) end
  return 'OK', change
end

-- Acknowledge a batch's deliveries (lease_batch.lua): `members[i]` (the
-- lease, which names its envelope) and `elapsed[i]` for each; writes each
-- one's status to codes[i] ('O' acked, 'S' stale: ack_one's 'OK' and
-- 'STALE') and its breaker change to changes[i], and adds the leases acked
-- to `dels`. Returns whether any change is not ''. Each tenant's state is
-- read and written once, however many of its deliveries the batch acks,
-- with what settle would have written after each in turn, and tenants
-- parked at their cap rejoin the ring in the order single acks would put
-- them there. Under endpoint isolation, or when a tenant of the batch has
-- breakers in use, it goes one ack at a time (ack_one): endpoint slots and
-- breaker records move tenants on the ring between acks.
local function ack_batch(members, elapsed, now, codes, changes, dels)
  local held = end_leases(members)
  local n = #members
  for i = 1, n do
    codes[i] = 'S'; changes[i] = ''
  end
  -- the tenants acked, in the order of their first ack, and their acks
  local order, acks = {}, {}
  for i = 1, n do
    local h = held[i]
    if h then
      local a = acks[h[2]]
      if not a then
        a = {}
        acks[h[2]] = a
        order[#order + 1] = h[2]
      end
      a[#a + 1] = i
    end
  end
  local states, one_by_one = {}, ISO_EP
  if not one_by_one then
    for _, t in ipairs(order) do
      local st = redis.call('HMGET', tkey(t), 'e', 'f', 'k', 'd', 'n', 'bw', 'bl', 'ok', 'up')
      if num(st[6], 0) > 0 then
        one_by_one = true
        break
      end
      states[t] = st
    end
  end
  if one_by_one then
    local changed = false
    for i = 1, n do
      if held[i] then
        local id = select(3, parse_lease(members[i]))
        local status, change = ack_one(id, members[i], elapsed[i], now, dels, held[i])
        codes[i] = status == 'OK' and 'O' or 'S'
        changes[i] = change
        if change ~= '' then changed = true end
      end
    end
    return changed
  end
  -- {ack, tenant}: where each parked tenant's rejoin falls among the acks
  local rejoins = {}
  for _, t in ipairs(order) do
    local st = states[t]
    local e, f, d = num(st[1], EST0), num(st[2], 0), num(st[4], 0)
    local depth, ok = num(st[5], 0), num(st[8], 0)
    local parked, rejoin = st[3] == '1', nil
    local cap = parked and cap_of(t)
    local us = 0
    for _, i in ipairs(acks[t]) do
      local actual = elapsed[i]
      e = estimate_after(e, actual)
      d = d + held[i][1] - actual
      f = math.max(f - 1, 0)
      ok = ok + 1
      depth = math.max(depth - 1, 0)
      if parked and f < cap then
        parked, rejoin = false, i
      end
      local u = math.floor(actual + 0.5)
      if u > 0 then us = us + u end
      codes[i] = 'O'
      dels[#dels + 1] = members[i]
    end
    local set = { 'e', e, 'd', d, 'f', istr(f), 'ok', ok, 'n', depth }
    if rejoin then
      set[11] = 'k'; set[12] = '0'
      -- unless a breaker blocks it or a user paused it
      if st[7] ~= '1' and st[9] ~= '1' then
        set[13] = 'r'; set[14] = '1'
        rejoins[#rejoins + 1] = { rejoin, t }
      end
    end
    redis.call('HSET', tkey(t), unpack(set))
    if us > 0 then ATTR[t] = (ATTR[t] or 0) + us end
  end
  -- to the ring's tail in one call, in the order single acks would put
  -- them there, and one wake-up for them all (push_active makes one each):
  -- the caller leases in this same call, and a woken worker leases a batch
  if #rejoins > 0 then
    table.sort(rejoins, function(x, y) return x[1] < y[1] end)
    for i, r in ipairs(rejoins) do rejoins[i] = r[2] end
    redis.call('RPUSH', RING, unpack(rejoins))
    wake(rejoins[1])
  end
  return false
end
