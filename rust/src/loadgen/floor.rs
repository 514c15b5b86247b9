//! The floor under the lighthouse's benchmarks: what the same rounds and the same
//! broadcast of a loss cost on this machine with nothing behind the connections but
//! TCP. A server that knows no quorum, no job, no token: each of N connections sends
//! one small message, and once all N have, every one of them gets one back (a
//! round); or one connection drops, and every other gets one message (a loss told).
//! Any lighthouse, however it is built, moves at least these bytes through at least
//! these sockets, so its round over the floor's says what it adds; the floor's own
//! growth with N says what no lighthouse on this machine can avoid.
//!
//! The server runs in a process of its own, as a lighthouse does (`serve`); the
//! groups' side runs in the benchmark's (`rounds`, `losses_told`).

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Barrier, Semaphore};

/// Every message, both ways: about the size of a steady round's ask and answer.
const MESSAGE: usize = 64;
/// Connections opened at once by the groups' side.
const OPENING_AT_ONCE: usize = 64;

/// What a connection is for, said in its first message (its first byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Asks for rounds: each message is an ask, answered once all have asked.
    Rounds = 1,
    /// Waits to be told of losses.
    Survivor = 2,
    /// Is dropped: its end is the loss.
    Victim = 3,
}

/// One message: the role, the round it asks for and how many groups ask in it.
fn message(role: Role, round: u64, groups: u64) -> [u8; MESSAGE] {
    let mut m = [0u8; MESSAGE];
    m[0] = role as u8;
    m[8..16].copy_from_slice(&round.to_le_bytes());
    m[16..24].copy_from_slice(&groups.to_le_bytes());
    m
}

fn parse(m: &[u8; MESSAGE]) -> io::Result<(Role, u64, u64)> {
    let role = match m[0] {
        1 => Role::Rounds,
        2 => Role::Survivor,
        3 => Role::Victim,
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no role {other}"),
            ))
        }
    };
    let word = |at: usize| u64::from_le_bytes(m[at..at + 8].try_into().expect("8 bytes"));
    Ok((role, word(8), word(16)))
}

/// The server's state: asks counted per round, and the last round and loss.
struct Floor {
    asked: Mutex<HashMap<u64, u64>>,
    completed: watch::Sender<u64>,
    losses: watch::Sender<u64>,
}

impl Floor {
    /// Counts one ask for `round` of `groups`; the last one completes the round.
    fn ask(&self, round: u64, groups: u64) {
        let mut asked = self.asked.lock().expect("no panic holds it");
        let count = asked.entry(round).or_default();
        *count += 1;
        if *count >= groups {
            asked.remove(&round);
            self.completed
                .send_modify(|last| *last = (*last).max(round));
        }
    }
}

/// Serves the floor's connections on `listener` until the process ends.
pub async fn serve(listener: TcpListener) -> io::Result<()> {
    let floor = Arc::new(Floor {
        asked: Mutex::default(),
        completed: watch::channel(0).0,
        losses: watch::channel(0).0,
    });
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let floor = floor.clone();
        // A connection's end or error concerns it alone.
        tokio::spawn(async move { connection(stream, &floor).await });
    }
}

async fn connection(mut stream: TcpStream, floor: &Floor) -> io::Result<()> {
    let mut m = [0u8; MESSAGE];
    stream.read_exact(&mut m).await?;
    match parse(&m)?.0 {
        Role::Rounds => {
            let mut completed = floor.completed.subscribe();
            loop {
                let (_, round, groups) = parse(&m)?;
                floor.ask(round, groups);
                completed
                    .wait_for(|&last| last >= round)
                    .await
                    .map_err(io::Error::other)?;
                stream.write_all(&m).await?;
                stream.read_exact(&mut m).await?;
            }
        }
        Role::Survivor => {
            // Subscribed before it says it is ready: no loss after that is missed.
            let mut losses = floor.losses.subscribe();
            losses.mark_unchanged();
            stream.write_all(&m).await?;
            let mut byte = [0u8; 1];
            loop {
                tokio::select! {
                    changed = losses.changed() => {
                        changed.map_err(io::Error::other)?;
                        stream.write_all(&m).await?;
                    }
                    read = stream.read(&mut byte) => if read? == 0 { return Ok(()) },
                }
            }
        }
        Role::Victim => {
            stream.write_all(&m).await?;
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
            floor.losses.send_modify(|n| *n += 1);
            Ok(())
        }
    }
}

/// `count` connections to `address`, each announced as `role` (and, unless it asks
/// for rounds, answered once the server has it).
async fn open(address: &str, count: usize, role: Role) -> io::Result<Vec<TcpStream>> {
    if let Some(warning) = crate::fdlimit::ensure(count, "the floor's connections") {
        return Err(io::Error::other(warning));
    }
    let opening = Arc::new(Semaphore::new(OPENING_AT_ONCE));
    let tasks: Vec<_> = (0..count)
        .map(|_| {
            let (address, opening) = (address.to_string(), opening.clone());
            tokio::spawn(async move {
                let _opening = opening.acquire().await;
                let mut stream = TcpStream::connect(address).await?;
                stream.set_nodelay(true)?;
                if role != Role::Rounds {
                    stream.write_all(&message(role, 0, 0)).await?;
                    stream.read_exact(&mut [0u8; MESSAGE]).await?;
                }
                Ok::<_, io::Error>(stream)
            })
        })
        .collect();
    let mut streams = Vec::with_capacity(count);
    for task in tasks {
        streams.push(task.await.map_err(io::Error::other)??);
    }
    Ok(streams)
}

