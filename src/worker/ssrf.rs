//! SSRF guard: webhook URLs come from tenants, so a delivery must not reach
//! the cluster's own network. The host is resolved once, every address is
//! checked, and the connection goes to the addresses that were checked (the
//! resolver below is the HTTP client's only resolver, so there is no second
//! lookup to rebind). Loopback, private, link-local and other non-global
//! addresses are refused unless an allowlist of CIDRs permits them, and so
//! are the IPv6 forms that embed an IPv4 address a router may unwrap
//! (IPv4-compatible, Teredo, 6to4, NAT64) and the deprecated site-local range.
//! A name that does not resolve is not a refusal: the lookup is retried.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

/// Which non-global addresses deliveries may reach anyway.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    allow: Arc<Vec<IpNet>>,
    /// Host names resolved without the check: the configured proxy's, which
    /// the operator chose (the proxy's own address is not a tenant's).
    trusted: Arc<Vec<String>>,
}

/// A refused destination, with the reason that goes into the dead letter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SSRF guard refused {host}: {reason}")]
pub struct Refused {
    pub host: String,
    pub reason: String,
}

/// A name that could not be resolved (a lookup error, or no address): the
/// DNS may be restarting, so this is worth another attempt, not a refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot resolve {host}: {reason}")]
pub struct Unresolved {
    pub host: String,
    pub reason: String,
}

/// Why [`Guard::resolve`] gave no addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error(transparent)]
    Unresolved(#[from] Unresolved),
}

impl Guard {
    pub fn new(allow: Vec<IpNet>) -> Self {
        Self {
            allow: Arc::new(allow),
            trusted: Arc::default(),
        }
    }

    /// Resolve `host` without checking its addresses (the proxy's host).
    pub fn trusting(mut self, host: &str) -> Self {
        let mut t = (*self.trusted).clone();
        t.push(
            host.trim_matches(|c| c == '[' || c == ']')
                .to_ascii_lowercase(),
        );
        self.trusted = Arc::new(t);
        self
    }

    /// Refuse `ip` unless it is global or allowlisted. An IPv4-mapped IPv6
    /// address is checked, and allowlisted, as the IPv4 address it is.
    pub fn check(&self, host: &str, ip: IpAddr) -> Result<(), Refused> {
        let ip = ip.to_canonical();
        if self.allow.iter().any(|net| net.contains(&ip)) {
            return Ok(());
        }
        match non_global(ip) {
            None => Ok(()),
            Some(kind) => Err(Refused {
                host: host.to_string(),
                reason: format!("{ip} is {kind}; add a CIDR to the allowlist if this is intended"),
            }),
        }
    }

    /// Resolve `host` and check every address; all must pass. A failed
    /// lookup is [`ResolveError::Unresolved`] (retryable); only an address
    /// the guard rejects is [`ResolveError::Refused`].
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
        let bare = host.trim_matches(|c| c == '[' || c == ']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            if !self.is_trusted(bare) {
                self.check(host, ip)?;
            }
            return Ok(vec![SocketAddr::new(ip, port)]);
        }
        let unresolved = |reason: String| Unresolved {
            host: host.to_string(),
            reason,
        };
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| unresolved(e.to_string()))?
            .collect();
        if addrs.is_empty() {
            return Err(unresolved("the name has no address".into()).into());
        }
        if !self.is_trusted(bare) {
            for a in &addrs {
                self.check(host, a.ip())?;
            }
        }
        Ok(addrs)
    }

    fn is_trusted(&self, host: &str) -> bool {
        self.trusted.iter().any(|t| t.eq_ignore_ascii_case(host))
    }
}

impl reqwest::dns::Resolve for Guard {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.clone();
        Box::pin(async move {
            // The port is replaced by the client with the URL's port.
            let addrs = guard.resolve(name.as_str(), 0).await?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// What kind of non-global address `ip` is, if it is one.
pub fn non_global(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => non_global_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return non_global_v4(v4);
            }
            non_global_v6(v6)
        }
    }
}

fn non_global_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    Some(if ip.is_loopback() {
        "loopback"
    } else if ip.is_private() {
        "private"
    } else if ip.is_link_local() {
        "link-local (cloud metadata lives here)"
    } else if ip.is_unspecified() || o[0] == 0 {
        "unspecified (this network)"
    } else if ip.is_broadcast() {
        "broadcast"
    } else if ip.is_multicast() {
        "multicast"
    } else if ip.is_documentation() {
        "reserved for documentation"
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        "shared address space (CGNAT)"
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        "reserved for benchmarking"
    } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
        "IETF protocol assignments"
    } else if o[0] == 192 && o[1] == 88 && o[2] == 99 {
        "the 6to4 relay anycast prefix"
    } else if o[0] >= 240 {
        "reserved"
    } else {
        return None;
    })
}

