//! The tier ConfigMap step of a ShardSet reconcile
//! (`scheduler.tierAssignments`): read the ConfigMap's metadata, and only
//! when its resourceVersion is not the one synced last read it whole, parse
//! it (the parser the admin API and the CLI use) and make the set's
//! ConfigMap tier hash hold exactly its assignments. All or nothing: a
//! ConfigMap that is missing, not allowed or has a bad line leaves the last
//! good assignments in force, and status and a Warning Event say why, naming
//! the line but quoting none of it (the set's author may not be allowed to
//! read the ConfigMap). Redis losing the hash loses the sync record with it,
//! so the next reconcile writes it again.

use crate::controller::Context;
use crate::crd::conditions;
use crate::crd::ShardSet;
use crate::crd::TierAssignmentsSpec;
use crate::crd::TierAssignmentsStatus;
use crate::policy::tiers::parse_assignments;
use crate::store::Store;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;
use tracing::{info, warn};

/// Most assignments one ConfigMap may hold (a ConfigMap is at most 1 MiB:
/// about 40,000 lines of 25 bytes).
pub const MAX_CONFIG_TIERS: usize = 100_000;

/// Pure: the assignments of the ConfigMap text, or what is wrong with it,
/// quoting nothing of it. A tenant listed twice: the later line wins.
pub(crate) fn assignments(
    spec: &TierAssignmentsSpec,
    text: &str,
) -> Result<BTreeMap<String, String>, String> {
    let (good, bad) = parse_assignments(text, false, MAX_CONFIG_TIERS, |t| {
        crate::envelope::validate_tenant(t).map_err(|e| e.reason)
    });
    if let Some(first) = bad.first() {
        return Err(format!(
            "ConfigMap {:?} key {:?} has {} bad line{} ({}{}); nothing of this version was synced, the last good assignments stay",
            spec.config_map_name,
            spec.key,
            bad.len(),
            if bad.len() == 1 { "" } else { "s" },
            first.redacted(),
            if bad.len() > 1 { ", ..." } else { "" },
        ));
    }
    Ok(good
        .into_iter()
        .filter_map(|(t, tier)| Some((t, tier?)))
        .collect())
}

