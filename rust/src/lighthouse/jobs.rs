//! The jobs one lighthouse serves: their names, the rules each declares, and which
//! of them are idle long enough to be forgotten. Pure: the service holds one `Shared`
//! per job (see `site::Site`) and asks this module what to do.
//!
//! A job is named by its groups, on every request to the lighthouse, in the
//! `phalanx-job` metadata key (none: the default job, as before jobs had names); its
//! rules travel beside it in `phalanx-job-rules`. Both are metadata, not fields of the
//! messages, so that the token check, which runs before a message is read, knows the
//! job it checks for (see `auth::LighthouseAuth`).
//!
//! Rules: the first group of a job to reach the lighthouse makes the job, with the
//! rules it declares and the lighthouse's own defaults for the rest. A later group's
//! declaration must agree with them, key by key, or it is refused with both named:
//! a job whose groups disagree on `min_replicas` would form quorums that some of them
//! take for too small. The default job's rules are the lighthouse's flags.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tonic::Status;

use crate::quorum::Identity;

/// Metadata key of the job a request is for.
pub const JOB_KEY: &str = "phalanx-job";
/// Metadata key of the rules the requester declares for its job (see `JobRules`).
pub const RULES_KEY: &str = "phalanx-job-rules";
/// The name of the job of requests that name none.
pub const DEFAULT_JOB: &str = "default";
const MAX_JOB_NAME_LEN: usize = 64;

/// A job's name, checked: 1 to 64 letters, digits, '.', '_' or '-'.
///
/// ```
/// use phalanx::lighthouse::jobs::JobName;
/// assert_eq!(JobName::parse(None).unwrap().as_str(), "default");
/// assert_eq!(JobName::parse(Some("llama-8b.run3")).unwrap().as_str(), "llama-8b.run3");
/// assert!(JobName::parse(Some("a b")).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobName(String);

impl JobName {
    pub fn default_job() -> Self {
        JobName(DEFAULT_JOB.to_string())
    }

