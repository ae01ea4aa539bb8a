//! This drafter's membership in the drafter group: joining a generation
//! through the coordinator with one rank per replica (device), the
//! rendezvous rank 0 serves (PyTorch's TCPStore), each replica's collective
//! on top (Gloo between CPU ranks, NCCL between GPU ranks, its unique id
//! handed over through the store), and leaving
//! when the generation ends -- the process exits with
//! [`dflash_role::EXIT_GROUP_REFORM`] so that its supervisor starts it again
//! into the next generation, from the last committed checkpoint.

use std::sync::Arc;
use std::time::Duration;

use dflash_models::collective::Collective;
use dflash_models::gloo::GroupStore;
use dflash_proto as pb;
use dflash_role::{KindExt, Session, Stages, StopCause, with_timeout};
use dflash_telemetry::ErrorKind;
use tokio::sync::watch;

/// The generation this drafter trains in, and its ranks.
#[derive(Clone, Debug)]
pub struct Membership {
    pub generation: u64,
    /// This member's first rank: its replicas hold `rank .. rank + replicas`.
    pub rank: usize,
    pub replicas: usize,
    /// Ranks in the generation (every member's replicas).
    pub world: usize,
    /// Members in the generation.
    pub members: usize,
    /// Instance id of each rank.
    pub names: Vec<String>,
}

impl Membership {
    /// The ranks of this member's replicas, in order.
    pub fn ranks(&self) -> std::ops::Range<usize> {
        self.rank..self.rank + self.replicas
    }

    /// Whether this member leads the group (holds rank 0).
    pub fn leads(&self) -> bool {
        self.rank == 0
    }
}

/// Asks the coordinator for a place in the next generation, bringing
/// `replicas` ranks, until the group is formed (the coordinator fails the
/// run when too few come within `group.wait_ms`).
pub async fn join(session: &Session, replicas: usize) -> anyhow::Result<Membership> {
    let r = ask_until(session, "joining the drafter group", None, || {
        let req = pb::JoinGroupRequest {
            run_id: session.run_id.clone(),
            instance_id: session.instance_id.clone(),
            generation: 0,
            store_address: String::new(),
            replicas: replicas as u32,
        };
        let mut client = session.client();
        async move { with_timeout(session.rpc_timeout(), client.join_group(req)).await.map(|r| r.formed.then_some(r)) }
    })
    .await?;
    let names = r
        .members
        .iter()
        .flat_map(|m| std::iter::repeat_n(m.instance_id.clone(), m.replicas.max(1) as usize))
        .collect::<Vec<_>>();
    let m = Membership {
        generation: r.generation,
        rank: r.rank as usize,
        replicas,
        world: r.world as usize,
        members: r.members.len(),
        names,
    };
    if m.names.len() != m.world || !m.ranks().all(|rank| m.names[rank] == session.instance_id) {
        return Err(anyhow::anyhow!(
            "the coordinator's generation {} does not add up: world {}, members' ranks {:?}",
            m.generation,
            m.world,
            r.members.iter().map(|x| (x.rank, x.replicas)).collect::<Vec<_>>()
        ))
        .kind(ErrorKind::Protocol);
    }
    tracing::info!(
        "drafter group generation {}: {} of world {} ({} member(s): {})",
        m.generation,
        match m.replicas {
            1 => format!("rank {}", m.rank),
            n => format!("ranks {}-{}", m.rank, m.rank + n - 1),
        },
        m.world,
        m.members,
        r.members.iter().map(|x| x.instance_id.as_str()).collect::<Vec<_>>().join(", ")
    );
    session.set_group(m.generation, m.world as u32);
    Ok(m)
}

