//! The lighthouse: it decides quorums, watches the liveness of every replica group
//! through its heartbeat stream, and serves a status page and metrics, for any number
//! of jobs at once (see `jobs`), each with its own rules, quorums and token.

mod access;
mod beat_path;
mod beats;
pub mod client;
pub(crate) mod datagrams;
mod frame_reader;
mod heartbeat;
mod history;
mod http;
pub mod jobs;
pub mod leadership;
mod metrics;
mod newest;
mod pulse;
mod service;
pub mod set;
mod site;
mod snapshot;
mod stall;
pub mod state;
mod tally;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;

use crate::auth::{self, JobToken};
use crate::door::Door;
use crate::fdlimit;
use crate::gate::GateLimits;
use crate::proto::lighthouse_server::LighthouseServer;
use crate::proto::lighthouse_set_server::LighthouseSetServer;
use crate::server::{self, FramedDoor, ServerHandle};
use crate::Error;
use access::JobCheck;
use datagrams::Channels;
pub use jobs::Tuning;
use service::LighthouseService;
use set::{Seat, SetOptions, SetService};
pub use site::JobLimits;
use site::{Site, MAX_REQUEST_BYTES};

#[derive(Clone, Debug)]
pub struct LighthouseOptions {
    /// "host:port" for gRPC and HTTP; port 0 picks a free one.
    pub bind: String,
    pub min_replicas: usize,
    pub join_timeout: Duration,
    pub heartbeat_timeout: Duration,
    pub rollback_after: Duration,
    pub token: JobToken,
    /// Caps on connections (see `gate`).
    pub connections: GateLimits,
    /// Serve without a token even where other hosts can reach the lighthouse.
    pub insecure: bool,
    /// How many jobs it serves at once, and when it forgets one (see `jobs`).
    pub jobs: JobLimits,
    /// Offer framed streams to take their beats as UDP datagrams on the same port
    /// number (`crate::datagram`); off, every beat comes on its stream.
    pub datagrams: bool,
}

impl Default for LighthouseOptions {
    fn default() -> Self {
        LighthouseOptions {
            bind: "0.0.0.0:29510".into(),
            min_replicas: Tuning::DEFAULT.min_replicas,
            join_timeout: Tuning::DEFAULT.join_timeout,
            heartbeat_timeout: Tuning::DEFAULT.heartbeat_timeout,
            rollback_after: Tuning::DEFAULT.rollback_after,
            token: JobToken::default(),
            connections: GateLimits::lighthouse(Tuning::DEFAULT.max_groups),
            insecure: false,
            jobs: JobLimits::DEFAULT,
            datagrams: true,
        }
    }
}

impl LighthouseOptions {
    pub fn validate(&self) -> Result<(), Error> {
        if self.min_replicas == 0 {
            return Err(Error::InvalidConfig(
                "--min-replicas must be at least 1".into(),
            ));
        }
        if self.join_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "--join-timeout must be positive, e.g. 1s".into(),
            ));
        }
        if self.heartbeat_timeout < Duration::from_millis(10) {
            return Err(Error::InvalidConfig(
                "--heartbeat-timeout must be at least 10ms; groups beat every 100ms by default"
                    .into(),
            ));
        }
        if self.jobs.max_jobs == 0 {
            return Err(Error::InvalidConfig(
                "--max-jobs must be at least 1 (the default job is one)".into(),
            ));
        }
        if self.jobs.forget_after < Duration::from_millis(10) {
            return Err(Error::InvalidConfig(
                "--forget-jobs-after must be at least 10ms, e.g. 10m".into(),
            ));
        }
        if self.rollback_after < self.heartbeat_timeout {
            return Err(Error::InvalidConfig(format!(
                "--rollback-after ({:?}) is shorter than --heartbeat-timeout ({:?}): a group \
                 holding the job's newest state would be given up before it is even known to \
                 be silent; give at least the heartbeat timeout (default 30s)",
                self.rollback_after, self.heartbeat_timeout
            )));
        }
        Ok(())
    }
}

/// Refuses a lighthouse that other hosts could reach without a token (I8): whoever
/// joins its quorums is sent the job's state and handed its peers' tokens. The bound
/// address decides, so a host name or the wildcard is judged by what it is.
fn check_exposure(options: &LighthouseOptions, bound: SocketAddr) -> Result<(), Error> {
    if options.token.is_set() || !auth::reachable_from_other_hosts(bound.ip()) {
        return Ok(());
    }
    if options.insecure {
        tracing::warn!(
            "the lighthouse serves {bound} without a job token (--insecure): anyone who \
             can reach it can join the job's quorums, and read or replace its model"
        );
        return Ok(());
    }
    // The port asked for, not the one picked: the fix is to the command as typed.
    let port = options
        .bind
        .rsplit_once(':')
        .map_or("29510", |(_, port)| port);
    Err(Error::InvalidConfig(format!(
        "refusing to serve the lighthouse on {} without a job token: other hosts can \
         reach it, and anyone who connects could join the job's quorums as a replica \
         group, stall its training, and read or replace its model. Either give it a \
         token (--token-file FILE, written once by `phalanx token FILE`; or \
         PHALANX_TOKEN), or bind loopback for a job on this host only (--bind \
         127.0.0.1:{port}), or pass --insecure on a network where you trust every host \
         (from Python: LighthouseServer(token=...), bind=\"127.0.0.1:0\" or \
         insecure=True)",
        options.bind
    )))
}

