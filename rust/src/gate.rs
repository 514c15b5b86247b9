//! Who may hold a connection to one of the job's listeners, and for how long.
//!
//! Every listener (lighthouse, manager server, state server) accepts a connection
//! before it can know whether the peer holds the job token: the token arrives with the
//! first request. Until then the connection is *unproven*, and unproven connections are
//! what a flood is made of. So they are few and short-lived: at most `max_unproven` at
//! once, each gone `prove_within` after it opened unless a request carrying the token
//! proved it. When a new connection would exceed a cap, the oldest unproven connection
//! of the peer holding the most unproven ones makes room: a flood from one host evicts
//! its own connections, not those of a rank that just connected from another. A proven
//! connection is never evicted for a newcomer; it is closed once nothing has moved on it
//! for `idle` (live gRPC peers answer the server's keepalive pings every 10 s).
//!
//! Pure: `now` comes in, ids of connections to close come out; `door.rs` does the I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::proto;

/// The caps of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateLimits {
    /// Connections at once, proven or not.
    pub max_connections: usize,
    /// Connections at once that have not yet presented the token.
    pub max_unproven: usize,
    /// How long a connection may stay unproven.
    pub prove_within: Duration,
    /// How long a proven connection may see no byte in either direction.
    pub idle: Duration,
}

impl GateLimits {
    /// A manager server: every rank of its group keeps one connection, and so do the
    /// other groups' ranks that meet in its rendezvous store.
    pub const RPC: GateLimits = GateLimits {
        max_connections: 4096,
        max_unproven: 256,
        prove_within: Duration::from_secs(5),
        idle: Duration::from_secs(60),
    };
    /// The lighthouse of a job (or jobs) of up to `groups` replica groups: each keeps
    /// one connection for its heartbeat stream and, for a minute after a call of its
    /// own (a quorum asked while no stream is open), a second; one that reconnects
    /// after a cut holds another until the old one is given up; beyond those, room
    /// for scrapes of the status page and metrics, operators' calls and the set's own
    /// peers. The unproven cap does not grow with it: a flood stays as small as ever.
    ///
    /// ```
    /// use phalanx::gate::GateLimits;
    /// assert_eq!(GateLimits::lighthouse(10_000).max_connections, 22_756);
    /// assert_eq!(GateLimits::lighthouse(10_000).max_unproven, GateLimits::RPC.max_unproven);
    /// ```
    pub fn lighthouse(groups: usize) -> GateLimits {
        GateLimits {
            max_connections: groups
                .saturating_mul(2)
                .saturating_add(groups / 4)
                .saturating_add(256),
            ..GateLimits::RPC
        }
    }

    /// A rank's state server: a few connections per healing rank, during a heal.
    pub const STATE: GateLimits = GateLimits {
        max_connections: 1024,
        max_unproven: 128,
        prove_within: Duration::from_secs(5),
        idle: Duration::from_secs(30),
    };
}

/// Why a request or connection was turned away; the label of `refused_requests`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A request without the job token, or with another one.
    Token,
    /// A request with a malformed field.
    Invalid,
    /// A group asked under a replica id that another live group holds.
    DuplicateReplica,
    /// A connection arrived while every slot held a proven connection.
    Full,
    /// A connection sent no request with the token within `prove_within`.
    Unproven,
    /// An unproven connection made room for a newer one.
    Crowded,
    /// A new job arrived while the lighthouse served its most jobs (`--max-jobs`).
    Jobs,
}

impl Refusal {
    pub const ALL: [Refusal; 7] = [
        Refusal::Token,
        Refusal::Invalid,
        Refusal::DuplicateReplica,
        Refusal::Full,
        Refusal::Unproven,
        Refusal::Crowded,
        Refusal::Jobs,
    ];

    /// The reason named `name` (as `as_str` writes it), if there is one.
    pub fn named(name: &str) -> Option<Refusal> {
        Refusal::ALL.into_iter().find(|r| r.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Token => "token",
            Refusal::Invalid => "invalid",
            Refusal::DuplicateReplica => "duplicate_replica",
            Refusal::Full => "connections_full",
            Refusal::Unproven => "no_token_in_time",
            Refusal::Crowded => "crowded_out",
            Refusal::Jobs => "jobs_full",
        }
    }
}

pub type ReasonLabel = Vec<(&'static str, &'static str)>;

