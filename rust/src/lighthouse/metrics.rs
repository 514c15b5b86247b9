//! Prometheus metrics of the lighthouse, served at `/metrics`.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry, Unit};

use super::history::{Eviction, History};
use super::jobs::JobName;
use super::snapshot::{ReplicaSnapshot, Snapshot};
use crate::gate::Refusals;

type Labels = Vec<(&'static str, &'static str)>;
/// Raft messages from peers a lighthouse of a set refused, by reason.
pub type RaftRefusals = Family<Labels, Counter>;
type GroupLabels = Vec<(&'static str, String)>;

pub struct Metrics {
    registry: Registry,
    pub quorum_id: Gauge,
    pub live_replicas: Gauge,
    pub quorums_issued: Counter,
    pub quorum_changes: Counter,
    pub rollbacks: Counter,
    pub rollback_steps_lost: Counter,
    pub quorum_wait_seconds: Histogram,
    pub heartbeats: Counter,
    /// By the way they came: `stream` (on a heartbeat stream) or `call` (a call of
    /// their own, as groups ask while no stream is open).
    pub quorum_requests: Family<Labels, Counter>,
    pub evictions: Family<Labels, Counter>,
}

/// The series of the default job carry no job label, as before a lighthouse served
/// many jobs; every other job's carry `phalanx_job` (not `job`, which Prometheus
/// gives every target it scrapes).
fn job_registry(job: &JobName) -> Registry {
    if job.is_default() {
        Registry::with_prefix(PREFIX)
    } else {
        let label = (
            Cow::Borrowed(JOB_LABEL),
            Cow::Owned(job.as_str().to_string()),
        );
        Registry::with_prefix_and_labels(PREFIX, std::iter::once(label))
    }
}

const PREFIX: &str = "phalanx_lighthouse";
const JOB_LABEL: &str = "phalanx_job";

/// The lighthouse's own series, of no one job: requests refused at its door, Raft
/// messages refused, how many jobs it serves.
pub struct SiteMetrics {
    registry: Registry,
    pub refusals: Refusals,
    /// Raft messages refused (`leadership::Refusal`), by `reason`: a buggy or
    /// hostile token holder, or a member whose state was not reset with the others.
    pub raft_refused: RaftRefusals,
    pub jobs: Gauge,
    pub jobs_forgotten: Counter,
    /// Beats taken as datagrams (`datagram`), of every job; `heartbeats` counts them
    /// too, by job.
    pub datagram_beats: Counter,
    /// Leases sent back as datagrams (renewals of datagram beats), of every job.
    pub datagram_leases: Counter,
    /// Datagrams dropped, by `reason` (`datagram::Dropped`): stray traffic, a stream
    /// that ended, or someone without the stream's key.
    pub datagrams_dropped: Family<Labels, Counter>,
}

impl SiteMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let m = SiteMetrics {
            registry: Registry::default(),
            refusals: Refusals::default(),
            raft_refused: Family::default(),
            jobs: Gauge::default(),
            jobs_forgotten: Counter::default(),
            datagram_beats: Counter::default(),
            datagram_leases: Counter::default(),
            datagrams_dropped: Family::default(),
        };
        registry.register(
            "refused_requests",
            "Requests and connections refused, by reason",
            m.refusals.family(),
        );
        registry.register(
            "raft_refused",
            "Raft messages from peers refused, by reason: term (above any the set can \
             have reached), kind (one no lighthouse sends), entry (one no leader appends)",
            m.raft_refused.clone(),
        );
        for reason in ["term", "kind", "entry"] {
            let _ = m.raft_refused.get_or_create(&vec![("reason", reason)]);
        }
        registry.register(
            "jobs",
            "Jobs served (the default job included)",
            m.jobs.clone(),
        );
        registry.register(
            "jobs_forgotten",
            "Jobs forgotten after no group used them for --forget-jobs-after",
            m.jobs_forgotten.clone(),
        );
        registry.register(
            "datagram_beats",
            "Beats taken as UDP datagrams beside their heartbeat streams",
            m.datagram_beats.clone(),
        );
        registry.register(
            "datagram_leases",
            "Leases sent back as UDP datagrams, renewing datagram beats",
            m.datagram_leases.clone(),
        );
        registry.register(
            "datagrams_dropped",
            "Datagrams dropped, by reason: garbage (no beat's layout), unknown_channel \
             (no open stream's), forged (not the stream's key), replayed (a sequence \
             number taken already)",
            m.datagrams_dropped.clone(),
        );
        for reason in crate::datagram::Dropped::ALL {
            let _ = m
                .datagrams_dropped
                .get_or_create(&vec![("reason", reason.as_str())]);
        }
        SiteMetrics { registry, ..m }
    }

    /// One exposition in OpenMetrics' text format: these series, then each job's
    /// (`Metrics::render`), every family once with the samples of all jobs.
    pub fn render(&self, jobs: &[String]) -> String {
        let mut own = String::new();
        encode(&mut own, &self.registry).expect("writing to a String cannot fail");
        let mut parts = vec![own];
        parts.extend(jobs.iter().cloned());
        merge_expositions(&parts)
    }
}

