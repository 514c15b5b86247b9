//! A lighthouse's seat in a set of lighthouses: the I/O around `leadership`.
//!
//! One task ticks Raft (sleeping until the next tick or the lease's end, woken by
//! arriving messages), one task per other member sends it Raft's messages, and the
//! `LighthouseSet` gRPC service takes theirs in. When this lighthouse starts or stops
//! serving, its soft quorum state is started afresh (see `Shared::serve_in`); while it
//! does not serve, quorum requests and heartbeats get UNAVAILABLE naming the server.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use tokio::sync::{mpsc, watch, Notify};
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use super::jobs::{JobName, NewestByJob, MAX_NEWEST_KNOWN};
use super::leadership::{Envelope, Leadership, Refusal, Saved, Timing, View, VoteStore, MAX_TERM};
use super::metrics::RaftRefusals;
use crate::auth::JobToken;
use crate::proto::{
    self, lighthouse_set_client::LighthouseSetClient, lighthouse_set_server, LEADER_KEY,
};
use crate::quorum::Identity;
use crate::transport::{self, Authed};
use crate::Error;

/// How a lighthouse joins a set.
#[derive(Clone, Debug)]
pub struct SetOptions {
    /// This lighthouse's id: its place in `peers`, counting from 1.
    pub id: u64,
    /// Every member's address, this one's included, in the same order on every member.
    pub peers: Vec<String>,
    /// Where the Raft term and vote are kept across restarts.
    pub state_file: PathBuf,
    pub timing: Timing,
}

impl SetOptions {
    pub fn validate(&self) -> Result<(), Error> {
        if self.peers.len() < 3 {
            return Err(Error::InvalidConfig(format!(
                "--peers lists {} lighthouse(s); a set needs at least 3 (an odd number: 3 \
                 or 5) so that one may fail. For a single lighthouse leave --peers out",
                self.peers.len()
            )));
        }
        if self.id == 0 || self.id as usize > self.peers.len() {
            return Err(Error::InvalidConfig(format!(
                "--id {} is not a place in --peers ({} addresses): give 1 to {}, this \
                 lighthouse's own position in the list",
                self.id,
                self.peers.len(),
                self.peers.len()
            )));
        }
        Ok(())
    }

    /// The default state file: one per member address, in the temporary directory.
    pub fn default_state_file(own_address: &str) -> PathBuf {
        let name: String = own_address
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        std::env::temp_dir().join(format!("phalanx-lighthouse-{name}.raft"))
    }
}

/// The term, vote and log terms in a small text file ("term vote t1 t2 ..."),
/// replaced atomically and synced.
struct FileVotes(PathBuf);

impl FileVotes {
    /// The state in `path` and how long ago it was written (by the file's time: a
    /// clock set back since only makes that shorter, and `term_ceiling` stricter).
    fn load_with_age(path: &Path) -> Result<(Saved, Duration), Error> {
        let saved = Self::load(path)?;
        let age = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|written| std::time::SystemTime::now().duration_since(written).ok())
            .unwrap_or_default();
        Ok((saved, age))
    }

    fn load(path: &Path) -> Result<Saved, Error> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Saved::default()),
            Err(e) => {
                return Err(Error::InvalidConfig(format!(
                    "cannot read the lighthouse's Raft state {}: {e}; fix its permissions \
                     or point --state-file elsewhere",
                    path.display()
                )))
            }
        };
        let numbers: Result<Vec<u64>, _> = text.split_whitespace().map(str::parse).collect();
        match numbers.as_deref() {
            Ok([term, vote, log @ ..]) => Ok(Saved {
                term: *term,
                vote: *vote,
                log_terms: log.to_vec(),
            }),
            _ => Err(Error::InvalidConfig(format!(
                "the lighthouse's Raft state {} is garbled ({text:?}); remove it only if no \
                 other lighthouse of the set is down, then start again",
                path.display()
            ))),
        }
    }
}

impl VoteStore for FileVotes {
    fn save(&mut self, saved: &Saved) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = self.0.with_extension("raft.tmp");
        let mut file = std::fs::File::create(&tmp)?;
        write!(file, "{} {}", saved.term, saved.vote)?;
        for term in &saved.log_terms {
            write!(file, " {term}")?;
        }
        writeln!(file)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &self.0)
    }
}

