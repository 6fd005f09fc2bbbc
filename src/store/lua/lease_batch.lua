-- Helpers (common.lua): now_ms, end_leases, attribute_gather, attribute_flush
-- Helpers (deliver.lua): leases_flush, lease_next, ack_one
-- ARGV: lease_ms, token, budget, k, n, then n triples (id, lease, elapsed_us):
-- acks the n deliveries, then leases up to k envelopes, each by its own turn
-- of deficit round robin, in one round trip (a worker with k free slots).
-- The tenants served are those k lease calls in a row would serve. Each
-- lease's token is `token` followed by '.' and its place in the batch.
-- Returns {acks, leases, tail}: acks the n {status, change} pairs as in
-- ack.lua, flattened; leases a LEASED reply (see lease_next) per envelope
-- leased; tail the answer that stopped the batch short of k ({'EMPTY',
-- wait_ms} or {'AGAIN'}), or {} when k were leased.
local lease_ms, token, budget = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local k, n = tonumber(ARGV[4]), tonumber(ARGV[5])
-- every check before the first write: a batch is at most 64 each way
if not (lease_ms and budget and k and n) or k < 0 or k > 64 or k % 1 ~= 0 or n < 0 or n > 64
    or n % 1 ~= 0 or #ARGV ~= 5 + 3 * n then
  return redis.error_reply('lease_batch: k and n must be whole numbers from 0 to 64, with 3 arguments per ack')
end
local elapsed = {}
for i = 1, n do
  elapsed[i] = tonumber(ARGV[5 + 3 * i])
  if not elapsed[i] then return redis.error_reply('lease_batch: ack ' .. i .. ': elapsed_us is not a number') end
end
local now = now_ms()
attribute_gather()
local ids, members = {}, {}
for i = 1, n do
  ids[i], members[i] = ARGV[3 + 3 * i], ARGV[4 + 3 * i]
end
local held = end_leases(ids, members)
local acks, dels = {}, {}
for i = 1, n do
  local status, change = ack_one(ids[i], members[i], elapsed[i], now, dels, held[i] == true)
  acks[2 * i - 1] = status
  acks[2 * i] = change
end
if #dels > 0 then redis.call('DEL', unpack(dels)) end
attribute_flush(now)
local leases, tail, pending = {}, {}, {}
for i = 1, k do
  local r = lease_next(lease_ms, token .. '.' .. i, budget, now, pending)
  if r[1] ~= 'LEASED' then
    tail = r
    break
  end
  leases[i] = r
end
leases_flush(pending)
return { acks, leases, tail }
