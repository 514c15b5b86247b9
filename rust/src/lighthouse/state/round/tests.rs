//! The quorum round's tests: joins, the engine's decisions and when a join skips it,
//! newest states and rollbacks, driven with `now` passed in (the scenarios are
//! `state/tests.rs`).

use tokio::sync::mpsc;

use super::*;
use crate::lighthouse::history::Eviction;
use crate::lighthouse::state::tests::*;

/// The engine's own answer at `now`, for comparison with what the state kept.
fn engine_waits(s: &LighthouseState, now: Instant) -> (WaitReason, Option<Instant>) {
    match s.decide(now) {
        Decision::Wait { reason, until } => (reason, until),
        Decision::Issue(q) => panic!("the engine would issue quorum {} now", q.id),
    }
}

#[test]
fn a_join_skips_the_engine_only_while_its_wait_for_a_late_member_stands() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut rng = Lcg(7);
    for round in 0..20 {
        let mut s = state();
        let n = 2 + rng.below(12) as usize;
        let ids: Vec<String> = (0..n).map(|i| format!("g{i:02}")).collect();
        let names: Vec<&str> = ids.iter().map(String::as_str).collect();
        form_quorum(&mut s, &names, t);
        // The deadline task sleeps until the heartbeat expiry.
        s.ticker_deadline = Some(ms(2000));
        let mut order = ids.clone();
        for i in (1..n).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut replies = Vec::new();
        for (k, id) in order.iter().enumerate() {
            let now = ms(100 + 10 * k as u64);
            let (tx, rx) = oneshot::channel();
            s.join(member(id), 1, now, tx).unwrap();
            replies.push(rx);
            let last = k + 1 == n;
            if s.wait_stands(now) {
                assert!(!last, "round {round}: nobody is late once all asked");
                // The engine would wait as well, for the same members, no sooner.
                let (reason, until) = engine_waits(&s, now);
                assert!(matches!(reason, WaitReason::LateMembers { .. }));
                assert!(until >= s.waiting_until(), "round {round}");
                assert_eq!(s.waiting_reason(now), reason, "round {round}");
                let WaitReason::LateMembers { missing } = reason else {
                    unreachable!()
                };
                assert_eq!(missing.count, n - k - 1, "round {round}");
            } else {
                assert!(
                    k == 0 || last,
                    "round {round}: join {k} of {n} ran the engine"
                );
                let issued = s.evaluate(now, 0);
                assert_eq!(issued.is_some(), last, "round {round}, join {k}");
            }
        }
        for mut reply in replies {
            assert_eq!(decoded(reply.try_recv().unwrap()).participants.len(), n);
        }
    }
}

#[test]
fn a_member_that_holds_the_last_quorum_gets_the_next_as_its_change() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let first = form_quorum(&mut s, &["a", "b", "c"], t);
    assert_ne!(first.issue, 0);
    // a holds the first quorum, b holds none, c holds one of another lighthouse.
    let mut replies = Vec::new();
    for (id, known) in [("a", first.issue), ("b", 0), ("c", first.issue ^ 1)] {
        let (tx, rx) = oneshot::channel();
        let step = quorum::Member {
            step: 1,
            ..member(id)
        };
        s.join_knowing(step, first.quorum_id, known, ms(10), tx)
            .unwrap();
        replies.push(rx);
    }
    s.evaluate(ms(10), 0).expect("the next round");
    let answers: Vec<Answer> = replies
        .into_iter()
        .map(|mut r| r.try_recv().unwrap().unwrap())
        .collect();
    let whole = match &answers[1] {
        Answer::Whole(bytes) => proto::Quorum::decode(bytes.clone()).unwrap(),
        Answer::Update(_) => panic!("b holds no quorum"),
    };
    assert!(matches!(answers[2], Answer::Whole(_)), "c holds another");
    let Answer::Update(update) = &answers[0] else {
        panic!("a holds the last quorum issued")
    };
    assert!(
        update.len() < 40,
        "a steady round's change is small: {}",
        update.len()
    );
    assert_eq!(answers[0].decode(Some(&first)).unwrap(), whole);
    assert_eq!(whole.quorum_id, first.quorum_id);
    assert_ne!(whole.issue, first.issue);
    assert!(whole.participants.iter().all(|m| m.step == 1));
}

