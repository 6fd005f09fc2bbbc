//! Standard Webhooks signing: `webhook-id`, `webhook-timestamp` and
//! `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, with
//! secrets in `whsec_<base64>` form. During a rotation an endpoint has two
//! secrets and every delivery carries both signatures, space-separated.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A signing secret, decoded from `whsec_<base64>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A secret that is not `whsec_` followed by base64 of 24 to 64 bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("signing secret: {0}")]
pub struct BadSecret(String);

impl Secret {
    pub fn parse(s: &str) -> Result<Self, BadSecret> {
        let b64 = s
            .strip_prefix("whsec_")
            .ok_or_else(|| BadSecret("must start with whsec_".into()))?;
        let key = STANDARD
            .decode(b64)
            .map_err(|e| BadSecret(format!("the part after whsec_ is not base64: {e}")))?;
        if !(24..=64).contains(&key.len()) {
            return Err(BadSecret(format!(
                "decodes to {} bytes; expected 24 to 64",
                key.len()
            )));
        }
        Ok(Secret(key))
    }

    /// A fresh random secret in `whsec_` form.
    pub fn generate() -> String {
        let key: [u8; 32] = rand::random();
        format!("whsec_{}", STANDARD.encode(key))
    }

    /// `v1,<base64 signature>` of one message.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
    }
}

/// The `webhook-signature` header value: one signature per secret.
pub fn signature_header(secrets: &[Secret], id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets
        .iter()
        .map(|s| s.sign(id, timestamp, body))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_standard_webhooks_reference_vector() {
        // The example from the Standard Webhooks specification's reference libraries.
        let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let sig = secret.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn rotation_signs_with_both_secrets() {
        let a = Secret::parse(&Secret::generate()).unwrap();
        let b = Secret::parse(&Secret::generate()).unwrap();
        let h = signature_header(&[a.clone(), b.clone()], "msg_1", 1, b"{}");
        let parts: Vec<&str> = h.split(' ').collect();
        assert_eq!(
            parts,
            [a.sign("msg_1", 1, b"{}"), b.sign("msg_1", 1, b"{}")]
        );
    }

    #[test]
    fn bad_secrets_say_why() {
        assert!(Secret::parse("abc")
            .unwrap_err()
            .to_string()
            .contains("whsec_"));
        assert!(Secret::parse("whsec_!!!")
            .unwrap_err()
            .to_string()
            .contains("base64"));
        assert!(Secret::parse("whsec_YWJj")
            .unwrap_err()
            .to_string()
            .contains("3 bytes"));
    }
}
