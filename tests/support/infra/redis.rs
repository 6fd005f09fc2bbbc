//! A throwaway `redis-server` per test binary, on a free loopback port.

use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use super::process;

/// A running test Redis.
pub struct TestRedis {
    pub port: u16,
    pub url: String,
    pub pid: u32,
}

static SHARED: OnceLock<TestRedis> = OnceLock::new();

/// What Debian packages redis-server and redis-cli in (installed together).
pub const REDIS_PACKAGES: &[&str] = &["redis-server", "redis-tools"];

/// The Redis server of this test binary, started on first use. Tests isolate
/// their keys by using a distinct ShardSet name or key prefix.
pub fn shared() -> &'static TestRedis {
    SHARED.get_or_init(start)
}

/// A Redis of its own, for a test that stops and restarts it.
pub fn dedicated() -> TestRedis {
    start_on(process::free_port())
}

/// Stop `redis` at once (SIGKILL).
pub fn kill(redis: &TestRedis) {
    process::signal(redis.pid, libc::SIGKILL);
    let _ = process::wait_exit(redis.pid, Duration::from_secs(10));
}

fn start() -> TestRedis {
    start_on(process::free_port())
}

/// Start a redis-server on `port` (again, after `kill`).
pub fn start_on(port: u16) -> TestRedis {
    start_on_with(port, &[])
}

/// A Redis of its own started with `extra` settings (`--maxmemory-policy
/// allkeys-lru`, `--tls-port ...`) after the defaults (no persistence), so
/// they win. Its plain-text port answers the harness's PING.
pub fn dedicated_with(extra: &[&str]) -> TestRedis {
    start_on_with(process::free_port(), extra)
}

/// [`start_on`] with `extra` settings.
pub fn start_on_with(port: u16, extra: &[&str]) -> TestRedis {
    let server = process::require_debian_program("redis-server", REDIS_PACKAGES);
    let dir = process::scratch_dir("redis");
    let log = dir.join("redis.log");
    let mut cmd = Command::new(server);
    cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ])
        .arg("--dir")
        .arg(&dir)
        .args(extra);
    let pid = process::spawn_server(cmd, &log);
    process::wait_until("redis-server", Duration::from_secs(20), &log, pid, || {
        ping(port)
    });
    TestRedis {
        port,
        url: format!("redis://127.0.0.1:{port}/"),
        pid,
    }
}

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 16];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// A real Redis Cluster of three primaries and three replicas on loopback
/// ports (`redis-server --cluster-enabled yes`, then `redis-cli --cluster
/// create`). Its servers are killed when it is dropped.
pub struct TestCluster {
    /// `redis+cluster://127.0.0.1:<port>,...` with every node as a seed.
    pub url: String,
    pub nodes: Vec<ClusterNode>,
    cli: std::path::PathBuf,
}

/// One server of a [`TestCluster`].
#[derive(Clone, Debug)]
pub struct ClusterNode {
    pub port: u16,
    pub pid: u32,
    pub log: std::path::PathBuf,
}

/// A node as `CLUSTER NODES` describes it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    /// The primary's id, for a replica.
    pub replica_of: Option<String>,
    /// Slot ranges, inclusive, for a primary.
    pub slots: Vec<(u16, u16)>,
}

impl NodeInfo {
    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }
}

impl TestCluster {
    /// Start six servers and make them a cluster with one replica per
    /// primary; returns once every node reports `cluster_state:ok` with all
    /// 16384 slots assigned and all six nodes known.
    pub fn start() -> TestCluster {
        let server = process::require_debian_program("redis-server", REDIS_PACKAGES);
        let cli = process::require_debian_program("redis-cli", REDIS_PACKAGES);
        let dir = process::scratch_dir("redis-cluster");
        let mut nodes = Vec::new();
        for i in 0..6 {
            let port = process::free_port();
            let bus = process::free_port();
            let node_dir = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&node_dir).expect("create a node directory");
            let log = node_dir.join("redis.log");
            let mut cmd = Command::new(&server);
            cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&node_dir);
            let pid = process::spawn_server(cmd, &log);
            process::wait_until("redis-server", Duration::from_secs(20), &log, pid, || {
                ping(port)
            });
            nodes.push(ClusterNode { port, pid, log });
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new(&cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = TestCluster {
            url: format!("redis+cluster://{}", addrs.join(",")),
            nodes,
            cli,
        };
        cluster.wait_healthy(Duration::from_secs(60));
        cluster
    }