/// Refusals counted by reason. The lighthouse exports the family as
/// `refused_requests`; every reason is there from the start, at zero.
#[derive(Clone, Debug)]
pub struct Refusals(Family<ReasonLabel, Counter>);

impl Default for Refusals {
    fn default() -> Self {
        let family = Family::default();
        for reason in Refusal::ALL {
            let _ = family.get_or_create(&label(reason));
        }
        Refusals(family)
    }
}

fn label(reason: Refusal) -> ReasonLabel {
    vec![("reason", reason.as_str())]
}

impl Refusals {
    pub fn count(&self, reason: Refusal) {
        self.0.get_or_create(&label(reason)).inc();
    }

    pub fn get(&self, reason: Refusal) -> u64 {
        self.0.get_or_create(&label(reason)).get()
    }

    /// Every reason with its count.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Refusal::ALL
            .iter()
            .map(|&r| (r.as_str(), self.get(r)))
            .collect()
    }

    pub fn family(&self) -> Family<ReasonLabel, Counter> {
        self.0.clone()
    }
}

/// Counts by reason, as a replica group reports them for its listeners.
pub type RefusalCounts = Vec<(Refusal, u64)>;

/// The counts a peer sent, one per reason (the last one sent, if it named a reason
/// twice); reasons this build does not know are dropped.
pub fn counts_from_wire(wire: &[proto::RefusalCount]) -> RefusalCounts {
    Refusal::ALL
        .into_iter()
        .filter_map(|reason| {
            let sent = wire.iter().rev().find(|c| c.reason == reason.as_str())?;
            Some((reason, sent.count))
        })
        .collect()
}

pub fn counts_to_wire(counts: &[(Refusal, u64)]) -> Vec<proto::RefusalCount> {
    counts
        .iter()
        .map(|&(r, count)| proto::RefusalCount {
            reason: r.as_str().into(),
            count,
        })
        .collect()
}

/// The refusals of one replica group's listeners: its manager server's own, and each
/// rank's state server's as the rank last reported them (with its quorum request).
#[derive(Debug, Default)]
pub struct GroupRefusals {
    pub own: Refusals,
    ranks: Mutex<BTreeMap<u32, RefusalCounts>>,
}

impl GroupRefusals {
    pub fn report(&self, rank: u32, counts: RefusalCounts) {
        self.ranks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rank, counts);
    }

    /// Every reason with the group's total, in `Refusal::ALL` order.
    pub fn totals(&self) -> RefusalCounts {
        let ranks = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
        Refusal::ALL
            .into_iter()
            .map(|reason| {
                let reported = ranks
                    .values()
                    .flatten()
                    .filter(|(r, _)| *r == reason)
                    .fold(0u64, |sum, (_, n)| sum.saturating_add(*n));
                (reason, self.own.get(reason).saturating_add(reported))
            })
            .collect()
    }
}

/// A connection's number at this listener; later connections have larger ones.
pub type ConnectionId = u64;

/// The answer to a new connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Keep it as `id`; close `crowded_out` (an older unproven connection) first.
    Admitted {
        id: ConnectionId,
        crowded_out: Option<ConnectionId>,
    },
    /// Every slot holds a proven connection: close the newcomer.
    Full,
}

#[derive(Debug)]
struct Entry {
    peer: IpAddr,
    opened: Instant,
    /// When a byte last moved; only looked at once proven.
    last_active: Instant,
    proven: bool,
}

#[derive(Debug)]
pub struct Gate {
    limits: GateLimits,
    entries: HashMap<ConnectionId, Entry>,
    /// Unproven connections by peer, oldest first (ids grow with time).
    unproven: HashMap<IpAddr, BTreeSet<ConnectionId>>,
    unproven_count: usize,
    next_id: ConnectionId,
}

impl Gate {
    pub fn new(limits: GateLimits) -> Self {
        Gate {
            limits,
            entries: HashMap::new(),
            unproven: HashMap::new(),
            unproven_count: 0,
            next_id: 0,
        }
    }

