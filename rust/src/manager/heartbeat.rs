//! A group's heartbeat: one stream to the lighthouse for as long as the manager server
//! runs (framed, on a connection of its own: `lighthouse::wire`), re-opened after a
//! lighthouse restart. Beats carry the group's progress (and
//! its refusal counts when they change), and its quorum requests; the lighthouse
//! answers with leases, quorums and the membership losses the group must act on.
//!
//! A stream's end is the end of its leases for good: the lighthouse declares a group
//! whose stream ends dead at once, and one whose old stream it still holds when a new
//! one opens dead then (`lighthouse::state`, `open_stream`), so no acknowledgement
//! names the quorums that lighthouse issued to the group again, and a step of them can
//! no longer commit. The heartbeat says so to the ranks at once ([`LIGHTHOUSE_LOST`]),
//! so that they drop the step in flight (its collectives wait on a group the cut may
//! have taken along) instead of at the collective timeout.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_util::task::AbortOnDropHandle;
use tonic::{Code, Status};

use super::progress::Board;
use crate::delta::Answer;
use crate::gate::{self, GroupRefusals, RefusalCounts};
use crate::lighthouse::client::{LighthouseClient, Route};
use crate::lighthouse::wire::BeatEvents;
use crate::proto::{self, lighthouse_event::Event, PROTOCOL_VERSION};
use crate::transport::timeout_ms;

/// A lighthouse that restarts is back within a second or so; its groups should be too.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_millis(250);

/// The cause of the membership-loss event a group's manager sends its own ranks when
/// its heartbeat stream ends: no step of the event's quorum can commit any more. It
/// names no group: none died that the group knows of.
pub const LIGHTHOUSE_LOST: &str = "lighthouse_lost";

/// How long a group evicted as stalled waits before it heartbeats again: its ranks are
/// exiting to be restarted (see `phalanx.watchdog`), and a stream re-opened meanwhile
/// would show it live again, and its eviction's cause overwritten, on the status page.
const REOPEN_AFTER_STALL: Duration = Duration::from_secs(5);

/// What a group's heartbeat reports besides being alive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub last_quorum_id: u64,
    /// With `state_quorum_id` and `lineage`: the state the group holds, as of its last
    /// quorum request or, once it committed since, its last commit.
    pub step: i64,
    pub state_quorum_id: u64,
    pub lineage: u64,
}

/// What the lighthouse last acknowledged: while `until` is ahead, it will not declare
/// this group dead, and the group is a live member of quorum `quorum_id` (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub quorum_id: u64,
    pub until: Instant,
    /// When the acknowledged beat was sent.
    pub sent_at: Instant,
}

impl Lease {
    /// Whether the group may still commit a step of `quorum_id` at `now`.
    pub fn holds(&self, quorum_id: u64, now: Instant) -> bool {
        quorum_id != 0 && self.quorum_id == quorum_id && now < self.until
    }
}

/// The part of a lease the group keeps for itself: clocks tick at slightly different
/// rates and a decision takes a moment after its check.
fn lease_length(lease_ms: u64) -> Duration {
    let granted = Duration::from_millis(lease_ms);
    granted.saturating_sub((granted / 10).max(Duration::from_millis(20)))
}

/// The send times of the beats not acknowledged yet, by sequence number.
#[derive(Default)]
struct InFlight(Mutex<VecDeque<(u64, Instant)>>);

impl InFlight {
    /// Keeps a bounded history: a lighthouse that never answers cannot grow it.
    const KEPT: usize = 256;

    fn sent(&self, seq: u64, at: Instant) {
        let mut sent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if sent.len() == Self::KEPT {
            sent.pop_front();
        }
        sent.push_back((seq, at));
    }

    /// The send time of `seq`, forgetting it and every earlier beat.
    fn acknowledged(&self, seq: u64) -> Option<Instant> {
        let mut sent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(&(s, at)) = sent.front() {
            if s > seq {
                return None;
            }
            sent.pop_front();
            if s == seq {
                return Some(at);
            }
        }
        None
    }
}

