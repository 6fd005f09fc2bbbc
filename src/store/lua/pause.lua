-- Helpers (common.lua): tkey, hold
-- ARGV: tenant. New envelopes of the tenant go to its hold buffer; a
-- previous "moved" mark in this queue is cleared (the tenant is coming here).
local tk = tkey(ARGV[1])
redis.call('HSET', tk, 'p', 1)
redis.call('HDEL', tk, 'm')
return redis.call('LLEN', hold(ARGV[1]))
