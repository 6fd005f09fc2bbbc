//! A set's Redis: its target (URL, credentials, TLS) read from the spec and
//! its Secrets, the check that those Secrets are ones the controller may
//! read, and one cached connection per set (with connect backoff).

use crate::controller::build::PolicyViolation;
use crate::controller::Context;
use crate::controller::Error;
use crate::crd::conditions;
use crate::crd::RedisSpec;
use crate::crd::ShardSet;
use crate::store::ConnectOptions;
use crate::store::RedisTls;
use crate::store::SetId;
use crate::store::Store;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::Client;
use kube::ResourceExt;
use std::time::Duration;
use std::time::Instant;

/// Most Redis connections (one per set) kept at once; past it the least
/// recently used goes.
const MAX_STORES: usize = 4096;

/// A set's Redis connection, or its last failure to connect, for the target
/// with `fingerprint` (a hash of URL and TLS material: no secret in the map
/// key, and a change of URL replaces the entry).
pub(crate) struct CachedStore {
    fingerprint: [u8; 32],
    pub(crate) state: Result<Store, ConnectFailure>,
    used: Instant,
}

/// A failed connect, not tried again before `retry_at` (exponential backoff).
#[derive(Clone)]
pub(crate) struct ConnectFailure {
    retry_at: Instant,
    attempts: u32,
    /// Without any secret.
    message: String,
}

/// Backoff after the `attempts`th consecutive failed connect: 5 s doubling,
/// at most a minute (a Redis that comes back is used within a minute).
fn connect_backoff(attempts: u32) -> Duration {
    crate::policy::capped_backoff(attempts, Duration::from_secs(5), Duration::from_secs(60))
}

/// The Secrets `spec.redis` names must be ones the controller itself may
/// read: worker pods mount them by reference, so a Secret outside the
/// controller's RBAC (the chart's `redis.secretName` / `extraSecretNames`)
/// would reach a pod the author could not create. A Secret that does not
/// exist yet is not refused (the status says it is missing).
pub(crate) async fn check_redis_secrets(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
) -> Result<(), Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut refs: Vec<(&str, &str)> = Vec::new();
    if let Some(r) = &spec.url_secret_ref {
        refs.push(("spec.redis.urlSecretRef.name", &r.name));
    }
    if let Some(r) = &spec.password_secret_ref {
        refs.push(("spec.redis.passwordSecretRef.name", &r.name));
    }
    if let Some(t) = &spec.tls {
        if let Some(r) = &t.ca_secret_ref {
            refs.push(("spec.redis.tls.caSecretRef.name", &r.name));
        }
        if let Some(r) = &t.client_cert_secret_ref {
            refs.push(("spec.redis.tls.clientCertSecretRef.name", &r.name));
        }
    }
    for (field, name) in refs {
        match api.get_metadata(name).await {
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return Err(PolicyViolation {
                    field: field.to_string(),
                    reason: conditions::SECRET_NOT_ALLOWED,
                    message: format!("the controller may not read Secret {name:?}, so a ShardSet may not use it (the operator names the Secrets it may read: chart values redis.secretName, redis.extraSecretNames)"),
                }
                .into())
            }
            Ok(_) | Err(kube::Error::Api(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A fingerprint of a Redis target (URL with credentials, TLS material),
/// so that the connection map holds no secret.
fn fingerprint(url: &str, tls: Option<&RedisTls>) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let part = |h: &mut sha2::Sha256, b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(&mut h, url.as_bytes());
    if let Some(t) = tls {
        part(&mut h, t.ca.as_deref().unwrap_or_default());
        if let Some((cert, key)) = &t.client {
            part(&mut h, cert);
            part(&mut h, key);
        }
    }
    h.finalize().into()
}

/// The set's Redis connection: the cached one while its target (URL,
/// credentials, TLS) is the same, else a new one replacing it. A failed
/// connect is remembered and not tried again before its backoff ends, so an
/// unreachable Redis costs nothing per reconcile or promotion tick.
pub(crate) async fn store_for(set: &ShardSet, ctx: &Context) -> Result<Store, String> {
    let ns = set.namespace().unwrap_or_default();
    let (url, tls, secrets) = redis_target(&ctx.client, &ns, &set.spec.redis)
        .await
        .map_err(|(e, secrets)| scrub(&e, &secrets))?;
    let id = SetId::new(&ns, set.name_any());
    let print = fingerprint(&url, tls.as_ref());
    let now = Instant::now();
    let mut attempts = 0;
    if let Some(c) = ctx
        .stores
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&id)
        .filter(|c| c.fingerprint == print)
    {
        c.used = now;
        match &c.state {
            Ok(store) => return Ok(store.clone()),
            Err(f) if now < f.retry_at => return Err(f.message.clone()),
            Err(f) => attempts = f.attempts,
        }
    }
    let opts = ConnectOptions {
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(3),
    };
    let result = Store::connect_tls(&url, id.clone(), opts, tls)
        .await
        .map_err(|e| {
            scrub(
                &format!("cannot reach Redis for {ns}/{}: {e}", set.name_any()),
                &secrets,
            )
        });
    let state = result.clone().map_err(|message| ConnectFailure {
        retry_at: Instant::now() + connect_backoff(attempts + 1),
        attempts: attempts + 1,
        message,
    });
    let mut stores = ctx.stores.lock().unwrap_or_else(|e| e.into_inner());
    if stores.len() >= MAX_STORES && !stores.contains_key(&id) {
        if let Some(oldest) = stores
            .iter()
            .min_by_key(|(_, c)| c.used)
            .map(|(k, _)| k.clone())
        {
            stores.remove(&oldest);
        }
    }
    stores.insert(
        id,
        CachedStore {
            fingerprint: print,
            state,
            used: now,
        },
    );
    result
}

/// `message` with every secret value in it replaced by `***`.
fn scrub(message: &str, secrets: &[String]) -> String {
    let mut out = message.to_string();
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        out = out.replace(s.as_str(), "***");
    }
    out
}