/// `phalanx lighthouse --reset-state`: rewrites this member's Raft state to term 0,
/// no vote, an empty log, for a set whose terms went where they should not
/// (docs/lighthouse-set.md). The file stays: a member with a file judges the terms
/// it hears from it, where one without takes the first leader it hears. Refused while any member of the set answers
/// on its address: Raft's safety needs every member reset together, none running.
/// Returns what it did, for the operator.
pub fn reset_state(options: &SetOptions) -> Result<String, Error> {
    options.validate()?;
    for (i, address) in options.peers.iter().enumerate() {
        if answers(address) {
            return Err(Error::InvalidConfig(format!(
                "lighthouse {} at {address} is up: stop every lighthouse of the set \
                 before resetting any (a running member keeps its term and vote, and a \
                 reset one could then vote twice in a term), then reset each and start \
                 them all",
                i + 1
            )));
        }
    }
    let path = &options.state_file;
    let old = FileVotes::load(path)?;
    FileVotes(path.clone())
        .save(&Saved::default())
        .map_err(|e| {
            Error::InvalidConfig(format!(
                "cannot write the lighthouse's Raft state {}: {e}; fix its permissions or \
                 give the --state-file the lighthouse runs with",
                path.display()
            ))
        })?;
    Ok(format!(
        "the Raft state {} of lighthouse {} held term {}, vote {} and {} log entries; it \
         holds term 0 now, no vote, no log. Reset every other member the same way, then \
         start them all: quorum ids go on from the highest the groups report",
        path.display(),
        options.id,
        old.term,
        old.vote,
        old.log_terms.len()
    ))
}

/// Whether something accepts a connection at `address` within a short wait.
fn answers(address: &str) -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(addresses) = address.to_socket_addrs() else {
        return false;
    };
    addresses
        .into_iter()
        .any(|a| TcpStream::connect_timeout(&a, Duration::from_millis(500)).is_ok())
}

/// Sends one Raft message to the lighthouse at `address` as a member of its set would
/// (with `token`, the job's): what a buggy or hostile token holder can send, for the
/// tests (`phalanx._core._testing.send_raft_heartbeat`).
pub async fn send_raft(
    address: &str,
    token: &JobToken,
    message: raft::eraftpb::Message,
) -> Result<(), Error> {
    let (channel, attach) = transport::channel(address, token, Duration::from_secs(2))?;
    let mut client = LighthouseSetClient::with_interceptor(channel, attach);
    let request = proto::RaftEnvelope {
        message: message.write_to_bytes().unwrap_or_default(),
        sent_us: 1,
        echo_us: 0,
        newest: None,
        jobs: Vec::new(),
    };
    tokio::time::timeout(Duration::from_secs(5), client.raft(request))
        .await
        .map_err(|_| {
            Error::Rpc(Status::deadline_exceeded(format!(
                "{address} did not answer a Raft message within 5 s"
            )))
        })??;
    Ok(())
}

/// The largest Raft message a lighthouse of a set takes: one that carries the newest
/// state of as many jobs as a lighthouse remembers, with the longest names.
pub(crate) const MAX_RAFT_BYTES: usize = 64 * 1024 + MAX_NEWEST_KNOWN * 128;

/// This lighthouse's place in the set.
pub(crate) struct Seat {
    options: SetOptions,
    leadership: Mutex<Leadership>,
    wake: Notify,
    outboxes: Vec<Option<mpsc::Sender<Envelope>>>,
    /// When a message to each member last went through (by id - 1).
    reached: Mutex<Vec<Option<Instant>>>,
    /// The term this lighthouse serves in, as last acted on (None: it does not serve).
    pub(crate) serving: watch::Sender<Option<u64>>,
    stopped: std::sync::atomic::AtomicBool,
    /// Each job's newest state that this lighthouse knows of, from its own serving
    /// and from every message of the set: each carries its sender's. A leader's
    /// successor wins the votes of a majority, each of which heard the leader's newest
    /// states on its last message, so it starts serving knowing each job's newest
    /// state as of about one set heartbeat (100 ms) before the change.
    newest: Mutex<NewestByJob>,
    /// Raft messages refused, by reason (the `raft_refused` metric).
    refused: RaftRefusals,
    /// When a refusal was last logged, and how many were not logged since: a flood
    /// of them is counted in full but logged once a second.
    refusal_log: Mutex<(Option<Instant>, u64)>,
}

/// Refusals logged at most this often (each is counted).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

