//! API keys: who may call ingest, and for which tenant.
//!
//! A handler learns its caller only through the extractors here: [`Caller`]
//! (a known key, for routes whose tenant is in the body) and [`Tenant`] (a
//! key that may act for the `{tenant}` in the path, which must be valid), so
//! a handler that needs a tenant cannot be written without the check.
//!
//! Keys are random tokens (`lk_` and 43 base64url characters: 256 bits). At
//! rest only their SHA-256 is kept, in a YAML file that usually comes from a
//! Kubernetes Secret mounted as a volume:
//!
//! ```yaml
//! keys:
//!   - name: acme-prod          # for logs; never the key itself
//!     sha256: 9f86d0...        # hex SHA-256 of the key
//!     tenant: acme             # this key may act for tenant acme only
//!   - name: ops
//!     sha256: 60303a...
//!     admin: true              # every tenant
//! ```
//!
//! A plain SHA-256 suffices because the keys are high-entropy random tokens,
//! not passwords (the same reasoning as GitHub's token storage). The file is
//! re-read when it changes, so keys rotate without a restart: add the new
//! key, move the producers, remove the old one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::Ingest;

/// What a key may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every tenant, and the admin-only operations.
    Admin,
    /// One tenant's events, endpoints, dead letters and stats.
    Tenant(String),
}

/// The caller, once its key is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub scope: Scope,
}

impl Principal {
    /// May this caller act for `tenant`?
    pub fn may_act_for(&self, tenant: &str) -> bool {
        match &self.scope {
            Scope::Admin => true,
            Scope::Tenant(t) => t == tenant,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    keys: Vec<KeyEntry>,
}

/// One entry of the api keys file (what `lanekeeper ingest-key` prints).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    pub name: String,
    /// Hex SHA-256 of the key.
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin: bool,
}

/// The keys in force.
#[derive(Clone, Debug, Default)]
pub struct KeyRing {
    by_hash: HashMap<[u8; 32], Principal>,
}

/// Why a key file was refused (the keys in force stay as they were).
#[derive(Debug, thiserror::Error)]
#[error("api keys file {path}: {reason}")]
pub struct BadKeyFile {
    pub path: String,
    pub reason: String,
}

impl KeyRing {
    /// Parse a key file's text; every entry is checked, naming the bad one.
    pub fn parse(text: &str, path: &str) -> Result<Self, BadKeyFile> {
        let bad = |reason: String| BadKeyFile {
            path: path.to_string(),
            reason,
        };
        let file: KeyFile = serde_yaml::from_str(text).map_err(|e| bad(e.to_string()))?;
        let mut by_hash = HashMap::new();
        for (i, k) in file.keys.into_iter().enumerate() {
            let at = format!("keys[{i}] ({})", k.name);
            let scope = match (k.admin, k.tenant) {
                (true, None) => Scope::Admin,
                (false, Some(t)) => {
                    crate::envelope::validate_tenant(&t).map_err(|e| bad(format!("{at}.{e}")))?;
                    Scope::Tenant(t)
                }
                (true, Some(_)) => {
                    return Err(bad(format!(
                        "{at}: set either tenant or admin: true, not both"
                    )))
                }
                (false, None) => return Err(bad(format!("{at}: set tenant, or admin: true"))),
            };
            let hash = parse_hash(&k.sha256).ok_or_else(|| {
                bad(format!(
                    "{at}.sha256: must be 64 hex characters (the SHA-256 of the key)"
                ))
            })?;
            if by_hash
                .insert(
                    hash,
                    Principal {
                        name: k.name,
                        scope,
                    },
                )
                .is_some()
            {
                return Err(bad(format!("{at}.sha256: the same key is listed twice")));
            }
        }
        Ok(Self { by_hash })
    }

