//! A real Kubernetes control plane for tests: etcd and kube-apiserver, and
//! for tests that need pods and Deployment status, kube-controller-manager,
//! kube-scheduler and kwok (fake nodes that make pods Ready).
//!
//! The binaries are compiled from their Go modules by
//! `tests/controlplane/build.sh` (pinned, cached under ~/.cache/lanekeeper).
//! Each test binary starts its own control plane on free loopback ports in a
//! scratch directory, with TLS, token authentication for an admin identity
//! and RBAC authorization, as a real cluster has. Several test binaries can
//! run at once.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::process;

/// Which components to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Components {
    /// etcd and kube-apiserver: enough for CRDs, validation and plain objects.
    ApiServer,
    /// Also kube-controller-manager, kube-scheduler and a kwok fake node:
    /// Deployments create pods, pods become Ready, Deployments report availability,
    /// garbage collection runs.
    Full,
}

/// A running control plane.
pub struct ControlPlane {
    /// Scratch directory with certificates, kubeconfigs and component logs.
    pub dir: PathBuf,
    /// Kubeconfig of the admin identity (group `system:masters`).
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    pub components: Components,
    /// Seconds from the first process spawned to ready (not counting the build).
    pub start_seconds: f64,
}

static API_ONLY: OnceLock<ControlPlane> = OnceLock::new();
static FULL: OnceLock<ControlPlane> = OnceLock::new();

/// The API-server-only control plane of this test binary, started on first use.
pub fn api_server() -> &'static ControlPlane {
    API_ONLY.get_or_init(|| ControlPlane::start(Components::ApiServer))
}

/// The full control plane (with controller-manager, scheduler and kwok) of
/// this test binary, started on first use.
pub fn full() -> &'static ControlPlane {
    FULL.get_or_init(|| ControlPlane::start(Components::Full))
}

/// The full control plane with the CRDs installed (once per test binary).
pub fn full_with_crds() -> &'static ControlPlane {
    static READY: OnceLock<()> = OnceLock::new();
    let cp = full();
    READY.get_or_init(|| {
        cp.install_crds();
    });
    cp
}

/// Directory holding the compiled control-plane binaries, building them first
/// if the cache is cold. `LANEKEEPER_CONTROLPLANE_BIN` overrides it.
pub fn binaries() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(dir) = std::env::var_os("LANEKEEPER_CONTROLPLANE_BIN") {
            return PathBuf::from(dir);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/controlplane/build.sh");
        eprintln!("control plane: ensuring binaries with {}", script.display());
        let out = Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed (see its output above); it needs Go >= 1.24 and the Go module proxy",
            script.display()
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout.lines().last().unwrap_or_default().trim().to_string();
        PathBuf::from(dir)
    })
    .clone()
}

const ADMIN_TOKEN: &str = "lanekeeper-admin-token";
const COMPONENT_TOKEN: &str = "lanekeeper-components-token";