/// The outcome of one sync, before it is reported.
struct Outcome {
    status: TierAssignmentsStatus,
    /// The Event to send, if this outcome is news.
    event: Option<(EventType, &'static str, String)>,
}

/// Sync the set's tier ConfigMap into Redis. Returns what status shows
/// (none when the spec names no ConfigMap). Never fails the reconcile.
pub(super) async fn sync_tiers(
    set: &ShardSet,
    ctx: &Context,
    store: &Store,
) -> Option<TierAssignmentsStatus> {
    let prev = set.status.as_ref().and_then(|s| s.tier_assignments.clone());
    let Some(spec) = &set.spec.scheduler.tier_assignments else {
        match store.clear_config_tiers().await {
            Ok(true) => {
                info!(set = %set.name_any(), "no tierAssignments: dropped the ConfigMap's tier assignments")
            }
            Ok(false) => {}
            Err(e) => {
                warn!(set = %set.name_any(), error = %e, "cannot drop the ConfigMap's tier assignments; retrying")
            }
        }
        return None;
    };
    let out = match sync(set, ctx, store, spec).await {
        Ok(out) => out,
        Err(e) => {
            // Redis trouble: the set's Redis status says so; keep what was shown.
            warn!(set = %set.name_any(), error = %e, "cannot sync the tier ConfigMap; retrying");
            return prev;
        }
    };
    let news = prev.as_ref().map(|p| (&p.synced, &p.message))
        != Some((&out.status.synced, &out.status.message));
    if let (true, Some((kind, reason, note))) = (news, out.event) {
        if kind == EventType::Warning {
            warn!(set = %set.name_any(), reason, "{note}");
        }
        ctx.event(&set.object_ref(&()), kind, reason, "SyncTiers", note)
            .await;
    }
    Some(out.status)
}

async fn sync(
    set: &ShardSet,
    ctx: &Context,
    store: &Store,
    spec: &TierAssignmentsSpec,
) -> Result<Outcome, crate::store::StoreError> {
    let name = &spec.config_map_name;
    let (synced, tenants) = store.config_tiers_state().await?;
    let mut status = TierAssignmentsStatus {
        config_map: name.clone(),
        synced: synced.clone(),
        tenants: tenants as i64,
        message: None,
    };
    let problem = |mut status: TierAssignmentsStatus, reason, message: String| {
        status.message = Some(message.clone());
        Ok(Outcome {
            status,
            event: Some((EventType::Warning, reason, message)),
        })
    };
    let api: Api<ConfigMap> =
        Api::namespaced(ctx.client.clone(), &set.namespace().unwrap_or_default());
    let cm = match api.get_metadata(name).await {
        Ok(meta) => {
            let source = format!("{name}/{}", meta.resource_version().unwrap_or_default());
            if synced.as_deref() == Some(source.as_str()) {
                return Ok(Outcome {
                    status,
                    event: None,
                });
            }
            api.get(name).await
        }
        Err(e) => Err(e),
    };
    let cm = match cm {
        Ok(cm) => cm,
        Err(kube::Error::Api(e)) if e.code == 403 => {
            return problem(
                status,
                conditions::TIER_CONFIG_MAP_NOT_ALLOWED,
                format!("the controller may not read ConfigMap {name:?}: it reads only the names the operator allows (chart value controller.tierConfigMapNames); the last good assignments stay"),
            )
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {
            return problem(
                status,
                conditions::TIER_CONFIG_MAP_NOT_FOUND,
                format!("ConfigMap {name:?} (scheduler.tierAssignments.configMapName) was not found in the set's namespace; the last good assignments stay"),
            )
        }
        Err(e) => {
            status.message = Some(format!("cannot read ConfigMap {name:?}: {e}"));
            return Ok(Outcome {
                status,
                event: None,
            });
        }
    };
    let source = format!("{name}/{}", cm.resource_version().unwrap_or_default());
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(&spec.key)) else {
        return problem(
            status,
            conditions::INVALID_TIER_ASSIGNMENTS,
            format!(
                "ConfigMap {name:?} has no key {:?} (scheduler.tierAssignments.key); the last good assignments stay",
                spec.key
            ),
        );
    };
    let want = match assignments(spec, text) {
        Ok(want) => want,
        Err(message) => return problem(status, conditions::INVALID_TIER_ASSIGNMENTS, message),
    };
    let done = store.sync_config_tiers(&source, &want).await?;
    status.synced = Some(source.clone());
    status.tenants = want.len() as i64;
    let note = format!(
        "synced {} tier assignments from ConfigMap {source}: {} written, {} removed",
        want.len(),
        done.set,
        done.removed
    );
    info!(set = %set.name_any(), "{note}");
    Ok(Outcome {
        status,
        event: Some((EventType::Normal, conditions::TIER_ASSIGNMENTS_SYNCED, note)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TierAssignmentsSpec {
        TierAssignmentsSpec {
            config_map_name: "lanekeeper-tiers".into(),
            key: "tiers".into(),
        }
    }

    #[test]
    fn a_good_text_gives_the_last_word_on_each_tenant() {
        let got = assignments(&spec(), "# tiers\nacme gold\nbeta silver\nacme bronze\n").unwrap();
        assert_eq!(
            got,
            BTreeMap::from([
                ("acme".to_string(), "bronze".to_string()),
                ("beta".to_string(), "silver".to_string()),
            ])
        );
    }

    #[test]
    fn a_bad_line_names_the_line_and_quotes_none_of_the_text() {
        let text = "acme gold\nhidden-customer gold extra\nok -\nsecret\u{202e} gold\n";
        let err = assignments(&spec(), text).unwrap_err();
        assert!(err.contains("3 bad lines"), "{err}");
        assert!(err.contains("line 2: expected `<tenant> <tier>`"), "{err}");
        assert!(err.contains("\"lanekeeper-tiers\" key \"tiers\""), "{err}");
        for hidden in ["hidden", "secret", "acme"] {
            assert!(!err.contains(hidden), "{err}");
        }
        // '-' does not clear here: the ConfigMap is the whole list
        assert!(assignments(&spec(), "ok -\n").is_err());
    }

    #[test]
    fn past_the_bound_is_refused_whole() {
        let text: String = (0..=MAX_CONFIG_TIERS)
            .map(|i| format!("t{i} gold\n"))
            .collect();
        let err = assignments(&spec(), &text).unwrap_err();
        assert!(
            err.contains(&format!("line {}", MAX_CONFIG_TIERS + 1)),
            "{err}"
        );
    }
}