    /// The job a request names (`None` or empty: the default job).
    pub fn parse(name: Option<&str>) -> Result<Self, Status> {
        let name = match name {
            None | Some("") => return Ok(Self::default_job()),
            Some(name) => name,
        };
        crate::validate::name(
            "job name",
            name,
            MAX_JOB_NAME_LEN,
            " (--job or PHALANX_JOB)",
        )?;
        Ok(JobName(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_default(&self) -> bool {
        self.0 == DEFAULT_JOB
    }
}

impl std::fmt::Display for JobName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a lighthouse decides quorums and liveness, apart from where it listens and who
/// may ask. `DEFAULT` is the one declaration of the defaults: the command line
/// (`cli::LighthouseArgs`), the Python binding (`LighthouseServer`,
/// `LIGHTHOUSE_DEFAULTS`) and the launcher all read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Fewest replica groups that may form a quorum.
    pub min_replicas: usize,
    /// How long a quorum waits for a late live group.
    pub join_timeout: Duration,
    /// How long a connected group may stay silent before it is declared dead.
    pub heartbeat_timeout: Duration,
    /// How long the job waits for a group holding its newest state to come back
    /// (after a cut, a pause) before it goes back to an older one (see `newest`).
    pub rollback_after: Duration,
    /// How many replica groups it is ready to serve: its connection cap and the file
    /// descriptors it asks for follow from it (`GateLimits::lighthouse`).
    pub max_groups: usize,
}

impl Tuning {
    pub const DEFAULT: Tuning = Tuning {
        min_replicas: 1,
        join_timeout: Duration::from_secs(1),
        heartbeat_timeout: Duration::from_secs(2),
        rollback_after: Duration::from_secs(30),
        max_groups: 10_000,
    };
}

/// The quorum rules a group declares for its job; `None`: whatever the job has.
///
/// On the wire, `key=value` pairs joined by commas, times in milliseconds:
///
/// ```
/// use phalanx::lighthouse::jobs::JobRules;
/// let rules = JobRules::parse("min_replicas=2,join_timeout_ms=500").unwrap();
/// assert_eq!(rules.min_replicas, Some(2));
/// assert_eq!(rules.to_string(), "min_replicas=2,join_timeout_ms=500");
/// assert!(JobRules::parse("min_replica=2").is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobRules {
    pub min_replicas: Option<usize>,
    pub join_timeout: Option<Duration>,
    pub heartbeat_timeout: Option<Duration>,
    pub rollback_after: Option<Duration>,
}

const KEYS: &str = "min_replicas, join_timeout_ms, heartbeat_timeout_ms, rollback_after_ms";
/// Above any rule a job needs (a day), and far from overflowing an `Instant`.
const MAX_RULE_MS: u64 = 86_400_000;

impl JobRules {
    /// Rules as a group sends them; an error names the bad pair and the keys there are.
    pub fn parse(text: &str) -> Result<Self, Status> {
        let mut rules = JobRules::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = |why: &str| {
                Status::invalid_argument(format!(
                    "job rule {pair:?}: {why} (rules are key=value pairs joined by ',', keys: \
                     {KEYS})"
                ))
            };
            let (key, value) = pair.split_once('=').ok_or_else(|| bad("no '='"))?;
            let n: u64 = value
                .trim()
                .parse()
                .map_err(|_| bad("the value is not a whole number"))?;
            let ms = || {
                if n == 0 || n > MAX_RULE_MS {
                    Err(bad("give 1 to 86400000 milliseconds"))
                } else {
                    Ok(Some(Duration::from_millis(n)))
                }
            };
            match key.trim() {
                "min_replicas" if (1..=1_000_000).contains(&n) => {
                    rules.min_replicas = Some(n as usize)
                }
                "min_replicas" => return Err(bad("give 1 to 1000000 groups")),
                "join_timeout_ms" => rules.join_timeout = ms()?,
                "heartbeat_timeout_ms" => rules.heartbeat_timeout = ms()?,
                "rollback_after_ms" => rules.rollback_after = ms()?,
                _ => return Err(bad("no such key")),
            }
        }
        Ok(rules)
    }

    /// The rules of a job that these make, the lighthouse's `defaults` for the rest;
    /// an error when together they are not a job's rules (see
    /// `LighthouseOptions::validate`).
    pub fn over(&self, defaults: &Tuning) -> Result<Tuning, Status> {
        let tuning = Tuning {
            min_replicas: self.min_replicas.unwrap_or(defaults.min_replicas),
            join_timeout: self.join_timeout.unwrap_or(defaults.join_timeout),
            heartbeat_timeout: self.heartbeat_timeout.unwrap_or(defaults.heartbeat_timeout),
            rollback_after: self.rollback_after.unwrap_or(defaults.rollback_after),
            max_groups: defaults.max_groups,
        };
        if tuning.heartbeat_timeout < Duration::from_millis(10) {
            return Err(Status::invalid_argument(
                "job rule heartbeat_timeout_ms: give at least 10",
            ));
        }
        if tuning.rollback_after < tuning.heartbeat_timeout {
            return Err(Status::invalid_argument(format!(
                "job rules: rollback_after ({:?}) is shorter than heartbeat_timeout ({:?}); \
                 give at least the heartbeat timeout",
                tuning.rollback_after, tuning.heartbeat_timeout
            )));
        }
        Ok(tuning)
    }