#[test]
fn the_first_rounds_joins_and_every_open_skip_the_engine_while_its_decision_stands() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut rng = Lcg(11);
    for round in 0..20 {
        let mut s = state();
        let n = 2 + rng.below(12) as usize;
        let ids: Vec<String> = (0..n).map(|i| format!("g{i:02}")).collect();
        // The deadline task sleeps until the heartbeat expiry.
        s.ticker_deadline = Some(ms(2000));
        let mut streams = Vec::new();
        for id in &ids {
            streams.push(open(&mut s, id, t));
            assert!(s.decision_stands(t), "round {round}: nobody asks yet");
        }
        let mut replies = Vec::new();
        for (k, id) in ids.iter().enumerate() {
            let now = ms(100 + 10 * k as u64);
            let (tx, rx) = oneshot::channel();
            s.join(member(id), 0, now, tx).unwrap();
            replies.push(rx);
            let last = k + 1 == n;
            if s.wait_stands(now) {
                assert!(!last, "round {round}: nobody is missing once all asked");
                let (reason, until) = engine_waits(&s, now);
                assert_eq!(s.waiting_reason(now), reason, "round {round}");
                let WaitReason::GatheringFirstQuorum { missing } = reason else {
                    panic!("round {round}: the engine waits for {reason}");
                };
                assert_eq!(missing.count, n - k - 1, "round {round}");
                assert!(until >= s.waiting_until(), "round {round}");
                // A group that opens its stream now is one more to wait for.
                if replies.len() == k + 1 {
                    streams.push(open(&mut s, "late", now));
                    assert!(s.decision_stands(now), "round {round}");
                    let (tx, rx) = oneshot::channel();
                    s.join(member("late"), 0, now, tx).unwrap();
                    replies.push(rx);
                    assert!(s.wait_stands(now), "round {round}");
                }
            } else {
                assert!(
                    k == 0 || last,
                    "round {round}: join {k} of {n} ran the engine"
                );
                let issued = s.evaluate(now, 0);
                assert_eq!(issued.is_some(), last, "round {round}, join {k}");
            }
        }
        let everyone = replies.len();
        assert!(
            everyone == n + 1 || n == 2,
            "round {round}: late joined a standing wait"
        );
        for mut reply in replies {
            let quorum = decoded(reply.try_recv().unwrap());
            assert_eq!(quorum.participants.len(), everyone, "round {round}");
        }
        // A stream opened while a quorum stands and nobody asks changes nothing.
        assert!(s.decision_stands(ms(500)), "round {round}");
        // But past a heartbeat expiry the deadline task has not acted on, a join
        // runs the engine: a group may be dead that the count takes for live.
        let mut s = state();
        s.ticker_deadline = Some(ms(50));
        let _a = open(&mut s, "a", t);
        let _b = open(&mut s, "b", t);
        join_at_step(&mut s, "a", 0, ms(10));
        assert!(
            s.evaluate(ms(10), 0).is_none(),
            "round {round}: b has not asked"
        );
        join_at_step(&mut s, "b", 0, ms(60));
        assert!(!s.wait_stands(ms(60)), "round {round}");
    }
}

#[test]
fn a_join_runs_the_engine_when_a_deadline_is_due_or_a_member_left() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    form_quorum(&mut s, &["a", "b", "c"], t);
    s.ticker_deadline = Some(ms(2000));
    join_at_step(&mut s, "a", 0, ms(100));
    assert!(!s.wait_stands(ms(100)), "the engine has not looked yet");
    assert!(s.evaluate(ms(100), 0).is_none());
    // A heartbeat expiry is due and the deadline task has not acted on it yet.
    s.ticker_deadline = Some(ms(150));
    join_at_step(&mut s, "b", 0, ms(200));
    assert!(!s.wait_stands(ms(200)));
    s.ticker_deadline = Some(ms(2000));
    assert!(s.wait_stands(ms(200)));
    // Past the engine's deadline, the engine decides (to issue without c).
    assert!(!s.wait_stands(ms(1100)));
    // A late member that leaves its request ends what the skipped joins relied on.
    let (tx, _rx) = oneshot::channel();
    let ticket = s.join(member("c"), 1, ms(300), tx).unwrap();
    s.leave("c", ticket);
    assert!(!s.wait_stands(ms(300)), "c left: the engine must look");
    let (reason, _) = engine_waits(&s, ms(300));
    assert_eq!(
        s.evaluate(ms(300), 0).map(|q| q.quorum_id),
        None,
        "{reason}"
    );
    assert!(s.wait_stands(ms(300)), "c is late again");
}

