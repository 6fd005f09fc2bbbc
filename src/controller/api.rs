//! Small helpers every reconciler shares for talking to the API server:
//! an `Api` for one namespace or all, guarded lists, and status apply.

use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::warn;

/// An `Api` for `namespace`, or for every namespace when `None`.
pub fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// The objects of a guarded list that decode; each one that does not is
/// logged (with `context`, who listed) and skipped, so one object this
/// version cannot decode stops nobody else.
pub fn decoded<K>(items: Vec<DeserializeGuard<K>>, context: &str) -> Vec<K> {
    items
        .into_iter()
        .filter_map(|o| match o.0 {
            Ok(k) => Some(k),
            Err(e) => {
                warn!(by = %context, error = %e, "skipping an object that cannot be decoded");
                None
            }
        })
        .collect()
}

/// Server-side apply of `status` to the status subresource of `name`,
/// with `manager` as the field manager (forced: the manager owns its status).
pub async fn apply_status<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    <K as Resource>::DynamicType: Default,
    S: Serialize,
{
    let dt = K::DynamicType::default();
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&dt),
        "kind": K::kind(&dt),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await
}
