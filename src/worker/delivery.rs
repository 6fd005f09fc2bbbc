//! One webhook over HTTP: sign, POST, classify the answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::ssrf::{Guard, ResolveError, Unresolved};
use crate::endpoint::Endpoint;
use crate::envelope::Envelope;
use crate::signing::signature_header;

/// Bytes of a failing response body kept for the dead letter.
const BODY_EXCERPT: usize = 256;

/// What became of one delivery attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx.
    Delivered { status: u16 },
    /// Worth another attempt (until the attempt limit): 429, 5xx, timeouts,
    /// connection errors (`endpoint_fault`, which counts against the breaker)
    /// and other non-2xx answers.
    Retry {
        class: &'static str,
        cause: String,
        /// The receiver's `Retry-After`, when it gave one.
        retry_after: Option<Duration>,
        /// A 429 or 503 with `Retry-After`: the receiver paces its endpoint,
        /// which then gets no request until `retry_after` has passed (not a
        /// fault of the endpoint: the breaker is not touched).
        pace: bool,
        endpoint_fault: bool,
    },
    /// No attempt can succeed: dead-letter now (SSRF refusal, no such
    /// endpoint, endpoint disabled, bad signing secret).
    Refused { class: &'static str, cause: String },
}

impl Outcome {
    pub fn class(&self) -> &'static str {
        match self {
            Outcome::Delivered { .. } => "delivered",
            Outcome::Retry { class, .. } | Outcome::Refused { class, .. } => class,
        }
    }
}

/// Delivers webhooks with one pooled HTTP client whose only resolver is the SSRF guard.
#[derive(Clone)]
pub struct Deliverer {
    client: reqwest::Client,
    guard: Guard,
    /// Whether requests go through a proxy (which resolves the host itself).
    proxied: bool,
}

impl Deliverer {
    /// Without `proxy`, no proxy at all: the environment's `HTTP_PROXY`,
    /// `HTTPS_PROXY` and `ALL_PROXY` are ignored, since a proxy would connect
    /// to the tenant's URL on the worker's behalf, past the guard. With
    /// `proxy`, every delivery goes through it; the guard then checks each
    /// URL's host (its literal address, or what its name resolves to here)
    /// before the request, and the proxy's own host is not checked.
    pub fn new(
        guard: Guard,
        connect_timeout: Duration,
        timeout: Duration,
        proxy: Option<&reqwest::Url>,
    ) -> Result<Self, reqwest::Error> {
        let mut resolver = guard.clone();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .timeout(timeout)
            // A redirect could point anywhere, an internal address included.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("lanekeeper/", env!("CARGO_PKG_VERSION")))
            .pool_max_idle_per_host(64);
        match proxy {
            Some(url) => {
                if let Some(host) = url.host_str() {
                    resolver = resolver.trusting(host);
                }
                builder = builder.proxy(reqwest::Proxy::all(url.clone())?);
            }
            None => builder = builder.no_proxy(),
        }
        let client = builder
            .dns_resolver(std::sync::Arc::new(resolver))
            .build()?;
        Ok(Self {
            client,
            guard,
            proxied: proxy.is_some(),
        })
    }

