//! Child processes that live as long as the test binary and no longer.
//!
//! Servers are spawned from one long-lived thread with `PR_SET_PDEATHSIG`, so
//! the kernel kills them if the test binary dies (even by SIGKILL; the signal
//! follows the *thread* that spawned them, hence the dedicated thread). On a
//! normal exit, passed or failed, an `atexit` hook stops them and removes
//! their scratch directories.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

static CHILDREN: Mutex<Vec<Child>> = Mutex::new(Vec::new());
static SCRATCH: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

type Job = Box<dyn FnOnce() + Send>;
static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();

extern "C" fn cleanup_at_exit() {
    stop_all();
}

/// Stop every server this binary started and remove their scratch directories.
pub fn stop_all() {
    let mut children = CHILDREN.lock().unwrap_or_else(|e| e.into_inner());
    for child in children.iter() {
        // SIGTERM first so etcd and the API server shut down cleanly.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for child in children.iter_mut() {
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    children.clear();
    for dir in SCRATCH.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn install_hook() {
    HOOK.call_once(|| unsafe {
        libc::atexit(cleanup_at_exit);
    });
}

/// Run `job` on the spawner thread, which lives as long as the process.
fn on_spawner<T: Send + 'static>(job: impl FnOnce() -> T + Send + 'static) -> T {
    let sender = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("test-server-spawner".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
                // The sender lives in a static, so this loop never ends.
            })
            .expect("spawn the test-server spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::channel();
    sender
        .lock()
        .unwrap()
        .send(Box::new(move || {
            let _ = tx.send(job());
        }))
        .expect("spawner thread is alive");
    rx.recv().expect("spawner thread answered")
}

/// A fresh scratch directory, removed when the test binary exits.
pub fn scratch_dir(prefix: &str) -> PathBuf {
    install_hook();
    let dir = tempfile::Builder::new()
        .prefix(&format!("lanekeeper-{prefix}-"))
        .tempdir()
        .expect("create a scratch directory")
        .keep();
    SCRATCH.lock().unwrap().push(dir.clone());
    dir
}

/// Start a long-running server with its output in `log`. It is stopped when
/// the test binary exits, however it exits.
pub fn spawn_server(mut cmd: Command, log: &Path) -> u32 {
    install_hook();
    let out = std::fs::File::create(log).expect("create server log");
    let err = out.try_clone().expect("clone log handle");
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let program = format!("{:?}", cmd.get_program());
    let child =
        on_spawner(move || cmd.spawn()).unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
    let pid = child.id();
    CHILDREN.lock().unwrap().push(child);
    pid
}

/// True while the server with this pid is still running.
pub fn is_running(pid: u32) -> bool {
    let mut children = CHILDREN.lock().unwrap();
    children
        .iter_mut()
        .find(|c| c.id() == pid)
        .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
}

/// A loopback port that was free a moment ago, for a server this harness
/// starts. It comes from below the kernel's ephemeral range
/// (`ip_local_port_range`), so no outgoing connection can take it between
/// this check and the server's bind: kube-scheduler once lost the port it
/// was given to one of kube-controller-manager's connections to the API
/// server ("bind: address already in use"). Each process walks the range
/// from its own place, and never hands out one port twice.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .min(65_536);
    if high <= LOW + 1_000 {
        // no room below the ephemeral range: any free port, as before
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind an ephemeral loopback port");
    }
    let span = high - LOW;
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let port = (LOW + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {LOW}..{high}")
}

/// The last lines of a log, for failure messages.
pub fn tail(log: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Poll `ready` until it holds, or panic with `what` and the log's tail.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    log: &Path,
    pid: u32,
    mut ready: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return;
        }
        if !is_running(pid) {
            panic!(
                "{what}: the process exited; last lines of {}:\n{}",
                log.display(),
                tail(log, 40)
            );
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: not ready after {timeout:?}; last lines of {}:\n{}",
                log.display(),
                tail(log, 40)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `lanekeeper` binary: cargo's for tests and benchmarks; for an example
/// (the demo), `$LANEKEEPER_BIN` or the one beside `target/<profile>/examples/`.
pub fn lanekeeper_bin() -> PathBuf {
    // An explicit binary first: to run a test or bench against another build
    // (an earlier commit's, to see a test fail before its fix).
    if let Some(p) = std::env::var_os("LANEKEEPER_BIN") {
        return PathBuf::from(p);
    }
    if let Some(p) = option_env!("CARGO_BIN_EXE_lanekeeper") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the path of this program");
    let bin = exe
        .parent()
        .and_then(|examples| examples.parent())
        .map(|profile| profile.join("lanekeeper"))
        .expect("target/<profile>/examples/<name>");
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build --release --bin lanekeeper), or set LANEKEEPER_BIN",
        bin.display()
    );
    bin
}

