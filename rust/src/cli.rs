//! The standalone lighthouse's command line, shared by the `phalanx-lighthouse`
//! binary and the `phalanx lighthouse` subcommand of the Python CLI.

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};

use crate::auth::{self, JobToken, TokenSource};
use crate::gate::GateLimits;
use crate::lighthouse::leadership::Timing;
use crate::lighthouse::set::SetOptions;
use crate::lighthouse::{self, JobLimits, LighthouseOptions, Tuning};
use crate::Error;

/// The default timeouts as `--help` shows them and clap parses them back.
static JOIN_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| duration_text(Tuning::DEFAULT.join_timeout));
static HEARTBEAT_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| duration_text(Tuning::DEFAULT.heartbeat_timeout));
static ROLLBACK_AFTER: LazyLock<String> =
    LazyLock::new(|| duration_text(Tuning::DEFAULT.rollback_after));
static FORGET_JOBS_AFTER: LazyLock<String> =
    LazyLock::new(|| duration_text(JobLimits::DEFAULT.forget_after));

/// The lighthouse's command line: its flags, torchft_lighthouse's spellings folded into
/// phalanx's own (`LighthouseFlags::resolve`). Parse it with `clap::Parser`'s calls.
#[derive(Debug)]
pub struct LighthouseArgs {
    /// The settings; where a torchft flag was given, its value is in the phalanx field.
    pub flags: LighthouseFlags,
    /// What the command line asked for that phalanx does not need, one line each for
    /// stderr when the lighthouse starts.
    pub notes: Vec<String>,
}

// By hand, not derived: telling a phalanx flag given on the command line from its
// default or its environment variable takes the parsed matches, which a derive hides.
impl CommandFactory for LighthouseArgs {
    fn command() -> clap::Command {
        LighthouseFlags::command()
    }
    fn command_for_update() -> clap::Command {
        LighthouseFlags::command_for_update()
    }
}

impl FromArgMatches for LighthouseArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let flags = LighthouseFlags::from_arg_matches(matches)?;
        flags.resolve(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
    }
    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl Parser for LighthouseArgs {}

