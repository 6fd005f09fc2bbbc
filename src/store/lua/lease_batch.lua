-- Helpers (common.lua): now_ms, end_leases, attribute_gather, attribute_flush
-- Helpers (deliver.lua): leases_flush, lease_next, ack_one
-- ARGV: lease_ms, token, budget, k, n, then n triples (id, lease, elapsed_us):
-- acks the n deliveries, then leases up to k envelopes, each by its own turn
-- of deficit round robin, in one round trip (a worker with k free slots).
-- The tenants served are those k lease calls in a row would serve (while
-- the scan budget, shared by the batch, lasts: past it the batch answers
-- AGAIN, as a single lease whose scan ran out does). Each
-- lease's token is `token` followed by '.' and its place in the batch.
-- Returns one flat array: n, then the n {status, change} pairs as in
-- ack.lua; m, then the m LEASED replies (see lease_next, 10 items each) of
-- the envelopes leased; then the answer that stopped the batch short of k
-- ('EMPTY', wait_ms or 'AGAIN'), nothing when k were leased.
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
-- one flat reply (a table per lease costs Redis a dozen lookups to convert)
local out, dels = { n }, {}
for i = 1, n do
  local status, change = ack_one(ids[i], members[i], elapsed[i], now, dels, held[i] or false)
  out[2 * i] = status
  out[2 * i + 1] = change
end
if #dels > 0 then redis.call('DEL', unpack(dels)) end
attribute_flush(now)
local count_at = #out + 1
out[count_at] = 0
-- the scan budget is the batch's, not each lease's: a batch looks at no
-- more tenants than one lease may, so its time is bounded whatever k
local pending, leased, left = {}, 0, budget
for i = 1, k do
  local r, steps = lease_next(lease_ms, token .. '.' .. i, left, now, pending)
  left = left - steps
  if r[1] ~= 'LEASED' then
    for _, x in ipairs(r) do out[#out + 1] = x end
    break
  end
  leased = leased + 1
  for j = 1, 10 do out[#out + 1] = r[j] end
end
out[count_at] = leased
leases_flush(pending)
return out
