//! Prometheus metrics of the lighthouse, served at `/metrics`.

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::state::Eviction;
use crate::gate::{RefusalCounts, Refusals};

type Labels = Vec<(&'static str, &'static str)>;
type GroupLabels = Vec<(&'static str, String)>;

pub struct Metrics {
    registry: Registry,
    pub quorum_id: Gauge,
    pub live_replicas: Gauge,
    pub quorums_issued: Counter,
    pub quorum_changes: Counter,
    pub quorum_wait_seconds: Histogram,
    pub heartbeats: Counter,
    pub evictions: Family<Labels, Counter>,
    pub refusals: Refusals,
    group_refusals: Family<GroupLabels, Counter>,
    /// What each replica id reported last: its counts are totals since its manager
    /// server started, so the counters grow by the difference.
    group_reported: Mutex<HashMap<String, RefusalCounts>>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("phalanx_lighthouse");
        let m = Metrics {
            quorum_id: Gauge::default(),
            live_replicas: Gauge::default(),
            quorums_issued: Counter::default(),
            quorum_changes: Counter::default(),
            // 100 µs to ~105 s.
            quorum_wait_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 21)),
            heartbeats: Counter::default(),
            evictions: Family::default(),
            refusals: Refusals::default(),
            group_refusals: Family::default(),
            group_reported: Mutex::default(),
            registry: Registry::default(),
        };
        registry.register("quorum_id", "Id of the current quorum", m.quorum_id.clone());
        registry.register(
            "live_replicas",
            "Replica groups with a fresh heartbeat",
            m.live_replicas.clone(),
        );
        registry.register(
            "quorums_issued",
            "Quorum rounds answered",
            m.quorums_issued.clone(),
        );
        registry.register(
            "quorum_changes",
            "Quorums issued with a new id (membership changed or a commit failed)",
            m.quorum_changes.clone(),
        );
        registry.register(
            "quorum_wait_seconds",
            "From the first request of a round to the quorum being issued",
            m.quorum_wait_seconds.clone(),
        );
        registry.register("heartbeats", "Heartbeats received", m.heartbeats.clone());
        registry.register(
            "evictions",
            "Replica groups declared dead, by cause",
            m.evictions.clone(),
        );
        registry.register(
            "refused_requests",
            "Requests and connections refused, by reason",
            m.refusals.family(),
        );
        registry.register(
            "group_refused_requests",
            "Requests and connections refused by a replica group's manager server and state \
             servers, by group and reason",
            m.group_refusals.clone(),
        );
        for cause in Eviction::ALL {
            m.evicted_family(cause);
        }
        Metrics { registry, ..m }
    }

    pub fn evicted(&self, cause: Eviction) {
        self.evicted_family(cause).inc();
    }

    fn evicted_family(&self, cause: Eviction) -> Counter {
        self.evictions
            .get_or_create(&vec![("cause", cause.as_str())])
            .clone()
    }

    /// `replica_id` reported `counts`, its totals so far.
    pub fn group_refused(&self, replica_id: &str, counts: RefusalCounts) {
        let mut reported = self
            .group_reported
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let before = reported.entry(replica_id.to_string()).or_default();
        for &(reason, count) in &counts {
            let was = before
                .iter()
                .find(|(r, _)| *r == reason)
                .map_or(0, |(_, n)| *n);
            // Fewer than before: a restarted group counting from zero again.
            let grown = if count >= was { count - was } else { count };
            if grown > 0 {
                self.group_refusals
                    .get_or_create(&vec![
                        ("replica_id", replica_id.to_string()),
                        ("reason", reason.as_str().into()),
                    ])
                    .inc_by(grown);
            }
        }
        *before = counts;
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