    /// Whether a job running under `rules` can take a group declaring these: every
    /// rule declared is the job's. The refusal names both and the fix.
    pub fn agree_with(&self, job: &JobName, rules: &Tuning) -> Result<(), Status> {
        let ms = |d: Duration| d.as_millis() as u64;
        let differ = [
            (
                "min_replicas",
                self.min_replicas.map(|n| n as u64),
                rules.min_replicas as u64,
            ),
            (
                "join_timeout_ms",
                self.join_timeout.map(ms),
                ms(rules.join_timeout),
            ),
            (
                "heartbeat_timeout_ms",
                self.heartbeat_timeout.map(ms),
                ms(rules.heartbeat_timeout),
            ),
            (
                "rollback_after_ms",
                self.rollback_after.map(ms),
                ms(rules.rollback_after),
            ),
        ]
        .into_iter()
        .find(|(_, declared, has)| declared.is_some_and(|d| d != *has));
        match differ {
            None => Ok(()),
            Some((key, declared, has)) => {
                let made_by = if job.is_default() {
                    "the lighthouse's own flags; name a job of its own (--job or PHALANX_JOB) \
                     to choose its rules"
                } else {
                    "its first group; start every group of the job with the same rules, or \
                     give the new rules a new job name"
                };
                Err(Status::failed_precondition(format!(
                    "job {job} runs with {key}={has}, set by {made_by}; this group declares \
                     {key}={}",
                    declared.unwrap_or_default()
                )))
            }
        }
    }
}

impl std::fmt::Display for JobRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
        let pairs = [
            ("min_replicas", self.min_replicas.map(|n| n as u64)),
            ("join_timeout_ms", ms(self.join_timeout)),
            ("heartbeat_timeout_ms", ms(self.heartbeat_timeout)),
            ("rollback_after_ms", ms(self.rollback_after)),
        ];
        let text: Vec<String> = pairs
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
            .collect();
        f.write_str(&text.join(","))
    }
}

/// The job a request is for and the rules its group declares: what a client sends
/// in metadata (`metadata`), and what the lighthouse's token check reads back from it
/// (`access::JobCheck`). The default: the default job, declaring nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRequest {
    pub job: JobName,
    pub rules: JobRules,
}

impl Default for JobRequest {
    fn default() -> Self {
        JobRequest {
            job: JobName::default_job(),
            rules: JobRules::default(),
        }
    }
}

impl JobRequest {
    /// The job named `job` (None: the default job) with rules `rules` (None: none
    /// declared), checked; the error names what is wrong and where it was given.
    pub fn parse(job: Option<&str>, rules: Option<&str>) -> Result<Self, Status> {
        Ok(JobRequest {
            job: JobName::parse(job)?,
            rules: rules.map_or(Ok(JobRules::default()), JobRules::parse)?,
        })
    }

    /// The metadata that names this job on a request: none for the default job
    /// declaring nothing, so that such a request is one as before jobs had names.
    ///
    /// ```
    /// use phalanx::lighthouse::jobs::JobRequest;
    /// assert!(JobRequest::default().metadata().is_empty());
    /// let job = JobRequest::parse(Some("a"), Some("min_replicas=2")).unwrap();
    /// assert_eq!(
    ///     job.metadata(),
    ///     [("phalanx-job", "a".to_string()), ("phalanx-job-rules", "min_replicas=2".to_string())]
    /// );
    /// ```
    pub fn metadata(&self) -> Vec<(&'static str, String)> {
        let mut pairs = Vec::new();
        if !self.job.is_default() {
            pairs.push((JOB_KEY, self.job.to_string()));
        }
        if self.rules != JobRules::default() {
            pairs.push((RULES_KEY, self.rules.to_string()));
        }
        pairs
    }
}

/// When a job no group uses any longer is forgotten: the janitor's verdict for one
/// job, from whether it is idle now (no group connected, joined or live) and since
/// when it has been.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// In use: nothing to remember.
    InUse,
    /// Idle since this instant, not yet for long enough.
    Since(Instant),
    /// Idle for `forget_after`: forget it.
    Forget,
}

/// The janitor's verdict on a job: the default job is never forgotten.
pub fn judge_idle(
    job: &JobName,
    idle_now: bool,
    idle_since: Option<Instant>,
    forget_after: Duration,
    now: Instant,
) -> Idle {
    match (idle_now && !job.is_default(), idle_since) {
        (false, _) => Idle::InUse,
        (true, Some(since)) if now.duration_since(since) >= forget_after => Idle::Forget,
        (true, Some(since)) => Idle::Since(since),
        (true, None) => Idle::Since(now),
    }
}

