//! The work source: leases batches of sample ids from the coordinator and
//! turns them into token batches from the local copy of the dataset.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dflash_config::MalformedPolicy;
use dflash_data::{ChatTokenizer, Dataset, LoadOptions};
use dflash_proto as pb;
use dflash_proto::CoordinatorError;
use dflash_role::{KindExt, Session, with_timeout};
use dflash_telemetry::{ErrorKind, Reaction};

use crate::leases::{Destination, Lease, Leases};

/// One leased batch, tokenized and packed: the forward loop's input.
#[derive(Clone, Debug)]
pub struct WorkItem {
    pub batch_id: u64,
    pub epoch: u32,
    pub sample_ids: Vec<u64>,
    pub seq_lengths: Vec<u32>,
    pub input_ids: Vec<u32>,
    pub loss_mask: Vec<u8>,
    /// Trace context of the batch's latest stage (the lease, then forward).
    pub trace: dflash_telemetry::TraceContext,
    /// Renewed while the batch exists; given up when it is dropped.
    pub lease: Lease,
    /// The lease's token, for the batch's header (the drafter checks it).
    pub lease_token: Vec<u8>,
}

/// Loads the dataset the coordinator planned from, the same way it did.
pub fn load_dataset(session: &Session) -> anyhow::Result<Dataset> {
    let c = &session.config;
    let dir = c.model.target_dir().map_err(|e| anyhow::anyhow!(e)).kind(ErrorKind::Config)?;
    let tok = ChatTokenizer::from_dir(&dir).kind(ErrorKind::Config)?;
    let opts = LoadOptions {
        max_seq_len: c.data.max_seq_len as usize,
        skip_malformed: c.data.on_malformed == MalformedPolicy::Skip,
        max_skipped_fraction: c.data.max_skipped_fraction,
    };
    let cache = c.data.tokenized_cache_dir();
    let ds =
        Dataset::load_cached(Path::new(&c.data.train_path), &tok, &opts, cache.as_deref()).kind(ErrorKind::Data)?;
    tracing::info!("dataset {}: {}", c.data.train_path, ds.report);
    Ok(ds)
}

/// Builds the packed batch of a granted lease, checking the coordinator's
/// lengths against the local dataset (a different dataset copy is a clear
/// error).
pub fn work_item(ds: &Dataset, lease: &pb::WorkLease, held: Lease) -> anyhow::Result<WorkItem> {
    let mut item = WorkItem {
        batch_id: lease.batch_id,
        epoch: lease.epoch,
        sample_ids: lease.sample_ids.clone(),
        seq_lengths: Vec::with_capacity(lease.sample_ids.len()),
        input_ids: Vec::new(),
        loss_mask: Vec::new(),
        trace: lease.trace_context.clone(),
        lease: held,
        lease_token: lease.lease_token.to_vec(),
    };
    for (i, &id) in lease.sample_ids.iter().enumerate() {
        let s = ds
            .get(id)
            .with_context(|| format!("batch {}: sample {id} is not in {}", lease.batch_id, ds.path.display()))
            .kind(ErrorKind::Data)?;
        let want = lease.sample_lengths.get(i).copied().unwrap_or(0) as usize;
        if s.len() != want {
            return Err(anyhow::anyhow!(
                "batch {}: sample {id} has {} tokens here but {want} at the coordinator; \
                 target and coordinator must read the same dataset and tokenizer",
                lease.batch_id,
                s.len()
            ))
            .kind(ErrorKind::Data);
        }
        item.seq_lengths.push(s.len() as u32);
        item.input_ids.extend_from_slice(&s.input_ids);
        item.loss_mask.extend_from_slice(&s.loss_mask);
    }
    Ok(item)
}

/// Leases batches one at a time while the work queue has room, until the
/// role stops. Each work item owns its lease (renewed by heartbeats) until
/// the drafter acknowledges the batch.
pub async fn lease_loop(
    session: Arc<Session>,
    ds: Arc<Dataset>,
    leases: Leases,
    out: flume::Sender<WorkItem>,
) -> anyhow::Result<()> {
    let mut client = session.client();
    let stop = session.stop.clone();
    let mut backoff = dflash_role::Backoff::new();
    loop {
        if stop.is_stopped() {
            return Ok(());
        }
        let req = pb::LeaseWorkRequest {
            run_id: session.run_id.clone(),
            instance_id: session.instance_id.clone(),
            max_batches: 1,
            // Held by the coordinator until work comes free, well inside
            // this call's own deadline.
            max_wait_ms: u32::try_from(session.rpc_timeout().as_millis() / 2).unwrap_or(u32::MAX),
        };
        let resp = tokio::select! {
            r = with_timeout(session.rpc_timeout(), client.lease_work(req)) => r,
            _ = stop.stopped() => return Ok(()),
        };
        let wait = match resp {
            Ok(r) if !r.leases.is_empty() => {
                for lease in &r.leases {
                    let to = Destination {
                        generation: lease.generation,
                        instance_id: lease.drafter_instance.clone(),
                        endpoint: lease.drafter_endpoint.clone(),
                    };
                    let item = work_item(&ds, lease, leases.hold(lease.batch_id, to))?;
                    dflash_telemetry::metrics().queue_depth.with_label_values(&["work"]).set(out.len() as i64 + 1);
                    tokio::select! {
                        r = out.send_async(item) => if r.is_err() { return Ok(()) },
                        _ = stop.stopped() => return Ok(()),
                    }
                }
                continue;
            }
            Ok(r) if r.exhausted => Duration::from_millis(1000),
            Ok(r) => {
                backoff.reset();
                Duration::from_millis(r.retry_after_ms.max(10) as u64)
            }
            Err(s) => match dflash_telemetry::on_coordinator_error(CoordinatorError::from_status(&s).as_ref()) {
                // The heartbeat registers again and stops the role when the
                // run is over or the coordinator gone; leasing waits.
                Reaction::Retry | Reaction::Register | Reaction::RunOver(_) | Reaction::Rejoin => {
                    tracing::debug!("lease request failed: {}", s.message());
                    backoff.next_delay()
                }
                Reaction::Fail => {
                    return Err(anyhow::anyhow!("leasing work: {}", s.message())).kind(ErrorKind::Protocol);
                }
            },
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.stopped() => return Ok(()),
        }
    }
}
