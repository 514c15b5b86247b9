//! State transfer over real loopback sockets: striping over several sources, a source
//! that dies mid-heal, damaged chunks, refusals (I8), withdraw semantics, and a
//! silent source that must not hang a heal (I6).
//!
//! Buffers are declared before the servers that lend them, so they outlive them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use phalanx::auth::JobToken;
use phalanx::gate::GateLimits;
use phalanx::state::{
    fetch_manifest, fetch_state, Corruption, DestRegion, FetchOptions, FetchStats, ServerOptions,
    SourceRegion, StateServer,
};
use phalanx::{Error, ErrorKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const STEP: i64 = 42;
const QUORUM: u64 = 7;
const MIB: usize = 1 << 20;

/// Position-dependent bytes: a chunk that lands in the wrong place shows.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn state(sizes: &[usize]) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i as u32))
        .collect()
}

async fn serve(regions: &[Vec<u8>], options: ServerOptions) -> StateServer {
    let server = StateServer::bind(ServerOptions {
        bind: "127.0.0.1:0".into(),
        ..options
    })
    .await
    .expect("state server starts");
    // SAFETY: the buffers outlive the server (declared before it in every test).
    let lent = regions
        .iter()
        .map(|r| unsafe { SourceRegion::new(r.as_ptr() as usize, r.len()) })
        .collect();
    server
        .publish(STEP, QUORUM, b"the manifest".to_vec(), lent)
        .unwrap();
    server
}

fn zeroed_like(regions: &[Vec<u8>]) -> Vec<Vec<u8>> {
    regions.iter().map(|r| vec![0u8; r.len()]).collect()
}

fn dest_of(buffers: &mut [Vec<u8>]) -> Vec<DestRegion> {
    // SAFETY: each test awaits the fetch to its end before it reads the buffers.
    buffers
        .iter_mut()
        .map(|b| unsafe { DestRegion::new(b.as_mut_ptr() as usize, b.len()) })
        .collect()
}

fn addresses(servers: &[StateServer]) -> Vec<String> {
    servers.iter().map(|s| s.address().to_string()).collect()
}

fn options() -> FetchOptions {
    FetchOptions {
        timeout: Duration::from_secs(10),
        chunk_bytes: MIB as u64,
        stall_timeout: Duration::from_secs(2),
        ..FetchOptions::default()
    }
}