    pub fn limits(&self) -> GateLimits {
        self.limits
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn unproven_len(&self) -> usize {
        self.unproven_count
    }

    pub fn admit(&mut self, peer: IpAddr, now: Instant) -> Admission {
        let crowded = self.entries.len() >= self.limits.max_connections
            || self.unproven_count >= self.limits.max_unproven;
        let crowded_out = if crowded {
            match self.most_crowding() {
                Some(id) => {
                    self.leave(id);
                    Some(id)
                }
                None => return Admission::Full,
            }
        } else {
            None
        };
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            id,
            Entry {
                peer,
                opened: now,
                last_active: now,
                proven: false,
            },
        );
        self.unproven.entry(peer).or_default().insert(id);
        self.unproven_count += 1;
        Admission::Admitted { id, crowded_out }
    }

    /// The oldest unproven connection of the peer holding the most unproven ones.
    fn most_crowding(&self) -> Option<ConnectionId> {
        self.unproven
            .values()
            .max_by_key(|ids| (ids.len(), std::cmp::Reverse(ids.first().copied())))
            .and_then(|ids| ids.first().copied())
    }

    /// A request on `id` carried the token. False if `id` is no longer here.
    pub fn prove(&mut self, id: ConnectionId) -> bool {
        let Some(entry) = self.entries.get_mut(&id) else {
            return false;
        };
        if !entry.proven {
            entry.proven = true;
            let peer = entry.peer;
            self.forget_unproven(peer, id);
        }
        true
    }

    pub fn is_proven(&self, id: ConnectionId) -> bool {
        self.entries.get(&id).is_some_and(|e| e.proven)
    }

    /// Bytes moved on `id` at `now`.
    pub fn touch(&mut self, id: ConnectionId, now: Instant) {
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.last_active = entry.last_active.max(now);
        }
    }

    /// The connection closed (or was closed); its slot is free.
    pub fn leave(&mut self, id: ConnectionId) {
        if let Some(entry) = self.entries.remove(&id) {
            if !entry.proven {
                self.forget_unproven(entry.peer, id);
            }
        }
    }

    fn forget_unproven(&mut self, peer: IpAddr, id: ConnectionId) {
        if let Some(ids) = self.unproven.get_mut(&peer) {
            if ids.remove(&id) {
                self.unproven_count -= 1;
            }
            if ids.is_empty() {
                self.unproven.remove(&peer);
            }
        }
    }

    /// Removes and returns the connections to close at `now`: unproven past
    /// `prove_within` (first) and proven ones idle for `idle`.
    pub fn expire(&mut self, now: Instant) -> Vec<(ConnectionId, Expiry)> {
        let limits = self.limits;
        let expired: Vec<(ConnectionId, Expiry)> = self
            .entries
            .iter()
            .filter_map(|(&id, e)| {
                if !e.proven && now >= e.opened + limits.prove_within {
                    Some((id, Expiry::Unproven))
                } else if e.proven && now >= e.last_active + limits.idle {
                    Some((id, Expiry::Idle))
                } else {
                    None
                }
            })
            .collect();
        for (id, _) in &expired {
            self.leave(*id);
        }
        expired
    }

    /// When `expire` next has something to do, if ever.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.entries
            .values()
            .map(|e| {
                if e.proven {
                    e.last_active + self.limits.idle
                } else {
                    e.opened + self.limits.prove_within
                }
            })
            .min()
    }
}

