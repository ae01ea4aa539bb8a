//! The drafter group: which registered drafters train together, with which
//! ranks, in which generation, and which member trains which batch.
//!
//! A generation is formed from the drafters waiting to join: at once when
//! `group.size` wait, or with the ones there (at least `group.min_size`)
//! once the first has waited `group.wait_ms`. It ends when a member is lost
//! (silent past the instance timeout) or when a drafter arrives that the
//! group could take (it is short of `group.size`, or full and the arrival
//! is a member's replacement): its members then leave and join the next
//! generation, which resumes from the last committed checkpoint whatever its
//! size. A member holds one rank per replica (per device it trains on), so
//! the world is the number of replicas over all members. Batches are dealt
//! out once rank 0 has resumed: the batches left, in plan order, the i-th to
//! rank i mod world, so that step k trains the k-th batch of every rank --
//! the same batches for the same world size, however the ranks are spread
//! over members and however often the run was interrupted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dflash_proto as pb;

/// A drafter in (or waiting for) a generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub instance_id: String,
    pub endpoint: String,
    /// Ranks it holds (one per device it trains on).
    pub replicas: usize,
}

/// One formed generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub number: u64,
    /// In rank order: member i holds the ranks after member i-1's.
    pub members: Vec<Member>,
    /// Rank 0's rendezvous store (empty until it published it).
    pub store_address: String,
    /// Rank of each batch left to train; None until rank 0 resumed.
    assignment: Option<HashMap<u64, usize>>,
    /// Each rank's batches, in order.
    by_rank: Vec<Vec<u64>>,
}

impl Generation {
    fn new(number: u64, members: Vec<Member>) -> Self {
        Self { number, members, store_address: String::new(), assignment: None, by_rank: Vec::new() }
    }

    /// Ranks: every member's replicas.
    pub fn world(&self) -> usize {
        self.members.iter().map(|m| m.replicas).sum()
    }

    /// The member's first rank.
    pub fn rank_of(&self, instance_id: &str) -> Option<usize> {
        let i = self.members.iter().position(|m| m.instance_id == instance_id)?;
        Some(self.members[..i].iter().map(|m| m.replicas).sum())
    }

    /// The member that holds `rank`.
    pub fn member_at(&self, rank: usize) -> Option<&Member> {
        let mut first = 0;
        self.members.iter().find(|m| {
            first += m.replicas;
            rank < first
        })
    }

    pub fn leader(&self) -> &Member {
        &self.members[0]
    }

    pub fn is_assigned(&self) -> bool {
        self.assignment.is_some()
    }

    /// The member that trains `batch_id` (None: not dealt out yet, or not
    /// a batch left to train).
    pub fn destination(&self, batch_id: u64) -> Option<&Member> {
        let rank = *self.assignment.as_ref()?.get(&batch_id)?;
        self.member_at(rank)
    }

    /// The batches of `rank`, in order (empty until dealt out).
    pub fn batches_of(&self, rank: usize) -> &[u64] {
        self.by_rank.get(rank).map_or(&[], Vec::as_slice)
    }

    /// A member's batches in plan order, each with the rank (one of its
    /// replicas) that trains it (None: not a member).
    pub fn member_batches(&self, instance_id: &str) -> Option<Vec<(u64, usize)>> {
        let first = self.rank_of(instance_id)?;
        let replicas = self.members.iter().find(|m| m.instance_id == instance_id)?.replicas;
        let mut out: Vec<(u64, usize)> =
            (first..first + replicas).flat_map(|r| self.batches_of(r).iter().map(move |&id| (id, r))).collect();
        out.sort_unstable();
        Some(out)
    }

    pub fn to_proto(&self) -> pb::DrafterGroup {
        pb::DrafterGroup { generation: self.number, members: members_proto(&self.members) }
    }
}

fn members_proto(members: &[Member]) -> Vec<pb::GroupMember> {
    let mut first = 0;
    members
        .iter()
        .map(|m| {
            let rank = first;
            first += m.replicas;
            pb::GroupMember {
                rank: rank as u32,
                instance_id: m.instance_id.clone(),
                endpoint: m.endpoint.clone(),
                replicas: m.replicas as u32,
            }
        })
        .collect()
}

/// What the coordinator decides about the group.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// A generation was formed.
    Formed(u64),
    /// The current generation ended (why).
    Ended(u64, String),
}

