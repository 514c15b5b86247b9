use super::*;

#[test]
fn a_long_wait_list_names_the_first_few_in_order_and_counts_the_rest() {
    let ids: Vec<String> = (0..20).rev().map(|i| format!("g{i:02}")).collect();
    let missing = Missing::of(ids.iter().map(String::as_str));
    assert_eq!(missing.count, 20);
    assert_eq!(
        missing.to_string(),
        "g00, g01, g02, g03, g04, g05, g06, g07 and 12 more"
    );
}

fn member(id: &str) -> Member {
    Member {
        replica_id: id.to_string(),
        world_size: 1,
        ..Member::default()
    }
}

struct Scene {
    t0: Instant,
    joiners: BTreeMap<ReplicaId, Joiner>,
    live: BTreeSet<ReplicaId>,
    /// When each group last made progress, as its beats report it.
    progressed: BTreeMap<ReplicaId, Instant>,
    /// The manager address a group beats from, where the test gives one.
    beats_from: BTreeMap<ReplicaId, String>,
    previous: Option<Quorum>,
    previous_at: Option<Instant>,
    newest: Option<Newest>,
    config: QuorumConfig,
}

/// A scene's groups as the lighthouse's liveness tracking would lend them.
struct Seen<'a>(&'a Scene);

impl LiveSet for Seen<'_> {
    fn is_live(&self, replica_id: &str) -> bool {
        self.0.live.is_live(replica_id)
    }
    fn live_ids(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        self.0.live.live_ids()
    }
    fn progressed_at(&self, replica_id: &str) -> Option<Instant> {
        self.0
            .progressed
            .get(replica_id)
            .copied()
            .filter(|_| self.is_live(replica_id))
    }
    fn manager_address(&self, replica_id: &str) -> Option<&str> {
        self.0.beats_from.get(replica_id).map(String::as_str)
    }
}

impl Scene {
    fn new(live: &[&str]) -> Self {
        Scene {
            t0: Instant::now(),
            joiners: BTreeMap::new(),
            live: live.iter().map(|s| s.to_string()).collect(),
            progressed: BTreeMap::new(),
            beats_from: BTreeMap::new(),
            previous: None,
            previous_at: None,
            newest: None,
            config: QuorumConfig {
                min_replicas: 1,
                join_timeout: Duration::from_secs(1),
            },
        }
    }

    fn join_at(&mut self, id: &str, ms: u64) {
        self.join_member(member(id), ms);
    }

    fn join_member(&mut self, m: Member, ms: u64) {
        self.live.insert(m.replica_id.clone());
        self.joiners.insert(
            m.replica_id.clone(),
            Joiner {
                member: m,
                last_quorum_id: self.previous.as_ref().map_or(0, |p| p.id),
                joined_at: self.t0 + Duration::from_millis(ms),
            },
        );
    }

    fn progressed_at(&mut self, id: &str, ms: u64) {
        self.progressed
            .insert(id.to_string(), self.t0 + Duration::from_millis(ms));
    }

    fn decide_at(&self, ms: u64) -> Decision {
        decide(&Round {
            joiners: &self.joiners,
            live: &Seen(self),
            previous: self.previous.as_ref(),
            previous_at: self.previous_at,
            highest_seen_id: 0,
            newest: self.newest,
            config: &self.config,
            now: self.t0 + Duration::from_millis(ms),
        })
    }

    /// Issues at `ms` (panicking otherwise) and starts the next round.
    fn issue_at(&mut self, ms: u64) -> Quorum {
        match self.decide_at(ms) {
            Decision::Issue(q) => {
                self.previous = Some(q.clone());
                self.previous_at = Some(self.t0 + Duration::from_millis(ms));
                self.joiners.clear();
                q
            }
            wait => panic!("expected a quorum, got {wait:?}"),
        }
    }
}

fn ids(q: &Quorum) -> Vec<&str> {
    q.replica_ids().collect()
}

