//! Prometheus metrics of the lighthouse, served at `/metrics`.

use std::collections::{HashMap, HashSet};
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

    /// In OpenMetrics' text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// The samples of an OpenMetrics exposition in Prometheus' older text format
/// (`text/plain; version=0.0.4`), which scrapers and `promtool` read when they do not
/// ask for OpenMetrics: a counter's family is named by its samples (`…_total`), and
/// there is no `# EOF` or `# UNIT`.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    out.push_str(&format!("{prefix}{name}_total {tail}"));
                } else {
                    out.push_str(line);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_by_their_samples_in_the_prometheus_text_format() {
        let om = "# HELP a_heartbeats Heartbeats received.\n# TYPE a_heartbeats counter\n\
                  a_heartbeats_total 3\n# HELP a_live Live.\n# TYPE a_live gauge\na_live 1\n# EOF\n";
        assert_eq!(
            prometheus_text(om),
            "# HELP a_heartbeats_total Heartbeats received.\n# TYPE a_heartbeats_total counter\n\
             a_heartbeats_total 3\n# HELP a_live Live.\n# TYPE a_live gauge\na_live 1\n"
        );
    }

    #[test]
    fn every_family_is_there_before_its_first_event() {
        let text = Metrics::new().render();
        for family in [
            "evictions",
            "refused_requests",
            "heartbeats",
            "quorum_changes",
        ] {
            assert!(
                text.contains(&format!("# TYPE phalanx_lighthouse_{family} counter")),
                "{family} missing:\n{text}"
            );
        }
        assert!(text.contains(r#"phalanx_lighthouse_evictions_total{cause="stream_broken"} 0"#));
        assert!(text.contains(r#"phalanx_lighthouse_refused_requests_total{reason="token"} 0"#));
    }
}
