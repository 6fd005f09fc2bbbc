//! The `spec.tenants` part of a spec's Redis writes: per-tenant overrides
//! a platform team keeps in Git. Weights, in-flight caps and rate limits go
//! into the queue policies (`QueuePolicy::from_spec`, written before this
//! step); this step writes the tiers into the set's spec tier hash and holds
//! the `paused: true` tenants paused.
//!
//! A pause is level-triggered: a tenant the spec holds paused and that is
//! not paused (a hand resume, Redis restarted empty) is paused again, with
//! a note (the controller's Event). A resume is edge-triggered and only for
//! pauses the spec made: the set's record in Redis (`Store::paused_by_spec`)
//! names each tenant this step paused, and a tenant in it that leaves the
//! list (`paused` removed or false) is resumed once and forgotten. A tenant
//! already paused by someone else when the spec asks is not recorded, so
//! the spec never lifts a pause it did not make. The record lives with the
//! pauses, not in status, so a stale read of status or a failed status
//! write cannot lose it (and `lanekeeper dataplane apply`, which has no
//! status, keeps the same record). Pauses and resumes are audited as
//! `shardset:<ns>/<name>`.

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use tracing::warn;

use super::Note;
use crate::crd::{conditions, ShardSet, TenantOverridesStatus};
use crate::routing::RoutingTable;
use crate::store::Store;

/// Pure: what the spec asks for, as (tiers, tenants held paused), and the
/// tenants to resume: those the spec paused (`recorded`) that it no longer
/// holds paused.
pub(crate) fn plan(
    set: &ShardSet,
    recorded: &[String],
) -> (BTreeMap<String, String>, BTreeSet<String>, BTreeSet<String>) {
    let tiers = set
        .spec
        .tenants
        .iter()
        .filter_map(|o| Some((o.tenant.clone(), o.tier.clone()?)))
        .collect();
    let paused: BTreeSet<String> = set
        .spec
        .tenants
        .iter()
        .filter(|o| o.paused == Some(true))
        .map(|o| o.tenant.clone())
        .collect();
    let resume = recorded
        .iter()
        .filter(|t| !paused.contains(*t))
        .cloned()
        .collect();
    (tiers, paused, resume)
}

