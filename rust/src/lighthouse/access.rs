//! Who may ask a lighthouse about which job. The lighthouse's own token (its
//! operator's) opens every job; a job's token (`JobToken::for_job`) opens that job
//! only, so that a job's groups never reach another job's state or quorums.

use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::jobs::{JobName, JobRequest, JOB_KEY, RULES_KEY};
use crate::auth::{JobToken, AUTHORIZATION};
use crate::door::Ticket;
use crate::gate::Refusal;

/// What a caller may see: every job, or one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// The lighthouse's own token (or a lighthouse without one).
    Operator,
    /// The token of this job.
    Job(JobName),
}

impl Access {
    /// May this caller see `job`?
    pub fn sees(&self, job: &JobName) -> bool {
        match self {
            Access::Operator => true,
            Access::Job(own) => own == job,
        }
    }
}

/// The access `presented` (a raw `Authorization` value, or a bare token) opens for a
/// request about `job`, if any.
pub fn check(secret: &JobToken, presented: Option<&str>, job: &JobName) -> Option<Access> {
    if secret.admits(presented) {
        Some(Access::Operator)
    } else if presented.is_some() && secret.for_job(job.as_str()).admits(presented) {
        Some(Access::Job(job.clone()))
    } else {
        None
    }
}

/// The job of a request that passed the check (`JobCheck`); the default job of one
/// that did not go through it (a test's service called directly).
pub fn job_of<T>(request: &Request<T>) -> JobRequest {
    request
        .extensions()
        .get::<JobRequest>()
        .cloned()
        .unwrap_or_default()
}

/// The token check of every request to the lighthouse, gRPC or framed: the job the
/// request names (`parsed` from what it sent), if `presented` opens it; else why not,
/// and the reason to count.
pub fn admit(
    secret: &JobToken,
    presented: Option<&str>,
    parsed: Result<JobRequest, Status>,
) -> Result<JobRequest, (Refusal, Status)> {
    // The token first: a caller without one learns nothing of what it sent.
    let job = match &parsed {
        Ok(r) => r.job.clone(),
        Err(_) => JobName::default_job(),
    };
    if check(secret, presented, &job).is_none() {
        let message = if job.is_default() {
            "missing or wrong job token: start every process of the job with the same \
             --token or PHALANX_TOKEN"
                .to_string()
        } else {
            format!(
                "missing or wrong token for job {job}: give every process of the job its \
                 job's token (`phalanx token --job {job} --lighthouse-token-file FILE OUT`) \
                 or the lighthouse's own, as --token or PHALANX_TOKEN"
            )
        };
        return Err((Refusal::Token, Status::unauthenticated(message)));
    }
    parsed.map_err(|status| (Refusal::Invalid, status))
}

/// The token check of the lighthouse's gRPC service, by job (`admit`): an admitted
/// request proves its connection (see `gate`), a refused one is counted.
#[derive(Clone)]
pub struct JobCheck(pub JobToken);

impl Interceptor for JobCheck {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let ticket = request.extensions().get::<Ticket>().cloned();
        let metadata = request.metadata();
        let text = |key: &str| -> Result<Option<&str>, Status> {
            metadata
                .get(key)
                .map(|v| {
                    v.to_str().map_err(|_| {
                        Status::invalid_argument(format!("{key} is not printable ASCII"))
                    })
                })
                .transpose()
        };
        let parsed = text(JOB_KEY)
            .and_then(|job| Ok((job, text(RULES_KEY)?)))
            .and_then(|(job, rules)| JobRequest::parse(job, rules));
        let presented = metadata.get(AUTHORIZATION).and_then(|v| v.to_str().ok());
        match admit(&self.0, presented, parsed) {
            Ok(job) => {
                if let Some(ticket) = &ticket {
                    ticket.prove();
                }
                request.extensions_mut().insert(job);
                Ok(request)
            }
            Err((reason, status)) => {
                if let Some(ticket) = &ticket {
                    ticket.refusals().count(reason);
                }
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_token_opens_that_job_only_and_the_lighthouses_opens_all() {
        let secret = JobToken::new(Some("s3cret".into()));
        let a = JobName::parse(Some("a")).unwrap();
        let b = JobName::parse(Some("b")).unwrap();
        let a_token = secret.for_job("a").header_value().unwrap();
        assert_eq!(
            check(&secret, Some(&a_token), &a),
            Some(Access::Job(a.clone()))
        );
        assert_eq!(check(&secret, Some(&a_token), &b), None);
        assert_eq!(
            check(&secret, Some("Bearer s3cret"), &b),
            Some(Access::Operator)
        );
        assert_eq!(check(&secret, None, &a), None);
        assert!(Access::Job(a.clone()).sees(&a) && !Access::Job(a).sees(&b));
        // A lighthouse without a token opens everything to everyone.
        assert_eq!(
            check(&JobToken::default(), None, &b),
            Some(Access::Operator)
        );
    }
}
