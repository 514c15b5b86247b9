//! The liveness's tests: heartbeat streams, expiry, stalls, driven with `now` passed
//! in (the scenarios are `state/tests.rs`).

use std::time::Duration;

use tokio::sync::oneshot;

use super::*;
use crate::lighthouse::state::tests::*;

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
