//! The store's gRPC service: thin I/O around `KeyValueStore`. A call that waits for
//! keys is event-driven: every change bumps a `watch` channel, and a waiter looks at
//! the store again only when it moved, until its deadline.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::{KeyValueStore, StoreLimits};
use crate::proto::{self, store_server};
use crate::validate;

/// The largest request the service decodes: a value at its limit, its key and framing.
pub fn max_request_bytes(limits: &StoreLimits) -> usize {
    limits.max_value_bytes + limits.max_key_bytes + 1024
}

/// Keys one Wait or Check may name; a process group names one per peer.
pub const MAX_KEYS_PER_CALL: usize = 65_536;
/// Values a Wait answers with, together at most: a rendezvous value is an address.
pub const MAX_WAIT_VALUES_BYTES: usize = 64 << 10;

/// A store shared by its service and its owner (the manager server, which drops the
/// keys of quorums its group has moved on from).
#[derive(Clone)]
pub struct SharedStore {
    state: Arc<Mutex<KeyValueStore>>,
    changed: Arc<watch::Sender<u64>>,
}

impl SharedStore {
    pub fn new(limits: StoreLimits) -> Self {
        let (changed, _) = watch::channel(0);
        SharedStore {
            state: Arc::new(Mutex::new(KeyValueStore::new(limits))),
            changed: Arc::new(changed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, KeyValueStore> {
        // Every change is complete before the lock is released; a panic leaves none half done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `change` on the store and wakes the waiters if it changed anything.
    pub fn update<T>(&self, change: impl FnOnce(&mut KeyValueStore) -> T) -> T {
        let (result, changes) = {
            let mut store = self.lock();
            let result = change(&mut store);
            (result, store.changes())
        };
        self.changed.send_if_modified(|seen| {
            let moved = *seen != changes;
            *seen = changes;
            moved
        });
        result
    }

    pub fn read<T>(&self, look: impl FnOnce(&KeyValueStore) -> T) -> T {
        look(&self.lock())
    }

    /// Waits until `ready` finds what it looks for, or `deadline` passes (None).
    pub async fn wait_for<T>(
        &self,
        deadline: Instant,
        mut ready: impl FnMut(&KeyValueStore) -> Option<T>,
    ) -> Option<T> {
        // Subscribed before the first look, so that no change between the look and
        // the wait goes unnoticed.
        let mut changed = self.changed.subscribe();
        loop {
            if let Some(found) = ready(&self.lock()) {
                return Some(found);
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                // The sender lives as long as `self`; only the deadline ends the wait.
                Ok(Err(_)) | Err(_) => return None,
            }
        }
    }
}

pub struct StoreService {
    store: SharedStore,
}

impl StoreService {
    pub fn new(store: SharedStore) -> Self {
        StoreService { store }
    }
}

fn keys(keys: &[String]) -> Result<(), Status> {
    if keys.len() > MAX_KEYS_PER_CALL {
        return Err(Status::invalid_argument(format!(
            "{} keys in one call; name at most {MAX_KEYS_PER_CALL}",
            keys.len()
        )));
    }
    Ok(())
}

fn not_set(what: &str, timeout: Duration) -> Status {
    Status::deadline_exceeded(format!(
        "{what} not set in the rendezvous store within {:.3} s: the peer that should set \
         it has not (yet) started, or is gone",
        timeout.as_secs_f64()
    ))
}

#[tonic::async_trait]
impl store_server::Store for StoreService {
    async fn set(
        &self,
        request: Request<proto::StoreSetRequest>,
    ) -> Result<Response<proto::StoreSetResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        self.store.update(|s| s.set(&req.key, req.value))?;
        Ok(Response::new(proto::StoreSetResponse {}))
    }

    async fn get(
        &self,
        request: Request<proto::StoreGetRequest>,
    ) -> Result<Response<proto::StoreGetResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        let timeout = validate::timeout_ms(req.timeout_ms)?;
        self.store.read(|s| s.check_key(&req.key))?;
        let value = self
            .store
            .wait_for(Instant::now() + timeout, |s| s.get(&req.key))
            .await
            .ok_or_else(|| not_set(&format!("key {:?} was", req.key), timeout))?;
        Ok(Response::new(proto::StoreGetResponse { value }))
    }

    async fn add(
        &self,
        request: Request<proto::StoreAddRequest>,
    ) -> Result<Response<proto::StoreAddResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        let value = self.store.update(|s| s.add(&req.key, req.delta))?;
        Ok(Response::new(proto::StoreAddResponse { value }))
    }

    async fn compare_set(
        &self,
        request: Request<proto::StoreCompareSetRequest>,
    ) -> Result<Response<proto::StoreCompareSetResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        let swap = self
            .store
            .update(|s| s.compare_set(&req.key, &req.expected, req.desired))?;
        Ok(Response::new(proto::StoreCompareSetResponse {
            current: swap.current,
        }))
    }

    async fn check(
        &self,
        request: Request<proto::StoreKeysRequest>,
    ) -> Result<Response<proto::StoreCheckResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        keys(&req.keys)?;
        let all_set = self.store.read(|s| s.contains_all(&req.keys));
        Ok(Response::new(proto::StoreCheckResponse { all_set }))
    }

    async fn wait(
        &self,
        request: Request<proto::StoreKeysRequest>,
    ) -> Result<Response<proto::StoreWaitResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        let timeout = validate::timeout_ms(req.timeout_ms)?;
        keys(&req.keys)?;
        let deadline = Instant::now() + timeout;
        let values = self
            .store
            .wait_for(deadline, |s| s.values_of(&req.keys, MAX_WAIT_VALUES_BYTES))
            .await;
        let Some(values) = values else {
            let missing = self
                .store
                .read(|s| s.first_missing(&req.keys).map(str::to_string))
                .unwrap_or_default();
            let what = match req.keys.len() {
                1 => format!("key {missing:?} was"),
                n => format!("key {missing:?} (one of {n} awaited) was"),
            };
            return Err(not_set(&what, timeout));
        };
        Ok(Response::new(proto::StoreWaitResponse { values }))
    }

    async fn delete_key(
        &self,
        request: Request<proto::StoreDeleteRequest>,
    ) -> Result<Response<proto::StoreDeleteResponse>, Status> {
        let req = request.into_inner();
        validate::protocol_version(req.protocol_version)?;
        let deleted = self.store.update(|s| s.delete(&req.key));
        Ok(Response::new(proto::StoreDeleteResponse { deleted }))
    }

    async fn num_keys(
        &self,
        request: Request<proto::StoreNumKeysRequest>,
    ) -> Result<Response<proto::StoreNumKeysResponse>, Status> {
        validate::protocol_version(request.into_inner().protocol_version)?;
        let keys = self.store.read(|s| s.len()) as i64;
        Ok(Response::new(proto::StoreNumKeysResponse { keys }))
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_when_its_key_is_set_and_not_before() {
        let store = SharedStore::new(StoreLimits::default());
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(10);
                store.wait_for(deadline, |s| s.get("k")).await
            })
        };
        store.update(|s| s.set("other", Bytes::from("x"))).unwrap();
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        store.update(|s| s.set("k", Bytes::from("v"))).unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), "v");
    }

    #[tokio::test]
    async fn a_waiter_gives_up_at_its_deadline() {
        let store = SharedStore::new(StoreLimits::default());
        let deadline = Instant::now() + Duration::from_millis(50);
        assert_eq!(store.wait_for(deadline, |s| s.get("k")).await, None);
        assert!(Instant::now() >= deadline);
    }
}