/// Expositions merged into one: a family's metadata once, then its samples from
/// every part in order (OpenMetrics wants a family's samples together).
fn merge_expositions(parts: &[String]) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut families: std::collections::HashMap<&str, (Vec<&str>, Vec<&str>)> =
        std::collections::HashMap::new();
    for part in parts {
        let mut current: Option<&str> = None;
        for line in part.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or(rest);
                current = Some(name);
                let family = families.entry(name).or_insert_with(|| {
                    order.push(name);
                    (Vec::new(), Vec::new())
                });
                if family.0.is_empty() {
                    family.0.push(line);
                }
                continue;
            }
            let Some(name) = current else { continue };
            let family = families.get_mut(name).expect("opened by its HELP line");
            if line.starts_with("# ") {
                // TYPE and UNIT: once, from the first part that has the family.
                if !family.0.contains(&line) && family.1.is_empty() {
                    family.0.push(line);
                }
            } else {
                family.1.push(line);
            }
        }
    }
    let mut out = String::new();
    for name in order {
        let (meta, samples) = &families[name];
        for line in meta.iter().chain(samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str(EOF);
    out
}

impl Metrics {
    /// The series of `job`.
    pub fn for_job(job: &JobName) -> Self {
        let mut registry = job_registry(job);
        let m = Metrics {
            quorum_id: Gauge::default(),
            live_replicas: Gauge::default(),
            quorums_issued: Counter::default(),
            quorum_changes: Counter::default(),
            rollbacks: Counter::default(),
            rollback_steps_lost: Counter::default(),
            // 100 µs to ~105 s.
            quorum_wait_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 21)),
            heartbeats: Counter::default(),
            quorum_requests: Family::default(),
            evictions: Family::default(),
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
            "rollbacks",
            "Quorums that started a new lineage: no group holding the job's newest state \
             could come back",
            m.rollbacks.clone(),
        );
        registry.register(
            "rollback_steps_lost",
            "Committed steps given up by rollbacks",
            m.rollback_steps_lost.clone(),
        );
        registry.register(
            "quorum_wait_seconds",
            "From the first request of a round to the quorum being issued",
            m.quorum_wait_seconds.clone(),
        );
        registry.register("heartbeats", "Heartbeats received", m.heartbeats.clone());
        registry.register(
            "quorum_requests",
            "Quorum requests received, by the way they came (stream or call)",
            m.quorum_requests.clone(),
        );
        for via in [Via::Stream, Via::Call] {
            m.quorum_request(via);
        }
        registry.register(
            "evictions",
            "Replica groups declared dead, by cause",
            m.evictions.clone(),
        );
        for cause in Eviction::ALL {
            m.evicted_family(cause);
        }
        Metrics { registry, ..m }
    }

    /// Counts a quorum request that came `via` that way.
    pub fn quorum_request(&self, via: Via) -> Counter {
        let via = match via {
            Via::Stream => "stream",
            Via::Call => "call",
        };
        self.quorum_requests
            .get_or_create(&vec![("via", via)])
            .clone()
    }

    pub fn evicted(&self, cause: Eviction) {
        self.evicted_family(cause).inc();
    }

    fn evicted_family(&self, cause: Eviction) -> Counter {
        self.evictions
            .get_or_create(&vec![("cause", cause.as_str())])
            .clone()
    }

    /// In OpenMetrics' text format, with the per-group series of `snapshot`, the
    /// snapshot of job `job`.
    pub fn render(&self, job: &JobName, snapshot: &Snapshot) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        // One exposition: the group families go before the end marker.
        if out.ends_with(EOF) {
            out.truncate(out.len() - EOF.len());
        }
        encode(&mut out, &group_registry(job, snapshot)).expect("writing to a String cannot fail");
        out
    }
}

