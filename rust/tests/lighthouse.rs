//! The lighthouse over real loopback sockets: quorums, crash and hang detection,
//! restart without state (I3), the job token (I8), and refusal of bad input.
//!
//! Every test starts its own lighthouse on 127.0.0.1 port 0 with short timeouts, and
//! every wait is bounded, so a regression fails fast instead of hanging (I6).

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use phalanx::auth::JobToken;
use phalanx::gate::GateLimits;
use phalanx::lighthouse::client::LighthouseClient;
use phalanx::lighthouse::{self, JobLimits, LighthouseOptions};
use phalanx::proto::{self, PROTOCOL_VERSION};
use phalanx::server::ServerHandle;
use phalanx::{Error, ErrorKind};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

const JOIN_TIMEOUT: Duration = Duration::from_millis(200);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);
const BEAT_EVERY: Duration = Duration::from_millis(50);
/// Upper bound for any single wait in these tests; far above what a pass needs.
const PATIENCE: Duration = Duration::from_secs(5);
/// What a call may take from these tests' point of view (the server's own long poll).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

fn options(min_replicas: usize) -> LighthouseOptions {
    LighthouseOptions {
        bind: "127.0.0.1:0".into(),
        min_replicas,
        join_timeout: JOIN_TIMEOUT,
        heartbeat_timeout: HEARTBEAT_TIMEOUT,
        rollback_after: Duration::from_secs(30),
        token: JobToken::default(),
        connections: GateLimits::RPC,
        insecure: false,
        jobs: JobLimits::DEFAULT,
        datagrams: true,
    }
}

async fn start(min_replicas: usize) -> (ServerHandle, SocketAddr) {
    let handle = lighthouse::serve(options(min_replicas))
        .await
        .expect("lighthouse starts");
    let addr = handle.local_addr();
    (handle, addr)
}

fn client(addr: SocketAddr) -> LighthouseClient {
    client_with_token(addr, &JobToken::default())
}

fn client_with_token(addr: SocketAddr, token: &JobToken) -> LighthouseClient {
    LighthouseClient::new(&addr.to_string(), token, Duration::from_secs(1)).expect("client")
}

/// A single-rank replica group as it asks the lighthouse for a quorum.
fn member(id: &str, step: i64) -> proto::Member {
    proto::Member {
        replica_id: id.into(),
        manager_address: format!("{id}-manager:29512"),
        store_address: "127.0.0.1:29500".into(),
        step,
        world_size: 1,
        state_addresses: vec![format!("{id}-state:1")],
        ..Default::default()
    }
}

fn beat(id: &str) -> proto::Beat {
    proto::Beat {
        protocol_version: PROTOCOL_VERSION,
        replica_id: id.into(),
        ..Default::default()
    }
}

/// Fails the test with `what` if `fut` does not finish within `limit`.
async fn bounded<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within {limit:?}"))
}

/// Asks for a quorum in a task of its own, as a replica group's manager would.
fn ask(
    client: &LighthouseClient,
    member: proto::Member,
    last_quorum_id: u64,
) -> JoinHandle<Result<proto::Quorum, Error>> {
    let client = client.clone();
    tokio::spawn(async move { client.quorum(member, last_quorum_id, CALL_TIMEOUT).await })
}

async fn answers(tasks: Vec<JoinHandle<Result<proto::Quorum, Error>>>) -> Vec<proto::Quorum> {
    let mut quorums = Vec::new();
    for task in tasks {
        let quorum = bounded("quorum request", PATIENCE, task)
            .await
            .expect("quorum task")
            .expect("quorum issued");
        quorums.push(quorum);
    }
    quorums
}

/// Every group of `names` asks at `step` at once, over one client; their quorums, in
/// the order of `names`.
async fn every_asks(
    client: &LighthouseClient,
    names: &[impl AsRef<str>],
    step: i64,
    last_quorum_id: u64,
) -> Vec<proto::Quorum> {
    let asking = names
        .iter()
        .map(|n| ask(client, member(n.as_ref(), step), last_quorum_id))
        .collect();
    answers(asking).await
}

fn ids(quorum: &proto::Quorum) -> Vec<&str> {
    quorum
        .participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect()
}

/// An open heartbeat stream: the sender that feeds its beats and the events coming back.
struct Heartbeat {
    beats: mpsc::Sender<proto::Beat>,
    events: phalanx::lighthouse::wire::BeatEvents,
}

async fn open_heartbeat(client: &LighthouseClient, id: &str) -> Result<Heartbeat, Error> {
    let (beats, rx) = mpsc::channel(8);
    // The server reads the first beat before it answers the call: queue it up front.
    beats.try_send(beat(id)).expect("room for the first beat");
    let events = bounded(
        "open heartbeat",
        PATIENCE,
        client.heartbeat(rx, CALL_TIMEOUT),
    )
    .await?;
    Ok(Heartbeat { beats, events })
}

