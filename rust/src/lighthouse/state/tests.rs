//! The lighthouse state's tests: its rules driven with `now` passed in.

use super::*;
use crate::lighthouse::history::Losses;

fn state() -> LighthouseState {
    LighthouseState::new(
        QuorumConfig {
            min_replicas: 1,
            join_timeout: Duration::from_secs(1),
        },
        Duration::from_secs(2),
        ROLLBACK_AFTER,
    )
}

const ROLLBACK_AFTER: Duration = Duration::from_secs(30);

fn member(id: &str) -> quorum::Member {
    quorum::Member {
        replica_id: id.into(),
        world_size: 1,
        ..Default::default()
    }
}

fn beat(id: &str) -> proto::Beat {
    proto::Beat {
        protocol_version: proto::PROTOCOL_VERSION,
        replica_id: id.into(),
        ..Default::default()
    }
}

type Events = mpsc::Receiver<Result<proto::LighthouseEvent, Status>>;

fn open(s: &mut LighthouseState, id: &str, now: Instant) -> ((u64, Arc<Pulse>), Events) {
    let (tx, rx) = mpsc::channel(4);
    let stream = s.open_stream(&beat(id), "test".into(), tx, now).unwrap();
    (stream, rx)
}

fn decoded(reply: QuorumReply) -> proto::Quorum {
    match reply.unwrap() {
        Answer::Whole(bytes) => proto::Quorum::decode(bytes).unwrap(),
        Answer::Update(_) => panic!("an update for a group that holds no quorum"),
    }
}

fn form_quorum(s: &mut LighthouseState, ids: &[&str], now: Instant) -> proto::Quorum {
    let mut replies = Vec::new();
    for id in ids {
        let (tx, rx) = oneshot::channel();
        s.join(member(id), 0, now, tx).unwrap();
        replies.push(rx);
    }
    s.evaluate(now, 0).expect("quorum");
    let mut got = replies
        .into_iter()
        .map(|mut r| decoded(r.try_recv().unwrap()));
    got.next().unwrap()
}

/// A beat of a group that reports its training: no progress for `age_ms`,
/// waiting on the others for `waiting_ms` (0: not), with a 5 s stall timeout.
fn trained(pulse: &Pulse, now: Instant, age_ms: u64, waiting_ms: u64) {
    let beat = proto::Beat {
        progress_age_ms: age_ms,
        waiting_ms,
        stall_timeout_ms: 5000,
        step_time_ms: 200,
        ..beat("any")
    };
    assert!(pulse.beat(now, pulse.step(), 0));
    pulse.trained(now, &beat);
}

fn lost(events: &mut Events) -> proto::MembershipLost {
    match events.try_recv().unwrap().unwrap().event {
        Some(proto::lighthouse_event::Event::MembershipLost(lost)) => lost,
        other => panic!("expected a membership loss, got {other:?}"),
    }
}

#[test]
fn a_member_stalled_while_a_peer_waits_on_it_is_evicted_and_told() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), mut a_events) = open(&mut s, "a", t);
    let ((_, b), mut b_events) = open(&mut s, "b", t);
    form_quorum(&mut s, &["a", "b"], t);
    // b's training thread stops at 1 s; a trains on, then waits on b from 1.5 s.
    for n in (0..=6000).step_by(100) {
        trained(&a, ms(n), 0, n.saturating_sub(1500));
        trained(&b, ms(n), n.saturating_sub(1000), 0);
        let now = ms(n);
        if n < 6000 {
            assert_eq!(s.evict_stalled(now), (vec![], false), "at {n} ms");
            if n == 4500 {
                assert_eq!(s.next_wakeup(now), Some(ms(6000)), "wakes when b is due");
            }
        }
    }
    assert_eq!(s.evict_stalled(ms(6000)), (vec!["b".to_string()], false));
    let told = lost(&mut a_events);
    assert_eq!(
        (told.lost.as_slice(), told.cause.as_str()),
        (&["b".to_string()][..], "progress_stalled")
    );
    let own = lost(&mut b_events);
    assert_eq!(
        own.lost,
        vec!["b".to_string()],
        "the stalled group is told too"
    );
    assert!(b.is_retired());
    let snap = s.snapshot(ms(6000));
    assert_eq!(snap.lost[0].cause, Eviction::ProgressStalled);
    assert_eq!(snap.lost[0].history.losses.progress_stalled, 1);
}

