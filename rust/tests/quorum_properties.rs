//! Property tests for the quorum engine: random scenes and random lighthouse
//! histories, checked against the rules in `phalanx::quorum`'s documentation.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use phalanx::quorum::*;
use proptest::prelude::*;

/// Byte order differs from the "natural" order here ("B" < "a", "r10" < "r2"),
/// so a quorum sorted any other way than by replica id would show.
const NAMES: [&str; 8] = ["r2", "a", "B", "r10", "z", "aa", "r1", "b"];

fn name(i: usize) -> ReplicaId {
    NAMES[i].to_string()
}

fn member(i: usize) -> Member {
    Member {
        replica_id: name(i),
        world_size: 1,
        ..Member::default()
    }
}

fn ids(q: &Quorum) -> Vec<String> {
    q.replica_ids().map(str::to_string).collect()
}

/// A subset of `NAMES`, one flag per name (shrinks name by name, unlike a bitmask).
type Subset = [bool; NAMES.len()];

fn subset() -> impl Strategy<Value = Subset> {
    prop::array::uniform8(any::<bool>())
}

fn names_in(subset: &Subset) -> impl Iterator<Item = usize> + '_ {
    (0..NAMES.len()).filter(|&i| subset[i])
}

/// The random part of one replica's join request.
#[derive(Clone, Debug)]
struct JoinSpec {
    offset_ms: u64,
    last_quorum_id: QuorumId,
    shrink_only: bool,
    commit_failures: u32,
}

fn join_spec() -> impl Strategy<Value = JoinSpec> {
    (
        0..2_000u64,
        0..20u64,
        // Rare, as in real jobs: a frequent shrink_only would starve most scenes.
        prop::bool::weighted(0.1),
        prop_oneof![4 => Just(0u32), 1 => 1..3u32],
    )
        .prop_map(
            |(offset_ms, last_quorum_id, shrink_only, commit_failures)| JoinSpec {
                offset_ms,
                last_quorum_id,
                shrink_only,
                commit_failures,
            },
        )
}

/// One evaluation's inputs, in owned form so proptest can print and shrink it.
#[derive(Clone, Debug)]
struct Scene {
    live: BTreeSet<ReplicaId>,
    /// Who asked to join; dead replicas may be among them, as a lighthouse may
    /// not have dropped a request by the time its sender is declared dead.
    joins: BTreeMap<usize, JoinSpec>,
    previous: Option<Quorum>,
    highest_seen_id: QuorumId,
    config: QuorumConfig,
    now_ms: u64,
}

impl Scene {
    /// Builds the joiners map inserting in `order` (indices not in `joins` are skipped).
    fn joiners_in_order(&self, t0: Instant, order: &[usize]) -> BTreeMap<ReplicaId, Joiner> {
        let mut joiners = BTreeMap::new();
        for i in order {
            if let Some(spec) = self.joins.get(i) {
                joiners.insert(
                    name(*i),
                    Joiner {
                        member: Member {
                            shrink_only: spec.shrink_only,
                            commit_failures: spec.commit_failures,
                            ..member(*i)
                        },
                        last_quorum_id: spec.last_quorum_id,
                        joined_at: t0 + Duration::from_millis(spec.offset_ms),
                    },
                );
            }
        }
        joiners
    }

    fn joiners(&self, t0: Instant) -> BTreeMap<ReplicaId, Joiner> {
        self.joiners_in_order(t0, &(0..NAMES.len()).collect::<Vec<_>>())
    }

    fn decide_with(&self, t0: Instant, joiners: &BTreeMap<ReplicaId, Joiner>) -> Decision {
        decide(&Round {
            joiners,
            live: &self.live,
            previous: self.previous.as_ref(),
            // The previous quorum was issued at t0, before every request of this round.
            previous_at: self.previous.as_ref().map(|_| t0),
            highest_seen_id: self.highest_seen_id,
            newest: None,
            config: &self.config,
            now: t0 + Duration::from_millis(self.now_ms),
        })
    }

