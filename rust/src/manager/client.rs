//! The client of a manager server, as its group's ranks call it: over the network, or
//! straight to the server when this process hosts it. Its calls run under the
//! deadlines of `crate::transport`.

use std::future::Future;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::LocalManager;
use crate::auth::JobToken;
use crate::proto::{self, PROTOCOL_VERSION};
use crate::transport::{call, channel, timeout_ms, with_timeout, Authed, MAX_RESPONSE_BYTES};
use crate::Error;

/// The server a failed call names.
const WHAT: &str = "manager server";

type Remote = proto::manager_client::ManagerClient<Authed>;

#[derive(Clone)]
pub struct ManagerClient {
    address: String,
    inner: Remote,
    /// The manager server itself, when this process hosts it: quorums, votes and
    /// progress go to it directly (events still come over the network).
    local: Option<LocalManager>,
}

impl ManagerClient {
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let (channel, attach) = channel(address, token, connect_timeout)?;
        Ok(ManagerClient {
            address: address.to_string(),
            inner: proto::manager_client::ManagerClient::with_interceptor(channel, attach)
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
            local: None,
        })
    }

    /// This client's calls go to `server`, hosted by this process, without the network.
    pub fn in_process(self, server: LocalManager) -> Self {
        ManagerClient {
            local: Some(server),
            ..self
        }
    }

    /// Sends `message` under its deadline: to `local`, the server this process hosts,
    /// if it hosts it, else over the network by `remote`.
    async fn ask<'a, R, T, L, N>(
        &'a self,
        message: R,
        timeout: Duration,
        local: impl FnOnce(&'a LocalManager, Request<R>) -> L,
        remote: impl FnOnce(Remote, Request<R>) -> N,
    ) -> Result<T, Error>
    where
        L: Future<Output = Result<Response<T>, Status>>,
        N: Future<Output = Result<Response<T>, Status>>,
    {
        let request = with_timeout(message, timeout);
        match &self.local {
            Some(server) => call(WHAT, &self.address, timeout, local(server, request)).await,
            None => {
                let answer = remote(self.inner.clone(), request);
                call(WHAT, &self.address, timeout, answer).await
            }
        }
    }

    /// Asks for the quorum of `request.step`; the protocol version and the timeout
    /// fields are filled in here.
    pub async fn quorum(
        &self,
        request: proto::ManagerQuorumRequest,
        timeout: Duration,
    ) -> Result<proto::ManagerQuorumResponse, Error> {
        let message = proto::ManagerQuorumRequest {
            protocol_version: PROTOCOL_VERSION,
            timeout_ms: timeout_ms(timeout),
            ..request
        };
        self.ask(
            message,
            timeout,
            LocalManager::quorum,
            |mut c, r| async move { c.quorum(r).await },
        )
        .await
    }

    /// Casts `vote.group_rank`'s vote and returns the group's decision.
    pub async fn should_commit(
        &self,
        vote: proto::ShouldCommitRequest,
        timeout: Duration,
    ) -> Result<proto::ShouldCommitResponse, Error> {
        let message = proto::ShouldCommitRequest {
            protocol_version: PROTOCOL_VERSION,
            timeout_ms: timeout_ms(timeout),
            ..vote
        };
        self.ask(
            message,
            timeout,
            LocalManager::should_commit,
            |mut c, r| async move { c.should_commit(r).await },
        )
        .await
    }

    /// Reports a rank's training progress (see `proto::ProgressReport`).
    pub async fn progress(
        &self,
        report: proto::ProgressReport,
        timeout: Duration,
    ) -> Result<(), Error> {
        let message = proto::ProgressReport {
            protocol_version: PROTOCOL_VERSION,
            ..report
        };
        self.ask(
            message,
            timeout,
            LocalManager::progress,
            |mut c, r| async move { c.progress(r).await },
        )
        .await
        .map(|_| ())
    }

    /// Subscribes to the membership-loss events the manager relays.
    pub async fn events(
        &self,
        timeout: Duration,
    ) -> Result<tonic::Streaming<proto::ManagerEvent>, Error> {
        let mut client = self.inner.clone();
        call(
            WHAT,
            &self.address,
            timeout,
            client.events(proto::EventsRequest {
                protocol_version: PROTOCOL_VERSION,
            }),
        )
        .await
    }
}
