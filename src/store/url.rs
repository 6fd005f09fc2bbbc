//! Redis URLs: TLS and cluster schemes, a cluster URL's seed nodes, and
//! putting a user name or password in (and redacting it out of) a URL.

/// Is `url` a TLS URL (`rediss://` or `rediss+cluster://`)?
pub fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("rediss+cluster://")
}

/// The URL schemes that mean Redis Cluster.
pub const CLUSTER_SCHEMES: [&str; 2] = ["redis+cluster", "rediss+cluster"];

/// The seed nodes of a Redis Cluster URL, as one `redis://` (or `rediss://`)
/// URL each: `redis+cluster://[user:password@]host:port[,host:port...][/][?query]`
/// gives `redis://[user:password@]host:port[?query]` per node (port 6379
/// when omitted). `None` when `url` is not a cluster URL. A cluster has only
/// database 0, so a path other than `/` or `/0` is an error.
pub fn cluster_nodes(url: &str) -> Option<std::result::Result<Vec<String>, String>> {
    let (scheme, rest) = url.split_once("://")?;
    let base = match scheme {
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        _ => return None,
    };
    Some((|| {
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (path, query) = match tail.split_once('?') {
            Some((p, q)) => (p, format!("?{q}")),
            None => (tail, String::new()),
        };
        if !matches!(path, "" | "/" | "/0") {
            return Err(format!(
                "redis url {:?}: a cluster has only database 0, not {path:?}",
                redact(url)
            ));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        let mut nodes = Vec::new();
        for host in hosts.split(',') {
            if host.is_empty() {
                return Err(format!(
                    "redis url {:?}: empty host in the node list",
                    redact(url)
                ));
            }
            let has_port = match host.rfind(']') {
                Some(i) => host[i..].contains(':'),
                None => host.contains(':'),
            };
            let port = if has_port { "" } else { ":6379" };
            let node = format!("{base}://{userinfo}{host}{port}{query}");
            url::Url::parse(&node)
                .map_err(|e| format!("redis url {:?}: node {host:?}: {e}", redact(url)))?;
            nodes.push(node);
        }
        Ok(nodes)
    })())
}

/// `url` as a Redis Cluster URL when `cluster` is set (a ShardSet's
/// `spec.redis.cluster`): `redis://` becomes `redis+cluster://` and
/// `rediss://` `rediss+cluster://`. Otherwise, or when it names a cluster
/// already, `url` unchanged.
pub fn cluster_url(url: &str, cluster: bool) -> String {
    match url.split_once("://") {
        Some((scheme @ ("redis" | "rediss"), rest)) if cluster => {
            format!("{scheme}+cluster://{rest}")
        }
        _ => url.to_string(),
    }
}

/// `url` with any password replaced by `***`, for messages. The userinfo
/// is taken to end at the *last* `@` (a password typed unencoded may hold
/// `/`, `?`, `#` or `@`), and a URL without a scheme is read as one without
/// `scheme://`, so a typo cannot make a password show; at worst a query
/// holding `@` is hidden too.
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _)) if !user.contains(['/', '?', '#']) => {
                format!("{scheme}{user}:***@{hosts}")
            }
            _ => format!("{scheme}***@{hosts}"),
        },
        None => url.to_string(),
    }
}

/// `url` with `password` set (for a Redis whose password lives in its own Secret).
/// A cluster URL (`redis+cluster://host:port,host:port`) gets it once, for
/// every node.
pub fn with_password(url: &str, password: &str) -> std::result::Result<String, String> {
    if let Some(nodes) = cluster_nodes(url) {
        nodes?;
        let (scheme, authority, tail) = cluster_parts(url);
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (u.split_once(':').map_or(u, |(u, _)| u), h),
            None => ("", authority),
        };
        // Percent-encode the password as a URL's userinfo wants it.
        let mut encoder = url::Url::parse("redis://host").expect("a valid url");
        encoder
            .set_password(Some(password))
            .map_err(|_| format!("redis url {:?} cannot carry a password", redact(url)))?;
        let encoded = encoder.password().unwrap_or_default();
        return Ok(format!("{scheme}://{user}:{encoded}@{hosts}{tail}"));
    }
    let mut u = url::Url::parse(url).map_err(|e| format!("redis url {:?}: {e}", redact(url)))?;
    u.set_password(Some(password))
        .map_err(|_| format!("redis url {:?} cannot carry a password", redact(url)))?;
    Ok(u.to_string())
}