/// What a lighthouse of a set knows of each job's newest state, from its own serving
/// and from its peers' messages, which carry all of it (see `set::Seat`). A named
/// job's word is kept while it keeps coming, and `NEWEST_KEPT_FOR` after (its groups
/// are gone by then, or its job forgotten), at most `MAX_NEWEST_KNOWN` jobs, the
/// oldest word dropped first; the default job's is kept for good.
#[derive(Debug, Default)]
pub struct NewestByJob {
    known: HashMap<JobName, (Identity, Instant)>,
    swept: Option<Instant>,
}

/// How long a named job's newest state is remembered without a word of it.
pub const NEWEST_KEPT_FOR: Duration = Duration::from_secs(600);
/// The most jobs whose newest state a lighthouse remembers: a bound on every Raft
/// message's size (`set::MAX_RAFT_BYTES`).
pub const MAX_NEWEST_KNOWN: usize = 4096;

impl NewestByJob {
    pub fn get(&self, job: &JobName) -> Option<Identity> {
        self.known.get(job).map(|(identity, _)| *identity)
    }

    /// Takes in `identity` for `job`, if newer than what is known; refreshes the word.
    pub fn learn(&mut self, job: &JobName, identity: Identity, now: Instant) {
        let new = !self.known.contains_key(job);
        let known = self.known.entry(job.clone()).or_insert((identity, now));
        if identity > known.0 {
            known.0 = identity;
        }
        known.1 = now;
        // Swept when a job is new, and else every tenth of the time words are kept.
        if new || self.swept.is_none_or(|at| now >= at + NEWEST_KEPT_FOR / 10) {
            self.forget_old(now);
        }
    }

    fn forget_old(&mut self, now: Instant) {
        self.swept = Some(now);
        self.known.retain(|job, (_, at)| {
            job.is_default() || now.saturating_duration_since(*at) < NEWEST_KEPT_FOR
        });
        while self.known.len() > MAX_NEWEST_KNOWN {
            let oldest = self
                .known
                .iter()
                .filter(|(job, _)| !job.is_default())
                .min_by_key(|(_, (_, at))| *at)
                .map(|(job, _)| job.clone());
            match oldest {
                Some(job) => self.known.remove(&job),
                None => break,
            };
        }
    }