/// Run the lighthouse of a phalanx job: it decides which replica groups take part in
/// each step and watches their liveness. Serves gRPC and, on the same port, a status
/// page at `/`, `/status` (JSON) and `/metrics` (Prometheus).
#[derive(Debug, Parser)]
#[command(name = "phalanx-lighthouse", version)]
pub struct LighthouseFlags {
    /// Address to listen on, host:port (port 0 picks a free one).
    #[arg(long, env = "PHALANX_LIGHTHOUSE_BIND", default_value = "0.0.0.0:29510")]
    pub bind: String,
    /// Fewest replica groups that may form a quorum.
    #[arg(long, env = "PHALANX_MIN_REPLICAS", default_value_t = Tuning::DEFAULT.min_replicas)]
    pub min_replicas: usize,
    /// How long a quorum waits for a late live group (e.g. 1s, 500ms).
    #[arg(long, env = "PHALANX_JOIN_TIMEOUT", default_value = JOIN_TIMEOUT.as_str(), value_parser = parse_duration)]
    pub join_timeout: Duration,
    /// How long a connected group may stay silent before it is declared dead.
    #[arg(long, env = "PHALANX_HEARTBEAT_TIMEOUT", default_value = HEARTBEAT_TIMEOUT.as_str(), value_parser = parse_duration)]
    pub heartbeat_timeout: Duration,
    /// How long the job waits for a group holding its newest committed state to come
    /// back (from a cut, a pause) before it goes back to the best older state the
    /// groups hold, as a new lineage, announced. A group known to be gone (crashed,
    /// evicted) is not waited for.
    #[arg(long, env = "PHALANX_ROLLBACK_AFTER", default_value = ROLLBACK_AFTER.as_str(), value_parser = parse_duration)]
    pub rollback_after: Duration,
    /// How many replica groups it is ready to serve: it admits two connections for each
    /// (its heartbeat stream's, one for its calls) and a quarter more (groups
    /// reconnecting, scrapes, operators), and raises its own
    /// file-descriptor limit to match, or says what it can serve when it may not.
    #[arg(long, env = "PHALANX_MAX_GROUPS", default_value_t = Tuning::DEFAULT.max_groups, value_parser = clap::value_parser!(u32).range(1..=1_000_000).map(|n| n as usize))]
    pub max_groups: usize,
    /// How many jobs it serves at once (each names itself with `--job` or
    /// PHALANX_JOB; groups that name none are the default job, one of these).
    #[arg(long, env = "PHALANX_MAX_JOBS", default_value_t = JobLimits::DEFAULT.max_jobs, value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub max_jobs: usize,
    /// A job none of whose groups has been connected for this long is forgotten: its
    /// quorums, rules and series (the default job never is).
    #[arg(long, env = "PHALANX_FORGET_JOBS_AFTER", default_value = FORGET_JOBS_AFTER.as_str(), value_parser = parse_duration)]
    pub forget_jobs_after: Duration,
    /// Job token; with it set, every request without it is refused. Visible to other
    /// users of this host in the process list: prefer --token-file. [env: PHALANX_TOKEN]
    #[arg(long)]
    pub token: Option<String>,
    /// File that holds the job token; only its owner may read it (chmod 600).
    /// `phalanx token FILE` writes one. [env: PHALANX_TOKEN_FILE]
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Serve without a token on an address other hosts can reach; without this, the
    /// lighthouse refuses to. Only on a network where you trust every host.
    #[arg(long)]
    pub insecure: bool,
    /// Take every beat on its group's heartbeat stream: offer no UDP datagrams for
    /// them (on by default, on UDP at the same port number as --bind).
    #[arg(long)]
    pub no_datagrams: bool,
    /// Run as one of a set of lighthouses (no single point of failure): every member's
    /// host:port, comma-separated, in the same order on every member, this one's
    /// included. One serves at a time, chosen by Raft; clients take the same list
    /// (--lighthouse a:p,b:p,c:p). Without it, one lighthouse serves alone.
    #[arg(
        long,
        env = "PHALANX_LIGHTHOUSE_PEERS",
        value_delimiter = ',',
        requires = "id"
    )]
    pub peers: Vec<String>,
    /// This lighthouse's place in --peers, counting from 1.
    #[arg(long, env = "PHALANX_LIGHTHOUSE_ID", requires = "peers")]
    pub id: Option<u64>,
    /// Where a lighthouse of a set keeps its Raft term and vote across restarts
    /// (default: phalanx-lighthouse-<its address>.raft in the temporary directory).
    /// Deleting it while another member is down can elect two leaders.
    #[arg(long, value_name = "FILE", requires = "peers")]
    pub state_file: Option<PathBuf>,
    /// Rewrite this member's --state-file to term 0, no vote, and exit without
    /// serving: for a set whose Raft term went where it should not. Refused
    /// while any member of --peers answers; stop them all, reset each, start them
    /// all (docs/lighthouse-set.md).
    #[arg(long, requires = "peers")]
    pub reset_state: bool,
    #[command(flatten)]
    pub torchft: TorchftFlags,
}

