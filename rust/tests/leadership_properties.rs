//! The safety rule of a lighthouse set, on a fake clock: in any interleaving of ticks,
//! message delays and losses, partitions, crashes and restarts, and with clocks that
//! run at rates up to the allowed drift apart, no two lighthouses serve (issue
//! quorums) at the same instant, and the term a server serves in — the high bits of
//! its quorum ids — never goes back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use phalanx::lighthouse::leadership::{
    quorum_id_floor, Envelope, Leadership, Saved, Timing, VoteStore, MAX_DRIFT,
};
use proptest::prelude::*;

/// A member's disk: survives its crashes.
#[derive(Clone, Default)]
struct Disk(Arc<Mutex<Saved>>);

impl VoteStore for Disk {
    fn save(&mut self, saved: &Saved) -> std::io::Result<()> {
        *self.0.lock().unwrap() = saved.clone();
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Let this many milliseconds of real time pass.
    Run(u32),
    /// Cut the set in two: members whose bit is set on one side.
    Partition(u8),
    Heal,
    Crash(usize),
    Restart(usize),
    /// Message delays from now on, up to this many milliseconds.
    Delays(u32),
    /// Lose one message in this many (0: none).
    Loss(u32),
}

fn op(members: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u32..1500).prop_map(Op::Run),
        1 => any::<u8>().prop_map(Op::Partition),
        1 => Just(Op::Heal),
        1 => (0..members).prop_map(Op::Crash),
        1 => (0..members).prop_map(Op::Restart),
        1 => (0u32..300).prop_map(Op::Delays),
        1 => (0u32..5).prop_map(Op::Loss),
    ]
}

struct Member {
    node: Option<Leadership>,
    disk: Disk,
    /// Its clock: base + real elapsed × rate.
    rate: f64,
}

struct World {
    base: Instant,
    real: Duration,
    members: Vec<Member>,
    in_flight: Vec<(Duration, u64, Envelope)>,
    side: u8,
    delays: u32,
    loss: u32,
    random: u64,
    highest_served_term: u64,
}

impl World {
    fn local(&self, i: usize) -> Instant {
        self.base + self.real.mul_f64(self.members[i].rate)
    }

    fn next_random(&mut self) -> u64 {
        self.random = self
            .random
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.random >> 33
    }

    fn connected(&self, a: usize, b: usize) -> bool {
        (self.side >> a & 1) == (self.side >> b & 1)
    }

    fn start(&mut self, i: usize) {
        let saved = self.members[i].disk.0.lock().unwrap().clone();
        let disk = Box::new(self.members[i].disk.clone());
        let voters = (1..=self.members.len() as u64).collect();
        let now = self.local(i);
        self.members[i].node = Some(
            Leadership::new(i as u64 + 1, voters, Timing::default(), saved, disk, now).unwrap(),
        );
    }

    fn send(&mut self, from: usize, out: Vec<(u64, Envelope)>) {
        for (to, envelope) in out {
            if self.loss > 0 && self.next_random().is_multiple_of(self.loss as u64) {
                continue;
            }
            let delay = if self.delays == 0 {
                0
            } else {
                self.next_random() % self.delays as u64
            };
            let _ = from;
            self.in_flight
                .push((self.real + Duration::from_millis(delay), to, envelope));
        }
    }

