//! The tier part of a spec's Redis writes (`scheduler.tierAssignments`):
//! make the set's ConfigMap tier hash hold exactly the assignments of the
//! source the spec names. The source is read through a [`TierSource`]: the
//! controller's reads the ConfigMap (metadata first, and the whole object
//! only when its resourceVersion is not the one synced last), the CLI's is
//! a file given with `--tiers-file`. Either text goes through the one parser
//! ([`assignments`], over `policy::tiers::parse_assignments`). All or
//! nothing: a source that is missing, not allowed or has a bad line leaves
//! the last good assignments in force, and status and a Warning note say
//! why, naming the line but quoting none of it (the set's author may not be
//! allowed to read the ConfigMap). Redis losing the hash loses the sync
//! record with it, so the next apply writes it again.

use super::Note;
use crate::crd::conditions;
use crate::crd::ShardSet;
use crate::crd::TierAssignmentsSpec;
use crate::crd::TierAssignmentsStatus;
use crate::policy::tiers::parse_assignments;
use crate::store::Store;
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::future::Future;
use tracing::{info, warn};

/// Most assignments one ConfigMap may hold (a ConfigMap is at most 1 MiB:
/// about 40,000 lines of 25 bytes).
pub const MAX_CONFIG_TIERS: usize = 100_000;

/// Pure: the assignments of the ConfigMap text, or what is wrong with it,
/// quoting nothing of it. A tenant listed twice: the later line wins.
pub fn assignments(
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

/// What a [`TierSource`] found.
pub enum TierLoad {
    /// The source is the version synced last: nothing to write.
    Unchanged,
    /// The source's text, the name it is recorded under with the hash
    /// (`<configMapName>/<version>`), and what it is (`ConfigMap`, `file`).
    Text {
        what: &'static str,
        source: String,
        text: String,
    },
    /// The source cannot be used (missing, not allowed, no such key): a
    /// Warning with this condition reason, the last good assignments stay.
    Refused {
        reason: &'static str,
        message: String,
    },
    /// Trouble reading it that may pass: said in status, no note.
    Failed(String),
}

/// Where the text of `scheduler.tierAssignments` comes from.
pub trait TierSource {
    /// The source's text unless it is `synced` (the version recorded with
    /// the hash at the last sync).
    fn load(
        &self,
        set: &ShardSet,
        spec: &TierAssignmentsSpec,
        synced: Option<&str>,
    ) -> impl Future<Output = TierLoad> + Send;
}

/// Sync the set's tier source into Redis. Returns what status shows (none
/// when the spec names no source) and the note to report, if this outcome
/// is news. Never fails the apply.
pub(super) async fn sync_tiers<T: TierSource + Sync>(
    set: &ShardSet,
    store: &Store,
    source: &T,
) -> (Option<TierAssignmentsStatus>, Option<Note>) {
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
        return (None, None);
    };
    let (status, note) = match sync(set, store, spec, source).await {
        Ok(out) => out,
        Err(e) => {
            // Redis trouble: the set's Redis status says so; keep what was shown.
            warn!(set = %set.name_any(), error = %e, "cannot sync the tier assignments; retrying");
            return (prev, None);
        }
    };
    let news =
        prev.as_ref().map(|p| (&p.synced, &p.message)) != Some((&status.synced, &status.message));
    if let (true, Some(note)) = (news, &note) {
        if note.warning {
            warn!(set = %set.name_any(), reason = note.reason, "{}", note.message);
        }
    }
    (Some(status), note.filter(|_| news))
}

async fn sync<T: TierSource + Sync>(
    set: &ShardSet,
    store: &Store,
    spec: &TierAssignmentsSpec,
    source: &T,
) -> Result<(TierAssignmentsStatus, Option<Note>), crate::store::StoreError> {
    let (synced, tenants) = store.config_tiers_state().await?;
    let mut status = TierAssignmentsStatus {
        config_map: spec.config_map_name.clone(),
        synced: synced.clone(),
        tenants: tenants as i64,
        message: None,
    };
    let (what, source, text) = match source.load(set, spec, synced.as_deref()).await {
        TierLoad::Unchanged => return Ok((status, None)),
        TierLoad::Text { what, source, text } => (what, source, text),
        TierLoad::Refused { reason, message } => {
            status.message = Some(message.clone());
            return Ok((status, Some(Note::warning(reason, "SyncTiers", message))));
        }
        TierLoad::Failed(message) => {
            status.message = Some(message);
            return Ok((status, None));
        }
    };
    let want = match assignments(spec, &text) {
        Ok(want) => want,
        Err(message) => {
            status.message = Some(message.clone());
            let note = Note::warning(conditions::INVALID_TIER_ASSIGNMENTS, "SyncTiers", message);
            return Ok((status, Some(note)));
        }
    };
    let done = store.sync_config_tiers(&source, &want).await?;
    status.synced = Some(source.clone());
    status.tenants = want.len() as i64;
    let note = format!(
        "synced {} tier assignments from {what} {source}: {} written, {} removed",
        want.len(),
        done.set,
        done.removed
    );
    info!(set = %set.name_any(), "{note}");
    Ok((
        status,
        Some(Note::normal(
            conditions::TIER_ASSIGNMENTS_SYNCED,
            "SyncTiers",
            note,
        )),
    ))
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