#[test]
fn a_join_runs_the_stall_check_while_a_stalled_member_waits_for_a_waiting_peer() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _ea) = open(&mut s, "a", t);
    let ((_, b), _eb) = open(&mut s, "b", t);
    let ((_, c), _ec) = open(&mut s, "c", t);
    form_quorum(&mut s, &["a", "b", "c"], t);
    s.ticker_deadline = Some(ms(7000));
    trained(&a, ms(6000), 6000, 0);
    trained(&b, ms(6000), 0, 0);
    assert!(c.beat(ms(6000), 0, 0));
    assert_eq!(s.evict_stalled(ms(6000)), (vec![], true), "a is due");
    join_at_step(&mut s, "b", 0, ms(6000));
    assert!(s.evaluate(ms(6000), 0).is_none(), "a and c are late");
    join_at_step(&mut s, "c", 0, ms(6100));
    assert!(!s.wait_stands(ms(6100)), "b began to wait on a, who is due");
    assert_eq!(s.evict_stalled(ms(6100)), (vec![], false));
    assert!(s.wait_stands(ms(6100)), "a is late, and no longer overdue");
    assert_eq!(
        s.next_stall(ms(6100)),
        Some(ms(8500)),
        "the deadline task's time"
    );
    // a goes once b waited half of a's stall timeout.
    trained(&a, ms(8499), 8499, 0);
    assert_eq!(s.evict_stalled(ms(8499)), (vec![], false));
    assert_eq!(s.evict_stalled(ms(8500)).0, ["a".to_string()]);
}

#[test]
fn a_group_kept_out_of_a_quorum_still_asks_for_the_next_one() {
    let t = Instant::now();
    let mut s = state();
    let _streams = [open(&mut s, "a", t), open(&mut s, "c", t)];
    form_quorum(&mut s, &["a", "c"], t);
    // b, between the members in replica-id order, asks while a asks to shrink only.
    let _b = open(&mut s, "b", t);
    let (b_tx, mut b_reply) = oneshot::channel();
    s.join(member("b"), 1, t, b_tx).unwrap();
    let shrink_only = quorum::Member {
        shrink_only: true,
        ..member("a")
    };
    let (a_tx, _a_reply) = oneshot::channel();
    s.join(shrink_only, 1, t, a_tx).unwrap();
    let (c_tx, _c_reply) = oneshot::channel();
    s.join(member("c"), 1, t, c_tx).unwrap();
    s.evaluate(t, 0).expect("a quorum of a and c");
    let asking: Vec<&str> = s.joiners.keys().map(String::as_str).collect();
    assert_eq!(
        asking,
        ["b"],
        "the members' requests were answered, b's stands"
    );
    assert!(b_reply.try_recv().is_err(), "b is not answered yet");
}

#[test]
fn a_quorum_request_under_a_live_groups_id_from_another_manager_is_refused_unrecorded() {
    let t = Instant::now();
    let mut s = state();
    let (tx, _rx) = mpsc::channel(4);
    let first = proto::Beat {
        manager_address: "10.0.0.1:7000".into(),
        ..beat("dup")
    };
    let (_, pulse) = s
        .open_stream(&first, "10.0.0.1:5000".into(), tx, t)
        .unwrap();
    let impostor = quorum::Member {
        manager_address: "10.0.0.2:7000".into(),
        ..member("dup")
    };
    let later = t + Duration::from_millis(1500);
    let (reply, _answer) = oneshot::channel();
    let err = s.join(impostor, 0, later, reply).unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    assert!(err.message().contains("10.0.0.1:7000"), "{}", err.message());
    assert!(err.message().contains("--replica-id"), "{}", err.message());
    // Not a sign of life of the real group, nor a request to join.
    assert_eq!(pulse.last_beat(), t);
    assert!(s.joiners.is_empty());
    // The real group's own request goes through.
    let real = quorum::Member {
        manager_address: "10.0.0.1:7000".into(),
        ..member("dup")
    };
    let (reply, _answer) = oneshot::channel();
    assert!(s.join(real, 0, later, reply).is_ok());
}