#[test]
fn a_stalled_member_nobody_waits_on_stays_until_a_peer_waits() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    let ((_, b), _b_events) = open(&mut s, "b", t);
    form_quorum(&mut s, &["a", "b"], t);
    // Both quiet for 8 s (a long step with no marks in it): neither is evicted.
    trained(&a, ms(8000), 8000, 0);
    trained(&b, ms(8000), 8000, 0);
    assert_eq!(
        s.evict_stalled(ms(8000)),
        (vec![], true),
        "overdue, not evicted"
    );
    // a moves on and waits: a wait that short is no sign that b hangs (b may be
    // done with its steps, a's vote waiting for its lease)...
    trained(&a, ms(8100), 0, 100);
    trained(&b, ms(8100), 8100, 0);
    assert_eq!(s.evict_stalled(ms(8100)), (vec![], false));
    // (The deadline task wakes at the heartbeat expiry before that, and then at it.)
    // ...but half the stall timeout of it is: b, still stalled, goes.
    trained(&a, ms(10500), 0, 2500);
    trained(&b, ms(10500), 10500, 0);
    assert_eq!(s.evict_stalled(ms(10500)).0, vec!["b".to_string()]);
}

#[test]
fn a_group_that_waits_or_asks_for_a_quorum_or_reports_nothing_is_not_stalled() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    let ((_, b), _b_events) = open(&mut s, "b", t);
    let ((_, c), _c_events) = open(&mut s, "c", t);
    form_quorum(&mut s, &["a", "b", "c"], t);
    // a waits (in its deadline: age 0); c reports nothing (an older client).
    trained(&a, ms(9000), 0, 9000);
    trained(&b, ms(9000), 0, 9000);
    assert!(c.beat(ms(9000), 0, 0));
    assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
    // b stalls but asks for the next quorum: all its ranks got that far.
    trained(&b, ms(20000), 10000, 0);
    trained(&a, ms(20000), 0, 20000);
    assert!(c.beat(ms(20000), 0, 0));
    let (tx, _rx) = oneshot::channel();
    s.join(member("b"), 1, ms(20000), tx).unwrap();
    assert_eq!(s.evict_stalled(ms(20000)), (vec![], false));
}

/// Forms a quorum of a, b and c at `t`, then, from `t` + 1 s, a quorum of the two in
/// `stay`: the other one dropped out. b and c beat at 1.5 s, reporting `step`.
fn drop_out(s: &mut LighthouseState, t: Instant, stay: [&str; 2], pulses: [&Pulse; 3], step: i64) {
    let ms = |n: u64| t + Duration::from_millis(n);
    form_quorum(s, &["a", "b", "c"], t);
    let mut replies = Vec::new();
    for id in stay {
        let (tx, rx) = oneshot::channel();
        s.join(member(id), 1, ms(1000), tx).unwrap();
        replies.push(rx);
    }
    for pulse in pulses.iter().skip(1) {
        assert!(pulse.beat(ms(1500), step, 1));
    }
    let issued = s.evaluate(ms(2500), 0);
    assert!(issued.is_some(), "{}", s.waiting_reason(ms(2500)));
}

#[test]
fn a_group_that_trained_and_dropped_out_of_the_quorum_stalled_is_evicted_and_told() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    let ((_, b), mut b_events) = open(&mut s, "b", t);
    let ((_, c), _c_events) = open(&mut s, "c", t);
    // b hung after its vote: the next quorum went on without it.
    drop_out(&mut s, t, ["a", "c"], [&a, &b, &c], 5);
    assert!(c.beat(ms(3000), 5, 1));
    trained(&c, ms(3000), 0, 0);
    assert!(b.beat(ms(3000), 5, 1));
    trained(&b, ms(3000), 3000, 0);
    trained(&a, ms(3000), 0, 0);
    assert_eq!(
        s.evict_stalled(ms(4000)),
        (vec![], false),
        "not stalled 5 s yet"
    );
    assert_eq!(
        s.next_wakeup(ms(4000)),
        Some(ms(5000)).min(s.next_wakeup(ms(4000)))
    );
    assert!(b.beat(ms(5000), 5, 1));
    trained(&b, ms(5000), 5000, 0);
    assert_eq!(s.evict_stalled(ms(5000)).0, vec!["b".to_string()]);
    let own = lost(&mut b_events);
    assert_eq!(
        (own.lost, own.cause.as_str()),
        (vec!["b".to_string()], "progress_stalled")
    );
}