proptest::proptest! {
    #[test]
    fn membership_asked_in_order_is_membership(
        members in proptest::collection::btree_set("[a-d]{1,3}", 0..12),
        asked in proptest::collection::btree_set("[a-d]{1,3}", 0..12),
    ) {
        let quorum = Quorum {
            id: 1,
            members: members.iter().map(|id| member(id)).collect(),
            lineage: 0,
            rolled_back_from: None,
            left_out: vec![],
        };
        let mut in_order = quorum.in_order();
        for id in &asked {
            proptest::prop_assert_eq!(in_order.contains(id), quorum.contains(id), "{}", id);
        }
    }
}

#[test]
fn first_quorum_waits_for_every_live_group_then_issues_at_once() {
    let mut s = Scene::new(&["a", "b", "c"]);
    s.join_at("b", 0);
    s.join_at("a", 5);
    assert_eq!(
        s.decide_at(10),
        Decision::Wait {
            until: Some(s.t0 + Duration::from_secs(1)),
            reason: WaitReason::GatheringFirstQuorum {
                missing: Missing::of(["c"].into_iter())
            },
        }
    );
    s.join_at("c", 20);
    let q = s.issue_at(20);
    assert_eq!(ids(&q), ["a", "b", "c"]);
    assert_eq!(q.id, 1);
}

