//! A group whose lighthouse went silent (a network cut: no reset, no answer) over real
//! loopback sockets. A proxy in front of the lighthouse plays the cut: it refuses new
//! connections while cut and drops every byte of the ones it has, both ways, without
//! closing them; a connection that lived through a cut stays silent for good, as one
//! deep in TCP's retransmission backoff does for seconds after the network is back.
//! The group must not wait on that connection: its quorum request is asked again over
//! a fresh one, and answered soon after the heal.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use phalanx::auth::JobToken;
use phalanx::gate::GateLimits;
use phalanx::lighthouse::{self, LighthouseOptions};
use phalanx::manager::client::ManagerClient;
use phalanx::manager::{self, ManagerOptions};
use phalanx::proto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const JOIN_TIMEOUT: Duration = Duration::from_millis(200);
/// The quorum request's own timeout: far past the cut, so that only an answer ends it.
const QUORUM_TIMEOUT: Duration = Duration::from_secs(10);

/// The cut: `cuts` counts the cuts begun, so a connection knows whether it lived
/// through one; `cut` says whether one is on now.
struct Network {
    address: SocketAddr,
    cuts: Arc<AtomicU64>,
    cut: watch::Sender<bool>,
}

impl Network {
    /// A proxy on a loopback port of its own, forwarding to `target`.
    async fn to(target: SocketAddr) -> Network {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy binds");
        let address = listener.local_addr().expect("proxy address");
        let cuts = Arc::new(AtomicU64::new(0));
        let (cut, mut cut_rx) = watch::channel(false);
        let counted = cuts.clone();
        tokio::spawn(async move {
            let mut listener = Some(listener);
            loop {
                // While cut, nothing listens: a new connection is refused.
                let open = match listener.take() {
                    Some(l) => l,
                    None => TcpListener::bind(address).await.expect("proxy binds again"),
                };
                loop {
                    tokio::select! {
                        accepted = open.accept() => {
                            let Ok((inbound, _)) = accepted else { continue };
                            tokio::spawn(forward(inbound, target, counted.clone()));
                        }
                        _ = cut_rx.wait_for(|c| *c) => break,
                    }
                }
                drop(open);
                if cut_rx.wait_for(|c| !*c).await.is_err() {
                    return;
                }
            }
        });
        Network { address, cuts, cut }
    }

    fn cut(&self) {
        self.cuts.fetch_add(1, SeqCst);
        self.cut.send_replace(true);
    }

    fn heal(&self) {
        self.cut.send_replace(false);
    }
}

async fn forward(inbound: TcpStream, target: SocketAddr, cuts: Arc<AtomicU64>) {
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let born = cuts.load(SeqCst);
    let (from_client, to_client) = inbound.into_split();
    let (from_server, to_server) = outbound.into_split();
    tokio::spawn(pump(from_client, to_server, born, cuts.clone()));
    tokio::spawn(pump(from_server, to_client, born, cuts));
}

/// Copies bytes one way until the connection lives through a cut; from then on every
/// byte is lost and not even a close gets through.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, born: u64, cuts: Arc<AtomicU64>) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = from.read(&mut buffer).await.unwrap_or(0);
        let silent = cuts.load(SeqCst) > born;
        if read == 0 {
            if silent {
                // The other side never hears of it: the write half stays open.
                std::future::pending::<()>().await;
            }
            return;
        }
        if !silent && to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_asked_during_a_cut_is_answered_over_a_fresh_connection_after_the_heal() {
    let lighthouse = lighthouse::serve(LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        min_replicas: 1,
        join_timeout: JOIN_TIMEOUT,
        heartbeat_timeout: Duration::from_millis(500),
        connections: GateLimits::RPC,
        ..LighthouseOptions::default()
    })
    .await
    .expect("lighthouse starts");
    let network = Network::to(lighthouse.local_addr()).await;
    let group = manager::serve(ManagerOptions {
        store_address: "a-store:29500".into(),
        heartbeat_interval: Duration::from_millis(50),
        init_sync: false,
        ..ManagerOptions::new("a", network.address.to_string())
    })
    .await
    .expect("manager server starts");
    let rank = ManagerClient::new(&group.address, &JobToken::default(), Duration::from_secs(1))
        .expect("rank client");
    let ask = |step: i64| {
        let rank = rank.clone();
        tokio::spawn(async move {
            let request = proto::ManagerQuorumRequest {
                group_rank: 0,
                step,
                state_address: "a-rank0:7000".into(),
                ..Default::default()
            };
            rank.quorum(request, QUORUM_TIMEOUT).await
        })
    };
    ask(0).await.expect("task ran").expect("the first quorum");

    network.cut();
    let during = ask(1);
    // Long past the heartbeat timeout: the lighthouse declared the group dead, and
    // the group's stream went silent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!during.is_finished(), "answered during the cut");
    network.heal();
    let healed = Instant::now();
    let answer = tokio::time::timeout(QUORUM_TIMEOUT, during)
        .await
        .expect("the quorum call's own deadline bounds this wait")
        .expect("task ran");
    let waited = healed.elapsed();
    let quorum = answer.unwrap_or_else(|e| {
        panic!("the quorum asked during the cut failed {waited:?} after the heal: {e}")
    });
    assert_eq!(quorum.participants.len(), 1, "{quorum:?}");
    assert_eq!(quorum.participants[0].step, 1, "{quorum:?}");
    // Asked again within the retry backoff of the heal, answered at once (the group
    // is the whole quorum): well within a join timeout and a margin.
    assert!(
        waited < JOIN_TIMEOUT + Duration::from_secs(1),
        "answered {waited:?} after the heal"
    );
    println!("{{\"heal_to_answer_s\": {:.3}}}", waited.as_secs_f64());
}
