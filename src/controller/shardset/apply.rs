//! Applying the shard Deployments: what was applied is remembered, so an
//! unchanged Deployment is not sent again.

use super::write_status;
use super::Apis;
use super::Plan;
use crate::controller::build;
use crate::controller::build::shard_of;
use crate::controller::build::FIELD_MANAGER;
use crate::controller::status;
use crate::controller::Context;
use crate::controller::Error;
use crate::crd::ShardSet;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::DeleteParams;
use kube::api::Patch;
use kube::api::PatchParams;
use kube::ResourceExt;
use std::time::Duration;
use std::time::Instant;
use tracing::{info, warn};

/// One apply of a Deployment, as the API server answered it.
#[derive(Clone, Debug)]
pub(crate) struct Applied {
    digest: [u8; 32],
    uid: Option<String>,
    generation: Option<i64>,
    at: Instant,
}

/// An unchanged Deployment is applied again after this long anyway, which
/// restores a field someone changed without bumping its generation (labels,
/// annotations).
const REAPPLY_AFTER: Duration = Duration::from_secs(600);

impl Applied {
    /// Would applying `digest` over `seen` (from a list just now) change
    /// nothing? True when this process applied exactly that object, and the
    /// Deployment is still the one it answered (same uid) with no spec change
    /// since (same generation), within [`REAPPLY_AFTER`]. Pure.
    pub(super) fn covers(&self, digest: &[u8; 32], seen: &Deployment, now: Instant) -> bool {
        self.digest == *digest
            && seen.metadata.uid.is_some()
            && self.uid == seen.metadata.uid
            && self.generation == seen.metadata.generation
            && now.duration_since(self.at) < REAPPLY_AFTER
    }
}

impl Context {
    pub(super) fn applied_memo(&self, key: &(String, String)) -> Option<Applied> {
        let memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.get(key).cloned()
    }

    pub(super) fn remember_applied(&self, key: (String, String), applied: Applied) {
        let mut memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.insert(key, applied);
    }

    pub(super) fn forget_applied(&self, key: &(String, String)) {
        let mut memo = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        memo.remove(key);
    }
}

/// What the apply step leaves: the shard Deployments as the API server
/// answered (a new generation not yet rolled out is not available).
pub(in crate::controller) struct Shards {
    /// The Deployments of the shards the spec asks for.
    pub current: Vec<Deployment>,
    /// Every shard the spec asks for is available.
    pub up: bool,
}

/// Apply the wanted Deployments, then prune the ones the set owns and no
/// longer wants. An unchanged Deployment (what this process applied last,
/// same uid and generation) is not sent again: an idle set costs its lists
/// and nothing more per resync.
pub(super) async fn apply_and_prune(
    set: &ShardSet,
    ctx: &Context,
    apis: &Apis,
    existing: &[Deployment],
    plan: &Plan,
) -> Result<Shards, Error> {
    let name = set.name_any();
    let ns = set.namespace().unwrap_or_default();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut applied = Vec::with_capacity(plan.wanted.len());
    for d in &plan.wanted {
        let dname = d.metadata.name.clone().unwrap_or_default();
        let key = (ns.clone(), dname.clone());
        let digest = build::digest(d);
        let seen = existing.iter().find(|e| e.name_any() == dname);
        let memo = ctx.applied_memo(&key);
        if let (Some(seen), Some(memo)) = (seen, memo) {
            if memo.covers(&digest, seen, Instant::now()) {
                applied.push(seen.clone());
                continue;
            }
        }
        let out = match apis
            .deployments
            .patch(&dname, &params, &Patch::Apply(d))
            .await
        {
            Ok(out) => out,
            // A Deployment the API server refuses (a bad nodeSelector key,
            // requests over limits): say so in status and an Event.
            Err(kube::Error::Api(e)) if matches!(e.code, 400 | 422) => {
                let message = format!(
                    "the API server refused Deployment {dname}: {}",
                    e.message.chars().take(1000).collect::<String>()
                );
                warn!(set = %name, "{message}");
                write_status(
                    &apis.sets,
                    set,
                    ctx,
                    status::deployment_rejected(set, &message),
                )
                .await?;
                return Err(Error::Kube(kube::Error::Api(e)));
            }
            Err(e) => return Err(e.into()),
        };
        ctx.remember_applied(
            key,
            Applied {
                digest,
                uid: out.metadata.uid.clone(),
                generation: out.metadata.generation,
                at: Instant::now(),
            },
        );
        applied.push(out);
    }
    let wanted_names: Vec<String> = plan
        .wanted
        .iter()
        .filter_map(|d| d.metadata.name.clone())
        .collect();
    for d in existing {
        let dname = d.name_any();
        if !wanted_names.contains(&dname) {
            info!(set = %name, deployment = %dname, "pruning a shard Deployment the set no longer wants");
            apis.deployments
                .delete(&dname, &DeleteParams::background())
                .await?;
            ctx.forget_applied(&(ns.clone(), dname));
        }
    }
    // Readiness counts the shards the spec asks for.
    let current: Vec<Deployment> = applied
        .into_iter()
        .filter(|d| shard_of(d).is_some_and(|n| n < plan.desired))
        .collect();
    let up = current
        .iter()
        .filter(|d| status::shard_available(d))
        .count()
        == plan.desired as usize;
    Ok(Shards { current, up })
}

#[cfg(test)]
mod applied_tests {
    use super::*;

    fn seen(uid: &str, generation: i64) -> Deployment {
        let mut d = Deployment::default();
        d.metadata.uid = Some(uid.into());
        d.metadata.generation = Some(generation);
        d
    }

    #[test]
    fn an_apply_is_skipped_only_for_the_same_object_uid_and_generation_recently() {
        let now = Instant::now();
        let memo = Applied {
            digest: [1; 32],
            uid: Some("u1".into()),
            generation: Some(3),
            at: now,
        };
        assert!(memo.covers(&[1; 32], &seen("u1", 3), now));
        // The controller wants something else now.
        assert!(!memo.covers(&[2; 32], &seen("u1", 3), now));
        // Someone changed the spec (kubectl scale, edit): generation moved.
        assert!(!memo.covers(&[1; 32], &seen("u1", 4), now));
        // Deleted and recreated by someone else under the same name.
        assert!(!memo.covers(&[1; 32], &seen("u2", 3), now));
        // Metadata edits do not move the generation: re-applied after a while.
        assert!(!memo.covers(&[1; 32], &seen("u1", 3), now + REAPPLY_AFTER));
        // A listed object without a uid proves nothing.
        assert!(!memo.covers(&[1; 32], &Deployment::default(), now));
    }
}