#[test]
fn first_quorum_goes_ahead_without_a_silent_group_after_the_join_timeout() {
    let mut s = Scene::new(&["a", "b", "c"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    let q = s.issue_at(1000);
    assert_eq!(ids(&q), ["a", "b"]);
}

#[test]
fn unchanged_membership_keeps_its_id_and_issues_without_waiting() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    let first = s.issue_at(0);
    s.join_at("a", 100);
    s.join_at("b", 101);
    let second = s.issue_at(101);
    assert_eq!(second.id, first.id);
}

#[test]
fn a_dead_member_never_holds_the_quorum_back() {
    let mut s = Scene::new(&["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        s.join_at(id, 0);
    }
    let first = s.issue_at(0);
    s.live.remove("c");
    s.join_at("a", 100);
    s.join_at("b", 100);
    let second = s.issue_at(100);
    assert_eq!(ids(&second), ["a", "b"]);
    assert!(second.id > first.id);
}

#[test]
fn a_late_live_member_is_waited_for_up_to_the_join_timeout() {
    let mut s = Scene::new(&["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        s.join_at(id, 0);
    }
    s.issue_at(0);
    s.join_at("a", 100);
    s.join_at("b", 150);
    assert_eq!(
        s.decide_at(200),
        Decision::Wait {
            until: Some(s.t0 + Duration::from_millis(1100)),
            reason: WaitReason::LateMembers {
                missing: Missing::of(["c"].into_iter())
            },
        }
    );
    assert_eq!(ids(&s.issue_at(1100)), ["a", "b"]);
}

/// Three groups in a quorum issued at 0; a and b ask again 3 s later (their step
/// took 3 s), c does not yet.
fn c_late_after_a_3_s_step() -> Scene {
    let mut s = Scene::new(&["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        s.join_at(id, 0);
    }
    s.issue_at(0);
    s.join_at("a", 3000);
    s.join_at("b", 3000);
    s
}

#[test]
fn a_late_member_still_computing_holds_the_round_past_the_join_timeout() {
    let mut s = c_late_after_a_3_s_step();
    s.progressed_at("c", 3900);
    assert_eq!(
        s.decide_at(4100),
        Decision::Wait {
            // When c's progress would be a join timeout old: looked at again then.
            until: Some(s.t0 + Duration::from_millis(4900)),
            reason: WaitReason::MembersOnTheirWay {
                missing: Missing::of(["c"].into_iter())
            },
        }
    );
    s.progressed_at("c", 4800);
    assert!(matches!(s.decide_at(4900), Decision::Wait { .. }));
    s.join_at("c", 5000);
    assert_eq!(ids(&s.issue_at(5000)), ["a", "b", "c"], "nobody heals");
}

#[test]
fn a_late_member_that_stopped_progressing_is_left_out_after_the_join_timeout() {
    let mut s = c_late_after_a_3_s_step();
    s.progressed_at("c", 3200);
    assert_eq!(ids(&s.issue_at(4200)), ["a", "b"]);
    // One that reports no progress at all is not waited for past it either.
    let mut s = c_late_after_a_3_s_step();
    s.progressed.clear();
    assert_eq!(ids(&s.issue_at(4000)), ["a", "b"]);
}

#[test]
fn a_straggler_is_left_out_at_twice_the_quickest_members_step_time() {
    let mut s = c_late_after_a_3_s_step();
    s.progressed_at("c", 5500);
    assert_eq!(
        s.decide_at(5600),
        Decision::Wait {
            until: Some(s.t0 + Duration::from_millis(6000)),
            reason: WaitReason::MembersOnTheirWay {
                missing: Missing::of(["c"].into_iter())
            },
        }
    );
    s.progressed_at("c", 5999);
    assert_eq!(ids(&s.issue_at(6000)), ["a", "b"]);
}

/// `c_late_after_a_3_s_step`, where a and b failed the step (their votes said no).
fn a_and_b_failed_the_step_c_is_late() -> Scene {
    let mut s = c_late_after_a_3_s_step();
    for id in ["a", "b"] {
        let failed = Member {
            commit_failures: 1,
            ..member(id)
        };
        s.join_member(failed, 3000);
    }
    s
}

#[test]
fn after_a_failed_step_a_member_on_its_way_is_waited_for_past_the_straggler_bound() {
    // a and b failed the step of the quorum issued at 0; c, late, may have
    // committed it (its collective completed, theirs did not).
    let mut s = a_and_b_failed_the_step_c_is_late();
    s.progressed_at("c", 5999);
    assert!(
        matches!(
            s.decide_at(6100),
            Decision::Wait {
                reason: WaitReason::MembersOnTheirWay { .. },
                ..
            }
        ),
        "a and b would commit c's step again without it"
    );
    s.join_at("c", 6500);
    assert_eq!(ids(&s.issue_at(6500)), ["a", "b", "c"]);
}

#[test]
fn after_a_failed_step_a_hung_member_is_still_left_out() {
    let mut s = c_late_after_a_3_s_step();
    let failed = Member {
        commit_failures: 1,
        ..member("a")
    };
    s.join_member(failed, 3000);
    s.progressed_at("c", 3200);
    assert_eq!(ids(&s.issue_at(4200)), ["a", "b"]);
}

#[test]
fn after_a_failed_step_a_restarted_member_is_a_straggler_like_any_other() {
    // c died in the step a and b failed and came back as a new life (another manager
    // address): it holds no step, and starting up is no reason to wait for it.
    let mut s = a_and_b_failed_the_step_c_is_late();
    s.beats_from.insert("c".into(), "c-restarted:2".into());
    s.progressed_at("c", 5999);
    assert_eq!(ids(&s.issue_at(6000)), ["a", "b"]);
}

#[test]
fn groups_waiting_since_the_last_round_do_not_close_it_on_the_members_on_their_way() {
    // Two cohorts leapfrogging (issue 47): w1 and w2 asked too late for the last
    // quorum and wait since its issue at 0; of its members, a and b contributed and
    // rejoin after their 1 s step, h1 and h2 healed in it and come later.
    let mut s = Scene::new(&["a", "b", "h1", "h2"]);
    for id in ["a", "b", "h1", "h2"] {
        s.join_at(id, 0);
    }
    s.issue_at(0);
    s.join_at("w1", 0);
    s.join_at("w2", 0);
    s.join_at("a", 1000);
    s.join_at("b", 1000);
    s.progressed_at("h1", 1000);
    s.progressed_at("h2", 1000);
    // The round's first request is a second old, but its members' step set the bound.
    assert!(matches!(
        s.decide_at(1000),
        Decision::Wait {
            reason: WaitReason::MembersOnTheirWay { .. },
            ..
        }
    ));
    s.join_at("h1", 1500);
    s.join_at("h2", 1600);
    assert_eq!(
        ids(&s.issue_at(1600)),
        ["a", "b", "h1", "h2", "w1", "w2"],
        "one cohort again: only the waiters heal"
    );
}

#[test]
fn with_a_short_join_timeout_progress_reported_on_the_beats_still_counts() {
    // Beats carry progress some hundreds of milliseconds old: a 50 ms join timeout
    // must not take a group at work for a hung one.
    let mut s = c_late_after_a_3_s_step();
    s.config.join_timeout = Duration::from_millis(50);
    s.progressed_at("c", 3000);
    assert!(matches!(
        s.decide_at(3600),
        Decision::Wait {
            reason: WaitReason::MembersOnTheirWay { .. },
            ..
        }
    ));
    assert_eq!(
        ids(&s.issue_at(4000)),
        ["a", "b"],
        "a second after its progress"
    );
}

#[test]
fn a_dead_member_on_its_way_is_not_waited_for() {
    let mut s = c_late_after_a_3_s_step();
    s.progressed_at("c", 3900);
    s.live.remove("c");
    assert_eq!(ids(&s.issue_at(3000)), ["a", "b"]);
}

#[test]
fn a_newcomer_that_has_not_asked_does_not_stall_the_others() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    s.issue_at(0);
    s.live.insert("c".into()); // heartbeating, still starting up
    s.join_at("a", 100);
    s.join_at("b", 100);
    assert_eq!(ids(&s.issue_at(100)), ["a", "b"]);
}

#[test]
fn a_newcomer_that_asks_joins_on_the_fast_path() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    let first = s.issue_at(0);
    s.join_at("c", 50);
    s.join_at("a", 100);
    s.join_at("b", 100);
    let second = s.issue_at(100);
    assert_eq!(ids(&second), ["a", "b", "c"]);
    assert_eq!(second.id, first.id + 1);
}

#[test]
fn shrink_only_keeps_newcomers_out() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    s.issue_at(0);
    s.join_at("c", 50);
    s.join_member(
        Member {
            shrink_only: true,
            ..member("a")
        },
        100,
    );
    s.join_at("b", 100);
    assert_eq!(ids(&s.issue_at(100)), ["a", "b"]);
}

#[test]
fn a_minority_waits_for_live_late_members_for_a_bounded_time_only() {
    let mut s = Scene::new(&["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        s.join_at(id, 0);
    }
    s.issue_at(0);
    s.join_at("a", 100);
    // b and c live but do not ask: they still count toward the majority...
    let expiry = u64::from(LATE_MEMBER_JOIN_TIMEOUTS) * 1000;
    assert_eq!(
        s.decide_at(5000),
        Decision::Wait {
            until: Some(s.t0 + Duration::from_millis(expiry)),
            reason: WaitReason::NoMajority {
                joined: 1,
                relevant: 3
            },
        }
    );
    // ...until LATE_MEMBER_JOIN_TIMEOUTS join timeouts after the previous quorum,
    // however often a's own request times out and comes again: a group that never
    // asks again (wedged) cannot stop the job.
    // (Its last request still gives them the join timeout to come, as ever.)
    s.joiners.clear();
    s.join_at("a", expiry - 500);
    assert!(matches!(s.decide_at(expiry - 1), Decision::Wait { .. }));
    assert_eq!(ids(&s.issue_at(expiry + 500)), ["a"]);
}

#[test]
fn min_replicas_holds_the_quorum_until_enough_groups_join() {
    let mut s = Scene::new(&["a"]);
    s.config.min_replicas = 2;
    s.join_at("a", 0);
    assert_eq!(
        s.decide_at(5000),
        Decision::Wait {
            until: None,
            reason: WaitReason::TooFewReplicas {
                joined: 1,
                min_replicas: 2
            },
        }
    );
}

#[test]
fn commit_failures_force_a_new_id() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    let first = s.issue_at(0);
    s.join_member(
        Member {
            commit_failures: 1,
            ..member("a")
        },
        100,
    );
    s.join_at("b", 100);
    assert_eq!(s.issue_at(100).id, first.id + 1);
}

#[test]
fn a_restarted_lighthouse_numbers_above_the_ids_its_callers_report() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_at("a", 0);
    s.join_at("b", 0);
    s.joiners.get_mut("b").unwrap().last_quorum_id = 41;
    assert_eq!(s.issue_at(1000).id, 42);
}

