-- Helpers (common.lua): num, now_ms, tkey, hold, dlkey, claims_key, id_period, ekey, lane_append, activate
-- ARGV: tenant, cursor, page, since, until, endpoint, then ids (none: every
-- dead letter).
-- Replays one page of the tenant's dead letters in this queue: it reads up
-- to `page` (at most 1000; Store::replay_dead asks for 250, a few ms of work)
-- letters of the tenant's own stream after `cursor` ('-' for the start,
-- otherwise the stream id of the last letter the previous page examined)
-- and no later than `until` (ms; '' for none), starting at `since` (ms; ''
-- for none), and puts each one asked for (by id, and by `endpoint` unless
-- '') back on the tail of its lane (its hold buffer while paused), oldest
-- first, as a new delivery: attempts start again, the id stays claimed. A
-- letter whose envelope is live again (the producer reused the id after the
-- idempotency window) is left where it is. Every read comes before the
-- first write, and nothing after it can fail, so a call does all of its
-- page or nothing. Live again means its record exists (a retry, an
-- envelope of an older version) or, as an envelope stored whole has no
-- record, that the id is claimed in an idempotency period after the one
-- the letter's envelope was enqueued in (its `n`): only a later enqueue
-- claims it there. A letter without `n` (an older version's) counts any
-- claim from its death's period on. Such a letter is replayed once that
-- claim has passed out of the window (at most two periods).
-- Returns {'OK', replayed, next cursor ('' when the range is done), examined}
-- or, when the tenant has moved to another queue, {'MOVED', queue} and
-- nothing changes.
local t, cursor, page = ARGV[1], ARGV[2], math.min(math.max(tonumber(ARGV[3]) or 100, 1), 1000)
local since, upto, endpoint = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] or ''
for _, x in ipairs({ since or 0, upto or 0 }) do
  if x < 0 or x > 9007199254740991 or x % 1 ~= 0 then
    return redis.error_reply('replay_dead: since and until are whole ms from 0')
  end
end
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'p', 'm', 'n')
if st[2] then return { 'MOVED', st[2] } end
local want = nil
if #ARGV > 6 then
  want = {}
  for i = 7, #ARGV do want[ARGV[i]] = true end
end
local k = dlkey(t)
local from = (cursor == '-' or cursor == '') and '-' or ('(' .. cursor)
if from == '-' and since then from = string.format('%d', since) end
local to = upto and string.format('%d', upto) or '+'
local entries = redis.call('XRANGE', k, from, to, 'COUNT', page)
local cand = {}
for _, e in ipairs(entries) do
  local f = {}
  local kv = e[2]
  for i = 1, #kv, 2 do f[kv[i]] = kv[i + 1] end
  if f.id and (not want or want[f.id]) and (endpoint == '' or f.ep == endpoint) and f.p and f.p ~= ''
    and redis.call('EXISTS', ekey(t, f.id)) == 0 then
    cand[#cand + 1] = { e[1], f }
  end
end
-- the candidates' claims in the two periods a claim can be in (see above),
-- one lookup each for the page
local take = {}
if #cand > 0 then
  local period = id_period(now_ms())
  local ids = {}
  for i, c in ipairs(cand) do ids[i] = c[2].id end
  local prev = redis.call('SMISMEMBER', claims_key(period - 1, t), unpack(ids))
  local cur = redis.call('SMISMEMBER', claims_key(period, t), unpack(ids))
  for i, c in ipairs(cand) do
    local f = c[2]
    local enq = tonumber(f.n)
    local p0 = enq and id_period(enq) or (id_period(tonumber(f.at) or 0) - 1)
    if not ((period - 1 > p0 and prev[i] == 1) or (period > p0 and cur[i] == 1)) then take[#take + 1] = c end
  end
end
local next_cursor = ''
if #entries == page then next_cursor = entries[#entries][1] end
if #take == 0 then return { 'OK', 0, next_cursor, #entries } end

-- writes: nothing below can fail (every unpack is of one page)
local now = now_ms()
local seq0 = redis.call('INCRBY', P .. ':seq', #take) - #take
local xids, ids, eps = {}, {}, {}
for j, it in ipairs(take) do
  local f = it[2]
  xids[j], ids[j], eps[j] = it[1], f.id, f.ep or ''
  redis.call('HSET', ekey(t, f.id), 't', t, 's', seq0 + j, 'p', f.p, 'n', now, 'ep', eps[j])
end
redis.call('XDEL', k, unpack(xids))
if st[1] == '1' then redis.call('RPUSH', hold(t), unpack(ids)) else lane_append(t, ids, eps) end
local set = { 'n', num(st[3], 0) + #take }
if st[1] == '1' then set[3] = 'h'; set[4] = num(redis.call('HGET', tk, 'h'), 0) + #take end
redis.call('HSET', tk, unpack(set))
if st[1] ~= '1' then activate(t) end
return { 'OK', #take, next_cursor, #entries }
