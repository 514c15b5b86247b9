//! The leadership's tests: a set of three driven tick by tick with `now` passed in,
//! its messages delivered by hand.

use super::*;

fn set(now: Instant) -> Vec<Leadership> {
    (1..=3)
        .map(|id| {
            Leadership::new(
                id,
                vec![1, 2, 3],
                Timing::default(),
                Saved::default(),
                Box::new(NoDisk),
                now,
            )
            .unwrap()
        })
        .collect()
}

/// Delivers everything at once, tick by tick, for `seconds`.
fn run(nodes: &mut [Leadership], start: Instant, seconds: u64, alive: &[bool]) -> Instant {
    let tick = Timing::default().tick;
    let steps = Duration::from_secs(seconds).as_nanos() / tick.as_nanos();
    let mut now = start;
    for _ in 0..steps {
        now += tick;
        let mut queue: Vec<(u64, Envelope)> = Vec::new();
        for (i, n) in nodes.iter_mut().enumerate() {
            if alive[i] {
                queue.extend(n.advance(now));
            }
        }
        while let Some((to, env)) = queue.pop() {
            let i = to as usize - 1;
            let from = env.message.from as usize - 1;
            if alive[i] && alive[from] {
                queue.extend(nodes[i].receive(env, now));
            }
        }
        let serving = nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| alive[*i] && n.serving(now).is_some())
            .count();
        assert!(serving <= 1);
    }
    now
}

#[test]
fn three_lighthouses_elect_one_server_and_a_survivor_takes_over() {
    let start = Instant::now();
    let mut nodes = set(start);
    let all = [true, true, true];
    let now = run(&mut nodes, start, 4, &all);
    let serving: Vec<u64> = nodes
        .iter()
        .filter(|n| n.serving(now).is_some())
        .map(|n| n.id())
        .collect();
    assert_eq!(serving.len(), 1, "one serves after 4 s");
    let old = serving[0];
    let old_term = nodes[old as usize - 1].term();
    let mut alive = all;
    alive[old as usize - 1] = false;
    let now = run(&mut nodes, now, 3, &alive);
    let serving: Vec<&Leadership> = nodes
        .iter()
        .filter(|n| alive[n.id() as usize - 1] && n.serving(now).is_some())
        .collect();
    assert_eq!(
        serving.len(),
        1,
        "a survivor serves 3 s after the leader died"
    );
    assert!(serving[0].term() > old_term);
    assert!(quorum_id_floor(serving[0].term()) > quorum_id_floor(old_term));
}

/// A set of three that elected a leader: its nodes, the time, the leader's index
/// and a follower's.
fn settled() -> (Vec<Leadership>, Instant, usize, usize) {
    let start = Instant::now();
    let mut nodes = set(start);
    let now = run(&mut nodes, start, 4, &[true, true, true]);
    let leader = nodes.iter().position(|n| n.serving(now).is_some()).unwrap();
    (nodes, now, leader, (leader + 1) % 3)
}

#[test]
fn an_echo_of_a_time_not_yet_come_neither_panics_nor_stretches_the_lease() {
    let start = Instant::now();
    let mut nodes = set(start);
    let now = run(&mut nodes, start, 4, &[true, true, true]);
    let leader = nodes.iter().position(|n| n.serving(now).is_some()).unwrap();
    let follower = (leader + 1) % 3;
    let until = nodes[leader].lease_until().unwrap();
    for echo_us in [
        u64::MAX,
        (now - start + Duration::from_secs(60)).as_micros() as u64,
    ] {
        let mut message = Message::default();
        message.set_msg_type(MessageType::MsgHeartbeatResponse);
        message.from = nodes[follower].id();
        message.to = nodes[leader].id();
        message.term = nodes[leader].term();
        let forged = Envelope {
            message,
            sent_us: 1,
            echo_us,
        };
        nodes[leader].receive(forged, now);
        assert_eq!(nodes[leader].lease_until(), Some(until), "echo {echo_us}");
    }
}

fn heartbeat(from: u64, to: u64, term: u64) -> Envelope {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgHeartbeat);
    message.from = from;
    message.to = to;
    message.term = term;
    Envelope {
        message,
        sent_us: 1,
        echo_us: 0,
    }
}

/// Counts what each save writes, to show a refused message writes nothing.
struct Saves(std::sync::Arc<std::sync::Mutex<Vec<Saved>>>);

impl VoteStore for Saves {
    fn save(&mut self, saved: &Saved) -> std::io::Result<()> {
        self.0.lock().unwrap().push(saved.clone());
        Ok(())
    }
}

