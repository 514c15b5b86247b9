//! Load for the lighthouse benchmarks (`benches/`): many replica groups at once,
//! driven from Rust so that what is measured is the lighthouse, not the driver.

pub mod floor;

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{mpsc, Barrier};

use crate::auth::JobToken;
use crate::lighthouse::client::LighthouseClient;
use crate::lighthouse::jobs::JobRequest;
use crate::lighthouse::wire::{BeatEvents, BeatTransport};
use crate::proto::{self, lighthouse_event::Event, PROTOCOL_VERSION};
use crate::Error;

/// One quorum round as the groups saw it.
#[derive(Clone, Copy, Debug)]
pub struct RoundTiming {
    /// From the last request sent to the last answer received.
    pub latency: Duration,
    /// Did the membership change this round (a group joined or left)?
    pub changed: bool,
    pub quorum_id: u64,
}

/// The id and the issue alone, of a `proto::Quorum` or a `proto::QuorumUpdate` (the
/// same tags): the driver skips decoding or applying the members, as each group would
/// on its own machine, so that its CPU stays off the measurement.
#[derive(Clone, PartialEq, prost::Message)]
struct QuorumId {
    #[prost(uint64, tag = "1")]
    quorum_id: u64,
    #[prost(uint64, tag = "6")]
    issue: u64,
}

/// A group as the benchmark drives it: its heartbeat stream, on which it asks for
/// its quorums as a manager server does.
struct Group {
    replica_id: String,
    beats: mpsc::Sender<proto::Beat>,
    events: BeatEvents,
    asked: u64,
    /// The issue of the last quorum it got (see `proto::QuorumAsk.known_issue`).
    known_issue: u64,
}

impl Group {
    async fn open(
        client: &LighthouseClient,
        replica_id: String,
        timeout: Duration,
    ) -> Result<Group, Error> {
        let (beats, rx) = mpsc::channel(4);
        beats.send(beat(&replica_id)).await.ok();
        let events = client.heartbeat(rx, timeout).await?;
        Ok(Group {
            replica_id,
            beats,
            events,
            asked: 0,
            known_issue: 0,
        })
    }

    /// Asks for the next quorum; returns its id.
    async fn ask(&mut self, timeout: Duration) -> Result<u64, Error> {
        self.asked += 1;
        let ask = proto::Beat {
            ask: Some(proto::QuorumAsk {
                ask_id: self.asked,
                requester: Some(member(self.replica_id.clone())),
                timeout_ms: timeout.as_millis() as u64,
                known_issue: self.known_issue,
            }),
            ..beat("")
        };
        let gone = || Error::InvalidConfig("the lighthouse ended the heartbeat stream".into());
        self.beats.send(ask).await.map_err(|_| gone())?;
        loop {
            let event = self.events.message().await.map_err(Error::Rpc)?;
            let Some(proto::LighthouseEvent { event }) = event else {
                return Err(gone());
            };
            if let Some(Event::Answer(answer)) = event {
                if answer.code != 0 {
                    return Err(Error::Rpc(tonic::Status::new(
                        answer.code.into(),
                        answer.message,
                    )));
                }
                let encoded = if answer.update.is_empty() {
                    answer.quorum
                } else {
                    answer.update
                };
                let quorum = QuorumId::decode(encoded)
                    .map_err(|e| Error::InvalidConfig(format!("malformed quorum: {e}")))?;
                self.known_issue = quorum.issue;
                return Ok(quorum.quorum_id);
            }
        }
    }
}

fn member(replica_id: String) -> proto::Member {
    proto::Member {
        replica_id,
        world_size: 1,
        ..Default::default()
    }
}

fn beat(replica_id: &str) -> proto::Beat {
    proto::Beat {
        protocol_version: PROTOCOL_VERSION,
        replica_id: replica_id.to_string(),
        ..Default::default()
    }
}

/// The shape of a load of quorum rounds (`quorum_rounds`).
#[derive(Clone, Copy, Debug)]
pub struct RoundsLoad {
    /// Groups that ask in every round.
    pub replicas: usize,
    /// Rounds measured, after the one that forms the first quorum.
    pub rounds: usize,
    /// With more than 0, one extra group joins on every such round and leaves (its
    /// heartbeat stream dropped, as on a crash) on the one after.
    pub change_every: usize,
}

