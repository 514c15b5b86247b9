//! A heartbeat stream over a plain TCP connection (`crate::frames`, `proto::BeatOpen`),
//! both ends: the lighthouse's, for a connection its door let in that opened with the
//! frames' preface, and the group's ([`open`]). The stream means what a gRPC
//! `Lighthouse.Heartbeat` means, event for event; only the bytes around the messages
//! differ (see `frames` for why). On the group's side, its beats go as UDP datagrams
//! beside the stream once the lighthouse offers them (`crate::datagram`).

use std::io;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncWriteExt, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use super::access;
use super::beat_path::DatagramPath;
use super::datagrams::Channels;
use super::frame_reader::{FrameReader, READ_AHEAD};
use super::heartbeat::{self, BeatReader, Events, Inbound};
use super::jobs::JobRequest;
use super::site::{Site, MAX_REQUEST_BYTES};
use crate::auth::JobToken;
use crate::door::Guarded;
use crate::frames::{self, PREFACE};
use crate::gate::Refusal;
use crate::proto::{self, lighthouse_event::Event, LEADER_KEY};
use crate::transport::MAX_RESPONSE_BYTES;
use crate::Error;

/// Serves one framed heartbeat stream on `conn`, a connection of the lighthouse's
/// door that opened with the preface. Its `BeatOpen` passes the token check as a
/// gRPC call's metadata would (and proves the connection); then it is a heartbeat
/// stream like any other (`heartbeat::open`), its events written in frames,
/// every event waiting at once in one write. The door's limits still hold: an
/// unproven connection is closed after its few seconds, a silent one after its idle
/// time. `datagrams`: the datagram channels offered to framed streams; None: beats
/// come on the streams only (`--no-datagrams`, or the UDP port was taken).
pub(crate) async fn serve(
    conn: Guarded,
    site: Arc<Site>,
    datagrams: Option<Arc<Channels>>,
    secret: JobToken,
) {
    let ticket = conn.ticket().clone();
    let (read, mut write) = tokio::io::split(conn);
    let mut reader = FrameReader::new(read, MAX_REQUEST_BYTES);
    let opened = async {
        let hello = async {
            reader.preface().await?;
            reader.message::<proto::BeatOpen>().await?.ok_or_else(|| {
                Status::invalid_argument("a heartbeat connection closed before its BeatOpen")
            })
        };
        let hello = hello
            .await
            .inspect_err(|_| ticket.refusals().count(Refusal::Invalid))?;
        let given = |s: &str| Some(s).filter(|s| !s.is_empty()).map(str::to_string);
        let (job, rules) = (given(&hello.job), given(&hello.job_rules));
        let job = access::admit(
            &secret,
            given(&hello.token).as_deref(),
            JobRequest::parse(job.as_deref(), rules.as_deref()),
        )
        .map_err(|(reason, status)| {
            ticket.refusals().count(reason);
            status
        })?;
        ticket.prove();
        let beats = Inbound::Framed(BeatReader(reader));
        let peer = ticket.peer().to_string();
        heartbeat::open(&site, job, peer, beats, datagrams.as_ref()).await
    };
    let end = match opened.await {
        Ok(events) => match send_events(events, &mut write).await {
            Ok(end) => end,
            Err(_) => return,
        },
        Err(status) => status,
    };
    let mut out = BytesMut::new();
    frames::encode(&end_of(&end), &mut out);
    let _ = write.write_all(&out).await;
    let _ = write.shutdown().await;
}

/// Writes `events` until they end: with Ok the lighthouse let the group go, and the
/// stream ends in order; the first error ends it with that error. Err: the
/// connection broke.
async fn send_events(mut events: Events, write: &mut WriteHalf<Guarded>) -> io::Result<Status> {
    let mut out = BytesMut::new();
    while let Some(event) = events.recv().await {
        let mut next = Some(event);
        while let Some(event) = next {
            match event {
                Ok(event) => {
                    if let Some(shared) = frames::encode_sharing(&event, &mut out) {
                        write.write_all(&out).await?;
                        write.write_all(&shared).await?;
                        out.clear();
                    }
                }
                Err(status) => {
                    write.write_all(&out).await?;
                    return Ok(status);
                }
            }
            next = events.try_recv().ok();
        }
        write.write_all(&out).await?;
        keep_small(&mut out);
    }
    Ok(Status::ok(""))
}