/// Quorum requests that ride on the open heartbeat stream (see `proto::QuorumAsk`): a
/// frame each way on a stream already open, where a call of its own costs a new
/// HTTP/2 stream, its headers and trailers. One ask waits at a time.
#[derive(Default)]
pub struct Asks(Mutex<AsksInner>);

#[derive(Default)]
struct AsksInner {
    /// The open stream's beats; None while no stream is open. Weak: the stream's
    /// beats end, and the lighthouse sees it close, once its beat sender stops.
    beats: Option<mpsc::WeakSender<proto::Beat>>,
    last_id: u64,
    /// The ask waiting for its answer.
    waiting: Option<(u64, oneshot::Sender<proto::QuorumAnswer>)>,
    /// Streams closed so far: the stream open now (or the next one) is number
    /// `closed`.
    closed: u64,
    /// The highest quorum answered on the stream open now and handed to the ranks.
    answered: u64,
    /// The highest quorum whose lease ended with a stream (see [`Asks::fresh`]).
    lost: u64,
}

/// A quorum answered on a heartbeat stream: the answer, and which stream it came on
/// (see [`Asks::handed`]).
pub struct StreamAnswer {
    pub quorum: Result<Answer, Status>,
    pub stream: u64,
}

impl Asks {
    fn lock(&self) -> std::sync::MutexGuard<'_, AsksInner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks for the next quorum on the open stream and waits up to `timeout` for the
    /// encoded quorum. None: ask by a call of its own instead, because no stream is
    /// open, it ended before the answer, or the lighthouse no longer serves (the call
    /// finds the one that does).
    pub async fn ask(
        &self,
        requester: proto::Member,
        last_quorum_id: u64,
        known_issue: u64,
        timeout: Duration,
    ) -> Option<StreamAnswer> {
        let (beats, ask_id, answer, stream) = {
            let mut inner = self.lock();
            let beats = inner.beats.as_ref()?.upgrade()?;
            inner.last_id += 1;
            let (tx, rx) = oneshot::channel();
            inner.waiting = Some((inner.last_id, tx));
            (beats, inner.last_id, rx, inner.closed)
        };
        let asked = (requester, last_quorum_id, known_issue);
        let quorum = Self::ride(beats, ask_id, answer, asked, timeout);
        Some(StreamAnswer {
            quorum: quorum.await?,
            stream,
        })
    }