    /// Run redis-cli against the node on `port`; its stdout.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new(&self.cli)
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Wait until every live node says `cluster_state:ok`, all slots are
    /// assigned, all nodes are known, and the nodes agree on who owns which
    /// slots.
    pub fn wait_healthy(&self, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let live: Vec<&ClusterNode> = self
                .nodes
                .iter()
                .filter(|n| process::is_running(n.pid))
                .collect();
            let ok = live.iter().all(|n| {
                let info = self.cli(n.port, &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_assigned:16384")
                    && info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
            });
            let views: std::collections::BTreeSet<String> = live
                .iter()
                .map(|n| {
                    let mut v: Vec<String> = self
                        .topology_from(n.port)
                        .into_iter()
                        .map(|i| match &i.replica_of {
                            None => format!("{}={:?}", i.port, i.slots),
                            Some(p) => format!("{}->{p}", i.port),
                        })
                        .collect();
                    v.sort();
                    v.join(";")
                })
                .collect();
            // Every replica has caught up with its primary (a coordinated
            // failover needs that) and every node sees every live node.
            let replicas_up = live.iter().all(|n| {
                let info = self.cli(n.port, &["INFO", "replication"]);
                info.contains("role:master") || info.contains("master_link_status:up")
            });
            let complete = views
                .iter()
                .next()
                .is_some_and(|v| v.split(';').count() == live.len());
            if ok && replicas_up && complete && views.len() == 1 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the test cluster did not become healthy within {timeout:?}: {}",
                self.cli(live[0].port, &["CLUSTER", "NODES"])
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The cluster as the first live node sees it.
    pub fn topology(&self) -> Vec<NodeInfo> {
        let node = self
            .nodes
            .iter()
            .find(|n| process::is_running(n.pid))
            .expect("a live node");
        self.topology_from(node.port)
    }

    fn topology_from(&self, port: u16) -> Vec<NodeInfo> {
        self.cli(port, &["CLUSTER", "NODES"])
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() < 8 || f[2].contains("fail") || f[2].contains("noaddr") {
                    return None;
                }
                let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
                let primary = f[2].contains("master");
                let slots = f[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| match s.split_once('-') {
                        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                        None => s.parse().ok().map(|a| (a, a)),
                    })
                    .collect();
                Some(NodeInfo {
                    id: f[0].to_string(),
                    port,
                    primary,
                    replica_of: (!primary).then(|| f[3].to_string()),
                    slots,
                })
            })
            .collect()
    }