#[test]
fn a_restarted_lighthouse_waits_the_join_timeout_before_its_first_quorum() {
    let mut s = Scene::new(&["a"]);
    s.join_at("a", 0);
    s.joiners.get_mut("a").unwrap().last_quorum_id = 7;
    assert_eq!(
        s.decide_at(10),
        Decision::Wait {
            until: Some(s.t0 + Duration::from_secs(1)),
            reason: WaitReason::RejoiningAfterRestart {
                missing: Missing::default()
            },
        }
    );
    s.join_at("b", 500);
    assert_eq!(ids(&s.issue_at(1000)), ["a", "b"]);
}
fn at(lineage: u64, step: i64, state_quorum_id: u64) -> Identity {
    Identity {
        lineage,
        step,
        state_quorum_id,
    }
}

fn holding(id: &str, state: Identity) -> Member {
    Member {
        lineage: state.lineage,
        step: state.step,
        state_quorum_id: state.state_quorum_id,
        ..member(id)
    }
}

#[test]
fn a_quorum_below_the_newest_state_waits_for_its_holders_then_starts_a_new_lineage() {
    let mut s = Scene::new(&["g1", "g2", "g3"]);
    s.previous = Some(Quorum {
        id: 8,
        members: vec![holding("g1", at(0, 296, 8)), holding("g3", at(0, 296, 8))],
        lineage: 0,
        rolled_back_from: None,
        left_out: Vec::new(),
    });
    s.previous_at = Some(s.t0);
    s.live.remove("g1");
    s.live.remove("g3");
    // g1 and g3 were restarted fresh; g2 comes back from a cut with step 186.
    s.join_member(holding("g2", at(0, 186, 5)), 0);
    let newest = at(0, 296, 8);
    let until = s.t0 + Duration::from_secs(30);
    s.newest = Some(Newest {
        state: newest,
        may_return_until: Some(until),
    });
    let wait = s.decide_at(100);
    assert_eq!(
        wait,
        Decision::Wait {
            until: Some(until),
            reason: WaitReason::NewestStateAway {
                newest,
                best: Some(at(0, 186, 5)),
            },
        }
    );
    assert!(
        wait_reason(&wait).contains("step 296 (committed in quorum 8, lineage 0)"),
        "{}",
        wait_reason(&wait)
    );
    // Nobody came back: the job goes on from the best state there is, as a new
    // lineage named by the quorum that starts it.
    let q = s.issue_at(30_000);
    assert_eq!(q.id, 9);
    assert_eq!(q.lineage, 9);
    assert_eq!(q.rolled_back_from, Some(newest));
    assert_eq!(q.members[0].identity(), at(9, 186, 5));
}

