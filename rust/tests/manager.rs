//! Manager servers over real loopback sockets, each with a real lighthouse: gathering
//! a group's ranks into one quorum request, the commit vote (I2), healing plans,
//! a lighthouse that is down, and the relay of membership-loss events.
//!
//! Every wait is bounded and the timeouts are short, so the file runs in seconds (I6).

use std::future::Future;
use std::time::{Duration, Instant};

use phalanx::auth::JobToken;
use phalanx::lighthouse::{self, LighthouseOptions};
use phalanx::manager::client::ManagerClient;
use phalanx::manager::{self, ManagerHandle, ManagerOptions};
use phalanx::proto;
use phalanx::server::ServerHandle;
use phalanx::{Error, ErrorKind};
use tokio::task::JoinHandle;
use tonic::Code;

/// Upper bound for any single wait in these tests; far above what a pass needs.
const PATIENCE: Duration = Duration::from_secs(5);
/// The timeout ranks give their calls when they expect an answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// A lighthouse on `bind` with short timeouts, so that quorums form quickly.
fn lighthouse_options(bind: String, min_replicas: usize) -> LighthouseOptions {
    LighthouseOptions {
        bind,
        min_replicas,
        join_timeout: Duration::from_millis(200),
        heartbeat_timeout: Duration::from_millis(500),
        ..LighthouseOptions::default()
    }
}

async fn start_lighthouse(min_replicas: usize) -> ServerHandle {
    lighthouse::serve(lighthouse_options("127.0.0.1:0".into(), min_replicas))
        .await
        .expect("lighthouse starts")
}

async fn start_manager(
    replica_id: &str,
    lighthouse_address: &str,
    world_size: u32,
) -> ManagerHandle {
    manager::serve(ManagerOptions {
        store_address: format!("{replica_id}-store:29500"),
        world_size,
        heartbeat_interval: Duration::from_millis(50),
        connect_timeout: Duration::from_millis(500),
        init_sync: false,
        ..ManagerOptions::new(replica_id, lighthouse_address)
    })
    .await
    .expect("manager server starts")
}

/// Group "g" of `world_size` ranks alone under a lighthouse of its own: the lighthouse,
/// the group's manager server and a rank's client of it.
async fn one_group(world_size: u32) -> (ServerHandle, ManagerHandle, ManagerClient) {
    let lighthouse = start_lighthouse(1).await;
    let group = start_manager("g", &lighthouse.local_addr().to_string(), world_size).await;
    let client = rank_client(&group);
    (lighthouse, group, client)
}

fn rank_client(manager: &ManagerHandle) -> ManagerClient {
    ManagerClient::new(
        &manager.address,
        &JobToken::default(),
        Duration::from_secs(1),
    )
    .expect("manager client")
}

/// Where rank `rank` of group `group` serves its state (never dialled in these tests).
fn state_address(group: &str, rank: u32) -> String {
    format!("{group}-rank{rank}:7000")
}

type Answer<T> = JoinHandle<Result<T, Error>>;

/// One rank asking for the quorum of `step`, in a task of its own as in a real group.
fn ask(
    client: &ManagerClient,
    group: &str,
    rank: u32,
    step: i64,
) -> Answer<proto::ManagerQuorumResponse> {
    let client = client.clone();
    let state = state_address(group, rank);
    tokio::spawn(async move {
        client
            .quorum(rank_request(rank, step, state), CALL_TIMEOUT)
            .await
    })
}

fn rank_request(group_rank: u32, step: i64, state_address: String) -> proto::ManagerQuorumRequest {
    proto::ManagerQuorumRequest {
        group_rank,
        step,
        state_address,
        ..Default::default()
    }
}

fn vote(
    client: &ManagerClient,
    rank: u32,
    step: i64,
    yes: bool,
    timeout: Duration,
) -> Answer<bool> {
    let client = client.clone();
    let ballot = proto::ShouldCommitRequest {
        group_rank: rank,
        step,
        vote: yes,
        ..Default::default()
    };
    tokio::spawn(async move {
        let decision = client.should_commit(ballot, timeout).await?;
        Ok(decision.commit)
    })
}

