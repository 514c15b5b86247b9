//! A group's heartbeat: one stream to the lighthouse for as long as the manager server
//! runs, re-opened after a lighthouse restart. Beats carry the group's progress (and
//! its refusal counts when they change), and its quorum requests; the lighthouse
//! answers with leases, quorums and the membership losses the group must act on.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_util::task::AbortOnDropHandle;
use tonic::{Code, Status, Streaming};

use super::progress::Board;
use crate::client::{timeout_ms, LighthouseClient, Route};
use crate::gate::{self, GroupRefusals, RefusalCounts};
use crate::proto::{self, lighthouse_event::Event, PROTOCOL_VERSION};

/// A lighthouse that restarts is back within a second or so; its groups should be too.
const MAX_REOPEN_BACKOFF: Duration = Duration::from_millis(250);

/// How long a group evicted as stalled waits before it heartbeats again: its ranks are
/// exiting to be restarted (see `phalanx.watchdog`), and a stream re-opened meanwhile
/// would show it live again, and its eviction's cause overwritten, on the status page.
const REOPEN_AFTER_STALL: Duration = Duration::from_secs(5);

/// What a group's heartbeat reports besides being alive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub last_quorum_id: u64,
    pub step: i64,
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
/// DATA frame each way on a stream already open, where a call of its own costs a new
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
        timeout: Duration,
    ) -> Option<Result<Bytes, Status>> {
        let (beats, ask_id, answer) = {
            let mut inner = self.lock();
            let beats = inner.beats.as_ref()?.upgrade()?;
            inner.last_id += 1;
            let (tx, rx) = oneshot::channel();
            inner.waiting = Some((inner.last_id, tx));
            (beats, inner.last_id, rx)
        };
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
            Ok(Ok(a)) if a.code == 0 => Some(Ok(a.quorum)),
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

    /// The stream ended: the ask waiting hears so and is asked again by a call.
    fn close(&self) {
        let mut inner = self.lock();
        inner.beats = None;
        inner.waiting = None;
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
}

impl Heartbeat {
    /// Keeps the stream open for as long as the task runs.
    pub async fn run(self) {
        let mut backoff = self.interval;
        loop {
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
                    if self.follow(stream, &in_flight, at).await {
                        tracing::error!(
                            replica_id = self.replica_id,
                            "the lighthouse evicted this group as stalled: its training made \
                             no progress while its peers waited on it"
                        );
                        backoff = REOPEN_AFTER_STALL;
                    }
                    backoff
                }
                Err(e) => {
                    tracing::warn!(
                        replica_id = self.replica_id,
                        "cannot open the heartbeat stream: {}",
                        e.message()
                    );
                    backoff = (backoff * 2).min(MAX_REOPEN_BACKOFF.max(self.interval));
                    // An attempt that took the backoff (a connect into a cut) waited it.
                    backoff.saturating_sub(opening.elapsed())
                }
            };
            // Without a stream the group cannot know whether the lighthouse still
            // counts it in: no lease until a new stream's first acknowledgement.
            self.lease.send_replace(None);
            self.asks.close();
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
        let interval = self.interval;
        self.asks.open(&beats_tx);
        let sender = AbortOnDropHandle::new(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            let mut seq = 1;
            loop {
                ticker.tick().await;
                seq += 1;
                // Stamped before it is queued: a lease counts from no later than the
                // beat's real departure.
                in_flight.sent(seq, Instant::now());
                let next = beat(*progress.borrow(), seq);
                if beats_tx.send(next).await.is_err() {
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
                seq,
                refused,
                tally,
                progress_age_ms: ms(trained.progress_age),
                waiting_ms: ms(trained.waiting),
                stall_timeout_ms: ms(trained.stall_timeout),
                step_time_ms: ms(trained.step_time),
                ask: None,
            }
        }
    }

    /// Acts on what the lighthouse sends until the stream ends; true when it ended
    /// because the group was evicted as stalled.
    async fn follow(
        &self,
        mut stream: Streaming<proto::LighthouseEvent>,
        in_flight: &InFlight,
        at: Route,
    ) -> bool {
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
                    return stalled;
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
                Ok(None) if stalled => return true,
                Ok(None) => {
                    tracing::warn!(
                        replica_id,
                        "the lighthouse ended the heartbeat stream; re-opening"
                    );
                    return false;
                }
                Err(status) => {
                    tracing::warn!(
                        replica_id,
                        "heartbeat stream lost: {}; re-opening",
                        status.message()
                    );
                    self.client.move_on(at, &crate::Error::Rpc(status));
                    return stalled;
                }
            }
        }
    }
}
