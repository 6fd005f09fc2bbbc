//! The DedicatedLane reconciler's effects on the API server and Redis: the
//! status write (conditions, Events), the lane Deployment, admission under
//! the lock, the finalizer.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use crate::crd::{DedicatedLane, DedicatedLaneStatus, LanePhase, ShardSet};
use crate::policy::QueuePolicy;
use crate::routing::QueueId;
use crate::store::Store;

use super::super::build::{deployment_name, lane_deployment, FIELD_MANAGER as APPLY_MANAGER};
use super::super::status::shard_available;
use super::super::{relocation, Context};
use super::step::{Abort, Act, Done, Effect, Facts, Read};
use super::{
    admit, conditions, has_workers, moving, LaneError, LaneSlot, Refusal, CRASH_HOOK_ENV,
    FIELD_MANAGER, FINALIZER,
};

pub(super) fn now() -> Timestamp {
    Timestamp::now()
}

pub(super) fn crash_hook(phase: LanePhase) {
    if let Ok(p) = std::env::var(CRASH_HOOK_ENV) {
        if p == format!("{phase:?}") {
            warn!(
                ?phase,
                "test hook: exiting after the work of this phase, before recording the next"
            );
            std::process::exit(86);
        }
    }
}

pub(super) struct Io<'a> {
    pub(super) ctx: &'a Context,
    pub(super) lanes: Api<DedicatedLane>,
    pub(super) lane: DedicatedLane,
    pub(super) set: ShardSet,
    pub(super) store: Store,
}