/// How a quorum request reached the lighthouse.
#[derive(Clone, Copy, Debug)]
pub enum Via {
    Stream,
    Call,
}

const EOF: &str = "# EOF\n";

type FloatGauge = Gauge<f64, AtomicU64>;

/// How one per-group series is read from a snapshot.
enum Series {
    /// 1 for a live group, 0 for one lost.
    Live,
    /// A whole number of a live group; none: no sample.
    Int(fn(&ReplicaSnapshot) -> Option<i64>),
    /// A measure of a live group (seconds, or a rate); none: no sample.
    Float(fn(&ReplicaSnapshot) -> Option<f64>),
    /// A count of a live or lost group's history.
    Count(fn(&History) -> u64),
    /// The times a group was declared dead, by cause.
    LossesByCause,
    /// The requests a group's servers refused, by reason.
    RefusedByReason,
    /// The job's own measure, not a group's.
    Job(fn(&Snapshot) -> f64),
}

/// One series of `/metrics` made from the snapshot.
struct Row {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    series: Series,
}

const fn row(name: &'static str, help: &'static str, series: Series) -> Row {
    Row {
        name,
        help,
        unit: None,
        series,
    }
}

fn seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// The per-group series an operator alerts on, in the order `/metrics` lists them.
const GROUP_SERIES: &[Row] = &[
    row(
        "group_live",
        "1 for a live replica group, 0 for one declared dead in the last minutes",
        Series::Live,
    ),
    row(
        "group_step",
        "The step a live replica group reported last",
        Series::Int(|r| Some(r.step)),
    ),
    row(
        "group_step_rate",
        "Steps per second of a live replica group over the last half minute",
        Series::Float(|r| r.step_rate),
    ),
    row(
        "group_healing",
        "1 while a member of the current quorum reports a step below the quorum's max \
         step (it is fetching the state it lacks)",
        Series::Int(|r| Some(r.healing.into())),
    ),
    row(
        "group_heartbeat_age_seconds",
        "Time since a live replica group's last heartbeat",
        Series::Float(|r| Some(seconds(r.heartbeat_age_ms))),
    ),
    row(
        "group_progress_age_seconds",
        "Time since a live replica group's training last made progress (a wait on the \
         other groups within its deadline counts as progress); past its stall timeout \
         while a peer waits on it, the group is evicted",
        Series::Float(|r| r.progress_age_ms.map(seconds)),
    ),
    row(
        "group_step_time_seconds",
        "A replica group's own work in its last step (its slowest rank's), waits on the \
         other groups left out",
        Series::Float(|r| r.step_time_ms.map(seconds)),
    ),
    row(
        "group_straggler",
        "1 for a member of the quorum whose step time is at least twice the other \
         members' median",
        Series::Int(|r| Some(r.straggler.into())),
    ),
    row(
        "group_losses",
        "Times a replica group was declared dead, by cause (kept while it is live or \
         lost in the last minutes)",
        Series::LossesByCause,
    ),
    row(
        "group_returns",
        "Times a replica group came back after it was declared dead (restarts)",
        Series::Count(|h| h.returns),
    ),
    row(
        "group_steps_committed",
        "Steps a replica group's vote committed (kept while it is live or lost in the \
         last minutes, across its restarts)",
        Series::Count(|h| h.tally.steps_committed),
    ),
    row(
        "group_steps_failed",
        "Steps a replica group did not commit: a rank voted no, its state was torn, or \
         the lighthouse had gone on without it",
        Series::Count(|h| h.tally.steps_failed),
    ),
    row(
        "group_heals",
        "Quorums in which a replica group fetched the state it lacked from its peers",
        Series::Count(|h| h.tally.heals),
    ),
    Row {
        name: "group_healed",
        help: "Tensor bytes a replica group's ranks fetched from their peers in heals",
        unit: Some(Unit::Bytes),
        series: Series::Count(|h| h.tally.healed_bytes),
    },
    row(
        "group_last_commit_age_seconds",
        "Time since a live replica group last committed a step (or since it appeared)",
        Series::Float(|r| Some(seconds(r.last_commit_age_ms))),
    ),
    row(
        "group_refused_requests",
        "Requests and connections refused by a replica group's manager server and state \
         servers, by group and reason",
        Series::RefusedByReason,
    ),
    row(
        "last_commit_age_seconds",
        "Time since any replica group last committed a step (or since the lighthouse \
         started): the job's stall",
        Series::Job(|s| seconds(s.last_commit_age_ms)),
    ),
];