#[test]
fn a_restarted_lighthouse_continues_above_the_ids_it_hears() {
    let t = Instant::now();
    let mut s = state();
    let mut b = beat("a");
    b.last_quorum_id = 17;
    let (tx, _rx) = mpsc::channel(1);
    s.open_stream(&b, "p".into(), tx, t).unwrap();
    let (reply, mut answer) = oneshot::channel();
    s.join(member("a"), 0, t, reply).unwrap();
    // Having heard of quorum 17, it gives re-connecting groups the join timeout.
    assert!(s.evaluate(t, 0).is_none());
    assert!(s.evaluate(t + Duration::from_secs(1), 0).is_some());
    assert_eq!(decoded(answer.try_recv().unwrap()).quorum_id, 18);
}

#[test]
fn a_request_that_leaves_no_longer_joins() {
    let t = Instant::now();
    let mut s = state();
    let _a = open(&mut s, "a", t);
    let _b = open(&mut s, "b", t);
    let (tx, _rx) = oneshot::channel();
    let ticket = s.join(member("a"), 0, t, tx).unwrap();
    s.leave("a", ticket);
    assert!(s.snapshot(t).replicas.iter().all(|r| !r.joined));
    assert!(s.evaluate(t, 0).is_none());
    assert_eq!(s.waiting_reason(t), WaitReason::NoJoiners);
}

fn ask(
    s: &mut LighthouseState,
    id: &str,
    held: Identity,
    now: Instant,
) -> oneshot::Receiver<QuorumReply> {
    let (tx, rx) = oneshot::channel();
    let m = quorum::Member {
        lineage: held.lineage,
        step: held.step,
        state_quorum_id: held.state_quorum_id,
        ..member(id)
    };
    s.join(m, 0, now, tx).unwrap();
    rx
}

fn at(lineage: u64, step: i64, state_quorum_id: u64) -> Identity {
    Identity {
        lineage,
        step,
        state_quorum_id,
    }
}

#[test]
fn a_stale_group_back_from_a_cut_waits_for_the_holders_that_went_silent() {
    let t = Instant::now();
    let secs = |n: u64| t + Duration::from_secs(n);
    let mut s = state();
    let (_g1, _e1) = open(&mut s, "g1", t);
    let (_g3, _e3) = open(&mut s, "g3", t);
    let q = form_quorum(&mut s, &["g1", "g3"], t);
    // g1 and g3 committed up to step 296 in quorum q, then went silent (their
    // host was cut off); g2 is back with the step it had, 186.
    drop((
        ask(&mut s, "g1", at(0, 296, q.quorum_id), t),
        ask(&mut s, "g3", at(0, 296, q.quorum_id), t),
    ));
    s.evaluate(t, 0);
    assert_eq!(s.expire(secs(3)).len(), 2);
    let mut g2 = ask(&mut s, "g2", at(0, 186, 1), secs(3));
    s.evaluate(secs(3), 0);
    assert!(g2.try_recv().is_err(), "no quorum below the newest state");
    assert!(
        s.waiting_reason(secs(3)).to_string().contains("step 296"),
        "{}",
        s.waiting_reason(secs(3))
    );
    // The wait lasts --rollback-after from when a holder was last seen; then the
    // job goes on from g2's state as a new lineage, announced.
    assert_eq!(s.waiting_until(), Some(t + ROLLBACK_AFTER));
    let mut g2 = ask(&mut s, "g2", at(0, 186, 1), secs(31));
    s.evaluate(secs(31), 0).expect("a quorum");
    let issued = decoded(g2.try_recv().unwrap());
    assert_eq!(issued.lineage, issued.quorum_id);
    assert_eq!(issued.participants[0].lineage, issued.quorum_id);
    let rollback = s.rollbacks().next().unwrap();
    assert_eq!(
        (rollback.from, rollback.steps_lost),
        (at(0, 296, q.quorum_id), 110)
    );
    assert_eq!(s.snapshot(secs(31)).rollbacks.len(), 1);
    assert_eq!(s.newest_state(), Some(at(issued.quorum_id, 186, 1)));
}

