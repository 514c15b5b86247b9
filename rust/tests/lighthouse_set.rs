//! A set of three lighthouses over loopback: one serves, the others refuse naming it,
//! a client given the list finds it, and when it stops another serves with higher
//! quorum ids. Every wait is bounded.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use phalanx::auth::JobToken;
use phalanx::lighthouse::client::LighthouseClient;
use phalanx::lighthouse::jobs::JobRequest;
use phalanx::lighthouse::leadership::{Timing, IDS_PER_TERM};
use phalanx::lighthouse::set::SetOptions;
use phalanx::lighthouse::{self, LighthouseOptions};
use phalanx::proto;
use phalanx::proto::LEADER_KEY;
use phalanx::server::ServerHandle;
use phalanx::Error;
use tonic::Code;

const PATIENCE: Duration = Duration::from_secs(10);

fn free_addresses(n: usize) -> Vec<String> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect()
}

async fn start_set(dir: &std::path::Path) -> (Vec<Option<ServerHandle>>, Vec<String>) {
    let peers = free_addresses(3);
    let mut handles = Vec::new();
    for (i, address) in peers.iter().enumerate() {
        let options = LighthouseOptions {
            bind: address.clone(),
            join_timeout: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_millis(500),
            ..LighthouseOptions::default()
        };
        let set = SetOptions {
            id: i as u64 + 1,
            peers: peers.clone(),
            state_file: dir.join(format!("{i}.raft")),
            timing: Timing::default(),
        };
        handles.push(Some(
            lighthouse::serve_in_set(options, Some(set))
                .await
                .expect("a lighthouse of the set starts"),
        ));
    }
    (handles, peers)
}

fn member(id: &str) -> proto::Member {
    proto::Member {
        replica_id: id.into(),
        manager_address: format!("{id}-manager:1"),
        store_address: "127.0.0.1:2".into(),
        world_size: 1,
        state_addresses: vec![format!("{id}-state:1")],
        ..Default::default()
    }
}

/// Asks each lighthouse alone until one issues a quorum; returns its index.
async fn find_server(peers: &[String], skip: Option<usize>) -> (usize, proto::Quorum) {
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        for (i, address) in peers.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            let client =
                LighthouseClient::new(address, &JobToken::default(), Duration::from_secs(1))
                    .unwrap();
            if let Ok(q) = client
                .quorum(member("probe"), 0, Duration::from_secs(2))
                .await
            {
                return (i, q);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no lighthouse of {peers:?} served within {PATIENCE:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_serves_the_others_name_it_and_a_successor_issues_higher_ids() {
    let dir = std::env::temp_dir().join(format!("phalanx-set-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut handles, peers) = start_set(&dir).await;
    let (leader, first) = find_server(&peers, None).await;

    // Another refuses, naming the server in words and in the metadata.
    let other = (leader + 1) % 3;
    let client =
        LighthouseClient::new(&peers[other], &JobToken::default(), Duration::from_secs(1)).unwrap();
    match client
        .quorum(member("probe"), 0, Duration::from_secs(1))
        .await
    {
        Err(Error::Rpc(status)) => {
            assert_eq!(status.code(), Code::Unavailable);
            assert!(status.message().contains(&peers[leader]), "{status:?}");
            let named = status.metadata().get(LEADER_KEY).unwrap().to_str().unwrap();
            assert_eq!(named, peers[leader]);
        }
        other => panic!("a non-serving lighthouse answered {other:?}"),
    }

    // A client with the whole list, starting at a non-server, is sent on to it.
    let mut list = peers.clone();
    list.rotate_left(other);
    let listed = LighthouseClient::new(
        &list.join(","),
        &JobToken::default(),
        Duration::from_secs(1),
    )
    .unwrap();
    let quorum = listed
        .quorum_patiently(member("probe"), first.quorum_id, PATIENCE)
        .await
        .expect("a quorum through the list");
    assert_eq!(listed.address(), peers[leader]);
    assert!(quorum.quorum_id >= first.quorum_id);
    // A named job on the same set has quorums of its own.
    let job_a = JobRequest::parse(Some("a"), None).unwrap();
    let of_a = LighthouseClient::for_job(
        &list.join(","),
        &JobToken::default(),
        &job_a,
        Duration::from_secs(1),
    )
    .unwrap();
    let a_first = of_a
        .quorum_patiently(member("a1"), 0, PATIENCE)
        .await
        .expect("a quorum of job a");
    assert_eq!(
        a_first.participants.len(),
        1,
        "job a's quorum holds job a's group only"
    );

    // The server stops; another takes over, with ids above the old term's.
    let stopped_at = Instant::now();
    handles[leader].take().unwrap().shutdown().await;
    let quorum = listed
        .quorum_patiently(member("probe"), quorum.quorum_id, PATIENCE)
        .await
        .expect("a quorum from the successor");
    assert_ne!(listed.address(), peers[leader]);
    assert!(
        quorum.quorum_id > first.quorum_id,
        "{quorum:?} after {first:?}"
    );
    // A later term's floor (`quorum_id_floor`): above every id of the earlier term.
    assert!(quorum.quorum_id / IDS_PER_TERM > first.quorum_id / IDS_PER_TERM);
    // And so for every job: job a's ids rise across the change of leader too.
    let a_next = of_a
        .quorum_patiently(member("a1"), a_first.quorum_id, PATIENCE)
        .await
        .expect("a quorum of job a from the successor");
    assert!(a_next.quorum_id / IDS_PER_TERM > a_first.quorum_id / IDS_PER_TERM);
    assert!(stopped_at.elapsed() < PATIENCE);
    for handle in handles.into_iter().flatten() {
        handle.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}