fn non_global_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    Some(if ip.is_loopback() {
        "loopback"
    } else if ip.is_unspecified() {
        "unspecified"
    } else if ip.is_multicast() {
        "multicast"
    } else if s[..6] == [0; 6] {
        // ::a.b.c.d, deprecated; some stacks still route it to a.b.c.d
        "IPv4-compatible (deprecated; embeds an IPv4 address)"
    } else if (s[0] & 0xfe00) == 0xfc00 {
        "unique local (private)"
    } else if (s[0] & 0xffc0) == 0xfe80 {
        "link-local"
    } else if (s[0] & 0xffc0) == 0xfec0 {
        "site-local (deprecated private)"
    } else if (s[0] == 0x2001 && s[1] == 0x0db8) || (s[0] == 0x3fff && s[1] < 0x1000) {
        "reserved for documentation"
    } else if s[0] == 0x64 && s[1] == 0xff9b {
        // NAT64 (64:ff9b::/96 and the local-use 64:ff9b:1::/48) reaches IPv4 private space
        "NAT64"
    } else if s[0] == 0x2001 && s[1] == 0 {
        "Teredo (embeds an IPv4 address)"
    } else if s[0] == 0x2002 {
        "6to4 (embeds an IPv4 address)"
    } else if s[0] == 0x0100 && s[1..4] == [0, 0, 0] {
        "discard-only"
    } else if s[0] == 0x2001 && s[1] == 0x0002 && s[2] == 0 {
        "reserved for benchmarking"
    } else if s[0] == 0x2001 && matches!(s[1] & 0xfff0, 0x0010 | 0x0020) {
        "ORCHID (not routable)"
    } else if s[0] == 0x5f00 {
        "SRv6 segment identifiers"
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(ip: &str) -> bool {
        Guard::default().check("h", ip.parse().unwrap()).is_err()
    }

    #[test]
    fn refuses_non_global_addresses() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "2002:a00:1::",
            // IPv4-compatible, site-local, Teredo (client 10.0.0.1, obfuscated),
            // 6to4 of 192.168.0.1, NAT64 local-use, discard, ORCHIDv2, SRv6,
            // the 2024 documentation prefix, the 6to4 relay anycast.
            "::10.0.0.1",
            "::127.0.0.1",
            "::a9fe:a9fe",
            "fec0::1",
            "feff::1",
            "2001:0:4136:e378:8000:63bf:f5ff:fffe",
            "2001::1",
            "2002:c0a8:1::1",
            "64:ff9b:1::a00:1",
            "100::1",
            "2001:20::1",
            "2001:10::1",
            "5f00::1",
            "3fff::1",
            "192.88.99.1",
        ] {
            assert!(refused(ip), "{ip} should be refused");
        }
        for ip in ["93.184.216.34", "1.1.1.1", "2606:4700::1111"] {
            assert!(!refused(ip), "{ip} is global");
        }
    }

    #[test]
    fn allowlist_permits() {
        let g = Guard::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(g.check("h", "127.0.0.1".parse().unwrap()).is_ok());
        // the mapped form of an allowlisted IPv4 address is that address
        assert!(g.check("h", "::ffff:127.0.0.1".parse().unwrap()).is_ok());
        assert!(g.check("h", "10.0.0.1".parse().unwrap()).is_err());
        let g = Guard::new(vec!["2001::/32".parse().unwrap()]);
        assert!(g.check("h", "2001::1".parse().unwrap()).is_ok());
    }

    #[tokio::test]
    async fn a_name_resolving_to_loopback_is_refused() {
        let err = Guard::default().resolve("localhost", 80).await.unwrap_err();
        assert!(
            matches!(&err, ResolveError::Refused(r) if r.reason.contains("loopback")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_name_that_does_not_resolve_is_not_a_refusal() {
        let err = Guard::default()
            .resolve("no-such-host.invalid", 80)
            .await
            .unwrap_err();
        assert!(matches!(err, ResolveError::Unresolved(_)), "{err}");
    }

    #[tokio::test]
    async fn a_trusted_host_is_not_checked() {
        let g = Guard::default().trusting("localhost");
        assert!(g.resolve("localhost", 80).await.is_ok());
        assert!(g.resolve("127.0.0.1", 80).await.is_err());
    }
}