/// Beats every `BEAT_EVERY` until aborted; aborting it drops the sender, ending the stream.
fn keep_beating(beats: mpsc::Sender<proto::Beat>, id: &str) -> JoinHandle<()> {
    let id = id.to_string();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(BEAT_EVERY);
        loop {
            ticker.tick().await;
            if beats.send(beat(&id)).await.is_err() {
                return;
            }
        }
    })
}

/// A group that stays alive: heartbeat stream open and beating.
struct LiveGroup {
    beating: JoinHandle<()>,
    events: phalanx::lighthouse::wire::BeatEvents,
    client: LighthouseClient,
}

async fn live_group(addr: SocketAddr, id: &str) -> LiveGroup {
    let client = client(addr);
    let hb = open_heartbeat(&client, id)
        .await
        .expect("heartbeat stream opens");
    LiveGroup {
        beating: keep_beating(hb.beats, id),
        events: hb.events,
        client,
    }
}

async fn next_membership_lost(
    events: &mut phalanx::lighthouse::wire::BeatEvents,
    within: Duration,
) -> proto::MembershipLost {
    let event = bounded("membership-loss event", within, next_event(events))
        .await
        .expect("event stream healthy")
        .expect("event stream still open");
    match event {
        proto::lighthouse_event::Event::MembershipLost(lost) => lost,
        other => panic!("expected a membership loss, got {other:?}"),
    }
}

/// The next event other than the leases that acknowledge the group's beats.
async fn next_event(
    events: &mut phalanx::lighthouse::wire::BeatEvents,
) -> Result<Option<proto::lighthouse_event::Event>, tonic::Status> {
    loop {
        match events.message().await? {
            None => return Ok(None),
            Some(proto::LighthouseEvent {
                event: Some(proto::lighthouse_event::Event::Lease(_)),
            }) => continue,
            Some(event) => return Ok(event.event),
        }
    }
}

async fn status_rpc(client: &LighthouseClient) -> proto::StatusResponse {
    client.status(CALL_TIMEOUT).await.expect("status RPC")
}

fn known(status: &proto::StatusResponse, id: &str) -> bool {
    status.replicas.iter().any(|r| r.replica_id == id)
}

/// Whether group `id` is known and its heartbeat stream open.
fn connected(status: &proto::StatusResponse, id: &str) -> bool {
    status
        .replicas
        .iter()
        .any(|r| r.replica_id == id && r.connected)
}

/// One HTTP/1.1 GET over a plain TCP stream: (status code, body).
async fn http_get(addr: SocketAddr, path: &str, authorization: Option<&str>) -> (u16, String) {
    bounded("HTTP GET", PATIENCE, async {
        let mut stream = TcpStream::connect(addr).await.expect("connect for HTTP");
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        if let Some(value) = authorization {
            request.push_str(&format!("Authorization: {value}\r\n"));
        }
        request.push_str("\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("send HTTP request");
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .expect("read HTTP response");
        let raw = String::from_utf8(raw).expect("UTF-8 response");
        let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP head and body");
        let code = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status code in {head:?}"));
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_string()
        };
        (code, body)
    })
    .await
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
    out
}

async fn status_json(addr: SocketAddr) -> serde_json::Value {
    let (code, body) = http_get(addr, "/status", None).await;
    assert_eq!(code, 200, "GET /status: {body}");
    serde_json::from_str(&body).expect("/status is JSON")
}

fn json_knows(status: &serde_json::Value, id: &str) -> bool {
    status["replicas"]
        .as_array()
        .expect("replicas array")
        .iter()
        .any(|r| r["replica_id"] == id)
}