    /// Sends ask `ask_id` on the stream `beats` go to and waits for its answer.
    /// `asked`: the requester, its last quorum id and the issue it holds whole.
    async fn ride(
        beats: mpsc::Sender<proto::Beat>,
        ask_id: u64,
        answer: oneshot::Receiver<proto::QuorumAnswer>,
        asked: (proto::Member, u64, u64),
        timeout: Duration,
    ) -> Option<Result<Answer, Status>> {
        let (requester, last_quorum_id, known_issue) = asked;
        // The lighthouse answers a little before the deadline here, so that a wait
        // that runs out still hears why from it.
        let lighthouse_wait = timeout - (timeout / 10).min(Duration::from_millis(100));
        let beat = proto::Beat {
            protocol_version: PROTOCOL_VERSION,
            last_quorum_id,
            step: requester.step,
            ask: Some(proto::QuorumAsk {
                ask_id,
                requester: Some(requester),
                timeout_ms: timeout_ms(lighthouse_wait),
                known_issue,
            }),
            ..Default::default()
        };
        let deadline = tokio::time::Instant::now() + timeout;
        match tokio::time::timeout_at(deadline, beats.send(beat)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return None,
            Err(_) => return Some(Err(not_answered(timeout))),
        }
        drop(beats);
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(a)) if a.code == 0 && !a.update.is_empty() => Some(Ok(Answer::Update(a.update))),
            Ok(Ok(a)) if a.code == 0 => Some(Ok(Answer::Whole(a.quorum))),
            Ok(Ok(a)) => match Status::new(Code::from(a.code), a.message) {
                refused if refused.code() == Code::Unavailable => None,
                refused => Some(Err(refused)),
            },
            Ok(Err(_)) => None,
            Err(_) => Some(Err(not_answered(timeout))),
        }
    }

    fn open(&self, beats: &mpsc::Sender<proto::Beat>) {
        self.lock().beats = Some(beats.downgrade());
    }

    /// Quorum `quorum_id`, answered on stream `stream`, is handed to the ranks. False
    /// when that stream has ended meanwhile: the quorum's lease went with it, and the
    /// caller tells the ranks (the stream's end did not count this quorum).
    pub fn handed(&self, quorum_id: u64, stream: u64) -> bool {
        let mut inner = self.lock();
        if inner.closed != stream {
            inner.lost = inner.lost.max(quorum_id);
            return false;
        }
        inner.answered = inner.answered.max(quorum_id);
        true
    }

    /// The group's request for its next quorum, as it goes to the lighthouse. After
    /// a lease ended with its stream, the request reports a failed step and the
    /// highest quorum id lost: a lighthouse that declared the group dead when the
    /// stream ended would otherwise give the same id to the same members again (an
    /// unchanged membership keeps its id), and the ranks, told that no step of that
    /// id can commit, would drop a step that could.
    pub fn fresh(&self, mut member: proto::Member, last_quorum_id: u64) -> (proto::Member, u64) {
        let lost = self.lock().lost;
        if lost != 0 && lost >= last_quorum_id {
            member.commit_failures = member.commit_failures.max(1);
        }
        (member, last_quorum_id.max(lost))
    }

    /// The stream ended: the ask waiting hears so and is asked again by a call.
    /// Returns the highest quorum whose lease ended with it: `leased`, the quorum its
    /// last acknowledgement named, or one answered on it and handed to the ranks (0:
    /// none).
    fn close(&self, leased: u64) -> u64 {
        let mut inner = self.lock();
        inner.beats = None;
        inner.waiting = None;
        inner.closed += 1;
        let ended = std::mem::take(&mut inner.answered).max(leased);
        inner.lost = inner.lost.max(ended);
        ended
    }

    fn answered(&self, answer: proto::QuorumAnswer) {
        // An answer to an ask given up on since is not for the one waiting now.
        let mut inner = self.lock();
        match inner.waiting.take() {
            Some((id, waiting)) if id == answer.ask_id => {
                let _ = waiting.send(answer);
            }
            other => inner.waiting = other,
        }
    }
}

/// Tells the group's ranks that no step of quorum `quorum_id` can commit any more: the
/// heartbeat stream that held its lease ended (`why`). They abort the step in flight
/// of that quorum, as for a group of it that died, and ask for the next quorum.
pub fn lease_lost(
    events: &broadcast::Sender<proto::MembershipLost>,
    replica_id: &str,
    quorum_id: u64,
    why: &str,
) {
    if quorum_id == 0 {
        return;
    }
    tracing::info!(
        replica_id,
        quorum_id,
        "no step of quorum {quorum_id} can commit any more ({why}): its ranks drop the \
         step in flight and ask for the next quorum"
    );
    let _ = events.send(proto::MembershipLost {
        quorum_id,
        lost: Vec::new(),
        cause: LIGHTHOUSE_LOST.to_string(),
    });
}

fn not_answered(timeout: Duration) -> Status {
    Status::deadline_exceeded(format!(
        "no quorum within {:.3} s: the lighthouse did not answer",
        timeout.as_secs_f64()
    ))
}

