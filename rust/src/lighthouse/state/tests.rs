//! The lighthouse state's tests: its rules driven with `now` passed in. Here the
//! scenarios every test builds on, and what the status shows; the liveness's tests
//! are `liveness/tests.rs`, the quorum round's `round/tests.rs`.

use prost::Message;

use super::*;
use crate::lighthouse::history::{Eviction, Losses};
use crate::quorum;

pub(super) fn state() -> LighthouseState {
    LighthouseState::new(
        QuorumConfig {
            min_replicas: 1,
            join_timeout: Duration::from_secs(1),
        },
        Duration::from_secs(2),
        ROLLBACK_AFTER,
    )
}

pub(super) const ROLLBACK_AFTER: Duration = Duration::from_secs(30);

pub(super) fn member(id: &str) -> quorum::Member {
    quorum::Member {
        replica_id: id.into(),
        world_size: 1,
        ..Default::default()
    }
}

pub(super) fn beat(id: &str) -> proto::Beat {
    proto::Beat {
        protocol_version: proto::PROTOCOL_VERSION,
        replica_id: id.into(),
        ..Default::default()
    }
}

pub(super) type Events = mpsc::Receiver<Result<proto::LighthouseEvent, Status>>;

pub(super) fn open(s: &mut LighthouseState, id: &str, now: Instant) -> ((u64, Arc<Pulse>), Events) {
    let (tx, rx) = mpsc::channel(4);
    let stream = s.open_stream(&beat(id), "test".into(), tx, now).unwrap();
    (stream, rx)
}

pub(super) fn decoded(reply: QuorumReply) -> proto::Quorum {
    match reply.unwrap() {
        Answer::Whole(bytes) => proto::Quorum::decode(bytes).unwrap(),
        Answer::Update(_) => panic!("an update for a group that holds no quorum"),
    }
}

pub(super) fn form_quorum(s: &mut LighthouseState, ids: &[&str], now: Instant) -> proto::Quorum {
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
pub(super) fn trained(pulse: &Pulse, now: Instant, age_ms: u64, waiting_ms: u64) {
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

/// A small deterministic generator: the scenarios below vary without a seed to chase.
pub(super) struct Lcg(pub(super) u64);

impl Lcg {
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

pub(super) fn join_at_step(s: &mut LighthouseState, id: &str, step: i64, now: Instant) {
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
