//! Leader election: only the holder of a Lease reconciles, so two replicas
//! never both write. [`acquire`] waits to hold the Lease; the [`Leader`] it
//! returns says when leadership is lost ([`Lost`]) and lets the Lease go at
//! the end ([`Release`]). Losing the Lease must stop the controller; the
//! binary then exits non-zero, so that its restart joins as a follower.

use std::future::Future;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Which Lease to hold, and as whom.
#[derive(Clone, Debug)]
pub struct Election {
    /// Namespace of the Lease (the controller's own namespace in a cluster).
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity in the Lease.
    pub identity: String,
    /// How long a leader holds the Lease without renewing it (at least 2 s;
    /// it renews a third of this before the end).
    pub duration: Duration,
}

/// This replica holds the Lease.
pub struct Leader {
    /// Resolves when the Lease is lost.
    pub lost: Lost,
    /// Lets the Lease go once `lost` is dropped.
    pub release: Release,
}

/// Resolves when this replica no longer holds the Lease.
pub struct Lost(watch::Receiver<bool>);

/// The task that renews the Lease; it releases the Lease once its
/// receivers (the [`Lost`]) are gone.
pub struct Release(JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>);

/// Waits to hold the Lease. `Ok(None)`: `stop` resolved first.
pub async fn acquire(
    client: Client,
    election: &Election,
    stop: impl Future<Output = ()>,
) -> anyhow::Result<Option<Leader>> {
    let identity = &election.identity;
    let duration = election.duration;
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client, &election.name)
        .with_namespace(&election.namespace)
        .with_identity(identity)
        .with_duration(duration.as_secs().max(2))
        .with_grace((duration.as_secs() / 3).max(1))
        .build()
        .await
        .with_context(|| {
            format!(
                "leader election Lease {}/{}",
                election.namespace, election.name
            )
        })?;
    let (mut rx, task) = manager.watch().await;
    tracing::info!(%identity, lease = %election.name, "waiting to become the leader");
    let leading = tokio::select! {
        r = rx.wait_for(|l| *l) => { r.context("leader election stopped")?; true }
        _ = stop => false,
    };
    if !leading {
        return Ok(None);
    }
    tracing::info!(%identity, "leading");
    Ok(Some(Leader {
        lost: Lost(rx),
        release: Release(task),
    }))
}

impl Lost {
    /// Resolves when the Lease is lost (or its task has ended).
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|l| !*l).await;
    }
}

impl Release {
    /// Waits (at most 5 s) for the Lease task to release the Lease; call it
    /// after the [`Lost`] is dropped.
    pub async fn wait(self) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.0).await;
    }
}
