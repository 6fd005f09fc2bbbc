//! Relocation primitives: pausing a tenant in a queue, its state there,
//! marking it moved (its idempotency claims travel first), resuming it and
//! moving its hold buffer; and the gate by which lane moves and reshards of
//! one set take turns (gate.lua).

use super::keys;
use super::library::Func;
use super::reply::{
    claims_delta_reply, claims_periods_reply, claims_scan_reply, export_hold_reply,
    gate_lane_begin_reply, gate_reshard_begin_reply, import_reply, mark_moved_reply, resume_reply,
    status_reply, MarkMovedReply,
};
use super::{Result, Store, TenantQueueState};
use crate::routing::QueueId;

/// Envelopes moved per step when a hold buffer changes queue.
const MOVE_CHUNK: usize = 500;

/// Idempotency claims copied per step when a tenant moves.
const CLAIMS_CHUNK: usize = 1000;

impl Store {
    /// Pause `tenant` in `q`: its new envelopes go to the hold buffer.
    pub async fn pause(&self, q: QueueId, tenant: &str) -> Result<()> {
        self.run(Func::Pause, q, &[tenant.as_bytes()]).await?;
        Ok(())
    }

    /// The tenant's state in `q`: is it drained, paused, moved?
    pub async fn tenant_state(&self, q: QueueId, tenant: &str) -> Result<TenantQueueState> {
        let v = self.run(Func::Status, q, &[tenant.as_bytes()]).await?;
        status_reply(v)
    }

