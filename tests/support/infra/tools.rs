//! Third-party tools a pinned script under `tests/` builds or fetches into
//! the cache outside the repository (helm, promtool, the monitoring CRDs),
//! and `helm` run with private directories.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::process;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A tool that a pinned script builds or fetches: `$env_var` if set, else
/// `<last stdout line of bash script>/<name>` (the directory itself when
/// `name` is empty). A failure names the command that installs it.
pub fn installed(script: &str, name: &str, env_var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        assert!(
            p.exists(),
            "{env_var}={} does not exist; unset it to use the pinned one from `bash {script}`",
            p.display()
        );
        return p;
    }
    let path = repo().join(script);
    let out = Command::new("bash")
        .arg(&path)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run `bash {script}`: {e}"));
    assert!(
        out.status.success(),
        "{name} is missing and `bash {script}` could not install it (see its output above). \
         It needs Go (the version the script names) and the Go module proxy; install Go \
         (https://go.dev/doc/install or `apt-get install golang`), \
         run `bash {script}` and rerun, or set {env_var}"
    );
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    let p = if name.is_empty() {
        PathBuf::from(dir)
    } else {
        PathBuf::from(dir).join(name)
    };
    assert!(
        p.exists(),
        "`bash {script}` printed no usable directory ({}); run it to see why",
        p.display()
    );
    p
}

/// The helm binary: `$LANEKEEPER_HELM`, or the one `tests/helm/install.sh`
/// builds (pinned, cached) from the Go module proxy.
pub fn helm_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| installed("tests/helm/install.sh", "helm", "LANEKEEPER_HELM"))
}

/// `helm` with private config, cache and data directories, run from the
/// repository's root.
pub fn helm() -> Command {
    static HOME: OnceLock<PathBuf> = OnceLock::new();
    let home = HOME.get_or_init(|| process::scratch_dir("helm-home"));
    let mut cmd = Command::new(helm_bin());
    cmd.env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .current_dir(repo());
    cmd
}

/// `helm <args>`, which must succeed; its stdout.
pub fn helm_ok(args: &[&str]) -> String {
    let out = helm().args(args).output().expect("run helm");
    assert!(
        out.status.success(),
        "helm {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("helm prints UTF-8")
}
