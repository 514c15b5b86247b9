//! A group's heartbeat stream, at the lighthouse's end and whichever transport carries
//! it (a gRPC stream, `service`; frames on a connection of its own, `wire`): its first
//! beat names the group and opens the stream in its job's state (`open`), and a task
//! of its own takes the beats that follow (`BeatTask`), each given to the stream's
//! `BeatSink` (`beats`) as a datagram's would be (`datagrams`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::ReadHalf;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;
use tonic::{Status, Streaming};

use super::beats::{Acks, BeatSink};
use super::datagrams::{Channel, Channels};
use super::frame_reader::FrameReader;
use super::history::Eviction;
use super::jobs::JobRequest;
use super::site::{refuse, Site};
use crate::door::Guarded;
use crate::gate::{Refusal, Refusals};
use crate::proto;
use crate::quorum::Identity;
use crate::validate;

/// Where a heartbeat stream's beats come from: a gRPC request stream, or frames on a
/// plain connection (`super::wire`).
pub(crate) enum Inbound {
    Grpc(Streaming<proto::Beat>),
    Framed(BeatReader),
}

impl Inbound {
    async fn message(&mut self) -> Result<Option<proto::Beat>, Status> {
        match self {
            Inbound::Grpc(beats) => beats.message().await,
            Inbound::Framed(beats) => beats.message().await,
        }
    }
}

/// The beats of a framed stream, as the lighthouse reads them.
pub(crate) struct BeatReader(pub(super) FrameReader<ReadHalf<Guarded>>);

impl BeatReader {
    async fn message(&mut self) -> Result<Option<proto::Beat>, Status> {
        self.0.message().await
    }
}

/// What the lighthouse sends on a heartbeat stream; it ends when the group is let go.
pub(crate) type Events = mpsc::Receiver<Result<proto::LighthouseEvent, Status>>;

/// Opens job `job`'s heartbeat stream of a group at `peer` on `site`: its first beat
/// names the group and opens the stream in the state (see `first_beat`); a task of
/// its own takes the beats that follow (see `BeatTask`). `datagrams`: the channels
/// offered to framed streams (see `wire::serve`).
pub(super) async fn open(
    site: &Site,
    job: JobRequest,
    peer: String,
    mut inbound: Inbound,
    datagrams: Option<&Arc<Channels>>,
) -> Result<Events, Status> {
    let refusals = &site.metrics.refusals;
    let first = first_beat(refusals, &mut inbound, site.defaults.heartbeat_timeout).await?;
    let framed = matches!(inbound, Inbound::Framed(_));
    let shared = site.job(&job)?;
    let heartbeat_timeout = shared.rules.heartbeat_timeout;

    let (events_tx, events_rx) = mpsc::channel(16);
    // Weak: the state holds the stream's one strong sender, so that evicting the
    // group ends its response stream at once, beats or no beats.
    let acks = Acks {
        events: events_tx.downgrade(),
        lease_ms: heartbeat_timeout.as_millis() as u64,
        last: None,
        offer: None,
        by_datagram: false,
    };
    let (stream_id, pulse) = {
        let mut st = shared.lock();
        let now = Instant::now();
        shared.admit(now)?;
        let opened = refuse(
            &shared.refusals,
            Refusal::DuplicateReplica,
            st.open_stream(&first, peer, events_tx, now),
        )?;
        shared.opened(&mut st, &first.replica_id, now);
        opened
    };
    shared.metrics.heartbeats.inc();
    let events = acks.events.clone();
    let sink = Arc::new(BeatSink {
        shared: shared.clone(),
        pulse,
        replica_id: first.replica_id.clone(),
        acks: Mutex::new(acks),
    });
    // Only a framed stream is offered datagrams: a group that beats over gRPC is
    // one behind a proxy that passes nothing else.
    let channel = match (datagrams, framed) {
        (Some(channels), true) => {
            let (channel, offer) = channels.open(sink.clone());
            sink.acks().offer = Some(offer);
            Some(channel)
        }
        _ => None,
    };
    // The first lease goes on the stream; a stream already gone ends in its task.
    let _ = sink
        .acks()
        .send(first.seq, sink.pulse.lease_quorum(), Instant::now(), false);
    sink.pulse.trained(Instant::now(), &first);
    shared.report(&first.replica_id, &first);
    let asking = first
        .ask
        .map(|ask| shared.answer_ask(&first.replica_id, ask, first.last_quorum_id, events));
    let task = BeatTask {
        sink,
        inbound,
        stream_id,
        _channel: channel,
        _asking: asking,
    };
    tokio::spawn(task.run());
    Ok(events_rx)
}

