//! The quorum round, as the lighthouse state keeps it: the groups' requests to join
//! the next quorum, the engine (`quorum::decide`) run on them, the quorum issued and
//! sent once for everyone (whole, or as its change to the last a group holds), the
//! rollback a quorum may start, and when a join need not run the engine at all.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use tokio::sync::oneshot;
use tonic::Status;

use super::{Issued, LighthouseState, PendingJoin, QuorumReply, Replica};
use crate::delta::{self, Answer};
use crate::lighthouse::history::{Rollback, StepSamples};
use crate::proto;
use crate::quorum::{
    self, Decision, Identity, Joiner, LiveSet, Quorum, QuorumId, ReplicaId, WaitReason,
};

/// Liveness as the engine sees it: a fresh heartbeat (a quorum request counts as one).
struct Fresh<'a> {
    replicas: &'a HashMap<ReplicaId, Replica>,
    horizon: Option<Instant>,
}

impl LiveSet for Fresh<'_> {
    fn is_live(&self, replica_id: &str) -> bool {
        self.replicas
            .get(replica_id)
            .is_some_and(|r| self.horizon.is_none_or(|h| r.pulse.last_beat() > h))
    }
    fn live_ids(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        Box::new(
            self.replicas
                .iter()
                .filter(|(_, r)| self.horizon.is_none_or(|h| r.pulse.last_beat() > h))
                .map(|(id, _)| id.as_str()),
        )
    }
    fn progressed_at(&self, replica_id: &str) -> Option<Instant> {
        let replica = self.replicas.get(replica_id)?;
        Some(replica.pulse.training()?.stalled_since)
    }
    fn manager_address(&self, replica_id: &str) -> Option<&str> {
        let stream = self.replicas.get(replica_id)?.stream.as_ref()?;
        Some(stream.manager_address.as_str())
    }
}

impl LighthouseState {
    /// Records a request to join the next quorum; the answer arrives on `reply`.
    /// Returns a ticket that identifies this request when it leaves.
    pub fn join(
        &mut self,
        member: quorum::Member,
        last_quorum_id: QuorumId,
        now: Instant,
        reply: oneshot::Sender<QuorumReply>,
    ) -> Result<u64, Status> {
        self.join_knowing(member, last_quorum_id, 0, now, reply)
    }

    /// `join`, for a group that holds issue `known_issue` of a quorum whole: it gets
    /// the next one as a change to it, when that is the last issued.
    pub fn join_knowing(
        &mut self,
        member: quorum::Member,
        last_quorum_id: QuorumId,
        known_issue: u64,
        now: Instant,
        reply: oneshot::Sender<QuorumReply>,
    ) -> Result<u64, Status> {
        let id = member.replica_id.clone();
        // Checked before anything is recorded: an impostor's request must not count
        // as a sign of life of the group whose id it took.
        if let Some((peer, manager)) = self.live_stream(&id, now).and_then(|s| {
            let named = !s.manager_address.is_empty() && !member.manager_address.is_empty();
            (named && s.manager_address != member.manager_address)
                .then(|| (s.peer.clone(), s.manager_address.clone()))
        }) {
            return Err(Status::already_exists(format!(
                "replica id {id:?} is already live: its manager server at {manager} \
                 heartbeats from {peer}, and this request comes from manager {}; give this \
                 group another --replica-id, or stop the other process",
                member.manager_address
            )));
        }
        if let Some(other) = self.joiners.get(&id) {
            if other.member.manager_address != member.manager_address {
                return Err(Status::already_exists(format!(
                    "replica id {id:?} is already asking for a quorum from manager {}; \
                     give this group another --replica-id, or stop the other process",
                    other.member.manager_address
                )));
            }
        }
        self.beat(&id, member.step, last_quorum_id, now);
        if member.torn {
            self.newest.gone(&id);
        } else {
            self.newest.observe(&id, member.identity(), now);
        }
        if let Some(old) = self.pending.remove(&id) {
            let _ = old.reply.send(Err(Status::aborted(
                "superseded by a newer quorum request from the same replica group",
            )));
        }
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        self.pending.insert(
            id.clone(),
            PendingJoin {
                ticket,
                reply,
                known_issue,
            },
        );
        self.joiners.insert(
            id,
            Joiner {
                member,
                last_quorum_id,
                joined_at: now,
            },
        );
        Ok(ticket)
    }