#[test]
fn one_heartbeat_at_an_absurd_term_is_refused_and_written_nowhere() {
    let (mut nodes, now, leader, follower) = settled();
    let saves = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    nodes[follower].disk = Box::new(Saves(saves.clone()));
    let term = nodes[follower].term();
    let from = nodes[leader].id();
    let to = nodes[follower].id();
    // The message (2^21 + 7), and the largest term there is.
    for hostile in [(1 << 21) + 7, u64::MAX] {
        let forged = heartbeat(from, to, hostile);
        let refused = nodes[follower].check(&forged, now);
        assert!(
            matches!(refused, Err(Refusal::Term { term: t, .. }) if t == hostile),
            "{refused:?}"
        );
        assert!(nodes[follower].receive(forged, now).is_empty());
        assert_eq!(nodes[follower].term(), term);
    }
    assert!(saves.lock().unwrap().is_empty(), "nothing was written");
    // The set goes on serving in its term.
    let now = run(&mut nodes, now, 2, &[true, true, true]);
    assert_eq!(nodes[leader].serving(now), Some(term));
}

#[test]
fn a_member_without_saved_state_joins_a_set_at_any_term_and_judges_from_there() {
    let start = Instant::now();
    let node = |saved: Saved| {
        Leadership::new(
            1,
            vec![1, 2, 3],
            Timing::default(),
            saved,
            Box::new(NoDisk),
            start,
        )
        .unwrap()
    };
    let far = 1 << 30;
    // A member whose state was reset (term 0 on file) refuses the far term...
    let mut reset = node(Saved::default());
    assert!(matches!(
        reset.check(&heartbeat(2, 1, far), start),
        Err(Refusal::Term { .. })
    ));
    reset.receive(heartbeat(2, 1, far), start);
    assert_eq!(reset.term(), 0);
    // ...one with no state at all takes the leader it hears, not a vote request.
    let mut fresh = node(Saved::default()).starting_fresh();
    let mut vote = heartbeat(2, 1, far);
    vote.message.set_msg_type(MessageType::MsgRequestPreVote);
    assert!(matches!(
        fresh.check(&vote, start),
        Err(Refusal::Term { .. })
    ));
    fresh.receive(heartbeat(2, 1, far), start);
    assert_eq!(fresh.term(), far);
    assert_eq!(fresh.leader(), Some(2));
    // From there on it judges as any member: the next elections, yes; a jump, no.
    let later = start + Duration::from_secs(1);
    assert_eq!(fresh.check(&heartbeat(3, 1, far + 2), later), Ok(()));
    assert!(matches!(
        fresh.check(&heartbeat(3, 1, far + 10 * TERM_SLACK), later),
        Err(Refusal::Term { .. })
    ));
}

#[test]
fn messages_phalanx_never_sends_are_refused() {
    let (mut nodes, now, leader, follower) = settled();
    let (from, to, term) = (
        nodes[follower].id(),
        nodes[leader].id(),
        nodes[leader].term(),
    );
    // A transfer makes the leader tell a follower to campaign at once, past the
    // stickiness the lease counts on.
    for kind in [
        MessageType::MsgTransferLeader,
        MessageType::MsgTimeoutNow,
        MessageType::MsgPropose,
        MessageType::MsgSnapshot,
        MessageType::MsgHup,
    ] {
        let mut forged = heartbeat(from, to, term);
        forged.message.set_msg_type(kind);
        assert_eq!(nodes[leader].check(&forged, now), Err(Refusal::Kind(kind)));
        nodes[leader].receive(forged, now);
    }
    let mut append = heartbeat(to, from, term);
    append.message.set_msg_type(MessageType::MsgAppend);
    append.message.entries.push(Entry {
        term: term + 5,
        ..Default::default()
    });
    assert_eq!(nodes[follower].check(&append, now), Err(Refusal::Entry));
    append.message.entries[0].term = term;
    append.message.entries[0].data = vec![1u8; 8].into();
    assert_eq!(nodes[follower].check(&append, now), Err(Refusal::Entry));
    let mut ack = heartbeat(from, to, term);
    ack.message.set_msg_type(MessageType::MsgAppendResponse);
    ack.message.index = 1 << 40;
    assert_eq!(nodes[leader].check(&ack, now), Err(Refusal::Entry));
    nodes[leader].receive(ack, now);
    let now = run(&mut nodes, now, 2, &[true, true, true]);
    assert_eq!(
        nodes[leader].serving(now),
        Some(term),
        "still the same leader"
    );
}

#[test]
fn a_heartbeat_committing_past_the_log_does_not_panic() {
    let (mut nodes, now, leader, follower) = settled();
    let (from, to, term) = (
        nodes[leader].id(),
        nodes[follower].id(),
        nodes[leader].term(),
    );
    let mut forged = heartbeat(from, to, term);
    forged.message.commit = 1_000_000;
    nodes[follower].receive(forged, now);
    let now = run(&mut nodes, now, 2, &[true, true, true]);
    assert_eq!(nodes[leader].serving(now), Some(term));
}