#[test]
fn a_healing_group_that_hung_at_step_0_and_dropped_out_of_the_quorum_is_evicted() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    let ((_, b), _b_events) = open(&mut s, "b", t);
    let ((_, c), mut c_events) = open(&mut s, "c", t);
    // c joined a quorum at step 0 to heal, and hung loading what it fetched: the next
    // quorum went on without it, and it still reports step 0.
    drop_out(&mut s, t, ["a", "b"], [&a, &b, &c], 0);
    assert!(c.beat(ms(3000), 0, 1));
    trained(&c, ms(3000), 3000, 0);
    trained(&b, ms(4000), 0, 0);
    trained(&a, ms(4000), 0, 0);
    assert_eq!(s.evict_stalled(ms(4000)), (vec![], false), "not 5 s yet");
    assert!(c.beat(ms(5000), 0, 1));
    trained(&c, ms(5000), 5000, 0);
    assert_eq!(s.evict_stalled(ms(5000)).0, vec!["c".to_string()]);
    let own = lost(&mut c_events);
    assert_eq!(
        (own.lost, own.cause.as_str()),
        (vec!["c".to_string()], "progress_stalled")
    );
}

#[test]
fn a_group_back_from_a_pause_or_not_trained_yet_is_not_taken_for_dropped() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    // Never trained (step 0): starting up, however still.
    let ((_, a), _a_events) = open(&mut s, "a", t);
    trained(&a, ms(9000), 9000, 0);
    assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
    // Trained, and its stream just re-opened (resumed from SIGSTOP): its old
    // progress age is not held against it until a stall timeout after.
    let ((_, b), _b_events) = open(&mut s, "b", ms(9000));
    assert!(b.beat(ms(9000), 7, 1));
    trained(&b, ms(9000), 9000, 0);
    assert_eq!(s.evict_stalled(ms(9000)), (vec![], false));
    assert!(b.beat(ms(9100), 7, 1));
    trained(&b, ms(9100), 0, 0);
    assert_eq!(s.evict_stalled(ms(14000)), (vec![], false), "it moved");
}

#[test]
fn the_groups_outside_the_quorum_are_looked_at_again_when_one_is_due_or_the_look_is_stale() {
    let t = Instant::now();
    let ms = |n: u64| t + Duration::from_millis(n);
    let mut s = state();
    let ((_, a), _a_events) = open(&mut s, "a", t);
    form_quorum(&mut s, &["a"], t);
    // b, outside the quorum, trained and stalled since 1 s: due at 6 s.
    let ((_, b), _b_events) = open(&mut s, "b", t);
    assert!(b.beat(ms(1000), 5, 1));
    trained(&b, ms(1000), 0, 0);
    trained(&a, ms(5900), 0, 0);
    assert_eq!(s.evict_stalled(ms(5900)), (vec![], false));
    assert_eq!(
        s.next_stall(ms(5900)),
        Some(ms(6000)),
        "the look found b due"
    );
    assert_eq!(s.evict_stalled(ms(6000)).0, ["b".to_string()]);

    // c reports its first step (it becomes one of them) after a look: found at the
    // first judgement once the look is RELOOK old, not before.
    let ((_, c), _c_events) = open(&mut s, "c", t);
    trained(&c, ms(4000), 0, 0);
    assert_eq!(s.evict_stalled(ms(9000)), (vec![], false), "c at step 0");
    assert!(c.beat(ms(9050), 5, 1));
    assert_eq!(
        s.evict_stalled(ms(9100)),
        (vec![], false),
        "the look stands"
    );
    assert_eq!(
        s.evict_stalled(ms(9000) + stall::RELOOK).0,
        ["c".to_string()]
    );
}

/// A small deterministic generator: the scenarios below vary without a seed to chase.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

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

