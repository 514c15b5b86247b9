//! A group's liveness, as the lighthouse state keeps it: its heartbeat stream opened
//! (one live stream per replica id) and closed, a silent group expired after the
//! heartbeat timeout, a stalled one evicted (stall detection, `stall`, judges), and
//! what an eviction tells the other members of the quorum at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tonic::Status;

use super::{HeartbeatStream, LighthouseState, Replica};
use crate::lighthouse::history::{Eviction, Lost, StepSamples};
use crate::lighthouse::pulse::Pulse;
use crate::lighthouse::stall::{self, Groups, Watched};
use crate::proto;
use crate::quorum::{Identity, Joiner, Quorum, ReplicaId};

/// The groups as stall detection sees them.
struct Watch<'a> {
    replicas: &'a HashMap<ReplicaId, Replica>,
    joiners: &'a BTreeMap<ReplicaId, Joiner>,
    quorum: Option<&'a Quorum>,
}

impl Groups for Watch<'_> {
    fn quorum(&self) -> Option<&Quorum> {
        self.quorum
    }
    fn watched(&self, replica_id: &str) -> Watched {
        let asked_at = self.joiners.get(replica_id).map(|j| j.joined_at);
        as_watched(self.replicas.get(replica_id), asked_at)
    }

    /// The quorum's members and the joiners are both in replica-id order: one merged
    /// walk finds which members ask, where a search of the joiners per member would
    /// compare a dozen ids or more.
    fn members(&self) -> Box<dyn Iterator<Item = (&str, Watched)> + '_> {
        let mut joiners = self.joiners.iter().peekable();
        let ids = self.quorum.into_iter().flat_map(Quorum::replica_ids);
        Box::new(ids.map(move |id| {
            while joiners.next_if(|(j, _)| j.as_str() < id).is_some() {}
            let asked_at = joiners
                .next_if(|(j, _)| j.as_str() == id)
                .map(|(_, j)| j.joined_at);
            (id, as_watched(self.replicas.get(id), asked_at))
        }))
    }

    /// Each group's own record first (one that reports no training or never trained
    /// is never due), then a search of the quorum's sorted members, and only for the
    /// groups outside it, of the joiners.
    fn dropped(&self) -> Box<dyn Iterator<Item = (&str, Instant)> + '_> {
        Box::new(self.replicas.iter().filter_map(|(id, replica)| {
            let at = stall::dropped_at(&as_watched(Some(replica), None))?;
            let inside = self.quorum.is_some_and(|q| q.contains(id));
            (!inside && !self.joiners.contains_key(id)).then_some((id.as_str(), at))
        }))
    }
}

/// A group as stall detection sees it: what its record says (none: it is not live),
/// and when it asked for the next quorum.
fn as_watched(replica: Option<&Replica>, asked_at: Option<Instant>) -> Watched {
    Watched {
        training: replica.and_then(|r| r.pulse.training()),
        asked_at,
        step: replica.map_or(0, |r| r.pulse.step()),
        joined: replica.is_some_and(|r| r.joined),
        stream_opened_at: replica.and_then(|r| r.stream.as_ref().map(|s| s.opened_at)),
    }
}

