//! The scripted floor: what Redis spends on a delivery, and on an enqueue,
//! when one Lua script call does only the commands the store's layout
//! needs of it, with none of the rest (no deficit round robin, no tenant
//! state, no caps, no attribution, no maintenance). Its keys are the
//! store's shapes: each envelope stored whole in its lane, the leases in a
//! sorted set with a member that names the envelope and its token, the
//! bodies of leased envelopes in one hash named by lease, the ids claimed
//! per tenant in a set.
//!
//! A fair delivery cannot cost less than this on this layout, so the
//! floor measured in the same run says how far a bar stated against the
//! raw pair can be met at all, and the fair phase over the floor says
//! what the scheduler adds. The fair floor ([`FAIR_LEASE_ACK`]) adds the
//! least deficit round robin to it: what any fair scheduler on this layout
//! costs, so the store's phase over it says what the store's own checks
//! and features add. Bench-only: nothing here is how the store works.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lanekeeper::envelope::Envelope;

use super::{measure, raw_connections, Rate};

/// Acks `n` deliveries and leases up to `k` envelopes. KEYS: the prefix.
/// ARGV: lease_ms, token, k, n, then n pairs (id, lease member). Each
/// envelope is stored whole in the lane, `id\nseq\nenqueued_ms\nendpoint\npayload`
/// (the payload last, so it may hold anything). Per ack: whether its lease
/// is held (ZMSCORE), its removal (ZREM) and its body's (HDEL), in one
/// command each for the call; per lease: the entry (one LPOP for the
/// call), its lease (one ZADD for the call) and its body kept in the hash
/// of leased bodies (P:lb, member -> entry: one HSET for the call).
/// Returns n statuses, then (id, entry, member) per lease.
const LEASE_ACK: &str = r#"
local P = KEYS[1]
local k, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
if n > 0 then
  local members = {}
  for i = 1, n do members[i] = ARGV[4 + 2 * i] end
  local held = redis.call('ZMSCORE', P .. ':leases', unpack(members))
  redis.call('ZREM', P .. ':leases', unpack(members))
  redis.call('HDEL', P .. ':lb', unpack(members))
  for i = 1, n do out[i] = held[i] and 'OK' or 'STALE' end
