//! The job token's rules, shared with the lighthouse command.

use pyo3::prelude::*;

use super::to_py;

/// The job token given by `token` or `token_file`, else by `env_token` or
/// `env_token_file` (PHALANX_TOKEN, PHALANX_TOKEN_FILE); None when none is. The rules
/// are the lighthouse command's: one of each pair, a token file only its owner can
/// read, printable ASCII.
#[pyfunction]
#[pyo3(signature = (token = None, token_file = None, env_token = None, env_token_file = None))]
fn resolve_token(
    token: Option<String>,
    token_file: Option<std::path::PathBuf>,
    env_token: Option<String>,
    env_token_file: Option<std::path::PathBuf>,
) -> PyResult<Option<String>> {
    use crate::auth::TokenSource;
    crate::auth::resolve_token(
        TokenSource {
            token: token.as_deref(),
            file: token_file.as_deref(),
        },
        TokenSource {
            token: env_token.as_deref(),
            file: env_token_file.as_deref(),
        },
    )
    .map_err(to_py)
}

/// The token of job `job` on a lighthouse whose own token is `lighthouse_token`
/// (`JobToken::for_job`): it opens that job's requests and no other's.
#[pyfunction]
fn job_token(lighthouse_token: &str, job: &str) -> PyResult<String> {
    use pyo3::exceptions::PyValueError;
    let name = crate::lighthouse::jobs::JobName::parse(Some(job))
        .map_err(|status| PyValueError::new_err(status.message().to_string()))?;
    if name.is_default() {
        return Err(PyValueError::new_err(
            "the default job has no token of its own: its groups take the lighthouse's",
        ));
    }
    let secret = crate::auth::JobToken::new(Some(lighthouse_token.to_string()));
    let token = secret
        .for_job(name.as_str())
        .header_value()
        .ok_or_else(|| {
            PyValueError::new_err("the lighthouse's token is empty; give the one it runs with")
        })?;
    Ok(token.trim_start_matches("Bearer ").to_string())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(resolve_token, m)?)?;
    m.add_function(wrap_pyfunction!(job_token, m)?)?;
    Ok(())
}