    fn decide(&self, t0: Instant) -> Decision {
        self.decide_with(t0, &self.joiners(t0))
    }
}

/// Sorts members by replica id, as a quorum's members must be.
fn sorted_members(members: impl IntoIterator<Item = Member>) -> Vec<Member> {
    members
        .into_iter()
        .map(|m| (m.replica_id.clone(), m))
        .collect::<BTreeMap<_, _>>()
        .into_values()
        .collect()
}

fn scene_with(
    previous: impl Strategy<Value = Option<(Subset, QuorumId)>>,
) -> impl Strategy<Value = Scene> {
    (
        subset(),
        prop::collection::vec(prop::option::of(join_spec()), NAMES.len()),
        previous,
        0..20u64,
        1..=4usize,
        1..2_000u64,
        0..5_000u64,
    )
        .prop_map(
            |(live, joins, previous, highest_seen_id, min_replicas, timeout_ms, now_ms)| Scene {
                live: names_in(&live).map(name).collect(),
                joins: joins
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, spec)| Some((i, spec?)))
                    .collect(),
                previous: previous.map(|(members, id)| Quorum {
                    id,
                    members: sorted_members(names_in(&members).map(member)),
                    lineage: 0,
                    rolled_back_from: None,
                    left_out: Vec::new(),
                }),
                highest_seen_id,
                config: QuorumConfig {
                    min_replicas,
                    join_timeout: Duration::from_millis(timeout_ms),
                },
                now_ms,
            },
        )
}

/// A quorum as the lighthouse would have issued it: never empty.
fn previous_quorum() -> impl Strategy<Value = (Subset, QuorumId)> {
    (
        subset().prop_filter("an issued quorum has members", |s| s.contains(&true)),
        1..20u64,
    )
}

fn scene() -> impl Strategy<Value = Scene> {
    scene_with(prop::option::weighted(0.7, previous_quorum()))
}

/// Properties 1 and 2 for a quorum issued from these inputs at `now`.
fn check_issued(
    q: &Quorum,
    joiners: &BTreeMap<ReplicaId, Joiner>,
    live: &BTreeSet<ReplicaId>,
    previous: Option<&Quorum>,
    config: &QuorumConfig,
    previous_at: Option<Instant>,
    now: Instant,
) -> Result<(), TestCaseError> {
    for id in q.replica_ids() {
        prop_assert!(live.contains(id), "dead replica {id} is a member of {q:?}");
        prop_assert!(
            joiners.contains_key(id),
            "{id} never asked to join, yet is in {q:?}"
        );
    }
    prop_assert!(q.members.len() >= config.min_replicas);
    prop_assert!(
        q.members
            .windows(2)
            .all(|w| w[0].replica_id < w[1].replica_id),
        "members not strictly sorted: {:?}",
        ids(q)
    );
    // The replicas that matter for the majority: live joiners, and live previous
    // members that have not asked, for LATE_MEMBER_JOIN_TIMEOUTS join timeouts from
    // the issue of the previous quorum.
    let first_join = joiners
        .values()
        .filter(|j| live.contains(&j.member.replica_id))
        .map(|j| j.joined_at)
        .min()
        .expect("a quorum was issued, so someone joined");
    let since = previous_at.unwrap_or(first_join);
    let late_count = now < since + LATE_MEMBER_JOIN_TIMEOUTS * config.join_timeout;
    let relevant: BTreeSet<&str> = previous
        .into_iter()
        .flat_map(Quorum::replica_ids)
        .filter(|_| late_count)
        .chain(joiners.keys().map(String::as_str))
        .filter(|id| live.contains(*id))
        .collect();
    prop_assert!(
        2 * q.members.len() > relevant.len(),
        "{} members out of {} relevant replicas is no majority",
        q.members.len(),
        relevant.len()
    );
    Ok(())
}