/// `load.replicas` groups, each with its own connection and heartbeat stream (over
/// `transport`), ask for `load.rounds` quorums in lock-step, a group joining and
/// leaving as `load.change_every` says.
pub async fn quorum_rounds(
    address: &str,
    token: &JobToken,
    job: &JobRequest,
    transport: BeatTransport,
    load: RoundsLoad,
    timeout: Duration,
) -> Result<Vec<RoundTiming>, Error> {
    let RoundsLoad {
        replicas,
        rounds,
        change_every,
    } = load;
    let status = LighthouseClient::for_job(address, token, job, timeout)?;
    let extra_client =
        LighthouseClient::for_job(address, token, job, timeout)?.beats_over(transport);
    let mut groups =
        open_groups(address, token, job, transport, "group", replicas, timeout).await?;
    let mut timings = Vec::with_capacity(rounds);
    let mut extra = None;
    // Round 0 forms the first quorum; it is not reported.
    for round in 0..=rounds {
        let change = change_every > 0 && round > 0 && round % change_every == 0;
        let mut newcomer = None;
        if change {
            if extra.take().is_none() {
                let mut group = Group::open(&extra_client, "extra".into(), timeout).await?;
                // A newcomer asks first: the others' round must find it waiting.
                newcomer = Some(tokio::spawn(async move {
                    let quorum_id = group.ask(timeout).await;
                    (group, None, Instant::now(), quorum_id)
                }));
                wait_until_joined(&status, "extra", timeout).await?;
            } else {
                // Let the lighthouse see the stream break before the round starts.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let barrier = Arc::new(Barrier::new(groups.len() + usize::from(extra.is_some())));
        let mut tasks: Vec<_> = groups
            .drain(..)
            .chain(extra.take())
            .map(|mut group| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    let sent = Instant::now();
                    let quorum_id = group.ask(timeout).await;
                    (group, Some(sent), Instant::now(), quorum_id)
                })
            })
            .collect();
        tasks.extend(newcomer);
        let mut last_sent = None::<Instant>;
        let mut last_answer = None::<Instant>;
        let mut quorum_id = 0;
        for task in tasks {
            let (group, sent, answered, id) = task
                .await
                .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))?;
            last_sent = last_sent.max(sent);
            last_answer = last_answer.max(Some(answered));
            quorum_id = id?;
            if group.replica_id == "extra" {
                extra = Some(group);
            } else {
                groups.push(group);
            }
        }
        if round > 0 {
            timings.push(RoundTiming {
                latency: last_answer
                    .zip(last_sent)
                    .map_or(Duration::ZERO, |(a, s)| a.saturating_duration_since(s)),
                changed: change,
                quorum_id,
            });
        }
    }
    Ok(timings)
}

/// `replicas` groups named `<prefix>-<n>`, each on a connection of its own, opened
/// `OPENING_AT_ONCE` at a time.
async fn open_groups(
    address: &str,
    token: &JobToken,
    job: &JobRequest,
    transport: BeatTransport,
    prefix: &str,
    replicas: usize,
    timeout: Duration,
) -> Result<Vec<Group>, Error> {
    if let Some(warning) = crate::fdlimit::ensure(replicas, "the load's connections") {
        return Err(Error::InvalidConfig(warning));
    }
    let opening = Arc::new(tokio::sync::Semaphore::new(OPENING_AT_ONCE));
    let mut tasks = Vec::with_capacity(replicas);
    for g in 0..replicas {
        let client = LighthouseClient::for_job(address, token, job, timeout)?.beats_over(transport);
        let (opening, replica_id) = (opening.clone(), format!("{prefix}-{g:05}"));
        tasks.push(tokio::spawn(async move {
            let _opening = opening.acquire().await;
            Group::open(&client, replica_id, timeout).await
        }));
    }
    let mut groups = Vec::with_capacity(replicas);
    for task in tasks {
        groups.push(
            task.await
                .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))??,
        );
    }
    Ok(groups)
}