/// Asks the coordinator until `call` answers `Some`, by the written policy:
/// "not yet" (`None`) asks again at once -- the coordinator answers that
/// only after waiting for the group to move -- and an error is retried with
/// backoff while the policy says so, until `deadline` (if any) or the stop.
pub async fn ask_until<T, Fut>(
    session: &Session,
    what: &str,
    deadline: Option<tokio::time::Instant>,
    mut call: impl FnMut() -> Fut,
) -> anyhow::Result<T>
where
    Fut: std::future::Future<Output = Result<Option<T>, tonic::Status>>,
{
    use dflash_telemetry::Reaction;
    let stop = session.stop.clone();
    let mut backoff = dflash_role::Backoff::new();
    let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let until = deadline.unwrap_or(far);
    loop {
        let r = tokio::select! {
            r = call() => r,
            _ = stop.stopped() => anyhow::bail!("stopped while {what}"),
        };
        let wait = match r {
            Ok(Some(answer)) => return Ok(answer),
            Ok(None) => {
                backoff.reset();
                Duration::ZERO
            }
            Err(s) => {
                let e = dflash_proto::CoordinatorError::from_status(&s);
                match dflash_telemetry::on_coordinator_error(e.as_ref()) {
                    Reaction::Fail => {
                        return Err(anyhow::anyhow!("{what}: {}", s.message())).kind(ErrorKind::Protocol);
                    }
                    Reaction::RunOver(state) => {
                        // The run's end stops the role for its reason (a
                        // completed run is this drafter's success too).
                        stop.stop(dflash_role::run_over_cause(state, s.message().to_string()));
                        anyhow::bail!("{what}: the run is over: {}", s.message())
                    }
                    // This member's generation is over: it leaves.
                    Reaction::Rejoin => {
                        return Err(anyhow::anyhow!("{what}: {}", s.message())).kind(ErrorKind::PeerLost);
                    }
                    // (Registering again is the session's heartbeat's job.)
                    Reaction::Retry | Reaction::Register => backoff.next_delay(),
                }
            }
        };
        let now = tokio::time::Instant::now();
        if now >= until {
            // Whoever should have moved the group on is gone.
            return Err(anyhow::anyhow!("{what}: no answer in time")).kind(ErrorKind::PeerLost);
        }
        tokio::select! {
            _ = tokio::time::sleep_until((now + wait).min(until)) => {}
            _ = stop.stopped() => anyhow::bail!("stopped while {what}"),
        }
    }
}

/// The host part of an endpoint URL (`http://10.0.0.7:50052` -> `10.0.0.7`):
/// where the other members reach this one.
pub fn host_of(endpoint: &str) -> String {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h.trim_matches(['[', ']']).to_string(),
        _ => authority.to_string(),
    }
}

/// The rendezvous: rank 0 serves the store and tells the coordinator where;
/// the others wait for that and connect. Returns one store connection per
/// replica of this member (rank 0's own is the one it serves). Err with
/// [`StopCause::GroupReform`] semantics when the generation ended meanwhile.
pub async fn rendezvous(session: &Session, m: &Membership, own_host: &str) -> anyhow::Result<Vec<GroupStore>> {
    let timeout = Duration::from_millis(session.config.group.collective_timeout_ms);
    let ask = |store_address: String| pb::JoinGroupRequest {
        run_id: session.run_id.clone(),
        instance_id: session.instance_id.clone(),
        generation: m.generation,
        store_address,
        replicas: m.replicas as u32,
    };
    let generation = m.generation;
    let first = if m.leads() {
        let (host, world) = (own_host.to_string(), m.world);
        let store = tokio::task::spawn_blocking(move || GroupStore::serve(&host, world, generation, timeout))
            .await?
            .kind(ErrorKind::Device)?;
        let mut client = session.client();
        with_timeout(session.rpc_timeout(), client.join_group(ask(store.address.clone())))
            .await
            .map_err(|s| anyhow::anyhow!("publishing the group's rendezvous: {}", s.message()))
            .kind(ErrorKind::PeerLost)?;
        store
    } else {
        let deadline = tokio::time::Instant::now() + timeout;
        let what = "waiting for rank 0's rendezvous (group.collective_timeout_ms)";
        let address = ask_until(session, what, Some(deadline), || {
            let (mut client, req) = (session.client(), ask(String::new()));
            async move {
                let r = with_timeout(session.rpc_timeout(), client.join_group(req)).await?;
                Ok(if r.formed && r.generation == m.generation && !r.store_address.is_empty() {
                    Some(Ok(r.store_address))
                } else if !r.formed && r.generation != m.generation {
                    Some(Err(anyhow::anyhow!("generation {} ended before its rendezvous", m.generation)))
                } else {
                    None
                })
            }
        })
        .await??;
        tokio::task::spawn_blocking(move || GroupStore::connect(&address, generation, timeout))
            .await?
            .kind(ErrorKind::PeerLost)?
    };
    // The member's other replicas reach the same store, each on its own
    // connection (each is a rank of its own).
    let address = first.address.clone();
    let mut stores = vec![first];
    for _ in 1..m.replicas {
        let address = address.clone();
        stores.push(
            tokio::task::spawn_blocking(move || GroupStore::connect(&address, generation, timeout))
                .await?
                .kind(ErrorKind::PeerLost)?,
        );
    }
    Ok(stores)
}

