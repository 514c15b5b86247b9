//! The job token (invariant I8): with one set, every RPC and HTTP route refuses a
//! caller that does not present it. Also where a token comes from (a flag, a file,
//! the environment) and what makes a token file safe to read one from.

use std::io::Read;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::{service::Interceptor, Request, Status};

use crate::door::Ticket;
use crate::gate::Refusal;
use crate::Error;

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

    /// The token of job `job` under this one, the lighthouse's own: its HMAC-SHA256 of
    /// the job's name, in hex. A lighthouse serving many jobs hands each job's groups
    /// their job's token only (`phalanx token --job`): it opens that job's requests
    /// and no other's, and cannot be turned back into the lighthouse's. None without
    /// a token.
    ///
    /// ```
    /// use phalanx::auth::JobToken;
    /// let secret = JobToken::new(Some("lighthouse secret".into()));
    /// let a = secret.for_job("a");
    /// assert!(a.is_set() && a.header_value() != secret.for_job("b").header_value());
    /// assert_eq!(a.header_value(), secret.for_job("a").header_value());
    /// assert!(!JobToken::default().for_job("a").is_set());
    /// ```
    pub fn for_job(&self, job: &str) -> JobToken {
        use hmac::{Hmac, Mac};
        let Some(secret) = &self.0 else {
            return JobToken(None);
        };
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes())
            .expect("HMAC takes a key of any length");
        mac.update(b"phalanx job token\0");
        mac.update(job.as_bytes());
        let digest = mac.finalize().into_bytes();
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        JobToken(Some(hex.into()))
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

/// Adds the token, and any other metadata it was given (the job a lighthouse client's
/// requests are for, see `lighthouse::jobs`), to every outgoing request of a client.
#[derive(Clone)]
pub struct AttachToken {
    token: Option<MetadataValue<Ascii>>,
    also: Vec<(&'static str, MetadataValue<Ascii>)>,
}

impl AttachToken {
    pub fn new(token: &JobToken) -> Result<Self, String> {
        let token = token
            .header_value()
            .map(|v| {
                v.parse()
                    .map_err(|_| "the job token must be printable ASCII".to_string())
            })
            .transpose()?;
        Ok(AttachToken {
            token,
            also: Vec::new(),
        })
    }

    /// Also sends `key: value` on every request.
    pub fn with(mut self, key: &'static str, value: &str) -> Result<Self, String> {
        let value = value
            .parse()
            .map_err(|_| format!("{key} {value:?} must be printable ASCII"))?;
        self.also.push((key, value));
        Ok(self)
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let metadata = request.metadata_mut();
        if let Some(v) = &self.token {
            metadata.insert(AUTHORIZATION, v.clone());
        }
        for (key, value) in &self.also {
            metadata.insert(*key, value.clone());
        }
        Ok(request)
    }
}

/// Where a process may be given its token: as text, or as a file that holds it.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenSource<'a> {
    pub token: Option<&'a str>,
    pub file: Option<&'a Path>,
}

/// The job token a process was given, if any: from `given` (flags, or a constructor's
/// arguments) first, else from `environment` (`PHALANX_TOKEN`, `PHALANX_TOKEN_FILE`).
/// An empty value counts as not given. A source that names both a token and a file
/// is refused: which one was meant is a guess, and a wrong guess locks the job out.
pub fn resolve_token(
    given: TokenSource<'_>,
    environment: TokenSource<'_>,
) -> Result<Option<String>, Error> {
    let given_names = ("--token", "--token-file");
    let environment_names = ("PHALANX_TOKEN", "PHALANX_TOKEN_FILE");
    if let Some(token) = one_token(given, given_names)? {
        return Ok(Some(token));
    }
    one_token(environment, environment_names)
}

fn one_token(
    source: TokenSource<'_>,
    (token_name, file_name): (&str, &str),
) -> Result<Option<String>, Error> {
    let token = source.token.filter(|t| !t.is_empty());
    let file = source.file.filter(|f| !f.as_os_str().is_empty());
    match (token, file) {
        (Some(_), Some(_)) => Err(Error::InvalidConfig(format!(
            "both {token_name} and {file_name} are given; give the job token one way only"
        ))),
        (Some(token), None) => {
            check_token(token.as_bytes()).map_err(|problem| {
                Error::InvalidConfig(format!("the job token of {token_name} {problem}"))
            })?;
            Ok(Some(token.to_string()))
        }
        (None, Some(file)) => read_token_file(file).map(Some),
        (None, None) => Ok(None),
    }
}

/// A token goes into HTTP headers, URLs and environment variables: printable ASCII
/// without spaces. The problem, worded to follow "the job token …", if not.
fn check_token(token: &[u8]) -> Result<(), String> {
    if token.is_empty() {
        return Err("is empty".into());
    }
    match token.iter().position(|b| !b.is_ascii_graphic()) {
        Some(at) => Err(format!(
            "has a byte that is not printable ASCII (0x{:02x} at byte {at}); a token is \
             one word of printable ASCII, like those `phalanx token FILE` writes",
            token[at]
        )),
        None => Ok(()),
    }
}