/// The coordinator's book of the drafter group.
pub struct GroupBook {
    size: usize,
    min: usize,
    wait: Duration,
    current: Option<Generation>,
    /// Drafters waiting for the next generation, in order of arrival.
    waiting: Vec<Member>,
    /// Since when the first of `waiting` waits.
    waiting_since: Option<Instant>,
    last_generation: u64,
}

impl GroupBook {
    pub fn new(config: &dflash_config::GroupSection) -> Self {
        Self {
            size: config.size as usize,
            min: config.minimum() as usize,
            wait: Duration::from_millis(config.wait_ms),
            current: None,
            waiting: Vec::new(),
            waiting_since: None,
            last_generation: 0,
        }
    }

    pub fn current(&self) -> Option<&Generation> {
        self.current.as_ref()
    }

    /// The current generation's members and the drafters waiting.
    pub fn member_ids(&self) -> Vec<String> {
        let current = self.current.iter().flat_map(|g| g.members.iter());
        current.chain(self.waiting.iter()).map(|m| m.instance_id.clone()).collect()
    }

    /// A drafter asks to join the next generation. Returns the change it
    /// causes: the current generation ends when it could take the drafter.
    pub fn join(&mut self, m: Member, now: Instant) -> Option<Change> {
        if self.current.as_ref().is_some_and(|g| g.rank_of(&m.instance_id).is_some()) {
            return None;
        }
        if !self.waiting.iter().any(|w| w.instance_id == m.instance_id) {
            tracing::info!("drafter {} waits to join the group ({} waiting)", m.instance_id, self.waiting.len() + 1);
            self.waiting.push(m.clone());
            self.waiting_since.get_or_insert(now);
        }
        // A group short of its size takes the newcomer; a full one takes it
        // as the replacement of a member presumed lost (a supervisor starts
        // a member again only when it died). Either way it re-forms.
        let g = self.current.as_ref()?;
        let why = if g.members.len() < self.size {
            format!("drafter {} joins a group of {} (group.size = {})", m.instance_id, g.members.len(), self.size)
        } else {
            format!("drafter {} arrived while the group was full: it replaces a member", m.instance_id)
        };
        self.end(&why)
    }

    /// Ends the current generation (its members leave and join again).
    pub fn end(&mut self, why: &str) -> Option<Change> {
        let g = self.current.take()?;
        Some(Change::Ended(g.number, why.to_string()))
    }

    /// A drafter is gone (silent, or replaced): out of the waiting list;
    /// if it was a member, the generation ends.
    pub fn lost(&mut self, instance_id: &str) -> Option<Change> {
        self.waiting.retain(|w| w.instance_id != instance_id);
        if self.waiting.is_empty() {
            self.waiting_since = None;
        }
        if self.current.as_ref().is_some_and(|g| g.rank_of(instance_id).is_some()) {
            return self.end(&format!("member {instance_id} was lost"));
        }
        None
    }