/// Why `Gate::expire` closes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    Unproven,
    Idle,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const LIMITS: GateLimits = GateLimits {
        max_connections: 4,
        max_unproven: 2,
        prove_within: Duration::from_secs(5),
        idle: Duration::from_secs(60),
    };

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    fn admitted(gate: &mut Gate, peer: IpAddr, now: Instant) -> (ConnectionId, Option<u64>) {
        match gate.admit(peer, now) {
            Admission::Admitted { id, crowded_out } => (id, crowded_out),
            Admission::Full => panic!("refused as full"),
        }
    }

    #[test]
    fn a_flood_from_one_peer_crowds_out_its_own_oldest_connection() {
        let t0 = Instant::now();
        let mut gate = Gate::new(LIMITS);
        let (rank, _) = admitted(&mut gate, ip(1), t0);
        let (flood0, _) = admitted(&mut gate, ip(9), t0);
        // Full of unproven: a newcomer pushes out the oldest connection of the peer
        // holding the most unproven ones; on a tie, the older one (here the rank's).
        let (flood1, out) = admitted(&mut gate, ip(9), t0);
        assert_eq!(out, Some(rank));
        // From now on the flood only evicts itself.
        let (rank2, out) = admitted(&mut gate, ip(1), t0);
        assert_eq!(out, Some(flood0));
        let (_, out) = admitted(&mut gate, ip(9), t0);
        assert_eq!(out, Some(flood1));
        assert!(gate.prove(rank2));
        // One unproven slot is free again; after that the flood only replaces itself.
        assert_eq!(admitted(&mut gate, ip(9), t0).1, None);
        for _ in 0..100 {
            let (_, out) = admitted(&mut gate, ip(9), t0);
            assert!(out.is_some());
        }
        assert!(gate.is_proven(rank2));
        assert_eq!(gate.unproven_len(), LIMITS.max_unproven);
    }

    #[test]
    fn proven_connections_are_never_crowded_out_and_fill_the_gate_last() {
        let t0 = Instant::now();
        let mut gate = Gate::new(LIMITS);
        for _ in 0..LIMITS.max_connections {
            let (id, _) = admitted(&mut gate, ip(1), t0);
            assert!(gate.prove(id));
        }
        assert_eq!(gate.admit(ip(9), t0), Admission::Full);
        assert_eq!(gate.len(), LIMITS.max_connections);
    }

    #[test]
    fn unproven_connections_expire_and_proven_ones_only_when_idle() {
        let t0 = Instant::now();
        let mut gate = Gate::new(LIMITS);
        let (slow, _) = admitted(&mut gate, ip(1), t0);
        let (quick, _) = admitted(&mut gate, ip(2), t0 + Duration::from_secs(1));
        gate.prove(quick);
        assert_eq!(gate.next_expiry(), Some(t0 + LIMITS.prove_within));
        assert!(gate.expire(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(
            gate.expire(t0 + LIMITS.prove_within),
            [(slow, Expiry::Unproven)]
        );
        assert!(!gate.prove(slow), "an expired connection cannot be proven");
        gate.touch(quick, t0 + Duration::from_secs(30));
        let idle_at = t0 + Duration::from_secs(30) + LIMITS.idle;
        assert_eq!(gate.next_expiry(), Some(idle_at));
        assert!(gate.expire(idle_at - Duration::from_millis(1)).is_empty());
        assert_eq!(gate.expire(idle_at), [(quick, Expiry::Idle)]);
        assert!(gate.is_empty());
        assert_eq!(gate.next_expiry(), None);
    }

    #[test]
    fn leaving_frees_the_slot_whatever_the_state() {
        let t0 = Instant::now();
        let mut gate = Gate::new(LIMITS);
        let (a, _) = admitted(&mut gate, ip(1), t0);
        let (b, _) = admitted(&mut gate, ip(1), t0);
        gate.prove(b);
        gate.leave(a);
        gate.leave(b);
        gate.leave(b);
        assert!(gate.is_empty());
        assert_eq!(gate.unproven_len(), 0);
    }

    #[test]
    fn a_group_totals_its_own_refusals_and_what_each_rank_last_reported() {
        let group = GroupRefusals::default();
        group.own.count(Refusal::Token);
        group.report(1, vec![(Refusal::Token, 5), (Refusal::Crowded, 2)]);
        group.report(1, vec![(Refusal::Token, 7)]);
        group.report(2, vec![(Refusal::Token, 1)]);
        let totals = group.totals();
        assert_eq!(totals.len(), Refusal::ALL.len());
        assert!(totals.contains(&(Refusal::Token, 9)));
        assert!(totals.contains(&(Refusal::Crowded, 0)));
        assert_eq!(Refusal::named("crowded_out"), Some(Refusal::Crowded));
        let wire = |reason: &str, count| proto::RefusalCount {
            reason: reason.into(),
            count,
        };
        let garbled = [wire("token", 5), wire("nonsense", 9), wire("token", 7)];
        assert_eq!(counts_from_wire(&garbled), [(Refusal::Token, 7)]);
        assert_eq!(Refusal::named("nonsense"), None);
    }

    #[test]
    fn every_refusal_reason_is_exported_from_the_start() {
        let refusals = Refusals::default();
        refusals.count(Refusal::Token);
        let snapshot = refusals.snapshot();
        assert_eq!(snapshot.len(), Refusal::ALL.len());
        assert!(snapshot.contains(&("token", 1)));
        assert!(snapshot.contains(&("no_token_in_time", 0)));
    }
}
