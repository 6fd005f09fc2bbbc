-- Helpers (common.lua): count_arg, lease_args, now_ms, forget_bodies, attribute_gather, attribute_flush
-- Helpers (deliver.lua): leases_flush, lease_next, ack_batch
-- ARGV: lease_ms, token, budget, k, n, then n pairs (lease, elapsed_us):
-- acks the n deliveries, then leases up to k envelopes, each by its own turn
-- of deficit round robin, in one round trip (a worker with k free slots).
-- The tenants served are those k lease calls in a row would serve (while
-- the scan budget, shared by the batch, lasts: past it the batch answers
-- AGAIN, as a single lease whose scan ran out does), and the state left is
-- theirs; what a batch saves is the per-call work: each acked tenant's
-- state is read and written once (ack_batch), and a tenant that would stay
-- at the ring's head lease after lease is served its run in one step
-- (lease_next). Each lease's token is `token` followed by '.' and its
-- place in the batch. An ack carries its lease alone: the lease names its
-- envelope and tenant (see lease_member), and only a lease that is held
-- is acked.
-- Returns one flat array, as few items as it can (Redis converts each):
-- n; the acks' statuses, one letter each ('O' acked, 'S' stale, as ack.lua
-- answers 'OK' and 'STALE'); false, or when an ack changed a breaker the n
-- changes; m; the leases' deadline (ms, the same for all); then three items
-- per envelope leased: its lease (which names its id and tenant), its
-- payload (for an envelope stored whole, its lane item, which holds the
-- rest: see lane_item), and false for an envelope stored whole whose lease
-- changed no breaker, else {attempts, seq, enqueued ms, breaker change}
-- (those of an envelope stored whole false); then the answer that stopped
-- the batch short of k ('EMPTY', wait_ms or 'AGAIN'), nothing when k were
-- leased.
local lease_ms, token = lease_args(ARGV[1], ARGV[2])
local budget = count_arg(ARGV[3])
local k, n = tonumber(ARGV[4]), tonumber(ARGV[5])
-- every check before the first write: a batch is at most 64 each way
if not (lease_ms and token and budget and k and n) or k < 0 or k > 64 or k % 1 ~= 0 or n < 0 or n > 64
    or n % 1 ~= 0 or #ARGV ~= 5 + 2 * n then
  return redis.error_reply('lease_batch: lease_ms must be a number from 0 to 2^40, budget a finite number from 0 '
    .. 'up, the token hold no newline, k and n be whole numbers from 0 to 64, with 2 arguments per ack')
end
local members, elapsed = {}, {}
for i = 1, n do
  members[i] = ARGV[4 + 2 * i]
  elapsed[i] = count_arg(ARGV[5 + 2 * i])
  if not elapsed[i] then
    return redis.error_reply('lease_batch: ack ' .. i .. ': elapsed_us must be a finite number from 0 up')
  end
end
local now = now_ms()
attribute_gather()
local codes, changes, dels = {}, {}, {}
local changed = ack_batch(members, elapsed, now, codes, changes, dels)
forget_bodies(dels)
attribute_flush(now)
local out = { n, table.concat(codes), changed and changes or false, 0, now + lease_ms }
-- the scan budget is the batch's, not each lease's: a batch looks at no
-- more tenants than one lease may, so its time is bounded whatever k
local pending, leased, left = {}, 0, budget
-- lease_next appends each lease's items to `out` itself
local bodies = {}
local batch = { pending = pending, bodies = bodies, token = token, out = out }
while leased < k do
  batch.at, batch.want = leased + 1, k - leased
  local r, steps, m = lease_next(lease_ms, token, left, now, batch)
  left = left - steps
  if not m then
    for _, x in ipairs(r) do out[#out + 1] = x end
    break
  end
  -- a tenant's run comes as several leases
  leased = leased + m
end
out[4] = leased
leases_flush(pending, bodies)
return out