async fn fetch(
    sources: &[String],
    buffers: &mut [Vec<u8>],
    options: FetchOptions,
) -> Result<FetchStats, Error> {
    fetch_state(
        sources,
        STEP,
        QUORUM,
        dest_of(buffers),
        options,
        std::future::pending(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_byte_arrives_striped_over_all_sources() {
    let source = state(&[0, 1, 4097, 3 * MIB, 10 * MIB + 5, 12345]);
    // Paced, so that no source can take every chunk before the others connect.
    let paced = || ServerOptions {
        max_bytes_per_s: Some(50e6),
        ..ServerOptions::default()
    };
    let servers = vec![
        serve(&source, paced()).await,
        serve(&source, paced()).await,
        serve(&source, paced()).await,
    ];
    let mut healed = zeroed_like(&source);
    let stats = fetch(&addresses(&servers), &mut healed, options())
        .await
        .unwrap();
    assert!(healed == source, "healed bytes differ from the source");
    let total: usize = source.iter().map(Vec::len).sum();
    assert_eq!(stats.bytes, total as u64);
    assert_eq!(stats.refetches, 0);
    assert_eq!(
        stats.chunks,
        1 + 1 + 3 + 11 + 1,
        "the empty region has no chunk"
    );
    let per_source: Vec<u64> = stats.per_source.iter().map(|(_, b)| *b).collect();
    assert_eq!(
        per_source.iter().sum::<u64>(),
        total as u64,
        "a byte counted twice"
    );
    assert!(
        per_source.iter().all(|&b| b > 0),
        "a source was idle: {per_source:?}"
    );
    let served: u64 = servers.iter().map(StateServer::served_bytes).sum();
    assert_eq!(served, total as u64, "a chunk was sent twice");
    for server in &servers {
        server.shutdown().await.unwrap();
    }
}

/// A healing link asks the kernel to wake it only once a whole piece has arrived;
/// an answer whose last bytes are fewer must still wake it, at once, not after the
/// stall timeout (each chunk here ends a few bytes past a piece, and the window has
/// grown past one segment by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_few_bytes_of_every_answer_wake_the_healing_link() {
    let source = state(&[24 * MIB + 5, 7]);
    let server = serve(&source, ServerOptions::default()).await;
    let mut healed = zeroed_like(&source);
    let stall = Duration::from_secs(1);
    let started = Instant::now();
    let stats = fetch(
        &[server.address().to_string()],
        &mut healed,
        FetchOptions {
            connections_per_source: 1,
            chunk_bytes: 3 * MIB as u64 + 3,
            stall_timeout: stall,
            ..options()
        },
    )
    .await
    .expect("the heal completes");
    assert!(healed == source, "healed bytes differ from the source");
    assert_eq!((stats.refetches, stats.chunks), (0, 9));
    assert!(
        started.elapsed() < stall,
        "the heal waited {:?}: a read slept through an answer's last bytes",
        started.elapsed()
    );
    server.shutdown().await.unwrap();
}

/// A source that sends all along but fills a piece more slowly than the stall
/// timeout (here paced to 1 MB/s against 400 ms) is not taken for failed: the link
/// gives up waiting for whole pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_slower_than_a_piece_per_stall_timeout_is_not_taken_for_failed() {
    let source = state(&[2 * MIB + 9]);
    let server = serve(
        &source,
        ServerOptions {
            max_bytes_per_s: Some(1e6),
            ..ServerOptions::default()
        },
    )
    .await;
    let mut healed = zeroed_like(&source);
    let stats = fetch(
        &[server.address().to_string()],
        &mut healed,
        FetchOptions {
            connections_per_source: 1,
            chunk_bytes: 2 * MIB as u64 + 9,
            stall_timeout: Duration::from_millis(400),
            ..options()
        },
    )
    .await
    .expect("the heal completes");
    assert!(healed == source, "healed bytes differ from the source");
    assert_eq!(stats.refetches, 0);
    server.shutdown().await.unwrap();
}

/// A loopback relay to `upstream`, and a flag it raises once `upstream` has answered
/// through it: the event that tells a test a fetch has asked.
async fn relay(upstream: String) -> (String, watch::Receiver<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay binds");
    let address = listener.local_addr().expect("relay address").to_string();
    let (answered, flag) = watch::channel(false);
    let answered = Arc::new(answered);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                continue;
            };
            let answered = answered.clone();
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let up = async {
                    tokio::io::copy(&mut from_client, &mut to_server).await?;
                    to_server.shutdown().await
                };
                let down = async {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = from_server.read(&mut buf).await?;
                        if n == 0 {
                            return to_client.shutdown().await;
                        }
                        to_client.write_all(&buf[..n]).await?;
                        answered.send_replace(true);
                    }
                };
                let _: (std::io::Result<()>, std::io::Result<()>) = tokio::join!(up, down);
            });
        }
    });
    (address, flag)
}

