//! The job's rendezvous store: the keys and values torch.distributed's process groups
//! exchange to find each other (gloo's addresses, NCCL's unique id), served by each
//! replica group's manager server behind the job token (I8), so that nobody without
//! the token can join a process group or change what its members read.
//!
//! This file is the store as pure state: no sockets, no clocks. Waiting for a key is
//! the service's part (`service.rs`); it asks `changes()` whether anything happened.
//!
//! The semantics follow what torch.distributed's stores promise, so that gloo and
//! NCCL can use it unchanged: `add` keeps a decimal counter, `compare_set` swaps only
//! when the current value is the expected one (an absent key matches an empty
//! expected value), and every write is visible to every later read.

pub mod client;
pub mod service;

use std::collections::BTreeMap;

use bytes::Bytes;
use tonic::Status;

/// How much one client may put into the store. A buggy client that writes in a loop
/// hits one of these, and hears which; the store and the job's other process groups
/// go on serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    pub max_key_bytes: usize,
    pub max_value_bytes: usize,
    pub max_keys: usize,
    pub max_total_bytes: usize,
}

impl Default for StoreLimits {
    /// Far above what rendezvous needs: gloo writes one key of a few hundred bytes
    /// per rank and group, NCCL one of 128 bytes; the keys of a quorum the group has
    /// moved on from are dropped (see `remove_prefix`).
    fn default() -> Self {
        StoreLimits {
            max_key_bytes: 4 << 10,
            max_value_bytes: 4 << 20,
            max_keys: 100_000,
            max_total_bytes: 256 << 20,
        }
    }
}

/// Why the store refused a request; each says which limit or rule and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("store key of {len} bytes is longer than the limit of {limit}; use shorter keys")]
    KeyTooLong { len: usize, limit: usize },
    #[error("store key is empty; name every key")]
    EmptyKey,
    #[error(
        "value of {len} bytes for store key {key:?} is larger than the limit of {limit}; \
         a rendezvous value is an address or an id, send large data another way"
    )]
    ValueTooLarge {
        key: String,
        len: usize,
        limit: usize,
    },
    #[error(
        "the rendezvous store holds {keys} keys, its limit: a client sets keys without \
         ever deleting them; delete the keys you no longer need (delete_key)"
    )]
    TooManyKeys { keys: usize },
    #[error(
        "the rendezvous store would hold more than {limit} bytes with {key:?}: a client \
         sets keys without ever deleting them; delete the keys you no longer need \
         (delete_key)"
    )]
    Full { key: String, limit: usize },
    #[error(
        "store key {key:?} holds a value that is not a counter ({value:?}); add() only \
         counts on keys that add() created, use another key"
    )]
    NotACounter { key: String, value: String },
    #[error("add({delta}) to store key {key:?} at {current} overflows a 64-bit counter")]
    Overflow {
        key: String,
        current: i64,
        delta: i64,
    },
}

impl From<StoreError> for Status {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::TooManyKeys { .. } | StoreError::Full { .. } => {
                Status::resource_exhausted(e.to_string())
            }
            StoreError::NotACounter { .. } => Status::failed_precondition(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        }
    }
}

/// What a `compare_set` found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Swap {
    /// The value the key holds now (after the swap, if it took place). For an absent
    /// key and a non-empty expected value, the expected value: the caller sees that
    /// its swap did not take place, as with torch's own stores.
    pub current: Bytes,
    pub swapped: bool,
}

/// The keys and values of one store, with the limits checked on every write.
#[derive(Debug, Default)]
pub struct KeyValueStore {
    entries: BTreeMap<String, Bytes>,
    /// Bytes of every key and value held.
    total_bytes: usize,
    limits: StoreLimits,
    /// Bumped by every change, so that a waiter can tell whether to look again.
    changes: u64,
}

impl KeyValueStore {
    pub fn new(limits: StoreLimits) -> Self {
        KeyValueStore {
            limits,
            ..KeyValueStore::default()
        }
    }