/// A stream opened for each of `ids` at `now`: their pulses and event queues, in
/// `ids`' order (keep the queues: one dropped reads as a broken stream).
fn open_each(s: &mut LighthouseState, ids: &[String], now: Instant) -> Vec<(Arc<Pulse>, Events)> {
    ids.iter()
        .map(|id| {
            let ((_, pulse), events) = open(s, id, now);
            (pulse, events)
        })
        .collect()
}

/// `open_each`, then the quorum of them formed.
fn quorum_of(s: &mut LighthouseState, ids: &[String], now: Instant) -> Vec<(Arc<Pulse>, Events)> {
    let streams = open_each(s, ids, now);
    let names: Vec<&str> = ids.iter().map(String::as_str).collect();
    form_quorum(s, &names, now);
    streams
}

/// Member `k`'s stall times as the lighthouse computed them before `EarliestWaits`:
/// every peer's wait looked up again for each member.
fn stall_due_by_every_peer(s: &LighthouseState, k: usize) -> (Option<Instant>, Option<Instant>) {
    let quorum = s.previous.as_ref().unwrap();
    let id = &quorum.members[k].replica_id;
    let watch = s.watch();
    if s.joiners.contains_key(id) {
        return (None, None);
    }
    let Some(training) = watch.watched(id).training else {
        return (None, None);
    };
    let evict_at = quorum
        .replica_ids()
        .filter(|peer| *peer != id.as_str())
        .filter_map(|peer| watch.watched(peer).waiting_since())
        .min()
        .map(|since| (since + training.stall_timeout / 2).max(training.due()));
    (Some(training.due()), evict_at)
}

#[test]
fn a_stall_is_judged_by_the_earliest_wait_of_the_other_members() {
    let t = Instant::now();
    let mut rng = Lcg(11);
    for round in 0..50 {
        let mut s = state();
        let n = 1 + rng.below(6) as usize;
        let ids: Vec<String> = (0..n).map(|i| format!("g{i}")).collect();
        let streams = quorum_of(&mut s, &ids, t);
        let now = t + Duration::from_millis(10_000);
        for ((pulse, _), id) in streams.iter().zip(&ids) {
            match rng.below(4) {
                0 => {} // reports no training
                1 => join_at_step(&mut s, id, 0, now - Duration::from_millis(rng.below(3000))),
                // Waits since the same instant as another, sometimes.
                _ => trained(pulse, now, rng.below(9000), 1000 * rng.below(4)),
            }
        }
        let quorum = s.previous.clone().unwrap();
        let watch = s.watch();
        let waits = stall::EarliestWaits::of(&watch.members().collect::<Vec<_>>());
        for (k, id) in quorum.replica_ids().enumerate() {
            assert_eq!(
                stall::member_due(k, &watch.watched(id), &waits),
                stall_due_by_every_peer(&s, k),
                "round {round}, member {id}"
            );
        }
    }
}

