"""The job token: every listener of a job refuses requests without it (I8).

`phalanx run` and `phalanx demo` make one when none is given. A job over several hosts
shares one through a file that only its owner can read:

    phalanx token ~/.phalanx/job.token          # once; copy it to every host
    phalanx run --token-file ~/.phalanx/job.token --lighthouse HOST:PORT ...

What a valid token or token file is, and which of `--token`, `--token-file`,
`PHALANX_TOKEN` and `PHALANX_TOKEN_FILE` wins, is decided by the Rust core, which the
`phalanx lighthouse` command shares.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

from phalanx import _core

#: Random bytes in a new token: 256 bits.
TOKEN_BYTES = 32


def new_token() -> str:
    """A fresh random job token, URL-safe (it travels in `?token=` of the status page).

    >>> a, b = new_token(), new_token()
    >>> a != b, len(a) >= 43, a.replace("-", "").replace("_", "").isalnum()
    (True, True, True)
    """
    return secrets.token_urlsafe(TOKEN_BYTES)


def resolve_token(
    token: str | None, token_file: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> str | None:
    """The job token given by `token` or `token_file` (one of them), else by
    PHALANX_TOKEN or PHALANX_TOKEN_FILE in `environ`; None when none is. A token file
    must be this user's and closed to everyone else (mode 0600 or 0400). Raises
    ValueError, naming what to fix, for both of a pair, a file others can read, an
    empty file or a token that is not printable ASCII.

    >>> resolve_token("from-flag", None, {"PHALANX_TOKEN": "from-env"})
    'from-flag'
    >>> resolve_token(None, None, {"PHALANX_TOKEN": "from-env"})
    'from-env'
    >>> resolve_token(None, None, {}) is None
    True
    >>> resolve_token("t", "job.token", {})
    Traceback (most recent call last):
    ValueError: both --token and --token-file are given; give the job token one way only
    """
    return _core.resolve_token(
        token=token,
        token_file=os.fspath(token_file) if token_file else None,
        env_token=environ.get("PHALANX_TOKEN"),
        env_token_file=environ.get("PHALANX_TOKEN_FILE"),
    )


def write_token_file(
    path: str | os.PathLike[str], force: bool = False, token: str | None = None
) -> None:
    """Writes `token` (default: a new one) to `path`, readable by its owner only
    (mode 0600), making its folder (mode 0700) if need be. The file appears whole or
    not at all; an existing one is kept unless `force`, since the jobs that use it
    would be locked out.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     write_token_file(f"{folder}/job.token")
    ...     mode = os.stat(f"{folder}/job.token").st_mode & 0o777
    ...     token = resolve_token(None, f"{folder}/job.token", {})
    ...     try:
    ...         write_token_file(f"{folder}/job.token")
    ...     except FileExistsError as e:
    ...         refused = str(e)
    >>> oct(mode), len(token) >= 43
    ('0o600', True)
    >>> refused.endswith("job.token already exists; pass --force to replace it (jobs that "
    ...                  "use it must then be restarted with the new token)")
    True
    """
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Written under a temporary name in the same folder, then linked or renamed into
    # place: a reader never sees half a token, and a link never replaces a file.
    fd, temporary = _private_temporary(path)
    try:
        with os.fdopen(fd, "w") as file:
            file.write((token or new_token()) + "\n")
            file.flush()
            os.fsync(file.fileno())
        if force:
            os.replace(temporary, path)
        else:
            try:
                os.link(temporary, path)
            except FileExistsError:
                raise FileExistsError(
                    f"{path} already exists; pass --force to replace it (jobs that use it "
                    "must then be restarted with the new token)"
                ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def _private_temporary(path: Path) -> tuple[int, Path]:
    """A new file next to `path` that only this user can read: (descriptor, name)."""
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot make a temporary file next to {path}")


def main(argv: list[str]) -> int:
    """`phalanx token FILE [--force]`, `phalanx token --job NAME --lighthouse-token-file
    LH FILE`."""
    parser = argparse.ArgumentParser(
        prog="phalanx token",
        description="Write a new random job token to FILE, readable by you only (mode "
        "0600), for --token-file / PHALANX_TOKEN_FILE. Copy it to every host of the job "
        "(keeping it private); the token itself is not printed. With --job, write that "
        "job's token on a lighthouse that serves many jobs instead: it opens that job "
        "only, and is derived from the lighthouse's own token, which stays with its "
        "operator.",
    )
    parser.add_argument("file", type=Path, metavar="FILE")
    parser.add_argument("--force", action="store_true", help="replace an existing FILE")
    parser.add_argument(
        "--job", metavar="NAME", help="write the token of job NAME (needs the lighthouse's)"
    )
    parser.add_argument(
        "--lighthouse-token-file",
        type=Path,
        metavar="LH",
        help="with --job: the file of the lighthouse's own token (default: PHALANX_TOKEN, "
        "PHALANX_TOKEN_FILE)",
    )
    args = parser.parse_args(argv)
    token = None
    if args.job is not None or args.lighthouse_token_file is not None:
        if args.job is None:
            parser.error("--lighthouse-token-file goes with --job NAME, the job to write for")
        try:
            secret = resolve_token(None, args.lighthouse_token_file, os.environ)
            if secret is None:
                raise ValueError(
                    "--job needs the lighthouse's own token: give --lighthouse-token-file "
                    "or set PHALANX_TOKEN_FILE"
                )
            token = _core.job_token(secret, args.job)
        except ValueError as e:
            print(f"phalanx token: {e}", file=sys.stderr)
            return 2
    try:
        write_token_file(args.file, force=args.force, token=token)
    except OSError as e:
        why = str(e) if e.strerror is None else f"cannot write {args.file}: {e.strerror}"
        print(f"phalanx token: {why}", file=sys.stderr)
        return 1
    what = "a new job token" if token is None else f"the token of job {args.job}"
    print(f"wrote {what} to {args.file} (mode 0600); use it with --token-file {args.file}")
    return 0