    /// The caller presenting `key`, if it is known.
    pub fn lookup(&self, key: &str) -> Option<&Principal> {
        self.by_hash.get(&hash_key(key))
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// SHA-256 of a key, as the key file holds it.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Hex SHA-256 of a key, for the key file.
pub fn hash_key_hex(key: &str) -> String {
    hash_key(key).iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hash(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// A new random key.
pub fn generate_key() -> String {
    use base64::Engine;
    let bytes: [u8; 32] = rand::random();
    format!(
        "lk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// The key ring, reloaded from its file when the file changes.
#[derive(Clone)]
pub struct Keys {
    ring: Arc<RwLock<Arc<KeyRing>>>,
    path: PathBuf,
}

impl Keys {
    /// Load `path`; it must exist and parse.
    pub fn load(path: &Path) -> Result<Self, BadKeyFile> {
        let ring = read(path)?;
        Ok(Self {
            ring: Arc::new(RwLock::new(Arc::new(ring))),
            path: path.to_path_buf(),
        })
    }

    /// The keys in force now.
    pub fn current(&self) -> Arc<KeyRing> {
        self.ring.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Re-read the file every `every` while it changes (modification time or
    /// size; a Kubernetes Secret volume swaps a symlink, which changes both).
    /// A file that no longer parses is reported and the previous keys stay.
    pub fn watch(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let keys = self.clone();
        tokio::spawn(async move {
            let mut seen = stamp(&keys.path);
            loop {
                tokio::time::sleep(every).await;
                let now = stamp(&keys.path);
                if now == seen {
                    continue;
                }
                seen = now;
                match read(&keys.path) {
                    Ok(ring) => {
                        tracing::info!(path = %keys.path.display(), keys = ring.len(), "api keys reloaded");
                        *keys.ring.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(ring);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "api keys not reloaded; the previous keys stay in force")
                    }
                }
            }
        })
    }
}

fn read(path: &Path) -> Result<KeyRing, BadKeyFile> {
    let text = std::fs::read_to_string(path).map_err(|e| BadKeyFile {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    KeyRing::parse(&text, &path.display().to_string())
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

// ---- the extractors ------------------------------------------------------

/// The caller of a route whose tenant is in the body (the events): its key
/// is known; whether it may act for each event's tenant is the handler's to
/// check, event by event.
pub struct Caller(pub Principal);

impl FromRequestParts<Ingest> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ingest: &Ingest) -> Result<Self, ApiError> {
        ingest.authenticate(&parts.headers).map(Caller)
    }
}

/// The caller of an admin-only route (`/v1/admin/...`): its key is known
/// and is an admin key; any other is refused 403.
pub struct Admin(pub Principal);

impl FromRequestParts<Ingest> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ingest: &Ingest) -> Result<Self, ApiError> {
        let who = ingest.authenticate(&parts.headers)?;
        match who.scope {
            Scope::Admin => Ok(Admin(who)),
            Scope::Tenant(_) => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                None,
                format!(
                    "api key {:?} is not an admin key; this operation needs one",
                    who.name
                ),
            )),
        }
    }
}

/// The caller of a `/v1/tenants/{tenant}/...` route: its key is known, may
/// act for the tenant in the path, and that tenant is valid. The only way a
/// tenant handler learns its tenant.
pub struct Tenant {
    /// The tenant in the path.
    pub name: String,
    pub who: Principal,
}

impl FromRequestParts<Ingest> for Tenant {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, ingest: &Ingest) -> Result<Self, Response> {
        let axum::extract::Path(params) = axum::extract::Path::<
            std::collections::BTreeMap<String, String>,
        >::from_request_parts(parts, ingest)
        .await
        .map_err(IntoResponse::into_response)?;
        let Some(name) = params.get("tenant").cloned() else {
            // A route without {tenant} in its path cannot take this extractor.
            return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
        };
        let who = ingest
            .authorize(&parts.headers, &name)
            .map_err(IntoResponse::into_response)?;
        Ok(Self { name, who })
    }
}

impl Ingest {
    pub(super) fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| ApiError::unauthorized("missing Authorization: Bearer <api key>"))?;
        let key = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::unauthorized("Authorization must be Bearer <api key>"))?;
        self.inner
            .keys
            .current()
            .lookup(key.trim())
            .cloned()
            .ok_or_else(|| ApiError::unauthorized("unknown api key"))
    }

    fn authorize(&self, headers: &HeaderMap, tenant: &str) -> Result<Principal, ApiError> {
        let who = self.authenticate(headers)?;
        if !who.may_act_for(tenant) {
            return Err(ApiError::forbidden(&who, tenant, None));
        }
        crate::envelope::validate_tenant(tenant)
            .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, "tenant", e.reason))?;
        Ok(who)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_looked_up_by_hash_and_scoped() {
        let (a, b) = (generate_key(), generate_key());
        assert_ne!(a, b);
        let text = format!(
            "keys:\n  - {{name: acme, sha256: {}, tenant: acme}}\n  - {{name: ops, sha256: {}, admin: true}}\n",
            hash_key_hex(&a),
            hash_key_hex(&b)
        );
        let ring = KeyRing::parse(&text, "keys.yaml").unwrap();
        let acme = ring.lookup(&a).unwrap();
        assert!(acme.may_act_for("acme") && !acme.may_act_for("globex"));
        assert!(ring.lookup(&b).unwrap().may_act_for("globex"));
        assert!(ring.lookup("lk_wrong").is_none());
        assert!(!text.contains(&a), "the file holds hashes, not keys");
    }

    #[test]
    fn bad_entries_are_refused_naming_the_entry() {
        let err = KeyRing::parse("keys:\n  - {name: x, sha256: abc, tenant: t}\n", "k.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("keys[0] (x).sha256: must be 64 hex"), "{err}");
        let h = hash_key_hex("k");
        let err = KeyRing::parse(&format!("keys:\n  - {{name: y, sha256: {h}}}\n"), "k.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("set tenant, or admin: true"), "{err}");
        let err = KeyRing::parse(
            &format!("keys:\n  - {{name: z, sha256: {h}, tenant: \"\"}}\n"),
            "k.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("keys[0] (z).tenant: must not be empty"),
            "{err}"
        );
        let err = KeyRing::parse(
            &format!("keys:\n  - {{name: w, sha256: {h}, admin: true, extra: 1}}\n"),
            "k.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown field `extra`"), "{err}");
    }
}