#[test]
fn an_election_storm_is_never_refused() {
    // Every leader is killed as soon as it serves and comes back at once (its
    // state kept in memory): elections one after another, as fast as the
    // timers allow, for ten minutes.
    let start = Instant::now();
    let timing = Timing::default();
    let mut nodes = set(start);
    let mut now = start;
    let first = nodes[0].term();
    let mut elections = 0;
    while now < start + Duration::from_secs(600) {
        now += timing.tick;
        let mut queue: Vec<(u64, Envelope)> = Vec::new();
        for n in nodes.iter_mut() {
            queue.extend(n.advance(now));
        }
        while let Some((to, env)) = queue.pop() {
            let node = &mut nodes[to as usize - 1];
            assert_eq!(node.check(&env, now), Ok(()), "{:?}", env.message);
            queue.extend(node.receive(env, now));
        }
        if let Some(i) = nodes.iter().position(|n| n.serving(now).is_some()) {
            let saved = nodes[i].to_save();
            nodes[i] = Leadership::new(
                i as u64 + 1,
                vec![1, 2, 3],
                timing,
                saved,
                Box::new(NoDisk),
                now,
            )
            .unwrap();
            elections += 1;
        }
    }
    let last = nodes.iter().map(Leadership::term).max().unwrap();
    assert!(elections > 100, "{elections} elections");
    assert!(last - first >= elections, "terms {first} -> {last}");
    assert!(last <= term_ceiling(0, now - start, &timing));
}

#[test]
fn the_term_ceiling_grows_faster_than_any_election_storm() {
    let t = Timing::default();
    assert_eq!(term_ceiling(7, Duration::ZERO, &t), 7 + TERM_SLACK);
    // An hour of elections at the fastest pace the timers allow.
    let hour = Duration::from_secs(3600);
    let storm = (hour.as_secs_f64() / t.fastest_election().as_secs_f64()) as u64;
    assert!(term_ceiling(0, hour, &t) >= 2 * storm);
    assert_eq!(term_ceiling(u64::MAX, hour, &t), u64::MAX);
    assert_eq!(term_ceiling(0, Duration::MAX, &t), u64::MAX);
    // A set past the last term with ids of its own still takes its members' terms.
    assert!(term_ceiling(1 << 40, Duration::ZERO, &t) > (1 << 40) + 1);
    // The term is refused by a set that has run a day; it would take
    // days of the fastest storm to be reached.
    let day = Duration::from_secs(86_400);
    assert!(term_ceiling(0, day, &t) < (1 << 21) + 7);
}

#[test]
fn the_quorum_ids_of_the_highest_term_are_still_accepted() {
    assert_eq!(MAX_TERM, (1 << 33) - 1);
    assert_eq!(quorum_id_floor(MAX_TERM) + IDS_PER_TERM, MAX_QUORUM_ID);
    assert!(crate::validate::quorum_id("id", quorum_id_floor(u64::MAX) + IDS_PER_TERM).is_ok());
    // The term: its ids were above 2^53 with `term << 32`.
    assert!(quorum_id_floor((1 << 21) + 7) + IDS_PER_TERM < MAX_QUORUM_ID);
}

proptest::proptest! {
    #[test]
    fn quorum_id_floors_stay_in_range_and_rise_with_the_term(a: u64, b: u64) {
        let (low, high) = (a.min(b), a.max(b));
        // Every id of every term is one groups accept.
        proptest::prop_assert!(quorum_id_floor(high) + IDS_PER_TERM <= MAX_QUORUM_ID);
        // Never back; strictly up while the terms have ids of their own.
        proptest::prop_assert!(quorum_id_floor(low) <= quorum_id_floor(high));
        if low < high && low < MAX_TERM {
            proptest::prop_assert!(quorum_id_floor(low) + IDS_PER_TERM <= quorum_id_floor(high));
        }
    }

    #[test]
    fn the_term_ceiling_never_falls_below_the_start_and_rises_with_time(
        start in 0u64..=u64::MAX,
        a_ms in 0u64..(1 << 40),
        b_ms in 0u64..(1 << 40),
    ) {
        let t = Timing::default();
        let (a, b) = (Duration::from_millis(a_ms.min(b_ms)), Duration::from_millis(a_ms.max(b_ms)));
        let (at_a, at_b) = (term_ceiling(start, a, &t), term_ceiling(start, b, &t));
        proptest::prop_assert!(at_a <= at_b);
        proptest::prop_assert!(at_a >= start.saturating_add(TERM_SLACK));
    }
}

#[test]
fn the_lease_is_shorter_than_the_stickiness_by_the_drift_margin() {
    let t = Timing::default();
    assert_eq!(t.stickiness(), Duration::from_millis(590));
    assert!(t.lease().as_secs_f64() <= t.stickiness().as_secs_f64() * (1.0 - MAX_DRIFT));
}
