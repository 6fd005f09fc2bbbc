//! SSRF guard: webhook URLs come from tenants, so a delivery must not reach
//! the cluster's own network. The host is resolved once, every address is
//! checked, and the connection goes to the addresses that were checked (the
//! resolver below is the HTTP client's only resolver, so there is no second
//! lookup to rebind). Loopback, private, link-local and other non-global
//! addresses are refused unless an allowlist of CIDRs permits them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

/// Which non-global addresses deliveries may reach anyway.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    allow: Arc<Vec<IpNet>>,
}

/// A refused destination, with the reason that goes into the dead letter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SSRF guard refused {host}: {reason}")]
pub struct Refused {
    pub host: String,
    pub reason: String,
}

impl Guard {
    pub fn new(allow: Vec<IpNet>) -> Self {
        Self {
            allow: Arc::new(allow),
        }
    }

    /// Refuse `ip` unless it is global or allowlisted.
    pub fn check(&self, host: &str, ip: IpAddr) -> Result<(), Refused> {
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

    /// Resolve `host` and check every address; all must pass.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Refused> {
        let refused = |reason: String| Refused {
            host: host.to_string(),
            reason,
        };
        if let Ok(ip) = host
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<IpAddr>()
        {
            self.check(host, ip)?;
            return Ok(vec![SocketAddr::new(ip, port)]);
        }
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| refused(format!("cannot resolve: {e}")))?
            .collect();
        if addrs.is_empty() {
            return Err(refused("resolves to no address".into()));
        }
        for a in &addrs {
            self.check(host, a.ip())?;
        }
        Ok(addrs)
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
    } else if (s[0] & 0xfe00) == 0xfc00 {
        "unique local (private)"
    } else if (s[0] & 0xffc0) == 0xfe80 {
        "link-local"
    } else if s[0] == 0x2001 && s[1] == 0x0db8 {
        "reserved for documentation"
    } else if s[0] == 0x64 && s[1] == 0xff9b {
        // NAT64 can reach IPv4 private space
        "NAT64"
    } else if s[0] == 0x2002 {
        "6to4 (can embed a private IPv4 address)"
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
        assert!(g.check("h", "10.0.0.1".parse().unwrap()).is_err());
    }

    #[tokio::test]
    async fn a_name_resolving_to_loopback_is_refused() {
        let err = Guard::default().resolve("localhost", 80).await.unwrap_err();
        assert!(err.reason.contains("loopback"), "{err}");
    }
}