/// A token file is one short line; anything longer is not one.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Reads the job token from `path`: a file only its owner, this user, can read
/// (anyone else who could read it could join the job), holding one line of
/// printable ASCII. Surrounding whitespace (the final newline) is not part of it.
pub fn read_token_file(path: &Path) -> Result<String, Error> {
    let shown = path.display();
    let failed = |e: std::io::Error| {
        Error::InvalidConfig(format!("cannot read the job token file {shown}: {e}"))
    };
    let file = std::fs::File::open(path).map_err(failed)?;
    let meta = file.metadata().map_err(failed)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if let Some(problem) = private_file_problem(&shown.to_string(), meta.mode(), meta.uid(), me) {
        return Err(Error::InvalidConfig(problem));
    }
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(failed)?;
    if bytes.len() as u64 > MAX_TOKEN_FILE_BYTES {
        return Err(Error::InvalidConfig(format!(
            "the job token file {shown} is longer than {MAX_TOKEN_FILE_BYTES} bytes; it \
             should hold one token on one line (`phalanx token FILE` writes one)"
        )));
    }
    let token = bytes.trim_ascii();
    if token.is_empty() {
        return Err(Error::InvalidConfig(format!(
            "the job token file {shown} is empty; write a token into it with \
             `phalanx token {shown} --force`"
        )));
    }
    check_token(token).map_err(|problem| {
        Error::InvalidConfig(format!("the job token in the file {shown} {problem}"))
    })?;
    Ok(String::from_utf8(token.to_vec()).expect("printable ASCII is UTF-8"))
}

/// Why the token file `shown`, with this mode and owner, must not be read; None when
/// only `me`, its owner, can read or change it.
fn private_file_problem(shown: &str, mode: u32, owner: u32, me: u32) -> Option<String> {
    if owner != me {
        return Some(format!(
            "the job token file {shown} belongs to user id {owner}, not to this user \
             ({me}); a token file must be yours alone: copy it to one of your own \
             (`install -m 600 {shown} MY_COPY`) and use that"
        ));
    }
    if mode & 0o077 != 0 {
        return Some(format!(
            "the job token file {shown} has mode {:04o}: users other than its owner may \
             read or change it; run `chmod 600 {shown}`",
            mode & 0o7777
        ));
    }
    None
}

/// Whether a listener bound to `ip` can be reached from other hosts: anything but
/// loopback, the wildcard (0.0.0.0, ::) included.
pub fn reachable_from_other_hosts(ip: IpAddr) -> bool {
    !ip.to_canonical().is_loopback()
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

    #[test]
    fn a_token_is_taken_from_the_flags_before_the_environment() {
        let flag = TokenSource {
            token: Some("from-flag"),
            file: None,
        };
        let env = TokenSource {
            token: Some("from-env"),
            file: None,
        };
        let none = TokenSource::default();
        assert_eq!(
            resolve_token(flag, env).unwrap().as_deref(),
            Some("from-flag")
        );
        assert_eq!(
            resolve_token(none, env).unwrap().as_deref(),
            Some("from-env")
        );
        assert_eq!(resolve_token(none, none).unwrap(), None);
        let empty = TokenSource {
            token: Some(""),
            file: Some(Path::new("")),
        };
        assert_eq!(resolve_token(empty, empty).unwrap(), None);
    }

    #[test]
    fn a_token_and_a_token_file_together_are_refused() {
        let both = TokenSource {
            token: Some("t"),
            file: Some(Path::new("/some/file")),
        };
        let given = resolve_token(both, TokenSource::default()).unwrap_err();
        assert!(given.to_string().contains("both --token and --token-file"));
        let env = resolve_token(TokenSource::default(), both).unwrap_err();
        assert!(env
            .to_string()
            .contains("both PHALANX_TOKEN and PHALANX_TOKEN_FILE"));
    }

    #[test]
    fn a_token_is_one_word_of_printable_ascii() {
        assert!(check_token(b"abc-_~XYZ09").is_ok());
        assert!(check_token(b"").is_err());
        assert!(check_token(b"two words")
            .unwrap_err()
            .contains("0x20 at byte 3"));
        assert!(check_token("caf\u{e9}".as_bytes()).is_err());
        let odd = TokenSource {
            token: Some("a\tb"),
            file: None,
        };
        let refused = resolve_token(odd, TokenSource::default()).unwrap_err();
        assert!(refused
            .to_string()
            .contains("the job token of --token has a byte"));
    }

    #[test]
    fn only_a_file_of_ones_own_that_no_one_else_can_read_holds_a_token() {
        assert_eq!(private_file_problem("f", 0o100600, 7, 7), None);
        assert_eq!(private_file_problem("f", 0o100400, 7, 7), None);
        let shared = private_file_problem("f", 0o100644, 7, 7).unwrap();
        assert!(shared.contains("has mode 0644") && shared.contains("chmod 600 f"));
        assert!(private_file_problem("f", 0o100620, 7, 7).is_some());
        let theirs = private_file_problem("f", 0o100600, 8, 7).unwrap();
        assert!(theirs.contains("belongs to user id 8"));
    }

    #[test]
    fn wildcard_and_other_addresses_are_reachable_from_other_hosts() {
        for ip in ["0.0.0.0", "::", "10.0.0.3", "fe80::1"] {
            assert!(reachable_from_other_hosts(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(!reachable_from_other_hosts(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn a_token_file_is_read_only_when_it_is_private_and_holds_a_token() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("phalanx-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        let write = |text: &str, mode: u32| {
            std::fs::write(&file, text).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        };

        write("s3cret\n", 0o600);
        assert_eq!(read_token_file(&file).unwrap(), "s3cret");
        write("s3cret\n", 0o644);
        let shared = read_token_file(&file).unwrap_err().to_string();
        assert!(
            shared.contains("has mode 0644") && shared.contains("chmod 600"),
            "{shared}"
        );
        write("\n", 0o600);
        assert!(read_token_file(&file)
            .unwrap_err()
            .to_string()
            .contains("is empty"));
        write("s3\x07cret", 0o600);
        assert!(read_token_file(&file)
            .unwrap_err()
            .to_string()
            .contains("0x07 at byte 2"));
        let missing = read_token_file(&dir.join("none")).unwrap_err().to_string();
        assert!(
            missing.contains("cannot read the job token file"),
            "{missing}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