/// `url` with the ACL user `username` (a ShardSet's `spec.redis.username`),
/// keeping any password: `redis://host` becomes `redis://user@host`, and a
/// cluster URL carries the user once, for every node. Apply it before
/// [`with_password`]. A user name that a URL cannot carry (empty, or a
/// control character) is an error.
pub fn with_username(url: &str, username: &str) -> std::result::Result<String, String> {
    if username.is_empty() || username.chars().any(|c| c.is_control() || c == ' ') {
        return Err(format!(
            "redis username {username:?}: must be non-empty, without spaces or control characters"
        ));
    }
    // Percent-encode the user name as a URL's userinfo wants it.
    let mut encoder = url::Url::parse("redis://host").expect("a valid url");
    encoder
        .set_username(username)
        .map_err(|_| format!("redis username {username:?} cannot be put in a URL"))?;
    let encoded = encoder.username().to_string();
    if let Some(nodes) = cluster_nodes(url) {
        nodes?;
        let (scheme, authority, tail) = cluster_parts(url);
        let (password, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (u.split_once(':').map(|(_, p)| p), h),
            None => (None, authority),
        };
        let userinfo = match password {
            Some(p) => format!("{encoded}:{p}@"),
            None => format!("{encoded}@"),
        };
        return Ok(format!("{scheme}://{userinfo}{hosts}{tail}"));
    }
    let mut u = url::Url::parse(url).map_err(|e| format!("redis url {}: {e}", redact(url)))?;
    u.set_username(username)
        .map_err(|_| format!("redis url {} cannot carry a user name", redact(url)))?;
    Ok(u.to_string())
}

/// A cluster URL's scheme, its authority (`[userinfo@]host:port,...`) and
/// the rest (path and query).
fn cluster_parts(url: &str) -> (&str, &str, &str) {
    let (scheme, rest) = url.split_once("://").expect("a cluster url has a scheme");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    (scheme, authority, tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_give_one_url_per_seed_node() {
        assert_eq!(cluster_nodes("redis://h:1/0"), None);
        assert_eq!(
            cluster_nodes("redis+cluster://a:7000,b:7001,c")
                .unwrap()
                .unwrap(),
            vec!["redis://a:7000", "redis://b:7001", "redis://c:6379"]
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://u:p%40ss@a:7000,[::1]:7001/?protocol=resp3")
                .unwrap()
                .unwrap(),
            vec![
                "rediss://u:p%40ss@a:7000?protocol=resp3",
                "rediss://u:p%40ss@[::1]:7001?protocol=resp3"
            ]
        );
        assert!(cluster_nodes("redis+cluster://a:1/3").unwrap().is_err());
        assert!(cluster_nodes("redis+cluster://a:1,,b:2").unwrap().is_err());
        assert!(cluster_nodes("redis+cluster://a:notaport")
            .unwrap()
            .is_err());
    }

    #[test]
    fn a_password_goes_to_every_cluster_node() {
        let url = with_password("redis+cluster://a:7000,b:7001/", "p@ss word").unwrap();
        assert_eq!(url, "redis+cluster://:p%40ss%20word@a:7000,b:7001/");
        assert_eq!(
            cluster_nodes(&url).unwrap().unwrap(),
            vec![
                "redis://:p%40ss%20word@a:7000",
                "redis://:p%40ss%20word@b:7001"
            ]
        );
        assert_eq!(
            with_password("redis://r:6379/0", "x").unwrap(),
            "redis://:x@r:6379/0"
        );
    }

    #[test]
    fn an_acl_user_name_goes_beside_the_password() {
        let url = with_username("redis://r:6379/0", "lanekeeper").unwrap();
        assert_eq!(url, "redis://lanekeeper@r:6379/0");
        assert_eq!(
            with_password(&url, "p@ss").unwrap(),
            "redis://lanekeeper:p%40ss@r:6379/0"
        );
        let cluster = with_username("rediss+cluster://a:7000,b:7001/", "lk").unwrap();
        assert_eq!(cluster, "rediss+cluster://lk@a:7000,b:7001/");
        let both = with_password(&cluster, "pw").unwrap();
        assert_eq!(both, "rediss+cluster://lk:pw@a:7000,b:7001/");
        assert_eq!(
            cluster_nodes(&both).unwrap().unwrap(),
            vec!["rediss://lk:pw@a:7000", "rediss://lk:pw@b:7001"]
        );
        assert!(with_username("redis://r", "").is_err());
        assert!(with_username("redis://r", "a b").is_err());
        assert_eq!(redact(&both), "rediss+cluster://lk:***@a:7000,b:7001/");
    }

    #[test]
    fn the_cluster_flag_turns_a_url_into_a_cluster_url() {
        assert_eq!(cluster_url("redis://r:6379/0", false), "redis://r:6379/0");
        assert_eq!(
            cluster_url("redis://r:6379", true),
            "redis+cluster://r:6379"
        );
        assert_eq!(
            cluster_url("rediss://:pw@r:6379", true),
            "rediss+cluster://:pw@r:6379"
        );
        assert_eq!(
            cluster_url("redis+cluster://a:1,b:2", true),
            "redis+cluster://a:1,b:2"
        );
        assert_eq!(
            redact("redis+cluster://u:secret@a:1,b:2/?x=1"),
            "redis+cluster://u:***@a:1,b:2/?x=1"
        );
        assert_eq!(redact("redis://r:6379/0"), "redis://r:6379/0");
    }
}
