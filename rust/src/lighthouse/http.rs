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

use super::service::Shared;
use crate::auth::{JobToken, AUTHORIZATION};
use crate::door::Ticket;
use crate::gate::Refusal;

const STATUS_PAGE: &str = include_str!("status.html");

pub(crate) fn router(shared: Arc<Shared>, token: JobToken) -> Router {
    Router::new()
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        // gRPC calls are POSTs to their own, more specific routes; any other page is 404.
        .route("/{*path}", get(not_found))
        .with_state(shared)
        .layer(middleware::from_fn_with_state(token, require_token))
}

/// The page's script passes `?token=` on to `/status`, so a browser needs no header.
async fn require_token(State(token): State<JobToken>, request: Request, next: Next) -> Response {
    let from_header = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let from_query = request
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("token=")));
    let ticket = request.extensions().get::<Ticket>().cloned();
    if token.admits(from_header) || (from_query.is_some() && token.admits(from_query)) {
        if let Some(ticket) = ticket {
            ticket.prove();
        }
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

async fn status(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let snap = shared.lock().snapshot(Instant::now());
    let mut value = serde_json::to_value(snap).unwrap_or_default();
    value["uptime_ms"] = (shared.started.elapsed().as_millis() as u64).into();
    // A lighthouse of a set says which one serves and what it sees of the others.
    if let Some(seat) = shared.seat.get() {
        value["lighthouses"] = seat.view();
    }
    Json(value)
}

/// OpenMetrics to a scraper that asks for it (Prometheus does), else the older text
/// format that every other reader (promtool, curl) expects.
async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> impl IntoResponse {
    let snapshot = shared.lock().snapshot(Instant::now());
    let text = shared.metrics.render(&snapshot);
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