/// Find a program on PATH, or panic saying what to install.
pub fn require_program(name: &str, install_hint: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join(name))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| panic!("`{name}` is not on PATH; {install_hint}"))
}

/// Find `name` on PATH; when it is missing and Debian's `packages` provide
/// it, install them with apt-get as root on a Debian-like system (saying
/// so on the terminal), else panic with the exact command to run. The same
/// rule as tests/prerequisites.sh, which demo.sh and .ci/run use, so that
/// `cargo test --locked` on a fresh machine sets itself up too.
/// `LANEKEEPER_NO_INSTALL=1` never installs.
pub fn require_debian_program(name: &str, packages: &[&str]) -> PathBuf {
    if let Some(p) = find_program(name) {
        return p;
    }
    let may_install = unsafe { libc::geteuid() } == 0
        && find_program("apt-get").is_some()
        && std::env::var_os("LANEKEEPER_NO_INSTALL").is_none();
    install_or_explain(name, packages, may_install);
    find_program(name).unwrap_or_else(|| {
        panic!(
            "`{name}` is still not on PATH after `apt-get install -y {}`",
            packages.join(" ")
        )
    })
}

/// Install `packages` with apt-get (once per test binary), or panic with
/// the command that would.
pub fn install_or_explain(name: &str, packages: &[&str], may_install: bool) {
    static APT: Mutex<()> = Mutex::new(());
    let install = format!("apt-get install -y {}", packages.join(" "));
    if !may_install {
        let sudo = if unsafe { libc::geteuid() } == 0 {
            ""
        } else {
            "sudo "
        };
        panic!(
            "`{name}` is not on PATH; install it with: {sudo}apt-get update && {sudo}{install}              (on Debian or Ubuntu; elsewhere, your distribution's Redis 7+ package)"
        );
    }
    let _one_at_a_time = APT.lock().unwrap_or_else(|e| e.into_inner());
    if find_program(name).is_some() {
        return;
    }
    // Straight to the terminal: the test harness captures print macros.
    let _ = writeln!(
        std::io::stderr(),
        "lanekeeper tests: `{name}` is not installed; running `apt-get update && {install}` (root on a Debian-like system)"
    );
    let run = |args: &[&str]| {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("cannot run apt-get: {e}"));
        assert!(
            status.success(),
            "apt-get {} failed ({status}); run `{install}` by hand",
            args.join(" ")
        );
    };
    run(&["update", "-qq"]);
    let mut args = vec!["install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300"];
    args.extend_from_slice(packages);
    run(&args);
    // The tests start their own servers on free ports; the distro's service is not needed.
    let _ = Command::new("service")
        .args(["redis-server", "stop"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn find_program(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

/// Send `signal` to a server this binary started (SIGKILL, SIGTERM).
pub fn signal(pid: u32, signal: i32) {
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// Wait for a server to exit and return its exit code (None if killed by a signal).
pub fn wait_exit(pid: u32, timeout: Duration) -> Option<Option<i32>> {
    let deadline = Instant::now() + timeout;
    loop {
        {
            let mut children = CHILDREN.lock().unwrap();
            if let Some(c) = children.iter_mut().find(|c| c.id() == pid) {
                if let Ok(Some(status)) = c.try_wait() {
                    return Some(status.code());
                }
            } else {
                return None;
            }
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// CPU seconds (user + system) a process has used so far, from /proc.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Does `GET <path>` on 127.0.0.1:`port` answer 200 now? (A raw HTTP/1.1
/// request: no client library, no proxy from the environment.)
pub fn answers_200(port: u16, path: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let _ = c.write_all(request.as_bytes());
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}