    /// Every job's newest state known.
    pub fn all(&self) -> impl Iterator<Item = (&JobName, Identity)> {
        self.known
            .iter()
            .map(|(job, (identity, _))| (job, *identity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> JobName {
        JobName::parse(Some(s)).unwrap()
    }

    #[test]
    fn a_job_name_is_checked_and_none_is_the_default_job() {
        assert!(JobName::parse(Some("")).unwrap().is_default());
        assert!(JobName::parse(None).unwrap().is_default());
        assert!(name("default").is_default());
        let long = "a".repeat(65);
        let e = JobName::parse(Some(&long)).unwrap_err();
        assert!(e.message().contains("65 bytes long"), "{}", e.message());
        let e = JobName::parse(Some("job/1")).unwrap_err();
        assert!(e.message().contains("'/' at byte 3"), "{}", e.message());
    }

    #[test]
    fn rules_round_trip_and_bad_ones_name_the_pair_and_the_keys() {
        let all =
            "min_replicas=3,join_timeout_ms=200,heartbeat_timeout_ms=900,rollback_after_ms=5000";
        let rules = JobRules::parse(all).unwrap();
        assert_eq!(rules.to_string(), all);
        assert_eq!(JobRules::parse("").unwrap(), JobRules::default());
        for (bad, says) in [
            ("min_replicas", "no '='"),
            ("min_replicas=x", "not a whole number"),
            ("min_replicas=0", "1 to 1000000"),
            ("join_timeout_ms=0", "1 to 86400000"),
            ("join_timeout_ms=99999999999", "1 to 86400000"),
            ("min_replicas=-1", "not a whole number"),
            ("quorum=2", "no such key"),
        ] {
            let e = JobRules::parse(bad).unwrap_err();
            assert!(e.message().contains(says), "{bad}: {}", e.message());
            assert!(
                e.message().contains("keys: min_replicas"),
                "{}",
                e.message()
            );
        }
    }

    #[test]
    fn a_job_takes_its_declared_rules_and_the_lighthouses_defaults_for_the_rest() {
        let rules = JobRules::parse("min_replicas=2").unwrap();
        let tuning = rules.over(&Tuning::DEFAULT).unwrap();
        assert_eq!(tuning.min_replicas, 2);
        assert_eq!(tuning.join_timeout, Tuning::DEFAULT.join_timeout);
        let e = JobRules::parse("rollback_after_ms=100")
            .unwrap()
            .over(&Tuning::DEFAULT)
            .unwrap_err();
        assert!(e.message().contains("shorter than heartbeat_timeout"));
    }

    #[test]
    fn a_group_declaring_other_rules_than_its_jobs_is_refused_with_both_named() {
        let job = name("a");
        let running = JobRules::parse("min_replicas=2")
            .unwrap()
            .over(&Tuning::DEFAULT)
            .unwrap();
        // Declaring nothing, or the same, is agreeing.
        JobRules::default().agree_with(&job, &running).unwrap();
        JobRules::parse("min_replicas=2,join_timeout_ms=1000")
            .unwrap()
            .agree_with(&job, &running)
            .unwrap();
        let e = JobRules::parse("min_replicas=3")
            .unwrap()
            .agree_with(&job, &running)
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("job a runs with min_replicas=2"),
            "{}",
            e.message()
        );
        assert!(
            e.message().contains("declares min_replicas=3"),
            "{}",
            e.message()
        );
        let e = JobRules::parse("min_replicas=3")
            .unwrap()
            .agree_with(&JobName::default_job(), &Tuning::DEFAULT)
            .unwrap_err();
        assert!(
            e.message().contains("the lighthouse's own flags"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn a_jobs_newest_state_only_rises_and_is_forgotten_when_no_word_comes() {
        let t = Instant::now();
        let at = |step| Identity {
            lineage: 1,
            step,
            state_quorum_id: 1,
        };
        let mut known = NewestByJob::default();
        let (a, default) = (name("a"), JobName::default_job());
        known.learn(&a, at(5), t);
        known.learn(&a, at(3), t);
        assert_eq!(known.get(&a), Some(at(5)));
        known.learn(&default, at(9), t);
        // A word of any job drops the named jobs not heard of for NEWEST_KEPT_FOR.
        known.learn(&name("b"), at(1), t + NEWEST_KEPT_FOR);
        assert_eq!(known.get(&a), None);
        assert_eq!(known.get(&default), Some(at(9)));
        for i in 0..MAX_NEWEST_KNOWN + 10 {
            known.learn(&name(&format!("j{i}")), at(1), t + NEWEST_KEPT_FOR);
        }
        assert_eq!(known.all().count(), MAX_NEWEST_KNOWN);
        assert_eq!(known.get(&default), Some(at(9)));
    }

    #[test]
    fn an_idle_job_is_forgotten_after_forget_after_and_the_default_job_never() {
        let t = Instant::now();
        let after = Duration::from_secs(60);
        let job = name("a");
        assert_eq!(judge_idle(&job, false, Some(t), after, t), Idle::InUse);
        assert_eq!(judge_idle(&job, true, None, after, t), Idle::Since(t));
        assert_eq!(
            judge_idle(&job, true, Some(t), after, t + Duration::from_secs(59)),
            Idle::Since(t)
        );
        assert_eq!(
            judge_idle(&job, true, Some(t), after, t + after),
            Idle::Forget
        );
        let default = JobName::default_job();
        assert_eq!(
            judge_idle(&default, true, Some(t), after, t + after * 10),
            Idle::InUse
        );
    }
}