    /// How many changes the store has seen; it grows with every write and delete.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn check_key(&self, key: &str) -> Result<(), StoreError> {
        if key.is_empty() {
            return Err(StoreError::EmptyKey);
        }
        if key.len() > self.limits.max_key_bytes {
            return Err(StoreError::KeyTooLong {
                len: key.len(),
                limit: self.limits.max_key_bytes,
            });
        }
        Ok(())
    }

    /// Stores `value` under `key`, replacing what was there.
    pub fn set(&mut self, key: &str, value: Bytes) -> Result<(), StoreError> {
        self.check_key(key)?;
        if value.len() > self.limits.max_value_bytes {
            return Err(StoreError::ValueTooLarge {
                key: key.into(),
                len: value.len(),
                limit: self.limits.max_value_bytes,
            });
        }
        let old = self.entries.get(key).map(|v| key.len() + v.len());
        if old.is_none() && self.entries.len() >= self.limits.max_keys {
            return Err(StoreError::TooManyKeys {
                keys: self.entries.len(),
            });
        }
        let total = self.total_bytes - old.unwrap_or(0) + key.len() + value.len();
        if total > self.limits.max_total_bytes {
            return Err(StoreError::Full {
                key: key.into(),
                limit: self.limits.max_total_bytes,
            });
        }
        self.total_bytes = total;
        self.entries.insert(key.to_string(), value);
        self.changes += 1;
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<Bytes> {
        self.entries.get(key).cloned()
    }

    /// Adds `delta` to the counter at `key` (absent: 0) and returns its new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.check_key(key)?;
        let current = match self.entries.get(key) {
            None => 0,
            Some(value) => std::str::from_utf8(value)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
                .ok_or_else(|| StoreError::NotACounter {
                    key: key.into(),
                    value: String::from_utf8_lossy(&value[..value.len().min(32)]).into(),
                })?,
        };
        let next = current.checked_add(delta).ok_or(StoreError::Overflow {
            key: key.into(),
            current,
            delta,
        })?;
        self.set(key, Bytes::from(next.to_string()))?;
        Ok(next)
    }

    /// Sets `key` to `desired` if it holds `expected` (an absent key holds "" here).
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: &[u8],
        desired: Bytes,
    ) -> Result<Swap, StoreError> {
        self.check_key(key)?;
        match self.entries.get(key) {
            Some(current) if current.as_ref() != expected => Ok(Swap {
                current: current.clone(),
                swapped: false,
            }),
            None if !expected.is_empty() => Ok(Swap {
                current: Bytes::copy_from_slice(expected),
                swapped: false,
            }),
            _ => {
                self.set(key, desired.clone())?;
                Ok(Swap {
                    current: desired,
                    swapped: true,
                })
            }
        }
    }

    /// Whether every one of `keys` is set.
    pub fn contains_all<'a>(&self, keys: impl IntoIterator<Item = &'a String>) -> bool {
        keys.into_iter().all(|k| self.entries.contains_key(k))
    }

    /// None until every one of `keys` is set; then their values in order, or no
    /// values when together they are larger than `max_bytes`.
    pub fn values_of(&self, keys: &[String], max_bytes: usize) -> Option<Vec<Bytes>> {
        let values: Vec<Bytes> = keys
            .iter()
            .map(|k| self.entries.get(k).cloned())
            .collect::<Option<_>>()?;
        let small = values.iter().map(Bytes::len).sum::<usize>() <= max_bytes;
        Some(if small { values } else { Vec::new() })
    }

    /// The first of `keys` that is not set, if any.
    pub fn first_missing<'a>(&self, keys: &'a [String]) -> Option<&'a str> {
        keys.iter()
            .find(|k| !self.entries.contains_key(k.as_str()))
            .map(String::as_str)
    }

    /// Deletes `key`; whether it was there.
    pub fn delete(&mut self, key: &str) -> bool {
        match self.entries.remove(key) {
            Some(value) => {
                self.total_bytes -= key.len() + value.len();
                self.changes += 1;
                true
            }
            None => false,
        }
    }

    /// Deletes every key that starts with `prefix`; how many there were. The manager
    /// server drops a quorum's keys this way once its group has moved on from it.
    pub fn remove_prefix(&mut self, prefix: &str) -> usize {
        let doomed: Vec<String> = self
            .entries
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &doomed {
            self.delete(key);
        }
        doomed.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> KeyValueStore {
        KeyValueStore::new(StoreLimits {
            max_key_bytes: 16,
            max_value_bytes: 8,
            max_keys: 3,
            max_total_bytes: 24,
        })
    }

    #[test]
    fn a_value_set_is_read_back_and_replaced() {
        let mut s = store();
        assert_eq!(s.get("a"), None);
        s.set("a", Bytes::from("1")).unwrap();
        s.set("a", Bytes::from("22")).unwrap();
        assert_eq!(s.get("a").unwrap(), "22");
        assert_eq!((s.len(), s.total_bytes()), (1, 3));
    }

    #[test]
    fn add_counts_from_zero_and_refuses_a_value_that_is_not_a_counter() {
        let mut s = store();
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.add("n", -5).unwrap(), -3);
        assert_eq!(s.get("n").unwrap(), "-3");
        s.set("addr", Bytes::from("h:1")).unwrap();
        let err = s.add("addr", 1).unwrap_err();
        assert!(err.to_string().contains("not a counter"), "{err}");
        let mut roomy = KeyValueStore::new(StoreLimits::default());
        roomy.add("max", i64::MAX).unwrap();
        assert!(matches!(
            roomy.add("max", 1),
            Err(StoreError::Overflow { .. })
        ));
    }

    #[test]
    fn compare_set_swaps_only_what_holds_the_expected_value() {
        let mut s = store();
        // Absent and expected "": created.
        let swap = s.compare_set("k", b"", Bytes::from("a")).unwrap();
        assert_eq!((swap.current.as_ref(), swap.swapped), (&b"a"[..], true));
        // Present but not as expected: left alone, the caller sees the value.
        let swap = s.compare_set("k", b"x", Bytes::from("b")).unwrap();
        assert_eq!((swap.current.as_ref(), swap.swapped), (&b"a"[..], false));
        let swap = s.compare_set("k", b"a", Bytes::from("b")).unwrap();
        assert_eq!((swap.current.as_ref(), swap.swapped), (&b"b"[..], true));
        // Absent and something else expected: not created.
        let swap = s.compare_set("other", b"x", Bytes::from("y")).unwrap();
        assert_eq!((swap.current.as_ref(), swap.swapped), (&b"x"[..], false));
        assert_eq!(s.get("other"), None);
    }

    #[test]
    fn every_limit_is_named_when_it_is_hit_and_nothing_changes() {
        let mut s = store();
        let long = "k".repeat(17);
        assert!(s
            .set(&long, Bytes::new())
            .unwrap_err()
            .to_string()
            .contains("17 bytes"));
        assert_eq!(s.set("", Bytes::new()), Err(StoreError::EmptyKey));
        let err = s.set("k", Bytes::from("123456789")).unwrap_err();
        assert!(err.to_string().contains("limit of 8"), "{err}");
        for key in ["a", "b", "c"] {
            s.set(key, Bytes::from("v")).unwrap();
        }
        let err = s.set("d", Bytes::from("v")).unwrap_err();
        assert!(err.to_string().contains("holds 3 keys"), "{err}");
        // Replacing a key needs no new one.
        s.set("a", Bytes::from("12345678")).unwrap();
        s.set("b", Bytes::from("12345678")).unwrap();
        let err = s.set("c", Bytes::from("12345678")).unwrap_err();
        assert!(matches!(err, StoreError::Full { limit: 24, .. }), "{err}");
        assert_eq!((s.len(), s.total_bytes()), (3, 20));
        assert_eq!(Status::from(err).code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn deleting_frees_room_and_counts_as_a_change() {
        let mut s = store();
        s.set("a", Bytes::from("v")).unwrap();
        let before = s.changes();
        assert!(s.delete("a"));
        assert!(!s.delete("a"));
        assert_eq!((s.len(), s.total_bytes()), (0, 0));
        assert_eq!(s.changes(), before + 1);
    }

    #[test]
    fn a_prefix_removes_its_keys_only() {
        let mut s = KeyValueStore::new(StoreLimits::default());
        for key in [
            "phalanx/q1/r0/0",
            "phalanx/q1/r1/0",
            "phalanx/q10/r0/0",
            "z",
        ] {
            s.set(key, Bytes::from("v")).unwrap();
        }
        assert_eq!(s.remove_prefix("phalanx/q1/"), 2);
        assert!(s.contains_all(&["phalanx/q10/r0/0".to_string(), "z".to_string()]));
        assert_eq!(
            s.first_missing(&["z".into(), "phalanx/q1/r0/0".into()]),
            Some("phalanx/q1/r0/0")
        );
    }

    #[test]
    fn values_of_keys_come_once_all_are_set_and_only_when_small() {
        let mut s = KeyValueStore::new(StoreLimits::default());
        let keys = ["a".to_string(), "b".to_string()];
        s.set("a", Bytes::from("1")).unwrap();
        assert_eq!(s.values_of(&keys, 8), None);
        s.set("b", Bytes::from("22")).unwrap();
        assert_eq!(s.values_of(&keys, 8).unwrap(), vec!["1", "22"]);
        assert_eq!(s.values_of(&keys, 2).unwrap(), Vec::<Bytes>::new());
    }
}