/// Apply the overrides Redis does not hold through the queue policies.
/// `table`: the routing table as written (where each tenant lives, so only
/// the queues of the tenants the spec holds paused are read). Never fails:
/// what fails is said in the status (`message`) and a Warning note, and is
/// tried again at the next apply. Returns what status shows and the notes.
pub(super) async fn sync_overrides(
    set: &ShardSet,
    store: &Store,
    table: &RoutingTable,
) -> (Option<TenantOverridesStatus>, Vec<Note>) {
    let mut notes = Vec::new();
    let prev = set
        .status
        .as_ref()
        .and_then(|s| s.tenant_overrides.as_ref());
    let recorded = match store.paused_by_spec().await {
        Ok(r) => r,
        Err(e) => {
            warn!(set = %set.name_any(), error = %e, "cannot read the spec's pauses; retrying");
            return (prev.cloned(), notes);
        }
    };
    if set.spec.tenants.is_empty() && recorded.is_empty() {
        // nothing asked and nothing to undo; drop the tiers an earlier spec
        // set (only when status says there was one, or there is no status
        // to say: a first reconcile, or `dataplane apply`; no write per
        // reconcile)
        if prev.is_some() || set.status.is_none() {
            if let Err(e) = store.put_spec_tiers(&BTreeMap::new()).await {
                warn!(set = %set.name_any(), error = %e, "cannot clear the spec's tier assignments; retrying");
                return (prev.cloned(), notes);
            }
        }
        return (None, notes);
    }
    let (tiers, paused, resume) = plan(set, &recorded);
    let mut failed: Vec<String> = Vec::new();
    if let Err(e) = store.put_spec_tiers(&tiers).await {
        failed.push(format!("tiers: {}", e.kind()));
    }
    let who = format!(
        "shardset:{}/{}",
        set.namespace().unwrap_or_default(),
        set.name_any()
    );
    // Paused now: read in the queues the held tenants live in, only.
    let mut now_paused: BTreeSet<String> = BTreeSet::new();
    let queues: BTreeSet<_> = paused.iter().map(|t| table.route(t)).collect();
    for q in queues {
        match store.user_paused(q).await {
            Ok(ts) => now_paused.extend(ts),
            Err(e) => failed.push(format!("read the pauses of {q}: {}", e.kind())),
        }
    }
    for t in paused.iter().filter(|t| !now_paused.contains(*t)) {
        match store
            .user_pause_audited(t, true, &who, Some("spec.tenants[].paused"))
            .await
        {
            Ok(o) if o.changed => {
                // recorded first in the audit, then here: a pause the spec
                // made and did not record would stay until a hand resume
                if let Err(e) = store.mark_paused_by_spec(t, true).await {
                    failed.push(format!("record the pause of {t}: {}", e.kind()));
                }
                notes.push(Note::normal(
                    conditions::PAUSED_BY_SPEC,
                    "PauseTenant",
                    format!("paused tenant {t} in {} (spec.tenants[].paused)", o.queue),
                ));
            }
            Ok(_) => {}
            Err(e) => failed.push(format!("pause {t}: {}", e.kind())),
        }
    }
    for t in &resume {
        match store
            .user_pause_audited(t, false, &who, Some("removed from spec.tenants[].paused"))
            .await
        {
            Ok(o) => {
                if let Err(e) = store.mark_paused_by_spec(t, false).await {
                    failed.push(format!("forget the pause of {t}: {}", e.kind()));
                }
                if o.changed {
                    notes.push(Note::normal(
                        conditions::RESUMED_BY_SPEC,
                        "ResumeTenant",
                        format!(
                            "resumed tenant {t} in {} (no longer paused in spec.tenants)",
                            o.queue
                        ),
                    ));
                }
            }
            Err(e) => failed.push(format!("resume {t}: {}", e.kind())),
        }
    }
    let message = (!failed.is_empty()).then(|| {
        let mut m = failed.join("; ");
        let cut = (0..=1000)
            .rev()
            .find(|&i| m.is_char_boundary(i))
            .unwrap_or(0);
        m.truncate(cut);
        m
    });
    if let Some(m) = &message {
        warn!(set = %set.name_any(), "spec.tenants: {m}");
        if prev.and_then(|p| p.message.as_ref()) != Some(m) {
            notes.push(Note::warning(
                conditions::TENANT_OVERRIDE_FAILED,
                "ApplyOverrides",
                m.clone(),
            ));
        }
    }
    // what the spec holds paused now, as the record says (at most the
    // list's 1000)
    let held = store
        .paused_by_spec()
        .await
        .unwrap_or_else(|_| paused.iter().cloned().collect());
    let status = TenantOverridesStatus {
        tenants: set.spec.tenants.len() as i32,
        paused: held.into_iter().take(1000).collect(),
        message,
    };
    (Some(status), notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ShardSetSpec, TenantOverride};

    fn set(tenants: Vec<TenantOverride>) -> ShardSet {
        let mut spec: ShardSetSpec = serde_json::from_value(serde_json::json!({
            "shards": 1,
            "redis": {"url": "redis://r:6379"},
            "worker": {"image": "w:1"},
        }))
        .unwrap();
        spec.tenants = tenants;
        ShardSet::new("hooks", spec)
    }

    #[test]
    fn the_plan_holds_the_paused_and_resumes_only_what_the_spec_paused() {
        let o = |t: &str, tier: Option<&str>, paused: Option<bool>| TenantOverride {
            tenant: t.into(),
            tier: tier.map(Into::into),
            paused,
            ..Default::default()
        };
        let s = set(vec![
            o("vip", Some("gold"), None),
            o("whale", None, Some(true)),
            o("was", None, Some(false)),
        ]);
        let recorded = vec!["was".to_string(), "whale".to_string(), "gone".to_string()];
        let (tiers, paused, resume) = plan(&s, &recorded);
        assert_eq!(tiers, BTreeMap::from([("vip".into(), "gold".into())]));
        assert_eq!(paused, BTreeSet::from(["whale".to_string()]));
        assert_eq!(
            resume,
            BTreeSet::from(["gone".to_string(), "was".to_string()])
        );
        // nothing recorded: nothing to resume (a pause by hand is never undone)
        assert!(plan(&s, &[]).2.is_empty());
    }
}