    /// One millisecond-step of real time: deliveries due, then every member's ticks,
    /// then the check.
    fn step(&mut self) -> Result<(), TestCaseError> {
        self.real += Duration::from_millis(1);
        let due: Vec<_> = {
            let real = self.real;
            let (due, later) = self.in_flight.drain(..).partition(|(at, _, _)| *at <= real);
            self.in_flight = later;
            due
        };
        for (_, to, envelope) in due {
            let i = to as usize - 1;
            let from = envelope.message.from as usize - 1;
            if !self.connected(i, from) {
                continue;
            }
            let now = self.local(i);
            if let Some(node) = self.members[i].node.as_mut() {
                // Crashes, partitions and delays never make a real message look
                // implausible (`Leadership::check`): none is refused.
                assert_eq!(node.check(&envelope, now), Ok(()), "{:?}", envelope.message);
                let out = node.receive(envelope, now);
                self.send(i, out);
            }
        }
        for i in 0..self.members.len() {
            let now = self.local(i);
            if let Some(node) = self.members[i].node.as_mut() {
                let out = node.advance(now);
                self.send(i, out);
            }
        }
        let serving: Vec<(usize, u64)> = (0..self.members.len())
            .filter_map(|i| {
                let now = self.local(i);
                let term = self.members[i].node.as_ref()?.serving(now)?;
                Some((i, term))
            })
            .collect();
        prop_assert!(
            serving.len() <= 1,
            "two lighthouses serve at {:?}: {serving:?}",
            self.real
        );
        if let Some(&(_, term)) = serving.first() {
            prop_assert!(
                quorum_id_floor(term) >= quorum_id_floor(self.highest_served_term),
                "term went back from {} to {term}",
                self.highest_served_term
            );
            self.highest_served_term = term;
        }
        Ok(())
    }
}

fn check(members: usize, rates: Vec<f64>, seed: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut world = World {
        base: Instant::now(),
        real: Duration::ZERO,
        members: rates
            .into_iter()
            .take(members)
            .map(|rate| Member {
                node: None,
                disk: Disk::default(),
                rate,
            })
            .collect(),
        in_flight: Vec::new(),
        side: 0,
        delays: 5,
        loss: 0,
        random: seed,
        highest_served_term: 0,
    };
    for i in 0..members {
        world.start(i);
    }
    for op in ops {
        match op {
            Op::Run(ms) => {
                for _ in 0..ms {
                    world.step()?;
                }
            }
            Op::Partition(mask) => world.side = mask,
            Op::Heal => world.side = 0,
            Op::Crash(i) => world.members[i].node = None,
            Op::Restart(i) => {
                if world.members[i].node.is_none() {
                    world.start(i);
                }
            }
            Op::Delays(ms) => world.delays = ms,
            Op::Loss(n) => world.loss = n,
        }
    }
    Ok(())
}

/// Clock rates within the drift the lease allows for: any two differ by a factor of
/// at most 1 - MAX_DRIFT.
fn rates() -> impl Strategy<Value = Vec<f64>> {
    let half = MAX_DRIFT / 2.0 * 0.99;
    prop::collection::vec(1.0 - half..1.0 + half, 5)
}

/// 128 cases, or `PROPTEST_CASES` where it is set (as every other property test here
/// reads it): a quick run asks for fewer.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(128)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn never_two_serving_and_terms_never_go_back(
        members in prop_oneof![Just(3usize), Just(5usize)],
        rates in rates(),
        seed in any::<u64>(),
        ops in prop::collection::vec(op(3), 1..40),
    ) {
        check(members, rates, seed, ops)?;
    }
}

/// With the network whole again and nobody crashed, somebody serves: the rule is not
/// kept by never serving.
#[test]
fn after_chaos_a_healed_set_serves_again() {
    let ops = vec![
        Op::Run(3000),
        Op::Partition(0b001),
        Op::Run(3000),
        Op::Crash(1),
        Op::Run(2000),
        Op::Restart(1),
        Op::Heal,
    ];
    let mut world_ops = ops.clone();
    world_ops.push(Op::Run(4000));
    check(3, vec![1.0; 5], 7, world_ops).unwrap();
    // And now look at who serves at the end.
    let base = Instant::now();
    let disks: Vec<Disk> = (0..3).map(|_| Disk::default()).collect();
    let mut nodes: Vec<Leadership> = (0..3)
        .map(|i| {
            Leadership::new(
                i as u64 + 1,
                vec![1, 2, 3],
                Timing::default(),
                Saved::default(),
                Box::new(disks[i].clone()),
                base,
            )
            .unwrap()
        })
        .collect();
    let mut now = base;
    let mut queue = Vec::new();
    for _ in 0..4000 {
        now += Duration::from_millis(1);
        for n in nodes.iter_mut() {
            queue.extend(n.advance(now));
        }
        while let Some((to, env)) = queue.pop() {
            let out = nodes[to as usize - 1].receive(env, now);
            queue.extend(out);
        }
    }
    assert_eq!(nodes.iter().filter(|n| n.serving(now).is_some()).count(), 1);
}
