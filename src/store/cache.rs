//! What a process read from the store, reused for a short time: the one
//! cache shape the worker (an endpoint by tenant and name) and ingest (a
//! tenant's endpoints) both use. Bounded: past `capacity` entries the
//! expired ones go, then the oldest, so a flood of tenants costs a bounded
//! amount of memory.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Values by key, each reused for `ttl` after it was read.
pub struct TtlCache<K, V> {
    ttl: Duration,
    capacity: usize,
    entries: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: Hash + Eq + Clone, V: Clone> TtlCache<K, V> {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl,
            capacity: capacity.max(1),
            entries: Mutex::default(),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<K, (Instant, V)>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The value of `key`, while it is younger than the TTL.
    pub fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries();
        let (at, v) = entries.get(key)?;
        (at.elapsed() < self.ttl).then(|| v.clone())
    }

    /// Remember `value` for `key` from now. A full cache first drops what
    /// expired; if still full, it drops the oldest eighth of its capacity
    /// at once, so a cache full of fresh entries costs one scan per
    /// `capacity / 8` inserts, not one per insert (the worker inserts on
    /// its delivery path).
    pub fn insert(&self, key: K, value: V) {
        let mut entries = self.entries();
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            let ttl = self.ttl;
            entries.retain(|_, (at, _)| at.elapsed() < ttl);
            if entries.len() >= self.capacity {
                let n = (self.capacity / 8).max(1);
                let mut by_age: Vec<(Instant, K)> = entries
                    .iter()
                    .map(|(k, (at, _))| (*at, k.clone()))
                    .collect();
                by_age.select_nth_unstable_by_key(n - 1, |(at, _)| *at);
                for (_, k) in by_age.into_iter().take(n) {
                    entries.remove(&k);
                }
            }
        }
        entries.insert(key, (Instant::now(), value));
    }

    /// Forget `key` (after this process changed what it holds).
    pub fn remove(&self, key: &K) {
        self.entries().remove(key);
    }

    /// The cached value of `key`, or `load`'s, which is then remembered.
    pub async fn get_or_load<E>(
        &self,
        key: K,
        load: impl std::future::Future<Output = Result<V, E>>,
    ) -> Result<V, E> {
        if let Some(v) = self.get(&key) {
            return Ok(v);
        }
        let v = load.await?;
        self.insert(key, v.clone());
        Ok(v)
    }

    pub fn len(&self) -> usize {
        self.entries().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_expire_and_the_cache_stays_within_its_capacity() {
        let c = TtlCache::new(Duration::from_millis(50), 3);
        c.insert("a", 1);
        assert_eq!(c.get(&"a"), Some(1));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(c.get(&"a"), None, "expired");
        for (i, k) in ["b", "c", "d", "e", "f"].into_iter().enumerate() {
            c.insert(k, i);
        }
        assert_eq!(c.len(), 3, "bounded");
        assert_eq!(c.get(&"f"), Some(4), "the newest stays");
        assert_eq!(c.get(&"b"), None, "the oldest went");
        c.remove(&"f");
        assert_eq!(c.get(&"f"), None);
    }

    #[test]
    fn a_full_cache_of_fresh_entries_makes_room_for_an_eighth_at_once() {
        let c = TtlCache::new(Duration::from_secs(60), 16);
        for i in 0..16 {
            c.insert(i, i);
            std::thread::sleep(Duration::from_millis(1));
        }
        c.insert(16, 16);
        assert_eq!(c.len(), 15, "the two oldest went, the new one came");
        assert_eq!((c.get(&0), c.get(&1)), (None, None));
        assert_eq!((c.get(&2), c.get(&16)), (Some(2), Some(16)));
        c.insert(17, 17);
        assert_eq!(c.len(), 16, "no scan until full again");
    }

    #[tokio::test]
    async fn a_load_is_remembered_and_a_failed_one_is_not() {
        let c: TtlCache<&str, u32> = TtlCache::new(Duration::from_secs(60), 10);
        assert_eq!(c.get_or_load("a", async { Ok::<_, ()>(7) }).await, Ok(7));
        assert_eq!(c.get_or_load("a", async { Err(()) }).await, Ok(7));
        assert_eq!(
            c.get_or_load("b", async { Err::<u32, _>(()) }).await,
            Err(())
        );
        assert!(c.get(&"b").is_none());
    }
}
