//! The optional job token (invariant I8): with one set, every RPC and HTTP route
//! refuses a caller that does not present it.

use std::sync::Arc;

use tonic::{service::Interceptor, Request, Status};

use crate::door::Ticket;
use crate::gate::Refusal;

/// gRPC metadata key and HTTP header that carry the token, as `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

#[derive(Clone, Default)]
pub struct JobToken(Option<Arc<str>>);

impl JobToken {
    pub fn new(token: Option<String>) -> Self {
        JobToken(token.filter(|t| !t.is_empty()).map(Into::into))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// `Bearer <token>`, for callers to send.
    pub fn header_value(&self) -> Option<String> {
        self.0.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// Does `presented` (the raw header value, or a bare token) open the door?
    pub fn admits(&self, presented: Option<&str>) -> bool {
        let Some(expected) = &self.0 else {
            return true;
        };
        let Some(presented) = presented else {
            return false;
        };
        let presented = presented.strip_prefix("Bearer ").unwrap_or(presented);
        constant_time_eq(presented.as_bytes(), expected.as_bytes())
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "JobToken(set)"
        } else {
            "JobToken(none)"
        })
    }
}

/// Compares without an early exit, so response timing does not leak the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token check of every gRPC server: an admitted request proves its connection
/// (see `gate`), a refused one is counted.
impl Interceptor for JobToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let presented = request
            .metadata()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let ticket = request.extensions().get::<Ticket>();
        if self.admits(presented) {
            if let Some(ticket) = ticket {
                ticket.prove();
            }
            Ok(request)
        } else {
            if let Some(ticket) = ticket {
                ticket.refusals().count(Refusal::Token);
            }
            Err(Status::unauthenticated(
                "missing or wrong job token: start every process of the job with the same \
                 --token or PHALANX_TOKEN",
            ))
        }
    }
}

/// Adds the token to every outgoing request of a client.
#[derive(Clone)]
pub struct AttachToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl AttachToken {
    pub fn new(token: &JobToken) -> Result<Self, String> {
        token
            .header_value()
            .map(|v| {
                v.parse()
                    .map_err(|_| "the job token must be printable ASCII".to_string())
            })
            .transpose()
            .map(AttachToken)
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert(AUTHORIZATION, v.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_token_is_admitted() {
        let token = JobToken::new(Some("s3cret".into()));
        assert!(token.admits(Some("Bearer s3cret")));
        assert!(token.admits(Some("s3cret")));
        assert!(!token.admits(Some("Bearer s3cre")));
        assert!(!token.admits(None));
        assert!(JobToken::new(None).admits(None));
        assert!(JobToken::new(Some(String::new())).admits(None));
    }
}
