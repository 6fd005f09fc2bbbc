//! The binary's subcommands: one file per subcommand holds its clap
//! arguments and its run function; `main.rs` only lists and dispatches them.
//! What several subcommands share is here once: the Redis target flags
//! ([`redis`]), the signal fan-out of the long-running ones ([`shutdown`]),
//! the Tokio runtime, the default process identity and reading an input
//! file ([`read_input`]).

pub mod controller;
pub mod crds;
pub mod dataplane;
pub mod ingest;
pub mod ingest_key;
pub mod redis;
pub mod route;
pub mod shutdown;
pub mod simulate;
pub mod tenant;
pub mod tiers;
pub mod top;
pub mod worker;

use std::future::Future;
use std::io::Read;
use std::path::Path;

use shutdown::Shutdown;

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Runs a short command (it ends on its own; Ctrl-C kills it) on a new runtime.
pub fn block_on(command: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    runtime()?.block_on(command)
}

/// Runs a long-running command (worker, ingest, controller, simulate) on a
/// new runtime, handing it the one [`Shutdown`] that SIGTERM and SIGINT set.
pub fn serve<F>(command: impl FnOnce(Shutdown) -> F) -> anyhow::Result<()>
where
    F: Future<Output = anyhow::Result<()>>,
{
    runtime()?.block_on(async move { command(Shutdown::on_signals()).await })
}

/// This process's identity when none is given: `<hostname>:<pid>`.
fn host_pid() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), std::process::id())
}

/// The text of `file` (`-`: stdin), refused past `max` bytes or when it is
/// not UTF-8, naming the file (and where the UTF-8 breaks).
pub fn read_input(file: &Path, max: u64) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    let n = if file.as_os_str() == "-" {
        std::io::stdin()
            .lock()
            .take(max + 1)
            .read_to_end(&mut bytes)?
    } else {
        std::fs::File::open(file)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?
            .take(max + 1)
            .read_to_end(&mut bytes)?
    };
    anyhow::ensure!(
        n as u64 <= max,
        "{}: larger than {} MiB",
        file.display(),
        max >> 20
    );
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 (at byte {})",
            file.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