    /// Mark `tenant` as moved from `q` to `target`: enqueues into `q` answer
    /// MOVED from now on. Refused (returns false) unless the tenant is paused
    /// and drained in `q` ([`TenantQueueState::drained`]: a lane a user
    /// paused is taken along, at the head of the hold buffer).
    ///
    /// The tenant's idempotency claims travel first: every id `q` claimed for
    /// it is copied to `target` (in bounded steps), and ids claimed while the
    /// copy runs are tracked and copied too; the mark is set only in the same
    /// script call that finds none left uncopied. So a producer's retry of
    /// an id accepted before the move is still a duplicate after it.
    /// Idempotent: after a crash it is simply called again.
    pub async fn mark_moved(&self, q: QueueId, tenant: &str, target: QueueId) -> Result<bool> {
        let state = self.tenant_state(q, tenant).await?;
        if !state.paused || !state.drained() {
            return Ok(false);
        }
        let t = tenant.as_bytes();
        let claims = |op: &'static str, rest: Vec<Vec<u8>>| {
            let mut args: Vec<Vec<u8>> = vec![op.as_bytes().to_vec(), t.to_vec()];
            args.extend(rest);
            args
        };
        let periods = self
            .run_owned(Func::Claims, q, claims("begin", vec![]))
            .await?;
        for period in claims_periods_reply(periods)? {
            let mut cursor = "0".to_string();
            loop {
                let (next, ids) = claims_scan_reply(
                    self.run_owned(
                        Func::Claims,
                        q,
                        claims(
                            "scan",
                            vec![
                                period.to_string().into_bytes(),
                                cursor.clone().into_bytes(),
                                (CLAIMS_CHUNK / 2).to_string().into_bytes(),
                            ],
                        ),
                    )
                    .await?,
                )?;
                // SSCAN's count is a hint: a step may return more
                for chunk in ids.chunks(CLAIMS_CHUNK) {
                    self.run_owned(Func::Claims, target, claims("import", chunk.to_vec()))
                        .await?;
                }
                cursor = next;
                if cursor == "0" {
                    break;
                }
            }
        }
        loop {
            let v = self
                .run(
                    Func::MarkMoved,
                    q,
                    &[tenant.as_bytes(), target.to_string().as_bytes()],
                )
                .await?;
            match mark_moved_reply(v)? {
                MarkMovedReply::Marked => return Ok(true),
                MarkMovedReply::Busy => return Ok(false),
                // bounded steps, each its own call, until the lane is over
                MarkMovedReply::Merge => continue,
                MarkMovedReply::Claims => {
                    let ids = claims_delta_reply(
                        self.run_owned(
                            Func::Claims,
                            q,
                            claims("delta", vec![CLAIMS_CHUNK.to_string().into_bytes()]),
                        )
                        .await?,
                    )?;
                    if !ids.is_empty() {
                        self.run_owned(Func::Claims, target, claims("import", ids.clone()))
                            .await?;
                        self.run_owned(Func::Claims, q, claims("done", ids)).await?;
                    }
                }
            }
        }
    }

    /// Append the tenant's hold buffer in `q` to its lane, in order, and
    /// unpause it there. Used on the target after a move, and on the source
    /// when a drain is aborted. Returns the count moved.
    pub async fn resume(&self, q: QueueId, tenant: &str) -> Result<u64> {
        let mut total = 0;
        loop {
            let v = self
                .run(
                    Func::Resume,
                    q,
                    &[tenant.as_bytes(), MOVE_CHUNK.to_string().as_bytes()],
                )
                .await?;
            let (done, moved) = resume_reply(v)?;
            total += moved;
            if done {
                return Ok(total);
            }
        }
    }

    /// Move the tenant's hold buffer from `from` to the lane of `to`, in
    /// order, in chunks. Each chunk is exported, imported (skipping what `to`
    /// imported from `from` before, by sequence number) and then trimmed from
    /// `from`, so the move can be repeated after a crash without loss or
    /// duplicates. Returns the count appended to `to`.
    pub async fn move_hold(&self, from: QueueId, to: QueueId, tenant: &str) -> Result<u64> {
        let mut appended = 0;
        // The tier and a user's pause go with the backlog (the source's
        // state stays until the tenant's move ends, so a repeated move
        // reads it again).
        let mut conn = self.conn.clone();
        let (tier, paused, version): (Option<String>, Option<String>, Option<String>) =
            redis::cmd("HMGET")
                .arg(keys::tenant(&self.queue_prefix(from), tenant))
                .arg(&["tr", "up", "upv"])
                .query_async(&mut conn)
                .await?;
        let tier = tier.unwrap_or_default();
        let paused = paused.unwrap_or_else(|| "0".into());
        let version = version.unwrap_or_else(|| "0".into());
        let mut first = true;
        loop {
            let v = self
                .run(
                    Func::ExportHold,
                    from,
                    &[tenant.as_bytes(), MOVE_CHUNK.to_string().as_bytes()],
                )
                .await?;
            let rows = export_hold_reply(v)?;
            // An empty hold buffer is imported once all the same: the pause
            // travels even with nothing queued.
            if rows.is_empty() && !first {
                return Ok(appended);
            }
            first = false;
            let last = rows.is_empty();
            let mut import: Vec<Vec<u8>> = vec![
                tenant.as_bytes().to_vec(),
                from.to_string().into_bytes(),
                tier.as_bytes().to_vec(),
                paused.as_bytes().to_vec(),
                version.as_bytes().to_vec(),
            ];
            let mut ids: Vec<Vec<u8>> = vec![tenant.as_bytes().to_vec()];
            for row in rows {
                ids.push(row[0].clone());
                import.extend(row);
            }
            let import_refs: Vec<&[u8]> = import.iter().map(|v| v.as_slice()).collect();
            let v = self.run(Func::Import, to, &import_refs).await?;
            appended += import_reply(&v);
            if last {
                return Ok(appended);
            }
            let id_refs: Vec<&[u8]> = ids.iter().map(|v| v.as_slice()).collect();
            self.run(Func::TrimHold, from, &id_refs).await?;
        }
    }

    /// A lane (admitted under `index`) may start moving its tenant: true, and
    /// it is recorded as moving, unless a reshard of the set runs or waits
    /// to run (false: try again later).
    pub async fn lane_move_begin(&self, index: i32, lane: &str) -> Result<bool> {
        let i = index.to_string();
        let v = self
            .call(
                Func::Gate,
                &self.routing_key(),
                &[b"lane_begin", i.as_bytes(), lane.as_bytes()],
            )
            .await?;
        Ok(gate_lane_begin_reply(&v))
    }

    /// The lane's move is over (Active, Retired, or given up).
    pub async fn lane_move_end(&self, index: i32, lane: &str) -> Result<()> {
        let i = index.to_string();
        self.call(
            Func::Gate,
            &self.routing_key(),
            &[b"lane_end", i.as_bytes(), lane.as_bytes()],
        )
        .await?;
        Ok(())
    }

    /// A reshard may start: `Ok(())` and it holds the gate, or the names of
    /// the lanes still moving (it then waits for them, and new lane moves
    /// wait for it). `lanes`: the set's DedicatedLanes that exist, so a lane
    /// deleted mid-move does not hold the gate forever.
    pub async fn reshard_begin(
        &self,
        lanes: &[String],
    ) -> Result<std::result::Result<(), Vec<String>>> {
        let mut args: Vec<&[u8]> = vec![b"reshard_begin"];
        args.extend(lanes.iter().map(|l| l.as_bytes()));
        gate_reshard_begin_reply(self.call(Func::Gate, &self.routing_key(), &args).await?)
    }

    /// The reshard is over: lane moves may start again.
    pub async fn reshard_end(&self) -> Result<()> {
        self.call(Func::Gate, &self.routing_key(), &[b"reshard_end"])
            .await?;
        Ok(())
    }
}
