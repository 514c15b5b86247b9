//! The lighthouse's HTTP routes, served on the gRPC port: `/` a self-contained status
//! page, `/status` as JSON, `/metrics` for Prometheus. All read-only.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use super::access::{self, Access};
use super::jobs::JobName;
use super::site::Site;
use crate::auth::{JobToken, AUTHORIZATION};
use crate::door::Ticket;
use crate::gate::Refusal;

const STATUS_PAGE: &str = include_str!("status.html");

pub(crate) fn router(site: Arc<Site>, token: JobToken) -> Router {
    Router::new()
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        // gRPC calls are POSTs to their own, more specific routes; any other page is 404.
        .route("/{*path}", get(not_found))
        .with_state(site)
        .layer(middleware::from_fn_with_state(token, require_token))
}

/// The job a page is asked about (`?job=`; none: the default job).
fn query_job(request: &Request) -> Result<JobName, tonic::Status> {
    JobName::parse(query_value(request, "job"))
}

/// The value of `key` in a request's query string, if it names one.
fn query_value<'a>(request: &'a Request, key: &str) -> Option<&'a str> {
    let query = request.uri().query()?;
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// The page's script passes `?token=` on to `/status`, so a browser needs no header.
/// The lighthouse's token opens every job's pages; a job's token, its own job's
/// (`Access`, left in the request for the pages).
async fn require_token(
    State(token): State<JobToken>,
    mut request: Request,
    next: Next,
) -> Response {
    let from_header = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let from_query = query_value(&request, "token");
    let ticket = request.extensions().get::<Ticket>().cloned();
    let job = match query_job(&request) {
        Ok(job) => job,
        Err(status) => {
            return (StatusCode::BAD_REQUEST, format!("{}\n", status.message())).into_response()
        }
    };
    let access = access::check(&token, from_header, &job)
        .or_else(|| from_query.and_then(|q| access::check(&token, Some(q), &job)));
    if let Some(access) = access {
        if let Some(ticket) = ticket {
            ticket.prove();
        }
        request.extensions_mut().insert((access, job));
        next.run(request).await
    } else {
        if let Some(ticket) = ticket {
            ticket.refusals().count(Refusal::Token);
        }
        (
            StatusCode::UNAUTHORIZED,
            "missing or wrong job token: send 'Authorization: Bearer <token>' or add ?token=<token>\n",
        )
            .into_response()
    }
}

async fn not_found() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        "no such page: the lighthouse serves /, /status and /metrics\n",
    )
}

async fn status(
    State(site): State<Arc<Site>>,
    axum::Extension(asked): axum::Extension<(Access, JobName)>,
) -> Response {
    let Some(shared) = site.find(&asked.1) else {
        let missing = format!("this lighthouse serves no job {} (?job=NAME)\n", asked.1);
        return (StatusCode::NOT_FOUND, missing).into_response();
    };
    let snap = shared.lock().snapshot(Instant::now());
    let mut value = serde_json::to_value(snap).unwrap_or_default();
    value["job"] = shared.job.as_str().into();
    value["uptime_ms"] = (site.started.elapsed().as_millis() as u64).into();
    // The jobs the caller may see: every one for the lighthouse's token.
    let jobs: Vec<serde_json::Value> = site
        .all()
        .into_iter()
        .filter(|job| asked.0.sees(&job.job))
        .map(|job| {
            let st = job.lock();
            serde_json::json!({
                "job": job.job.as_str(),
                "live_replicas": st.live_replicas(),
                "quorum_id": st.current_quorum().map(|q| q.id),
                "min_replicas": job.rules.min_replicas,
            })
        })
        .collect();
    value["jobs"] = jobs.into();
    // A lighthouse of a set says which one serves and what it sees of the others.
    if let Some(seat) = site.seat.get() {
        value["lighthouses"] = seat.view();
    }
    Json(value).into_response()
}

/// OpenMetrics to a scraper that asks for it (Prometheus does), else the older text
/// format that every other reader (promtool, curl) expects.
/// Every job's series the caller may see (the lighthouse's token: all of them, and
/// the lighthouse's own; a job's token: its job's).
async fn metrics(
    State(site): State<Arc<Site>>,
    axum::Extension(asked): axum::Extension<(Access, JobName)>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let now = Instant::now();
    let jobs: Vec<String> = site
        .all()
        .into_iter()
        .filter(|job| asked.0.sees(&job.job))
        .map(|job| {
            let snapshot = job.lock().snapshot(now);
            job.metrics.render(&job.job, &snapshot)
        })
        .collect();
    let text = site.metrics.render(&jobs);
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if openmetrics {
        ([(header::CONTENT_TYPE, OPENMETRICS)], text)
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            super::metrics::prometheus_text(&text),
        )
    }
}

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