impl ControlPlane {
    fn start(components: Components) -> ControlPlane {
        let kubectl = process::require_program(
            "kubectl",
            "install kubectl (the end-to-end tests drive the API server with the real kubectl)",
        );
        let bin = binaries();
        let began = Instant::now();
        let dir = process::scratch_dir("controlplane");
        let pki = Pki::generate(&dir);

        // etcd
        let etcd_port = process::free_port();
        let peer_port = process::free_port();
        let etcd_log = dir.join("etcd.log");
        let mut etcd = Command::new(bin.join("etcd"));
        etcd.arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"))
            .arg(format!(
                "--advertise-client-urls=http://127.0.0.1:{etcd_port}"
            ))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"
            ))
            .arg(format!(
                "--initial-cluster=default=http://127.0.0.1:{peer_port}"
            ))
            .arg("--unsafe-no-fsync=true")
            .arg("--log-level=warn");
        let etcd_pid = process::spawn_server(etcd, &etcd_log);
        process::wait_until("etcd", Duration::from_secs(30), &etcd_log, etcd_pid, || {
            http_get(etcd_port, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
        });

        // kube-apiserver
        let api_port = process::free_port();
        let server = format!("https://127.0.0.1:{api_port}");
        std::fs::write(
            dir.join("tokens.csv"),
            format!(
                "{ADMIN_TOKEN},lanekeeper-admin,uid-admin,\"system:masters\"\n\
                 {COMPONENT_TOKEN},lanekeeper-components,uid-components,\"system:masters\"\n"
            ),
        )
        .expect("write tokens.csv");
        let kubeconfig = write_kubeconfig(&dir, "admin", &server, &pki.ca_cert, ADMIN_TOKEN);
        let components_kubeconfig =
            write_kubeconfig(&dir, "components", &server, &pki.ca_cert, COMPONENT_TOKEN);
        let api_log = dir.join("kube-apiserver.log");
        let mut api = Command::new(bin.join("kube-apiserver"));
        api.arg(format!("--etcd-servers=http://127.0.0.1:{etcd_port}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={api_port}"))
            .arg(format!(
                "--cert-dir={}",
                dir.join("apiserver-certs").display()
            ))
            .arg(format!("--tls-cert-file={}", pki.server_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.server_key.display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca_cert.display()))
            .arg(format!(
                "--token-auth-file={}",
                dir.join("tokens.csv").display()
            ))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!(
                "--service-account-key-file={}",
                pki.sa_public.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.sa_key.display()
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/24")
            .arg("--allow-privileged=true")
            .arg("--enable-priority-and-fairness=false")
            .arg("--profiling=false")
            .arg("--v=1");
        let api_pid = process::spawn_server(api, &api_log);
        process::wait_until(
            "kube-apiserver",
            Duration::from_secs(90),
            &api_log,
            api_pid,
            || {
                Command::new(&kubectl)
                    .arg(format!("--kubeconfig={}", kubeconfig.display()))
                    .args(["get", "--raw", "/readyz"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            },
        );

        let cp = ControlPlane {
            dir: dir.clone(),
            kubeconfig,
            server,
            components,
            start_seconds: 0.0,
        };

        if components == Components::Full {
            cp.start_rest(&bin, &components_kubeconfig, &pki);
        }
        let start_seconds = began.elapsed().as_secs_f64();
        eprintln!(
            "control plane ({components:?}) ready at {} in {start_seconds:.1}s; logs in {}",
            cp.server,
            dir.display()
        );
        ControlPlane {
            start_seconds,
            ..cp
        }
    }

    /// A kube-controller-manager or kube-scheduler command with what both
    /// need: the component identity for API access and delegated auth, no
    /// leader election, and a private serving port and cert dir.
    fn component(&self, bin: &Path, name: &str, kubeconfig: &Path) -> Command {
        let kc = kubeconfig.display();
        let mut cmd = Command::new(bin.join(name));
        cmd.arg(format!("--kubeconfig={kc}"))
            .arg(format!("--authentication-kubeconfig={kc}"))
            .arg(format!("--authorization-kubeconfig={kc}"))
            .arg("--leader-elect=false")
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", process::free_port()))
            .arg(format!(
                "--cert-dir={}",
                self.dir.join(format!("{name}-certs")).display()
            ))
            .arg("--v=1");
        cmd
    }

    fn start_rest(&self, bin: &Path, kubeconfig: &Path, pki: &Pki) {
        let kc = format!("{}", kubeconfig.display());

        let kcm_log = self.dir.join("kube-controller-manager.log");
        let mut kcm = self.component(bin, "kube-controller-manager", kubeconfig);
        kcm.arg(format!(
            "--service-account-private-key-file={}",
            pki.sa_key.display()
        ))
        .arg(format!("--root-ca-file={}", pki.ca_cert.display()))
        .arg("--controllers=*")
        .arg("--concurrent-deployment-syncs=10")
        .arg("--concurrent-replicaset-syncs=10")
        // A fake node's heartbeat may lag on a loaded 2-core machine; never evict for it.
        .arg("--node-monitor-grace-period=10m");
        let kcm_pid = process::spawn_server(kcm, &kcm_log);

        let sched_log = self.dir.join("kube-scheduler.log");
        let sched = self.component(bin, "kube-scheduler", kubeconfig);
        let sched_pid = process::spawn_server(sched, &sched_log);

        let kwok_log = self.dir.join("kwok.log");
        let mut kwok = Command::new(bin.join("kwok"));
        kwok.arg(format!("--kubeconfig={kc}"))
            .arg("--manage-all-nodes=false")
            .arg("--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake")
            .arg("--cidr=10.244.0.0/16")
            .arg("--node-ip=10.0.0.1")
            // Heartbeats through the node Lease, so the fake node never goes NotReady.
            .arg("--node-lease-duration-seconds=40")
            .arg(format!(
                "--server-address=127.0.0.1:{}",
                process::free_port()
            ));
        let kwok_pid = process::spawn_server(kwok, &kwok_log);

        // A fake node kwok keeps Ready. No taints, so pods need no tolerations.
        // Room for the idle_load bench (50 sets x 16 shards = 800 pods).
        let node = r#"{
          "apiVersion": "v1", "kind": "Node",
          "metadata": {
            "name": "kwok-node-0",
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": "kwok-node-0",
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
          },
          "status": {
            "allocatable": {"cpu": "2000", "memory": "8Ti", "pods": "2000"},
            "capacity": {"cpu": "2000", "memory": "8Ti", "pods": "2000"}
          }
        }"#;
        self.kubectl_stdin(&["apply", "-f", "-"], node);
        process::wait_until(
            "kwok fake node Ready",
            Duration::from_secs(60),
            &kwok_log,
            kwok_pid,
            || {
                self.kubectl()
                    .args([
                        "get",
                        "node",
                        "kwok-node-0",
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                    ])
                    .output()
                    .is_ok_and(|o| o.stdout == b"True")
            },
        );
        // Pods need the namespace's default ServiceAccount, which the controller-manager creates.
        process::wait_until(
            "default ServiceAccount (kube-controller-manager)",
            Duration::from_secs(60),
            &kcm_log,
            kcm_pid,
            || {
                self.kubectl()
                    .args(["get", "serviceaccount", "default", "-n", "default"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            },
        );
        assert!(
            process::is_running(sched_pid),
            "kube-scheduler exited:\n{}",
            process::tail(&sched_log, 40)
        );
    }

    /// Apply the repository's `crds/` and wait until both are Established.
    /// Returns kubectl's output.
    pub fn install_crds(&self) -> String {
        let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
        let out = self.kubectl_ok(&["apply", "-f", &crds.display().to_string()]);
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/shardsets.lanekeeper.io",
            "crd/dedicatedlanes.lanekeeper.io",
        ]);
        out
    }

    /// Start `lanekeeper controller` watching `ns`, electing its leader
    /// through a Lease of that namespace; `extra` flags are appended.
    pub fn spawn_controller(&self, ns: &str, extra: &[&str]) -> u32 {
        self.spawn_controller_env(ns, extra, &[]).0
    }

    /// Like [`Self::spawn_controller`], with extra environment variables;
    /// returns the pid and the path of the controller's log.
    pub fn spawn_controller_env(
        &self,
        ns: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (u32, PathBuf) {
        self.spawn_controller_as(&self.kubeconfig, ns, extra, env)
    }

    /// Start `lanekeeper controller` for `ns` under ServiceAccount
    /// `ns/lanekeeper-controller`, with exactly the rights the chart and
    /// `config/rbac` give it: the `lanekeeper-controller` ClusterRole (bound
    /// in `ns` only) and the leader-election Role. Returns the pid and log.
    pub fn spawn_controller_with_rbac(
        &self,
        ns: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (u32, PathBuf) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        // The ClusterRole is cluster-wide: applied once per control plane
        // (tests applying it at the same time conflict: AlreadyExists).
        static APPLIED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut applied = APPLIED.lock().unwrap_or_else(|e| e.into_inner());
        if !applied.contains(&self.server) {
            self.kubectl_ok(&[
                "apply",
                "-f",
                &root.join("config/rbac/role.yaml").display().to_string(),
            ]);
            applied.push(self.server.clone());
        }
        drop(applied);
        let election =
            std::fs::read_to_string(root.join("config/components/leader-election/role.yaml"))
                .expect("read the leader-election Role")
                .replace("namespace: lanekeeper-system", &format!("namespace: {ns}"));
        self.kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &election);
        let kubeconfig = self.service_account_kubeconfig(ns, "lanekeeper-controller");
        self.kubectl_ok(&[
            "create",
            "rolebinding",
            "lanekeeper-controller",
            "-n",
            ns,
            "--clusterrole=lanekeeper-controller",
            &format!("--serviceaccount={ns}:lanekeeper-controller"),
        ]);
        self.spawn_controller_as(&kubeconfig, ns, extra, env)
    }

    /// A kubeconfig for ServiceAccount `ns/name` (created if it is missing),
    /// with a token the API server issued for it (TokenRequest, one day).
    pub fn service_account_kubeconfig(&self, ns: &str, name: &str) -> PathBuf {
        let exists = self
            .kubectl()
            .args(["get", "serviceaccount", name, "-n", ns])
            .output()
            .expect("run kubectl")
            .status
            .success();
        if !exists {
            self.kubectl_ok(&["create", "serviceaccount", name, "-n", ns]);
        }
        let token = self.kubectl_ok(&["create", "token", name, "-n", ns, "--duration=24h"]);
        write_kubeconfig(
            &self.dir,
            &format!("{ns}-{name}"),
            &self.server,
            &self.dir.join("pki/ca.crt"),
            token.trim(),
        )
    }

    /// The attacker of the RBAC tests: ServiceAccount `ns/shardset-author`,
    /// who may do anything to ShardSets and DedicatedLanes in `ns` and read
    /// Deployments, pods and Events there, but may not create pods or
    /// Deployments and may not read Secrets. Returns her kubeconfig (use it
    /// with [`Self::kubectl_as`]).
    pub fn shardset_author(&self, ns: &str) -> PathBuf {
        let role = format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: shardset-author\n  namespace: {ns}\n\
             rules:\n\
             - apiGroups: [lanekeeper.io]\n  resources: [shardsets, dedicatedlanes]\n  verbs: ['*']\n\
             - apiGroups: ['', apps, events.k8s.io]\n  resources: [pods, deployments, replicasets, events]\n  verbs: [get, list, watch]\n"
        );
        self.kubectl_stdin(&["apply", "-f", "-"], &role);
        let kubeconfig = self.service_account_kubeconfig(ns, "shardset-author");
        self.kubectl_ok(&[
            "create",
            "rolebinding",
            "shardset-author",
            "-n",
            ns,
            "--role=shardset-author",
            &format!("--serviceaccount={ns}:shardset-author"),
        ]);
        kubeconfig
    }

    /// `kubectl` bound to another identity's kubeconfig.
    pub fn kubectl_as(&self, kubeconfig: &Path) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()));
        cmd
    }

    /// Start `lanekeeper controller` for `ns` with the identity of `kubeconfig`.
    pub fn spawn_controller_as(
        &self,
        kubeconfig: &Path,
        ns: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> (u32, PathBuf) {
        let dir = process::scratch_dir("controller");
        let log = dir.join("controller.log");
        let mut cmd = Command::new(super::process::lanekeeper_bin());
        cmd.args(["controller", "--namespace", ns, "--lease-namespace", ns])
            .args(extra)
            .args([
                "--metrics-addr",
                &format!("127.0.0.1:{}", process::free_port()),
            ])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        (process::spawn_server(cmd, &log), log)
    }

    /// `kubectl` bound to this control plane's admin kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()));
        cmd
    }

    /// Run kubectl and return its stdout; panic with stderr if it fails.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl().args(args).output().expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl {} failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Run kubectl with `input` on stdin and return the raw output.
    pub fn kubectl_stdin_output(&self, args: &[&str], input: &str) -> Output {
        with_stdin(self.kubectl().args(args), input)
    }

    /// Run kubectl as another identity (its kubeconfig) with `input` on
    /// stdin and return the raw output.
    pub fn kubectl_as_stdin_output(&self, who: &Path, args: &[&str], input: &str) -> Output {
        with_stdin(self.kubectl_as(who).args(args), input)
    }

    /// Run kubectl with `input` on stdin; panic with stderr if it fails.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> String {
        let out = self.kubectl_stdin_output(args, input);
        assert!(
            out.status.success(),
            "kubectl {} failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The API server's own request counter (`apiserver_request_total`),
    /// summed per verb, group, resource and subresource; watches included.
    pub fn request_counts(&self) -> Vec<RequestCount> {
        let text = self.kubectl_ok(&["get", "--raw", "/metrics"]);
        let mut out: Vec<RequestCount> = Vec::new();
        for line in text.lines() {
            let Some((labels, value)) = line
                .strip_prefix("apiserver_request_total{")
                .and_then(|r| r.rsplit_once("} "))
            else {
                continue;
            };
            let label = |k: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
                    .unwrap_or_default()
            };
            let key = RequestCount {
                verb: label("verb"),
                group: label("group"),
                resource: label("resource"),
                subresource: label("subresource"),
                count: 0.0,
            };
            let n = value.trim().parse::<f64>().unwrap_or(0.0);
            match out.iter_mut().find(|c| c.same_kind(&key)) {
                Some(c) => c.count += n,
                None => out.push(RequestCount { count: n, ..key }),
            }
        }
        out
    }

    /// A kube client with the admin identity.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig =
            kube::config::Kubeconfig::read_from(&self.kubeconfig).expect("read kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .expect("load kubeconfig");
        kube::Client::try_from(config).expect("build kube client")
    }

    /// Create a namespace with a unique name and return it.
    pub fn namespace(&self, prefix: &str) -> String {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        self.kubectl_ok(&["create", "namespace", &name]);
        name
    }
}