/// Reads beats as datagrams on UDP `bound` (the TCP listener's address and port),
/// and returns the channels to offer framed streams. A port some other program holds
/// costs the offer, never the lighthouse: its groups beat on their streams.
fn take_datagrams(
    site: &Site,
    bound: SocketAddr,
    shutdown: watch::Receiver<bool>,
) -> Option<Arc<Channels>> {
    let channels = datagrams::Channels::new(&site.metrics);
    let reading = datagrams::bind(bound)
        .and_then(|socket| datagrams::spawn_reader(socket, channels.clone(), shutdown));
    match reading {
        Ok(_) => Some(channels),
        Err(e) => {
            tracing::warn!(
                "no heartbeat datagrams on UDP {bound}: {e}; groups beat on their streams \
                 (free the UDP port, or give --no-datagrams to say so)"
            );
            None
        }
    }
}

/// Starts a lighthouse on the current tokio runtime.
pub async fn serve(options: LighthouseOptions) -> Result<ServerHandle, Error> {
    serve_in_set(options, None).await
}

/// Starts a lighthouse, one of a set when `set` is given: it then serves only while
/// the set's Raft makes it leader and a majority's lease holds (see `leadership`).
pub async fn serve_in_set(
    options: LighthouseOptions,
    set: Option<SetOptions>,
) -> Result<ServerHandle, Error> {
    options.validate()?;
    if let Some(set) = &set {
        set.validate()?;
    }
    let (listener, bound) = server::bind(&options.bind).await?;
    check_exposure(&options, bound)?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let defaults = Tuning {
        min_replicas: options.min_replicas,
        join_timeout: options.join_timeout,
        heartbeat_timeout: options.heartbeat_timeout,
        rollback_after: options.rollback_after,
        max_groups: options.connections.max_connections,
    };
    let site = Site::new(defaults, options.jobs, shutdown_rx.clone());
    let datagrams = if options.datagrams {
        take_datagrams(&site, bound, shutdown_rx.clone())
    } else {
        None
    };
    let grpc = LighthouseServer::new(LighthouseService { site: site.clone() })
        .max_decoding_message_size(MAX_REQUEST_BYTES);
    let grpc = InterceptedService::new(grpc, JobCheck(options.token.clone()));
    let seat = match set {
        Some(set) => {
            let seat = Seat::new(set, &options.token, site.metrics.raft_refused.clone())?;
            let _ = site.seat.set(seat.clone());
            Some(seat)
        }
        None => None,
    };
    let mut routes = Routes::new(grpc);
    if let Some(seat) = &seat {
        let set_grpc = LighthouseSetServer::new(SetService { seat: seat.clone() })
            .max_decoding_message_size(set::MAX_RAFT_BYTES);
        routes = routes.add_service(InterceptedService::new(set_grpc, options.token.clone()));
    }
    let routes = routes
        .into_axum_router()
        .merge(http::router(site.clone(), options.token.clone()));
    let admitted = options.connections.max_connections;
    if let Some(warning) = fdlimit::ensure(admitted, &format!("its {admitted} connections")) {
        tracing::warn!("{warning}");
    }
    let door = Door::new(options.connections, site.metrics.refusals.clone());
    let framed: FramedDoor = {
        let (site, token) = (site.clone(), options.token.clone());
        Arc::new(move |conn| {
            let serving = wire::serve(conn, site.clone(), datagrams.clone(), token.clone());
            tokio::spawn(serving);
        })
    };
    let mut handle = server::spawn(
        listener,
        Vec::new(),
        routes.into(),
        shutdown,
        door,
        Some(framed),
    );
    if let Some(seat) = seat {
        let serving = site.clone();
        handle.add_task(tokio::spawn(
            seat.run(move |term| serving.serve_in(term), shutdown_rx.clone()),
        ));
    }
    handle.add_task(tokio::spawn(site.forget_idle_jobs(shutdown_rx)));
    tracing::debug!(
        address = %handle.local_addr(),
        min_replicas = options.min_replicas,
        "lighthouse listening (status page at http://{}/)",
        handle.local_addr()
    );
    Ok(handle)
}