    /// Forms the next generation when its time has come. Err: fewer than
    /// `group.min_size` drafters came within `group.wait_ms`.
    pub fn try_form(&mut self, now: Instant) -> Result<Option<Change>, String> {
        if self.current.is_some() || self.waiting.is_empty() {
            return Ok(None);
        }
        let waited = self.waiting_since.map_or(Duration::ZERO, |t| now.duration_since(t));
        let n = self.waiting.len();
        if n < self.size && waited < self.wait {
            return Ok(None);
        }
        if n < self.min {
            return Err(format!(
                "the drafter group needs at least {} member(s) (group.min_size, group.size = {}); only {n} joined \
                 within group.wait_ms ({} ms)",
                self.min,
                self.size,
                self.wait.as_millis()
            ));
        }
        let take = n.min(self.size);
        let members: Vec<Member> = self.waiting.drain(..take).collect();
        self.waiting_since = (!self.waiting.is_empty()).then_some(now);
        self.last_generation += 1;
        let number = self.last_generation;
        let g = Generation::new(number, members);
        tracing::info!(
            "drafter group generation {number} formed with {} member(s), world {}: {}",
            g.members.len(),
            g.world(),
            members_proto(&g.members)
                .iter()
                .map(|m| match m.replicas {
                    1 => format!("rank {} {}", m.rank, m.instance_id),
                    n => format!("ranks {}-{} {}", m.rank, m.rank + n - 1, m.instance_id),
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.current = Some(g);
        Ok(Some(Change::Formed(number)))
    }

    /// A drafter that registers again (this coordinator restarted) says it
    /// trains alone in `generation`: a group of one goes on as it was.
    /// A larger group cannot be put back together (its batches were dealt
    /// by the coordinator that is gone): its generation is over, and its
    /// members leave and join the next.
    pub fn adopt(&mut self, m: Member, generation: u64, world: u32) -> Option<Change> {
        self.last_generation = self.last_generation.max(generation);
        if self.current.is_some() {
            return None;
        }
        if world as usize != m.replicas || self.size != 1 {
            tracing::warn!(
                "drafter {} was rank of generation {generation} ({world} members) before this coordinator \
                 started: that generation is over",
                m.instance_id
            );
            return Some(Change::Ended(generation, "the coordinator restarted".into()));
        }
        tracing::info!("drafter {} goes on in generation {generation} (registered again)", m.instance_id);
        self.current = Some(Generation::new(generation, vec![m]));
        Some(Change::Formed(generation))
    }

    /// Rank 0 of `generation` publishes its rendezvous store.
    pub fn publish_store(&mut self, generation: u64, instance_id: &str, address: &str) -> bool {
        match self.current.as_mut() {
            Some(g) if g.number == generation && g.rank_of(instance_id) == Some(0) => {
                g.store_address = address.to_string();
                true
            }
            _ => false,
        }
    }

    /// Deals the batches left (`remaining`, in plan order) out to the
    /// current generation's ranks.
    pub fn assign(&mut self, remaining: &[u64]) {
        let Some(g) = self.current.as_mut() else { return };
        let world = g.world();
        let mut by_rank = vec![Vec::new(); world];
        let mut assignment = HashMap::with_capacity(remaining.len());
        for (i, &id) in remaining.iter().enumerate() {
            by_rank[i % world].push(id);
            assignment.insert(id, i % world);
        }
        g.assignment = Some(assignment);
        g.by_rank = by_rank;
    }

    /// The reply to a member of the current generation.
    pub fn joined(&self, instance_id: &str) -> Option<pb::JoinGroupResponse> {
        let g = self.current.as_ref()?;
        let rank = g.rank_of(instance_id)?;
        Some(pb::JoinGroupResponse {
            formed: true,
            generation: g.number,
            rank: rank as u32,
            world: g.world() as u32,
            store_address: g.store_address.clone(),
            members: members_proto(&g.members),
        })
    }

    /// The group event: the current generation, or none (re-forming).
    pub fn event(&self) -> pb::DrafterGroup {
        self.current
            .as_ref()
            .map_or(pb::DrafterGroup { generation: self.last_generation, members: Vec::new() }, Generation::to_proto)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(i: u32) -> Member {
        Member { instance_id: format!("d{i}"), endpoint: format!("http://h{i}:1"), replicas: 1 }
    }

    fn book(size: u32, min: u32, wait_ms: u64) -> GroupBook {
        GroupBook::new(&dflash_config::GroupSection { size, min_size: min, wait_ms, collective_timeout_ms: 5000 })
    }

    #[test]
    fn a_group_forms_when_its_size_waits_and_deals_batches_by_rank() {
        let mut b = book(3, 0, 1000);
        let t = Instant::now();
        for i in 0..2 {
            assert_eq!(b.join(member(i), t), None);
        }
        assert_eq!(b.try_form(t), Ok(None), "two of three wait");
        b.join(member(2), t);
        assert_eq!(b.try_form(t), Ok(Some(Change::Formed(1))));
        let g = b.current().unwrap();
        assert_eq!((g.world(), g.rank_of("d2")), (3, Some(2)));
        assert_eq!(g.destination(5), None, "nothing is dealt before rank 0 resumed");
        b.assign(&[4, 5, 6, 7, 8, 9, 10]);
        let g = b.current().unwrap();
        assert_eq!(g.batches_of(0), &[4, 7, 10]);
        assert_eq!(g.batches_of(1), &[5, 8]);
        assert_eq!(g.destination(9).unwrap().instance_id, "d2");
        assert!(b.joined("d1").is_some_and(|r| r.rank == 1 && r.world == 3 && r.store_address.is_empty()));
        assert!(b.publish_store(1, "d0", "h0:7"));
        assert!(!b.publish_store(1, "d1", "h1:7"), "only rank 0 publishes");
        assert_eq!(b.joined("d2").unwrap().store_address, "h0:7");
    }

    #[test]
    fn after_the_wait_the_group_starts_with_the_minimum_or_fails() {
        let t = Instant::now();
        let mut b = book(3, 2, 1000);
        b.join(member(0), t);
        assert_eq!(b.try_form(t + Duration::from_millis(999)), Ok(None));
        let err = b.try_form(t + Duration::from_millis(1000)).unwrap_err();
        assert!(err.contains("at least 2") && err.contains("only 1 joined"), "{err}");
        b.join(member(1), t);
        assert_eq!(b.try_form(t + Duration::from_millis(1000)), Ok(Some(Change::Formed(1))));
        assert_eq!(b.current().unwrap().world(), 2);
    }

    #[test]
    fn losing_a_member_or_a_newcomer_ends_the_generation() {
        let t = Instant::now();
        let mut b = book(2, 1, 1000);
        b.join(member(0), t);
        b.join(member(1), t);
        b.try_form(t).unwrap();
        assert_eq!(b.lost("d9"), None, "not a member");
        assert!(matches!(b.lost("d1"), Some(Change::Ended(1, why)) if why.contains("d1")));
        assert_eq!(b.event().members.len(), 0, "re-forming");
        // The survivor comes back; alone it waits, then starts with one.
        b.join(member(2), t);
        assert_eq!(b.try_form(t + Duration::from_millis(1000)), Ok(Some(Change::Formed(2))));
        // A replacement arrives: the short group re-forms to take it.
        assert!(matches!(b.join(member(3), t), Some(Change::Ended(2, why)) if why.contains("joins a group of 1")));
        b.join(member(2), t);
        assert_eq!(b.try_form(t), Ok(Some(Change::Formed(3))));
        assert_eq!(b.current().unwrap().world(), 2, "the world grows back");
    }

    #[test]
    fn members_with_several_replicas_hold_consecutive_ranks_and_their_batches() {
        let t = Instant::now();
        let mut b = book(2, 0, 1000);
        b.join(Member { replicas: 2, ..member(0) }, t);
        b.join(Member { replicas: 3, ..member(1) }, t);
        assert_eq!(b.try_form(t), Ok(Some(Change::Formed(1))));
        let g = b.current().unwrap();
        assert_eq!((g.world(), g.rank_of("d0"), g.rank_of("d1")), (5, Some(0), Some(2)));
        assert_eq!(g.member_at(1).unwrap().instance_id, "d0");
        assert_eq!(g.member_at(4).unwrap().instance_id, "d1");
        assert!(g.member_at(5).is_none());
        let ids: Vec<u64> = (10..22).collect();
        b.assign(&ids);
        let g = b.current().unwrap();
        // The i-th batch left goes to rank i mod 5: d0 holds ranks 0 and 1.
        assert_eq!(g.member_batches("d0").unwrap(), vec![(10, 0), (11, 1), (15, 0), (16, 1), (20, 0), (21, 1)]);
        assert_eq!(g.member_batches("d1").unwrap(), vec![(12, 2), (13, 3), (14, 4), (17, 2), (18, 3), (19, 4)]);
        assert_eq!(g.destination(14).unwrap().instance_id, "d1");
        let r = b.joined("d1").unwrap();
        assert_eq!((r.rank, r.world), (2, 5));
        let ranks: Vec<(u32, u32)> = r.members.iter().map(|m| (m.rank, m.replicas)).collect();
        assert_eq!(ranks, vec![(0, 2), (2, 3)]);
        // A group short of its size counts members, not ranks.
        let mut b = book(2, 1, 1000);
        b.join(Member { replicas: 2, ..member(0) }, t);
        assert_eq!(b.try_form(t + Duration::from_millis(1000)), Ok(Some(Change::Formed(1))));
        assert!(matches!(b.join(member(1), t), Some(Change::Ended(1, why)) if why.contains("joins a group of 1")));
    }

    #[test]
    fn a_restarted_coordinator_adopts_a_lone_member_with_all_its_replicas() {
        let mut b = book(1, 0, 1000);
        assert_eq!(b.adopt(Member { replicas: 2, ..member(0) }, 4, 2), Some(Change::Formed(4)));
        assert_eq!(b.current().unwrap().world(), 2);
        let mut b = book(1, 0, 1000);
        // It claims a world its replicas do not make: another member was in it.
        assert!(matches!(b.adopt(Member { replicas: 2, ..member(0) }, 4, 3), Some(Change::Ended(4, _))));
    }
}