fn wait_reason(d: &Decision) -> String {
    match d {
        Decision::Wait { reason, .. } => reason.to_string(),
        Decision::Issue(q) => panic!("expected a wait, got {q:?}"),
    }
}

#[test]
fn a_quorum_holding_the_newest_state_goes_on_in_its_lineage() {
    let mut s = Scene::new(&["a", "b"]);
    s.newest = Some(Newest {
        state: at(4, 50, 7),
        may_return_until: Some(s.t0 + Duration::from_secs(30)),
    });
    s.join_member(holding("a", at(4, 50, 7)), 0);
    s.join_member(holding("b", at(4, 12, 4)), 0);
    let q = s.issue_at(0);
    assert_eq!((q.lineage, q.rolled_back_from), (4, None));
    assert_eq!(
        q.members[1].lineage, 4,
        "a behind member keeps its own, and heals"
    );
}

fn restored(id: &str, state: Identity) -> Member {
    Member {
        resumed: true,
        ..holding(id, state)
    }
}

#[test]
fn a_state_restored_from_a_snapshot_starts_a_new_lineage_even_as_the_newest_known() {
    // Every group was lost right after committing step 41, which no request had
    // reported yet: the lighthouse knows step 40, the state of the snapshot.
    let mut s = Scene::new(&["a", "b"]);
    s.newest = Some(Newest {
        state: at(0, 40, 3),
        may_return_until: None,
    });
    s.join_member(restored("a", at(0, 40, 3)), 0);
    s.join_member(holding("b", at(0, 0, 0)), 0);
    let q = s.issue_at(0);
    assert_eq!(q.lineage, q.id, "step 41 redone is a new lineage's");
    assert_eq!(q.rolled_back_from, Some(at(0, 40, 3)));
    assert_eq!(q.members[0].identity(), at(q.id, 40, 3));
    assert_eq!(q.members[1].lineage, 0, "the fresh group heals to it");
    // With no lighthouse memory at all (a restarted one), the same.
    let mut fresh = Scene::new(&["a"]);
    fresh.join_member(restored("a", at(0, 40, 3)), 0);
    let q = fresh.issue_at(10_000);
    assert_eq!((q.lineage, q.rolled_back_from), (q.id, Some(at(0, 40, 3))));
}

