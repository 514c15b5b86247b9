//! A client of a replica group's rendezvous store. Every call has a deadline (I6).
//! The calls that wait for keys (`get`, `wait`) also wait for the store itself: a
//! group's rank 0 may still be starting when its other ranks, or the other groups'
//! ranks, first ask, so an unreachable store is asked again until the deadline.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tonic::Code;

use crate::auth::JobToken;
use crate::proto::{self, store_client, PROTOCOL_VERSION};
use crate::transport::{
    call, channel, jittered, timeout_ms, with_timeout, Authed, MAX_RESPONSE_BYTES,
    MAX_RETRY_BACKOFF, MIN_RETRY_BACKOFF,
};
use crate::Error;

const WHAT: &str = "rendezvous store";

#[derive(Clone)]
pub struct StoreClient {
    address: String,
    inner: store_client::StoreClient<Authed>,
}

/// Whether `error` says the store could not be reached at all (nothing was done).
fn unreachable(error: &Error) -> bool {
    match error {
        Error::Connect { .. } => true,
        Error::Rpc(status) => status.code() == Code::Unavailable,
        _ => false,
    }
}

impl StoreClient {
    /// Does not connect yet: the first call does.
    pub fn new(address: &str, token: &JobToken, connect_timeout: Duration) -> Result<Self, Error> {
        let (channel, attach) = channel(address, token, connect_timeout)?;
        Ok(StoreClient {
            address: address.to_string(),
            inner: store_client::StoreClient::with_interceptor(channel, attach)
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs `attempt` (given the time left) until it reaches the store or `timeout`
    /// has passed: the waiting calls wait for a store that is still starting, too.
    async fn patiently<T, F>(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut(Duration) -> F,
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>>,
    {
        let deadline = Instant::now() + timeout;
        let mut backoff = MIN_RETRY_BACKOFF;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let result = attempt(left.max(Duration::from_millis(1))).await;
            let pause = jittered(backoff);
            match result {
                Err(e) if unreachable(&e) && Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    backoff = (backoff * 2).min(MAX_RETRY_BACKOFF);
                }
                other => return other,
            }
        }
    }

    pub async fn set(&self, key: String, value: Bytes, timeout: Duration) -> Result<(), Error> {
        let request = proto::StoreSetRequest {
            protocol_version: PROTOCOL_VERSION,
            key,
            value,
        };
        let mut client = self.inner.clone();
        let call_ = client.set(with_timeout(request, timeout));
        call(WHAT, &self.address, timeout, call_).await.map(|_| ())
    }

    /// The value of `key`, once it is set, waiting up to `timeout`.
    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Bytes, Error> {
        self.patiently(timeout, |left| {
            let request = proto::StoreGetRequest {
                protocol_version: PROTOCOL_VERSION,
                key: key.to_string(),
                timeout_ms: timeout_ms(left),
            };
            let mut client = self.inner.clone();
            async move {
                let response = client.get(with_timeout(request, left));
                call(WHAT, &self.address, left, response).await
            }
        })
        .await
        .map(|r| r.value)
    }

    pub async fn add(&self, key: String, delta: i64, timeout: Duration) -> Result<i64, Error> {
        let request = proto::StoreAddRequest {
            protocol_version: PROTOCOL_VERSION,
            key,
            delta,
        };
        let mut client = self.inner.clone();
        let response = client.add(with_timeout(request, timeout));
        Ok(call(WHAT, &self.address, timeout, response).await?.value)
    }

    /// Sets `key` to `desired` if it holds `expected`; returns what it holds now.
    pub async fn compare_set(
        &self,
        key: String,
        expected: Vec<u8>,
        desired: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, Error> {
        let request = proto::StoreCompareSetRequest {
            protocol_version: PROTOCOL_VERSION,
            key,
            expected,
            desired,
        };
        let mut client = self.inner.clone();
        let response = client.compare_set(with_timeout(request, timeout));
        Ok(call(WHAT, &self.address, timeout, response).await?.current)
    }

    pub async fn check(&self, keys: Vec<String>, timeout: Duration) -> Result<bool, Error> {
        let request = proto::StoreKeysRequest {
            protocol_version: PROTOCOL_VERSION,
            keys,
            timeout_ms: 0,
        };
        let mut client = self.inner.clone();
        let response = client.check(with_timeout(request, timeout));
        Ok(call(WHAT, &self.address, timeout, response).await?.all_set)
    }

    /// Returns once every one of `keys` is set, waiting up to `timeout`, with their
    /// values when they are small (else none).
    pub async fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<Bytes>, Error> {
        self.patiently(timeout, |left| {
            let request = proto::StoreKeysRequest {
                protocol_version: PROTOCOL_VERSION,
                keys: keys.to_vec(),
                timeout_ms: timeout_ms(left),
            };
            let mut client = self.inner.clone();
            async move {
                let response = client.wait(with_timeout(request, left));
                call(WHAT, &self.address, left, response).await
            }
        })
        .await
        .map(|r| r.values)
    }

    pub async fn delete_key(&self, key: String, timeout: Duration) -> Result<bool, Error> {
        let request = proto::StoreDeleteRequest {
            protocol_version: PROTOCOL_VERSION,
            key,
        };
        let mut client = self.inner.clone();
        let response = client.delete_key(with_timeout(request, timeout));
        Ok(call(WHAT, &self.address, timeout, response).await?.deleted)
    }

    pub async fn num_keys(&self, timeout: Duration) -> Result<i64, Error> {
        let request = proto::StoreNumKeysRequest {
            protocol_version: PROTOCOL_VERSION,
        };
        let mut client = self.inner.clone();
        let response = client.num_keys(with_timeout(request, timeout));
        Ok(call(WHAT, &self.address, timeout, response).await?.keys)
    }
}