impl Seat {
    pub(crate) fn new(
        options: SetOptions,
        token: &JobToken,
        refused: RaftRefusals,
    ) -> Result<Arc<Seat>, Error> {
        options.validate()?;
        let fresh = !options.state_file.exists();
        let (saved, age) = FileVotes::load_with_age(&options.state_file)?;
        if saved.term > MAX_TERM {
            tracing::error!(
                id = options.id,
                term = saved.term,
                "the Raft state {} holds term {}, above {MAX_TERM}, the highest whose \
                 quorum ids rise with the term: quorum ids stay valid, but rise only by \
                 what the groups report. Stop every lighthouse of the set, run `phalanx \
                 lighthouse --reset-state` with each one's flags, and start them again \
                 (docs/lighthouse-set.md)",
                options.state_file.display(),
                saved.term
            );
        }
        let voters = (1..=options.peers.len() as u64).collect();
        let leadership = Leadership::new(
            options.id,
            voters,
            options.timing,
            saved,
            Box::new(FileVotes(options.state_file.clone())),
            Instant::now(),
        )
        .map_err(Error::InvalidConfig)?
        .with_saved_age(age);
        let leadership = if fresh {
            leadership.starting_fresh()
        } else {
            leadership
        };
        let mut outboxes = Vec::new();
        let mut senders = Vec::new();
        for (i, address) in options.peers.iter().enumerate() {
            if i as u64 + 1 == options.id {
                outboxes.push(None);
                continue;
            }
            let (channel, attach) = transport::channel(address, token, Duration::from_millis(300))?;
            let (tx, rx) = mpsc::channel(256);
            outboxes.push(Some(tx));
            senders.push((
                i,
                LighthouseSetClient::with_interceptor(channel, attach),
                rx,
            ));
        }
        let seat = Arc::new(Seat {
            reached: Mutex::new(vec![None; options.peers.len()]),
            options,
            leadership: Mutex::new(leadership),
            wake: Notify::new(),
            outboxes,
            serving: watch::channel(None).0,
            stopped: Default::default(),
            newest: Mutex::new(NewestByJob::default()),
            refused,
            refusal_log: Mutex::new((None, 0)),
        });
        for (i, client, rx) in senders {
            tokio::spawn(send_loop(Arc::downgrade(&seat), i, client, rx));
        }
        Ok(seat)
    }

    fn newest_known(&self) -> MutexGuard<'_, NewestByJob> {
        self.newest.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn newest(&self, job: &JobName) -> Option<Identity> {
        self.newest_known().get(job)
    }

    pub(crate) fn learn_newest(&self, job: &JobName, identity: Identity) {
        self.newest_known().learn(job, identity, Instant::now());
    }

    /// What a message of this lighthouse says of the jobs' newest states: the default
    /// job's, and the others'.
    fn newest_words(&self) -> (Option<proto::StateIdentity>, Vec<proto::JobNewest>) {
        let known = self.newest_known();
        let mut default = None;
        let mut jobs = Vec::new();
        for (job, identity) in known.all() {
            if job.is_default() {
                default = Some(identity.into());
            } else {
                jobs.push(proto::JobNewest {
                    job: job.as_str().to_string(),
                    newest: Some(identity.into()),
                });
            }
        }
        (default, jobs)
    }

    fn lock(&self) -> MutexGuard<'_, Leadership> {
        self.leadership.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The term this lighthouse serves in at `now`, if it does.
    pub(crate) fn serving_at(&self, now: Instant) -> Option<u64> {
        if self.stopped.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.lock().serving(now)
    }

    pub(crate) fn address_of(&self, id: u64) -> Option<&str> {
        (id as usize)
            .checked_sub(1)
            .and_then(|i| self.options.peers.get(i))
            .map(String::as_str)
    }

    /// The refusal a non-serving lighthouse answers with: UNAVAILABLE (clients try
    /// another lighthouse on it), naming the server in words and in `LEADER_KEY`.
    pub(crate) fn refusal(&self) -> Status {
        let (leader, term) = {
            let l = self.lock();
            (l.leader().filter(|id| *id != self.options.id), l.term())
        };
        let me = format!(
            "lighthouse {} at {}",
            self.options.id,
            self.address_of(self.options.id).unwrap_or("?")
        );
        match leader.and_then(|id| self.address_of(id).map(|a| (id, a.to_string()))) {
            Some((id, address)) => {
                let mut status = Status::unavailable(format!(
                    "{me} does not serve quorums now: lighthouse {id} at {address} does \
                     (term {term}); ask it"
                ));
                if let Ok(value) = MetadataValue::try_from(address.as_str()) {
                    status.metadata_mut().insert(LEADER_KEY, value);
                }
                status
            }
            None => Status::unavailable(format!(
                "{me} does not serve quorums now and knows of no lighthouse that does (an \
                 election is under way, term {term}); ask again shortly"
            )),
        }
    }