    /// The hash slot of `key`.
    pub fn keyslot(&self, key: &str) -> u16 {
        self.cli(self.topology()[0].port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number")
    }

    /// The primary owning `slot`.
    pub fn primary_of(&self, slot: u16) -> NodeInfo {
        self.topology()
            .into_iter()
            .find(|n| n.primary && n.owns(slot))
            .unwrap_or_else(|| panic!("no primary owns slot {slot}"))
    }

    /// A replica of the primary with id `primary`.
    pub fn replica_of(&self, primary: &str) -> NodeInfo {
        self.topology()
            .into_iter()
            .find(|n| n.replica_of.as_deref() == Some(primary))
            .unwrap_or_else(|| panic!("primary {primary} has no replica"))
    }

    /// Number of keys on the node at `port`.
    pub fn dbsize(&self, port: u16) -> u64 {
        self.cli(port, &["DBSIZE"]).trim().parse().unwrap_or(0)
    }

    /// Promote the replica on `port` with a coordinated `CLUSTER FAILOVER`
    /// (the primary stops taking writes, the replica catches up, then takes
    /// over); returns once the replica is a primary and the cluster is healthy.
    pub fn failover(&self, replica_port: u16) {
        let answer = self.cli(replica_port, &["CLUSTER", "FAILOVER"]);
        assert!(answer.contains("OK"), "CLUSTER FAILOVER: {answer}");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !self.cli(replica_port, &["ROLE"]).starts_with("master") {
            assert!(
                std::time::Instant::now() < deadline,
                "the replica on {replica_port} was not promoted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_healthy(Duration::from_secs(30));
    }

    /// Move `slots` slots from the primary `from` to the primary `to` with
    /// `redis-cli --cluster reshard` (key by key, with MIGRATE); returns its
    /// output once it finished and the cluster is healthy.
    pub fn reshard(&self, from: &NodeInfo, to: &NodeInfo, slots: u32) -> String {
        let out = Command::new(&self.cli)
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", from.port)])
            .args(["--cluster-from", &from.id, "--cluster-to", &to.id])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster reshard");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && !text.contains("[ERR]"),
            "redis-cli --cluster reshard failed; the end of its output:\n{}",
            &text[(text.len().saturating_sub(1500)..)
                .find(|i| text.is_char_boundary(*i))
                .unwrap_or(0)..]
        );
        self.wait_healthy(Duration::from_secs(30));
        text
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for n in &self.nodes {
            if process::is_running(n.pid) {
                process::signal(n.pid, libc::SIGKILL);
                let _ = process::wait_exit(n.pid, Duration::from_secs(10));
            }
        }
    }
}

/// The value of `field` in an INFO reply's `field:value` lines (the
/// tests' and benches' reading of INFO; the store's own is private to
/// `store::settings`).
pub fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// Run redis-cli against the plain-text port of `redis`; its stdout (and
/// stderr, for error replies).
pub fn cli(redis: &TestRedis, args: &[&str]) -> String {
    let cli = process::require_program(
        "redis-cli",
        "install it with `apt-get install redis-tools` (the tests drive Redis with redis-cli)",
    );
    let out = Command::new(cli)
        .args(["-h", "127.0.0.1", "-p", &redis.port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A test certificate authority, a server certificate for 127.0.0.1 and
/// localhost, and a client certificate, made at test time (rcgen), as PEM
/// files in a scratch directory.
pub struct Pki {
    pub dir: std::path::PathBuf,
    pub ca: std::path::PathBuf,
    pub server_cert: std::path::PathBuf,
    pub server_key: std::path::PathBuf,
    pub client_cert: std::path::PathBuf,
    pub client_key: std::path::PathBuf,
}

impl Pki {
    pub fn generate() -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let dir = process::scratch_dir("redis-pki");
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "lanekeeper-test-redis-ca");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("self-sign the CA");
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |names: Vec<String>, cn: &str, usage: Vec<ExtendedKeyUsagePurpose>| {
            let key = KeyPair::generate().expect("leaf key");
            let mut p = CertificateParams::new(names).expect("leaf params");
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = usage;
            let cert = p.signed_by(&key, &issuer).expect("sign a leaf");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            "redis",
            // A cluster node is also a TLS client of the others (cluster bus,
            // replication) with the same certificate.
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client_cert, client_key) = leaf(
            Vec::new(),
            "lanekeeper",
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        );
        let write = |name: &str, body: &str| {
            let path = dir.join(name);
            std::fs::write(&path, body).expect("write a pki file");
            path
        };
        Pki {
            ca: write("ca.crt", &ca_cert.pem()),
            server_cert: write("redis.crt", &server_cert),
            server_key: write("redis.key", &server_key),
            client_cert: write("client.crt", &client_cert),
            client_key: write("client.key", &client_key),
            dir,
        }
    }

    /// The redis-server settings that serve TLS on `tls_port` with this
    /// PKI; `clients`: `tls-auth-clients` (`yes`, `no` or `optional`).
    pub fn server_args(&self, tls_port: u16, clients: &str) -> Vec<String> {
        vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            self.server_cert.display().to_string(),
            "--tls-key-file".into(),
            self.server_key.display().to_string(),
            "--tls-ca-cert-file".into(),
            self.ca.display().to_string(),
            "--tls-auth-clients".into(),
            clients.into(),
        ]
    }

    pub fn tls(&self, client: bool) -> lanekeeper::store::RedisTls {
        lanekeeper::store::RedisTls {
            ca: Some(std::fs::read(&self.ca).unwrap()),
            client: client.then(|| {
                (
                    std::fs::read(&self.client_cert).unwrap(),
                    std::fs::read(&self.client_key).unwrap(),
                )
            }),
        }
    }
}

/// A Redis serving TLS on a port of its own (and plain text on `port`,
/// for the harness), with `extra` settings.
pub struct TlsRedis {
    pub redis: TestRedis,
    pub tls_port: u16,
    pub pki: Pki,
}

impl TlsRedis {
    pub fn start(clients: &str, extra: &[&str]) -> TlsRedis {
        let pki = Pki::generate();
        let tls_port = process::free_port();
        let mut args: Vec<String> = pki.server_args(tls_port, clients);
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let redis = dedicated_with(&args);
        TlsRedis {
            redis,
            tls_port,
            pki,
        }
    }

    /// `rediss://[userinfo@]127.0.0.1:<tls port>/`.
    pub fn url(&self, userinfo: &str) -> String {
        format!("rediss://{userinfo}127.0.0.1:{}/", self.tls_port)
    }
}
