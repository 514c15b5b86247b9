//! The lighthouse's gRPC service (`Lighthouse`): a quorum call, a heartbeat stream
//! (opened as every stream is, `heartbeat`), and the status of a job. Each job's core
//! is `site::Shared`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::access::job_of;
use super::heartbeat::{self, Inbound};
use super::metrics::Via;
use super::site::{refuse, Site};
use crate::door::Ticket;
use crate::gate::Refusal;
use crate::proto::{self, lighthouse_server::Lighthouse};
use crate::validate;

pub(crate) struct LighthouseService {
    pub(crate) site: Arc<Site>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<proto::LighthouseEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Lighthouse for LighthouseService {
    async fn quorum(
        &self,
        request: Request<proto::LighthouseQuorumRequest>,
    ) -> Result<Response<proto::LighthouseQuorumResponse>, Status> {
        let shared = self.site.job(&job_of(&request))?;
        shared.metrics.quorum_request(Via::Call).inc();
        let req = request.into_inner();
        let checked = validate::protocol_version(req.protocol_version).and_then(|_| {
            let member = req
                .requester
                .ok_or_else(|| Status::invalid_argument("quorum request without a requester"))?;
            validate::member(&member)?;
            validate::quorum_id("last_quorum_id", req.last_quorum_id)?;
            Ok((member, validate::timeout_ms(req.timeout_ms)?))
        });
        let (member, timeout) = refuse(&shared.refusals, Refusal::Invalid, checked)?;
        let quorum = shared
            .quorum_for(member, req.last_quorum_id, timeout)
            .await?;
        Ok(Response::new(proto::LighthouseQuorumResponse { quorum }))
    }

    type HeartbeatStream = EventStream;

    async fn heartbeat(
        &self,
        request: Request<Streaming<proto::Beat>>,
    ) -> Result<Response<Self::HeartbeatStream>, Status> {
        let peer = request
            .extensions()
            .get::<Ticket>()
            .map_or_else(|| "unknown".to_string(), |t| t.peer().to_string());
        let job = job_of(&request);
        let inbound = Inbound::Grpc(request.into_inner());
        let events = heartbeat::open(&self.site, job, peer, inbound, None).await?;
        Ok(Response::new(Box::pin(ReceiverStream::new(events))))
    }

    async fn status(
        &self,
        request: Request<proto::StatusRequest>,
    ) -> Result<Response<proto::StatusResponse>, Status> {
        let job = job_of(&request).job;
        let Some(shared) = self.site.find(&job) else {
            return Err(Status::not_found(format!(
                "this lighthouse serves no job {job}"
            )));
        };
        let snap = shared.lock().snapshot(Instant::now());
        Ok(Response::new(proto::StatusResponse {
            quorum_id: snap.quorum_id,
            quorum_members: snap.quorum_members,
            replicas: snap
                .replicas
                .into_iter()
                .map(|r| proto::ReplicaStatus {
                    replica_id: r.replica_id,
                    connected: r.connected,
                    joined: r.joined,
                    in_quorum: r.in_quorum,
                    step: r.step,
                    heartbeat_age_ms: r.heartbeat_age_ms,
                    peer: r.peer,
                    progress_age_ms: r.progress_age_ms.unwrap_or_default(),
                    step_time_ms: r.step_time_ms.unwrap_or_default(),
                    straggler: r.straggler,
                })
                .collect(),
            waiting_for: snap.waiting_for,
            quorums_issued: snap.quorums_issued,
            uptime_ms: self.site.started.elapsed().as_millis() as u64,
            min_replicas: snap.min_replicas,
            join_timeout_ms: snap.join_timeout_ms,
            heartbeat_timeout_ms: snap.heartbeat_timeout_ms,
        }))
    }
}