/// The last frame of a stream that ended with `status`.
fn end_of(status: &Status) -> proto::LighthouseEvent {
    let leader = status
        .metadata()
        .get(LEADER_KEY)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    proto::LighthouseEvent {
        event: Some(Event::End(proto::StreamEnd {
            code: status.code() as i32,
            message: status.message().to_string(),
            leader: leader.to_string(),
        })),
    }
}

/// What a `StreamEnd` says: None, the stream ended in order; else the error, as the
/// status of a gRPC call that ended so (the serving lighthouse in `LEADER_KEY`).
fn ended(end: proto::StreamEnd) -> Option<Status> {
    if end.code == 0 {
        return None;
    }
    let mut status = Status::new(Code::from(end.code), end.message);
    match MetadataValue::try_from(end.leader.as_str()) {
        Ok(leader) if !end.leader.is_empty() => {
            status.metadata_mut().insert(LEADER_KEY, leader);
        }
        _ => {}
    }
    Some(status)
}

/// How a group's heartbeat stream reaches the lighthouse: in frames on a connection
/// of its own, its beats as UDP datagrams beside it when the lighthouse offers them
/// (the default: a beat costs the lighthouse a share of one batched read, see
/// `crate::datagram`); in frames alone (a beat costs a read and a decode, and the
/// kernel a segment and its ACK); or as a gRPC stream (`Lighthouse.Heartbeat`,
/// HTTP/2: what a proxy that passes only gRPC lets through, and the yardstick of
/// `benches/heartbeat_capacity.py`).
///
/// ```
/// use phalanx::lighthouse::wire::BeatTransport;
/// assert_eq!("grpc".parse::<BeatTransport>(), Ok(BeatTransport::Grpc));
/// assert_eq!(BeatTransport::default(), BeatTransport::Datagrams);
/// assert!("udp".parse::<BeatTransport>().unwrap_err().contains("datagrams"));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BeatTransport {
    #[default]
    Datagrams,
    Framed,
    Grpc,
}

impl std::str::FromStr for BeatTransport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "datagrams" => Ok(BeatTransport::Datagrams),
            "framed" => Ok(BeatTransport::Framed),
            "grpc" => Ok(BeatTransport::Grpc),
            _ => Err(format!(
                "{s:?} is no heartbeat transport: give \"datagrams\", \"framed\" or \"grpc\""
            )),
        }
    }
}

/// A group's heartbeat stream: what the lighthouse sends on it, in order. Dropping it
/// ends the stream (the lighthouse then declares the group dead).
pub struct BeatEvents(Stream);

enum Stream {
    Framed {
        reader: FrameReader<OwnedReadHalf>,
        /// The first event, read while opening.
        first: Option<proto::LighthouseEvent>,
        /// Where beats go as datagrams, once the lighthouse offered them.
        datagrams: Arc<OnceLock<DatagramPath>>,
        /// Leases that came back as datagrams.
        leases: mpsc::Receiver<proto::Lease>,
        _beats: AbortOnDropHandle<()>,
    },
    Grpc(tonic::Streaming<proto::LighthouseEvent>),
}

impl std::fmt::Debug for BeatEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeatEvents")
    }
}

impl BeatEvents {
    pub(crate) fn grpc(events: tonic::Streaming<proto::LighthouseEvent>) -> Self {
        BeatEvents(Stream::Grpc(events))
    }

    /// The next event; None once the lighthouse ended the stream in order.
    pub async fn message(&mut self) -> Result<Option<proto::LighthouseEvent>, Status> {
        let (reader, first, datagrams, leases) = match &mut self.0 {
            Stream::Grpc(events) => return events.message().await,
            Stream::Framed {
                reader,
                first,
                datagrams,
                leases,
                ..
            } => (reader, first, datagrams, leases),
        };
        if let Some(first) = first.take() {
            return Ok(Some(first));
        }
        let next = tokio::select! {
            biased;
            read = reader.message::<proto::LighthouseEvent>() => read?,
            Some(lease) = leases.recv() => Some(proto::LighthouseEvent {
                event: Some(Event::Lease(lease)),
            }),
        };
        match next {
            Some(proto::LighthouseEvent {
                event: Some(Event::End(end)),
            }) => ended(end).map_or(Ok(None), Err),
            Some(proto::LighthouseEvent {
                event: Some(Event::Lease(lease)),
            }) => {
                if let Some(path) = datagrams.get() {
                    path.leased(lease.seq);
                }
                Ok(Some(proto::LighthouseEvent {
                    event: Some(Event::Lease(lease)),
                }))
            }
            Some(event) => Ok(Some(event)),
            None => Err(Status::unavailable(
                "the lighthouse closed the heartbeat connection",
            )),
        }
    }
}

