//! The unit of delivery: one webhook for one tenant, and the checks it must
//! pass before anything stores it.

use serde::{Deserialize, Serialize};

/// Longest tenant id, in bytes.
pub const MAX_TENANT_BYTES: usize = 128;
/// The endpoint of envelopes that name none.
pub const DEFAULT_ENDPOINT: &str = "default";
/// Longest envelope id, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// One webhook on its way to one tenant's endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Unique id; also the idempotency key (the same id twice is stored once).
    pub id: String,
    /// The tenant whose webhook this is; routing and fairness are per tenant.
    pub tenant: String,
    /// The tenant's endpoint to deliver to, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Event type, e.g. `user.password_reset`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// The webhook body.
    pub payload: serde_json::Value,
}

/// Why an envelope was refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidEnvelope {
    pub field: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> InvalidEnvelope {
    InvalidEnvelope {
        field,
        reason: reason.into(),
    }
}

/// Check a tenant id against the one rule every entry point shares (ingest,
/// the api keys file, the CRDs' `tenant` fields, the CLI):
/// `^[A-Za-z0-9][A-Za-z0-9._:-]*$`, at most [`MAX_TENANT_BYTES`] bytes. A
/// tenant id is part of Redis keys, metric labels and log lines, so it stays
/// printable ASCII without spaces, quotes or bidi controls.
pub fn validate_tenant(tenant: &str) -> Result<(), InvalidEnvelope> {
    if tenant.is_empty() {
        return Err(invalid("tenant", "must not be empty"));
    }
    if tenant.len() > MAX_TENANT_BYTES {
        return Err(invalid(
            "tenant",
            format!("is {} bytes; the limit is {MAX_TENANT_BYTES}", tenant.len()),
        ));
    }
    let rule = "a tenant id starts with a letter or digit and contains only letters, digits, '.', '_', ':' and '-'";
    let first = tenant.chars().next().unwrap_or_default();
    if !first.is_ascii_alphanumeric() {
        return Err(invalid("tenant", format!("starts with {first:?}; {rule}")));
    }
    if let Some(c) = tenant
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(invalid("tenant", format!("contains {c:?}; {rule}")));
    }
    Ok(())
}

/// What is wrong with an endpoint's name, if anything: 1 to 64 letters,
/// digits, `-`, `_` or `.` (the name is quoted, at most 80 characters of
/// it). A name is part of Redis keys (a breaker, a rate bucket, and under
/// endpoint isolation a lane) and of the lease a worker holds.
pub fn check_endpoint_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        let quoted: String = name.chars().take(80).collect();
        Err(format!(
            "{quoted:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
        ))
    }
}

impl Envelope {
    /// Check the envelope before it is stored.
    pub fn validate(&self) -> Result<(), InvalidEnvelope> {
        validate_tenant(&self.tenant)?;
        if let Some(ep) = &self.endpoint {
            check_endpoint_name(ep).map_err(|reason| invalid("endpoint", reason))?;
        }
        if self.id.is_empty() {
            return Err(invalid("id", "must not be empty"));
        }
        if self.id.len() > MAX_ID_BYTES {
            return Err(invalid(
                "id",
                format!("is {} bytes; the limit is {MAX_ID_BYTES}", self.id.len()),
            ));
        }
        if let Some(c) = self
            .id
            .chars()
            .find(|c| c.is_control() || c.is_whitespace())
        {
            return Err(invalid(
                "id",
                format!("contains {c:?}; use printable characters without spaces"),
            ));
        }
        Ok(())
    }

    /// The endpoint this envelope goes to: the one named, else `default`.
    pub fn endpoint_name(&self) -> &str {
        self.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT)
    }

    /// A fresh random id, for producers that bring none.
    pub fn new_id() -> String {
        use rand::Rng;
        let n: u128 = rand::rng().random();
        format!("msg_{n:032x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(tenant: &str, id: &str) -> Envelope {
        Envelope {
            id: id.into(),
            tenant: tenant.into(),
            endpoint: None,
            event_type: None,
            payload: serde_json::json!({}),
        }
    }

    #[test]
    fn rejects_bad_endpoint_names_naming_the_field() {
        let mut e = env("acme", "a");
        for bad in ["", "a\nb", "a:b", "x y", &"e".repeat(65)] {
            e.endpoint = Some(bad.to_string());
            let err = e.validate().unwrap_err().to_string();
            assert!(err.starts_with("endpoint: "), "{bad:?}: {err}");
            assert!(err.contains("1 to 64 letters"), "{bad:?}: {err}");
        }
        for ok in ["main", "a.b-c_d", &"e".repeat(64)] {
            e.endpoint = Some(ok.to_string());
            assert!(e.validate().is_ok(), "{ok:?}");
        }
        e.endpoint = None;
        assert!(e.validate().is_ok());
    }

    #[test]
    fn rejects_bad_tenants_naming_the_field() {
        assert_eq!(
            env("", "a").validate().unwrap_err().to_string(),
            "tenant: must not be empty"
        );
        let long = "t".repeat(129);
        assert!(env(&long, "a")
            .validate()
            .unwrap_err()
            .to_string()
            .contains("129 bytes; the limit is 128"));
        assert!(env(&"t".repeat(128), "a").validate().is_ok());
        for ok in ["acme", "A1", "org:team-7.prod_x", "0"] {
            assert!(validate_tenant(ok).is_ok(), "{ok:?}");
        }
        // The documented rule, ^[A-Za-z0-9][A-Za-z0-9._:-]*$: no control
        // characters, spaces, quotes, slashes, non-ASCII letters or bidi
        // overrides, and no leading punctuation.
        for bad in [
            "a\nb",
            "a b",
            "a\"b",
            "a'b",
            "a/b",
            "a{b}",
            "caf\u{e9}",
            "evil\u{202e}gnp",
            "\u{200b}x",
            "-a",
            ".a",
            ":a",
            "_a",
            "a\u{0}",
            "a*",
            "a,b",
        ] {
            let e = validate_tenant(bad).unwrap_err();
            assert_eq!(e.field, "tenant", "{bad:?}");
            assert!(e.reason.contains("letter or digit"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn rejects_bad_ids() {
        assert_eq!(env("t", "").validate().unwrap_err().field, "id");
        assert_eq!(env("t", "a b").validate().unwrap_err().field, "id");
        assert!(env("t", &Envelope::new_id()).validate().is_ok());
    }
}