/// The per-group series an operator alerts on, made afresh from a snapshot at each
/// scrape: a group's series are there while it is live or recently lost (see
/// `history::LOST_KEPT_FOR`) and leave with it, so their number stays bounded.
fn group_registry(job: &JobName, snapshot: &Snapshot) -> Registry {
    let group = |id: &str| vec![("replica_id", id.to_string())];
    let histories: Vec<(&str, &History)> = snapshot
        .replicas
        .iter()
        .map(|r| (r.replica_id.as_str(), &r.history))
        .chain(
            snapshot
                .lost
                .iter()
                .map(|l| (l.replica_id.as_str(), &l.history)),
        )
        .collect();
    let mut registry = job_registry(job);
    for row in GROUP_SERIES {
        match row.series {
            Series::Live => {
                let family = Family::<GroupLabels, Gauge>::default();
                for r in &snapshot.replicas {
                    family.get_or_create(&group(&r.replica_id)).set(1);
                }
                for l in &snapshot.lost {
                    family.get_or_create(&group(&l.replica_id)).set(0);
                }
                add(&mut registry, row, family);
            }
            Series::Int(read) => {
                let family = Family::<GroupLabels, Gauge>::default();
                for r in &snapshot.replicas {
                    if let Some(v) = read(r) {
                        family.get_or_create(&group(&r.replica_id)).set(v);
                    }
                }
                add(&mut registry, row, family);
            }
            Series::Float(read) => {
                let family = Family::<GroupLabels, FloatGauge>::default();
                for r in &snapshot.replicas {
                    if let Some(v) = read(r) {
                        family.get_or_create(&group(&r.replica_id)).set(v);
                    }
                }
                add(&mut registry, row, family);
            }
            Series::Count(read) => {
                let family = Family::<GroupLabels, Counter>::default();
                for (id, history) in &histories {
                    family.get_or_create(&group(id)).inc_by(read(history));
                }
                add(&mut registry, row, family);
            }
            Series::LossesByCause => {
                let family = Family::<GroupLabels, Counter>::default();
                for (id, history) in &histories {
                    for cause in Eviction::ALL {
                        let mut labels = group(id);
                        labels.push(("cause", cause.as_str().to_string()));
                        family
                            .get_or_create(&labels)
                            .inc_by(history.losses.of(cause));
                    }
                }
                add(&mut registry, row, family);
            }
            Series::RefusedByReason => {
                let family = Family::<GroupLabels, Counter>::default();
                for (id, history) in &histories {
                    for (&reason, &count) in &history.tally.refused {
                        let mut labels = group(id);
                        labels.push(("reason", reason.to_string()));
                        family.get_or_create(&labels).inc_by(count);
                    }
                }
                add(&mut registry, row, family);
            }
            Series::Job(read) => {
                let gauge = FloatGauge::default();
                gauge.set(read(snapshot));
                add(&mut registry, row, gauge);
            }
        }
    }
    registry
}