/// torchft_lighthouse's flags, so that a job's torchft command line starts phalanx's
/// lighthouse unchanged. Its durations are whole milliseconds.
#[derive(Debug, Default, clap::Args)]
#[command(next_help_heading = "torchft_lighthouse's flags (durations in milliseconds)")]
pub struct TorchftFlags {
    /// --min-replicas, as torchft_lighthouse spells it.
    #[arg(id = "torchft_min_replicas", long = "min_replicas", value_name = "N")]
    pub min_replicas: Option<usize>,
    /// --join-timeout, in milliseconds.
    #[arg(long = "join_timeout_ms", value_name = "MS")]
    pub join_timeout_ms: Option<u64>,
    /// --heartbeat-timeout, in milliseconds.
    #[arg(long = "heartbeat_timeout_ms", value_name = "MS")]
    pub heartbeat_timeout_ms: Option<u64>,
    /// Accepted, not needed: phalanx has no quorum tick; it decides a quorum on every
    /// event (a join, a heartbeat, a deadline). Noted once on stderr.
    #[arg(long = "quorum_tick_ms", value_name = "MS")]
    pub quorum_tick_ms: Option<u64>,
    /// Accepted, not needed: a silent group is declared dead at its own heartbeat
    /// deadline, with no failure tick. Noted once on stderr.
    #[arg(long = "failure_tick_ms", value_name = "MS")]
    pub failure_tick_ms: Option<u64>,
    /// Refused: phalanx's lighthouse hands its clients no configuration file; give
    /// the training script its settings itself.
    #[arg(long = "lighthouse_config", value_name = "FILE")]
    pub lighthouse_config: Option<PathBuf>,
    /// Refused: a phalanx quorum holds every live group that joins in time and is not
    /// cut to listed sizes; start as many groups as the job should use.
    #[arg(long = "expected_replicas", value_name = "N,N,...")]
    pub expected_replicas: Option<String>,
}

impl LighthouseFlags {
    /// These flags with torchft_lighthouse's folded into phalanx's: a torchft flag
    /// sets the phalanx one it spells (over its environment variable, as any flag
    /// does); both on the command line (`on_command_line` of a phalanx flag's id)
    /// must agree. A torchft flag phalanx cannot honour is refused, saying what to do.
    pub fn resolve(
        mut self,
        on_command_line: impl Fn(&str) -> bool,
    ) -> Result<LighthouseArgs, clap::Error> {
        let torchft = std::mem::take(&mut self.torchft);
        if let Some(file) = &torchft.lighthouse_config {
            return Err(usage_error(format!(
                "--lighthouse_config {}: phalanx's lighthouse hands its clients no \
                 configuration (torchft's LighthouseConfig call); drop the flag and give the \
                 training script its settings itself, as arguments or environment",
                file.display()
            )));
        }
        if let Some(sizes) = &torchft.expected_replicas {
            return Err(usage_error(format!(
                "--expected_replicas {sizes}: a phalanx quorum holds every live group that \
                 joins within --join-timeout and is not cut to listed sizes; drop the flag \
                 and start as many groups as the job should use (phalanx run --replicas N)"
            )));
        }
        if let Some(n) = torchft.min_replicas {
            if on_command_line("min_replicas") && self.min_replicas != n {
                return Err(disagree(
                    format!("--min-replicas {}", self.min_replicas),
                    format!("--min_replicas {n}"),
                ));
            }
            self.min_replicas = n;
        }
        for (id, ms, field, phalanx, torchft_flag) in [
            (
                "join_timeout",
                torchft.join_timeout_ms,
                &mut self.join_timeout,
                "--join-timeout",
                "--join_timeout_ms",
            ),
            (
                "heartbeat_timeout",
                torchft.heartbeat_timeout_ms,
                &mut self.heartbeat_timeout,
                "--heartbeat-timeout",
                "--heartbeat_timeout_ms",
            ),
        ] {
            let Some(ms) = ms else { continue };
            let wanted = Duration::from_millis(ms);
            if on_command_line(id) && *field != wanted {
                return Err(disagree(
                    format!("{phalanx} {}", duration_text(*field)),
                    format!("{torchft_flag} {ms}"),
                ));
            }
            *field = wanted;
        }
        let mut notes = Vec::new();
        if let Some(ms) = torchft.quorum_tick_ms {
            notes.push(format!(
                "--quorum_tick_ms {ms} is not needed and is ignored: phalanx has no quorum \
                 tick; it decides a quorum on every event (a join, a heartbeat, a deadline)"
            ));
        }
        if let Some(ms) = torchft.failure_tick_ms {
            notes.push(format!(
                "--failure_tick_ms {ms} is not needed and is ignored: a silent group is \
                 declared dead at its own --heartbeat-timeout deadline, with no failure tick"
            ));
        }
        Ok(LighthouseArgs { flags: self, notes })
    }
}