/// A group's heartbeat, ready to run.
pub struct Heartbeat {
    pub client: LighthouseClient,
    pub replica_id: String,
    pub manager_address: String,
    pub interval: Duration,
    /// What each beat reports.
    pub progress: watch::Receiver<Progress>,
    /// Where the membership losses the lighthouse pushes go.
    pub events: broadcast::Sender<proto::MembershipLost>,
    /// The lease of the last acknowledged beat; None while no stream is open.
    pub lease: watch::Sender<Option<Lease>>,
    pub refusals: Arc<GroupRefusals>,
    /// The group's steps and heals so far.
    pub tally: Arc<dyn Fn() -> proto::GroupTally + Send + Sync>,
    /// The ranks' training progress, summed up on every beat.
    pub board: Arc<Mutex<Board>>,
    /// The group's quorum requests, sent on the open stream.
    pub asks: Arc<Asks>,
    /// Set when the manager server stops: the stream's last beat says the group leaves.
    pub stopping: watch::Receiver<bool>,
}

impl Heartbeat {
    /// Keeps the stream open until the server stops: then its last beat says the group
    /// leaves, and this returns once the lighthouse has ended the stream.
    pub async fn run(self) {
        let mut backoff = self.interval;
        while !*self.stopping.borrow() {
            let in_flight = Arc::new(InFlight::default());
            let (beats, sender) = self.send_beats(in_flight.clone());
            let opening = Instant::now();
            let (at, opened) = self
                .client
                .open_heartbeat(beats, self.interval.max(Duration::from_secs(1)))
                .await;
            let pause = match opened {
                Ok(stream) => {
                    backoff = self.interval;
                    let (stalled, why) = self.follow(stream, &in_flight, at).await;
                    if stalled {
                        tracing::error!(
                            replica_id = self.replica_id,
                            "the lighthouse evicted this group as stalled: its training made \
                             no progress while its peers waited on it"
                        );
                        backoff = REOPEN_AFTER_STALL;
                    }
                    // Without a stream the group cannot know whether the lighthouse
                    // still counts it in: no lease until a new stream's first
                    // acknowledgement. And the leases of this one end for good (see
                    // the module's doc).
                    let leased = self.lease.send_replace(None).map_or(0, |l| l.quorum_id);
                    let ended = self.asks.close(leased);
                    if *self.stopping.borrow() {
                        return;
                    }
                    lease_lost(&self.events, &self.replica_id, ended, why);
                    backoff
                }
                Err(e) => {
                    tracing::warn!(
                        replica_id = self.replica_id,
                        "cannot open the heartbeat stream: {}",
                        e.message()
                    );
                    // An ask queued for the stream that never opened is asked by a call.
                    self.asks.close(0);
                    backoff = (backoff * 2).min(MAX_REOPEN_BACKOFF.max(self.interval));
                    // An attempt that took the backoff (a connect into a cut) waited it.
                    backoff.saturating_sub(opening.elapsed())
                }
            };
            drop(sender);
            tokio::time::sleep(pause).await;
        }
    }