proptest! {
    #[test]
    fn a_dead_replica_is_never_a_member(scene in scene()) {
        if let Decision::Issue(q) = scene.decide(Instant::now()) {
            for id in q.replica_ids() {
                prop_assert!(scene.live.contains(id), "dead replica {id} in {q:?}");
            }
        }
    }

    #[test]
    fn an_issued_quorum_is_a_sorted_majority_of_live_joiners(scene in scene()) {
        let t0 = Instant::now();
        let joiners = scene.joiners(t0);
        if let Decision::Issue(q) = scene.decide_with(t0, &joiners) {
            let now = t0 + Duration::from_millis(scene.now_ms);
            let previous_at = scene.previous.as_ref().map(|_| t0);
            check_issued(
                &q,
                &joiners,
                &scene.live,
                scene.previous.as_ref(),
                &scene.config,
                previous_at,
                now,
            )?;
        }
    }

    #[test]
    fn the_same_round_always_gets_the_same_decision(
        scene in scene(),
        order in Just((0..NAMES.len()).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let t0 = Instant::now();
        let first = scene.decide(t0);
        prop_assert_eq!(&first, &scene.decide(t0));
        // The lighthouse fills its map in arrival order, which must not matter.
        let shuffled = scene.joiners_in_order(t0, &order);
        prop_assert_eq!(&first, &scene.decide_with(t0, &shuffled));
        let reversed: Vec<usize> = (0..NAMES.len()).rev().collect();
        prop_assert_eq!(&first, &scene.decide_with(t0, &scene.joiners_in_order(t0, &reversed)));
    }

    #[test]
    fn a_previous_quorum_that_has_fully_rejoined_is_issued_without_waiting(
        scene in scene_with(previous_quorum().prop_map(Some)),
        rejoin in join_spec(),
    ) {
        let mut scene = scene;
        // Every live previous member rejoins; nobody asks to shrink.
        let previous = scene.previous.clone().expect("strategy always has a previous quorum");
        for id in previous.replica_ids().filter(|id| scene.live.contains(*id)) {
            let i = NAMES.iter().position(|n| n == &id).expect("known name");
            scene.joins.entry(i).or_insert_with(|| rejoin.clone());
        }
        for spec in scene.joins.values_mut() {
            spec.shrink_only = false;
        }
        let live_joiners = scene.joins.keys().filter(|&&i| scene.live.contains(NAMES[i])).count();
        prop_assume!(live_joiners > 0);
        // Keep min_replicas satisfiable; the majority then holds by construction.
        scene.config.min_replicas = 1 + (scene.config.min_replicas - 1) % live_joiners;
        let decision = scene.decide(Instant::now());
        prop_assert!(matches!(decision, Decision::Issue(_)), "expected a quorum, got {decision:?}");
    }

    #[test]
    fn a_wait_with_a_deadline_always_ends_in_the_future(scene in scene()) {
        let t0 = Instant::now();
        if let Decision::Wait { until: Some(until), reason } = scene.decide(t0) {
            let now = t0 + Duration::from_millis(scene.now_ms);
            prop_assert!(until > now, "waits until {until:?}, not after now {now:?} ({reason})");
        }
    }

    #[test]
    fn a_restarted_lighthouse_numbers_above_every_id_it_hears(
        scene in scene_with(Just(None)),
    ) {
        let t0 = Instant::now();
        let joiners = scene.joiners(t0);
        if let Decision::Issue(q) = scene.decide_with(t0, &joiners) {
            // Dead joiners count too: their requests prove those ids were in use.
            let reported = joiners
                .values()
                .map(|j| j.last_quorum_id)
                .max()
                .unwrap_or(0);
            prop_assert!(q.id > reported, "id {} not above reported id {reported}", q.id);
            prop_assert!(q.id > scene.highest_seen_id);
        }
    }
}

/// A request whose sender died before the quorum formed still proves its id was in use.
#[test]
fn a_dead_joiners_reported_id_is_not_reused() {
    let t0 = Instant::now();
    let scene = Scene {
        live: [name(1)].into(),
        joins: [
            (
                1,
                JoinSpec {
                    offset_ms: 0,
                    last_quorum_id: 0,
                    shrink_only: false,
                    commit_failures: 0,
                },
            ),
            (
                7,
                JoinSpec {
                    offset_ms: 0,
                    last_quorum_id: 5,
                    shrink_only: false,
                    commit_failures: 0,
                },
            ),
        ]
        .into(),
        previous: None,
        highest_seen_id: 0,
        config: QuorumConfig {
            min_replicas: 1,
            join_timeout: Duration::from_secs(1),
        },
        now_ms: 0,
    };
    match scene.decide(t0) {
        Decision::Issue(q) => assert!(q.id > 5, "issued id {} although \"b\" reported 5", q.id),
        wait => panic!("expected a quorum, got {wait:?}"),
    }
}

/// What happens to the simulated lighthouse between two evaluations.
#[derive(Clone, Debug)]
enum Event {
    Join {
        replica: usize,
        shrink_only: bool,
        commit_failures: u32,
    },
    Die(usize),
    Revive(usize),
    Advance(u64),
    Evaluate,
}

fn event() -> impl Strategy<Value = Event> {
    let replica = 0..NAMES.len();
    prop_oneof![
        5 => (replica.clone(), prop::bool::weighted(0.1), prop_oneof![4 => Just(0u32), 1 => Just(1u32)])
            .prop_map(|(replica, shrink_only, commit_failures)| Event::Join {
                replica,
                shrink_only,
                commit_failures,
            }),
        1 => replica.clone().prop_map(Event::Die),
        1 => replica.prop_map(Event::Revive),
        2 => (0..1_500u64).prop_map(Event::Advance),
        3 => Just(Event::Evaluate),
    ]
}

/// The lighthouse's bookkeeping around the engine, reduced to what the engine sees.
struct Lighthouse {
    t0: Instant,
    now_ms: u64,
    live: BTreeSet<ReplicaId>,
    joiners: BTreeMap<ReplicaId, Joiner>,
    previous: Option<Quorum>,
    previous_at: Option<Instant>,
    /// The id of the last quorum each replica was a member of (0: none yet).
    last_in: [QuorumId; NAMES.len()],
    config: QuorumConfig,
    issued: Vec<Quorum>,
}

impl Lighthouse {
    fn apply(&mut self, event: &Event) -> Result<(), TestCaseError> {
        match *event {
            Event::Join {
                replica,
                shrink_only,
                commit_failures,
            } => {
                // A dead process sends nothing.
                if self.live.contains(NAMES[replica]) {
                    self.joiners.insert(
                        name(replica),
                        Joiner {
                            member: Member {
                                shrink_only,
                                commit_failures,
                                ..member(replica)
                            },
                            last_quorum_id: self.last_in[replica],
                            joined_at: self.t0 + Duration::from_millis(self.now_ms),
                        },
                    );
                }
            }
            Event::Die(replica) => {
                self.live.remove(NAMES[replica]);
            }
            Event::Revive(replica) => {
                self.live.insert(name(replica));
            }
            Event::Advance(ms) => self.now_ms += ms,
            Event::Evaluate => self.evaluate()?,
        }
        Ok(())
    }

    fn evaluate(&mut self) -> Result<(), TestCaseError> {
        // Live replicas heartbeat the ids they have seen.
        let highest_seen_id = (0..NAMES.len())
            .filter(|&i| self.live.contains(NAMES[i]))
            .map(|i| self.last_in[i])
            .max()
            .unwrap_or(0);
        let now = self.t0 + Duration::from_millis(self.now_ms);
        let decision = decide(&Round {
            joiners: &self.joiners,
            live: &self.live,
            previous: self.previous.as_ref(),
            previous_at: self.previous_at,
            highest_seen_id,
            newest: None,
            config: &self.config,
            now,
        });
        let q = match decision {
            Decision::Issue(q) => q,
            Decision::Wait { until, .. } => {
                prop_assert!(until.is_none_or(|t| t > now));
                return Ok(());
            }
        };
        check_issued(
            &q,
            &self.joiners,
            &self.live,
            self.previous.as_ref(),
            &self.config,
            self.previous_at,
            now,
        )?;

        let max_before = self.issued.iter().map(|p| p.id).max().unwrap_or(0);
        if let Some(last) = self.issued.last() {
            prop_assert!(q.id >= last.id, "id went down: {} after {}", q.id, last.id);
        }
        if let Some(same_id) = self.issued.iter().find(|p| p.id == q.id) {
            prop_assert_eq!(
                ids(same_id),
                ids(&q),
                "id {} reused for another membership",
                q.id
            );
        }
        let changed = self.previous.as_ref().is_none_or(|p| ids(p) != ids(&q));
        if changed {
            prop_assert!(
                q.id > max_before,
                "membership changed to {:?} but id {} is not above {max_before}",
                ids(&q),
                q.id
            );
        }

        for id in q.replica_ids() {
            let i = NAMES.iter().position(|n| *n == id).expect("known name");
            self.last_in[i] = q.id;
        }
        self.joiners.clear();
        self.previous = Some(q.clone());
        self.previous_at = Some(now);
        self.issued.push(q);
        Ok(())
    }
}

proptest! {
    #[test]
    fn quorum_ids_over_a_lighthouse_history_only_move_up_and_are_never_reused(
        live in subset(),
        min_replicas in 1..=4usize,
        timeout_ms in 1..1_000u64,
        events in prop::collection::vec(event(), 1..80),
    ) {
        let mut lighthouse = Lighthouse {
            t0: Instant::now(),
            now_ms: 0,
            live: names_in(&live).map(name).collect(),
            joiners: BTreeMap::new(),
            previous: None,
            previous_at: None,
            last_in: [0; NAMES.len()],
            config: QuorumConfig {
                min_replicas,
                join_timeout: Duration::from_millis(timeout_ms),
            },
            issued: Vec::new(),
        };
        for event in &events {
            lighthouse.apply(event)?;
        }
    }
}

proptest! {
    /// Invariant I3 over the whole range of ids a caller may report: the id issued is
    /// above every id heard, never wraps, and stays within what callers accept.
    #[test]
    fn a_quorum_id_is_above_every_id_heard_over_the_whole_u64_range(
        heard in prop_oneof![
            0..=phalanx::validate::MAX_QUORUM_ID,
            (phalanx::validate::MAX_QUORUM_ID - 16)..=phalanx::validate::MAX_QUORUM_ID,
            any::<u64>(),
        ],
        reported in any::<u64>(),
    ) {
        let reported = reported.min(heard);
        let joiners: BTreeMap<ReplicaId, Joiner> = [(
            name(0),
            Joiner {
                member: member(0),
                last_quorum_id: reported,
                joined_at: Instant::now(),
            },
        )]
        .into();
        let live: BTreeSet<ReplicaId> = [name(0)].into();
        let config = QuorumConfig { min_replicas: 1, join_timeout: Duration::from_millis(1) };
        let round = Round {
            joiners: &joiners,
            live: &live,
            previous: None,
            previous_at: None,
            highest_seen_id: heard,
            newest: None,
            config: &config,
            now: Instant::now() + Duration::from_secs(1),
        };
        let Decision::Issue(q) = decide(&round) else {
            return Err(TestCaseError::fail("a lone live joiner past the join timeout is issued"));
        };
        if heard < u64::MAX {
            prop_assert_eq!(q.id, heard + 1);
        } else {
            // Unreachable through the lighthouse (it refuses ids above MAX_QUORUM_ID),
            // and even so it saturates rather than wrap to 0.
            prop_assert_eq!(q.id, u64::MAX);
        }
        if heard <= phalanx::validate::MAX_QUORUM_ID {
            prop_assert!(phalanx::validate::quorum_id("last_quorum_id", heard).is_ok());
        } else {
            prop_assert!(phalanx::validate::quorum_id("last_quorum_id", heard).is_err());
        }
    }
}

/// One joiner's state and reports, for the never-back and reach properties.
#[derive(Clone, Debug)]
struct Held {
    identity: Identity,
    torn: bool,
    unreachable: Subset,
}

fn held() -> impl Strategy<Value = Held> {
    (
        (0..3u64, 0..6i64, 0..4u64),
        prop::bool::weighted(0.1),
        prop::array::uniform8(prop::bool::weighted(0.15)),
    )
        .prop_map(
            |((lineage, step, state_quorum_id), torn, unreachable)| Held {
                identity: Identity {
                    lineage,
                    step,
                    state_quorum_id,
                },
                torn,
                unreachable,
            },
        )
}

proptest! {
    /// Never back (I11), and members that can reach each other: whatever the
    /// joiners hold and report, an issued quorum's newest sound member is at least
    /// the job's newest state, unless no holder may come back any more and the
    /// quorum says it starts a new lineage above every id; and no member reports
    /// another member unreachable.
    #[test]
    fn a_quorum_never_starts_below_the_newest_state_while_a_holder_may_return(
        joins in prop::collection::btree_map(0..NAMES.len(), held(), 1..=NAMES.len()),
        newest in (0..3u64, 0..6i64, 0..4u64),
        wait_ms in prop::option::of(0..3_000u64),
        now_ms in 0..3_000u64,
    ) {
        let t0 = Instant::now();
        let joiners: BTreeMap<ReplicaId, Joiner> = joins
            .iter()
            .map(|(&i, h)| {
                let member = Member {
                    lineage: h.identity.lineage,
                    step: h.identity.step,
                    state_quorum_id: h.identity.state_quorum_id,
                    torn: h.torn,
                    unreachable: names_in(&h.unreachable).map(name).collect(),
                    ..member(i)
                };
                (name(i), Joiner { member, last_quorum_id: 0, joined_at: t0 })
            })
            .collect();
        let live: BTreeSet<ReplicaId> = joiners.keys().cloned().collect();
        let newest = Newest {
            state: Identity { lineage: newest.0, step: newest.1, state_quorum_id: newest.2 },
            may_return_until: wait_ms.map(|ms| t0 + Duration::from_millis(ms)),
        };
        let config = QuorumConfig { min_replicas: 1, join_timeout: Duration::from_millis(1) };
        let now = t0 + Duration::from_millis(now_ms) + Duration::from_millis(1);
        let decision = decide(&Round {
            joiners: &joiners,
            live: &live,
            previous: None,
            previous_at: None,
            highest_seen_id: 0,
            newest: Some(newest),
            config: &config,
            now,
        });
        let Decision::Issue(q) = decision else { return Ok(()) };
        for m in &q.members {
            // A group naming itself is no cut.
            for other in m.unreachable.iter().filter(|o| **o != m.replica_id) {
                prop_assert!(!q.contains(other), "{} reports member {} unreachable", m.replica_id, other);
            }
        }
        let best = q.members.iter().filter(|m| !m.torn).map(Member::identity).max();
        match q.rolled_back_from {
            None => {
                prop_assert!(best >= Some(newest.state), "{best:?} below {:?}", newest.state);
                prop_assert_eq!(q.lineage, best.map_or(0, |b| b.lineage));
            }
            Some(from) => {
                prop_assert_eq!(from, newest.state);
                prop_assert!(newest.may_return_until.is_none_or(|until| now >= until));
                prop_assert_eq!(q.lineage, q.id);
                prop_assert!(q.id > newest.state.state_quorum_id && q.id > newest.state.lineage);
                // The new lineage's start is the best state there was, relabeled.
                prop_assert!(best.is_none_or(|b| b.lineage == q.id));
            }
        }
    }
}