#[test]
fn a_live_group_as_new_as_a_restored_state_keeps_its_lineage() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_member(restored("a", at(0, 40, 3)), 0);
    s.join_member(holding("b", at(0, 40, 3)), 0);
    let q = s.issue_at(0);
    assert_eq!((q.lineage, q.rolled_back_from), (0, None));
}

#[test]
fn with_every_holder_gone_for_good_the_job_goes_back_at_once() {
    let mut s = Scene::new(&["a"]);
    s.newest = Some(Newest {
        state: at(0, 401, 1),
        may_return_until: None,
    });
    s.join_member(holding("a", at(0, 0, 0)), 0);
    let q = s.issue_at(0);
    assert_eq!(q.rolled_back_from, Some(at(0, 401, 1)));
    assert_eq!(q.lineage, q.id);
    assert!(
        q.id > 1,
        "a new lineage never reuses the id of the one it leaves"
    );
}

#[test]
fn a_state_of_an_older_lineage_is_older_than_any_of_a_newer_one() {
    assert!(at(0, 296, 8) < at(9, 0, 0));
    let mut s = Scene::new(&["old"]);
    s.newest = Some(Newest {
        state: at(9, 190, 12),
        may_return_until: Some(s.t0 + Duration::from_secs(30)),
    });
    // The holder of the old lineage's step 296 is back: it is behind the job.
    s.join_member(holding("old", at(0, 296, 8)), 0);
    assert!(matches!(
        s.decide_at(10),
        Decision::Wait {
            reason: WaitReason::NewestStateAway { .. },
            ..
        }
    ));
}
fn cut_off_from(id: &str, others: &[&str]) -> Member {
    Member {
        unreachable: others.iter().map(|o| o.to_string()).collect(),
        ..member(id)
    }
}

#[test]
fn of_two_groups_that_cannot_reach_each_other_one_is_left_out() {
    // A bridge cut: g1 and g2 cannot reach each other; both reach g3.
    let mut s = Scene::new(&["g1", "g2", "g3"]);
    s.join_member(cut_off_from("g1", &["g2"]), 0);
    s.join_member(cut_off_from("g2", &["g1"]), 0);
    s.join_member(cut_off_from("g3", &[]), 0);
    let q = s.issue_at(0);
    assert_eq!(ids(&q), ["g1", "g3"]);
    assert_eq!(q.left_out, [("g2".to_string(), "g1".to_string())]);
    // One side's word is enough, and a group left out no longer counts against
    // the others: g3 reached by nobody costs only g3.
    let mut s = Scene::new(&["a", "b", "c", "d"]);
    s.join_member(cut_off_from("a", &["d"]), 0);
    s.join_member(cut_off_from("b", &["d"]), 0);
    s.join_member(cut_off_from("c", &[]), 0);
    s.join_member(cut_off_from("d", &[]), 0);
    let q = s.issue_at(0);
    assert_eq!(ids(&q), ["a", "b", "c"]);
}

#[test]
fn the_group_left_out_is_the_one_with_the_older_state() {
    let mut s = Scene::new(&["g1", "g2", "g3"]);
    let newer = Member {
        step: 10,
        ..cut_off_from("g2", &["g1"])
    };
    s.join_member(
        Member {
            step: 4,
            ..cut_off_from("g1", &["g2"])
        },
        0,
    );
    s.join_member(newer, 0);
    s.join_member(
        Member {
            step: 10,
            ..member("g3")
        },
        0,
    );
    assert_eq!(ids(&s.issue_at(0)), ["g2", "g3"]);
}

#[test]
fn two_groups_cut_apart_do_not_make_a_majority_of_one() {
    let mut s = Scene::new(&["a", "b"]);
    s.join_member(cut_off_from("a", &["b"]), 0);
    s.join_member(cut_off_from("b", &["a"]), 0);
    assert!(matches!(
        s.decide_at(2000),
        Decision::Wait {
            reason: WaitReason::NoMajority {
                joined: 1,
                relevant: 2
            },
            ..
        }
    ));
}