/// A command-line error clap prints and exits 2 on, like its own.
fn usage_error(message: String) -> clap::Error {
    clap::Error::raw(ErrorKind::ArgumentConflict, message)
}

/// Two spellings of one setting that say different things.
fn disagree(phalanx: String, torchft: String) -> clap::Error {
    usage_error(format!(
        "{phalanx} and {torchft} (torchft_lighthouse's spelling of the same setting) \
         disagree; give one of them"
    ))
}

impl LighthouseArgs {
    /// The options these arguments give, `environment` (a variable's value by name)
    /// filling in the token where no flag gives one.
    pub fn options(
        &self,
        environment: impl Fn(&str) -> Option<String>,
    ) -> Result<LighthouseOptions, Error> {
        let flags = &self.flags;
        let env_token = environment("PHALANX_TOKEN");
        let env_token_file = environment("PHALANX_TOKEN_FILE").map(PathBuf::from);
        let token = auth::resolve_token(
            TokenSource {
                token: flags.token.as_deref(),
                file: flags.token_file.as_deref(),
            },
            TokenSource {
                token: env_token.as_deref(),
                file: env_token_file.as_deref(),
            },
        )?;
        Ok(LighthouseOptions {
            bind: flags.bind.clone(),
            min_replicas: flags.min_replicas,
            join_timeout: flags.join_timeout,
            heartbeat_timeout: flags.heartbeat_timeout,
            rollback_after: flags.rollback_after,
            token: JobToken::new(token),
            insecure: flags.insecure,
            connections: GateLimits::lighthouse(flags.max_groups),
            jobs: JobLimits {
                max_jobs: flags.max_jobs,
                forget_after: flags.forget_jobs_after,
            },
            datagrams: !flags.no_datagrams,
        })
    }
}

impl LighthouseArgs {
    /// The set this lighthouse is one of, if --peers says it is.
    pub fn set_options(&self) -> Result<Option<SetOptions>, Error> {
        let flags = &self.flags;
        set_options(&flags.peers, flags.id, flags.state_file.as_deref())
    }
}

/// The set a lighthouse is one of: none without `peers`; `id` is its place in them.
pub fn set_options(
    peers: &[String],
    id: Option<u64>,
    state_file: Option<&std::path::Path>,
) -> Result<Option<SetOptions>, Error> {
    if peers.is_empty() && id.is_none() {
        return Ok(None);
    }
    let Some(id) = id else {
        return Err(Error::InvalidConfig(
            "--peers without --id: give this lighthouse's place in --peers (1 for the \
             first address)"
                .into(),
        ));
    };
    {
        let peers: Vec<String> = peers
            .iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        let own = peers.get((id as usize).wrapping_sub(1)).cloned();
        let state_file = match (state_file, own) {
            (Some(file), _) => file.to_path_buf(),
            (None, Some(own)) => SetOptions::default_state_file(&own),
            (None, None) => PathBuf::new(),
        };
        let set = SetOptions {
            id,
            peers,
            state_file,
            timing: Timing::default(),
        };
        set.validate()?;
        Ok(Some(set))
    }
}

/// A variable of this process's environment; one that is not Unicode is kept, with
/// its odd bytes replaced, for the token check to refuse it by name.
/// The lighthouse's tuning flags (quorum and liveness), which `phalanx run` takes too
/// for the lighthouse it serves, declared once here: (flag, option name, help).
pub fn tuning_flags() -> Vec<(String, String, String)> {
    let command = LighthouseFlags::command();
    [
        "min_replicas",
        "join_timeout",
        "heartbeat_timeout",
        "rollback_after",
    ]
    .into_iter()
    .filter_map(|id| command.get_arguments().find(|a| a.get_id() == id))
    .map(|arg| {
        let long = arg.get_long().unwrap_or_default();
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        (format!("--{long}"), arg.get_id().to_string(), help)
    })
    .collect()
}

