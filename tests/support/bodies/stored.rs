//! Behind the store's back: where a queued or leased envelope's body is
//! kept, for tests that play an eviction or a hand edit. A queued envelope
//! is stored whole as its lane item (or hold buffer item), one leased while
//! stored whole waits in `P:leased`, and any other (a retry, a replay, an
//! import, an older library's) has a record (see `keys::LaneItem`).

use lanekeeper::store::keys::{self, LaneItem};
use redis::aio::ConnectionLike;

async fn query<C: ConnectionLike + Send, T: redis::FromRedisValue>(
    conn: &mut C,
    cmd: &redis::Cmd,
) -> T {
    cmd.query_async(conn).await.unwrap()
}

/// The lists an envelope of `tenant` may wait in: its lane, its hold
/// buffer and its endpoint lanes.
async fn lists<C: ConnectionLike + Send>(conn: &mut C, prefix: &str, tenant: &str) -> Vec<String> {
    let mut out = vec![keys::lane(prefix, tenant), format!("{prefix}:h:{tenant}")];
    let eps: Vec<String> = query(
        conn,
        redis::cmd("SMEMBERS").arg(keys::queued_endpoints(prefix, tenant)),
    )
    .await;
    out.extend(eps.iter().map(|ep| keys::endpoint_lane(prefix, tenant, ep)));
    out
}

/// The fields of `P:leased` (leases, see `P:leases`) that hold envelope
/// `id` of `tenant`.
async fn leased_fields<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
) -> Vec<Vec<u8>> {
    let all: Vec<Vec<u8>> = query(conn, redis::cmd("HKEYS").arg(keys::leased(prefix))).await;
    all.into_iter()
        .filter(|lease| {
            let parts: Vec<&[u8]> = lease.split(|&b| b == b'\n').collect();
            parts.len() >= 5 && parts[2] == id.as_bytes() && parts[3] == tenant.as_bytes()
        })
        .collect()
}

/// Whole item `item` with its payload replaced by `payload` (None when
/// it is not a whole item).
fn with_payload(item: &[u8], payload: &str) -> Option<Vec<u8>> {
    match keys::lane_item(item) {
        LaneItem::Whole { payload: old, .. } => {
            let mut out = item[..item.len() - old.len()].to_vec();
            out.extend_from_slice(payload.as_bytes());
            Some(out)
        }
        LaneItem::Bare(_) => None,
    }
}

/// Where envelope `id` of `tenant` is stored whole: each list, index and
/// item.
async fn whole_items<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
) -> Vec<(String, usize, Vec<u8>)> {
    let mut out = Vec::new();
    for list in lists(conn, prefix, tenant).await {
        let items: Vec<Vec<u8>> = query(conn, redis::cmd("LRANGE").arg(&list).arg(0).arg(-1)).await;
        for (i, item) in items.into_iter().enumerate() {
            if matches!(keys::lane_item(&item), LaneItem::Whole { id: got, .. } if got == id.as_bytes())
            {
                out.push((list.clone(), i, item));
            }
        }
    }
    out
}

/// Envelope `id` of `tenant` loses its body wherever it is kept, as an
/// eviction of its record would: its record and its `P:leased` field are
/// deleted, and a lane item that holds it whole becomes its bare id (an id
/// whose record is gone).
pub async fn lose_body<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
) {
    for (list, i, _) in whole_items(conn, prefix, tenant, id).await {
        let _: () = query(conn, redis::cmd("LSET").arg(&list).arg(i).arg(id)).await;
    }
    for field in leased_fields(conn, prefix, tenant, id).await {
        let _: () = query(
            conn,
            redis::cmd("HDEL").arg(keys::leased(prefix)).arg(field),
        )
        .await;
    }
    let _: () = query(
        conn,
        redis::cmd("DEL").arg(keys::envelope(prefix, tenant, id)),
    )
    .await;
}