/// Opens a framed heartbeat stream to the lighthouse at `address` ("host:port"),
/// saying `hello`; its beats are sent from `beats` (the first, which names the group,
/// queued already), as datagrams once the lighthouse offers them if `datagrams`.
/// Returns once the lighthouse took the stream (its first event, the first beat's
/// lease, came) or refused it (the error it gave, as a gRPC call's).
pub(crate) async fn open(
    address: &str,
    hello: &proto::BeatOpen,
    beats: mpsc::Receiver<proto::Beat>,
    connect_timeout: Duration,
    datagrams: bool,
) -> Result<BeatEvents, Error> {
    let unreachable = |detail: String| Error::Connect {
        what: "lighthouse",
        address: address.to_string(),
        detail,
    };
    let stream = match tokio::time::timeout(connect_timeout, TcpStream::connect(address)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(unreachable(e.to_string())),
        Err(_) => {
            return Err(unreachable(format!(
                "no connection within {connect_timeout:?}"
            )))
        }
    };
    // Beats and leases are small and must not wait for a delayed ACK.
    let _ = stream.set_nodelay(true);
    let lighthouse = stream.peer_addr().ok();
    let (read, mut write) = stream.into_split();
    let mut out = BytesMut::from(&PREFACE[..]);
    frames::encode(hello, &mut out);
    write
        .write_all(&out)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let reader = FrameReader::new(read, MAX_RESPONSE_BYTES);
    let path = Arc::new(OnceLock::new());
    let sending = AbortOnDropHandle::new(tokio::spawn(send_beats(beats, write, path.clone())));
    let (leased, leases) = mpsc::channel(DatagramPath::WAITING);
    let mut events = BeatEvents(Stream::Framed {
        reader,
        first: None,
        datagrams: path.clone(),
        leases,
        _beats: sending,
    });
    match events.message().await {
        Ok(Some(event)) => {
            let offer = match &event.event {
                Some(Event::Lease(lease)) => lease
                    .datagrams
                    .as_ref()
                    .map(|offer| (offer, Duration::from_millis(lease.lease_ms))),
                _ => None,
            };
            if let (true, Some((offer, lease)), Some(lighthouse)) = (datagrams, offer, lighthouse) {
                if let Some(offered) = DatagramPath::offered(offer, lease, lighthouse, leased) {
                    let _ = path.set(offered);
                }
            }
            if let Stream::Framed { first, .. } = &mut events.0 {
                *first = Some(event);
            }
            Ok(events)
        }
        Ok(None) => Err(Error::Rpc(Status::unavailable(
            "the lighthouse ended the heartbeat stream as it opened",
        ))),
        Err(status) => Err(Error::Rpc(status)),
    }
}

/// Sends `beats` until they end, each as a datagram on `datagrams` once there is one
/// and it may go so, else in frames, every beat waiting at once in one write; then
/// the connection's sending side closes, which the lighthouse reads as the end of
/// the stream.
async fn send_beats(
    mut beats: mpsc::Receiver<proto::Beat>,
    mut write: OwnedWriteHalf,
    datagrams: Arc<OnceLock<DatagramPath>>,
) {
    let mut out = BytesMut::new();
    let on_stream = |beat: &proto::Beat| datagrams.get().is_none_or(|path| !path.send(beat));
    while let Some(beat) = beats.recv().await {
        if on_stream(&beat) {
            frames::encode(&beat, &mut out);
        }
        while let Ok(beat) = beats.try_recv() {
            if on_stream(&beat) {
                frames::encode(&beat, &mut out);
            }
        }
        if out.is_empty() {
            continue;
        }
        if write.write_all(&out).await.is_err() {
            return;
        }
        keep_small(&mut out);
    }
    let _ = write.shutdown().await;
}

/// Empties a buffer that was written out, and gives back its memory if a large
/// message (a whole quorum of thousands) grew it: 10,000 streams would otherwise each
/// hold a copy of the largest quorum they were sent for as long as they live.
fn keep_small(out: &mut BytesMut) {
    if out.capacity() > READ_AHEAD {
        *out = BytesMut::new();
    } else {
        out.clear();
    }
}