/// Asks every group for the next quorum at once; returns them and the quorum's id.
async fn ask_all(groups: Vec<Group>, timeout: Duration) -> Result<(Vec<Group>, u64), Error> {
    let tasks: Vec<_> = groups
        .into_iter()
        .map(|mut group| {
            tokio::spawn(async move {
                let quorum_id = group.ask(timeout).await;
                (group, quorum_id)
            })
        })
        .collect();
    let (mut groups, mut quorum_id) = (Vec::with_capacity(tasks.len()), 0);
    for task in tasks {
        let (group, id) = task
            .await
            .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))?;
        quorum_id = id?;
        groups.push(group);
    }
    Ok((groups, quorum_id))
}

/// `replicas` groups, each on its own connection, and for each of `trials` one more
/// that joins their quorum and then crashes (its heartbeat stream dropped, its
/// connection with it). Returns, per trial, the time from the drop until every other
/// group has been told of the loss on its stream.
pub async fn crash_told(
    address: &str,
    token: &JobToken,
    transport: BeatTransport,
    replicas: usize,
    trials: usize,
    timeout: Duration,
) -> Result<Vec<Duration>, Error> {
    let mut groups = open_groups(
        address,
        token,
        &JobRequest::default(),
        transport,
        "group",
        replicas,
        timeout,
    )
    .await?;
    let mut told = Vec::with_capacity(trials);
    for trial in 0..trials {
        let victim = open_groups(
            address,
            token,
            &JobRequest::default(),
            transport,
            &format!("crash{trial}"),
            1,
            timeout,
        )
        .await?;
        groups.extend(victim);
        let quorum_id;
        (groups, quorum_id) = ask_all(groups, timeout).await?;
        let victim = groups.pop().expect("the victim asked last");
        let dropped = Instant::now();
        drop(victim);
        let tasks: Vec<_> = groups
            .drain(..)
            .map(|mut group| {
                tokio::spawn(async move {
                    let heard = tokio::time::timeout(timeout, async {
                        loop {
                            match group.events.message().await {
                                Ok(Some(proto::LighthouseEvent {
                                    event: Some(Event::MembershipLost(lost)),
                                })) if lost.quorum_id == quorum_id => return Ok(Instant::now()),
                                Ok(Some(_)) => {}
                                Ok(None) | Err(_) => {
                                    return Err(Error::InvalidConfig(
                                        "a survivor's stream ended".into(),
                                    ))
                                }
                            }
                        }
                    })
                    .await
                    .map_err(|_| Error::InvalidConfig("a survivor was never told".into()));
                    (group, heard)
                })
            })
            .collect();
        let mut last = dropped;
        for task in tasks {
            let (group, heard) = task
                .await
                .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))?;
            last = last.max(heard??);
            groups.push(group);
        }
        told.push(last - dropped);
    }
    Ok(told)
}

