"""How a rank of `phalanx run` starts: its program found as the shell would, whether
the fork server can fork it, the `sys.path` it would see, and the folder that makes
its `import torchft` phalanx's (--as-torchft)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping

from phalanx._torchft_alias.torchft import ALIAS_DIR, real_torchft, refusal
from phalanx.forkserver import runnable
from phalanx.forkserver.wire import environment, ours


def resolve(command: list[str]) -> list[str]:
    """`command` with its program where PATH finds it, as the shell would, so that
    `python -m train` can be recognised as this interpreter's (see `rank_mode`).

    >>> resolve(["sh", "-c", "true"])[0] == shutil.which("sh")
    True
    >>> resolve(["no-such-program", "x"])
    ['no-such-program', 'x']
    """
    found = shutil.which(command[0])
    return [found, *command[1:]] if found else command


def rank_mode(command: list[str], fork_server: bool) -> tuple[bool, str]:
    """Whether ranks of `command` (resolved) are forked by the fork server, and why,
    for the log: only a module or a script of the launcher's own interpreter can be.

    >>> rank_mode([sys.executable, "-m", "train"], fork_server=True)[0]
    True
    >>> rank_mode([sys.executable, "-m", "train"], fork_server=False)
    (False, 'plain processes (--no-fork-server)')
    >>> rank_mode([sys.executable, "-c", "print(1)"], fork_server=True)[1].startswith(
    ...     f"plain processes ({sys.executable} -c is not `python -m MODULE`"
    ... )
    True
    """
    if not fork_server:
        return False, "plain processes (--no-fork-server)"
    if runnable(command):
        return True, f"fork server ({command[0]} is this launcher's interpreter)"
    if os.path.realpath(command[0]) == os.path.realpath(sys.executable) and not ours(command[0]):
        return False, (
            f"plain processes ({command[0]} starts in the environment "
            f"{environment(command[0])}, not in "
            f"this launcher's, {sys.prefix}: a fork of the launcher would run the job with "
            "the launcher's packages)"
        )
    return False, (
        f"plain processes ({' '.join(command[:2])} is not `python -m MODULE` or "
        f"`python SCRIPT.py` run by this launcher's interpreter, {sys.executable})"
    )


#: The interpreter's options that take the next word as their value.
_VALUED = frozenset("WX")
#: Its long options that do.
_VALUED_LONG = frozenset({"--check-hash-based-pycs"})


def python_start(command: list[str]) -> tuple[str | None, frozenset[str]]:
    """How a Python `command` (resolved) starts: the first `sys.path` entry it gets
    (its script's folder; the working directory for `-m`, `-c` or standard input;
    None under `-P` or `-I`) and the one-letter flags it was given.

    >>> python_start(["python", "-u", "-X", "dev", "/jobs/train.py", "--lr", "1"])
    ('/jobs', frozenset({'u'}))
    >>> python_start(["python", "-Im", "train"])[0] is None
    True
    """
    flags: set[str] = set()
    script = None
    words = command[1:]
    at = 0
    while at < len(words):
        word = words[at]
        at += 1
        if word in _VALUED_LONG:
            at += 1
        elif word == "--":
            script = words[at] if at < len(words) else None
            break
        elif word == "-" or not word.startswith("-"):
            script = None if word == "-" else word
            break
        elif not word.startswith("--"):
            letters = word[1:]
            ends = next((i for i, letter in enumerate(letters) if letter in "cm"), None)
            valued = next((i for i, letter in enumerate(letters) if letter in _VALUED), None)
            stop = min(i for i in (ends, valued, len(letters)) if i is not None)
            flags.update(letters[:stop])
            if stop == ends:
                break  # -c CODE or -m MODULE: the rest is the program's
            if stop == valued and stop == len(letters) - 1:
                at += 1  # -X dev: the value is the next word
    if flags & {"P", "I"}:
        return None, frozenset(flags)
    first = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
    return first, frozenset(flags)


def rank_sys_path(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """The `sys.path` a rank running `command` (resolved) would start with: its
    script's folder (or the working directory) first, then PYTHONPATH, then what this
    interpreter's site adds, as the launcher's own `sys.path` shows it.

    >>> rank_sys_path([sys.executable, "-u", "/jobs/train.py"], {"PYTHONPATH": "/a:/b"})[:3]
    ['/jobs', '/a', '/b']
    """
    first, flags = python_start(command)
    ours = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    # This process's own first entry is its script's folder, not a rank's.
    site = [p for p in sys.path[0 if sys.flags.safe_path else 1 :] if p not in ours]
    given = [] if flags & {"E", "I"} else environ.get("PYTHONPATH", "").split(os.pathsep)
    return [*([first] if first else []), *(p for p in given if p), *site]


def torchft_alias_dir(command: list[str], environ: Mapping[str, str]) -> str:
    """The folder whose `torchft` is `phalanx.torchft`, for --as-torchft; ValueError
    (what to do) if the ranks would find a real torchft as well, which the alias
    itself would refuse in every rank."""
    if os.path.basename(command[0]).startswith("python"):
        ignored = python_start(command)[1] & {"E", "I"}
        if ignored:
            raise ValueError(
                f"`{command[0]} -{''.join(sorted(ignored))}` ignores PYTHONPATH, where "
                "--as-torchft puts phalanx's torchft: drop the flag, or import phalanx.torchft "
                "in the script instead of torchft"
            )
    found = real_torchft(rank_sys_path(command, environ))
    if found is not None:
        raise ValueError(refusal(found))
    return ALIAS_DIR
