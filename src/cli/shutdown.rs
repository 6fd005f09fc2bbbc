//! The one signal fan-out of the long-running commands: SIGTERM or SIGINT
//! sets a flag that every part of the command (worker loop, HTTP server,
//! controller, simulator) waits on.

use tokio::sync::watch;
use tracing::warn;

/// A flag set by SIGTERM or SIGINT. Clones share it.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Listens for SIGTERM and SIGINT (inside a Tokio runtime).
    pub fn on_signals() -> Self {
        Self(stop_on_signals())
    }

    /// The flag as a watch channel (what `worker::run` takes).
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.0.clone()
    }

    /// Resolves once a signal has come.
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|s| *s).await;
    }
}

/// A flag set by SIGTERM or SIGINT, as a watch channel.
fn stop_on_signals() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let _ = tx.send(true);
    });
    rx
}