fn add(registry: &mut Registry, row: &Row, metric: impl Metric) {
    match &row.unit {
        Some(unit) => registry.register_with_unit(row.name, row.help, unit.clone(), metric),
        None => registry.register(row.name, row.help, metric),
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
    use crate::gate::Refusal;
    use crate::lighthouse::history::{History, Losses};
    use crate::lighthouse::snapshot::{LostSnapshot, ReplicaSnapshot};
    use crate::lighthouse::tally::Tally;
    use crate::proto::GroupTally;

    fn snapshot(replicas: Vec<ReplicaSnapshot>, lost: Vec<LostSnapshot>) -> Snapshot {
        Snapshot {
            quorum_id: 3,
            quorum_members: Vec::new(),
            max_step: 0,
            replicas,
            lost,
            waiting_for: String::new(),
            quorums_issued: 3,
            min_replicas: 1,
            join_timeout_ms: 1000,
            heartbeat_timeout_ms: 2000,
            lost_kept_for_ms: 600_000,
            lost_kept: 32,
            last_commit_age_ms: 250,
            newest: None,
            rollbacks: Vec::new(),
        }
    }

    fn history(stream_broken: u64, returns: u64) -> History {
        let mut tally = Tally::default();
        tally.report(GroupTally {
            steps_committed: 40,
            steps_failed: 2,
            heals: 1,
            healed_bytes: 4096,
        });
        tally.report_refused(vec![(Refusal::Token, 3)]);
        History {
            losses: Losses {
                stream_broken,
                heartbeat_timeout: 0,
                progress_stalled: 0,
                left: 0,
            },
            returns,
            tally,
        }
    }

    #[test]
    fn live_and_recently_lost_groups_have_their_own_series() {
        let healing = ReplicaSnapshot {
            replica_id: "a".into(),
            connected: true,
            joined: false,
            in_quorum: true,
            step: 41,
            healing: true,
            step_rate: Some(2.5),
            heartbeat_age_ms: 120,
            last_commit_age_ms: 1500,
            progress_age_ms: Some(2500),
            step_time_ms: Some(400),
            straggler: true,
            peer: "127.0.0.1:5000".into(),
            history: history(1, 1),
        };
        let lost = LostSnapshot {
            replica_id: "b".into(),
            cause: Eviction::StreamBroken,
            lost_ms_ago: 5000,
            step: 40,
            was_member: true,
            peer: String::new(),
            history: history(2, 1),
        };
        let text = Metrics::for_job(&JobName::default_job()).render(
            &JobName::default_job(),
            &snapshot(vec![healing], vec![lost]),
        );
        for sample in [
            r#"phalanx_lighthouse_group_live{replica_id="a"} 1"#,
            r#"phalanx_lighthouse_group_live{replica_id="b"} 0"#,
            r#"phalanx_lighthouse_group_step{replica_id="a"} 41"#,
            r#"phalanx_lighthouse_group_step_rate{replica_id="a"} 2.5"#,
            r#"phalanx_lighthouse_group_healing{replica_id="a"} 1"#,
            r#"phalanx_lighthouse_group_heartbeat_age_seconds{replica_id="a"} 0.12"#,
            r#"phalanx_lighthouse_group_progress_age_seconds{replica_id="a"} 2.5"#,
            r#"phalanx_lighthouse_group_step_time_seconds{replica_id="a"} 0.4"#,
            r#"phalanx_lighthouse_group_straggler{replica_id="a"} 1"#,
            r#"phalanx_lighthouse_group_losses_total{replica_id="b",cause="progress_stalled"} 0"#,
            r#"phalanx_lighthouse_group_losses_total{replica_id="b",cause="stream_broken"} 2"#,
            r#"phalanx_lighthouse_group_losses_total{replica_id="b",cause="heartbeat_timeout"} 0"#,
            r#"phalanx_lighthouse_group_returns_total{replica_id="a"} 1"#,
            r#"phalanx_lighthouse_group_steps_committed_total{replica_id="a"} 40"#,
            r#"phalanx_lighthouse_group_steps_failed_total{replica_id="b"} 2"#,
            r#"phalanx_lighthouse_group_heals_total{replica_id="a"} 1"#,
            r#"phalanx_lighthouse_group_healed_bytes_total{replica_id="b"} 4096"#,
            r#"phalanx_lighthouse_group_refused_requests_total{replica_id="a",reason="token"} 3"#,
            r#"phalanx_lighthouse_group_last_commit_age_seconds{replica_id="a"} 1.5"#,
            r#"phalanx_lighthouse_last_commit_age_seconds 0.25"#,
        ] {
            assert!(
                text.contains(&format!("{sample}\n")),
                "{sample} missing:\n{text}"
            );
        }
        for live_only in ["group_step", "group_last_commit_age_seconds"] {
            assert!(
                !text.contains(&format!(r#"{live_only}{{replica_id="b"}}"#)),
                "a lost group has no {live_only}"
            );
        }
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.ends_with("# EOF\n"));
    }

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
    fn every_job_has_its_own_labelled_series_and_each_family_is_written_once() {
        let default = JobName::default_job();
        let a = JobName::parse(Some("a")).unwrap();
        let (mine, theirs) = (Metrics::for_job(&default), Metrics::for_job(&a));
        mine.heartbeats.inc();
        theirs.heartbeats.inc_by(5);
        let site = SiteMetrics::new();
        site.jobs.set(2);
        let empty = snapshot(Vec::new(), Vec::new());
        let text = site.render(&[mine.render(&default, &empty), theirs.render(&a, &empty)]);
        assert!(
            text.contains("\nphalanx_lighthouse_heartbeats_total 1\n"),
            "{text}"
        );
        assert!(
            text.contains("\nphalanx_lighthouse_heartbeats_total{phalanx_job=\"a\"} 5\n"),
            "{text}"
        );
        assert!(text.contains("\nphalanx_lighthouse_jobs 2\n"), "{text}");
        for line in text.lines().filter(|l| l.starts_with("# ")) {
            assert_eq!(
                text.matches(&format!("{line}\n")).count(),
                1,
                "{line} twice"
            );
        }
        // A family's samples stand together, after its metadata.
        let lines: Vec<&str> = text.lines().collect();
        let at = |needle: &str| lines.iter().position(|l| l.starts_with(needle)).unwrap();
        let first = at("phalanx_lighthouse_heartbeats_total ");
        assert_eq!(at("phalanx_lighthouse_heartbeats_total{"), first + 1);
        assert_eq!(at("# TYPE phalanx_lighthouse_heartbeats "), first - 1);
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn every_family_is_there_before_its_first_event() {
        let text = SiteMetrics::new().render(&[Metrics::for_job(&JobName::default_job())
            .render(&JobName::default_job(), &snapshot(Vec::new(), Vec::new()))]);
        for family in [
            "evictions",
            "refused_requests",
            "heartbeats",
            "quorum_changes",
            "rollbacks",
            "rollback_steps_lost",
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