    /// POST `env` to `endpoint`, signed with all of its secrets.
    pub async fn deliver(&self, env: &Envelope, endpoint: Option<&Endpoint>) -> Outcome {
        let refused = |class, cause: String| Outcome::Refused { class, cause };
        let name = env.endpoint_name();
        let Some(endpoint) = endpoint else {
            return refused(
                "no_endpoint",
                format!("tenant {} has no endpoint named {name}", env.tenant),
            );
        };
        if !endpoint.enabled {
            return refused(
                "endpoint_disabled",
                format!("endpoint {name} of tenant {} is disabled", env.tenant),
            );
        }
        let secrets = match endpoint.signing_secrets() {
            Ok(s) => s,
            Err(e) => return refused("bad_secret", format!("endpoint {name}: {e}")),
        };
        let url = match reqwest::Url::parse(&endpoint.url) {
            Ok(u) => u,
            Err(e) => return refused("bad_url", format!("endpoint {name}: url: {e}")),
        };
        // IP-literal hosts never reach the resolver; check them here.
        match url.host() {
            Some(url::Host::Ipv4(ip)) => {
                if let Err(e) = self.guard.check(&ip.to_string(), ip.into()) {
                    return refused("ssrf", e.to_string());
                }
            }
            Some(url::Host::Ipv6(ip)) => {
                if let Err(e) = self.guard.check(&ip.to_string(), ip.into()) {
                    return refused("ssrf", e.to_string());
                }
            }
            Some(url::Host::Domain(host)) => {
                // Through a proxy, the client never resolves the tenant's host:
                // resolve and check it here (the proxy resolves it again).
                if self.proxied {
                    let port = url.port_or_known_default().unwrap_or(443);
                    match self.guard.resolve(host, port).await {
                        Ok(_) => {}
                        Err(ResolveError::Refused(e)) => return refused("ssrf", e.to_string()),
                        Err(ResolveError::Unresolved(e)) => return unresolved(&e),
                    }
                }
            }
            None => return refused("bad_url", format!("endpoint {name}: url has no host")),
        }
        let body = serde_json::to_vec(&env.payload).unwrap_or_default();
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let request = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", &env.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                signature_header(&secrets, &env.id, timestamp, &body),
            )
            .body(body);
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => return classify_error(e),
        };
        let status = response.status().as_u16();
        if response.status().is_success() {
            return Outcome::Delivered { status };
        }
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| parse_retry_after(v.as_bytes(), SystemTime::now()));
        let excerpt = body_excerpt(response).await;
        let cause = format!("HTTP {status}: {excerpt}");
        // A 429 or 503 that says when to come back paces the endpoint; without
        // Retry-After it is a failure like any other.
        let pace = matches!(status, 429 | 503) && retry_after.is_some();
        match status {
            429 => Outcome::Retry {
                class: "http_429",
                cause,
                retry_after,
                pace,
                endpoint_fault: !pace,
            },
            500..=599 => Outcome::Retry {
                class: "http_5xx",
                cause,
                retry_after,
                pace,
                endpoint_fault: !pace,
            },
            _ => Outcome::Retry {
                class: "http_4xx",
                cause,
                retry_after: None,
                pace: false,
                endpoint_fault: false,
            },
        }
    }
}

/// The longest `Retry-After` the worker reads; the queue's
/// `delivery.maxRetryAfter` (at most 24 h, see the CRD) bounds it further.
pub const RETRY_AFTER_CAP: Duration = Duration::from_secs(24 * 3600);

/// A `Retry-After` value (RFC 9110 section 10.2.3) as the time to wait from
/// `now`: delta-seconds (`120`), or an HTTP-date in the IMF-fixdate form
/// (`Sun, 06 Nov 1994 08:49:37 GMT`) or the obsolete RFC 850 and asctime
/// forms. A date in the past is zero. At most [`RETRY_AFTER_CAP`]: a
/// number too large for any integer is the cap, not an error. Anything else
/// (negative, fractional, non-ASCII, empty, an unknown date format) is
/// `None`, as if there were no header. Linear in the value's length, never panics.
pub fn parse_retry_after(value: &[u8], now: SystemTime) -> Option<Duration> {
    let v = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    if v.is_empty() {
        return None;
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        // delta-seconds: saturate instead of failing on a huge number
        let secs = v
            .bytes()
            .try_fold(0u64, |n, b| {
                n.checked_mul(10)?.checked_add(u64::from(b - b'0'))
            })
            .unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs).min(RETRY_AFTER_CAP));
    }
    // The longest HTTP-date (RFC 850 with a long weekday name) is 33 bytes.
    if v.len() > 40 {
        return None;
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(RETRY_AFTER_CAP),
    )
}

/// A failed lookup: retried with backoff, and counted against the endpoint
/// (its breaker), like a connection error; never a dead letter by itself.
fn unresolved(e: &Unresolved) -> Outcome {
    Outcome::Retry {
        class: "dns_error",
        cause: e.to_string(),
        retry_after: None,
        pace: false,
        endpoint_fault: true,
    }
}