/// Waits until `server` has sent its first chunk bytes: a heal is under way.
async fn sending(server: &StateServer) {
    let started = Instant::now();
    while server.served_bytes() == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "no bytes sent");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dies_mid_heal_is_replaced_by_the_others() {
    let source = state(&[8 * MIB, 8 * MIB, 8 * MIB]);
    // 24 MiB at 20 MB/s per source: long enough to kill one of three mid-way.
    let paced = || ServerOptions {
        max_bytes_per_s: Some(20e6),
        ..ServerOptions::default()
    };
    let servers = vec![
        serve(&source, paced()).await,
        serve(&source, paced()).await,
        serve(&source, paced()).await,
    ];
    let sources = addresses(&servers);
    let mut healed = zeroed_like(&source);
    let (stats, ()) = tokio::join!(fetch(&sources, &mut healed, options()), async {
        sending(&servers[1]).await;
        // A dying process: its sockets close with its sends half done.
        servers[1].shutdown().await.unwrap();
    });
    let stats = stats.unwrap();
    assert!(healed == source, "healed bytes differ from the source");
    assert_eq!(stats.failed_sources.len(), 1, "{stats:?}");
    assert_eq!(stats.failed_sources[0].0, sources[1]);
    let dead = stats.per_source[1].1;
    assert!(dead > 0 && dead < (8 * MIB) as u64, "{stats:?}");
    assert!(
        stats.refetches >= 1,
        "the dead source's chunks were fetched again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_chunk_is_caught_and_fetched_again() {
    let source = state(&[3 * MIB + 17, 100]);
    let server = serve(&source, ServerOptions::default()).await;
    server.damage_next_chunks(Corruption {
        chunks: 3,
        byte: 777_777,
    });
    let mut healed = zeroed_like(&source);
    let stats = fetch(&[server.address().to_string()], &mut healed, options())
        .await
        .unwrap();
    assert!(healed == source, "a damaged byte got through");
    assert_eq!(stats.refetches, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_on_every_try_fails_the_heal_with_the_cause() {
    let source = state(&[1000]);
    let server = serve(&source, ServerOptions::default()).await;
    server.damage_next_chunks(Corruption {
        chunks: u64::MAX,
        byte: 0,
    });
    let mut healed = zeroed_like(&source);
    let err = fetch(&[server.address().to_string()], &mut healed, options())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection);
    assert!(err.message().contains("arrived damaged 5 times"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_token_or_for_another_quorum_are_refused() {
    let source = state(&[4096]);
    let server = serve(
        &source,
        ServerOptions {
            token: JobToken::new(Some("s3cret".into())),
            ..ServerOptions::default()
        },
    )
    .await;
    let sources = vec![server.address().to_string()];
    let mut healed = zeroed_like(&source);

    let err = fetch(&sources, &mut healed, options()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permission, "{err}");
    assert!(err.message().contains("job token"), "{err}");
    let err = fetch_manifest(
        &sources,
        STEP,
        QUORUM,
        &JobToken::new(Some("guess".into())),
        Duration::from_secs(2),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permission, "{err}");

    let token = JobToken::new(Some("s3cret".into()));
    let with_token = || FetchOptions {
        token: token.clone(),
        ..options()
    };
    // An older quorum, or the same quorum at a later step: refused at once.
    for (step, quorum) in [(STEP, QUORUM - 1), (STEP - 1, QUORUM)] {
        let started = Instant::now();
        let err = fetch_state(
            &sources,
            step,
            quorum,
            dest_of(&mut healed),
            with_token(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Permission, "{err}");
        assert!(
            err.message().contains("serves step 42 of quorum 7"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    // A step the source has not reached: waited for, up to the deadline.
    let started = Instant::now();
    let err = fetch_state(
        &sources,
        STEP + 1,
        QUORUM,
        dest_of(&mut healed),
        FetchOptions {
            timeout: Duration::from_millis(500),
            ..with_token()
        },
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        err.message().contains("still serves step 42 of quorum 7"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        healed.iter().all(|r| r.iter().all(|&b| b == 0)),
        "a refused fetch wrote bytes"
    );

    let manifest = fetch_manifest(&sources, STEP, QUORUM, &token, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(manifest, b"the manifest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_waits_for_a_source_to_publish() {
    let source = state(&[2 * MIB]);
    let server = StateServer::bind(ServerOptions {
        bind: "127.0.0.1:0".into(),
        ..ServerOptions::default()
    })
    .await
    .unwrap();
    let (through, mut answered) = relay(server.address().to_string()).await;
    let sources = vec![through];
    let mut healed = zeroed_like(&source);
    let (stats, ()) = tokio::join!(fetch(&sources, &mut healed, options()), async {
        // Published only once the server has told the fetch that nothing is yet.
        let told = answered.wait_for(|&answered| answered);
        tokio::time::timeout(Duration::from_secs(10), told)
            .await
            .expect("the fetch asked within 10 s")
            .expect("relay running");
        // SAFETY: `source` outlives `server`.
        let lent = vec![unsafe { SourceRegion::new(source[0].as_ptr() as usize, source[0].len()) }];
        server.publish(STEP, QUORUM, vec![], lent).unwrap();
    });
    stats.unwrap();
    assert!(healed == source);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdraw_lets_sends_finish_then_cuts_them() {
    let source = state(&[8 * MIB]);
    let server = serve(
        &source,
        ServerOptions {
            max_bytes_per_s: Some(4e6),
            ..ServerOptions::default()
        },
    )
    .await;
    assert_eq!(server.serving(), Some((STEP, QUORUM)));
    let sources = vec![server.address().to_string()];
    let mut healed = zeroed_like(&source);
    let (fetched, withdrawn) = tokio::join!(fetch(&sources, &mut healed, options()), async {
        sending(&server).await;
        let started = Instant::now();
        let cut = server.withdraw(Duration::from_millis(100)).await;
        (cut, started.elapsed())
    });
    let (cut, took) = withdrawn;
    assert!(
        cut.unwrap() >= 1,
        "a paced send of 1 MiB was still in flight"
    );
    assert!(took < Duration::from_millis(1500), "withdraw took {took:?}");
    assert_eq!(server.serving(), None);
    let err = fetched.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    // Nothing in flight: a withdraw returns at once.
    let lent = vec![unsafe { SourceRegion::new(source[0].as_ptr() as usize, 16) }];
    server.publish(STEP + 1, QUORUM, vec![], lent).unwrap();
    assert_eq!(server.withdraw(Duration::from_secs(5)).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_over_an_open_window_is_refused() {
    let source = state(&[16]);
    let server = serve(&source, ServerOptions::default()).await;
    let err = server
        .publish(STEP + 1, QUORUM, vec![], vec![])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.message().contains("withdraw() it before"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_source_cannot_hang_a_heal() {
    // Accepts connections and never answers, like a hung process.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_address = silent.local_addr().unwrap().to_string();
    let source = state(&[MIB]);
    let good = serve(&source, ServerOptions::default()).await;
    let stalling = FetchOptions {
        stall_timeout: Duration::from_millis(300),
        timeout: Duration::from_secs(3),
        ..options()
    };

    let mut healed = zeroed_like(&source);
    let started = Instant::now();
    let err = fetch(
        std::slice::from_ref(&silent_address),
        &mut healed,
        stalling.clone(),
    )
    .await
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(err.message().contains("sent nothing for"), "{err}");

    let both = vec![silent_address.clone(), good.address().to_string()];
    let stats = fetch(&both, &mut healed, stalling).await.unwrap();
    assert!(healed == source);
    assert_eq!(stats.per_source[0].1, 0);
    let manifest = fetch_manifest(
        &both,
        STEP,
        QUORUM,
        &JobToken::default(),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    assert_eq!(manifest, b"the manifest");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_of_another_shape_is_refused_before_any_byte_moves() {
    let source = state(&[1000, 2000]);
    let server = serve(&source, ServerOptions::default()).await;
    let mut healed = vec![vec![0u8; 1000], vec![0u8; 2001]];
    let err = fetch(&[server.address().to_string()], &mut healed, options())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.message().contains("region 1 has 2000 bytes"), "{err}");
    assert!(healed.iter().all(|r| r.iter().all(|&b| b == 0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_completes_beside_a_flood_of_idle_connections_and_refusals_are_counted() {
    let source = state(&[3 * MIB, 12345]);
    let token = JobToken::new(Some("s3cret".into()));
    let limits = GateLimits {
        max_connections: 64,
        max_unproven: 16,
        prove_within: Duration::from_secs(30),
        idle: Duration::from_secs(30),
    };
    let server = serve(
        &source,
        ServerOptions {
            token: token.clone(),
            connections: limits,
            ..ServerOptions::default()
        },
    )
    .await;
    let mut flood = Vec::new();
    for _ in 0..300 {
        flood.push(
            tokio::net::TcpStream::connect(server.local_addr())
                .await
                .expect("connect"),
        );
    }

    let sources = addresses(std::slice::from_ref(&server));
    let wrong = FetchOptions {
        token: JobToken::new(Some("guess".into())),
        ..options()
    };
    let mut healed = zeroed_like(&source);
    let refused = fetch(&sources, &mut healed, wrong).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Permission, "{refused}");
    let honest = FetchOptions { token, ..options() };
    fetch(&sources, &mut healed, honest)
        .await
        .expect("heals beside the flood");
    assert_eq!(healed, source);

    let count = |reason| {
        server
            .refusals()
            .snapshot()
            .into_iter()
            .find(|(r, _)| *r == reason)
            .map(|(_, n)| n)
    };
    assert!(count("token") >= Some(1), "{:?}", count("token"));
    assert!(
        count("crowded_out") >= Some(300 - 16),
        "{:?}",
        count("crowded_out")
    );
    drop(flood);
}