    fn dispatch(&self, out: Vec<(u64, Envelope)>) {
        for (to, envelope) in out {
            let outbox = (to as usize)
                .checked_sub(1)
                .and_then(|i| self.outboxes.get(i))
                .and_then(Option::as_ref);
            if let Some(outbox) = outbox {
                // A full queue is a member that does not keep up: Raft sends again.
                let _ = outbox.try_send(envelope);
            }
        }
    }

    /// Takes in a peer's message, and its word on the job's newest state, which came
    /// over a connection from `peer`; a message `Leadership::check` refuses is
    /// counted, logged naming its sender, and answered with the reason.
    fn receive(
        &self,
        envelope: Envelope,
        newest: Vec<(JobName, Identity)>,
        peer: Option<std::net::SocketAddr>,
    ) -> Result<(), Status> {
        // A stopping lighthouse is out of the set at once, though its port lingers
        // for the grace of open calls: the others elect without it.
        if self.stopped.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let now = Instant::now();
        let checked = {
            let l = self.lock();
            l.check(&envelope, now).map_err(|why| (why, l.term()))
        };
        if let Err((why, term)) = checked {
            return Err(self.refuse(&envelope, peer, why, term, now));
        }
        // Before the message: it may make this lighthouse serve, and serving starts
        // from the newest state known.
        for (job, identity) in newest {
            self.learn_newest(&job, identity);
        }
        let out = self.lock().receive(envelope, now);
        self.dispatch(out);
        self.wake.notify_one();
        Ok(())
    }

    fn refuse(
        &self,
        envelope: &Envelope,
        peer: Option<std::net::SocketAddr>,
        why: Refusal,
        term: u64,
        now: Instant,
    ) -> Status {
        self.refused
            .get_or_create(&vec![("reason", why.reason())])
            .inc();
        let m = &envelope.message;
        let peer = peer.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
        let sender = format!(
            "a {:?} said to be from lighthouse {} ({}), sent from {peer}",
            m.get_msg_type(),
            m.from,
            self.address_of(m.from).unwrap_or("not a member")
        );
        let fix = match why {
            Refusal::Term { .. } => {
                "; a lighthouse's token is the job's: find the process at that address. \
                 If the set's terms really are this high, stop every lighthouse and run \
                 `phalanx lighthouse --reset-state` for each (docs/lighthouse-set.md)"
            }
            _ => "; only lighthouses of the set send Raft messages, and never this one",
        };
        let message = format!(
            "lighthouse {} (term {term}) refused {sender}: {why}{fix}",
            self.options.id
        );
        let mut log = self.refusal_log.lock().unwrap_or_else(|e| e.into_inner());
        if log.0.is_none_or(|at| now >= at + REFUSAL_LOG_EVERY) {
            let unlogged = std::mem::take(&mut log.1);
            *log = (Some(now), 0);
            drop(log);
            tracing::warn!(
                from = m.from,
                peer = %peer,
                term = m.term,
                reason = why.reason(),
                unlogged,
                "{message}"
            );
        } else {
            log.1 += 1;
        }
        Status::invalid_argument(message)
    }

    /// What this lighthouse sees of the set, for `/status`.
    pub(crate) fn view(&self) -> serde_json::Value {
        let now = Instant::now();
        let view: View = self.lock().view(now);
        let reached = self
            .reached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let members: Vec<serde_json::Value> = self
            .options
            .peers
            .iter()
            .enumerate()
            .map(|(i, address)| {
                let id = i as u64 + 1;
                let heard_ms = view.heard_ms.get(&id).copied().flatten();
                let reached_ms = reached[i].map(|t| now.saturating_duration_since(t).as_millis());
                serde_json::json!({
                    "id": id,
                    "address": address,
                    "self": id == self.options.id,
                    "leader": id == view.leader,
                    "heard_ms": heard_ms,
                    "reached_ms": reached_ms,
                })
            })
            .collect();
        serde_json::json!({
            "id": view.id,
            "term": view.term,
            "role": view.role,
            "leader": view.leader,
            "leader_address": self.address_of(view.leader),
            "serving": view.serving,
            "lease_left_ms": view.lease_left_ms,
            "members": members,
        })
    }

