//! Load for the lighthouse benchmarks (`benches/`): many replica groups at once,
//! driven from Rust so that what is measured is the lighthouse, not the driver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use tokio::sync::{mpsc, Barrier};

use crate::auth::JobToken;
use crate::client::LighthouseClient;
use crate::proto::{self, PROTOCOL_VERSION};
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

/// The id alone: the driver skips decoding the members, as each group would on its
/// own machine, so that its CPU stays off the measurement.
#[derive(Clone, PartialEq, prost::Message)]
struct QuorumId {
    #[prost(uint64, tag = "1")]
    quorum_id: u64,
}

async fn ask(client: &LighthouseClient, id: String, timeout: Duration) -> Result<u64, Error> {
    let encoded = client.quorum_encoded(member(id), 0, timeout).await?;
    QuorumId::decode(encoded)
        .map(|q| q.quorum_id)
        .map_err(|e| Error::InvalidConfig(format!("malformed quorum: {e}")))
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
        last_quorum_id: 0,
        step: 0,
        seq: 0,
        manager_address: String::new(),
        refused: Vec::new(),
        ..Default::default()
    }
}

/// `replicas` groups, each with its own connection, ask for `rounds` quorums in
/// lock-step. With `change_every` > 0, one extra group joins on every such round and
/// leaves (its heartbeat stream dropped, as on a crash) on the one after.
pub async fn quorum_rounds(
    address: &str,
    token: &JobToken,
    replicas: usize,
    rounds: usize,
    change_every: usize,
    timeout: Duration,
) -> Result<Vec<RoundTiming>, Error> {
    let clients: Vec<LighthouseClient> = (0..=replicas)
        .map(|_| LighthouseClient::new(address, token, timeout))
        .collect::<Result<_, _>>()?;
    let mut timings = Vec::with_capacity(rounds);
    let mut extra_in = false;
    let mut extra_stream = None;
    // Round 0 connects everybody and forms the first quorum; it is not reported.
    for round in 0..=rounds {
        let change = change_every > 0 && round > 0 && round % change_every == 0;
        if change {
            extra_in = !extra_in;
            if extra_in {
                let (tx, rx) = mpsc::channel(4);
                tx.send(beat("extra")).await.ok();
                let stream = clients[replicas].heartbeat(rx, timeout).await?;
                extra_stream = Some((tx, stream));
            } else {
                extra_stream = None;
            }
            // Let the lighthouse see the stream open or break before the round starts.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let groups = replicas + usize::from(extra_in);
        // A newcomer asks first: the others' round must find it waiting to be let in.
        let newcomer_first = change && extra_in;
        let barrier = Arc::new(Barrier::new(groups - usize::from(newcomer_first)));
        let mut tasks = Vec::with_capacity(groups);
        for (g, client) in clients.iter().take(groups).enumerate().rev() {
            let client = client.clone();
            let barrier = barrier.clone();
            let is_extra = g == replicas;
            let id = if is_extra {
                "extra".to_string()
            } else {
                format!("group-{g:05}")
            };
            if is_extra && newcomer_first {
                tasks.push(tokio::spawn(async move {
                    let quorum_id = ask(&client, id, timeout).await?;
                    Ok::<_, Error>((None, Instant::now(), quorum_id))
                }));
                wait_until_joined(&clients[0], "extra", timeout).await?;
                continue;
            }
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let sent = Instant::now();
                let quorum_id = ask(&client, id, timeout).await?;
                Ok::<_, Error>((Some(sent), Instant::now(), quorum_id))
            }));
        }
        let mut last_sent = None::<Instant>;
        let mut last_answer = None::<Instant>;
        let mut quorum_id = 0;
        for task in tasks {
            let (sent, answered, id) = task
                .await
                .map_err(|e| Error::InvalidConfig(format!("load task failed: {e}")))??;
            last_sent = last_sent.max(sent);
            last_answer = last_answer.max(Some(answered));
            quorum_id = id;
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
    drop(extra_stream);
    Ok(timings)
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

/// Keeps `replicas` heartbeat streams open, each beating `hz` times a second, over
/// `connections` connections, for `duration`. Returns the beats sent.
pub async fn heartbeats(
    address: &str,
    token: &JobToken,
    replicas: usize,
    hz: f64,
    connections: usize,
    duration: Duration,
) -> Result<u64, Error> {
    let connections = connections.clamp(1, replicas.max(1));
    let period = Duration::from_secs_f64(1.0 / hz.max(0.001));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let client = LighthouseClient::new(address, token, Duration::from_secs(10))?;
        let ids: Vec<String> = (c..replicas)
            .step_by(connections)
            .map(|g| format!("beat-{g:06}"))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut streams = Vec::with_capacity(ids.len());
            for id in &ids {
                let (tx, rx) = mpsc::channel(2);
                tx.send(beat(id)).await.ok();
                let events = client.heartbeat(rx, Duration::from_secs(10)).await?;
                streams.push((tx, events));
            }
            let deadline = Instant::now() + duration;
            let mut ticker = tokio::time::interval(period);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut sent = 0u64;
            while Instant::now() < deadline {
                ticker.tick().await;
                for (tx, _) in &streams {
                    if tx.try_send(beat("")).is_ok() {
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