/// Waits until the lighthouse lists `replica_id` as asking for the next quorum.
async fn wait_until_joined(
    client: &LighthouseClient,
    replica_id: &str,
    timeout: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    loop {
        let status = client.status(timeout).await?;
        if status
            .replicas
            .iter()
            .any(|r| r.replica_id == replica_id && r.joined)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Rpc(tonic::Status::deadline_exceeded(format!(
                "{replica_id} never showed up as joined"
            ))));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Connections the heartbeat load opens at once (see `heartbeats`).
const OPENING_AT_ONCE: usize = 64;

/// Keeps `replicas` heartbeat streams open over `transport`, each beating `hz` times a
/// second, for `duration`, driven by `connections` tasks (over gRPC, a connection
/// each, its streams multiplexed on it; framed, every stream is a connection of its
/// own, and with datagrams its beats go beside it, from one socket); every stream reads what the lighthouse sends it (its leases), as a group
/// does. Returns the beats sent.
pub async fn heartbeats(
    address: &str,
    token: &JobToken,
    transport: BeatTransport,
    replicas: usize,
    hz: f64,
    connections: usize,
    duration: Duration,
) -> Result<u64, Error> {
    let connections = connections.clamp(1, replicas.max(1));
    let sockets = match transport {
        BeatTransport::Grpc => connections,
        BeatTransport::Framed | BeatTransport::Datagrams => replicas,
    };
    if let Some(warning) = crate::fdlimit::ensure(sockets, "the load's connections") {
        return Err(Error::InvalidConfig(warning));
    }
    let period = Duration::from_secs_f64(1.0 / hz.max(0.001));
    // Groups come up over a while, not in one instant: at most this many connections
    // are being opened at once, below the lighthouse's cap on unproven ones (a burst
    // past it crowds out its own handshakes, and only a group retries).
    let opening = Arc::new(tokio::sync::Semaphore::new(OPENING_AT_ONCE));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let opening = opening.clone();
        let client =
            LighthouseClient::new(address, token, Duration::from_secs(10))?.beats_over(transport);
        let ids: Vec<String> = (c..replicas)
            .step_by(connections)
            .map(|g| format!("beat-{g:06}"))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut streams = Vec::with_capacity(ids.len());
            let opened = opening.acquire().await;
            for id in &ids {
                let (tx, rx) = mpsc::channel(2);
                tx.send(beat(id)).await.ok();
                let mut events = client.heartbeat(rx, Duration::from_secs(10)).await?;
                tokio::spawn(async move { while let Ok(Some(_)) = events.message().await {} });
                streams.push(tx);
            }
            drop(opened);
            let deadline = Instant::now() + duration;
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let (mut sent, mut seq) = (0u64, 0u64);
            while Instant::now() < deadline {
                ticker.tick().await;
                // Numbered as a group numbers them: a datagram must grow its stream's.
                seq += 1;
                for tx in &streams {
                    if tx.try_send(proto::Beat { seq, ..beat("") }).is_ok() {
                        sent += 1;
                    }
                }
            }
            Ok::<u64, Error>(sent)
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task
            .await
            .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))??;
    }
    Ok(total)
}

/// What a flood came to: requests sent, and those the lighthouse answered at all
/// (with a status or a refusal) within their deadline.
#[derive(Clone, Copy, Debug, Default)]
pub struct Flood {
    pub sent: u64,
    pub answered: u64,
}

/// Requests of one flood in flight at once, at most: past them a tick sends none.
const FLOOD_IN_FLIGHT: usize = 512;

/// Floods the lighthouse with `rate` requests a second of job `job` for `duration`,
/// over `connections` connections: status calls and quorum requests that are
/// garbage (no requester), in turn, as a buggy or hostile client of a job would send.
pub async fn flood(
    address: &str,
    token: &JobToken,
    job: &JobRequest,
    rate: f64,
    connections: usize,
    duration: Duration,
) -> Result<Flood, Error> {
    let connections = connections.max(1);
    let tick = Duration::from_millis(10);
    let per_tick = (rate * tick.as_secs_f64() / connections as f64).max(1.0);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(FLOOD_IN_FLIGHT));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let client = LighthouseClient::for_job(address, token, job, Duration::from_secs(5))?;
        let in_flight = in_flight.clone();
        tasks.push(tokio::spawn(async move {
            let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let (mut sent, mut owed) = (0u64, 0.0);
            let deadline = Instant::now() + duration;
            let mut ticker = tokio::time::interval(tick);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while Instant::now() < deadline {
                ticker.tick().await;
                owed += per_tick;
                while owed >= 1.0 {
                    owed -= 1.0;
                    let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                        break;
                    };
                    let (client, answered) = (client.clone(), answered.clone());
                    let garbage = sent % 2 == 1;
                    sent += 1;
                    tokio::spawn(async move {
                        let timeout = Duration::from_secs(1);
                        let heard = if garbage {
                            let nobody = proto::Member::default();
                            matches!(client.quorum(nobody, 0, timeout).await, Err(Error::Rpc(_)))
                        } else {
                            client.status(timeout).await.is_ok()
                        };
                        if heard {
                            answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        drop(permit);
                    });
                }
            }
            // What is still in flight has a second to come back.
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                while in_flight.available_permits() < FLOOD_IN_FLIGHT {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            Flood {
                sent,
                answered: answered.load(std::sync::atomic::Ordering::Relaxed),
            }
        }));
    }
    let mut total = Flood::default();
    for task in tasks {
        let part = task
            .await
            .map_err(|e| Error::InvalidConfig(format!("flood task failed: {e}")))?;
        total.sent += part.sent;
        total.answered += part.answered;
    }
    Ok(total)
}
