//! The router: every leased batch goes to the drafter group member the
//! coordinator assigned it (its lease says which), through that member's
//! own streams (`pipeline.streams_per_target` senders each, with their own
//! credits and acknowledgements), so that no member starves while another
//! queues. Routes are opened on a member's first batch and closed when the
//! member leaves the group; a batch routed to a generation that ended is
//! dropped (its lease goes back to pending and is dealt out again).

use std::collections::HashMap;
use std::sync::Arc;

use dflash_proto as pb;
use dflash_role::{Session, Stages};
use tokio::sync::{mpsc, watch};

use crate::postprocess::OutboundBatch;
use crate::sender::Sender;

/// A route is one member process: its instance at its endpoint. A member
/// that restarts at the same address is another instance and gets fresh
/// senders (the old ones' credits and replays belong to the one that died).
fn route_key(instance_id: &str, endpoint: &str) -> String {
    format!("{instance_id}@{endpoint}")
}

/// One member's queue and the endpoint its senders stream to (dropping
/// both ends the senders).
struct Route {
    queue: flume::Sender<OutboundBatch>,
    _endpoint: watch::Sender<Option<String>>,
}

pub struct Router {
    pub session: Arc<Session>,
    pub stages: Stages,
    /// The group as the coordinator announces it.
    pub group: watch::Receiver<Option<pb::DrafterGroup>>,
    /// Senders per member.
    pub streams: usize,
    /// Each sender's share of the in-flight limit.
    pub window: usize,
    pub reports: mpsc::Sender<(u64, String)>,
}

impl Router {
    /// Routes until the input closes or the role stops.
    pub async fn run(mut self, input: flume::Receiver<OutboundBatch>) -> anyhow::Result<()> {
        let stop = self.session.stop.clone();
        let mut routes: HashMap<String, Route> = HashMap::new();
        loop {
            tokio::select! {
                b = input.recv_async() => {
                    let Ok(b) = b else { return Ok(()) };
                    let to = b.lease.destination().clone();
                    if self.ended(&to) {
                        tracing::info!(
                            "batch {} was routed to generation {} of the drafter group, which ended: dropped, it is \
                             dealt out again",
                            b.lease.batch_id(),
                            to.generation
                        );
                        continue;
                    }
                    let key = route_key(&to.instance_id, &to.endpoint);
                    let queue = routes.entry(key.clone()).or_insert_with(|| self.open(&to.endpoint)).queue.clone();
                    // A member that is gone takes no more batches: waiting for
                    // its queue must not keep the router from learning that
                    // the group changed (every later batch would wait too).
                    let (id, send) = (b.lease.batch_id(), queue.send_async(b));
                    tokio::pin!(send);
                    loop {
                        tokio::select! {
                            r = &mut send => {
                                if r.is_err() {
                                    routes.remove(&key);
                                }
                                break;
                            }
                            r = self.group.changed() => {
                                if r.is_err() { return Ok(()) }
                                if self.ended(&to) {
                                    tracing::info!(
                                        "batch {id} waited for {}, which left the drafter group: dropped, it is dealt \
                                         out again",
                                        to.endpoint
                                    );
                                    break;
                                }
                            }
                            _ = stop.stopped() => return Ok(()),
                        }
                    }
                    self.prune(&mut routes);
                }
                r = self.group.changed() => {
                    if r.is_err() { return Ok(()) }
                    self.prune(&mut routes);
                }
                _ = stop.stopped() => return Ok(()),
            }
        }
    }

    /// Whether a batch for `to` belongs to a generation (or a member) that
    /// is no longer in the group.
    fn ended(&self, to: &crate::leases::Destination) -> bool {
        to.endpoint.is_empty()
            || self.group.borrow().as_ref().is_some_and(|g| {
                to.generation < g.generation
                    || (to.generation == g.generation
                        && !g.members.iter().any(|m| m.endpoint == to.endpoint && m.instance_id == to.instance_id))
            })
    }

    /// Closes the routes of members no longer in the group: they have
    /// nothing more to receive; what they did not acknowledge is redone.
    fn prune(&self, routes: &mut HashMap<String, Route>) {
        let members: Vec<String> = self
            .group
            .borrow()
            .as_ref()
            .map(|g| g.members.iter().map(|m| route_key(&m.instance_id, &m.endpoint)).collect())
            .unwrap_or_default();
        routes.retain(|key, _| {
            let keep = members.contains(key);
            if !keep {
                tracing::info!("closing the streams to {key}: no longer in the drafter group");
            }
            keep
        });
    }

    /// Starts the senders of a member's route.
    fn open(&self, endpoint: &str) -> Route {
        let (queue, rx) = flume::bounded(1);
        let (endpoint_tx, endpoint_rx) = watch::channel(Some(endpoint.to_string()));
        for i in 0..self.streams {
            let s = Sender::new(
                Arc::clone(&self.session),
                rx.clone(),
                endpoint_rx.clone(),
                self.window,
                self.reports.clone(),
                i,
            );
            self.stages.spawn_task(&format!("sender-{i} to {endpoint}"), s.run());
        }
        Route { queue, _endpoint: endpoint_tx }
    }
}
