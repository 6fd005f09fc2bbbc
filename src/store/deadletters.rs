//! Dead letters: listing a tenant's by pages, the count retention dropped,
//! and replaying them.

use super::library::Func;
use super::reply::replay_dead_reply;
use super::{keys, DeadLetter, DeadLetterPage, ReplayPage, Result, Store, StoreError};
use crate::routing::QueueId;

/// A tenant's dead letters in a queue are listed and replayed by pages of at
/// most this many: one call's work is bounded whatever their number.
pub const DEAD_LETTER_PAGE: usize = 1000;
/// The page a whole replay walks by: a few milliseconds of Redis work per
/// call (each letter is a record written and a lane entry), so queues that
/// share the Redis never wait long behind it.
pub const REPLAY_PAGE: usize = 250;

impl Store {
    /// One page of `tenant`'s dead letters in `q`, oldest first, after the
    /// cursor `after` (`None`: from the oldest): at most `limit` (at most
    /// [`DEAD_LETTER_PAGE`]), read in O(limit) whatever the tenant or the
    /// queue holds.
    pub async fn dead_letters(
        &self,
        q: QueueId,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<DeadLetterPage> {
        let limit = limit.clamp(1, DEAD_LETTER_PAGE);
        let from = match after {
            Some(c) => {
                check_stream_cursor(c)?;
                format!("({c}")
            }
            None => "-".to_string(),
        };
        let mut conn = self.conn.clone();
        let raw: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(keys::dead_letters(&self.queue_prefix(q), tenant))
            .arg(from)
            .arg("+")
            .arg("COUNT")
            .arg(limit)
            .query_async(&mut conn)
            .await?;
        let full = raw.len() == limit;
        let letters: Vec<DeadLetter> = raw
            .into_iter()
            .map(|(cursor, fields)| {
                let mut d = DeadLetter {
                    id: String::new(),
                    tenant: tenant.to_string(),
                    attempts: 0,
                    cause: String::new(),
                    at: 0,
                    envelope: String::new(),
                    cursor,
                };
                for (k, v) in fields {
                    let v = String::from_utf8_lossy(&v).into_owned();
                    match k.as_str() {
                        "id" => d.id = v,
                        "a" => d.attempts = v.parse().unwrap_or(0),
                        "c" => d.cause = v,
                        "at" => d.at = v.parse::<f64>().map(|x| x as u64).unwrap_or(0),
                        "p" => d.envelope = v,
                        _ => {}
                    }
                }
                d
            })
            .collect();
        let next = if full {
            letters.last().map(|d| d.cursor.clone())
        } else {
            None
        };
        Ok(DeadLetterPage { letters, next })
    }

    /// How many dead letters `q`'s retention bound has dropped, all tenants.
    pub async fn dead_letters_dropped(&self, q: QueueId) -> Result<u64> {
        let mut conn = self.conn.clone();
        let n: Option<u64> = redis::cmd("GET")
            .arg(keys::dead_letters_dropped(&self.queue_prefix(q)))
            .query_async(&mut conn)
            .await?;
        Ok(n.unwrap_or(0))
    }

    /// Replay one page of `tenant`'s dead letters in `q` (all of them, or
    /// those with the given ids), starting after `after` (`None`: the
    /// oldest). Each is put back on the tail of its lane in order as a new
    /// delivery. One call examines at most `page` letters (at most
    /// [`DEAD_LETTER_PAGE`]), so it is bounded however many the tenant has.
    /// `Err(queue)` when the tenant has moved away from `q` (nothing changed).
    pub async fn replay_dead_page(
        &self,
        q: QueueId,
        tenant: &str,
        after: Option<&str>,
        page: usize,
        ids: &[String],
    ) -> Result<std::result::Result<ReplayPage, QueueId>> {
        self.replay_dead_page_filtered(q, tenant, after, page, ids, &ReplayFilter::default())
            .await
    }

    /// [`Store::replay_dead_page`] of only the letters `filter` takes: dead
    /// since and until a time, to one endpoint. The page still examines at
    /// most `page` letters, those of the time range only.
    pub async fn replay_dead_page_filtered(
        &self,
        q: QueueId,
        tenant: &str,
        after: Option<&str>,
        page: usize,
        ids: &[String],
        filter: &ReplayFilter,
    ) -> Result<std::result::Result<ReplayPage, QueueId>> {
        let page = page.clamp(1, DEAD_LETTER_PAGE).to_string();
        let cursor = after.unwrap_or("-");
        check_stream_cursor(cursor)?;
        let ms = |x: Option<u64>| x.map(|v| v.min(MAX_MS).to_string()).unwrap_or_default();
        let (since, until) = (ms(filter.since_ms), ms(filter.until_ms));
        let endpoint = filter.endpoint.as_deref().unwrap_or("");
        let mut args: Vec<&[u8]> = vec![
            tenant.as_bytes(),
            cursor.as_bytes(),
            page.as_bytes(),
            since.as_bytes(),
            until.as_bytes(),
            endpoint.as_bytes(),
        ];
        args.extend(ids.iter().map(|id| id.as_bytes()));
        replay_dead_reply(self.run(Func::ReplayDead, q, &args).await?)
    }

    /// Replay all of `tenant`'s dead letters in `q` (or those with the given
    /// ids), oldest first, in bounded steps ([`Store::replay_dead_page`]).
    /// Returns how many, or `Err(queue)` when the tenant has moved away.
    pub async fn replay_dead(
        &self,
        q: QueueId,
        tenant: &str,
        ids: &[String],
    ) -> Result<std::result::Result<u64, QueueId>> {
        let mut total = 0;
        let mut after: Option<String> = None;
        loop {
            let page = match self
                .replay_dead_page(q, tenant, after.as_deref(), REPLAY_PAGE, ids)
                .await?
            {
                Ok(p) => p,
                Err(moved) if total == 0 => return Ok(Err(moved)),
                Err(_) => return Ok(Ok(total)),
            };
            total += page.replayed;
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(Ok(total)),
            }
        }
    }
}

/// The largest time a filter may name, ms (2^53 - 1: what a Lua number holds exactly).
const MAX_MS: u64 = (1 << 53) - 1;

/// Which dead letters a replay takes, besides by id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayFilter {
    /// Dead-lettered at or after this time (ms since the epoch).
    pub since_ms: Option<u64>,
    /// Dead-lettered at or before this time (ms since the epoch).
    pub until_ms: Option<u64>,
    /// To this endpoint only.
    pub endpoint: Option<String>,
}

/// One stream entry as XRANGE returns it: its id and its field-value pairs.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// A dead-letter cursor is a stream id, `<ms>-<seq>`: anything else is
/// refused before it reaches a script.
fn check_stream_cursor(c: &str) -> Result<()> {
    let ok = c == "-"
        || c.split_once('-').is_some_and(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && a.len() <= 20
                && b.len() <= 20
                && a.bytes().all(|x| x.is_ascii_digit())
                && b.bytes().all(|x| x.is_ascii_digit())
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidCursor)
    }
}
