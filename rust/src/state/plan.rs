//! The stripe plan of a heal: which byte ranges to ask for, and which source fetches
//! which range next. Pure bookkeeping, no sockets and no clock, so the property "every
//! byte lands exactly once, whatever fails" is tested on its own.
//!
//! The state is cut into chunks, and the chunks are dealt into one stripe per source,
//! equal in bytes, so every source works from the start. A source's connections take
//! from its own stripe; once it is empty they take over the tail of the stripe with
//! the most bytes left (a failed source's first), so a fast source ends up carrying
//! more and nobody idles at the end. A chunk whose fetch failed (source gone, checksum
//! mismatch) goes first in line for the next free connection of any live source.

use std::collections::VecDeque;

/// A byte range of one region, fetched with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub region: u32,
    pub offset: u64,
    pub len: u64,
}

/// Cuts every region into chunks of at most `chunk_bytes`; empty regions get none.
pub fn chunks(region_lens: &[u64], chunk_bytes: u64) -> Vec<Chunk> {
    assert!(chunk_bytes > 0, "chunk size must be positive");
    let mut out = Vec::new();
    for (region, &len) in region_lens.iter().enumerate() {
        let region = u32::try_from(region).expect("region count fits the wire (u32)");
        let mut offset = 0;
        while offset < len {
            let take = chunk_bytes.min(len - offset);
            out.push(Chunk {
                region,
                offset,
                len: take,
            });
            offset += take;
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Waiting,
    /// Held by one connection of this source; nobody else may write its bytes.
    InFlight(usize),
    Done,
}

#[derive(Debug)]
pub struct StripePlan {
    chunks: Vec<Chunk>,
    state: Vec<ChunkState>,
    attempts: Vec<u32>,
    /// Each source's share, in order; others take over its tail when they run dry.
    stripes: Vec<VecDeque<usize>>,
    /// Bytes still waiting in each stripe.
    stripe_bytes: Vec<u64>,
    /// Chunks whose fetch failed: first in line for any live source.
    retry: VecDeque<usize>,
    live: Vec<bool>,
    remaining: usize,
}

impl StripePlan {
    pub fn new(chunks: Vec<Chunk>, sources: usize) -> Self {
        let n = chunks.len();
        let mut stripes = vec![VecDeque::new(); sources];
        let mut stripe_bytes = vec![0u64; sources];
        let mut retry = VecDeque::new();
        for (index, chunk) in chunks.iter().enumerate() {
            // To the stripe with the fewest bytes so far: equal shares in bytes, also
            // when large and small tensors alternate.
            match (0..sources).min_by_key(|&s| (stripe_bytes[s], s)) {
                Some(s) => {
                    stripes[s].push_back(index);
                    stripe_bytes[s] += chunk.len;
                }
                None => retry.push_back(index),
            }
        }
        StripePlan {
            state: vec![ChunkState::Waiting; n],
            attempts: vec![0; n],
            stripes,
            stripe_bytes,
            retry,
            live: vec![true; sources],
            remaining: n,
            chunks,
        }
    }

    /// The next chunk for a free connection of `source`: None when the source has
    /// been removed or nothing is waiting right now (others may still fail and give
    /// theirs back, so a caller waits until `is_done`).
    pub fn take(&mut self, source: usize) -> Option<(usize, Chunk)> {
        if !self.is_live(source) {
            return None;
        }
        let index = match self.retry.pop_front() {
            Some(index) => index,
            None => {
                let from = if self.stripes[source].is_empty() {
                    self.richest_stripe()?
                } else {
                    source
                };
                let index = if from == source {
                    self.stripes[from].pop_front()
                } else {
                    self.stripes[from].pop_back()
                }?;
                self.stripe_bytes[from] -= self.chunks[index].len;
                index
            }
        };
        debug_assert_eq!(self.state[index], ChunkState::Waiting);
        self.state[index] = ChunkState::InFlight(source);
        self.attempts[index] += 1;
        Some((index, self.chunks[index]))
    }

    /// The stripe to take over: a failed source's, else the one with most bytes left.
    fn richest_stripe(&self) -> Option<usize> {
        (0..self.stripes.len())
            .filter(|&s| !self.stripes[s].is_empty())
            .max_by_key(|&s| (!self.live[s], self.stripe_bytes[s]))
    }

    /// The chunk arrived intact.
    pub fn complete(&mut self, index: usize) {
        assert!(
            matches!(self.state[index], ChunkState::InFlight(_)),
            "chunk {index} completed while {:?}",
            self.state[index]
        );
        self.state[index] = ChunkState::Done;
        self.remaining -= 1;
    }

    /// The fetch of an in-flight chunk failed; it goes first in line for any live
    /// source. Its bytes may be half written: whoever takes it next overwrites them.
    pub fn give_back(&mut self, index: usize) {
        assert!(
            matches!(self.state[index], ChunkState::InFlight(_)),
            "chunk {index} given back while {:?}",
            self.state[index]
        );
        self.state[index] = ChunkState::Waiting;
        self.retry.push_front(index);
    }

    /// The source failed: it gets no new chunks. Chunks its connections hold stay
    /// theirs until each connection completes or gives its chunk back, so two
    /// writers never share a byte range.
    pub fn remove_source(&mut self, source: usize) {
        if let Some(live) = self.live.get_mut(source) {
            *live = false;
        }
    }

    pub fn is_live(&self, source: usize) -> bool {
        self.live.get(source).copied().unwrap_or(false)
    }

    pub fn live_sources(&self) -> usize {
        self.live.iter().filter(|l| **l).count()
    }

    /// How often the chunk has been handed out so far.
    pub fn attempts(&self, index: usize) -> u32 {
        self.attempts[index]
    }

    pub fn chunk(&self, index: usize) -> Chunk {
        self.chunks[index]
    }

    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// True when chunks still wait but no live source is left to fetch them, and
    /// nothing is in flight that could still complete.
    pub fn is_stuck(&self) -> bool {
        self.remaining > 0
            && self.live_sources() == 0
            && !self
                .state
                .iter()
                .any(|s| matches!(s, ChunkState::InFlight(_)))
    }

    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    pub fn remaining(&self) -> usize {
        self.remaining
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn region_lens() -> impl Strategy<Value = Vec<u64>> {
        proptest::collection::vec(prop_oneof![Just(0u64), 1u64..64, 64u64..5000], 0..40)
    }

    /// True when `done` tiles every region exactly: no byte missing, none twice.
    fn tiles_exactly(region_lens: &[u64], done: &[Chunk]) -> bool {
        let mut sorted = done.to_vec();
        sorted.sort_by_key(|c| (c.region, c.offset));
        let mut next = vec![0u64; region_lens.len()];
        for c in sorted {
            if c.offset != next[c.region as usize] {
                return false;
            }
            next[c.region as usize] += c.len;
        }
        next == region_lens
    }

    #[derive(Clone, Debug)]
    enum Op {
        Take(usize),
        Complete(prop::sample::Index),
        GiveBack(prop::sample::Index),
        Remove(usize),
    }

    fn op(sources: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..sources).prop_map(Op::Take),
            3 => any::<prop::sample::Index>().prop_map(Op::Complete),
            1 => any::<prop::sample::Index>().prop_map(Op::GiveBack),
            1 => (0..sources).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn chunks_cover_every_byte_once(lens in region_lens(), chunk_bytes in 1u64..10_000) {
            let cs = chunks(&lens, chunk_bytes);
            prop_assert!(cs.iter().all(|c| c.len > 0 && c.len <= chunk_bytes));
            prop_assert!(tiles_exactly(&lens, &cs));
        }

        /// Any interleaving of takes, completions, failures and source removals ends
        /// with every byte fetched exactly once, as long as one source survives; a
        /// chunk is never held by two connections, and removed sources get nothing.
        #[test]
        fn every_byte_lands_once_whatever_fails(
            lens in region_lens(),
            chunk_bytes in 1u64..3000,
            sources in 1usize..6,
            ops in proptest::collection::vec(op(6), 0..200),
            survivor in any::<prop::sample::Index>(),
        ) {
            let survivor = survivor.index(sources);
            let mut plan = StripePlan::new(chunks(&lens, chunk_bytes), sources);
            let mut in_flight: Vec<(usize, usize)> = Vec::new(); // (chunk, source)
            let mut done: Vec<Chunk> = Vec::new();
            let mut removed = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Take(s) => {
                        let s = s % sources;
                        if let Some((i, c)) = plan.take(s) {
                            prop_assert!(!removed.contains(&s), "removed source {} got a chunk", s);
                            prop_assert!(in_flight.iter().all(|(j, _)| *j != i), "chunk {} held twice", i);
                            prop_assert_eq!(plan.chunk(i), c);
                            in_flight.push((i, s));
                        }
                    }
                    Op::Complete(at) if !in_flight.is_empty() => {
                        let (i, _) = in_flight.swap_remove(at.index(in_flight.len()));
                        plan.complete(i);
                        done.push(plan.chunk(i));
                    }
                    Op::GiveBack(at) if !in_flight.is_empty() => {
                        let (i, _) = in_flight.swap_remove(at.index(in_flight.len()));
                        plan.give_back(i);
                    }
                    Op::Remove(s) if s % sources != survivor => {
                        plan.remove_source(s % sources);
                        removed.insert(s % sources);
                    }
                    _ => {}
                }
            }
            // Drain: in-flight chunks of removed sources finish or fail; the survivor
            // takes everything still waiting.
            for (n, (i, _)) in in_flight.drain(..).enumerate() {
                if n % 2 == 0 {
                    plan.complete(i);
                    done.push(plan.chunk(i));
                } else {
                    plan.give_back(i);
                }
            }
            for s in &removed {
                prop_assert!(plan.take(*s).is_none());
            }
            while let Some((i, c)) = plan.take(survivor) {
                plan.complete(i);
                done.push(c);
            }
            prop_assert!(plan.is_done());
            prop_assert!(!plan.is_stuck());
            prop_assert_eq!(done.len(), plan.chunk_count());
            prop_assert!(tiles_exactly(&lens, &done), "a byte missing or fetched twice");
        }
    }

    #[test]
    fn a_plan_without_sources_is_stuck_until_done() {
        let mut plan = StripePlan::new(chunks(&[10], 4), 1);
        let (i, _) = plan.take(0).unwrap();
        plan.remove_source(0);
        assert!(!plan.is_stuck(), "a chunk in flight may still complete");
        plan.give_back(i);
        assert!(plan.is_stuck());
        assert!(plan.take(0).is_none());
    }

    #[test]
    fn stripes_carry_equal_bytes_and_a_dead_sources_stripe_is_taken_over() {
        // Large and small tensors alternating, as in a model.
        let lens: Vec<u64> = (0..30)
            .map(|i| if i % 3 == 0 { 4000 } else { 10 })
            .collect();
        let mut plan = StripePlan::new(chunks(&lens, 1000), 3);
        let b = plan.stripe_bytes.clone();
        assert!(
            b.iter().max().unwrap() - b.iter().min().unwrap() <= 1000,
            "{b:?}"
        );
        plan.remove_source(1);
        let mut fetched = 0;
        while let Some((i, c)) = plan.take(0).or_else(|| plan.take(2)) {
            plan.complete(i);
            fetched += c.len;
        }
        assert!(plan.is_done());
        assert!(plan.take(1).is_none());
        assert_eq!(fetched, lens.iter().sum::<u64>());
    }

    #[test]
    fn a_source_takes_from_its_own_stripe_first() {
        let mut plan = StripePlan::new(chunks(&[400], 100), 2);
        let (a, _) = plan.take(0).unwrap();
        let (b, _) = plan.take(1).unwrap();
        assert_eq!((a, b), (0, 1), "chunks are dealt alternately");
        assert_eq!(plan.take(0).unwrap().0, 2);
        // Source 0's stripe is empty: it takes over the tail of source 1's.
        assert_eq!(plan.take(0).unwrap().0, 3);
        assert!(plan.take(1).is_none());
    }

    #[test]
    fn a_failed_chunk_goes_first_in_line() {
        let mut plan = StripePlan::new(chunks(&[12], 4), 2);
        let (a, _) = plan.take(0).unwrap();
        let (b, _) = plan.take(1).unwrap();
        plan.give_back(b);
        assert_eq!(plan.take(0).unwrap().0, b);
        assert_eq!(plan.attempts(b), 2);
        plan.complete(a);
        assert_eq!(plan.remaining(), 2);
    }
}
