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
//! what the scheduler adds. Bench-only: nothing here is how the store
//! works.

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
    let script = redis::Script::new(LEASE_ACK);
    let left = Arc::new(AtomicU64::new(ops));
    let conns = raw_connections(url, clients).await;
    let phase = {
        let p = p.clone();
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
                        for (id, member) in &held {
                            inv.arg(id).arg(member);
                        }
                        let out: Vec<String> = inv.invoke_async(&mut conn).await.unwrap();
                        let (acks, leased) = out.split_at(held.len());
                        assert!(acks.iter().all(|a| a == "OK"));
                        assert_eq!(leased.len() as u64, 3 * want, "the floor's backlog ran out");
                        held = leased
                            .chunks(3)
                            .map(|l| (l[0].clone(), l[2].clone()))
                            .collect();
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    let rate = measure(url, ops, phase).await;
    drop_prefix(url, &p).await;
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
