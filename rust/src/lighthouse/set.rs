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

use super::leadership::{Envelope, Leadership, Saved, Timing, View, VoteStore};
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
    /// The job's newest state that this lighthouse knows of, from its own serving and
    /// from every message of the set: each carries its sender's. A leader's successor
    /// wins the votes of a majority, each of which heard the leader's newest state on
    /// its last message, so it starts serving knowing the job's newest state as of
    /// about one set heartbeat (100 ms) before the change.
    newest: Mutex<Option<Identity>>,
}

impl Seat {
    pub(crate) fn new(options: SetOptions, token: &JobToken) -> Result<Arc<Seat>, Error> {
        options.validate()?;
        let saved = FileVotes::load(&options.state_file)?;
        let voters = (1..=options.peers.len() as u64).collect();
        let leadership = Leadership::new(
            options.id,
            voters,
            options.timing,
            saved,
            Box::new(FileVotes(options.state_file.clone())),
            Instant::now(),
        )
        .map_err(Error::InvalidConfig)?;
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
            newest: Mutex::new(None),
        });
        for (i, client, rx) in senders {
            tokio::spawn(send_loop(Arc::downgrade(&seat), i, client, rx));
        }
        Ok(seat)
    }

    pub(crate) fn newest(&self) -> Option<Identity> {
        *self.newest.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn learn_newest(&self, identity: Identity) {
        let mut newest = self.newest.lock().unwrap_or_else(|e| e.into_inner());
        if newest.is_none_or(|n| identity > n) {
            *newest = Some(identity);
        }
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

    fn receive(&self, envelope: Envelope) {
        // A stopping lighthouse is out of the set at once, though its port lingers
        // for the grace of open calls: the others elect without it.
        if self.stopped.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let out = self.lock().receive(envelope, Instant::now());
        self.dispatch(out);
        self.wake.notify_one();
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
    while let Some(envelope) = outbox.recv().await {
        let Some(newest) = seat.upgrade().map(|seat| seat.newest()) else {
            return;
        };
        let request = proto::RaftEnvelope {
            message: envelope.message.write_to_bytes().unwrap_or_default(),
            sent_us: envelope.sent_us,
            echo_us: envelope.echo_us,
            newest: newest.map(Into::into),
        };
        let sent = tokio::time::timeout(Duration::from_millis(500), client.raft(request)).await;
        let Some(seat) = seat.upgrade() else { return };
        if matches!(sent, Ok(Ok(_))) {
            seat.reached.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(Instant::now());
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
        let request = request.into_inner();
        let message = raft::eraftpb::Message::parse_from_bytes(&request.message)
            .map_err(|e| Status::invalid_argument(format!("malformed Raft message: {e}")))?;
        if let Some(newest) = request.newest {
            self.seat.learn_newest(newest.into());
        }
        self.seat.receive(Envelope {
            message,
            sent_us: request.sent_us,
            echo_us: request.echo_us,
        });
        Ok(Response::new(proto::RaftReceived {}))
    }
}
