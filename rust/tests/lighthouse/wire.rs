//! Heartbeat streams in frames on the lighthouse's one port (`lighthouse::wire`):
//! beside gRPC and HTTP on the same port, meaning the same events, and refusing
//! garbage, oversized frames and wrong tokens as a gRPC call would.

use super::*;
use phalanx::frames::{self, PREFACE};
use phalanx::lighthouse::wire::BeatTransport;

/// A raw connection that opened with the preface and `hello`.
async fn framed(addr: SocketAddr, hello: &proto::BeatOpen) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    let mut out = bytes::BytesMut::from(&PREFACE[..]);
    frames::encode(hello, &mut out);
    stream.write_all(&out).await.expect("writes");
    stream
}

/// The frames the lighthouse writes until it closes the connection.
async fn frames_until_closed(stream: &mut TcpStream) -> Vec<proto::LighthouseEvent> {
    let mut read = bytes::BytesMut::new();
    bounded("the lighthouse to close the connection", PATIENCE, async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
            read.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let reader = frames::Frames { max: 1 << 20 };
    let mut events = Vec::new();
    while let Some(frame) = reader.next(&mut read).expect("whole frames") {
        events.push(proto::LighthouseEvent::decode(frame).expect("an event"));
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_and_grpc_heartbeats_http_and_calls_share_the_port_and_mean_the_same() {
    let (_lighthouse, addr) = start(2).await;
    let framed = client(addr);
    let grpc = client(addr).beats_over(BeatTransport::Grpc);
    let mut a = live_group_on(&framed, "a").await;
    let mut b = live_group_on(&grpc, "b").await;

    // One quorum of both, asked on their streams.
    let ask_a = ask_beat(1, member("a", 0), CALL_TIMEOUT);
    let ask_b = ask_beat(1, member("b", 0), CALL_TIMEOUT);
    a.beats.send(ask_a).await.unwrap();
    b.beats.send(ask_b).await.unwrap();
    let (qa, qb) = (
        next_answer(&mut a.events).await,
        next_answer(&mut b.events).await,
    );
    assert_eq!((qa.code, qb.code), (0, 0), "{qa:?} {qb:?}");
    assert_eq!(
        qa.quorum, qb.quorum,
        "the same encoded quorum on both transports"
    );

    // The status page and a status call on the same port list both as connected.
    let status = status_rpc(&framed).await;
    assert!(known(&status, "a") && known(&status, "b"), "{status:?}");
    let page = status_json(addr).await;
    assert!(json_knows(&page, "a") && json_knows(&page, "b"), "{page}");

    // Either stream ending is the group's death, told to the other on its stream.
    a.beating.abort();
    drop(a);
    let lost = next_membership_lost(&mut b.events, PATIENCE).await;
    assert_eq!(lost.lost, ["a"], "{lost:?}");
    b.beating.abort();
}

/// A group beating on `client`'s transport, its beats sent by a task.
async fn live_group_on(client: &LighthouseClient, id: &str) -> LiveGroupOn {
    let hb = open_heartbeat(client, id).await.expect("the stream opens");
    LiveGroupOn {
        beats: hb.beats.clone(),
        events: hb.events,
        beating: keep_beating(hb.beats, id),
    }
}

struct LiveGroupOn {
    beats: mpsc::Sender<proto::Beat>,
    events: phalanx::lighthouse::wire::BeatEvents,
    beating: JoinHandle<()>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_oversized_frames_and_wrong_tokens_are_refused_and_counted() {
    let token = "s3cret";
    let handle = lighthouse::serve(LighthouseOptions {
        token: JobToken::new(Some(token.into())),
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = handle.local_addr();
    let hello = |token: &str| proto::BeatOpen {
        token: token.into(),
        ..Default::default()
    };

    // A wrong token: the stream ends with the refusal a gRPC call gets, and nothing
    // else; the connection closes.
    let mut wrong = framed(addr, &hello("wrong")).await;
    let events = frames_until_closed(&mut wrong).await;
    let [proto::LighthouseEvent {
        event: Some(proto::lighthouse_event::Event::End(end)),
    }] = &events[..]
    else {
        panic!("one StreamEnd, got {events:?}");
    };
    assert_eq!(Code::from(end.code), Code::Unauthenticated, "{end:?}");
    assert!(end.message.contains("token"), "{end:?}");
    // The same through the client: an error naming the fix.
    let wrong_client = client_with_token(addr, &JobToken::new(Some("wrong".into())));
    let (code, message) = rpc_code(open_heartbeat(&wrong_client, "x").await.map(|_| ()));
    assert_eq!(code, Code::Unauthenticated, "{message}");
    assert_eq!(refused(addr, token, "token").await, 2);

    // Garbage after the preface's first byte, a frame longer than any request, and a
    // frame that is no BeatOpen: each closes its connection, counted as invalid.
    let mut garbage = TcpStream::connect(addr).await.unwrap();
    garbage.write_all(b"\xffGARBAGE GARBAGE").await.unwrap();
    until_closed(&mut garbage).await;
    let mut huge = TcpStream::connect(addr).await.unwrap();
    huge.write_all(&PREFACE[..]).await.unwrap();
    huge.write_all(&(1u32 << 30).to_be_bytes()).await.unwrap();
    let events = frames_until_closed(&mut huge).await;
    assert!(
        matches!(&events[..], [proto::LighthouseEvent { event: Some(proto::lighthouse_event::Event::End(end)) }]
            if Code::from(end.code) == Code::InvalidArgument && end.message.contains("over the")),
        "{events:?}"
    );
    let mut malformed = TcpStream::connect(addr).await.unwrap();
    malformed.write_all(&PREFACE[..]).await.unwrap();
    malformed
        .write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    until_closed(&mut malformed).await;
    assert_eq!(refused(addr, token, "invalid").await, 3);

    // A good token opens a stream on the same lighthouse, which served on throughout.
    let good = client_with_token(addr, &JobToken::new(Some(token.into())));
    let mut hb = open_heartbeat(&good, "ok").await.expect("the stream opens");
    let first = hb.events.message().await.expect("an event");
    assert!(
        matches!(
            first,
            Some(proto::LighthouseEvent {
                event: Some(proto::lighthouse_event::Event::Lease(_))
            })
        ),
        "{first:?}"
    );
    handle.shutdown().await;
}
