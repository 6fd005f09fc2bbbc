-- Helpers (common.lua): num, now_ms, tkey, importkey, ekey, lane_append, activate, dead_letter
-- ARGV: tenant, source queue, the tenant's tier in the source ('' none), its
-- user pause there ('1' paused, else not) and that pause's version (0: none),
-- then id, seq (in the source), attempts, payload, enqueued_ms, endpoint per
-- envelope (none: only the state travels). Appends envelopes moved from the
-- source queue's hold buffer to this lane, in order. Idempotent: the tenant
-- remembers the source and the last source sequence number it imported
-- (isrc, isq), and an envelope at or below it is skipped, so a move that
-- died between import and trim can be repeated. (Not by id: the tenant's id
-- claims travel before the move, see claims.lua, so every id is known here.)
-- Under endpoint isolation the hold buffer is in order per endpoint only (a
-- user-paused tenant's lanes went to its head one endpoint after another,
-- see mark_moved.lua), so the mark is per endpoint: P:isq:<tenant>, field s
-- the source the marks are from, e:<endpoint> the last source sequence
-- number imported to that endpoint.
-- An envelope whose record was gone in the source is dead-lettered here.
-- The tier comes along, so the moved backlog is weighed by its tier before
-- the tenant's next event says it again, unless this queue already has one
-- (an event accepted here since the repin said a newer one). A user's pause
-- comes along when its version is newer than what this queue has (a resume
-- that reached this queue after the repin wins over the source's older pause,
-- see user_pause.lua).
-- Returns the count appended.
local t, src, tier, upaused, upv = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]) or 0
if #ARGV < 5 or (#ARGV - 5) % 6 ~= 0 or #ARGV > 5 + 6 * 1000 then
  return redis.error_reply('import: tenant, source, tier, pause, pause version, then six fields per envelope (at most 1000)')
end
local tk = tkey(t)
local st = redis.call('HMGET', tk, 'isrc', 'isq', 'n', 'ko', 'tr', 'upv', 'up')
local last = (st[1] == src) and num(st[2], -1) or -1
local now = now_ms()
local n, dead, top = 0, 0, last
local ids, eps = {}, {}
-- endpoint isolation: the marks of this call's endpoints (read before any write)
local marks, mk, from_here = nil, importkey(t), false
if ISO_EP then
  marks = {}
  from_here = redis.call('HGET', mk, 's') == src
  if from_here then
    local names, seen = {}, {}
    for i = 6, #ARGV, 6 do
      local ep = ARGV[i + 5]
      if not seen[ep] then
        seen[ep] = true
        names[#names + 1] = 'e:' .. ep
      end
    end
    if #names > 0 then
      local got = redis.call('HMGET', mk, unpack(names))
      for k, f in ipairs(names) do marks[string.sub(f, 3)] = num(got[k], -1) end
    end
  end
end
local touched = {}
for i = 6, #ARGV, 6 do
  local id, sseq = ARGV[i], tonumber(ARGV[i + 1])
  local mark = last
  if marks then mark = marks[ARGV[i + 5]] or -1 end
  if sseq == nil then
    dead = dead + 1
    dead_letter(t, id, num(ARGV[i + 2], 0), MISSING, now, '', ARGV[i + 5])
  elseif sseq > mark then
    if sseq > top then top = sseq end
    if marks then
      marks[ARGV[i + 5]] = sseq
      touched[ARGV[i + 5]] = true
    end
    local seq = redis.call('INCR', P .. ':seq')
    redis.call('HSET', ekey(t, id), 't', t, 's', seq, 'a', ARGV[i + 2], 'p', ARGV[i + 3], 'n', ARGV[i + 4],
      'ep', ARGV[i + 5])
    ids[#ids + 1] = id
    eps[#ids] = ARGV[i + 5]
    n = n + 1
  end
end
lane_append(t, ids, eps)
if marks and next(touched) then
  if not from_here then redis.call('DEL', mk) end
  local set = { 's', src }
  for ep, _ in pairs(touched) do
    set[#set + 1] = 'e:' .. ep
    set[#set + 1] = marks[ep]
  end
  redis.call('HSET', mk, unpack(set))
end
if n > 0 or dead > 0 then
  redis.call('HSET', tk, 'isrc', src, 'isq', top, 'n', num(st[3], 0) + n, 'ko', num(st[4], 0) + dead, 'la', now)
  redis.call('SADD', P .. ':tenants', t)
  if tier ~= '' and not st[5] then redis.call('HSET', tk, 'tr', tier) end
end
local up = st[7] or '0'
if upv > num(st[6], 0) then
  up = (upaused == '1') and '1' or '0'
  redis.call('HSET', tk, 'up', up, 'upv', upv)
end
-- listed where it lives (a queue it comes back to may hold its pause already)
redis.call(up == '1' and 'SADD' or 'SREM', P .. ':paused', t)
activate(t)
return n