/// The Redis URL of a set (user name and password in it) and its TLS
/// material, resolving Secret references; with the secret values read (the
/// URL when it came from a Secret, the password), which no message may carry.
/// An error comes with them too, to scrub it.
async fn redis_target(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
) -> Result<(String, Option<RedisTls>, Vec<String>), (String, Vec<String>)> {
    let mut secrets = Vec::new();
    match redis_target_inner(client, ns, spec, &mut secrets).await {
        Ok((url, tls)) => Ok((url, tls, secrets)),
        Err(e) => Err((e, secrets)),
    }
}

async fn redis_target_inner(
    client: &Client,
    ns: &str,
    spec: &RedisSpec,
    secrets: &mut Vec<String>,
) -> Result<(String, Option<RedisTls>), String> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let read_bytes = |name: String, key: String| {
        let api = api.clone();
        async move {
            let s = api
                .get(&name)
                .await
                .map_err(|e| format!("reading Secret {ns}/{name}: {e}"))?;
            s.data
                .and_then(|d| d.get(&key).cloned())
                .map(|v| v.0)
                .ok_or_else(|| format!("Secret {ns}/{name} has no key {key}"))
        }
    };
    let read = |name: String, key: String| {
        let bytes = read_bytes(name.clone(), key.clone());
        async move {
            String::from_utf8(bytes.await?)
                .map_err(|_| format!("Secret {ns}/{name} key {key} is not UTF-8"))
        }
    };
    // A URL read from a Secret is never shown, not even redacted: the key
    // may hold something else entirely (a password).
    let (url, from_secret) = match (&spec.url, &spec.url_secret_ref) {
        (_, Some(r)) => {
            let url = read(r.name.clone(), r.key.clone()).await?;
            secrets.push(url.clone());
            (url, Some(r))
        }
        (Some(u), None) => (u.clone(), None),
        (None, None) => return Err("spec.redis has neither url nor urlSecretRef".to_string()),
    };
    let hidden = |e: String| match from_secret {
        Some(r) => format!(
            "the Redis URL in Secret {ns}/{} key {} is not usable (value not shown)",
            r.name, r.key
        ),
        None => e,
    };
    let mut url = crate::store::cluster_url(&url, spec.cluster);
    if let Some(user) = &spec.username {
        url = crate::store::with_username(&url, user).map_err(hidden)?;
    }
    if let Some(r) = &spec.password_secret_ref {
        let password = read(r.name.clone(), r.key.clone()).await?;
        secrets.push(password.clone());
        url = crate::store::with_password(&url, &password).map_err(hidden)?;
    }
    let mut tls = RedisTls::default();
    if let Some(t) = &spec.tls {
        if let Some(r) = &t.ca_secret_ref {
            tls.ca = Some(read_bytes(r.name.clone(), r.key.clone()).await?);
        }
        if let Some(r) = &t.client_cert_secret_ref {
            let cert = read_bytes(r.name.clone(), "tls.crt".into()).await?;
            let key = read_bytes(r.name.clone(), "tls.key".into()).await?;
            tls.client = Some((cert, key));
        }
    }
    let tls = (tls != RedisTls::default()).then_some(tls);
    if tls.is_some() && !crate::store::is_tls_url(&url) {
        return Err(hidden(format!(
            "spec.redis.tls is set but the Redis URL {} is not rediss:// (or rediss+cluster://)",
            crate::store::redact(&url)
        )));
    }
    if from_secret.is_some()
        && url::Url::parse(&url).is_err()
        && crate::store::cluster_nodes(&url).is_none()
    {
        return Err(hidden(String::new()));
    }
    Ok((url, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_failures_back_off_to_a_minute() {
        let secs: Vec<u64> = (1..=6).map(|n| connect_backoff(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 60, 60]);
    }

    #[test]
    fn messages_are_scrubbed_of_secret_values_and_keys_hold_none() {
        let secrets = vec!["pw-1".to_string(), String::new()];
        assert_eq!(
            scrub("redis url \"pw-1\": relative URL without a base", &secrets),
            "redis url \"***\": relative URL without a base"
        );
        let a = fingerprint("redis://:pw-1@r:6379", None);
        assert_ne!(a, fingerprint("redis://:pw-2@r:6379", None));
        let tls = RedisTls {
            ca: Some(b"ca".to_vec()),
            client: None,
        };
        assert_ne!(a, fingerprint("redis://:pw-1@r:6379", Some(&tls)));
        assert!(!String::from_utf8_lossy(&a).contains("pw-1"));
    }
}
