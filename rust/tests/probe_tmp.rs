use std::time::{Duration, Instant};
use phalanx::auth::JobToken;
use phalanx::client::{LighthouseClient, ManagerClient};
use phalanx::lighthouse::{self, LighthouseOptions};
use phalanx::manager::{self, ManagerOptions};
use phalanx::proto;
use tokio::sync::mpsc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_manager_events_after_shutdown() {
    let lh = lighthouse::serve(LighthouseOptions { bind: "127.0.0.1:0".into(), min_replicas: 1, join_timeout: Duration::from_millis(200), heartbeat_timeout: Duration::from_millis(500), token: JobToken::default() }).await.unwrap();
    let m = manager::serve(ManagerOptions { replica_id: "g".into(), lighthouse_address: lh.local_addr().to_string(), bind: "127.0.0.1:0".into(), advertise_host: None, store_address: "s:1".into(), world_size: 1, heartbeat_interval: Duration::from_millis(50), connect_timeout: Duration::from_millis(500), init_sync: false, token: JobToken::default() }).await.unwrap();
    let c = ManagerClient::new(&m.address, &JobToken::default(), Duration::from_secs(1)).unwrap();
    let mut ev = c.events(Duration::from_secs(1)).await.unwrap();
    let t = Instant::now();
    m.server.shutdown().await;
    eprintln!("manager shutdown took {:?}", t.elapsed());
    let r = tokio::time::timeout(Duration::from_secs(3), ev.message()).await;
    eprintln!("events after shutdown: {:?} at {:?}", r.as_ref().map(|x| x.as_ref().map(|_| ()).map_err(|e| e.code())), t.elapsed());
    let r = tokio::time::timeout(Duration::from_secs(3), c.quorum(0, 0, String::new(), false, Duration::from_millis(300))).await;
    eprintln!("quorum after shutdown: {:?} at {:?}", r.map(|x| x.map(|_| ()).map_err(|e| e.to_string())), t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_lighthouse_heartbeat_after_shutdown() {
    let lh = lighthouse::serve(LighthouseOptions { bind: "127.0.0.1:0".into(), min_replicas: 1, join_timeout: Duration::from_millis(200), heartbeat_timeout: Duration::from_millis(500), token: JobToken::default() }).await.unwrap();
    let c = LighthouseClient::new(&lh.local_addr().to_string(), &JobToken::default(), Duration::from_secs(1)).unwrap();
    let (tx, rx) = mpsc::channel(8);
    tx.try_send(proto::Beat { protocol_version: 1, replica_id: "a".into(), last_quorum_id: 0, step: 0 }).unwrap();
    let mut ev = c.heartbeat(rx, Duration::from_secs(1)).await.unwrap();
    let t = Instant::now();
    lh.shutdown().await;
    eprintln!("lighthouse shutdown took {:?}", t.elapsed());
    let r = tokio::time::timeout(Duration::from_secs(3), ev.message()).await;
    eprintln!("heartbeat events after shutdown: {:?} at {:?}", r.as_ref().map(|x| x.as_ref().map(|_| ()).map_err(|e| e.code())), t.elapsed());
    drop(tx);
}