#[test]
fn the_walks_over_the_members_and_the_dropped_find_what_a_lookup_per_group_finds() {
    let t = Instant::now();
    let mut rng = Lcg(29);
    for round in 0..50 {
        let mut s = state();
        // Ids whose order as text is not their number's ("g10" < "g2").
        let n = 1 + rng.below(14) as usize;
        let ids: Vec<String> = (0..n).map(|i| format!("g{}", 3 * i)).collect();
        let inside = 1 + rng.below(n as u64) as usize;
        let mut streams = quorum_of(&mut s, &ids[..inside], t);
        streams.extend(open_each(&mut s, &ids[inside..], t));
        let now = t + Duration::from_millis(10_000);
        for ((pulse, _), id) in streams.iter().zip(&ids) {
            if rng.below(2) == 0 {
                assert!(pulse.beat(now, rng.below(3) as i64, 1));
                trained(pulse, now, rng.below(9000), 1000 * rng.below(2));
            }
            if rng.below(3) == 0 {
                join_at_step(&mut s, id, 1, now - Duration::from_millis(rng.below(3000)));
            }
        }
        // A group that asks without a stream of its own.
        join_at_step(&mut s, "g0-alone", 1, now);
        let watch = s.watch();
        let quorum = s.previous.as_ref().unwrap();
        let looked_up: Vec<_> = quorum
            .replica_ids()
            .map(|id| (id, watch.watched(id)))
            .collect();
        assert_eq!(
            watch.members().collect::<Vec<_>>(),
            looked_up,
            "round {round}"
        );
        let mut dropped: Vec<_> = watch.dropped().collect();
        let mut each: Vec<_> = s
            .replicas
            .keys()
            .filter_map(|id| stall::dropped_due(&watch, id).map(|at| (id.as_str(), at)))
            .collect();
        dropped.sort();
        each.sort();
        assert_eq!(dropped, each, "round {round}");
    }
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
fn a_broken_stream_evicts_at_once_and_tells_the_other_members() {
    let t = Instant::now();
    let mut s = state();
    let ((a_stream, _), mut a_events) = open(&mut s, "a", t);
    let ((b_stream, b_pulse), _b_events) = open(&mut s, "b", t);
    form_quorum(&mut s, &["a", "b"], t);
    assert_eq!(
        s.close_stream("b", b_stream, Eviction::StreamBroken, t),
        Some(Eviction::StreamBroken)
    );
    assert!(b_pulse.is_retired(), "its stream task must end");
    let event = a_events.try_recv().unwrap().unwrap();
    let Some(proto::lighthouse_event::Event::MembershipLost(lost)) = event.event else {
        panic!("expected a membership loss");
    };
    assert_eq!(lost.lost, ["b"]);
    assert_eq!(lost.cause, "stream_broken");
    assert_eq!(s.live_replicas(), 1);
    // A stale stream id (an old connection closing late) changes nothing.
    assert_eq!(
        s.close_stream("a", a_stream + 100, Eviction::StreamBroken, t),
        None
    );
}

#[test]
fn a_silent_group_expires_after_the_heartbeat_timeout_and_is_forgotten() {
    let t = Instant::now();
    let mut s = state();
    let ((_, a), _ea) = open(&mut s, "a", t);
    let (_b, _eb) = open(&mut s, "b", t);
    assert!(s.expire(t + Duration::from_millis(1900)).is_empty());
    a.beat(t + Duration::from_millis(1900), 1, 0);
    let expired = s.expire(t + Duration::from_millis(2000));
    assert_eq!(expired, [("b".to_string(), Eviction::HeartbeatTimeout)]);
    assert_eq!(s.live_replicas(), 1);
    assert_eq!(s.next_wakeup(t), Some(t + Duration::from_millis(3900)));
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
fn a_second_live_stream_for_the_same_replica_is_refused_with_the_conflict_named() {
    let t = Instant::now();
    let mut s = state();
    let _a = open(&mut s, "a", t);
    let (tx, _rx) = mpsc::channel(1);
    let err = s
        .open_stream(&beat("a"), "other".into(), tx, t)
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    assert!(
        err.message().contains("heartbeating from test"),
        "{}",
        err.message()
    );
    // Once the first one is silent past the timeout, a restarted group may take over.
    let (tx, _rx) = mpsc::channel(1);
    assert!(s
        .open_stream(&beat("a"), "new".into(), tx, t + Duration::from_secs(3))
        .is_ok());
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

fn join_at_step(s: &mut LighthouseState, id: &str, step: i64, now: Instant) {
    let (tx, _rx) = oneshot::channel();
    s.join(quorum::Member { step, ..member(id) }, 0, now, tx)
        .unwrap();
}

#[test]
fn a_groups_commits_are_counted_across_its_restart_and_date_its_last_commit() {
    let t = Instant::now();
    let ms = Duration::from_millis;
    let mut s = state();
    let ((a_stream, _), _ea) = open(&mut s, "a", t);
    let _b = open(&mut s, "b", t);
    let totals = |committed, heals| proto::GroupTally {
        steps_committed: committed,
        heals,
        ..Default::default()
    };
    s.report("a", Some(totals(3, 0)), None, t + ms(100));
    s.report("a", Some(totals(3, 0)), None, t + ms(900));
    let snap = s.snapshot(t + ms(1000));
    let age = |id: &str| {
        let r = snap.replicas.iter().find(|r| r.replica_id == id).unwrap();
        (r.last_commit_age_ms, r.history.tally.steps_committed)
    };
    assert_eq!(
        age("a"),
        (900, 3),
        "a beat with no new commit dates nothing"
    );
    assert_eq!(age("b"), (1000, 0), "counted from when it appeared");
    assert_eq!(snap.last_commit_age_ms, 900);

    // Restarted: its manager server counts from zero; the lighthouse goes on.
    s.close_stream("a", a_stream, Eviction::StreamBroken, t + ms(1100));
    let _a = open(&mut s, "a", t + ms(1500));
    s.report("a", Some(totals(0, 0)), None, t + ms(1500));
    s.report("a", Some(totals(2, 1)), None, t + ms(1600));
    let snap = s.snapshot(t + ms(1600));
    let a = snap.replicas.iter().find(|r| r.replica_id == "a").unwrap();
    assert_eq!(
        (a.history.tally.steps_committed, a.history.tally.heals),
        (5, 1)
    );
    assert_eq!(a.last_commit_age_ms, 0);
}

#[test]
fn a_lost_group_is_shown_with_why_and_its_return_is_counted() {
    let t = Instant::now();
    let mut s = state();
    let _a = open(&mut s, "a", t);
    let ((b_stream, _), _eb) = open(&mut s, "b", t);
    form_quorum(&mut s, &["a", "b"], t);
    let killed = t + Duration::from_secs(1);
    s.close_stream("b", b_stream, Eviction::StreamBroken, killed);

    let snap = s.snapshot(killed + Duration::from_millis(250));
    assert_eq!(snap.replicas.len(), 1);
    let [lost] = &snap.lost[..] else {
        panic!("one lost group expected: {:?}", snap.lost);
    };
    assert_eq!(lost.replica_id, "b");
    assert_eq!(lost.cause, Eviction::StreamBroken);
    assert_eq!(lost.lost_ms_ago, 250);
    assert!(lost.was_member);
    assert_eq!(lost.peer, "test");
    assert_eq!(lost.history.losses.stream_broken, 1);

    // Restarted: live again, no longer lost, its loss and return counted.
    let back = killed + Duration::from_secs(5);
    let (_b, _eb) = open(&mut s, "b", back);
    let snap = s.snapshot(back);
    assert!(snap.lost.is_empty());
    let b = &snap.replicas[1];
    assert_eq!((b.history.losses.stream_broken, b.history.returns), (1, 1));

    // Hung this time: the second loss has its own cause, the history goes on.
    let expired = s.expire(back + Duration::from_secs(2));
    assert_eq!(expired.len(), 2);
    let snap = s.snapshot(back + Duration::from_secs(2));
    let b = snap.lost.iter().find(|l| l.replica_id == "b").unwrap();
    assert_eq!(b.cause, Eviction::HeartbeatTimeout);
    assert_eq!(
        b.history.losses,
        Losses {
            stream_broken: 1,
            heartbeat_timeout: 1,
            progress_stalled: 0,
            left: 0,
        }
    );
    assert_eq!(b.history.returns, 1);
}

#[test]
fn lost_groups_are_kept_for_ten_minutes_and_at_most_32_then_start_afresh() {
    let t = Instant::now();
    let mut s = state();
    for i in 0..40 {
        let id = format!("g{i:02}");
        let ((stream, _), _) = open(&mut s, &id, t);
        s.close_stream(
            &id,
            stream,
            Eviction::StreamBroken,
            t + Duration::from_secs(i),
        );
    }
    let snap = s.snapshot(t + Duration::from_secs(40));
    assert_eq!(snap.lost.len(), LOST_KEPT);
    assert_eq!(snap.lost[0].replica_id, "g39", "most recent first");
    assert_eq!(snap.lost[LOST_KEPT - 1].replica_id, "g08");

    let later = t + Duration::from_secs(39) + LOST_KEPT_FOR + Duration::from_millis(1);
    assert!(s.snapshot(later).lost.is_empty());
    s.sample_steps(later);
    assert!(s.lost.is_empty(), "forgotten, not only hidden");
    // Back after it was forgotten: a new group as far as anyone can tell.
    let _g = open(&mut s, "g39", later);
    assert_eq!(s.snapshot(later).replicas[0].history, History::default());
}

#[test]
fn a_groups_step_rate_is_measured_over_the_samples_of_the_last_half_minute() {
    let t = Instant::now();
    let mut s = state();
    let ((_, a), _ea) = open(&mut s, "a", t);
    form_quorum(&mut s, &["a"], t);
    let at = |ms: u64| t + Duration::from_millis(ms);
    s.sample_steps(at(0));
    a.beat(at(500), 5, 0);
    assert_eq!(s.snapshot(at(500)).replicas[0].step_rate, None, "too soon");
    a.beat(at(2000), 20, 0);
    assert_eq!(s.snapshot(at(2000)).replicas[0].step_rate, Some(10.0));
    // Samples every second or so; a rate from the last 30 s only.
    for second in 1..=40 {
        let step = if second <= 20 {
            second * 10
        } else {
            200 + (second - 20) * 2
        };
        a.beat(at(second * 1000), step as i64, 0);
        s.sample_steps(at(second * 1000));
    }
    let rate = s.snapshot(at(40_000)).replicas[0].step_rate.unwrap();
    assert!(
        (rate - (2.0 * 20.0 + 10.0 * 10.0) / 30.0).abs() < 1e-9,
        "{rate}"
    );
    assert!(s.replicas["a"].steps.kept() <= 32);
}

#[test]
fn a_member_below_the_quorums_max_step_is_healing_until_it_reports_that_step() {
    let t = Instant::now();
    let mut s = state();
    let ((_, a), _ea) = open(&mut s, "a", t);
    let ((_, b), _eb) = open(&mut s, "b", t);
    let ((_, c), _ec) = open(&mut s, "c", t);
    join_at_step(&mut s, "a", 10, t);
    join_at_step(&mut s, "b", 0, t);
    // c, live but not asking, is waited for until the join timeout.
    s.evaluate(t + Duration::from_secs(1), 0)
        .expect("quorum of a and b");
    c.beat(t, 3, 0);
    let healing = |s: &LighthouseState| -> Vec<bool> {
        s.snapshot(t).replicas.iter().map(|r| r.healing).collect()
    };
    assert_eq!(s.snapshot(t).max_step, 10);
    assert_eq!(healing(&s), [false, true, false], "c is no member");
    b.beat(t, 10, 1);
    a.beat(t, 11, 1);
    assert_eq!(healing(&s), [false, false, false]);
}

#[test]
fn a_heals_jump_is_no_speed_the_rate_counts_from_where_it_caught_up() {
    let t = Instant::now();
    let at = |ms: u64| t + Duration::from_millis(ms);
    let mut s = state();
    let ((_, a), _ea) = open(&mut s, "a", t);
    let ((_, b), _eb) = open(&mut s, "b", t);
    join_at_step(&mut s, "a", 1000, t);
    join_at_step(&mut s, "b", 0, t);
    s.evaluate(t, 0).expect("quorum");
    let rate = |s: &LighthouseState, ms| s.snapshot(at(ms)).replicas[1].step_rate;
    for second in 0..3 {
        a.beat(at(second * 1000), 1000 + second as i64, 1);
        b.beat(at(second * 1000), 0, 1);
        s.sample_steps(at(second * 1000));
    }
    assert_eq!(rate(&s, 2000), None, "healing");
    // Healed to 1000, then a step a second.
    for second in 3..6 {
        b.beat(at(second * 1000), 1000 + second as i64 - 3, 1);
        s.sample_steps(at(second * 1000));
    }
    assert_eq!(rate(&s, 5000), Some(1.0));
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
fn the_same_manager_reopening_its_stream_replaces_the_silent_one() {
    let t = Instant::now();
    let mut s = state();
    let first = proto::Beat {
        manager_address: "10.0.0.2:7000".into(),
        ..beat("g2")
    };
    let (tx, _rx) = mpsc::channel(4);
    s.open_stream(&first, "10.0.0.2:5001".into(), tx, t)
        .unwrap();
    // Within the heartbeat timeout, after a cut: a fresh connection, same group.
    let (tx, _rx2) = mpsc::channel(4);
    let later = t + Duration::from_millis(1500);
    s.open_stream(&first, "10.0.0.2:5002".into(), tx, later)
        .expect("the group's own new stream");
    // Another manager under the same id is still refused.
    let impostor = proto::Beat {
        manager_address: "10.0.0.9:7000".into(),
        ..beat("g2")
    };
    let (tx, _rx3) = mpsc::channel(4);
    let refused = s.open_stream(&impostor, "10.0.0.9:1".into(), tx, later);
    assert_eq!(refused.unwrap_err().code(), tonic::Code::AlreadyExists);
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