/// Both ranks of a group of two vote on `step` at once (`votes[r]` is rank r's); the
/// decision each is told.
async fn both_vote(
    client: &ManagerClient,
    step: i64,
    votes: [bool; 2],
    timeout: Duration,
) -> [bool; 2] {
    let tasks = [
        vote(client, 0, step, votes[0], timeout),
        vote(client, 1, step, votes[1], timeout),
    ];
    let mut decisions = [false; 2];
    for (decision, task) in decisions.iter_mut().zip(tasks) {
        *decision = answer("a vote", task).await.expect("vote");
    }
    decisions
}

async fn bounded<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {limit:?}"))
}

async fn answer<T>(what: &str, task: Answer<T>) -> Result<T, Error> {
    bounded(what, PATIENCE, task).await.expect("task ran")
}

/// Waits until the manager server has gathered exactly `ranks` for `step`.
async fn asked(group: &ManagerHandle, step: i64, ranks: &[u32]) {
    let gathered = async {
        while group.local.asking() != Some((step, ranks.to_vec())) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    bounded("the gathered ranks", PATIENCE, gathered).await
}

fn rpc_status(result: Result<impl std::fmt::Debug, Error>) -> tonic::Status {
    match result {
        Err(Error::Rpc(status)) => status,
        other => panic!("expected a status from the server, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ranks_of_a_group_get_their_plan_from_one_quorum() {
    let (_lighthouse, group, c) = one_group(2).await;

    let r0 = ask(&c, "g", 0, 4);
    let r1 = ask(&c, "g", 1, 4);
    let p0 = answer("rank 0", r0).await.expect("rank 0 plan");
    let p1 = answer("rank 1", r1).await.expect("rank 1 plan");

    assert!(p0.quorum_id > 0);
    assert_eq!(p0.quorum_id, p1.quorum_id, "one quorum for the whole group");
    for (rank, plan) in [(0, &p0), (1, &p1)] {
        assert_eq!(plan.replica_rank, 0, "the only group is replica 0");
        assert_eq!(plan.replica_world_size, 1);
        assert_eq!(plan.max_step, 4);
        assert!(!plan.heal, "nobody is ahead of the only group");
        assert!(plan.recovery_sources.is_empty());
        assert_eq!(plan.store_address, "g-store:29500");
        assert_eq!(
            plan.store_prefix,
            format!("phalanx/q{}/r{rank}", plan.quorum_id)
        );
    }
    // The lighthouse got one member for the group, carrying every rank's state address.
    let me = &p0.participants[..];
    assert_eq!(me.len(), 1);
    assert_eq!(me[0].replica_id, "g");
    assert_eq!(me[0].manager_address, group.address);
    assert_eq!(me[0].world_size, 2);
    assert_eq!(me[0].step, 4);
    assert_eq!(
        me[0].state_addresses,
        [state_address("g", 0), state_address("g", 1)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_disagree_on_the_step_are_all_refused_with_both_steps_named() {
    let (_lighthouse, group, c) = one_group(2).await;

    let early = ask(&c, "g", 0, 5);
    // Rank 0's request arrives first, so it is the one waiting when rank 1 disagrees.
    asked(&group, 5, &[0]).await;
    let late = ask(&c, "g", 1, 6);
    for (who, task) in [("rank 0", early), ("rank 1", late)] {
        let status = rpc_status(answer(who, task).await);
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{who}: {}",
            status.message()
        );
        let message = status.message();
        assert!(
            message.contains("rank 0 at step 5") && message.contains("rank 1 at step 6"),
            "{who}: the refusal names both: {message}"
        );
    }

    // Nothing is left half-gathered: the next attempt with agreeing steps goes through.
    let r0 = ask(&c, "g", 0, 6);
    let r1 = ask(&c, "g", 1, 6);
    assert_eq!(answer("rank 0", r0).await.expect("plan").max_step, 6);
    assert_eq!(answer("rank 1", r1).await.expect("plan").max_step, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_commits_only_when_every_rank_votes_yes() {
    let (_lighthouse, _group, c) = one_group(2).await;
    let timeout = Duration::from_secs(2);
    for rank in [ask(&c, "g", 0, 1), ask(&c, "g", 1, 1)] {
        answer("quorum", rank).await.expect("plan");
    }

    assert_eq!(
        both_vote(&c, 1, [true, true], timeout).await,
        [true, true],
        "all yes commits"
    );
    assert_eq!(
        both_vote(&c, 2, [true, false], timeout).await,
        [false, false],
        "one no aborts for every rank"
    );

    // Rank 1 never votes on step 3: rank 0 gets "no" at its timeout instead of hanging.
    let short = Duration::from_millis(200);
    let asked = Instant::now();
    let alone = answer("missing rank", vote(&c, 0, 3, true, short))
        .await
        .expect("vote");
    let waited = asked.elapsed();
    eprintln!("a lone vote answered after {waited:?}");
    assert!(!alone, "a missing vote is a no");
    assert!(
        waited >= short && waited < short + Duration::from_millis(500),
        "answered after {waited:?}, expected about {short:?}"
    );
    // A rank that votes after the decision gets the same decision, not a new ballot.
    let straggler = answer("late vote", vote(&c, 1, 3, true, short))
        .await
        .expect("vote");
    assert!(
        !straggler,
        "the late rank must not commit a step the group aborted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_behind_heals_from_the_same_rank_of_the_up_to_date_group() {
    let lighthouse = start_lighthouse(2).await;
    let address = lighthouse.local_addr().to_string();
    let ahead = start_manager("ahead", &address, 2).await;
    let behind = start_manager("behind", &address, 2).await;
    let (ca, cb) = (rank_client(&ahead), rank_client(&behind));

    let tasks = [
        ask(&ca, "ahead", 0, 10),
        ask(&ca, "ahead", 1, 10),
        ask(&cb, "behind", 0, 3),
        ask(&cb, "behind", 1, 3),
    ];
    let mut plans = Vec::new();
    for task in tasks {
        plans.push(answer("plan", task).await.expect("plan"));
    }
    let id = plans[0].quorum_id;
    assert!(plans.iter().all(|p| p.quorum_id == id && p.max_step == 10));
    assert!(plans.iter().all(|p| p.replica_world_size == 2));
    assert!(
        plans.iter().all(|p| p.store_address == "ahead-store:29500"),
        "the first participant's store hosts the group"
    );

    for (rank, plan) in [(0u32, &plans[0]), (1, &plans[1])] {
        assert_eq!(plan.replica_rank, 0, "\"ahead\" sorts first");
        assert!(!plan.heal, "ahead rank {rank} is up to date");
        assert!(plan.recovery_sources.is_empty());
    }
    for (rank, plan) in [(0u32, &plans[2]), (1, &plans[3])] {
        assert_eq!(plan.replica_rank, 1);
        assert!(plan.heal, "behind rank {rank} is at step 3 of 10");
        let sources: Vec<(&str, &str)> = plan
            .recovery_sources
            .iter()
            .map(|s| (s.replica_id.as_str(), s.state_address.as_str()))
            .collect();
        assert_eq!(
            sources,
            [("ahead", state_address("ahead", rank).as_str())],
            "rank {rank} heals from rank {rank} of the up-to-date group"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_lighthouse_down_a_step_waits_for_it_and_uses_it_once_it_is_back() {
    // A port that was free a moment ago: nothing listens there.
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let nowhere = free.local_addr().expect("address").to_string();
    drop(free);
    let group = start_manager("g", &nowhere, 1).await;
    let c = rank_client(&group);

    // Down for the whole timeout: a connection error naming the lighthouse, at the
    // timeout (not at once: the step waits, asking again with backoff).
    let started = Instant::now();
    let timeout = Duration::from_secs(1);
    let result = bounded(
        "quorum",
        timeout * 3,
        c.quorum(rank_request(0, 0, state_address("g", 0)), timeout),
    )
    .await;
    let waited = started.elapsed();
    let err = result.expect_err("no lighthouse, no quorum");
    eprintln!("quorum without a lighthouse failed after {waited:?}: {err}");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(
        err.message().contains(&nowhere),
        "the error names the lighthouse: {err}"
    );
    assert!(
        waited >= timeout / 2 && waited < timeout * 2,
        "failed after {waited:?}, expected about the {timeout:?} timeout"
    );

    // Back on its address while a step waits: used within the retry backoff. A
    // group of two, so that the step is seen to wait: rank 1 is gathered, and once
    // rank 0 is in too the gathering is handed to the lighthouse call.
    let later = start_manager("later", &nowhere, 2).await;
    let cl = rank_client(&later);
    let second = ask(&cl, "later", 1, 0);
    asked(&later, 0, &[1]).await;
    let waiting = ask(&cl, "later", 0, 0);
    bounded("the step asks the lighthouse", PATIENCE, async {
        while later.local.asking().is_some() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    let back = Instant::now();
    let _lighthouse = lighthouse::serve(lighthouse_options(nowhere.clone(), 1))
        .await
        .expect("lighthouse starts on the old address");
    let plan = answer("quorum", waiting)
        .await
        .expect("a quorum once it is back");
    let took = back.elapsed();
    eprintln!(
        "quorum {} after the lighthouse came back: {took:?}",
        plan.quorum_id
    );
    let other = answer("quorum", second).await.expect("rank 1's plan");
    assert_eq!(other.quorum_id, plan.quorum_id, "one quorum for the group");
    // Its first quorum waits out the join timeout (it hears of no earlier quorum,
    // but may be a restart) plus at most one retry backoff.
    assert!(took < Duration::from_millis(1500), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_group_is_reported_to_the_ranks_of_the_others_within_a_second() {
    let lighthouse = start_lighthouse(2).await;
    let address = lighthouse.local_addr().to_string();
    let stays = start_manager("stays", &address, 1).await;
    let stops = start_manager("stops", &address, 1).await;
    let (cs, cx) = (rank_client(&stays), rank_client(&stops));
    let plans = [ask(&cs, "stays", 0, 0), ask(&cx, "stops", 0, 0)];
    let mut id = 0;
    for task in plans {
        id = answer("first quorum", task).await.expect("plan").quorum_id;
    }
    let mut events = bounded("subscribe", PATIENCE, cs.events(CALL_TIMEOUT))
        .await
        .expect("events stream");

    let stopped = Instant::now();
    // Stopping the server ends its heartbeat stream with a beat that says it leaves.
    let shutdown = tokio::spawn(stops.server.shutdown());
    let event = bounded("membership-loss relay", PATIENCE, events.message())
        .await
        .expect("events stream healthy")
        .expect("events stream open");
    let after = stopped.elapsed();
    eprintln!("membership loss relayed after {after:?}");
    let lost = event.membership_lost.expect("a membership loss");
    assert_eq!(lost.lost, ["stops"]);
    assert_eq!(lost.quorum_id, id);
    assert_eq!(
        lost.cause, "left",
        "a server stopped in order says its group left: no crash, no hang"
    );
    assert!(after < Duration::from_secs(1), "relayed after {after:?}");
    bounded("shutdown", PATIENCE, shutdown)
        .await
        .expect("shutdown task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_manager_server_ends_its_event_streams_at_once() {
    let lighthouse = start_lighthouse(1).await;
    let group = start_manager("g", &lighthouse.local_addr().to_string(), 1).await;
    let mut events = bounded(
        "subscribe",
        PATIENCE,
        rank_client(&group).events(CALL_TIMEOUT),
    )
    .await
    .expect("events stream");

    let stopping = Instant::now();
    bounded("shutdown", PATIENCE, group.server.shutdown()).await;
    let end = bounded("events stream ends", PATIENCE, events.message()).await;
    let took = stopping.elapsed();
    eprintln!("events stream ended {took:?} after the shutdown began");
    assert!(!matches!(end, Ok(Some(_))), "got {end:?}");
    assert!(
        took < Duration::from_millis(500),
        "a listening rank learnt after {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_reattaches_to_a_restarted_lighthouse_and_quorum_ids_keep_rising() {
    let first = start_lighthouse(1).await;
    let addr = first.local_addr();
    let group = start_manager("g", &addr.to_string(), 1).await;
    let c = rank_client(&group);
    let before = answer("quorum", ask(&c, "g", 0, 0))
        .await
        .expect("plan")
        .quorum_id;

    first.shutdown().await;
    let second = lighthouse::serve(lighthouse_options(addr.to_string(), 1))
        .await
        .expect("a new lighthouse binds the same port");

    // Without any quorum request, the group's heartbeat finds the new lighthouse.
    let watcher = phalanx::lighthouse::client::LighthouseClient::new(
        &addr.to_string(),
        &JobToken::default(),
        Duration::from_secs(1),
    )
    .expect("client");
    bounded("heartbeat re-opened", Duration::from_secs(2), async {
        loop {
            let status = watcher.status(CALL_TIMEOUT).await.expect("status");
            if status
                .replicas
                .iter()
                .any(|r| r.replica_id == "g" && r.connected)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    let after = answer("quorum", ask(&c, "g", 0, 1))
        .await
        .expect("plan")
        .quorum_id;
    assert!(
        after > before,
        "quorum id {after} after the restart, {before} before (I3)"
    );
    second.shutdown().await;
}

/// The step counts committed steps, so after a "no" the group retries the same step
/// number (DESIGN.md §2). The remembered decision of the failed attempt must not
/// answer the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_retried_after_an_aborted_commit_can_commit() {
    let (_lighthouse, _group, c) = one_group(2).await;
    let timeout = Duration::from_secs(1);

    assert_eq!(
        both_vote(&c, 7, [true, false], timeout).await,
        [false, false]
    );
    // The retry goes through a new quorum, as every step does.
    let (r0, r1) = (ask(&c, "g", 0, 7), ask(&c, "g", 1, 7));
    answer("rank 0", r0).await.expect("plan");
    answer("rank 1", r1).await.expect("plan");
    assert_eq!(
        both_vote(&c, 7, [true, true], timeout).await,
        [true, true],
        "every rank voted yes on the retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_lost_its_lease_does_not_commit_though_every_rank_votes_yes() {
    let (lighthouse, _group, c) = one_group(1).await;
    answer("quorum", ask(&c, "g", 0, 0)).await.expect("plan");
    assert!(answer("vote", vote(&c, 0, 0, true, CALL_TIMEOUT))
        .await
        .expect("vote"));

    // Without the lighthouse nobody vouches that the group still counts in the
    // quorum: its peers may have gone on without it, so once the group knows its
    // stream (and with it the lease) ended, it must not commit. (Until it knows, a
    // lease it still holds may commit: nobody formed a quorum without it meanwhile.)
    let mut events = bounded("subscribe", PATIENCE, c.events(CALL_TIMEOUT))
        .await
        .expect("events stream");
    lighthouse.shutdown().await;
    let event = bounded("lease lost", PATIENCE, events.message())
        .await
        .expect("events stream healthy")
        .expect("events stream open");
    let lost = event.membership_lost.expect("a membership loss");
    assert_eq!(lost.cause, "lighthouse_lost");
    let voted = Instant::now();
    let short = Duration::from_millis(700);
    let committed = answer("vote", vote(&c, 0, 1, true, short))
        .await
        .expect("vote");
    assert!(!committed, "a group without a lease committed");
    assert!(voted.elapsed() < short + Duration::from_millis(500));
}
