//! Beats as UDP datagrams beside framed heartbeat streams (`phalanx::datagram`): they
//! keep a group live and leased (their renewals come back as datagrams), a closed
//! stream is still told at once, datagrams without the stream's key or number are
//! dropped and counted, and a group whose datagrams, or whose leases, are lost falls
//! back to its stream.

use super::*;
use phalanx::datagram::{DatagramBeat, Sealer, LEN};
use phalanx::frames::{self, PREFACE};

/// Plain beats (no name, no report), numbered from 2 as a group's manager numbers
/// them, every `BEAT_EVERY` until aborted: what the client sends as datagrams.
fn keep_beating_plain(beats: mpsc::Sender<proto::Beat>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(BEAT_EVERY);
        for seq in 2.. {
            ticker.tick().await;
            let plain = proto::Beat {
                protocol_version: PROTOCOL_VERSION,
                seq,
                ..Default::default()
            };
            if beats.send(plain).await.is_err() {
                return;
            }
        }
    })
}

fn dropped(reason: &str) -> String {
    format!("phalanx_lighthouse_datagrams_dropped_total{{reason=\"{reason}\"}}")
}

const TAKEN: &str = "phalanx_lighthouse_datagram_beats_total";
const LEASES: &str = "phalanx_lighthouse_datagram_leases_total";