pub fn process_environment(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}

/// Parses "1.5", "1.5s", "250ms", "2m" into a duration; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a duration; write e.g. 1s, 250ms or 2m"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("{text:?} is not a duration; it must be 0 or more"));
    }
    Ok(Duration::from_secs_f64(value * scale))
}

/// A duration as `parse_duration` reads it back: "2s", "250ms", or "1.5s" where no
/// whole unit fits.
pub fn duration_text(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{}s", duration.as_secs())
    } else if duration.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", duration.as_millis())
    } else {
        format!("{}s", duration.as_secs_f64())
    }
}

/// The lighthouse's log lines (what the set decides, what it refuses) on stderr, at
/// `RUST_LOG`'s level or info. Once per process; later calls do nothing.
pub fn log_to_stderr() {
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .try_init();
}

/// Serves until SIGINT or SIGTERM, then shuts down cleanly.
pub async fn run_lighthouse(args: LighthouseArgs) -> Result<(), Error> {
    // `phalanx lighthouse` too, not only the standalone binary.
    log_to_stderr();
    if args.flags.reset_state {
        // Before the token and the rest: resetting needs neither.
        let set = args
            .set_options()?
            .ok_or_else(|| Error::InvalidConfig("--reset-state needs --peers and --id".into()))?;
        let done = tokio::task::spawn_blocking(move || crate::lighthouse::set::reset_state(&set))
            .await
            .map_err(|e| Error::InvalidConfig(format!("--reset-state failed: {e}")))??;
        println!("phalanx lighthouse: {done}");
        return Ok(());
    }
    let options = args.options(process_environment)?;
    let set = args.set_options()?;
    for note in &args.notes {
        eprintln!("phalanx lighthouse: {note}");
    }
    let token_set = options.token.is_set();
    let handle = lighthouse::serve_in_set(options, set).await?;
    // Listen for the signals before announcing the address: a supervisor may signal
    // as soon as it reads the line, and a signal before this would kill the process
    // (SIGTERM) or be lost (SIGINT).
    let stop = shutdown_signal();
    let addr = handle.local_addr();
    let shown = crate::server::advertised_address(addr, None);
    // The token stays out of the output, which often ends up in shared logs.
    let query = if token_set {
        " (add ?token=JOB_TOKEN)"
    } else {
        ""
    };
    println!("phalanx lighthouse listening on {addr}; status page: http://{shown}/{query}");
    stop.await;
    println!("phalanx lighthouse shutting down");
    handle.shutdown().await;
    Ok(())
}