end
if k > 0 then
  local entries = redis.call('LPOP', P .. ':lane', k)
  if entries then
    local z, b, deadline = {}, {}, string.format('%d', now + tonumber(ARGV[1]))
    for j, e in ipairs(entries) do
      local id = string.sub(e, 1, string.find(e, '\n', 1, true) - 1)
      local m = id .. '\n' .. ARGV[2] .. '.' .. j
      z[2 * j - 1] = deadline
      z[2 * j] = m
      b[2 * j - 1] = m
      b[2 * j] = e
      out[#out + 1] = id
      out[#out + 1] = e
      out[#out + 1] = m
    end
    redis.call('ZADD', P .. ':leases', unpack(z))
    redis.call('HSET', P .. ':lb', unpack(b))
  end
end
return out
"#;

/// Stores a call's envelopes (at most 200). KEYS: the prefix. ARGV: id,
/// tenant, endpoint, payload per envelope, each tenant's side by side. One
/// sequence block and one clock read per call; per tenant: which ids are
/// claimed (SMISMEMBER), the claim (SADD) and the lane push (RPUSH), which
/// stores its envelopes whole (see [`LEASE_ACK`]). Returns 'OK' or 'DUP'
/// per envelope.
const ENQUEUE: &str = r#"
local P = KEYS[1]
local n = #ARGV / 4
local seq0 = redis.call('INCRBY', P .. ':seq', n) - n
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local out = {}
local i = 1
while i <= n do
  local tenant = ARGV[4 * i - 2]
  local last = i
  while last < n and ARGV[4 * last + 2] == tenant do last = last + 1 end
  local ids = {}
  for j = i, last do ids[#ids + 1] = ARGV[4 * j - 3] end
  local claimed = redis.call('SMISMEMBER', P .. ':ids:' .. tenant, unpack(ids))
  local fresh, entries = {}, {}
  for j = i, last do
    if claimed[j - i + 1] == 1 then
      out[j] = 'DUP'
    else
      local id = ARGV[4 * j - 3]
      entries[#entries + 1] = id .. '\n' .. string.format('%d', seq0 + j) .. '\n' .. now .. '\n'
        .. ARGV[4 * j - 1] .. '\n' .. ARGV[4 * j]
      fresh[#fresh + 1] = id
      out[j] = 'OK'
    end
  end
  if #fresh > 0 then
    redis.call('SADD', P .. ':ids:' .. tenant, unpack(fresh))
    redis.call('RPUSH', P .. ':lane', unpack(entries))
  end
  i = last + 1
end
return out
"#;

/// A prefix of its own per run (ids repeat between runs).
fn prefix() -> String {
    static RUN: AtomicU64 = AtomicU64::new(0);
    format!("bench:floor:{}", RUN.fetch_add(1, Ordering::Relaxed))
}

/// Store `envs` with the floor's enqueue script, `chunk` per call, 1,000
/// per pipeline from 4 producers (what `enqueue_all` does with the store).
async fn enqueue(url: &str, p: &str, envs: &[Envelope]) {
    let script = redis::Script::new(ENQUEUE);
    let mut sorted: Vec<&Envelope> = envs.iter().collect();
    let chunks: Vec<Vec<Vec<String>>> = envs
        .chunks(1000)
        .map(|pipe| {
            sorted.clear();
            sorted.extend(pipe.iter());
            sorted.sort_by(|a, b| a.tenant.cmp(&b.tenant));
            sorted
                .chunks(200)
                .map(|call| {
                    call.iter()
                        .flat_map(|e| {
                            [
                                e.id.clone(),
                                e.tenant.clone(),
                                e.endpoint_name().to_string(),
                                serde_json::to_string(&e.payload).unwrap(),
                            ]
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let chunks = Arc::new(std::sync::Mutex::new(chunks));
    let mut tasks = Vec::new();
    for mut conn in raw_connections(url, 4).await {
        let (chunks, script, p) = (chunks.clone(), script.clone(), p.to_string());
        tasks.push(tokio::spawn(async move {
            // load it once, so the pipeline's EVALSHAs find it
            let _: String = script.prepare_invoke().load_async(&mut conn).await.unwrap();
            loop {
                let next = chunks.lock().unwrap().pop();
                let Some(calls) = next else { break };
                let mut pipe = redis::pipe();
                for args in &calls {
                    pipe.cmd("EVALSHA")
                        .arg(script.get_hash())
                        .arg(1)
                        .arg(&p)
                        .arg(args);
                }
                let replies: Vec<Vec<String>> = pipe.query_async(&mut conn).await.unwrap();
                assert!(replies.iter().flatten().all(|r| r == "OK"));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// The floor's batch enqueue of `envs`, measured; its keys are deleted after.
pub async fn floor_enqueue(url: &str, envs: &[Envelope]) -> Rate {
    let p = prefix();
    let rate = measure(url, envs.len() as u64, enqueue(url, &p, envs)).await;
    drop_prefix(url, &p).await;
    rate
}

/// What both fair floors begin with: the call's arguments and clock, its
/// acks (ZMSCORE, ZREM and HDEL for the call; `order` lists the tenants
/// acked in order of their first ack, `acks[t]` each one's (charge,
/// elapsed us) pairs), and `lease_run`, which leases a run of a tenant's
/// lane items as the store's batch answers them, gathered for one ZADD and
/// one HSET at the end ([`FAIR_FLUSH`]).
const FAIR_ACKS: &str = r#"
local P = KEYS[1]
local lease_ms, token, k, n = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local QUANTUM, CAP, RING = 2000000, 8, P .. ':ring'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local out = {}
local order, acks = {}, {}
if n > 0 then
  local members = {}
  for i = 1, n do members[i] = ARGV[3 + 2 * i] end
  local held = redis.call('ZMSCORE', P .. ':leases', unpack(members))
  redis.call('ZREM', P .. ':leases', unpack(members))
  redis.call('HDEL', P .. ':lb', unpack(members))
  for i = 1, n do
    if held[i] then
      out[i] = 'OK'
      local m = members[i]
      local a = string.find(m, '\n', 1, true)
      local b = string.find(m, '\n', a + 1, true)
      local c = string.find(m, '\n', b + 1, true)
      local t = string.sub(m, c + 1, string.find(m, '\n', c + 1, true) - 1)
      local g = acks[t]
      if not g then
        g = {}
        acks[t] = g
        order[#order + 1] = t
      end
      g[#g + 1] = tonumber(string.sub(m, 1, a - 1))
      g[#g + 1] = tonumber(ARGV[4 + 2 * i])
    else
      out[i] = 'STALE'
    end
  end
end
local pending, bodies, leased = {}, {}, 0
local deadline, at = string.format('%d', now + lease_ms), string.format('%d', now)
local function lease_run(items, charge, t)
  local head, tail = charge .. '\n' .. at .. '\n', '\n' .. t .. '\n' .. token .. '.'
  for j, item in ipairs(items) do
    local m = head .. string.sub(item, 1, string.find(item, '\n', 1, true) - 1) .. tail .. (leased + j)
    pending[#pending + 1] = deadline
    pending[#pending + 1] = m
    bodies[#bodies + 1] = m
    bodies[#bodies + 1] = item
    local o = #out
    out[o + 1] = m
    out[o + 2] = item
    out[o + 3] = false
  end
  leased = leased + #items
end
"#;

/// What both fair floors end with: the call's leases and their bodies.
const FAIR_FLUSH: &str = r#"
if #pending > 0 then
  redis.call('ZADD', P .. ':leases', unpack(pending))
  redis.call('HSET', P .. ':lb', unpack(bodies))
end
return out
"#;

/// The fair floor: [`LEASE_ACK`] plus the least of deficit round robin
/// that the store's layout allows, and nothing else: no pause, breaker,
/// rate limit, endpoint, tier, weight, maintenance, wake-up, scan budget
/// or argument check. The keys are the store's: a ring of tenants, per
/// tenant a lane of envelopes stored whole and a hash of its state (`d`
/// deficit in us, `f` in flight, `e` estimate in us, `k` 1 while parked at
/// its cap), the leases and bodies as in [`LEASE_ACK`], worker-us per
/// tenant in one hash. ARGV: lease_ms, token, k, n, then n pairs (lease
/// member, elapsed us); a member is `charge\nleased ms\nid\ntenant\ntoken.j`,
/// the store's. Per call: the acks' ZMSCORE, ZREM and HDEL; per tenant
/// acked, its state read and written once and its worker-us added
/// (HINCRBY), and back on the ring when an ack frees its cap; per turn at
/// the ring's head, its state read, a run of envelopes popped in one LPOP
/// (while it is in credit and under its cap), whether its lane is empty
/// (LLEN), its state written and its place on the ring moved; then one
/// ZADD of the leases and one HSET of their bodies. Returns n statuses,
/// then (member, entry, false) per lease, as the store's batch does. The
/// script is [`FAIR_ACKS`], this, then [`FAIR_FLUSH`] (see [`fair_script`]).
const FAIR_LEASE_ACK: &str = r#"
for _, t in ipairs(order) do
  local tk = P .. ':t:' .. t
  local st = redis.call('HMGET', tk, 'd', 'f', 'e', 'k')
  local d, f, e = tonumber(st[1]), tonumber(st[2]), tonumber(st[3])
  local g, us = acks[t], 0
  for j = 1, #g, 2 do
    d = d + g[j] - g[j + 1]
    e = math.floor(e + 0.3 * (g[j + 1] - e) + 0.5)
    us = us + g[j + 1]
    f = f - 1
  end
  if st[4] == '1' then
    redis.call('HSET', tk, 'd', d, 'f', f, 'e', e, 'k', '0')
    redis.call('RPUSH', RING, t)
  else
    redis.call('HSET', tk, 'd', d, 'f', f, 'e', e)
  end
  redis.call('HINCRBY', P .. ':attr', t, us)
end
local steps = 0
while leased < k and steps < 100 do
  steps = steps + 1
  local t = redis.call('LINDEX', RING, 0)
  if not t then break end
  local tk = P .. ':t:' .. t
  local st = redis.call('HMGET', tk, 'd', 'f', 'e')
  local d, f, e = tonumber(st[1]), tonumber(st[2]), tonumber(st[3])
  if d <= 0 then
    redis.call('LMOVE', RING, RING, 'LEFT', 'RIGHT')
    redis.call('HSET', tk, 'd', d + QUANTUM)
  else
    local room, run = math.min(CAP - f, k - leased), 1
    while run < room and d - e * run > 0 do run = run + 1 end
    local lane = P .. ':q:' .. t
    local items = redis.call('LPOP', lane, run) or {}
    lease_run(items, st[3], t)
    d, f = d - e * #items, f + #items
    if #items < run or redis.call('LLEN', lane) == 0 then
      redis.call('LPOP', RING)
      redis.call('HSET', tk, 'd', math.min(d, 0), 'f', f, 'r', '0')
    elseif f >= CAP then
      redis.call('LPOP', RING)
      redis.call('HSET', tk, 'd', d, 'f', f, 'k', '1')
    elseif d <= 0 then
      redis.call('LMOVE', RING, RING, 'LEFT', 'RIGHT')
      redis.call('HSET', tk, 'd', d + QUANTUM, 'f', f)
    else
      redis.call('HSET', tk, 'd', d, 'f', f)
    end
  end
end
"#;

/// [`FAIR_LEASE_ACK`] on another layout: every tenant's state in one
/// field of one hash (`d f e k w`, the last its worker-us), so that a call
/// reads the state of the tenants it acks and the first four at the ring's
/// head in one HMGET (a turn past them reads its own with HGET) and writes
/// what changed in one HSET, and the ring's changes as one
/// LTRIM of the turns taken and one RPUSH of the tenants back at its tail.
/// The turns are the same: the tenants at the ring's head (one LRANGE of
/// up to 16; a batch that would look past them stops short), each
/// leasing a run while in credit and under its cap, popped from its lane
/// per turn. Same ARGV, answer and shared parts as [`FAIR_LEASE_ACK`].
const FAIR_SHARED_LEASE_ACK: &str = r#"
local TS = P .. ':ts'
-- the tenants this call may touch: those acked and the first few at the
-- ring's head, read in one HMGET (a turn past them reads its own)
local ring = k > 0 and redis.call('LRANGE', RING, 0, 15) or {}
local names, seen = {}, {}
for _, t in ipairs(order) do
  if not seen[t] then seen[t] = true; names[#names + 1] = t end
end
for i = 1, math.min(#ring, 4) do
  local t = ring[i]
  if not seen[t] then seen[t] = true; names[#names + 1] = t end
end
local state, touched = {}, {}
local function parse(t, v)
  local d, f, e, kk, w = string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
  state[t] = { tonumber(d), tonumber(f), tonumber(e), kk, tonumber(w) }
end
if #names > 0 then
  local v = redis.call('HMGET', TS, unpack(names))
  for i, t in ipairs(names) do parse(t, v[i]) end
end
local function get(t)
  local s = state[t]
  if not s then
    parse(t, redis.call('HGET', TS, t))
    s = state[t]
  end
  touched[t] = true
  return s
end
-- the ring after this call: its first `taken` entries go, `tail` joins it
local tail = {}
for _, t in ipairs(order) do
  local s, g = get(t), acks[t]
  for j = 1, #g, 2 do
    s[1] = s[1] + g[j] - g[j + 1]
    s[3] = math.floor(s[3] + 0.3 * (g[j + 1] - s[3]) + 0.5)
    s[5] = s[5] + g[j + 1]
    s[2] = s[2] - 1
  end
  if s[4] == '1' then
    s[4] = '0'
    tail[#tail + 1] = t
  end
end
local steps = 0
-- the turns: the known ring, then the tenants joining its tail (while the
-- whole ring is known)
local head, known = 1, #ring < 16
while leased < k and steps < 100 do
  steps = steps + 1
  local t
  if head <= #ring then
    t = ring[head]
  elseif known and head - #ring <= #tail then
    t = tail[head - #ring]
  else
    break
  end
  local s = get(t)
  if s[1] <= 0 then
    s[1] = s[1] + QUANTUM
    tail[#tail + 1] = t
    head = head + 1
  else
    local d, f, e = s[1], s[2], s[3]
    local room, run = math.min(CAP - f, k - leased), 1
    while run < room and d - e * run > 0 do run = run + 1 end
    local lane = P .. ':q:' .. t
    local items = redis.call('LPOP', lane, run) or {}
    lease_run(items, e, t)
    d, f = d - e * #items, f + #items
    s[2] = f
    if #items < run or redis.call('LLEN', lane) == 0 then
      s[1] = math.min(d, 0)
      head = head + 1
    elseif f >= CAP then
      s[1], s[4] = d, '1'
      head = head + 1
    elseif d <= 0 then
      s[1] = d + QUANTUM
      tail[#tail + 1] = t
      head = head + 1
    else
      s[1] = d
    end
  end
end
local taken = head - 1
-- turns taken from the tail's own entries leave them there no longer
local moved = {}
for i = math.max(taken - #ring, 0) + 1, #tail do moved[#moved + 1] = tail[i] end
if taken > 0 then redis.call('LTRIM', RING, math.min(taken, #ring), -1) end
if #moved > 0 then redis.call('RPUSH', RING, unpack(moved)) end
local set = {}
for t in pairs(touched) do
  local s = state[t]
  set[#set + 1] = t
  set[#set + 1] = s[1] .. ' ' .. s[2] .. ' ' .. s[3] .. ' ' .. s[4] .. ' ' .. s[5]
end
if #set > 0 then redis.call('HSET', TS, unpack(set)) end
"#;

/// A fair floor's script: [`FAIR_ACKS`], `body`, [`FAIR_FLUSH`].
fn fair_script(body: &str) -> String {
    format!("{FAIR_ACKS}{body}{FAIR_FLUSH}")
}

/// The fair floor's backlog: `envs` stored whole in their tenants' lanes
/// (the layout [`ENQUEUE`] gives, one lane per tenant), each tenant's
/// state fresh (a full quantum, nothing in flight, the estimate the
/// bench's deliveries take) and on the ring in order of first envelope.
async fn fair_backlog(url: &str, p: &str, envs: &[Envelope], shared: bool) {
    let mut conn = raw_connections(url, 1).await.pop().unwrap();
    let mut tenants: Vec<&str> = Vec::new();
    for chunk in envs.chunks(1000) {
        let mut pipe = redis::pipe();
        for (i, e) in chunk.iter().enumerate() {
            if !tenants.contains(&e.tenant.as_str()) {
                tenants.push(&e.tenant);
                let fresh = [("d", "2000000"), ("f", "0"), ("e", "20000"), ("k", "0")];
                if shared {
                    pipe.hset(format!("{p}:ts"), &e.tenant, "2000000 0 20000 0 0")
                        .ignore();
                } else {
                    pipe.hset_multiple(format!("{p}:t:{}", e.tenant), &fresh)
                        .ignore();
                }
                pipe.rpush(format!("{p}:ring"), &e.tenant).ignore();
            }
            let entry = format!(
                "{}\n{i}\n0\n{}\n{}",
                e.id,
                e.endpoint_name(),
                serde_json::to_string(&e.payload).unwrap()
            );
            pipe.rpush(format!("{p}:q:{}", e.tenant), entry).ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
    }
}

/// `ops` floor deliveries by `clients` clients, each acking what it holds
/// and leasing up to `k` more per call, from a backlog of `envs` stored
/// with the floor's enqueue (set up unmeasured).
pub async fn floor_deliveries(
    url: &str,
    envs: &[Envelope],
    clients: usize,
    k: usize,
    ops: u64,
) -> Rate {
    let p = prefix();
    enqueue(url, &p, envs).await;
    // an ack names the id and the lease
    let acked = |l: &[Option<String>]| (l[0].clone().unwrap(), l[2].clone().unwrap());
    deliveries(url, &p, LEASE_ACK, clients, k, ops, acked).await
}

/// `ops` fair-floor deliveries ([`FAIR_LEASE_ACK`]) by `clients` clients,
/// each acking what it holds (20 ms each) and leasing up to `k` more per
/// call, from a backlog of `envs` set up unmeasured.
/// With `shared`, on the layout of [`FAIR_SHARED_LEASE_ACK`].
pub async fn fair_floor_deliveries(
    url: &str,
    envs: &[Envelope],
    clients: usize,
    k: usize,
    ops: u64,
    shared: bool,
) -> Rate {
    let p = prefix();
    fair_backlog(url, &p, envs, shared).await;
    // an ack names the lease and the time its delivery took
    let acked = |l: &[Option<String>]| (l[0].clone().unwrap(), "20000".to_string());
    let script = fair_script(if shared {
        FAIR_SHARED_LEASE_ACK
    } else {
        FAIR_LEASE_ACK
    });
    deliveries(url, &p, &script, clients, k, ops, acked).await
}

/// The measured loop of both floors: `ops` deliveries by `clients`
/// clients of `script` (ARGV lease_ms, token, k, n, then n pairs, which
/// `acked` makes of each lease's three items), then the prefix deleted.
async fn deliveries(
    url: &str,
    p: &str,
    script: &str,
    clients: usize,
    k: usize,
    ops: u64,
    acked: fn(&[Option<String>]) -> (String, String),
) -> Rate {
    let script = redis::Script::new(script);
    let left = Arc::new(AtomicU64::new(ops));
    let conns = raw_connections(url, clients).await;
    let phase = {
        let p = p.to_string();
        async move {
            let mut tasks = Vec::new();
            for (c, mut conn) in conns.into_iter().enumerate() {
                let (left, script, p) = (left.clone(), script.clone(), p.clone());
                tasks.push(tokio::spawn(async move {
                    let token = format!("floor{c}");
                    let mut held: Vec<(String, String)> = Vec::new();
                    loop {
                        let want = left
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                                Some(n - n.min(k as u64))
                            })
                            .map(|n| n.min(k as u64))
                            .unwrap();
                        if want == 0 && held.is_empty() {
                            break;
                        }
                        let mut inv = script.key(&p);
                        inv.arg(60_000).arg(&token).arg(want).arg(held.len());
                        for (a, b) in &held {
                            inv.arg(a).arg(b);
                        }
                        let out: Vec<Option<String>> = inv.invoke_async(&mut conn).await.unwrap();
                        let (acks, leased) = out.split_at(held.len());
                        assert!(acks.iter().all(|a| a.as_deref() == Some("OK")));
                        assert_eq!(leased.len() as u64, 3 * want, "the floor's backlog ran out");
                        held = leased.chunks(3).map(acked).collect();
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    let rate = measure(url, ops, phase).await;
    drop_prefix(url, p).await;
    rate
}

/// Delete every key under `p` (what a run leaves would only grow the
/// keyspace later rounds work in).
async fn drop_prefix(url: &str, p: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{p}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}