/// Reads `events` until a lease acknowledges a beat numbered `seq` or later (in a
/// quorum, if `in_quorum`); fails on any other event. A group reads its events all
/// along: a lease it does not read is one it did not get.
async fn leased_from(
    events: &mut phalanx::lighthouse::wire::BeatEvents,
    seq: u64,
    in_quorum: bool,
) -> u64 {
    bounded("a lease of a later beat", PATIENCE, async {
        loop {
            match events.message().await {
                Ok(Some(proto::LighthouseEvent {
                    event: Some(proto::lighthouse_event::Event::Lease(lease)),
                })) if lease.seq >= seq && (lease.quorum_id != 0 || !in_quorum) => {
                    return lease.quorum_id
                }
                Ok(Some(proto::LighthouseEvent {
                    event: Some(proto::lighthouse_event::Event::Lease(_)),
                })) => {}
                other => panic!("the stream must only lease, got {other:?}"),
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beats_as_datagrams_keep_groups_live_and_leased_and_a_closed_stream_is_told_at_once() {
    let (_lighthouse, addr) = start(3).await;
    let mut clients = Vec::new();
    let mut reading = Vec::new();
    for id in ["a", "b", "c"] {
        let client = client(addr);
        let hb = open_heartbeat(&client, id).await.expect("the stream opens");
        let beating = keep_beating_plain(hb.beats);
        let mut events = hb.events;
        reading.push(tokio::spawn(async move {
            let leased = leased_from(&mut events, 30, true).await;
            (beating, events, leased)
        }));
        clients.push(client);
    }
    let quorum = answers(
        clients
            .iter()
            .zip(["a", "b", "c"])
            .map(|(client, id)| ask(client, member(id, 0), 0))
            .collect(),
    )
    .await;
    let id = quorum[0].quorum_id;

    // Beat 30 comes 1.5 s in, three heartbeat timeouts: every group is still live,
    // its beats taken as datagrams, and leased in the quorum by its stream.
    let mut groups = Vec::new();
    for (reading, client) in reading.into_iter().zip(clients) {
        let (beating, events, leased) = reading.await.expect("the reader");
        assert_eq!(leased, id);
        groups.push((client, beating, events));
    }
    let taken = metric(addr, None, TAKEN).await;
    let beats = metric(addr, None, "phalanx_lighthouse_heartbeats_total").await;
    // The streams carried their first beats, and a few more only if a busy machine
    // held a lease back long enough for a group to fall back for a while.
    assert!(taken >= 3 * 25, "{taken} datagrams taken");
    assert!(
        taken * 10 >= beats * 8,
        "{beats} beats, only {taken} of them datagrams"
    );
    // Kept on datagrams, the groups heard their renewals: they came as datagrams (a
    // lease every 250 ms at most, each group's first and its quorum's on the stream).
    let leases = metric(addr, None, LEASES).await;
    assert!(leases >= 3 * 3, "{leases} leases sent as datagrams");
    let status = status_rpc(&groups[0].0).await;
    assert!(status.replicas.iter().all(|r| r.connected), "{status:?}");

    // "Kill" c: its beats stop and its connection closes. The others are told at once,
    // as with beats on the stream.
    let (_, c_beating, c_events) = groups.pop().expect("c");
    let killed = Instant::now();
    c_beating.abort();
    drop(c_events);
    for (_, _, events) in &mut groups {
        let lost = next_membership_lost(events, PATIENCE).await;
        let after = killed.elapsed();
        assert_eq!(
            (lost.lost.as_slice(), lost.cause.as_str()),
            (&["c".to_string()][..], "stream_broken")
        );
        assert!(after < Duration::from_millis(500), "told after {after:?}");
    }
    for (_, beating, _) in groups {
        beating.abort();
    }
}

/// A raw framed stream of `id`: its connection, and the datagram offer of its first
/// lease (channel, key).
async fn raw_stream(addr: SocketAddr, id: &str) -> (TcpStream, u64, [u8; 16]) {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    let mut out = bytes::BytesMut::from(&PREFACE[..]);
    frames::encode(&proto::BeatOpen::default(), &mut out);
    frames::encode(&beat(id), &mut out);
    stream.write_all(&out).await.expect("writes");
    let mut read = bytes::BytesMut::new();
    let reader = frames::Frames { max: 1 << 20 };
    let first = bounded("the first lease", PATIENCE, async {
        loop {
            if let Some(frame) = reader.next(&mut read).expect("whole frames") {
                return proto::LighthouseEvent::decode(frame).expect("an event");
            }
            let mut buf = [0u8; 1024];
            let n = stream.read(&mut buf).await.expect("reads");
            assert!(n > 0, "the lighthouse closed the stream");
            read.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let Some(proto::lighthouse_event::Event::Lease(proto::Lease {
        datagrams: Some(offer),
        ..
    })) = first.event
    else {
        panic!("the first lease offers datagrams: {first:?}");
    };
    let key = offer.key[..].try_into().expect("a 16-byte key");
    (stream, offer.channel, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_unknown_forged_and_replayed_datagrams_are_dropped_and_counted() {
    let (_lighthouse, addr) = start(1).await;
    let (_stream, channel, key) = raw_stream(addr, "g").await;
    let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    udp.connect(addr).await.unwrap();
    let sealed = |channel: u64, key: &[u8; 16], seq: u64| {
        let beat = DatagramBeat {
            channel,
            seq,
            ..Default::default()
        };
        Sealer::new(key).seal(&beat)
    };
    let counts = || async {
        let mut counts = Vec::new();
        for reason in ["garbage", "unknown_channel", "forged", "replayed"] {
            counts.push(metric(addr, None, &dropped(reason)).await);
        }
        counts.push(metric(addr, None, TAKEN).await);
        counts
    };
    let until = |want: [u64; 5]| async move {
        eventually("the datagrams counted", PATIENCE, || async {
            counts().await == want
        })
        .await;
    };
    until([0, 0, 0, 0, 0]).await;

    udp.send(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    udp.send(&[0u8; LEN]).await.unwrap();
    until([2, 0, 0, 0, 0]).await;
    udp.send(&sealed(channel + 1000, &key, 5)).await.unwrap();
    until([2, 1, 0, 0, 0]).await;
    let mut tampered = sealed(channel, &key, 5);
    tampered[20] ^= 1;
    udp.send(&tampered).await.unwrap();
    udp.send(&sealed(channel, b"not the rightkey", 5))
        .await
        .unwrap();
    until([2, 1, 2, 0, 0]).await;

    // The real one is taken once; the copy and an older number are replays.
    let good = sealed(channel, &key, 5);
    udp.send(&good).await.unwrap();
    until([2, 1, 2, 0, 1]).await;
    udp.send(&good).await.unwrap();
    udp.send(&sealed(channel, &key, 4)).await.unwrap();
    until([2, 1, 2, 2, 1]).await;

    // The lighthouse served on: the next beat is taken, and the group is live.
    udp.send(&sealed(channel, &key, 6)).await.unwrap();
    until([2, 1, 2, 2, 2]).await;
    let status = status_rpc(&client(addr)).await;
    assert!(connected(&status, "g"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_streams_channel_takes_no_more_datagrams() {
    let (_lighthouse, addr) = start(1).await;
    let (stream, channel, key) = raw_stream(addr, "g").await;
    drop(stream);
    eventually("g gone", PATIENCE, || async {
        !known(&status_rpc(&client(addr)).await, "g")
    })
    .await;
    let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let beat = DatagramBeat {
        channel,
        seq: 2,
        ..Default::default()
    };
    udp.send_to(&Sealer::new(&key).seal(&beat), addr)
        .await
        .unwrap();
    eventually("the datagram dropped", PATIENCE, || async {
        metric(addr, None, &dropped("unknown_channel")).await == 1
    })
    .await;
    assert!(!known(&status_rpc(&client(addr)).await, "g"));
}

/// Forwards TCP connections to `to`; UDP sent to its port goes to a socket that never
/// reads it, as a firewall that drops UDP would.
async fn tcp_only_forwarder(to: SocketAddr) -> (SocketAddr, std::net::UdpSocket, JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    let sink = std::net::UdpSocket::bind(at).expect("the UDP port of the same number");
    sink.set_nonblocking(true).unwrap();
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut outbound = TcpStream::connect(to).await.expect("the lighthouse");
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    (at, sink, forwarding)
}

/// Opens group g's stream through `client` and beats until beat 30, 1.5 s in (three
/// heartbeat timeouts), is leased: where datagrams or their leases are lost, it and
/// the beats before it since the fallback came on the stream.
async fn beating_past_the_fallback(
    client: &LighthouseClient,
) -> (phalanx::lighthouse::wire::BeatEvents, JoinHandle<()>) {
    let hb = open_heartbeat(client, "g").await.expect("the stream opens");
    let mut events = hb.events;
    let beating = keep_beating_plain(hb.beats);
    leased_from(&mut events, 30, false).await;
    (events, beating)
}

/// Group g is live, and no group ever timed out.
async fn live_and_never_timed_out(addr: SocketAddr, client: &LighthouseClient) {
    let status = status_rpc(client).await;
    assert!(connected(&status, "g"), "{status:?}");
    let timeouts = "phalanx_lighthouse_evictions_total{cause=\"heartbeat_timeout\"}";
    assert_eq!(metric(addr, None, timeouts).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_whose_datagrams_are_lost_falls_back_to_its_stream_stays_live_and_comes_back() {
    let (_lighthouse, addr) = start(1).await;
    let (through, lost, forwarding) = tcp_only_forwarder(addr).await;
    let client = client(through);
    let (mut events, beating) = beating_past_the_fallback(&client).await;
    let mut tried = 0;
    let mut buf = [0u8; 256];
    while lost.recv(&mut buf).is_ok() {
        tried += 1;
    }
    // Three before falling back, then a probe every tenth beat.
    assert!(
        (3..=8).contains(&tried),
        "{tried} datagrams tried before falling back and since"
    );
    assert_eq!(metric(addr, None, TAKEN).await, 0);
    live_and_never_timed_out(addr, &client).await;

    // UDP passes again: a probe gets through, its lease brings the group back to
    // datagrams, and its beats come as datagrams from then on.
    let relaying = udp_relay(lost, addr, true);
    let reading = tokio::spawn(async move { while let Ok(Some(_)) = events.message().await {} });
    eventually("beats as datagrams again", PATIENCE, || async {
        metric(addr, None, TAKEN).await >= 10
    })
    .await;
    assert!(metric(addr, None, LEASES).await > 0);
    beating.abort();
    forwarding.abort();
    relaying.abort();
    reading.abort();
}

/// Relays what `relay` receives: from a group to the lighthouse at `lighthouse`, and,
/// if `back`, from the lighthouse to the group that sent last.
fn udp_relay(relay: std::net::UdpSocket, lighthouse: SocketAddr, back: bool) -> JoinHandle<()> {
    let relay = tokio::net::UdpSocket::from_std(relay).unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 256];
        let mut group = None;
        while let Ok((n, from)) = relay.recv_from(&mut buf).await {
            let to = if from != lighthouse {
                group = Some(from);
                Some(lighthouse)
            } else {
                group.filter(|_| back)
            };
            if let Some(to) = to {
                let _ = relay.send_to(&buf[..n], to).await;
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_hears_no_lease_datagrams_falls_back_to_its_stream_and_stays_leased() {
    // UDP passes to the lighthouse and not back: its datagrams are taken, the leases
    // that renew them are lost.
    let (_lighthouse, addr) = start(1).await;
    let (through, relay, forwarding) = tcp_only_forwarder(addr).await;
    let relaying = udp_relay(relay, addr, false);
    let client = client(through);
    let (_events, beating) = beating_past_the_fallback(&client).await;
    let taken = metric(addr, None, TAKEN).await;
    assert!(
        (3..=8).contains(&taken),
        "{taken} datagrams taken before falling back and since"
    );
    assert!(metric(addr, None, LEASES).await > 0);
    live_and_never_timed_out(addr, &client).await;
    beating.abort();
    forwarding.abort();
    relaying.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lighthouse_without_datagrams_offers_none_and_takes_beats_on_the_stream() {
    let handle = lighthouse::serve(LighthouseOptions {
        datagrams: false,
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = handle.local_addr();
    let client = client(addr);
    let hb = open_heartbeat(&client, "g")
        .await
        .expect("the stream opens");
    let mut events = hb.events;
    let first = events.message().await.expect("an event");
    assert!(
        matches!(
            &first,
            Some(proto::LighthouseEvent {
                event: Some(proto::lighthouse_event::Event::Lease(proto::Lease {
                    datagrams: None,
                    ..
                }))
            })
        ),
        "{first:?}"
    );
    let beating = keep_beating_plain(hb.beats);
    leased_from(&mut events, 30, false).await;
    assert_eq!(metric(addr, None, TAKEN).await, 0);
    beating.abort();
    handle.shutdown().await;
}
