//! The controller's source of `scheduler.tierAssignments`: the ConfigMap.
//! Its metadata is read at every reconcile, and the whole ConfigMap only
//! when its resourceVersion is not the one synced last. What is done with
//! the text (the parser, the all-or-nothing write, the messages that quote
//! none of it) is `controller::dataplane`'s, shared with `lanekeeper
//! dataplane apply --tiers-file`.

use crate::controller::dataplane::{TierLoad, TierSource};
use crate::crd::conditions;
use crate::crd::ShardSet;
use crate::crd::TierAssignmentsSpec;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::ResourceExt;

/// The ConfigMap a set names, in the set's namespace.
pub(super) struct ConfigMapTiers {
    pub client: kube::Client,
}

impl TierSource for ConfigMapTiers {
    async fn load(
        &self,
        set: &ShardSet,
        spec: &TierAssignmentsSpec,
        synced: Option<&str>,
    ) -> TierLoad {
        let name = &spec.config_map_name;
        let api: Api<ConfigMap> =
            Api::namespaced(self.client.clone(), &set.namespace().unwrap_or_default());
        let cm = match api.get_metadata(name).await {
            Ok(meta) => {
                let source = format!("{name}/{}", meta.resource_version().unwrap_or_default());
                if synced == Some(source.as_str()) {
                    return TierLoad::Unchanged;
                }
                api.get(name).await
            }
            Err(e) => Err(e),
        };
        let cm = match cm {
            Ok(cm) => cm,
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return TierLoad::Refused {
                    reason: conditions::TIER_CONFIG_MAP_NOT_ALLOWED,
                    message: format!("the controller may not read ConfigMap {name:?}: it reads only the names the operator allows (chart value controller.tierConfigMapNames); the last good assignments stay"),
                }
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return TierLoad::Refused {
                    reason: conditions::TIER_CONFIG_MAP_NOT_FOUND,
                    message: format!("ConfigMap {name:?} (scheduler.tierAssignments.configMapName) was not found in the set's namespace; the last good assignments stay"),
                }
            }
            Err(e) => return TierLoad::Failed(format!("cannot read ConfigMap {name:?}: {e}")),
        };
        let source = format!("{name}/{}", cm.resource_version().unwrap_or_default());
        match cm.data.and_then(|mut d| d.remove(&spec.key)) {
            Some(text) => TierLoad::Text {
                what: "ConfigMap",
                source,
                text,
            },
            None => TierLoad::Refused {
                reason: conditions::INVALID_TIER_ASSIGNMENTS,
                message: format!(
                    "ConfigMap {name:?} has no key {:?} (scheduler.tierAssignments.key); the last good assignments stay",
                    spec.key
                ),
            },
        }
    }
}