/// Registers the SIGINT and SIGTERM handlers now; the returned future ends at the
/// first of them.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    async move {
        match (interrupt, terminate) {
            (Ok(mut interrupt), Ok(mut terminate)) => {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
            }
            (Ok(mut only), Err(_)) | (Err(_), Ok(mut only)) => {
                only.recv().await;
            }
            (Err(_), Err(_)) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_a_person_writes_them() {
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").unwrap_err().contains("e.g. 1s"));
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn a_duration_shown_reads_back_the_same() {
        for ns in [
            0,
            1_000_000_000,
            250_000_000,
            1_500_000_000,
            120_000_000_000,
            1_234_567,
        ] {
            let duration = Duration::from_nanos(ns);
            let text = duration_text(duration);
            assert_eq!(parse_duration(&text), Ok(duration), "{text}");
        }
        assert_eq!(duration_text(Duration::from_millis(2000)), "2s");
        assert_eq!(duration_text(Duration::from_millis(250)), "250ms");
    }

    #[test]
    fn the_command_line_defaults_are_the_lighthouses() {
        let args = LighthouseArgs::try_parse_from(["phalanx-lighthouse"])
            .unwrap()
            .flags;
        let defaults = Tuning::DEFAULT;
        // The environment of the test process may set them; only the unset ones tell.
        if std::env::var_os("PHALANX_MIN_REPLICAS").is_none() {
            assert_eq!(args.min_replicas, defaults.min_replicas);
        }
        if std::env::var_os("PHALANX_JOIN_TIMEOUT").is_none() {
            assert_eq!(args.join_timeout, defaults.join_timeout);
        }
        if std::env::var_os("PHALANX_HEARTBEAT_TIMEOUT").is_none() {
            assert_eq!(args.heartbeat_timeout, defaults.heartbeat_timeout);
        }
        if std::env::var_os("PHALANX_ROLLBACK_AFTER").is_none() {
            assert_eq!(args.rollback_after, defaults.rollback_after);
        }
        if std::env::var_os("PHALANX_MAX_GROUPS").is_none() {
            assert_eq!(args.max_groups, defaults.max_groups);
        }
    }

    #[test]
    fn the_connection_cap_follows_the_groups_the_lighthouse_is_ready_to_serve() {
        let options = |args: &[&str]| parsed(args).unwrap().options(|_| None).unwrap();
        assert_eq!(
            options(&["--max-groups", "20000"])
                .connections
                .max_connections,
            2 * 20_000 + 5_000 + 256
        );
        if std::env::var_os("PHALANX_MAX_GROUPS").is_none() {
            let admitted = options(&[]).connections.max_connections;
            assert!(admitted > 10_000, "10,000 groups by default: {admitted}");
        }
        for bad in ["0", "1000001", "many"] {
            let refused = parsed(&["--max-groups", bad]).unwrap_err().to_string();
            assert!(refused.contains("--max-groups"), "{bad}: {refused}");
        }
    }
    fn parsed(args: &[&str]) -> Result<LighthouseArgs, clap::Error> {
        LighthouseArgs::try_parse_from(
            std::iter::once("phalanx-lighthouse").chain(args.iter().copied()),
        )
    }

    #[test]
    fn torchft_flags_set_phalanx_settings_in_milliseconds() {
        let args = parsed(&[
            "--bind",
            "[::]:29510",
            "--min_replicas",
            "2",
            "--join_timeout_ms",
            "250",
            "--heartbeat_timeout_ms",
            "1500",
            "--quorum_tick_ms",
            "100",
        ])
        .unwrap();
        assert_eq!(args.flags.bind, "[::]:29510");
        assert_eq!(args.flags.min_replicas, 2);
        assert_eq!(args.flags.join_timeout, Duration::from_millis(250));
        assert_eq!(args.flags.heartbeat_timeout, Duration::from_millis(1500));
        let options = args.options(|_| None).unwrap();
        assert_eq!(
            (
                options.min_replicas,
                options.join_timeout,
                options.heartbeat_timeout
            ),
            (2, Duration::from_millis(250), Duration::from_millis(1500))
        );
        assert_eq!(args.notes.len(), 1, "{:?}", args.notes);
        assert!(args.notes[0].starts_with("--quorum_tick_ms 100 is not needed"));
        assert!(args.notes[0].contains("decides a quorum on every event"));
    }

    #[test]
    fn a_tick_phalanx_does_not_need_is_noted_once_each() {
        let args = parsed(&["--failure_tick_ms", "1000", "--quorum_tick_ms=50"]).unwrap();
        assert_eq!(args.notes.len(), 2, "{:?}", args.notes);
        assert!(args.notes[0].starts_with("--quorum_tick_ms 50 "));
        assert!(args.notes[1].starts_with("--failure_tick_ms 1000 "));
        assert!(parsed(&[]).unwrap().notes.is_empty());
    }

    #[test]
    fn both_spellings_of_a_setting_may_be_given_if_they_agree() {
        let args = parsed(&[
            "--min-replicas",
            "2",
            "--min_replicas",
            "2",
            "--join-timeout",
            "250ms",
            "--join_timeout_ms",
            "250",
            "--heartbeat-timeout",
            "1.5s",
            "--heartbeat_timeout_ms",
            "1500",
        ])
        .unwrap();
        assert_eq!(args.flags.min_replicas, 2);
        assert_eq!(args.flags.join_timeout, Duration::from_millis(250));
        assert_eq!(args.flags.heartbeat_timeout, Duration::from_millis(1500));
    }

    #[test]
    fn both_spellings_of_a_setting_that_disagree_are_refused_naming_both() {
        for (args, phalanx, torchft) in [
            (
                ["--min-replicas", "3", "--min_replicas", "2"],
                "--min-replicas 3",
                "--min_replicas 2",
            ),
            (
                ["--join-timeout", "1s", "--join_timeout_ms", "250"],
                "--join-timeout 1s",
                "--join_timeout_ms 250",
            ),
            (
                [
                    "--heartbeat_timeout_ms",
                    "1500",
                    "--heartbeat-timeout",
                    "2s",
                ],
                "--heartbeat-timeout 2s",
                "--heartbeat_timeout_ms 1500",
            ),
        ] {
            let error = parsed(&args).unwrap_err();
            assert_eq!(error.exit_code(), 2);
            let text = error.to_string();
            assert!(text.contains(&format!("{phalanx} and {torchft}")), "{text}");
            assert!(text.contains("give one of them"), "{text}");
        }
    }

    #[test]
    fn a_torchft_flag_outranks_the_environment_and_the_default() {
        // A phalanx value that did not come from the command line (its environment
        // variable, or its default) yields, as it yields to any flag.
        let flags =
            LighthouseFlags::try_parse_from(["x", "--min-replicas", "3", "--min_replicas", "2"])
                .unwrap();
        let args = flags.resolve(|_| false).unwrap();
        assert_eq!(args.flags.min_replicas, 2);
    }

    #[test]
    fn a_torchft_flag_phalanx_cannot_honour_is_refused_with_the_fix() {
        for (args, expected) in [
            (
                ["--lighthouse_config", "lh.json"],
                [
                    "--lighthouse_config lh.json",
                    "drop the flag",
                    "give the training script",
                ],
            ),
            (
                ["--expected_replicas", "1,2,4"],
                [
                    "--expected_replicas 1,2,4",
                    "drop the flag",
                    "phalanx run --replicas N",
                ],
            ),
        ] {
            let error = parsed(&args).unwrap_err();
            assert_eq!(error.exit_code(), 2);
            let text = error.to_string();
            for part in expected {
                assert!(text.contains(part), "{part:?} in {text}");
            }
        }
    }

    #[test]
    fn a_torchft_duration_is_whole_milliseconds() {
        let error = parsed(&["--join_timeout_ms", "1s"]).unwrap_err();
        assert!(error.to_string().contains("--join_timeout_ms"), "{error}");
    }

    #[test]
    fn every_tuning_flag_is_declared_with_its_help() {
        let flags = tuning_flags();
        let names: Vec<&str> = flags.iter().map(|(flag, _, _)| flag.as_str()).collect();
        assert_eq!(
            names,
            [
                "--min-replicas",
                "--join-timeout",
                "--heartbeat-timeout",
                "--rollback-after"
            ]
        );
        assert!(flags.iter().all(|(_, _, help)| !help.is_empty()));
    }

    #[test]
    fn the_help_lists_torchft_lighthouses_flags_apart() {
        let help = LighthouseArgs::command().render_help().to_string();
        let heading = help
            .find("torchft_lighthouse's flags")
            .expect("a heading of their own");
        for flag in [
            "--min_replicas",
            "--join_timeout_ms",
            "--heartbeat_timeout_ms",
            "--quorum_tick_ms",
            "--failure_tick_ms",
            "--lighthouse_config",
            "--expected_replicas",
        ] {
            let at = help
                .find(flag)
                .unwrap_or_else(|| panic!("{flag} in {help}"));
            assert!(at > heading, "{flag} under the heading");
        }
    }
}
