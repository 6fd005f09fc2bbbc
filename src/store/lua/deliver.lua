-- Lease and ack, shared by the lease, ack and ack_lease scripts.

-- After a lease (charging `charged`) or a skip (charging 0), put the head
-- tenant of `list` where it belongs.
local function reposition(list, t, tk, d, f, charged)
  if redis.call('LLEN', lane(t)) == 0 then
    -- idle: leaves the ring and keeps no credit (debt stays)
    redis.call('LPOP', list)
    redis.call('HSET', tk, 'r', 0, 'd', math.min(d, 0))
  elseif f >= CAP then
    -- at its cap: parked off the ring until a slot frees, so it is not rescanned
    redis.call('LPOP', list)
    redis.call('HSET', tk, 'r', 0, 'k', 1)
  elseif d <= 0 then
    -- turn over: next turn's quantum, to the tail of the ring
    redis.call('LMOVE', list, RING, 'LEFT', 'RIGHT')
    redis.call('HSET', tk, 'd', d + QUANTUM * weight(t))
  elseif list == FRESH and charged > 0 and tonumber(redis.call('HINCRBYFLOAT', tk, 'b', -charged)) <= 0 then
    -- the fresh turn is spent (refunds do not extend it): on with its credit to the ring's tail
    redis.call('LMOVE', FRESH, RING, 'LEFT', 'RIGHT')
  end
end

-- The tenant to serve next: fresh tenants first, then the ring.
local function head()
  local t = redis.call('LINDEX', FRESH, 0)
  if t then return FRESH, t end
  return RING, redis.call('LINDEX', RING, 0)
end

-- Lease the next envelope by deficit round robin.
-- Returns {'LEASED', id, tenant, payload, attempts, seq, token, deadline_ms, enqueued_ms}
--       | {'EMPTY', wait_ms} (nothing eligible; wait_ms until the next retry or lease deadline is due)
--       | {'AGAIN'} (the scan budget ran out while crediting tenants; call again at once).
-- Due retries and expired leases are handled here at most every 100 ms while
-- the queue is busy (workers also call `maintain` on a timer), and always
-- before answering EMPTY, so an idle queue recovers at once.
local function lease_next(lease_ms, token, budget, now)
  local maintained = false
  local function maintain()
    maintained = true
    promote_due(now, 32)
    reap(now, 32)
    unblock_due(now, 32)
  end
  if now >= MAINT_NEXT then
    redis.call('HSET', P .. ':conf', 'mnext', now + 100)
    maintain()
  end

  for _ = 1, budget do
    local list, t = head()
    if not t and not maintained then
      maintain()
      list, t = head()
    end
    if not t then
      local wait = 1000
      local due = redis.call('ZRANGE', DELAYED, 0, 0, 'WITHSCORES')
      if due[2] then wait = math.min(wait, tonumber(due[2]) - now) end
      for _, z in ipairs({ LEASES, BLOCKED }) do
        local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
        if first[2] then wait = math.min(wait, tonumber(first[2]) - now) end
      end
      return { 'EMPTY', math.max(wait, 1) }
    end
    local tk = tkey(t)
    local st = redis.call('HMGET', tk, 'd', 'f', 'e', 'bw')
    local d, f, e = tonumber(st[1]) or 0, tonumber(st[2]) or 0, tonumber(st[3]) or EST0
    local id = d > 0 and f < CAP and redis.call('LPOP', lane(t))
    local env, pass, change = nil, true, ''
    if id then
      env = redis.call('HMGET', ekey(id), 'p', 'a', 's', 'n', 'ep')
      if env[1] and (tonumber(st[4]) or 0) > 0 and env[5] and env[5] ~= '' then
        pass, change = breaker_gate(t, env[5], now)
      end
    end
    if id and pass ~= true then
      -- the head envelope's endpoint is broken: the tenant steps off the ring
      -- until the breaker lets a probe through, and its share goes to the others
      redis.call('LPUSH', lane(t), id)
      redis.call('LPOP', list)
      redis.call('HSET', tk, 'r', 0, 'bl', 1)
      redis.call('ZADD', BLOCKED, pass, t)
    elseif id then
      local ek = ekey(id)
      if not env[1] then
        -- an id without its record cannot be delivered; say so instead of dropping it silently
        redis.call('RPUSH', P .. ':dead', cjson.encode({ id = id, tenant = t, attempts = 0,
          cause = 'envelope record missing from the queue', at = now, envelope = '' }))
        redis.call('HINCRBY', tk, 'n', -1)
        redis.call('HINCRBY', tk, 'ko', 1)
        reposition(list, t, tk, d, f, 0)
      else
        local deadline = now + lease_ms
        redis.call('HSET', ek, 'l', token, 'c', e, 'at', now)
        redis.call('ZADD', LEASES, deadline, id)
        d = d - e
        f = f + 1
        redis.call('HSET', tk, 'd', d, 'f', f)
        reposition(list, t, tk, d, f, e)
        return { 'LEASED', id, t, env[1], env[2], env[3], token, deadline, env[4], change }
      end
    else
      reposition(list, t, tk, d, f, 0)
    end
  end
  return { 'AGAIN' }
end

-- Acknowledge a delivery. Returns 'OK', or 'STALE' when the lease is gone
-- (already acked, or expired and handed to another worker): ack is idempotent.
-- The second value is the breaker's state change ('closed' after a probe).
local function ack_one(id, token, elapsed, now)
  local ek = ekey(id)
  local m = redis.call('HMGET', ek, 't', 'l', 'c', 'ep')
  if not m[1] or m[2] ~= token then return 'STALE', '' end
  local t = m[1]
  redis.call('DEL', ek)
  redis.call('ZREM', LEASES, id)
  local bw = settle(t, tonumber(m[3]) or 0, elapsed, now, true, 'delivered')
  return 'OK', breaker_record(t, m[4], false, bw, now)
end