fn classify_error(e: reqwest::Error) -> Outcome {
    // The guard's answer surfaces as a connect error whose source is a
    // `ResolveError`: a refusal dead-letters, a failed lookup is retried.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        match s.downcast_ref::<ResolveError>() {
            Some(ResolveError::Refused(r)) => {
                return Outcome::Refused {
                    class: "ssrf",
                    cause: r.to_string(),
                }
            }
            Some(ResolveError::Unresolved(u)) => return unresolved(u),
            None => {}
        }
        source = s.source();
    }
    let (class, what) = if e.is_timeout() {
        ("timeout", "timed out")
    } else if e.is_connect() {
        ("connect_error", "could not connect")
    } else {
        ("transport_error", "request failed")
    };
    Outcome::Retry {
        class,
        cause: format!("{what}: {}", chain(&e)),
        retry_after: None,
        pace: false,
        endpoint_fault: true,
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

async fn body_excerpt(mut response: reqwest::Response) -> String {
    let mut buf = Vec::new();
    while buf.len() < BODY_EXCERPT {
        match response.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk),
            _ => break,
        }
    }
    buf.truncate(BODY_EXCERPT);
    String::from_utf8_lossy(&buf).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    // Sun, 06 Nov 1994 08:49:37 GMT
    const T: u64 = 784_111_777;

    #[test]
    fn delta_seconds() {
        let now = at(T);
        assert_eq!(
            parse_retry_after(b"120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(b"0", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(b" 2 ", now), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after(b"0002", now),
            Some(Duration::from_secs(2))
        );
    }

    #[test]
    fn http_dates_in_all_three_forms() {
        let now = at(T - 10);
        for form in [
            "Sun, 06 Nov 1994 08:49:37 GMT",  // IMF-fixdate
            "Sunday, 06-Nov-94 08:49:37 GMT", // RFC 850
            "Sun Nov  6 08:49:37 1994",       // asctime
        ] {
            assert_eq!(
                parse_retry_after(form.as_bytes(), now),
                Some(Duration::from_secs(10)),
                "{form}"
            );
        }
    }

    #[test]
    fn a_date_in_the_past_is_zero() {
        let now = at(T + 3600);
        assert_eq!(
            parse_retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn garbage_is_none() {
        let now = at(T);
        for v in [
            &b""[..],
            b"   ",
            b"-5",
            b"+5",
            b"1.5",
            b"1e3",
            b"soon",
            b"0x10",
            b"Sun, 06 Nov 1994 08:49:37 PST",
            b"Sun, 32 Nov 1994 08:49:37 GMT",
            "\u{663}".as_bytes(), // an Arabic-Indic digit three
            "١٢٠".as_bytes(),
            b"\xff\xfe12",
            b"12\x00",
        ] {
            assert_eq!(parse_retry_after(v, now), None, "{v:?}");
        }
    }

    #[test]
    fn hostile_values_are_clamped_and_never_panic() {
        let now = at(T);
        // far beyond u64 seconds: the cap, not an overflow
        assert_eq!(
            parse_retry_after(b"99999999999999999999999999999999", now),
            Some(RETRY_AFTER_CAP)
        );
        assert_eq!(
            parse_retry_after(u64::MAX.to_string().as_bytes(), now),
            Some(RETRY_AFTER_CAP)
        );
        assert_eq!(parse_retry_after(b"86400000", now), Some(RETRY_AFTER_CAP));
        // a 10 kB header of digits, and one of anything else
        assert_eq!(
            parse_retry_after(&vec![b'9'; 10 * 1024], now),
            Some(RETRY_AFTER_CAP)
        );
        assert_eq!(parse_retry_after(&vec![b'a'; 10 * 1024], now), None);
        let mut long_date = b"Sun, 06 Nov 1994 08:49:37 GMT".to_vec();
        long_date.extend(vec![b' '; 10 * 1024]);
        long_date.push(b'x');
        assert_eq!(parse_retry_after(&long_date, now), None);
        // a date far in the future
        assert_eq!(
            parse_retry_after(b"Fri, 31 Dec 9999 23:59:59 GMT", now),
            Some(RETRY_AFTER_CAP)
        );
        // every single byte, and a clock before the epoch
        for b in 0..=255u8 {
            let _ = parse_retry_after(&[b], now);
            let _ = parse_retry_after(&[b'1', b], UNIX_EPOCH);
        }
    }
}
