//! One lighthouse, many jobs (`lighthouse::jobs`): each job's quorums, ids, rules,
//! token, status and metrics are its own; idle jobs are forgotten; a job-less
//! request is the default job's, as before jobs had names.

use super::*;
use phalanx::lighthouse::jobs::JobRequest;

fn job(name: &str, rules: &str) -> JobRequest {
    JobRequest::parse(Some(name), Some(rules)).expect("a valid job")
}

fn job_client(addr: SocketAddr, token: &JobToken, job: &JobRequest) -> LighthouseClient {
    LighthouseClient::for_job(&addr.to_string(), token, job, Duration::from_secs(1))
        .expect("client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_jobs_on_one_lighthouse_form_their_own_quorums_under_their_own_rules() {
    // The lighthouse's own rule (min_replicas 1) is the default job's; job a asks 2.
    let (_lighthouse, addr) = start(1).await;
    let a = job_client(addr, &JobToken::default(), &job("a", "min_replicas=2"));
    let b = job_client(addr, &JobToken::default(), &job("b", ""));

    // Job a's first group alone is not a quorum of a; b's one group is a quorum of b.
    let a1 = ask(&a, member("g1", 0), 0);
    let quorums = every_asks(&b, &["g1"], 0, 0).await;
    assert_eq!(ids(&quorums[0]), ["g1"], "b's quorum holds b's group only");
    assert!(!a1.is_finished(), "job a waits for its second group");
    // The same replica ids in both jobs are no duplicates: each job has its own.
    let a2 = ask(&a, member("g2", 0), 0);
    let of_a = answers(vec![a1, a2]).await;
    assert_eq!(ids(&of_a[0]), ["g1", "g2"]);
    assert_eq!(of_a[0].quorum_id, of_a[1].quorum_id);
    // Each job numbers its quorums itself: a's first quorum has b's first id.
    assert_eq!(of_a[0].quorum_id, quorums[0].quorum_id);

    // A job-less client is the default job's, which has seen none of these groups.
    let status = status_rpc(&client(addr)).await;
    assert!(status.replicas.is_empty(), "{status:?}");
    let status = status_rpc(&a).await;
    assert_eq!(status.min_replicas, 2);
    assert!(known(&status, "g1") && known(&status, "g2"));

    // A group of a that declares other rules is refused, both rules named.
    let other = job_client(addr, &JobToken::default(), &job("a", "min_replicas=3"));
    let (code, message) = rpc_code(other.quorum(member("g3", 0), 0, CALL_TIMEOUT).await);
    assert_eq!(code, Code::FailedPrecondition);
    assert!(
        message.contains("job a runs with min_replicas=2") && message.contains("min_replicas=3"),
        "{message}"
    );
    // And a default-job group may not re-rule the lighthouse's flags.
    let rerule = job_client(
        addr,
        &JobToken::default(),
        &job("default", "min_replicas=2"),
    );
    let (code, message) = rpc_code(rerule.quorum(member("g4", 0), 0, CALL_TIMEOUT).await);
    assert_eq!(code, Code::FailedPrecondition, "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_token_opens_that_job_only_and_the_lighthouses_opens_every_job() {
    let secret = JobToken::new(Some("s3cret".into()));
    let lighthouse = lighthouse::serve(LighthouseOptions {
        token: secret.clone(),
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = lighthouse.local_addr();
    let (job_a, job_b) = (job("a", ""), job("b", ""));
    let a_token = secret.for_job("a");

    every_asks(&job_client(addr, &a_token, &job_a), &["a1"], 0, 0).await;
    every_asks(&job_client(addr, &secret, &job_b), &["b1"], 0, 0).await;
    // a's token opens neither b nor the default job, for any call.
    for other in [job_b.clone(), JobRequest::default()] {
        let c = job_client(addr, &a_token, &other);
        let (code, message) = rpc_code(c.quorum(member("x", 0), 0, CALL_TIMEOUT).await);
        assert_eq!(code, Code::Unauthenticated, "{other:?}");
        let says = match other.job.is_default() {
            true => "missing or wrong job token".to_string(),
            false => format!("token for job {}", other.job),
        };
        assert!(message.contains(&says), "{message}");
        let (code, _) = rpc_code(c.status(CALL_TIMEOUT).await);
        assert_eq!(code, Code::Unauthenticated);
        let (code, _) = rpc_code(open_heartbeat(&c, "x").await.map(|_| ()));
        assert_eq!(code, Code::Unauthenticated);
    }
    assert!(known(
        &status_rpc(&job_client(addr, &a_token, &job_a)).await,
        "a1"
    ));

    // The pages: a's token sees a's status and series only; the lighthouse's, all.
    let a_header = a_token.header_value().unwrap();
    let (code, body) = http_get(addr, "/status?job=a", Some(&a_header)).await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(status["job"], "a");
    assert!(json_knows(&status, "a1") && !json_knows(&status, "b1"));
    let jobs: Vec<&str> = status["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["job"].as_str().unwrap())
        .collect();
    assert_eq!(jobs, ["a"], "a's token is shown a's job only");
    for path in ["/status?job=b", "/status", "/metrics?job=b"] {
        let (code, _) = http_get(addr, path, Some(&a_header)).await;
        assert_eq!(code, 401, "GET {path} with a's token");
    }
    let (code, metrics) = http_get(addr, "/metrics?job=a", Some(&a_header)).await;
    assert_eq!(code, 200, "{metrics}");
    assert!(
        metrics.contains(r#"phalanx_lighthouse_group_live{phalanx_job="a",replica_id="a1"} 1"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"phalanx_job="b""#), "{metrics}");
    let (code, body) = http_get(addr, "/status?job=b", Some("Bearer s3cret")).await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(json_knows(&status, "b1"));
    assert_eq!(status["jobs"].as_array().unwrap().len(), 3, "{status}");
    let (_, metrics) = http_get(addr, "/metrics", Some("Bearer s3cret")).await;
    for series in [
        r#"phalanx_lighthouse_group_live{phalanx_job="a",replica_id="a1"} 1"#,
        r#"phalanx_lighthouse_group_live{phalanx_job="b",replica_id="b1"} 1"#,
        "phalanx_lighthouse_jobs 3",
    ] {
        assert!(metrics.contains(series), "{series} in:\n{metrics}");
    }
    // A job name that is no name is refused as such, before anything else.
    let (code, body) = http_get(addr, "/status?job=a%2Fb", Some("Bearer s3cret")).await;
    assert_eq!(code, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_job_is_forgotten_and_no_job_past_max_jobs_starts() {
    let lighthouse = lighthouse::serve(LighthouseOptions {
        jobs: JobLimits {
            max_jobs: 2,
            forget_after: Duration::from_millis(300),
        },
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = lighthouse.local_addr();
    let a = job_client(addr, &JobToken::default(), &job("a", ""));
    let b = job_client(addr, &JobToken::default(), &job("b", ""));
    let first = every_asks(&a, &["g"], 0, 0).await[0].quorum_id;

    // The default job and a are two: b cannot start while a is held by a group.
    let group = open_heartbeat(&a, "g").await.expect("a's group beats");
    let beating = keep_beating(group.beats, "g");
    let (code, message) = rpc_code(b.quorum(member("g", 0), 0, CALL_TIMEOUT).await);
    assert_eq!(code, Code::ResourceExhausted);
    assert!(message.contains("--max-jobs"), "{message}");
    assert_eq!(refused(addr, "", "jobs_full").await, 1);

    // Once a's group is gone, a is forgotten, and b starts.
    beating.abort();
    eventually("b starts once a is forgotten", PATIENCE, || async {
        b.quorum(member("g", 0), 0, CALL_TIMEOUT).await.is_ok()
    })
    .await;
    let (_, metrics) = http_get(addr, "/metrics", None).await;
    assert!(
        metrics.contains("phalanx_lighthouse_jobs_forgotten_total 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"phalanx_job="a""#),
        "a's series left with it:\n{metrics}"
    );
    // A job that comes back after it was forgotten starts afresh, above its last id
    // only by what its groups report (I3), as after a lighthouse restart.
    drop(b);
    eventually("a starts again once b is forgotten", PATIENCE, || async {
        a.quorum(member("g", 1), first, CALL_TIMEOUT)
            .await
            .is_ok_and(|q| q.quorum_id > first)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_short_jobs_leave_nothing_behind() {
    let lighthouse = lighthouse::serve(LighthouseOptions {
        jobs: JobLimits {
            max_jobs: 2000,
            forget_after: Duration::from_millis(100),
        },
        ..options(1)
    })
    .await
    .expect("lighthouse starts");
    let addr = lighthouse.local_addr();
    // A connection each (a job's client names its job on every request), fifty at a
    // time: below the lighthouse's cap on connections not yet proven by a request.
    for batch in 0..20 {
        let asking: Vec<_> = (0..50)
            .map(|i| {
                let name = format!("short-{}", batch * 50 + i);
                let c = job_client(addr, &JobToken::default(), &job(&name, ""));
                tokio::spawn(async move { c.quorum(member("g", 0), 0, CALL_TIMEOUT).await })
            })
            .collect();
        for quorum in asking {
            quorum
                .await
                .expect("task")
                .expect("each short job forms its quorum");
        }
    }
    let jobs = |metrics: &str, name: &str| -> Option<u64> {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("phalanx_lighthouse_{name} ")))
            .and_then(|v| v.parse().ok())
    };
    eventually("every short job is forgotten", PATIENCE, || async {
        let (_, metrics) = http_get(addr, "/metrics", None).await;
        jobs(&metrics, "jobs") == Some(1) && jobs(&metrics, "jobs_forgotten_total") == Some(1000)
    })
    .await;
    let (_, metrics) = http_get(addr, "/metrics", None).await;
    assert!(!metrics.contains("phalanx_job="), "no job's series is left");
}
