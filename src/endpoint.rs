//! A tenant's webhook endpoint, as the registry in Redis holds it.

use serde::{Deserialize, Serialize};

use crate::signing::{BadSecret, Secret};

/// Where and how one tenant receives webhooks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    /// `https://` (or `http://`) URL that receives POSTs.
    pub url: String,
    /// Signing secrets in `whsec_` form; two during a rotation (both sign).
    pub secrets: Vec<String>,
    /// Disabled endpoints receive nothing; their envelopes are dead-lettered.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Event types this endpoint wants (fan-out); empty means all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_types: Vec<String>,
}

fn yes() -> bool {
    true
}

/// Why an endpoint definition was refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidEndpoint {
    pub field: &'static str,
    pub reason: String,
}

impl Endpoint {
    pub fn validate(&self) -> Result<(), InvalidEndpoint> {
        let bad = |field, reason: String| InvalidEndpoint { field, reason };
        let url = reqwest::Url::parse(&self.url).map_err(|e| bad("url", format!("{e}")))?;
        if !matches!(url.scheme(), "https" | "http") {
            return Err(bad(
                "url",
                format!("scheme {:?}: only https and http", url.scheme()),
            ));
        }
        if url.host_str().is_none() {
            return Err(bad("url", "has no host".into()));
        }
        if self.secrets.is_empty() || self.secrets.len() > 2 {
            return Err(bad(
                "secrets",
                format!(
                    "{} given; one, or two during a rotation",
                    self.secrets.len()
                ),
            ));
        }
        self.signing_secrets()
            .map_err(|e: BadSecret| bad("secrets", e.to_string()))?;
        Ok(())
    }

    pub fn signing_secrets(&self) -> Result<Vec<Secret>, BadSecret> {
        self.secrets.iter().map(|s| Secret::parse(s)).collect()
    }

    /// Whether this endpoint wants events of `event_type`.
    pub fn wants(&self, event_type: Option<&str>) -> bool {
        self.event_types.is_empty()
            || event_type.is_some_and(|t| self.event_types.iter().any(|e| e == t))
    }
}
/// What is wrong with an endpoint's name, if anything: the envelope's rule
/// ([`crate::envelope::check_endpoint_name`]), so a name the registry takes
/// is one an envelope may carry.
pub fn check_name(name: &str) -> Result<(), String> {
    crate::envelope::check_endpoint_name(name)
}
