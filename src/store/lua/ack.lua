-- ARGV: id, token, elapsed_s. Returns 'OK', or 'STALE' when the lease is gone
-- (already acked, or expired and handed to another worker): ack is idempotent.
local id, token, elapsed = ARGV[1], ARGV[2], tonumber(ARGV[3])
local ek = ekey(id)
local m = redis.call('HMGET', ek, 't', 'l', 'c')
if not m[1] or m[2] ~= token then return 'STALE' end
local t = m[1]
local now = now_ms()
redis.call('DEL', ek)
redis.call('ZREM', LEASES, id)
settle(t, tonumber(m[3]) or 0, elapsed, now)
depth_down(t)
redis.call('HINCRBY', P .. ':delivered', t, 1)
release(t)
return 'OK'
