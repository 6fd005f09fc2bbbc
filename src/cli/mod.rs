//! The binary's subcommands: one file per subcommand holds its clap
//! arguments and its run function; `main.rs` only lists and dispatches them.
//! What several subcommands share is here once: the Redis target flags
//! ([`redis`]), the signal fan-out of the long-running ones ([`shutdown`]),
//! the Tokio runtime and the default process identity.

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
