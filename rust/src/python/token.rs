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

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(resolve_token, m)?)?;
    Ok(())
}