impl LighthouseState {
    /// Opens a group's heartbeat stream; its beats go to the returned pulse. A second
    /// live stream for the same replica id is refused, naming the one already connected.
    pub fn open_stream(
        &mut self,
        beat: &proto::Beat,
        peer: String,
        events: mpsc::Sender<Result<proto::LighthouseEvent, Status>>,
        now: Instant,
    ) -> Result<(u64, Arc<Pulse>), Status> {
        let id = &beat.replica_id;
        // The same manager server opening a new stream gave up its old one (it went
        // silent to it: a cut): that is the group coming back, not a second one.
        let same_group = |s: &&HeartbeatStream| {
            !beat.manager_address.is_empty() && s.manager_address == beat.manager_address
        };
        if let Some(HeartbeatStream { peer: other, .. }) =
            self.live_stream(id, now).filter(|s| !same_group(s))
        {
            return Err(Status::already_exists(format!(
                "replica id {id:?} is already live, heartbeating from {other}; give this group \
                 another --replica-id, or stop the other process (a dead one is forgotten \
                 within the heartbeat timeout, {:.1} s)",
                self.heartbeat_timeout.as_secs_f64()
            )));
        }
        // A group whose old stream went silent is dead: its peers learn it now, and
        // the new stream starts without a lease.
        if self.replicas.get(id).is_some_and(|r| r.stream.is_some()) {
            self.evict(id, Eviction::HeartbeatTimeout, now);
        }
        // A fresh pulse: a stale stream of the same group, should it wake up, beats
        // into its own retired one and ends. A group known so far only from its quorum
        // requests keeps the quorum it is a member of. A member of the current quorum
        // found dead since the engine looked may live again: `wait_stands` looks for
        // late members from the start.
        self.late_cursor = 0;
        let pulse = self.new_pulse(now, beat.step);
        pulse.beat(now, beat.step, beat.last_quorum_id);
        let (history, steps, last_commit, joined) = match self.replicas.remove(id) {
            Some(known) => {
                pulse.set_lease_quorum(known.pulse.lease_quorum());
                known.pulse.retire();
                (known.history, known.steps, known.last_commit, known.joined)
            }
            None => (self.lost.returned(id), StepSamples::default(), now, false),
        };
        self.next_ticket += 1;
        let stream_id = self.next_ticket;
        self.replicas.insert(
            id.clone(),
            Replica {
                pulse: pulse.clone(),
                stream: Some(HeartbeatStream {
                    id: stream_id,
                    events,
                    peer,
                    manager_address: beat.manager_address.clone(),
                    opened_at: now,
                }),
                history,
                steps,
                last_commit,
                joined,
            },
        );
        Ok((stream_id, pulse))
    }

    /// The stream dropped (`StreamBroken`: the group is dead now, not after a timeout)
    /// or said it is leaving (`Left`). Nothing when the stream is not the group's own.
    pub fn close_stream(
        &mut self,
        replica_id: &str,
        stream_id: u64,
        cause: Eviction,
        now: Instant,
    ) -> Option<Eviction> {
        if !self.streams(replica_id, stream_id) {
            return None;
        }
        self.evict(replica_id, cause, now);
        Some(cause)
    }

    /// The group of stream `stream_id` ends its run holding `held` (its leaving beat
    /// says so): the job's newest state is at least that, held by nobody once it is
    /// gone, so a quorum of groups behind it starts a new lineage, announced, rather
    /// than commit its step numbers again (invariant I11).
    pub fn leaves_holding(
        &mut self,
        replica_id: &str,
        stream_id: u64,
        held: Identity,
        now: Instant,
    ) {
        if self.streams(replica_id, stream_id) {
            self.newest.observe(replica_id, held, now);
        }
    }

    /// Whether `stream_id` is the heartbeat stream `replica_id` has open.
    fn streams(&self, replica_id: &str, stream_id: u64) -> bool {
        self.replicas
            .get(replica_id)
            .and_then(|r| r.stream.as_ref())
            .is_some_and(|s| s.id == stream_id)
    }