#[test]
fn holders_that_crashed_or_were_evicted_as_stalled_are_not_waited_for() {
    let t = Instant::now();
    let mut s = state();
    let ((a_stream, _), _a) = open(&mut s, "a", t);
    let q = form_quorum(&mut s, &["a"], t);
    drop(ask(&mut s, "a", at(0, 401, q.quorum_id), t));
    s.evaluate(t, 0);
    assert_eq!(
        s.close_stream("a", a_stream, Eviction::StreamBroken, t),
        Some(Eviction::StreamBroken)
    );
    // Restarted empty, at once: nothing to wait for, the job goes back loudly.
    let mut a = ask(&mut s, "a", at(0, 0, 0), t);
    s.evaluate(t, 0).expect("a quorum at once");
    let issued = decoded(a.try_recv().unwrap());
    assert_eq!(issued.rolled_back_from.map(|r| r.step), Some(401));
}

#[test]
fn a_quorum_at_the_newest_state_goes_on_while_a_stale_group_heals() {
    let t = Instant::now();
    let mut s = state();
    let q = form_quorum(&mut s, &["g1", "g3"], t);
    let (a, b, c) = (
        ask(&mut s, "g1", at(0, 296, q.quorum_id), t),
        ask(&mut s, "g2", at(0, 186, 1), t),
        ask(&mut s, "g3", at(0, 296, q.quorum_id), t),
    );
    s.evaluate(t, 0).expect("a quorum at once");
    for mut reply in [a, b, c] {
        let issued = decoded(reply.try_recv().unwrap());
        assert_eq!((issued.lineage, issued.rolled_back_from), (0, None));
        assert_eq!(issued.participants.len(), 3);
    }
    assert!(s.rollbacks().next().is_none());
}

#[test]
fn a_group_cut_off_from_a_member_is_left_out_and_told_why_at_once() {
    let t = Instant::now();
    let mut s = state();
    let mut replies = Vec::new();
    for (id, unreachable) in [("g1", vec!["g2"]), ("g2", vec!["g1"]), ("g3", vec![])] {
        let (tx, rx) = oneshot::channel();
        let m = quorum::Member {
            unreachable: unreachable.into_iter().map(String::from).collect(),
            ..member(id)
        };
        s.join(m, 0, t, tx).unwrap();
        replies.push(rx);
    }
    s.evaluate(t, 0)
        .expect("a quorum of the two that reach each other");
    let mut g2 = replies.remove(1);
    let refused = g2.try_recv().unwrap().unwrap_err();
    assert_eq!(refused.code(), tonic::Code::DeadlineExceeded);
    assert!(
        refused.message().contains("\"g1\" could not reach"),
        "{refused:?}"
    );
    for mut reply in replies {
        assert_eq!(decoded(reply.try_recv().unwrap()).participants.len(), 2);
    }
    assert!(
        s.joiners.is_empty(),
        "g2 asks again, with what it can reach by then"
    );
}

#[test]
fn a_late_member_whose_beats_report_progress_holds_the_round_until_it_stops() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    let ((_, b), _b_events) = open(&mut s, "b", t);
    let ((_, c), _c_events) = open(&mut s, "c", t);
    form_quorum(&mut s, &["a", "b", "c"], t);
    // a's and b's step took 3 s; c computes on until 4.5 s, then hangs.
    let mut replies = Vec::new();
    for id in ["a", "b"] {
        let (tx, reply) = oneshot::channel();
        s.join(member(id), 1, ms(3000), tx).unwrap();
        replies.push(reply);
    }
    for n in (3000..=5600).step_by(100) {
        trained(&a, ms(n), 0, n - 3000);
        trained(&b, ms(n), 0, n - 3000);
        trained(&c, ms(n), n.saturating_sub(4500), 0);
        let now = ms(n);
        let issued = s.evaluate(now, 0);
        if n < 5500 {
            assert!(issued.is_none(), "at {n} ms, c is on its way");
            if n >= 4000 {
                let why = s.waiting_reason(now);
                assert!(
                    matches!(why, WaitReason::MembersOnTheirWay { .. }),
                    "at {n} ms: {why}"
                );
            }
        } else {
            // A join timeout after c's last progress, the round goes on without it.
            assert!(issued.expect("a quorum without c").changed);
            let quorum = s.current_quorum().unwrap();
            assert_eq!(quorum.replica_ids().collect::<Vec<_>>(), ["a", "b"]);
            return;
        }
    }
    unreachable!();
}
