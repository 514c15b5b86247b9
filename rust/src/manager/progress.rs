//! The group's training progress, gathered from its ranks' reports for its heartbeat.
//!
//! A beating heartbeat proves the process lives, not that it trains: a training thread
//! stuck in a kernel, a deadlock or a C call holding the GIL keeps the heartbeat going.
//! So each rank reports what its training thread did (a count of marks that moves
//! while it works) and whether it sits in a wait on the other groups, which ends by
//! itself within its deadline. The group has made no progress for as long as its
//! stillest rank; a rank whose reports stop (its Python is frozen) stops moving too.
//!
//! Pure: every method takes `now`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One rank's report (see `proto::ProgressReport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankReport {
    pub marks: u64,
    /// Inside a wait on the other groups that ends within this long; None: not waiting.
    pub wait_left: Option<Duration>,
    pub stall_timeout: Duration,
    pub step_time: Duration,
}

#[derive(Clone, Copy, Debug)]
struct RankProgress {
    report: RankReport,
    /// When `marks` last changed.
    moved_at: Instant,
    /// While waiting: since when, and when the wait's deadline passes.
    waiting: Option<(Instant, Instant)>,
    /// When this report came.
    reported_at: Instant,
}

impl RankProgress {
    /// The last instant this rank counts as having made progress: a move, or a report
    /// from inside a wait that is still within its deadline. Only a report: a rank
    /// whose reports stop has a frozen interpreter, whatever its last one said (its
    /// wait may well have ended, and its training thread hung right after).
    fn progressed_at(&self, now: Instant) -> Instant {
        match self.waiting {
            Some((_, deadline)) => self.moved_at.max(deadline.min(self.reported_at).min(now)),
            None => self.moved_at,
        }
    }
}

/// What the group's heartbeat reports of its progress (all zero: no rank reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub progress_age: Duration,
    pub waiting: Duration,
    pub stall_timeout: Duration,
    pub step_time: Duration,
}

#[derive(Debug, Default)]
pub struct Board {
    ranks: BTreeMap<u32, RankProgress>,
}

impl Board {
    pub fn report(&mut self, rank: u32, report: RankReport, now: Instant) {
        let previous = self.ranks.get(&rank);
        let still = previous.filter(|p| p.report.marks == report.marks);
        let moved_at = still.map_or(now, |p| p.moved_at);
        // Entering a wait moves the marks: unmoved, it is the same wait, and its first
        // deadline holds (a wait overrun reports 0 left, again and again).
        let waiting = report
            .wait_left
            .map(|left| match previous.and_then(|p| p.waiting) {
                Some(same) if still.is_some() => same,
                Some((since, _)) => (since, now + left),
                None => (now, now + left),
            });
        self.ranks.insert(
            rank,
            RankProgress {
                report,
                moved_at,
                waiting,
                reported_at: now,
            },
        );
    }

    /// The group's progress at `now`: the age of its stillest rank, its longest wait
    /// on the other groups, the stall timeout its ranks asked for (the shortest) and
    /// its slowest rank's step time.
    pub fn summary(&self, now: Instant) -> Summary {
        let ranks = self.ranks.values();
        Summary {
            progress_age: ranks
                .clone()
                .map(|r| now.saturating_duration_since(r.progressed_at(now)))
                .max()
                .unwrap_or_default(),
            waiting: ranks
                .clone()
                .filter_map(|r| {
                    r.waiting
                        .map(|(since, _)| now.saturating_duration_since(since))
                })
                .max()
                .unwrap_or_default(),
            stall_timeout: ranks
                .clone()
                .map(|r| r.report.stall_timeout)
                .filter(|t| !t.is_zero())
                .min()
                .unwrap_or_default(),
            step_time: ranks.map(|r| r.report.step_time).max().unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn moving(marks: u64) -> RankReport {
        RankReport {
            marks,
            stall_timeout: ms(5000),
            ..RankReport::default()
        }
    }

    #[test]
    fn a_group_is_as_still_as_its_stillest_rank() {
        let t = Instant::now();
        let mut board = Board::default();
        board.report(0, moving(1), t);
        board.report(1, moving(1), t);
        // Rank 0 moves on; rank 1 reports the same marks: it is stuck.
        for i in 1..=30 {
            board.report(0, moving(1 + i), t + ms(100 * i));
            board.report(1, moving(1), t + ms(100 * i));
        }
        let s = board.summary(t + ms(3000));
        assert_eq!(s.progress_age, ms(3000));
        assert_eq!(s.stall_timeout, ms(5000));
        assert_eq!(s.waiting, Duration::ZERO);
    }

    #[test]
    fn a_wait_within_its_deadline_is_progress_and_past_it_is_not() {
        let t = Instant::now();
        let mut board = Board::default();
        let deadline = t + ms(3000);
        for n in [0, 1000, 2000, 2500] {
            board.report(0, waiting_until(deadline, t + ms(n)), t + ms(n));
        }
        let s = board.summary(t + ms(2500));
        assert_eq!(s.progress_age, Duration::ZERO);
        assert_eq!(s.waiting, ms(2500), "the wait counts from its first report");
        // The wait overruns its deadline: reports of 0 left do not move it.
        for n in [3500, 4500] {
            board.report(0, waiting_until(deadline, t + ms(n)), t + ms(n));
        }
        assert_eq!(board.summary(t + ms(4500)).progress_age, ms(1500));
        // The next wait moves the marks and brings its own deadline.
        let next = t + ms(9000);
        for n in [4600, 8000] {
            let report = RankReport {
                wait_left: Some(next.saturating_duration_since(t + ms(n))),
                ..moving(8)
            };
            board.report(0, report, t + ms(n));
        }
        assert_eq!(board.summary(t + ms(8000)).progress_age, Duration::ZERO);
    }

    /// A report from inside a wait whose deadline is `deadline`, sent at `now`.
    fn waiting_until(deadline: Instant, now: Instant) -> RankReport {
        RankReport {
            wait_left: Some(deadline.saturating_duration_since(now)),
            ..moving(7)
        }
    }

    #[test]
    fn a_rank_whose_reports_stop_inside_a_wait_stops_moving_at_its_last_report() {
        // Its interpreter froze: the wait may have ended at once and its training
        // thread hung right after, so the rest of the wait's deadline is no excuse.
        let t = Instant::now();
        let mut board = Board::default();
        board.report(0, waiting_until(t + ms(10_000), t), t);
        board.report(0, waiting_until(t + ms(10_000), t + ms(500)), t + ms(500));
        assert_eq!(board.summary(t + ms(4000)).progress_age, ms(3500));
        assert_eq!(board.summary(t + ms(12_000)).progress_age, ms(11_500));
    }

    #[test]
    fn a_rank_that_stops_reporting_stops_moving() {
        let t = Instant::now();
        let mut board = Board::default();
        board.report(0, moving(1), t);
        assert_eq!(board.summary(t + ms(4000)).progress_age, ms(4000));
        board.report(0, moving(2), t + ms(4000));
        assert_eq!(board.summary(t + ms(4000)).progress_age, Duration::ZERO);
    }

    #[test]
    fn nothing_reported_is_all_zero() {
        assert_eq!(Board::default().summary(Instant::now()), Summary::default());
    }
}