    /// Declares dead every group silent for longer than the heartbeat timeout.
    pub fn expire(&mut self, now: Instant) -> Vec<(ReplicaId, Eviction)> {
        let Some(horizon) = now.checked_sub(self.heartbeat_timeout) else {
            return Vec::new();
        };
        // Retiring in the same atomic step as the check means a beat that arrives
        // meanwhile either lands before it (and the group lives on) or is refused (and
        // never acknowledged), so no lease outlives its group's eviction.
        let stale: Vec<ReplicaId> = self
            .replicas
            .iter()
            .filter(|(_, r)| r.pulse.retire_if_silent_since(horizon))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            self.evict(id, Eviction::HeartbeatTimeout, now);
        }
        stale
            .into_iter()
            .map(|id| (id, Eviction::HeartbeatTimeout))
            .collect()
    }

    /// Forgets a dead group (only what the status page shows of it stays, for a
    /// while), answers its pending request, and tells the other members of the current
    /// quorum at once.
    fn evict(&mut self, replica_id: &str, cause: Eviction, now: Instant) {
        // A group evicted as stalled still reads its stream: it is told, so that its
        // ranks dump what they were doing and exit to be restarted.
        self.engine_due = true;
        // A process that died or exits took its state with it; one that went silent
        // may come back with it.
        if cause != Eviction::HeartbeatTimeout {
            self.newest.gone(replica_id);
        }
        let mut own = None;
        if let Some(r) = self.replicas.remove(replica_id) {
            r.pulse.retire();
            if cause == Eviction::ProgressStalled {
                own = r.stream.as_ref().map(|s| s.events.clone());
            }
            self.remember_lost(replica_id, r, cause, now);
        }
        self.joiners.remove(replica_id);
        if let Some(p) = self.pending.remove(replica_id) {
            let _ = p.reply.send(Err(Status::unavailable(format!(
                "replica group {replica_id:?} was declared dead ({}) while waiting for a quorum",
                cause.as_str()
            ))));
        }
        let event = proto::LighthouseEvent {
            event: Some(proto::lighthouse_event::Event::MembershipLost(
                proto::MembershipLost {
                    quorum_id: self.previous.as_ref().map_or(0, |q| q.id),
                    lost: vec![replica_id.to_string()],
                    cause: cause.as_str().to_string(),
                },
            )),
        };
        if let Some(own) = own {
            let _ = own.try_send(Ok(event.clone()));
        }
        let Some(current) = &self.previous else {
            return;
        };
        if !current.contains(replica_id) {
            return;
        }
        for peer in current.replica_ids() {
            if let Some(stream) = self.replicas.get(peer).and_then(|r| r.stream.as_ref()) {
                // A full queue means the peer is not reading; it will learn from its next quorum.
                let _ = stream.events.try_send(Ok(event.clone()));
            }
        }
    }

    /// Evicts every group stall detection finds hung (see `Stalls::judge`); returns
    /// them, and whether a member is due but waited on by nobody yet.
    pub fn evict_stalled(&mut self, now: Instant) -> (Vec<ReplicaId>, bool) {
        let watch = Watch {
            replicas: &self.replicas,
            joiners: &self.joiners,
            quorum: self.previous.as_ref(),
        };
        let (stalled, overdue) = self.stalls.judge(&watch, now);
        for id in &stalled {
            tracing::warn!(
                replica_id = id,
                "replica group made no progress for its stall timeout while its peers wait \
                 on it: evicted"
            );
            self.evict(id, Eviction::ProgressStalled, now);
        }
        (stalled, overdue)
    }

    /// The groups as stall detection reads them.
    fn watch(&self) -> Watch<'_> {
        Watch {
            replicas: &self.replicas,
            joiners: &self.joiners,
            quorum: self.previous.as_ref(),
        }
    }

    fn remember_lost(&mut self, replica_id: &str, r: Replica, cause: Eviction, now: Instant) {
        let lost = Lost {
            replica_id: replica_id.to_string(),
            cause,
            at: now,
            step: r.pulse.step(),
            was_member: self
                .previous
                .as_ref()
                .is_some_and(|q| q.contains(replica_id)),
            peer: r.stream.map(|s| s.peer).unwrap_or_default(),
            history: r.history,
        };
        self.lost.remember(lost, now);
    }

    /// When stall detection next has group `replica_id` to judge as dropped out of
    /// the quorum (see `stall::dropped_due`): all that a stream's opening changes of
    /// it (a fresh pulse reports no progress and no wait yet, so no member becomes
    /// due or waited on sooner).
    pub fn stall_of(&self, replica_id: &str, now: Instant) -> Option<Instant> {
        stall::dropped_due(&self.watch(), replica_id).filter(|at| *at > now)
    }

    /// When stall detection next has a group to judge (see `Stalls::next`).
    pub fn next_stall(&self, now: Instant) -> Option<Instant> {
        self.stalls.next(&self.watch(), now)
    }
}

#[cfg(test)]
mod tests;
