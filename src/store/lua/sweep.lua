-- Helpers (common.lua): num, now_ms, tkey, lane, hold, dlkey, ezkey, epskey, importkey, claims_key,
--   id_period, limit_of, bucket_level, endpoint_level
-- ARGV: count (SSCAN COUNT hint, 1 to 500). One bounded step of the sweep
-- of idle tenants (policy `sweep`, seconds; 0: never): scans the next part
-- of P:tenants from the cursor kept in P:conf (swc) and deletes the
-- per-queue state of each tenant found idle: its state hash P:t:<tenant>,
-- its entry in P:tenants, its stale id claims, its expired pace hash and
-- its emptied dead-letter stream.
-- Idle means:
--   no work here (depth n, in flight, delayed, held all 0; lane and hold
--   buffer empty; not on the ring, parked, blocked, paced, shaped or in a
--   breaker; no dead letters; its delivery token buckets in its state, if
--   any, full again);
--   not paused (by a user or a move), not moved away or being moved;
--   no id claims still inside the idempotency window;
--   no activity (la: an enqueue, an import, or a sweep that found it busy)
--   for the policy's time. A tenant that came here by a move (isrc) is kept
--   at least a day, so a stalled move that repeats its import still skips
--   what it imported.
-- A tenant found busy has its la set to now; one found idle with no la gets
-- one, so its time starts. What a sweep deletes comes back as it was the
-- next time the tenant sends (defaults, zero counters; DRR debt forgiven).
-- When a pass over P:tenants ends, the next starts no sooner than a quarter
-- of the sweep time later (between 1 s and 1 h; P:conf swn).
-- Every read comes before the first write, and no write can fail: every
-- key written was read as its type first (a tenant whose state key is not
-- a hash is skipped; a cursor Redis refuses starts the pass over).
-- Returns {scanned, swept, state}: state 0 mid-pass, 1 this call ended a
-- pass, 2 waiting for the next pass (or the sweep is off).
local count = math.min(math.max(math.floor(tonumber(ARGV[1]) or 100), 1), 500)
if SWEEP_MS <= 0 then return { 0, 0, 2 } end
local conf = P .. ':conf'
local c = redis.call('HMGET', conf, 'swc', 'swn')
local cursor = c[1] or '0'
if not string.match(cursor, '^%d+$') then cursor = '0' end
local now = now_ms()
-- the next pass is due (a time further off than the longest rest, from a
-- clock that stepped back or a hostile value, does not hold it back)
local due = num(c[2], 0)
if cursor == '0' and now < due and due <= now + 3600000 then return { 0, 0, 2 } end
-- pcall: a cursor Redis refuses (not one it gave) starts the pass over
local scan = redis.pcall('SSCAN', P .. ':tenants', cursor, 'COUNT', count)
if scan.err then
  if cursor == '0' then return redis.error_reply('sweep: ' .. scan.err) end
  cursor = '0'
  scan = redis.call('SSCAN', P .. ':tenants', cursor, 'COUNT', count)
end
local nextc, members = scan[1], scan[2]
local period = id_period(now)
-- A counter or flag with nothing in it: absent or '0' (a value that is not
-- a number is read as something, so hostile state keeps what it names).
local function zero(v) return v == false or v == '0' end
-- busy: marked active now (also an idle one with no time of its own yet)
local busy, gone = {}, {}
for _, t in ipairs(members) do
  -- pcall: a state key of another type (written behind the scripts'
  -- back) is left alone, neither marked nor swept, rather than stopping
  -- every sweep at this cursor
  local st = redis.pcall('HMGET', tkey(t), 'n', 'f', 'w', 'h', 'r', 'k', 'bl', 'p', 'up', 'xc', 'm', 'bw', 'sr',
    'pz', 'la', 'ip', 'ia', 'isrc', 'tk', 'tu', 'tr', 'ek')
  if not st.err then
    local idle = zero(st[1]) and zero(st[2]) and zero(st[3]) and zero(st[4]) and zero(st[5]) and zero(st[6])
      and zero(st[7]) and zero(st[8]) and zero(st[9]) and zero(st[10]) and (st[11] == false or st[11] == '')
      and zero(st[12]) and zero(st[13])
    -- paced until a time not yet past
    if idle and st[14] and not (tonumber(st[14]) and tonumber(st[14]) < now) then idle = false end
    -- claims still consulted for duplicates: this period's or the last one's
    local ip = tonumber(st[16])
    if idle and st[16] and not (ip and ip < period - 1) then idle = false end
    -- a delivery bucket not yet full again, the tenant's or the endpoint
    -- bucket in its slot (see endpoint_gate): forgetting it would refill it
    if idle and (st[19] or st[22]) then
      local lim = limit_of(t, st[21] or nil)
      if lim and lim.rate > 0 and bucket_level(tonumber(st[19]), num(st[20], 0), lim.rate, lim.cap, now) < lim.cap then
        idle = false
      end
      if lim and lim.erate > 0 and endpoint_level(st[22], lim, now) < lim.ecap then idle = false end
    end
    if idle then
      idle = redis.call('EXISTS', lane(t), hold(t), epskey(t), ezkey(t)) == 0
      -- dead letters are data; an empty stream (retention or a replay
      -- took them all) is not. pcall: a key of another type counts as data
      local len = redis.pcall('XLEN', dlkey(t))
      if type(len) ~= 'number' or len > 0 then idle = false end
    end
    if not idle then
      busy[#busy + 1] = t
    else
      local la = tonumber(st[15])
      local after = SWEEP_MS
      if st[18] then after = math.max(after, 86400000) end
      if not la or la ~= la or la > now then
        busy[#busy + 1] = t
      elseif now - la >= after then
        gone[#gone + 1] = { t, ip, tonumber(st[17]) }
      end
    end
  end
end
-- writes
redis.call('HSET', conf, 'swc', nextc)
if nextc == '0' then
  redis.call('HSET', conf, 'swn', now + math.min(math.max(math.floor(SWEEP_MS / 4), 1000), 3600000))
end
for _, t in ipairs(busy) do redis.call('HSET', tkey(t), 'la', now) end
local names = {}
for i, g in ipairs(gone) do
  local t = g[1]
  -- the state, the pace hash (expired), the empty dead-letter stream, the
  -- import marks and the stale claims, in one call
  local keys = { tkey(t), P .. ':pace:' .. t, dlkey(t), importkey(t) }
  if g[2] then keys[#keys + 1] = claims_key(g[2], t) end
  if g[3] then keys[#keys + 1] = claims_key(g[3], t) end
  redis.call('DEL', unpack(keys))
  names[#names + 1] = t
  if #names == 100 or i == #gone then
    redis.call('SREM', P .. ':tenants', unpack(names))
    names = {}
  end
end
return { #members, #gone, nextc == '0' and 1 or 0 }