/// One line of `apiserver_request_total`, summed over its other labels.
#[derive(Clone, Debug)]
pub struct RequestCount {
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub subresource: String,
    pub count: f64,
}

impl RequestCount {
    fn same_kind(&self, other: &RequestCount) -> bool {
        (&self.verb, &self.group, &self.resource, &self.subresource)
            == (
                &other.verb,
                &other.group,
                &other.resource,
                &other.subresource,
            )
    }

    /// `VERB resource[/subresource]`.
    pub fn key(&self) -> String {
        if self.subresource.is_empty() {
            format!("{} {}", self.verb, self.resource)
        } else {
            format!("{} {}/{}", self.verb, self.resource, self.subresource)
        }
    }
}

struct Pki {
    ca_cert: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    sa_key: PathBuf,
    sa_public: PathBuf,
}

impl Pki {
    fn generate(dir: &Path) -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
        };
        let pki = dir.join("pki");
        std::fs::create_dir_all(&pki).expect("create pki dir");

        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "lanekeeper-test-ca");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("self-sign CA");
        let issuer = Issuer::new(ca, ca_key);

        let server_key = KeyPair::generate().expect("server key");
        let mut server = CertificateParams::new(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
            "kubernetes.default.svc".to_string(),
        ])
        .expect("server params");
        server
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        let server_cert = server
            .signed_by(&server_key, &issuer)
            .expect("sign server cert");

        let sa_key = KeyPair::generate().expect("service account key");

        let write = |name: &str, body: String| {
            let path = pki.join(name);
            std::fs::write(&path, body).expect("write pki file");
            path
        };
        Pki {
            ca_cert: write("ca.crt", ca_cert.pem()),
            server_cert: write("apiserver.crt", server_cert.pem()),
            server_key: write("apiserver.key", server_key.serialize_pem()),
            sa_key: write("sa.key", sa_key.serialize_pem()),
            sa_public: write("sa.pub", sa_key.public_key_pem()),
        }
    }
}

fn write_kubeconfig(dir: &Path, user: &str, server: &str, ca: &Path, token: &str) -> PathBuf {
    let path = dir.join(format!("{user}.kubeconfig"));
    let body = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: {user}\n  user:\n    token: {token}\n\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: {user}\n    namespace: default\n\
         current-context: test\n",
        ca = ca.display()
    );
    std::fs::write(&path, body).expect("write kubeconfig");
    path
}

/// Run `cmd` with `input` on its stdin and return its output.
fn with_stdin(cmd: &mut Command, input: &str) -> Output {
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl");
    child
        .stdin
        .take()
        .expect("kubectl stdin")
        .write_all(input.as_bytes())
        .expect("write kubectl stdin");
    child.wait_with_output().expect("wait for kubectl")
}

/// A plain HTTP GET on loopback, for etcd's health endpoint.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}