    /// The beats of one stream, and the task that sends them every interval.
    fn send_beats(
        &self,
        in_flight: Arc<InFlight>,
    ) -> (mpsc::Receiver<proto::Beat>, AbortOnDropHandle<()>) {
        let (beats_tx, beats_rx) = mpsc::channel(4);
        let mut beat = self.beat_maker();
        // Only the first beat names the group; the server reads it before answering,
        // so it is queued before the call.
        in_flight.sent(1, Instant::now());
        let _ = beats_tx.try_send(proto::Beat {
            replica_id: self.replica_id.clone(),
            manager_address: self.manager_address.clone(),
            ..beat(*self.progress.borrow(), 1)
        });
        let progress = self.progress.clone();
        let mut stopping = self.stopping.clone();
        let interval = self.interval;
        self.asks.open(&beats_tx);
        let sender = AbortOnDropHandle::new(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            let mut seq = 1;
            loop {
                let leaving = tokio::select! {
                    _ = ticker.tick() => false,
                    _ = stopping.wait_for(|s| *s) => true,
                };
                seq += 1;
                // Stamped before it is queued: a lease counts from no later than the
                // beat's real departure.
                in_flight.sent(seq, Instant::now());
                let next = proto::Beat {
                    leaving,
                    ..beat(*progress.borrow(), seq)
                };
                if beats_tx.send(next).await.is_err() || leaving {
                    return;
                }
            }
        }));
        (beats_rx, sender)
    }

    /// Makes the beats of one stream: refusal counts and the tally ride on a beat when
    /// they changed (and on a stream's first).
    fn beat_maker(&self) -> impl FnMut(Progress, u64) -> proto::Beat + Send + 'static {
        let refusals = self.refusals.clone();
        let board = self.board.clone();
        let mut reported = RefusalCounts::new();
        let tally = self.tally.clone();
        let mut tallied = None;
        move |p: Progress, seq: u64| {
            let trained = board
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .summary(Instant::now());
            let ms = |d: Duration| d.as_millis().min(u64::MAX as u128) as u64;
            let totals = refusals.totals();
            let refused = if totals == reported {
                Vec::new()
            } else {
                reported = totals;
                gate::counts_to_wire(&reported)
            };
            let now = tally();
            let tally = (tallied.as_ref() != Some(&now)).then(|| {
                tallied = Some(now);
                now
            });
            proto::Beat {
                protocol_version: PROTOCOL_VERSION,
                replica_id: String::new(),
                manager_address: String::new(),
                last_quorum_id: p.last_quorum_id,
                step: p.step,
                state_quorum_id: p.state_quorum_id,
                lineage: p.lineage,
                seq,
                refused,
                tally,
                progress_age_ms: ms(trained.progress_age),
                waiting_ms: ms(trained.waiting),
                stall_timeout_ms: ms(trained.stall_timeout),
                step_time_ms: ms(trained.step_time),
                ask: None,
                leaving: false,
            }
        }
    }

    /// Acts on what the lighthouse sends until the stream ends; says whether it ended
    /// because the group was evicted as stalled, and how it ended.
    async fn follow(
        &self,
        mut stream: BeatEvents,
        in_flight: &InFlight,
        at: Route,
    ) -> (bool, &'static str) {
        let replica_id = &self.replica_id;
        let mut stalled = false;
        // The lighthouse acknowledges every beat. A lighthouse cut off by the network
        // says nothing, and neither does a connection that the cut left in the
        // kernel's retransmission backoff: a stream silent this long gives up its
        // connection for a fresh one (in a set, to the next lighthouse), and the ask
        // waiting on it is asked again there.
        let silence = (self.interval * 10).max(Duration::from_secs(1));
        loop {
            let next = match tokio::time::timeout(silence, stream.message()).await {
                Ok(next) => next,
                Err(_) => {
                    tracing::warn!(
                        replica_id,
                        "the lighthouse at {} went silent for {:.1} s; connecting again",
                        self.client.addresses()[at.index],
                        silence.as_secs_f64()
                    );
                    self.client.went_silent(at);
                    return (stalled, "the lighthouse went silent");
                }
            };
            match next {
                Ok(Some(proto::LighthouseEvent { event: Some(event) })) => match event {
                    Event::MembershipLost(lost) => {
                        stalled |= lost.cause == "progress_stalled"
                            && lost.lost.iter().any(|id| id == replica_id);
                        let _ = self.events.send(lost);
                    }
                    Event::Answer(answer) => self.asks.answered(answer),
                    // `BeatEvents` reads a stream's end itself.
                    Event::End(_) => {}
                    Event::Lease(granted) => {
                        if let Some(sent_at) = in_flight.acknowledged(granted.seq) {
                            self.lease.send_replace(Some(Lease {
                                quorum_id: granted.quorum_id,
                                until: sent_at + lease_length(granted.lease_ms),
                                sent_at,
                            }));
                        }
                    }
                },
                Ok(Some(_)) => {}
                Ok(None) if stalled => return (true, "evicted as stalled"),
                Ok(None) => {
                    tracing::warn!(
                        replica_id,
                        "the lighthouse ended the heartbeat stream; re-opening"
                    );
                    return (false, "the lighthouse ended the heartbeat stream");
                }
                Err(status) => {
                    tracing::warn!(
                        replica_id,
                        "heartbeat stream lost: {}; re-opening",
                        status.message()
                    );
                    self.client.move_on(at, &crate::Error::Rpc(status));
                    return (stalled, "the heartbeat stream broke");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::JobToken;
    use crate::manager::tests::{bounded, start_lighthouse, PATIENCE};
    use bytes::Bytes;

    fn member(replica_id: &str) -> proto::Member {
        proto::Member {
            replica_id: replica_id.into(),
            manager_address: format!("{replica_id}-manager:1"),
            store_address: format!("{replica_id}-store:1"),
            world_size: 1,
            state_addresses: vec![format!("{replica_id}-state:1")],
            ..Default::default()
        }
    }

    #[test]
    fn a_quorum_answered_on_a_stream_is_counted_by_its_end_or_else_told_at_once() {
        let asks = Asks::default();
        let (beats, _sent) = mpsc::channel(1);
        asks.open(&beats);
        assert!(asks.handed(7, 0));
        assert!(asks.handed(5, 0));
        assert_eq!(asks.close(6), 7, "the highest quorum the stream answered");
        // Answered on the stream that ended, handed after its end: not counted by
        // it, so the caller tells the ranks itself.
        assert!(!asks.handed(8, 0));
        asks.open(&beats);
        assert!(asks.handed(9, 1));
        assert_eq!(
            asks.close(10),
            10,
            "the last acknowledgement named a newer one"
        );
        asks.open(&beats);
        assert_eq!(asks.close(0), 0, "a stream that answered nothing");
    }

    #[test]
    fn after_a_lease_ended_the_next_request_asks_for_a_new_quorum_id() {
        let asks = Asks::default();
        let (first, last) = asks.fresh(member("g"), 4);
        assert_eq!((first.commit_failures, last), (0, 4), "no lease lost yet");
        let (beats, _sent) = mpsc::channel(1);
        asks.open(&beats);
        assert!(asks.handed(4, 0));
        asks.close(5);
        let (after, last) = asks.fresh(member("g"), 4);
        assert_eq!((after.commit_failures, last), (1, 5));
        // Quorum 6 came since: the lost ones are behind.
        let (later, last) = asks.fresh(member("g"), 6);
        assert_eq!((later.commit_failures, last), (0, 6));
    }

    #[tokio::test]
    async fn an_ask_names_the_stream_that_answered_it_and_a_closed_stream_answers_none() {
        let asks = Arc::new(Asks::default());
        let (beats, mut sent) = mpsc::channel(4);
        asks.open(&beats);
        let asking = {
            let asks = asks.clone();
            tokio::spawn(async move { asks.ask(member("g"), 0, 0, PATIENCE).await })
        };
        let ask = bounded("the ask's beat", sent.recv()).await.unwrap().ask;
        asks.answered(proto::QuorumAnswer {
            ask_id: ask.expect("an ask").ask_id,
            quorum: Bytes::from_static(b"q"),
            ..Default::default()
        });
        let answer = bounded("the answer", asking)
            .await
            .unwrap()
            .expect("answered");
        assert!(matches!(answer.quorum, Ok(Answer::Whole(q)) if q == "q"));
        assert_eq!(answer.stream, 0);

        // A group that holds a quorum says which issue; its update comes as one.
        let asking = {
            let asks = asks.clone();
            tokio::spawn(async move { asks.ask(member("g"), 0, 9, PATIENCE).await })
        };
        let ask = bounded("the ask's beat", sent.recv())
            .await
            .unwrap()
            .ask
            .unwrap();
        assert_eq!(ask.known_issue, 9);
        asks.answered(proto::QuorumAnswer {
            ask_id: ask.ask_id,
            update: Bytes::from_static(b"u"),
            ..Default::default()
        });
        let answer = bounded("the update", asking).await.unwrap().unwrap();
        assert!(matches!(answer.quorum, Ok(Answer::Update(u)) if u == "u"));

        let asking = {
            let asks = asks.clone();
            tokio::spawn(async move { asks.ask(member("g"), 0, 0, PATIENCE).await })
        };
        bounded("the second ask's beat", sent.recv()).await.unwrap();
        asks.close(0);
        let answer = bounded("the closed stream's answer", asking).await.unwrap();
        assert!(answer.is_none(), "asked again by a call");
    }

    /// Beats `beats` (every 20 ms: the lighthouse leaves a beat unacknowledged when it
    /// renewed the same lease moments ago) until one is acknowledged; returns the
    /// quorum its lease names.
    async fn acknowledged(
        events: &mut BeatEvents,
        beats: &mpsc::Sender<proto::Beat>,
        seq: &mut u64,
    ) -> u64 {
        let first = *seq + 1;
        let leased = async {
            loop {
                *seq += 1;
                let beat = proto::Beat {
                    protocol_version: PROTOCOL_VERSION,
                    seq: *seq,
                    ..Default::default()
                };
                beats.send(beat).await.expect("the stream takes beats");
                let next = Duration::from_millis(20);
                while let Ok(event) = tokio::time::timeout(next, events.message()).await {
                    match event
                        .expect("the stream lives")
                        .expect("the stream is open")
                        .event
                    {
                        Some(Event::Lease(lease)) if lease.seq >= first => return lease.quorum_id,
                        _ => {}
                    }
                }
            }
        };
        bounded("an acknowledgement", leased).await
    }

    /// Opens a heartbeat stream for `replica_id`, again while the lighthouse still
    /// holds an older one as live.
    async fn open(
        client: &LighthouseClient,
        replica_id: &str,
    ) -> (mpsc::Sender<proto::Beat>, BeatEvents) {
        let opened = async {
            loop {
                let (beats, rx) = mpsc::channel(4);
                let first = proto::Beat {
                    protocol_version: PROTOCOL_VERSION,
                    replica_id: replica_id.into(),
                    manager_address: format!("{replica_id}-manager:1"),
                    seq: 1,
                    ..Default::default()
                };
                beats.try_send(first).expect("room for the first beat");
                match client.heartbeat(rx, PATIENCE).await {
                    Ok(events) => return (beats, events),
                    Err(crate::Error::Rpc(s)) if s.code() == Code::AlreadyExists => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => panic!("cannot open a heartbeat stream: {e}"),
                }
            }
        };
        bounded("a heartbeat stream", opened).await
    }

    /// The premise of telling the ranks at once when a stream ends: a stream opened
    /// again to the same lighthouse, however soon, never holds a lease of a quorum the
    /// one before held, so no step of that quorum can commit any more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_opened_again_holds_no_lease_of_the_quorum_its_last_one_held() {
        let server = start_lighthouse().await;
        let address = server.local_addr().to_string();
        let client = LighthouseClient::new(&address, &JobToken::default(), PATIENCE).unwrap();

        let (beats, mut events) = open(&client, "g").await;
        let quorum = client.quorum(member("g"), 0, PATIENCE).await.unwrap();
        let mut seq = 1;
        while acknowledged(&mut events, &beats, &mut seq).await != quorum.quorum_id {}
        // Ended at once, well inside the lease of its last acknowledgement.
        drop((beats, events));
        let (beats, mut events) = open(&client, "g").await;
        let mut seq = 1;
        for _ in 0..5 {
            let leased = acknowledged(&mut events, &beats, &mut seq).await;
            assert_ne!(
                leased, quorum.quorum_id,
                "a lease of the old stream's quorum"
            );
        }
        // Left to itself the lighthouse would give the same id to the same member
        // again; with a failed step reported, as `Asks::fresh` does, it does not.
        let ask = proto::Member {
            commit_failures: 1,
            ..member("g")
        };
        let again = client
            .quorum(ask, quorum.quorum_id, PATIENCE)
            .await
            .unwrap();
        assert!(
            again.quorum_id > quorum.quorum_id,
            "{again:?} after {quorum:?}"
        );
        server.shutdown().await;
    }
}