    /// Ticks Raft until `shutdown`; calls `changed` with the new serving term each
    /// time this lighthouse starts or stops serving.
    pub(crate) async fn run(
        self: Arc<Self>,
        changed: impl Fn(Option<u64>) + Send + 'static,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let now = Instant::now();
            let (out, serving, next) = {
                let mut l = self.lock();
                let out = l.advance(now);
                (out, l.serving(now), l.next_wakeup(now))
            };
            self.dispatch(out);
            if *self.serving.borrow() != serving {
                let view = self.lock().view(now);
                tracing::info!(
                    id = self.options.id,
                    term = view.term,
                    leader = view.leader,
                    "{}",
                    if serving.is_some() {
                        "this lighthouse serves now"
                    } else {
                        "this lighthouse no longer serves"
                    }
                );
                self.serving.send_replace(serving);
                changed(serving);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next.into()) => {}
                _ = self.wake.notified() => {}
                _ = shutdown.changed() => {
                    self.stopped.store(true, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
            }
        }
    }
}

async fn send_loop(
    seat: std::sync::Weak<Seat>,
    index: usize,
    mut client: LighthouseSetClient<Authed>,
    mut outbox: mpsc::Receiver<Envelope>,
) {
    // A member that refuses this one's messages says why; said here too, so that the
    // operator of either side sees it, once a refusal log interval at most.
    let mut warned: Option<Instant> = None;
    while let Some(envelope) = outbox.recv().await {
        let Some((newest, jobs)) = seat.upgrade().map(|seat| seat.newest_words()) else {
            return;
        };
        let request = proto::RaftEnvelope {
            message: envelope.message.write_to_bytes().unwrap_or_default(),
            sent_us: envelope.sent_us,
            echo_us: envelope.echo_us,
            newest,
            jobs,
        };
        let sent = tokio::time::timeout(Duration::from_millis(500), client.raft(request)).await;
        let Some(seat) = seat.upgrade() else { return };
        match sent {
            Ok(Ok(_)) => {
                seat.reached.lock().unwrap_or_else(|e| e.into_inner())[index] =
                    Some(Instant::now());
            }
            Ok(Err(status))
                if status.code() == tonic::Code::InvalidArgument
                    && warned.is_none_or(|at| at.elapsed() >= REFUSAL_LOG_EVERY) =>
            {
                warned = Some(Instant::now());
                tracing::warn!(
                    to = index + 1,
                    "a Raft message of this lighthouse was refused: {}",
                    status.message()
                );
            }
            _ => {}
        }
    }
}

pub(crate) struct SetService {
    pub(crate) seat: Arc<Seat>,
}

#[tonic::async_trait]
impl lighthouse_set_server::LighthouseSet for SetService {
    async fn raft(
        &self,
        request: Request<proto::RaftEnvelope>,
    ) -> Result<Response<proto::RaftReceived>, Status> {
        // The connection's peer, from the door that let it in.
        let peer = request
            .extensions()
            .get::<crate::door::Ticket>()
            .map(|ticket| ticket.peer())
            .or_else(|| request.remote_addr());
        let request = request.into_inner();
        let message = raft::eraftpb::Message::parse_from_bytes(&request.message)
            .map_err(|e| Status::invalid_argument(format!("malformed Raft message: {e}")))?;
        let envelope = Envelope {
            message,
            sent_us: request.sent_us,
            echo_us: request.echo_us,
        };
        let mut newest: Vec<(JobName, Identity)> = Vec::with_capacity(request.jobs.len() + 1);
        if let Some(identity) = request.newest {
            newest.push((JobName::default_job(), identity.into()));
        }
        for word in request.jobs {
            let (Ok(job), Some(identity)) = (JobName::parse(Some(&word.job)), word.newest) else {
                return Err(Status::invalid_argument(format!(
                    "a Raft message names job {:?} without its state, or by a name no job has",
                    word.job
                )));
            };
            newest.push((job, identity.into()));
        }
        // A refused sender's word on the jobs' newest states is not taken either.
        self.seat.receive(envelope, newest, peer)?;
        Ok(Response::new(proto::RaftReceived {}))
    }
}