    /// Withdraws a request that timed out or whose caller went away.
    pub fn leave(&mut self, replica_id: &str, ticket: u64) {
        if self
            .pending
            .get(replica_id)
            .is_some_and(|p| p.ticket == ticket)
        {
            self.pending.remove(replica_id);
            self.joiners.remove(replica_id);
            self.engine_due = true;
        }
    }

    fn beat(&mut self, replica_id: &str, step: i64, last_quorum_id: QuorumId, now: Instant) {
        match self.replicas.get(replica_id) {
            // A pulse in the map is never retired: eviction removes it first.
            Some(r) => {
                r.pulse.beat(now, step, last_quorum_id);
            }
            None => {
                let pulse = self.new_pulse(now, step);
                pulse.beat(now, step, last_quorum_id);
                let history = self.lost.returned(replica_id);
                self.replicas.insert(
                    replica_id.to_string(),
                    Replica {
                        pulse,
                        stream: None,
                        history,
                        steps: StepSamples::default(),
                        last_commit: now,
                        joined: false,
                    },
                );
            }
        }
    }

    fn highest_seen_id(&self) -> QuorumId {
        self.heard.load(Relaxed)
    }

    /// The next quorum id is above `floor` (a new leader's term, see
    /// `leadership::quorum_id_floor`).
    pub fn raise_quorum_floor(&mut self, floor: QuorumId) {
        self.heard.fetch_max(floor, Relaxed);
    }

    fn decide(&self, now: Instant) -> Decision {
        let live = Fresh {
            replicas: &self.replicas,
            horizon: now.checked_sub(self.heartbeat_timeout),
        };
        quorum::decide(&quorum::Round {
            joiners: &self.joiners,
            live: &live,
            previous: self.previous.as_ref(),
            previous_at: self.previous_at,
            highest_seen_id: self.highest_seen_id(),
            newest: self.newest.newest(),
            config: &self.config,
            now,
        })
    }

    /// The groups that hold the newest state and beat are seen alive now.
    fn see_live_holders(&mut self, now: Instant) {
        let live = Fresh {
            replicas: &self.replicas,
            horizon: now.checked_sub(self.heartbeat_timeout),
        };
        self.newest.see_live(|id| live.is_live(id), now);
    }

    /// The job's newest committed state, as far as this lighthouse knows.
    pub fn newest_state(&self) -> Option<Identity> {
        self.newest.state()
    }

    /// Another lighthouse of the set knows of `identity` (see `NewestState::learn`).
    pub fn learn_newest(&mut self, identity: Identity, now: Instant) {
        self.newest.learn(identity, now);
    }

    pub fn rollbacks(&self) -> impl Iterator<Item = &Rollback> {
        self.rollbacks.iter()
    }