fn late(what: &str, timeout: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} did not end within {timeout:?}"),
    )
}

/// `groups` connections to the floor at `address` ask for `rounds` rounds in
/// lock-step, as `loadgen::quorum_rounds` does of a lighthouse; returns each round's
/// time from the last ask sent to the last answer read. Round 0 is not reported.
/// Rounds are numbered from 1: a server serves the rounds of one call.
pub async fn rounds(
    address: &str,
    groups: usize,
    rounds: usize,
    timeout: Duration,
) -> io::Result<Vec<Duration>> {
    let mut streams = open(address, groups, Role::Rounds).await?;
    let mut timings = Vec::with_capacity(rounds);
    for round in 0..=rounds as u64 {
        let barrier = Arc::new(Barrier::new(streams.len()));
        let tasks: Vec<_> = streams
            .drain(..)
            .map(|mut stream| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    let sent = Instant::now();
                    let ask = message(Role::Rounds, round + 1, groups as u64);
                    stream.write_all(&ask).await?;
                    stream.read_exact(&mut [0u8; MESSAGE]).await?;
                    Ok::<_, io::Error>((stream, sent, Instant::now()))
                })
            })
            .collect();
        let (mut last_sent, mut last_answer) = (None::<Instant>, None::<Instant>);
        let answered = tokio::time::timeout(timeout, async {
            for task in tasks {
                let (stream, sent, answer) = task.await.map_err(io::Error::other)??;
                last_sent = last_sent.max(Some(sent));
                last_answer = last_answer.max(Some(answer));
                streams.push(stream);
            }
            Ok::<_, io::Error>(())
        });
        answered.await.map_err(|_| late("a round", timeout))??;
        if round > 0 {
            timings.push(
                last_answer
                    .zip(last_sent)
                    .map_or(Duration::ZERO, |(a, s)| a.saturating_duration_since(s)),
            );
        }
    }
    Ok(timings)
}

/// `groups` connections to the floor at `address` wait, and for each of `trials` one
/// more connects and is dropped, as `loadgen::crash_told` does at a lighthouse;
/// returns, per trial, the time from the drop until every one of them was told.
pub async fn losses_told(
    address: &str,
    groups: usize,
    trials: usize,
    timeout: Duration,
) -> io::Result<Vec<Duration>> {
    let mut survivors = open(address, groups, Role::Survivor).await?;
    let mut told = Vec::with_capacity(trials);
    for _ in 0..trials {
        let victim = open(address, 1, Role::Victim).await?;
        let dropped = Instant::now();
        drop(victim);
        let tasks: Vec<_> = survivors
            .drain(..)
            .map(|mut stream| {
                tokio::spawn(async move {
                    stream.read_exact(&mut [0u8; MESSAGE]).await?;
                    Ok::<_, io::Error>((stream, Instant::now()))
                })
            })
            .collect();
        let mut last = dropped;
        let heard = tokio::time::timeout(timeout, async {
            for task in tasks {
                let (stream, at) = task.await.map_err(io::Error::other)??;
                last = last.max(at);
                survivors.push(stream);
            }
            Ok::<_, io::Error>(())
        });
        heard.await.map_err(|_| late("a loss told", timeout))??;
        told.push(last - dropped);
    }
    Ok(told)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn server() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(serve(listener));
        address
    }

    #[tokio::test]
    async fn a_round_ends_when_every_group_has_asked() {
        let address = server().await;
        let timings = rounds(&address, 5, 4, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(timings.len(), 4);
        // One group short of the count, a round is not answered; the second ask ends it.
        let address = server().await;
        let ask = message(Role::Rounds, 1, 2);
        let mut first = TcpStream::connect(&address).await.unwrap();
        first.write_all(&ask).await.unwrap();
        let mut answer = [0u8; MESSAGE];
        let early = tokio::time::timeout(Duration::from_millis(100), first.read_exact(&mut answer));
        assert!(
            early.await.is_err(),
            "answered before the second group asked"
        );
        let mut second = TcpStream::connect(&address).await.unwrap();
        second.write_all(&ask).await.unwrap();
        for stream in [&mut first, &mut second] {
            stream.read_exact(&mut answer).await.unwrap();
            assert_eq!(answer, ask);
        }
    }

    #[tokio::test]
    async fn every_survivor_is_told_of_each_loss() {
        let address = server().await;
        let told = losses_told(&address, 6, 3, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(told.len(), 3);
    }

    #[test]
    fn a_message_reads_back_as_written_and_an_unknown_role_is_refused() {
        let m = message(Role::Victim, 7, 9);
        assert_eq!(parse(&m).unwrap(), (Role::Victim, 7, 9));
        let mut bad = m;
        bad[0] = 9;
        assert!(parse(&bad).is_err());
    }
}