/// Forms one replica's collective over its store, as `rank` (collective:
/// every rank of the generation calls it). A GPU rank that fails here has a
/// device problem or lost its peers; a CPU rank, lost peers. Both end the
/// generation. An NCCL wait also ends when `stop` says the generation is
/// over (or the role failed); a completed run or a signal is agreed on at
/// the next step instead, so that the leader checkpoints first.
pub fn collective(
    store: GroupStore,
    m: &Membership,
    rank: usize,
    own_host: &str,
    device: tch::Device,
    stop: &dflash_role::Stop,
) -> anyhow::Result<Box<dyn Collective>> {
    let kind = if device.is_cuda() { ErrorKind::Device } else { ErrorKind::PeerLost };
    let stop = stop.clone();
    let cancel: dflash_models::dp::Cancel = std::sync::Arc::new(move || {
        stop.is_stopped() && stop.cause().is_some_and(|c| !matches!(c, StopCause::RunCompleted | StopCause::Signal(_)))
    });
    dflash_models::group::join(store, own_host, rank, m.world, device, cancel).kind(kind)
}

/// Where the other ranks reach this member's rendezvous and collectives:
/// the host of its endpoint, or loopback when it is the only member (its
/// replicas meet inside this host; no name needs to resolve).
pub fn own_host(m: &Membership, endpoint: &str) -> String {
    if m.members == 1 { "127.0.0.1".to_string() } else { host_of(endpoint) }
}

/// Leaves the group (stops the role with [`StopCause::GroupReform`]) when
/// the coordinator announces that this generation is over.
pub fn spawn_leave_watch(
    session: &Arc<Session>,
    stages: &Stages,
    mut group: watch::Receiver<Option<pb::DrafterGroup>>,
    m: &Membership,
) {
    let (stop, me, generation) = (session.stop.clone(), session.instance_id.clone(), m.generation);
    stages.spawn_task("group-watch", async move {
        loop {
            let over = group.borrow_and_update().as_ref().is_some_and(|g| {
                g.generation > generation
                    || (g.generation == generation && !g.members.iter().any(|x| x.instance_id == me))
            });
            if over {
                stop.stop(StopCause::GroupReform(format!("generation {generation} of the drafter group ended")));
                return Ok(());
            }
            tokio::select! {
                r = group.changed() => if r.is_err() { return Ok(()) },
                _ = stop.stopped() => return Ok(()),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn the_host_of_an_endpoint() {
        assert_eq!(host_of("http://10.0.0.7:50052"), "10.0.0.7");
        assert_eq!(host_of("https://drafter-1.drafters.ns.svc:50052/"), "drafter-1.drafters.ns.svc");
        assert_eq!(host_of("http://[::1]:80"), "::1");
        assert_eq!(host_of("drafter"), "drafter");
    }
}