/// Polls `check` every 10 ms until it holds; fails the test after `within`.
async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    bounded(what, within, async {
        while !check().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

fn rpc_code(result: Result<impl std::fmt::Debug, Error>) -> (Code, String) {
    match result {
        Err(Error::Rpc(status)) => (status.code(), status.message().to_string()),
        other => panic!("expected a status from the server, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_groups_get_the_same_sorted_quorum_and_keep_its_id_next_round() {
    let (_lighthouse, addr) = start(3).await;
    let client = client(addr);
    // Asked in an order that is not the replica-id order, to see the sorting.
    let names = ["group-c", "group-a", "group-b"];

    let first = every_asks(&client, &names, 0, 0).await;
    let id = first[0].quorum_id;
    assert!(id > 0, "quorum ids start above 0");
    for q in &first {
        assert_eq!(q.quorum_id, id, "every group sees the same quorum id");
        assert_eq!(
            ids(q),
            ["group-a", "group-b", "group-c"],
            "members sorted by replica id"
        );
    }
    assert_eq!(first[0].participants, first[1].participants);
    assert_eq!(first[1].participants, first[2].participants);

    // Same members, no commit failures: the quorum is unchanged, so is its id.
    let second = every_asks(&client, &names, 1, id).await;
    for q in &second {
        assert_eq!(q.quorum_id, id, "an unchanged membership keeps its id");
        assert_eq!(ids(q), ["group-a", "group-b", "group-c"]);
        assert!(q.participants.iter().all(|m| m.step == 1));
    }
}

/// Most joins of a round leave a member late and skip the engine: the wait must still
/// name who is missing now, and the last member to ask must end it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_names_its_late_members_while_it_waits_and_ends_when_the_last_one_asks() {
    // Long, so that a loaded machine's slow requests stay well under it; a quorum
    // issued only at the timeout still fails the last assertion.
    let join_timeout = Duration::from_secs(10);
    let lighthouse = lighthouse::serve(LighthouseOptions {
        join_timeout,
        ..options(12)
    })
    .await
    .expect("lighthouse starts");
    let client = client(lighthouse.local_addr());
    let names: Vec<String> = (0..12).map(|i| format!("group-{i:02}")).collect();
    let first = every_asks(&client, &names, 0, 0).await;
    let id = first[0].quorum_id;

    let (late, early): (Vec<&String>, Vec<&String>) = names
        .iter()
        .partition(|n| ["group-03", "group-10"].contains(&n.as_str()));
    let started = Instant::now();
    let mut waiting: Vec<_> = early
        .iter()
        .map(|n| ask(&client, member(n, 1), id))
        .collect();
    eventually("ten requests waiting", PATIENCE, || async {
        let status = status_rpc(&client).await;
        status.replicas.iter().filter(|r| r.joined).count() == early.len()
    })
    .await;
    assert_eq!(
        status_rpc(&client).await.waiting_for,
        "waiting up to the join timeout for live members of the previous quorum: \
         group-03, group-10"
    );
    waiting.extend(late.iter().map(|n| ask(&client, member(n, 1), id)));
    for quorum in answers(waiting).await {
        assert_eq!(quorum.quorum_id, id);
        assert_eq!(quorum.participants.len(), names.len());
    }
    assert!(
        started.elapsed() < join_timeout,
        "the last member's request must issue the quorum, not the join timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_group_is_evicted_and_its_peers_are_told_within_half_a_second() {
    let (_lighthouse, addr) = start(3).await;
    let mut a = live_group(addr, "a").await;
    let mut b = live_group(addr, "b").await;
    let c = live_group(addr, "c").await;
    let quorum = answers(vec![
        ask(&a.client, member("a", 0), 0),
        ask(&b.client, member("b", 0), 0),
        ask(&c.client, member("c", 0), 0),
    ])
    .await;
    let id = quorum[0].quorum_id;
    assert!(json_knows(&status_json(addr).await, "c"));

    // "Kill" c: its beating task (which owns the sender), its event stream and its
    // connection all go at once, as when the process dies.
    let killed = Instant::now();
    c.beating.abort();
    drop(c);

    for (name, group) in [("a", &mut a), ("b", &mut b)] {
        let lost = next_membership_lost(&mut group.events, PATIENCE).await;
        let after = killed.elapsed();
        eprintln!("{name} told of the crash after {after:?}");
        assert_eq!(lost.lost, ["c"], "{name} is told who died");
        assert_eq!(lost.cause, "stream_broken");
        assert_eq!(lost.quorum_id, id, "the event names the quorum it breaks");
        assert!(
            after < Duration::from_millis(500),
            "{name} learnt of the crash after {after:?}; it must take well under 1 s"
        );
    }
    eventually(
        "c gone from /status",
        Duration::from_millis(500),
        || async { !json_knows(&status_json(addr).await, "c") },
    )
    .await;
    let status = status_json(addr).await;
    assert!(
        json_knows(&status, "a") && json_knows(&status, "b"),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_group_is_evicted_after_the_heartbeat_timeout() {
    let (_lighthouse, addr) = start(2).await;
    let mut alive = live_group(addr, "alive").await;
    let hung_client = client(addr);
    // The hung group's stream stays open (sender and events kept) but never beats again.
    let hung = open_heartbeat(&hung_client, "hung")
        .await
        .expect("stream opens");
    let Heartbeat {
        beats: _keep_open,
        events: mut hung_events,
    } = hung;

    // A quorum request counts as a beat; the last sign of life is at or after `t0`.
    let t0 = Instant::now();
    answers(vec![
        ask(&alive.client, member("alive", 0), 0),
        ask(&hung_client, member("hung", 0), 0),
    ])
    .await;

    let lost = next_membership_lost(&mut alive.events, PATIENCE).await;
    let after = t0.elapsed();
    eprintln!("hung group evicted {after:?} after its last sign of life");
    assert_eq!(lost.lost, ["hung"]);
    assert_eq!(lost.cause, "heartbeat_timeout");
    assert!(
        after >= HEARTBEAT_TIMEOUT && after < HEARTBEAT_TIMEOUT + Duration::from_millis(500),
        "evicted after {after:?}; expected between {HEARTBEAT_TIMEOUT:?} and 0.5 s more"
    );
    let status = status_rpc(&alive.client).await;
    assert!(!known(&status, "hung"), "{status:?}");
    assert!(
        known(&status, "alive"),
        "the beating group stays: {status:?}"
    );

    // The lighthouse lets go of the evicted stream: its events end.
    let end = bounded("hung stream ends", PATIENCE, next_event(&mut hung_events)).await;
    assert!(matches!(end, Ok(None) | Err(_)), "got {end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_lighthouse_numbers_quorums_above_the_ids_groups_report() {
    let (first, addr) = start(2).await;
    let a = client(addr);
    let b = client(addr);
    // Groups that have seen id 41 elsewhere: the lighthouse goes above it.
    let before = answers(vec![
        ask(&a, member("a", 5), 41),
        ask(&b, member("b", 5), 41),
    ])
    .await;
    let n = before[0].quorum_id;
    assert!(n > 41);

    first.shutdown().await;
    let mut again = options(2);
    again.bind = addr.to_string();
    let second = lighthouse::serve(again)
        .await
        .expect("a new lighthouse binds the same port");
    assert_eq!(second.local_addr(), addr);

    // The new lighthouse knows nothing. Group a reports N, group b (say, freshly
    // restarted itself) reports 0; the same clients reconnect on their own, asking
    // again as a manager server does when the old connection turns out closed.
    let patiently = |c: &LighthouseClient, m: proto::Member, last: u64| {
        let c = c.clone();
        tokio::spawn(async move { c.quorum_patiently(m, last, CALL_TIMEOUT).await })
    };
    let after = answers(vec![
        patiently(&a, member("a", 6), n),
        patiently(&b, member("b", 6), 0),
    ])
    .await;
    for q in &after {
        assert!(q.quorum_id > n, "id {} after restart, was {n}", q.quorum_id);
    }
    assert_eq!(after[0].quorum_id, after[1].quorum_id);
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_set_every_request_without_it_is_refused() {
    let token = JobToken::new(Some("s3cret".into()));
    let lighthouse = lighthouse::serve(LighthouseOptions {
        token: token.clone(),
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = lighthouse.local_addr();

    for (who, presented) in [
        ("no token", JobToken::default()),
        ("wrong token", JobToken::new(Some("guess".into()))),
    ] {
        let c = client_with_token(addr, &presented);
        let err = c.quorum(member("a", 0), 0, CALL_TIMEOUT).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Permission, "{who}: {err}");
        let (code, message) = rpc_code(Err::<(), _>(err));
        assert_eq!(code, Code::Unauthenticated, "{who}");
        assert!(message.contains("token"), "{who}: {message}");
        let (code, _) = rpc_code(c.status(CALL_TIMEOUT).await);
        assert_eq!(code, Code::Unauthenticated, "{who}: Status RPC");
        let (code, _) = rpc_code(open_heartbeat(&c, "a").await.map(|_| ()));
        assert_eq!(code, Code::Unauthenticated, "{who}: heartbeat stream");
    }
    let good = client_with_token(addr, &token);
    assert_eq!(
        good.quorum(member("a", 0), 0, CALL_TIMEOUT)
            .await
            .expect("admitted")
            .participants
            .len(),
        1
    );

    for path in ["/", "/status", "/metrics"] {
        let (code, body) = http_get(addr, path, None).await;
        assert_eq!(code, 401, "GET {path} without a token");
        assert!(
            body.contains("token"),
            "the refusal says what is missing: {body}"
        );
        let (code, _) = http_get(addr, path, Some("Bearer guess")).await;
        assert_eq!(code, 401, "GET {path} with a wrong token");
    }
    let (code, body) = http_get(addr, "/status", Some("Bearer s3cret")).await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(status["quorum_members"][0], "a");
    // The status page's script passes the token in the query string instead.
    let (code, _) = http_get(addr, "/status?token=s3cret", None).await;
    assert_eq!(code, 200);
}

/// The generated client on a plain channel, so requests can be built field by field.
async fn raw_client(addr: SocketAddr) -> proto::lighthouse_client::LighthouseClient<Channel> {
    let channel = bounded(
        "connect",
        PATIENCE,
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .expect("connects");
    proto::lighthouse_client::LighthouseClient::new(channel)
}

fn raw_request(requester: Option<proto::Member>) -> proto::LighthouseQuorumRequest {
    proto::LighthouseQuorumRequest {
        protocol_version: PROTOCOL_VERSION,
        requester,
        last_quorum_id: 0,
        timeout_ms: 1_000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_the_lighthouse_serves_on() {
    let (_lighthouse, addr) = start(1).await;
    let mut raw = raw_client(addr).await;

    let with = |f: fn(&mut proto::Member)| {
        let mut m = member("ok", 0);
        f(&mut m);
        raw_request(Some(m))
    };
    let speaks = format!("this server speaks version {PROTOCOL_VERSION}");
    let cases: Vec<(&str, proto::LighthouseQuorumRequest, Code, Vec<&str>)> = vec![
        (
            "bad replica id",
            with(|m| m.replica_id = "a b".into()),
            Code::InvalidArgument,
            vec!["' ' at byte 1"],
        ),
        (
            "empty replica id",
            with(|m| m.replica_id.clear()),
            Code::InvalidArgument,
            vec!["empty"],
        ),
        (
            "negative step",
            with(|m| m.step = -1),
            Code::InvalidArgument,
            vec!["step -1"],
        ),
        (
            "world size 0",
            with(|m| m.world_size = 0),
            Code::InvalidArgument,
            vec!["world size 0"],
        ),
        (
            "more state addresses than ranks",
            with(|m| m.state_addresses = vec!["x:1".into(), "y:1".into()]),
            Code::InvalidArgument,
            vec!["one per rank"],
        ),
        (
            "address with a newline",
            with(|m| m.store_address = "h:1\n".into()),
            Code::InvalidArgument,
            vec!["store address"],
        ),
        (
            "no requester",
            raw_request(None),
            Code::InvalidArgument,
            vec!["without a requester"],
        ),
        (
            "zero timeout",
            proto::LighthouseQuorumRequest {
                timeout_ms: 0,
                ..with(|_| {})
            },
            Code::InvalidArgument,
            vec!["timeout of 0 ms"],
        ),
        (
            // The refusal names both versions, so the operator sees which host is off.
            "wrong protocol version",
            proto::LighthouseQuorumRequest {
                protocol_version: 99,
                ..with(|_| {})
            },
            Code::FailedPrecondition,
            vec!["protocol version 99", &speaks],
        ),
    ];
    for (what, request, code, needles) in cases {
        let status = bounded(what, PATIENCE, raw.quorum(request))
            .await
            .expect_err(what);
        assert_eq!(status.code(), code, "{what}: {}", status.message());
        for needle in needles {
            assert!(
                status.message().contains(needle),
                "{what}: {:?} lacks {needle:?}",
                status.message()
            );
        }
    }

    // A 1 MiB replica id: refused by size before it is even decoded.
    let huge = raw_request(Some(member(&"x".repeat(1 << 20), 0)));
    let status = bounded("oversized", PATIENCE, raw.quorum(huge))
        .await
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::ResourceExhausted | Code::OutOfRange),
        "oversized request: {:?} {}",
        status.code(),
        status.message()
    );

    // Bad first beats on a heartbeat stream are refused the same way.
    let c = client(addr);
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(proto::Beat {
        protocol_version: 99,
        ..beat("hb")
    })
    .unwrap();
    let (code, message) = rpc_code(c.heartbeat(rx, CALL_TIMEOUT).await);
    assert_eq!(code, Code::FailedPrecondition, "{message}");
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(beat("no/slash")).unwrap();
    let (code, message) = rpc_code(c.heartbeat(rx, CALL_TIMEOUT).await);
    assert_eq!(code, Code::InvalidArgument, "{message}");
    let (tx, rx) = mpsc::channel(1);
    tx.try_send(proto::Beat {
        step: -3,
        ..beat("hb")
    })
    .unwrap();
    let (code, message) = rpc_code(c.heartbeat(rx, CALL_TIMEOUT).await);
    assert_eq!(code, Code::InvalidArgument, "{message}");

    // None of it left a trace: the same connection and a fresh client both get quorums.
    let q = bounded(
        "quorum after bad input",
        PATIENCE,
        raw.quorum(raw_request(Some(member("ok", 0)))),
    )
    .await
    .expect("served on the same connection")
    .into_inner()
    .quorum;
    let q = proto::Quorum::decode(q).expect("an encoded quorum");
    assert_eq!(ids(&q), ["ok"]);
    let q = c
        .quorum(member("ok", 1), q.quorum_id, CALL_TIMEOUT)
        .await
        .expect("served");
    assert_eq!(ids(&q), ["ok"]);
    let status = status_rpc(&c).await;
    assert_eq!(
        status
            .replicas
            .iter()
            .map(|r| r.replica_id.as_str())
            .collect::<Vec<_>>(),
        ["ok"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_heartbeat_stream_for_a_live_replica_id_is_refused_naming_the_first() {
    let (_lighthouse, addr) = start(1).await;
    let first = live_group(addr, "dup").await;

    let other = client(addr);
    let (code, message) = rpc_code(open_heartbeat(&other, "dup").await.map(|_| ()));
    assert_eq!(code, Code::AlreadyExists, "{message}");
    assert!(
        message.contains("\"dup\""),
        "names the replica id: {message}"
    );
    assert!(
        message.contains("heartbeating from 127.0.0.1:"),
        "names where the live one connects from: {message}"
    );

    // The first stream is untouched: still connected and still counted.
    let status = status_rpc(&first.client).await;
    let dup = status
        .replicas
        .iter()
        .find(|r| r.replica_id == "dup")
        .expect("dup known");
    assert!(dup.connected, "{status:?}");
    assert!(dup.heartbeat_age_ms < HEARTBEAT_TIMEOUT.as_millis() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_request_for_a_waiting_replica_id_from_another_manager_is_refused() {
    // Two groups needed: the first request stays pending while the second arrives.
    let (_lighthouse, addr) = start(2).await;
    let c = client(addr);
    let waiting = ask(&c, member("twin", 0), 0);
    let mut impostor = member("twin", 0);
    impostor.manager_address = "127.0.0.1:9".into();
    eventually("first request pending", PATIENCE, || async {
        status_rpc(&c)
            .await
            .replicas
            .iter()
            .any(|r| r.replica_id == "twin" && r.joined)
    })
    .await;

    let (code, message) = rpc_code(c.quorum(impostor, 0, CALL_TIMEOUT).await);
    assert_eq!(code, Code::AlreadyExists, "{message}");
    assert!(
        message.contains("\"twin\"") && message.contains("twin-manager:29512"),
        "{message}"
    );

    // The first request still gets its quorum once a second group comes.
    let other = answers(vec![ask(&c, member("other", 0), 0)]).await;
    let first = answers(vec![waiting]).await;
    assert_eq!(ids(&first[0]), ["other", "twin"]);
    assert_eq!(first[0].quorum_id, other[0].quorum_id);
}

/// A quorum request sent on the group's heartbeat stream (a beat with seq 0 and an ask).
fn ask_beat(ask_id: u64, requester: proto::Member, timeout: Duration) -> proto::Beat {
    proto::Beat {
        step: requester.step,
        ask: Some(proto::QuorumAsk {
            ask_id,
            requester: Some(requester),
            timeout_ms: timeout.as_millis() as u64,
            known_issue: 0,
        }),
        ..beat("")
    }
}

/// The next event on a stream, leases included.
async fn next_raw_event(
    events: &mut phalanx::lighthouse::wire::BeatEvents,
) -> proto::lighthouse_event::Event {
    bounded("heartbeat event", PATIENCE, events.message())
        .await
        .expect("event stream healthy")
        .expect("event stream still open")
        .event
        .expect("an event")
}

async fn next_answer(events: &mut phalanx::lighthouse::wire::BeatEvents) -> proto::QuorumAnswer {
    match bounded("quorum answer", PATIENCE, next_event(events))
        .await
        .expect("event stream healthy")
        .expect("event stream still open")
    {
        proto::lighthouse_event::Event::Answer(answer) => answer,
        other => panic!("expected a quorum answer, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_asked_on_the_heartbeat_stream_is_answered_on_it_and_gets_no_lease() {
    let (_lighthouse, addr) = start(2).await;
    let on_stream = client(addr);
    let mut hb = open_heartbeat(&on_stream, "a").await.expect("stream opens");
    assert!(matches!(
        next_raw_event(&mut hb.events).await,
        proto::lighthouse_event::Event::Lease(_)
    ));

    hb.beats
        .send(ask_beat(7, member("a", 0), CALL_TIMEOUT))
        .await
        .unwrap();
    let by_call = answers(vec![ask(&client(addr), member("b", 0), 0)]).await;

    // The ask's only answer is the quorum: no lease comes first.
    let answer = match next_raw_event(&mut hb.events).await {
        proto::lighthouse_event::Event::Answer(answer) => answer,
        other => panic!("expected the quorum answer, got {other:?}"),
    };
    assert_eq!((answer.ask_id, answer.code), (7, 0), "{}", answer.message);
    let quorum = proto::Quorum::decode(answer.quorum).expect("an encoded quorum");
    assert_eq!(ids(&quorum), ["a", "b"]);
    assert_eq!(quorum.quorum_id, by_call[0].quorum_id);

    let (_, metrics) = http_get(addr, "/metrics", None).await;
    for via in ["stream", "call"] {
        let line = format!("phalanx_lighthouse_quorum_requests_total{{via=\"{via}\"}} 1");
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
}

/// Sends a quorum ask on `hb` and waits for its answer.
async fn ask_on(
    hb: &mut Heartbeat,
    ask_id: u64,
    requester: proto::Member,
    timeout: Duration,
) -> proto::QuorumAnswer {
    hb.beats
        .send(ask_beat(ask_id, requester, timeout))
        .await
        .expect("stream open");
    let answer = next_answer(&mut hb.events).await;
    assert_eq!(answer.ask_id, ask_id, "{}", answer.message);
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_or_unanswerable_ask_is_refused_on_the_stream_which_serves_on() {
    let (_lighthouse, addr) = start(2).await;
    let mut hb = open_heartbeat(&client(addr), "a")
        .await
        .expect("stream opens");
    let _beating = keep_beating(hb.beats.clone(), "a");

    // A group asks for itself only.
    let answer = ask_on(&mut hb, 1, member("b", 0), CALL_TIMEOUT).await;
    assert_eq!(Code::from(answer.code), Code::PermissionDenied);
    assert!(
        answer.message.contains("\"b\"") && answer.message.contains("itself"),
        "{}",
        answer.message
    );
    assert!(answer.quorum.is_empty());

    let answer = ask_on(&mut hb, 2, member("a", 0), Duration::ZERO).await;
    assert_eq!(Code::from(answer.code), Code::InvalidArgument);
    assert!(answer.message.contains("timeout"), "{}", answer.message);

    // Alone, with two groups needed: the wait runs out, and the answer says why.
    let answer = ask_on(&mut hb, 3, member("a", 0), Duration::from_millis(300)).await;
    assert_eq!(Code::from(answer.code), Code::DeadlineExceeded);
    assert!(
        answer.message.contains("no quorum within"),
        "{}",
        answer.message
    );

    // The stream still serves: with a second group, the next ask gets its quorum.
    let b = ask(&client(addr), member("b", 0), 0);
    let answer = ask_on(&mut hb, 4, member("a", 0), CALL_TIMEOUT).await;
    assert_eq!(answer.code, 0, "{}", answer.message);
    let by_call = answers(vec![b]).await;
    let quorum = proto::Quorum::decode(answer.quorum).expect("an encoded quorum");
    assert_eq!(quorum.quorum_id, by_call[0].quorum_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_lighthouse_ends_heartbeat_streams_and_waiting_requests_at_once() {
    let (lighthouse, addr) = start(2).await;
    let mut group = live_group(addr, "a").await;
    // Waits for a second group that never comes.
    let waiting = ask(&group.client, member("a", 0), 0);
    eventually("request pending", PATIENCE, || async {
        status_rpc(&group.client)
            .await
            .replicas
            .iter()
            .any(|r| r.joined)
    })
    .await;

    // A stopped lighthouse must not leave groups attached to a server that is gone
    // (they would never re-open their stream to its successor).
    let stopping = Instant::now();
    bounded("shutdown", PATIENCE, lighthouse.shutdown()).await;
    let end = bounded(
        "heartbeat stream ends",
        PATIENCE,
        next_event(&mut group.events),
    )
    .await;
    assert!(!matches!(end, Ok(Some(_))), "got {end:?}");
    let err = answers_err(waiting).await;
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    let took = stopping.elapsed();
    eprintln!("shutdown, stream end and request failure after {took:?}");
    assert!(
        took < Duration::from_millis(500),
        "streams and requests ended after {took:?}"
    );
    group.beating.abort();
}

async fn answers_err(task: JoinHandle<Result<proto::Quorum, Error>>) -> Error {
    bounded("quorum request", PATIENCE, task)
        .await
        .expect("quorum task")
        .expect_err("no quorum from a stopped lighthouse")
}

/// Connection caps small and short enough for a test to reach.
const TIGHT: GateLimits = GateLimits {
    max_connections: 64,
    max_unproven: 16,
    prove_within: Duration::from_millis(300),
    idle: Duration::from_millis(600),
};

async fn refused(addr: SocketAddr, token: &str, reason: &str) -> u64 {
    let series = format!("phalanx_lighthouse_refused_requests_total{{reason=\"{reason}\"}}");
    metric(addr, Some(token), &series).await
}

/// The count `series` (its name and labels, as exported) from /metrics, read with
/// `token` if the lighthouse has one.
async fn metric(addr: SocketAddr, token: Option<&str>, series: &str) -> u64 {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let (code, metrics) = http_get(addr, "/metrics", bearer.as_deref()).await;
    assert_eq!(code, 200, "{metrics}");
    let line = format!("{series} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap_or_else(|| panic!("no {series} exported:\n{metrics}"))
        .parse()
        .expect("a count")
}

/// A lighthouse (no token) with the connection caps `limits`.
async fn start_limited(limits: GateLimits) -> (ServerHandle, SocketAddr) {
    let handle = lighthouse::serve(LighthouseOptions {
        connections: limits,
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = handle.local_addr();
    (handle, addr)
}

/// Reads until the peer closes the connection; how long that took.
async fn until_closed(stream: &mut TcpStream) -> Duration {
    let started = Instant::now();
    bounded("the lighthouse to close the connection", PATIENCE, async {
        let mut buf = [0u8; 256];
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_the_token_is_closed_soon_and_every_refusal_is_counted() {
    let token = JobToken::new(Some("s3cret".into()));
    let lighthouse = lighthouse::serve(LighthouseOptions {
        token: token.clone(),
        connections: TIGHT,
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = lighthouse.local_addr();
    for reason in [
        "token",
        "no_token_in_time",
        "crowded_out",
        "connections_full",
    ] {
        assert_eq!(refused(addr, "s3cret", reason).await, 0, "{reason}");
    }

    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let mut talker = TcpStream::connect(addr).await.expect("connect");
    talker
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("send a preface");
    assert!(until_closed(&mut silent).await >= TIGHT.prove_within - Duration::from_millis(50));
    until_closed(&mut talker).await;
    assert_eq!(refused(addr, "s3cret", "no_token_in_time").await, 2);

    let wrong = client_with_token(addr, &JobToken::new(Some("guess".into())));
    let (code, _) = rpc_code(wrong.status(CALL_TIMEOUT).await.map(|_| ()));
    assert_eq!(code, Code::Unauthenticated);
    let (code, _) = http_get(addr, "/status", Some("Bearer guess")).await;
    assert_eq!(code, 401);
    assert_eq!(refused(addr, "s3cret", "token").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_on_time_beside_long_lived_proven_ones() {
    let (_lighthouse, addr) = start_limited(GateLimits {
        idle: Duration::from_secs(60),
        ..TIGHT
    })
    .await;
    // A proven connection whose idle deadline lies a minute away...
    let c = client(addr);
    status_rpc(&c).await;
    // (past its own proving deadline, so that nothing else is due before that minute)
    tokio::time::sleep(2 * TIGHT.prove_within).await;
    // ...does not put off closing a silent one at its own, earlier deadline.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    until_closed(&mut silent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_held_against_the_lighthouse_do_not_keep_a_group_out() {
    let (_lighthouse, addr) = start_limited(GateLimits {
        prove_within: Duration::from_secs(30),
        ..TIGHT
    })
    .await;
    let mut flood = Vec::new();
    for _ in 0..400 {
        flood.push(TcpStream::connect(addr).await.expect("connect"));
    }

    let c = client(addr);
    let q = bounded(
        "a quorum beside the flood",
        PATIENCE,
        c.quorum(member("a", 0), 0, CALL_TIMEOUT),
    )
    .await
    .expect("served");
    assert_eq!(ids(&q), ["a"]);
    // The lighthouse keeps at most `max_unproven` of them; the rest made room.
    let crowded_out = refused(addr, "", "crowded_out").await;
    assert!(
        crowded_out >= 400 - TIGHT.max_unproven as u64,
        "{crowded_out}"
    );
    drop(flood);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_and_the_client_reconnects_unnoticed() {
    let (_lighthouse, addr) = start_limited(TIGHT).await;
    // A proven connection that goes quiet (HTTP/1.1 keep-alive: nothing pings it) is
    // closed once nothing moved on it for the idle limit, not before.
    let mut quiet = TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET /status HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    quiet.write_all(request.as_bytes()).await.expect("send");
    let mut answer = [0u8; 1024];
    let n = quiet.read(&mut answer).await.expect("an answer");
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        &answer[..n]
    );
    let closed_after = until_closed(&mut quiet).await;
    assert!(
        closed_after >= TIGHT.idle - Duration::from_millis(50),
        "{closed_after:?}"
    );

    // A gRPC client whose connection was closed that way reconnects on its next call.
    let c = client(addr);
    status_rpc(&c).await;
    tokio::time::sleep(2 * TIGHT.idle).await;
    status_rpc(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_asks_on_one_stream_leaves_only_the_last_one_waiting() {
    let (_lighthouse, addr) = start(2).await;
    let mut hb = open_heartbeat(&client(addr), "a")
        .await
        .expect("stream opens");
    let _beating = keep_beating(hb.beats.clone(), "a");
    const ASKS: u64 = 200;
    for ask_id in 1..=ASKS {
        hb.beats
            .send(ask_beat(ask_id, member("a", 0), CALL_TIMEOUT))
            .await
            .expect("stream open");
    }

    // Counted once joined: from then on the last ask is the one waiting.
    let counted = format!("phalanx_lighthouse_quorum_requests_total{{via=\"stream\"}} {ASKS}");
    eventually("every ask taken", PATIENCE, || async {
        http_get(addr, "/metrics", None).await.1.contains(&counted)
    })
    .await;

    // Each ask withdrew the one before it: only the last is answered with the quorum;
    // earlier ones are answered as superseded, never with a quorum.
    let by_call = answers(vec![ask(&client(addr), member("b", 0), 0)]).await;
    let last = loop {
        let answer = next_answer(&mut hb.events).await;
        if answer.ask_id == ASKS {
            break answer;
        }
        assert_ne!(
            answer.code, 0,
            "superseded ask {} got a quorum",
            answer.ask_id
        );
    };
    assert_eq!(last.code, 0, "{}", last.message);
    let quorum = proto::Quorum::decode(last.quorum).expect("an encoded quorum");
    assert_eq!(quorum.quorum_id, by_call[0].quorum_id);
    assert_eq!(ids(&quorum), ["a", "b"]);
    let status = status_rpc(&client(addr)).await;
    assert!(status.replicas.iter().all(|r| !r.joined), "{status:?}");
}

#[path = "lighthouse/datagrams.rs"]
mod datagrams;
#[path = "lighthouse/jobs.rs"]
mod jobs;
#[path = "lighthouse/wire.rs"]
mod wire;