/// Store queued envelope `id` of `tenant` as a library before whole items
/// did: its lane item becomes its bare id, and its parts a record.
pub async fn to_record<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
) {
    for (list, i, item) in whole_items(conn, prefix, tenant, id).await {
        if let LaneItem::Whole {
            endpoint,
            seq,
            enqueued_ms,
            payload,
            ..
        } = keys::lane_item(&item)
        {
            let record = redis::cmd("HSET")
                .arg(keys::envelope(prefix, tenant, id))
                .arg("t")
                .arg(tenant)
                .arg("s")
                .arg(seq)
                .arg("p")
                .arg(payload)
                .arg("n")
                .arg(enqueued_ms)
                .arg("ep")
                .arg(endpoint)
                .clone();
            let _: () = query(conn, &record).await;
            let _: () = query(conn, redis::cmd("LSET").arg(&list).arg(i).arg(id)).await;
        }
    }
}

/// Overwrite the stored payload of envelope `id` of `tenant` wherever it is
/// kept (a bug's or a hand edit's payload): its whole items, its
/// `P:leased` field, its record.
pub async fn set_payload<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
    payload: &str,
) {
    for (list, i, item) in whole_items(conn, prefix, tenant, id).await {
        if let Some(new) = with_payload(&item, payload) {
            let _: () = query(conn, redis::cmd("LSET").arg(&list).arg(i).arg(new)).await;
        }
    }
    for field in leased_fields(conn, prefix, tenant, id).await {
        let leased: Option<Vec<u8>> = query(
            conn,
            redis::cmd("HGET").arg(keys::leased(prefix)).arg(&field),
        )
        .await;
        if let Some(new) = leased.and_then(|item| with_payload(&item, payload)) {
            let set = redis::cmd("HSET")
                .arg(keys::leased(prefix))
                .arg(&field)
                .arg(new)
                .clone();
            let _: () = query(conn, &set).await;
        }
    }
    let record = keys::envelope(prefix, tenant, id);
    let exists: bool = query(conn, redis::cmd("EXISTS").arg(&record)).await;
    if exists {
        let _: () = query(conn, redis::cmd("HSET").arg(&record).arg("p").arg(payload)).await;
    }
}

/// Whether anything of envelope `id` of `tenant` is still kept as a body
/// in flight or retried: its record or its `P:leased` field.
pub async fn body_kept<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    tenant: &str,
    id: &str,
) -> bool {
    let record: bool = query(
        conn,
        redis::cmd("EXISTS").arg(keys::envelope(prefix, tenant, id)),
    )
    .await;
    record || !leased_fields(conn, prefix, tenant, id).await.is_empty()
}

/// A connection to `url`: one node's, or the cluster's (every key of a
/// queue shares one slot).
pub enum Conn {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Conn {
    pub async fn open(url: &str) -> Conn {
        match lanekeeper::store::cluster_nodes(url) {
            Some(nodes) => {
                let client = redis::cluster::ClusterClient::new(nodes.unwrap()).unwrap();
                Conn::Cluster(client.get_async_connection().await.unwrap())
            }
            None => Conn::Single(
                redis::Client::open(url)
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            ),
        }
    }

    pub async fn lose_body(&mut self, prefix: &str, tenant: &str, id: &str) {
        match self {
            Conn::Single(c) => lose_body(c, prefix, tenant, id).await,
            Conn::Cluster(c) => lose_body(c, prefix, tenant, id).await,
        }
    }

    pub async fn store_as_record(&mut self, prefix: &str, tenant: &str, id: &str) {
        match self {
            Conn::Single(c) => to_record(c, prefix, tenant, id).await,
            Conn::Cluster(c) => to_record(c, prefix, tenant, id).await,
        }
    }

    pub async fn set_payload(&mut self, prefix: &str, tenant: &str, id: &str, payload: &str) {
        match self {
            Conn::Single(c) => set_payload(c, prefix, tenant, id, payload).await,
            Conn::Cluster(c) => set_payload(c, prefix, tenant, id, payload).await,
        }
    }

    pub async fn body_kept(&mut self, prefix: &str, tenant: &str, id: &str) -> bool {
        match self {
            Conn::Single(c) => body_kept(c, prefix, tenant, id).await,
            Conn::Cluster(c) => body_kept(c, prefix, tenant, id).await,
        }
    }
}