/// A heartbeat stream's first beat, within the heartbeat timeout and valid: it names
/// the group, so nothing is opened for a stream that sends none.
async fn first_beat(
    refusals: &Refusals,
    inbound: &mut Inbound,
    heartbeat_timeout: Duration,
) -> Result<proto::Beat, Status> {
    let first = match tokio::time::timeout(heartbeat_timeout, inbound.message()).await {
        Ok(Ok(Some(beat))) => beat,
        Ok(Ok(None)) => return Err(Status::invalid_argument("heartbeat stream without a beat")),
        Ok(Err(status)) => return Err(status),
        Err(_) => {
            return Err(Status::deadline_exceeded(
                "no first heartbeat within the heartbeat timeout",
            ))
        }
    };
    let checked = validate::protocol_version(first.protocol_version).and_then(|_| {
        validate::replica_id(&first.replica_id)?;
        validate::beat(&first)
    });
    refuse(refusals, Refusal::Invalid, checked)?;
    Ok(first)
}

/// A heartbeat stream after its first beat.
struct BeatTask {
    sink: Arc<BeatSink>,
    inbound: Inbound,
    stream_id: u64,
    /// The stream's datagram channel, if it was offered one; closed with the stream.
    _channel: Option<Channel>,
    /// The stream's quorum request still waiting, if any; withdrawn with the stream.
    _asking: Option<AbortOnDropHandle<()>>,
}

impl BeatTask {
    /// Ends when the group's side closes or breaks, or at its first beat once it was
    /// evicted or the lighthouse stopped (both retire the pulse, and the stream's
    /// response ends with this task).
    async fn run(mut self) {
        loop {
            match self.inbound.message().await {
                Ok(Some(beat)) if beat.leaving => return self.left(&beat),
                Ok(Some(beat)) => {
                    if !self.beat(beat) {
                        return;
                    }
                }
                Ok(None) | Err(_) => return self.closed(Eviction::StreamBroken),
            }
        }
    }

    /// A beat on the stream. False: the stream ends.
    fn beat(&mut self, mut beat: proto::Beat) -> bool {
        let sink = &self.sink;
        let ask = beat.ask.take();
        // An ask on its own (seq 0) is a sign of life that reports nothing else; its
        // answer acknowledges it.
        if beat.seq != 0 || ask.is_none() {
            if sink.take(&beat, false).is_err() {
                return false;
            }
        } else if validate::beat(&beat).is_err()
            || !sink
                .pulse
                .beat(Instant::now(), beat.step, beat.last_quorum_id)
        {
            return false;
        }
        if let Some(ask) = ask {
            let events = sink.acks().events.clone();
            self._asking =
                Some(
                    sink.shared
                        .answer_ask(&sink.replica_id, ask, beat.last_quorum_id, events),
                );
        }
        true
    }

    /// The group said it is leaving, holding the state its beat names: the job's
    /// newest, maybe, which the groups left behind must not go on without knowing of.
    fn left(&self, beat: &proto::Beat) {
        if validate::beat(beat).is_ok() && beat.state_quorum_id != 0 {
            let held = Identity {
                lineage: beat.lineage,
                step: beat.step,
                state_quorum_id: beat.state_quorum_id,
            };
            let mut st = self.sink.shared.lock();
            st.leaves_holding(&self.sink.replica_id, self.stream_id, held, Instant::now());
        }
        self.closed(Eviction::Left)
    }

    /// The group's side closed or broke (it is dead), or it said it is leaving.
    fn closed(&self, cause: Eviction) {
        let shared = &self.sink.shared;
        let replica_id = &self.sink.replica_id;
        let mut st = shared.lock();
        let now = Instant::now();
        if let Some(cause) = st.close_stream(replica_id, self.stream_id, cause, now) {
            shared.evicted(cause);
            let what = match cause {
                Eviction::Left => "replica group left: it ended its run",
                _ => "heartbeat stream closed: replica group is dead",
            };
            tracing::info!(replica_id, "{what}");
        }
        shared.evaluate(&mut st, Instant::now());
    }
}
