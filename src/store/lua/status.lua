-- Helpers (common.lua): tkey, hold, queued_of
-- ARGV: tenant. Returns {queued, in_flight, delayed, held, paused, moved_to, depth,
-- user_paused}.
local t = ARGV[1]
local st = redis.call('HMGET', tkey(t), 'f', 'w', 'p', 'm', 'n', 'up')
return { queued_of(t), tonumber(st[1]) or 0, tonumber(st[2]) or 0,
  redis.call('LLEN', hold(t)), st[3] == '1' and 1 or 0, st[4] or '',
  tonumber(st[5]) or 0, st[6] == '1' and 1 or 0 }