impl Io<'_> {
    pub(super) fn tenant(&self) -> &str {
        &self.lane.spec.tenant
    }

    pub(super) async fn write(
        &mut self,
        st: &DedicatedLaneStatus,
        refusal: Option<&Refusal>,
    ) -> Result<(), LaneError> {
        let before = self.lane.status.clone().unwrap_or_default();
        let mut st = st.clone();
        st.observed_generation = self.lane.metadata.generation;
        if !moving(st.phase) {
            // Not moving (any more): a reshard may take its turn.
            if let Some(i) = st.lane_index.or(before.lane_index) {
                self.store.lane_move_end(i, &self.lane.name_any()).await?;
            }
        }
        st.conditions = conditions(
            &st,
            refusal,
            st.observed_generation,
            self.set.spec.promotion.max_lanes,
        );
        if before.phase != st.phase {
            st.phase_since = Some(Time(now()));
            self.event(
                EventType::Normal,
                &format!("{:?}", st.phase),
                format!(
                    "phase {:?} -> {:?} ({} -> {})",
                    before.phase,
                    st.phase,
                    st.source_queue.as_deref().unwrap_or("-"),
                    st.target_queue.as_deref().unwrap_or("-")
                ),
            )
            .await;
        }
        let flipped = |t: &str| {
            let a = before.conditions.iter().find(|c| c.type_ == t);
            let b = st.conditions.iter().find(|c| c.type_ == t);
            match (a, b) {
                (Some(a), Some(b)) => a.reason != b.reason || a.status != b.status,
                (None, Some(_)) => true,
                _ => false,
            }
        };
        if flipped(conditions::RELOCATING) {
            if let Some(c) = st.conditions.iter().find(|c| {
                c.type_ == conditions::RELOCATING && c.reason == conditions::DRAIN_TIMEOUT
            }) {
                self.event(
                    EventType::Warning,
                    conditions::DRAIN_TIMEOUT,
                    c.message.clone(),
                )
                .await;
            }
        }
        if flipped(conditions::ADMITTED) {
            if let Some(c) = st.conditions.iter().find(|c| {
                c.type_ == conditions::ADMITTED
                    && c.status == "False"
                    && c.reason != "Pending"
                    && c.reason != "Retired"
            }) {
                self.event(EventType::Warning, &c.reason.clone(), c.message.clone())
                    .await;
            }
        }
        if st == before {
            // Nothing changed (a lane still waiting, say): no write.
            return Ok(());
        }
        let updated = crate::controller::api::apply_status(
            &self.lanes,
            &self.lane.name_any(),
            FIELD_MANAGER,
            &st,
        )
        .await?;
        self.lane = updated;
        Ok(())
    }

    pub(super) async fn event(&self, type_: EventType, reason: &str, note: String) {
        self.ctx
            .event(&self.lane.object_ref(&()), type_, reason, "Relocate", note)
            .await;
    }

    pub(super) async fn apply_deployment(&self, index: i32) -> Result<(), LaneError> {
        // The set's worker template under the operator's limits (the set's
        // reconcile reports a refusal in the set's status).
        let set = super::super::build::enforce_worker_policy(&self.set, &self.ctx.worker_policy)
            .map_err(|e| LaneError::Other(format!("the ShardSet is refused: {e}")))?;
        let ns = self.lane.namespace().unwrap_or_default();
        super::super::check_redis_secrets(&self.ctx.client, &ns, &set.spec.redis)
            .await
            .map_err(|e| LaneError::Other(format!("the ShardSet is refused: {e}")))?;
        let d = lane_deployment(&set, &self.lane, index as u8)
            .map_err(|e| LaneError::Other(e.to_string()))?;
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = d.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply(APPLY_MANAGER).force(),
            &Patch::Apply(&d),
        )
        .await?;
        Ok(())
    }

    pub(super) async fn deployment_available(&self, index: i32) -> Result<bool, LaneError> {
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = deployment_name(&self.set.name_any(), QueueId::Lane(index as u8));
        // Available with zero replicas serves nobody.
        let worker = super::super::build::lane_worker(&self.set, &self.lane);
        Ok(api.get_opt(&name).await?.is_some_and(|d| {
            if worker.autoscaled {
                shard_available(&d)
            } else {
                super::super::status::serving(&d)
            }
        }))
    }

    pub(super) async fn delete_deployment(&self, index: i32) -> Result<(), LaneError> {
        let ns = self.lane.namespace().unwrap_or_default();
        let api: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &ns);
        let name = deployment_name(&self.set.name_any(), QueueId::Lane(index as u8));
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Index under the cap, decided under the context's admission lock
    /// against a fresh list, and recorded before the lock is released.
    pub(super) async fn admit(
        &mut self,
        st: &mut DedicatedLaneStatus,
    ) -> Result<Option<Refusal>, LaneError> {
        let _guard = self.ctx.admission.lock().await;
        let set_name = self.set.name_any();
        // Guarded: one lane this version cannot decode must not stop every
        // lane of the namespace from being admitted.
        let guarded: Api<kube::core::DeserializeGuard<DedicatedLane>> = Api::namespaced(
            self.ctx.client.clone(),
            &self.lane.namespace().unwrap_or_default(),
        );
        let all = crate::controller::api::decoded(
            guarded.list(&ListParams::default()).await?.items,
            &self.lane.name_any(),
        );
        let slots: Vec<LaneSlot> = all
            .iter()
            .filter(|l| l.spec.shard_set == set_name)
            .map(|l| {
                let s = l.status.clone().unwrap_or_default();
                LaneSlot {
                    name: l.name_any(),
                    tenant: l.spec.tenant.clone(),
                    index: s.lane_index,
                    waiting: s.lane_index.is_none()
                        && !l.spec.retire
                        && l.metadata.deletion_timestamp.is_none()
                        && s.phase != LanePhase::Retired,
                    created: l.metadata.creation_timestamp.as_ref().map(|t| t.0),
                }
            })
            .collect();
        match admit(
            &self.lane.name_any(),
            &slots,
            self.set.spec.promotion.max_lanes,
        ) {
            Ok(i) => {
                st.lane_index = Some(i);
                self.write(st, None).await?;
                Ok(None)
            }
            Err(r) => {
                self.write(st, Some(&r)).await?;
                Ok(Some(r))
            }
        }
    }

    pub(super) async fn remove_finalizer(&self) -> Result<(), LaneError> {
        let finalizers: Vec<String> = self
            .lane
            .finalizers()
            .iter()
            .filter(|f| f.as_str() != FINALIZER)
            .cloned()
            .collect();
        let patch = serde_json::json!({
            "metadata": {
                "finalizers": finalizers,
                "resourceVersion": self.lane.resource_version(),
            }
        });
        match self
            .lanes
            .patch(
                &self.lane.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Io<'_> {
    /// What is known without asking anyone (the rest is read on demand).
    pub(super) fn facts(&self, done: &Done) -> Facts {
        Facts {
            status: self.lane.status.clone().unwrap_or_default(),
            generation: self.lane.metadata.generation,
            tenant: self.tenant().to_string(),
            deleting: self.lane.metadata.deletion_timestamp.is_some(),
            retire: self.lane.spec.retire,
            from_promotion: self
                .lane
                .labels()
                .get(super::super::promotion::ORIGIN_LABEL)
                .is_some_and(|v| v == super::super::promotion::ORIGIN_PROMOTION),
            has_workers: has_workers(&super::super::build::lane_worker(&self.set, &self.lane)),
            max_lanes: self.set.spec.promotion.max_lanes,
            drain_timeout: self.set.spec.relocation.drain_timeout(),
            now: now(),
            routing: None,
            source: None,
            available: None,
            done: done.clone(),
        }
    }

    /// Read the fact a decision asked for.
    pub(super) async fn read(&self, what: Read, facts: &mut Facts) -> Result<(), LaneError> {
        match what {
            Read::Routing => facts.routing = Some(self.store.routing().await?),
            Read::Source(q) => {
                facts.source = Some(self.store.tenant_state(q, self.tenant()).await?)
            }
            Read::Available(i) => facts.available = Some(self.deployment_available(i).await?),
        }
        Ok(())
    }

    /// Carry out a step's effects in order, then write its status.
    pub(super) async fn act(&mut self, act: &Act, done: &mut Done) -> Result<(), LaneError> {
        let name = self.lane.name_any();
        let tenant = self.tenant().to_string();
        for effect in &act.effects {
            match effect {
                Effect::ApplyDeployment(i) => {
                    self.apply_deployment(*i).await?;
                    done.applied = true;
                }
                Effect::DeleteDeployment(i) => self.delete_deployment(*i).await?,
                Effect::ConfigureQueue(q) => {
                    self.store
                        .configure_queue(*q, &QueuePolicy::from_spec(&self.set.spec))
                        .await?
                }
                Effect::BeginMove(i) => {
                    done.gate = Some(self.store.lane_move_begin(*i, &name).await?);
                }
                Effect::EndMove(i) => self.store.lane_move_end(*i, &name).await?,
                Effect::Admit(st) => {
                    let mut st = (**st).clone();
                    done.admission = Some(self.admit(&mut st).await?);
                }
                Effect::Pause(q) => self.store.pause(*q, &tenant).await?,
                Effect::Resume(q) => {
                    self.store.resume(*q, &tenant).await?;
                }
                Effect::Abort { from, why } => {
                    relocation::abort(&self.store, *from, &tenant).await?;
                    if let Abort::DrainTimeout { attempts } = why {
                        warn!(lane = %name, %tenant, from = %from, attempts, "drain timed out; resumed in place");
                    }
                }
                Effect::Pin(q) => {
                    self.store.pin(&tenant, *q).await?;
                }
                Effect::Unpin => {
                    self.store.unpin(&tenant).await?;
                }
                Effect::HandOver { from, to } => {
                    let marked = relocation::hand_over(&self.store, &tenant, *from, *to).await?;
                    done.marked = Some(marked);
                }
                Effect::RestorePin(lane_q) => {
                    warn!(lane = %name, %tenant, "the routing table lost this Active lane's pin: pinning the tenant to its lane again");
                    self.store.pin(&tenant, *lane_q).await?;
                    self.event(
                        EventType::Warning,
                        conditions::REPINNED,
                        format!("{tenant} was not pinned to {lane_q} in the routing table; pinned again"),
                    )
                    .await;
                }
                Effect::DeleteLane => {
                    info!(lane = %name, "retired lane made by promotion: deleting it");
                    match self.lanes.delete(&name, &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Effect::Info(line) => info!(lane = %name, %tenant, "{line}"),
                Effect::CrashHook(phase) => crash_hook(*phase),
            }
        }
        if let Some(r) = &act.record {
            self.write(&r.status, r.refusal.as_ref()).await?;
        }
        Ok(())
    }
}