    /// Records a quorum that starts a new lineage, and says so loudly.
    /// Returns the steps lost.
    fn rolled_back(&mut self, quorum: &Quorum, from: Identity, now: Instant, unix_ms: i64) -> u64 {
        let start: Vec<&quorum::Member> = quorum
            .members
            .iter()
            .filter(|m| m.lineage == quorum.lineage && !m.torn)
            .collect();
        let to = start.first().map_or(
            Identity {
                lineage: quorum.lineage,
                ..Identity::default()
            },
            |m| m.identity(),
        );
        let steps_lost = from.step.saturating_sub(to.step).max(0) as u64;
        let holders: Vec<String> = self.newest.holders().map(str::to_string).collect();
        tracing::error!(
            quorum_id = quorum.id,
            steps_lost,
            "ROLLBACK: the job's newest state, {from}, is held by no group that can come \
             back (last holders: {}); quorum {} starts lineage {} from {to}, held by {}: \
             the steps committed after step {} are lost",
            if holders.is_empty() {
                "gone".to_string()
            } else {
                holders.join(", ")
            },
            quorum.id,
            quorum.lineage,
            start
                .iter()
                .map(|m| m.replica_id.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            to.step,
        );
        self.newest
            .rolled_back(to, start.iter().map(|m| m.replica_id.as_str()), now);
        self.rollbacks.push(Rollback {
            quorum_id: quorum.id,
            from,
            to,
            steps_lost,
            unix_ms,
        });
        steps_lost
    }

    /// Runs the engine; on a quorum, answers every member's pending request.
    pub fn evaluate(&mut self, now: Instant, unix_ms: i64) -> Option<Issued> {
        self.see_live_holders(now);
        let quorum = match self.decide(now) {
            Decision::Wait { until, reason } => {
                self.set_waiting(reason, until);
                return None;
            }
            Decision::Issue(q) => q,
        };
        let waited = self
            .joiners
            .values()
            .map(|j| j.joined_at)
            .min()
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let changed = self.previous.as_ref().is_none_or(|p| p.id != quorum.id);
        let rolled_back = quorum
            .rolled_back_from
            .map(|from| self.rolled_back(&quorum, from, now, unix_ms));
        let sent = proto::Quorum {
            quorum_id: quorum.id,
            participants: quorum.members.iter().cloned().map(Into::into).collect(),
            issued_at_unix_ms: unix_ms,
            lineage: quorum.lineage,
            rolled_back_from: quorum.rolled_back_from.map(Into::into),
            issue: self.issue_base.wrapping_add(self.quorums_issued),
        };
        let whole = Bytes::from(sent.encode_to_vec());
        // Each encoded once, whoever gets it.
        let update = self.sent.as_ref().and_then(|known| {
            let update = delta::between(known, &sent)?;
            Some((known.issue, Bytes::from(update.encode_to_vec())))
        });
        let mut members = quorum.in_order();
        self.joiners.retain(|id, _| !members.contains(id));
        for id in quorum.replica_ids() {
            if let Some(p) = self.pending.remove(id) {
                let answer = match &update {
                    Some((base, update)) if p.known_issue == *base => {
                        Answer::Update(update.clone())
                    }
                    _ => Answer::Whole(whole.clone()),
                };
                let _ = p.reply.send(Ok(answer));
            }
        }
        self.sent = Some(sent);
        // Told at once, so that they look again whether they can reach the others,
        // rather than wait out their request: as a quorum that did not come in time
        // (the lighthouse was reached; this round has no place for them).
        for (id, by) in &quorum.left_out {
            self.joiners.remove(id);
            if let Some(p) = self.pending.remove(id) {
                let _ = p.reply.send(Err(Status::deadline_exceeded(format!(
                    "left out of quorum {}: replica group {by:?} could not reach this group \
                     (a cut between their hosts); asking again once they reach each other",
                    quorum.id
                ))));
            }
        }
        // Leases name the new quorum from now on; a member of the old one left out
        // of it holds none.
        if let Some(old) = &self.previous {
            let mut members = quorum.in_order();
            for id in old.replica_ids().filter(|id| !members.contains(id)) {
                if let Some(r) = self.replicas.get(id) {
                    r.pulse.set_lease_quorum(0);
                }
            }
        }
        for id in quorum.replica_ids() {
            if let Some(r) = self.replicas.get_mut(id) {
                r.pulse.set_lease_quorum(quorum.id);
                r.joined = true;
            }
        }
        self.heard.fetch_max(quorum.id, Relaxed);
        self.quorums_issued += 1;
        let issued = Issued {
            quorum_id: quorum.id,
            changed,
            waited,
            rolled_back,
        };
        self.previous = Some(quorum);
        self.previous_at = Some(now);
        // Whoever is left (kept out by shrink_only) starts the next round now.
        for j in self.joiners.values_mut() {
            j.joined_at = now;
        }
        let (reason, until) = match self.decide(now) {
            Decision::Wait { until, reason } => (reason, until),
            Decision::Issue(_) => (WaitReason::NoJoiners, Some(now)),
        };
        self.set_waiting(reason, until);
        Some(issued)
    }

    /// Whether the engine's last decision, to wait until its deadline for live
    /// members of the current quorum that have not asked again, still stands after a
    /// join: then the join need not run the engine (nor the stall check), which would
    /// cost every round time proportional to the square of its groups.
    ///
    /// It stands while some member is still late (live, not asking), the wait's
    /// deadline is ahead, and nothing that time changes (a heartbeat expiry, a stall,
    /// the engine's deadline) is due before the deadline task has acted on it, which
    /// `ticker_deadline` tells: a join adds a live joiner, never a late member or an
    /// earlier first request, so the engine would wait too, until the same deadline
    /// or a later one (a re-request moves the round's first request later; the
    /// deadline task then finds the wait longer). Nor can a join make a stalled
    /// member due for eviction at once: its wait starts now, and a stall is evicted
    /// only once a peer waited half the stall timeout; but a member due already and
    /// waited on by nobody yet gets its eviction time from this join, so then the
    /// stall check runs (and the deadline task is set for that time).
    pub fn wait_stands(&mut self, now: Instant) -> bool {
        let (reason, Some(until)) = &self.waiting else {
            return false;
        };
        if self.engine_due
            || self.stalls.overdue()
            || now >= *until
            || self.ticker_deadline.is_none_or(|at| now >= at)
        {
            return false;
        }
        let stands = match reason {
            WaitReason::LateMembers { .. } | WaitReason::MembersOnTheirWay { .. } => {
                self.a_member_is_late(now)
            }
            // The first round waits for every live group, and every group is live
            // while no heartbeat expiry is due (`ticker_deadline`); a join's group is
            // one of them, so some group has not asked while there are fewer joiners.
            WaitReason::GatheringFirstQuorum { .. } => self.joiners.len() < self.replicas.len(),
            // A restarted lighthouse's first round waits out its deadline whoever asks.
            WaitReason::RejoiningAfterRestart { .. } => true,
            _ => false,
        };
        self.waiting_stale |= stands;
        stands
    }

    /// Whether some live member of the current quorum has not asked again, looked for
    /// from where the last look stopped (see `late_cursor`).
    fn a_member_is_late(&mut self, now: Instant) -> bool {
        let Some(quorum) = &self.previous else {
            return false;
        };
        let horizon = now.checked_sub(self.heartbeat_timeout);
        let live = Fresh {
            replicas: &self.replicas,
            horizon,
        };
        let late = quorum.members[self.late_cursor.min(quorum.members.len())..]
            .iter()
            .position(|m| !self.joiners.contains_key(&m.replica_id) && live.is_live(&m.replica_id));
        match late {
            Some(at) => {
                self.late_cursor += at;
                true
            }
            None => false,
        }
    }

    /// Whether the engine's last decision stands after a heartbeat stream opened: it
    /// adds a live group and no request, and a round waits for a live group or
    /// leaves it out, so it ends no wait; nor does a round start while nobody asks.
    /// Then the open need not run the engine (nor the stall check, see `stall_of`),
    /// which on every open would cost a job's start time proportional to the square
    /// of its groups.
    pub fn decision_stands(&mut self, now: Instant) -> bool {
        let nobody_asks = self.joiners.is_empty()
            && matches!(self.waiting.0, WaitReason::NoJoiners)
            && !self.engine_due
            && !self.stalls.overdue();
        nobody_asks || self.wait_stands(now)
    }

    pub fn waiting_until(&self) -> Option<Instant> {
        self.waiting.1
    }

    /// Why no quorum is issued yet, as of `now`.
    pub fn waiting_reason(&self, now: Instant) -> WaitReason {
        if !self.waiting_stale {
            return self.waiting.0.clone();
        }
        match self.decide(now) {
            Decision::Wait { reason, .. } => reason,
            Decision::Issue(_) => self.waiting.0.clone(),
        }
    }

    pub fn current_quorum(&self) -> Option<&Quorum> {
        self.previous.as_ref()
    }
}

#[cfg(test)]
mod tests;
