"""What `phalanx run` is asked to do: its command line (`build_parser`) and the
checked configuration it gives (`LaunchConfig`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from phalanx import _core
from phalanx.launcher.chaos import Chaos
from phalanx.launcher.restarts import MAX_BACKOFF
from phalanx.snapshots.rank import DEFAULT_KEEP, SnapshotSettings
from phalanx.token import new_token, resolve_token


def parse_duration(text: str) -> float:
    """Seconds from "15s", "500ms", "2m" or a plain number, read as the lighthouse's
    command line reads them.

    >>> parse_duration("15s"), parse_duration("500ms"), parse_duration("2m"), parse_duration("3")
    (15.0, 0.5, 120.0, 3.0)
    """
    return _core.parse_duration(text)


def job_token(token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """The job's token: the one given (--token, --token-file, PHALANX_TOKEN,
    PHALANX_TOKEN_FILE), else a new random one, so that no job runs open. ValueError
    (what to fix) for a token given wrong.

    >>> job_token(None, None, {"PHALANX_TOKEN": "given"})
    'given'
    >>> len(job_token(None, None, {})) >= 43
    True
    """
    return resolve_token(token, token_file, environ) or new_token()


@dataclass(frozen=True)
class LaunchConfig:
    """What `phalanx run` is asked to do, checked: the command line's options, typed.

    >>> config = LaunchConfig(command=("python", "train.py"), replicas=2)
    >>> config.replica_ids(), config.chaos.kill_every
    (['group0', 'group1'], None)
    >>> LaunchConfig(command=("train.sh",), replicas=1, replica_id="host7").replica_ids()
    ['host7']
    >>> LaunchConfig(command=())
    Traceback (most recent call last):
    ...
    ValueError: give the training command after --, e.g. -- train.py --lr 0.1
    >>> LaunchConfig(command=("train.sh",), max_restarts=-1)
    Traceback (most recent call last):
    ...
    ValueError: --max-restarts -1: give 0 or more, the failures in a row (without a ...
    """

    #: The training command each rank runs.
    command: tuple[str, ...]
    replicas: int = 1
    nproc_per_replica: int = 1
    #: The lighthouse of a job that spans hosts; None: serve one here.
    lighthouse: str | None = None
    #: Where the lighthouse served here listens, and its options.
    lighthouse_bind: str = "127.0.0.1:0"
    min_replicas: int = int(_core.LIGHTHOUSE_DEFAULTS["min_replicas"])
    join_timeout: float = _core.LIGHTHOUSE_DEFAULTS["join_timeout"]
    heartbeat_timeout: float = _core.LIGHTHOUSE_DEFAULTS["heartbeat_timeout"]
    rollback_after: float = _core.LIGHTHOUSE_DEFAULTS["rollback_after"]
    #: The group's id; with several replicas, the prefix of their ids.
    replica_id: str | None = None
    #: The job's name on a lighthouse that serves many (None: its default job).
    job: str | None = None
    #: Failures in a row (without a committed step in between) a group is restarted
    #: after; evictions as stalled are counted apart, against as many (`RestartCount`).
    max_restarts: int = 10
    restart_backoff: float = 0.5
    #: MASTER_ADDR of the ranks: where each group's rank 0 listens.
    master_addr: str = "127.0.0.1"
    chaos: Chaos = field(default_factory=Chaos)
    chaos_seed: int = 0
    fork_server: bool = True
    #: `import torchft` in the ranks is `phalanx.torchft` (`torchft_alias_dir`).
    as_torchft: bool = False
    #: Durable snapshots of the job's state, passed to the ranks (None: none).
    snapshots: SnapshotSettings | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("give the training command after --, e.g. -- train.py --lr 0.1")
        if self.replicas < 1 or self.nproc_per_replica < 1:
            raise ValueError("--replicas and --nproc-per-replica must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(
                f"--max-restarts {self.max_restarts}: give 0 or more, the failures in a row "
                "(without a committed step) after which a group is given up on; 0: never "
                "restart a failed group"
            )
        if self.restart_backoff < 0:
            raise ValueError(f"--restart-backoff {self.restart_backoff:g}: give 0 or more seconds")

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: list[str]) -> LaunchConfig:
        """The config of parsed `phalanx run` options; ValueError for a bad one."""
        if command and command[0].endswith(".py"):
            command = [sys.executable, *command]
        # Every other field is the option of its name, as parsed.
        built = {"command", "chaos", "snapshots"}
        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in built}
        return cls(
            command=tuple(command),
            chaos=Chaos.parse(args.chaos),
            snapshots=snapshot_settings(args.snapshot_dir, args.snapshot_every, args.snapshot_keep),
            **given,
        )

    def rank_environ(self) -> dict[str, str]:
        """What the config adds to every rank's environment.

        >>> config = LaunchConfig(("train.py",), snapshots=SnapshotSettings.of("/ckpt", "500"))
        >>> config.rank_environ()["PHALANX_SNAPSHOT_EVERY"]
        '500'
        >>> environ = LaunchConfig(("train.py",), job="llama", min_replicas=2).rank_environ()
        >>> environ["PHALANX_JOB"], environ["PHALANX_JOB_RULES"].split(",")[:2]
        ('llama', ['min_replicas=2', 'join_timeout_ms=1000'])
        """
        environ = {}
        if self.job:
            environ["PHALANX_JOB"] = self.job
            environ["PHALANX_JOB_RULES"] = self.job_rules()
        s = self.snapshots
        if s is not None:
            every = str(s.every.steps) if s.every.steps is not None else f"{s.every.seconds:g}s"
            environ.update(
                PHALANX_SNAPSHOT_DIR=s.location,
                PHALANX_SNAPSHOT_EVERY=every,
                PHALANX_SNAPSHOT_KEEP=str(s.keep),
            )
        return environ

    def job_rules(self) -> str:
        """The quorum rules the groups of a named job declare: this launcher's
        `--min-replicas`, `--join-timeout`, `--heartbeat-timeout`, `--rollback-after`.
        Every launcher of the job must agree on them, or the lighthouse refuses the
        groups of the one that does not, both rules named."""

        def ms(seconds: float) -> int:
            return max(1, round(seconds * 1000))

        return (
            f"min_replicas={self.min_replicas},join_timeout_ms={ms(self.join_timeout)},"
            f"heartbeat_timeout_ms={ms(self.heartbeat_timeout)},"
            f"rollback_after_ms={ms(self.rollback_after)}"
        )

    def replica_ids(self) -> list[str]:
        if self.replicas == 1 and self.replica_id:
            return [self.replica_id]
        prefix = self.replica_id or "group"
        return [f"{prefix}{i}" for i in range(self.replicas)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx run",
        description="Run a fault-tolerant training job: N replica groups of W ranks each.",
        usage="phalanx run [options] -- COMMAND [ARGS...]",
    )
    _add_group_options(parser)
    _add_lighthouse_options(parser)
    _add_access_options(parser)
    _add_rank_options(parser)
    _add_snapshot_options(parser)
    return parser


def snapshot_settings(
    location: str | None, every: str | None, keep: int
) -> SnapshotSettings | None:
    """The snapshots of `--snapshot-dir/--snapshot-every/--snapshot-keep`; ValueError
    when one is given without the other."""
    return SnapshotSettings.given(location, every, keep, ("--snapshot-dir", "--snapshot-every"))


def _add_snapshot_options(parser: argparse.ArgumentParser) -> None:
    """Durable snapshots, for the loss of every group at once."""
    parser.add_argument(
        "--snapshot-dir",
        metavar="DIR|URL",
        help="where the job's snapshots go: a directory (shared by a group's ranks) or an "
        "fsspec URL; a job whose every group was lost resumes from the newest; `phalanx "
        "snapshots DIR` lists them (default: none)",
    )
    parser.add_argument(
        "--snapshot-every",
        metavar="N|DURATION",
        help="snapshot every N committed steps (e.g. 500) or every DURATION (e.g. 10m); one "
        "group writes each, in turn, beside training (default: none; required with "
        "--snapshot-dir)",
    )
    parser.add_argument(
        "--snapshot-keep",
        type=int,
        default=DEFAULT_KEEP,
        metavar="K",
        help=f"snapshots kept, newest first (default: {DEFAULT_KEEP})",
    )


def _add_group_options(parser: argparse.ArgumentParser) -> None:
    """The groups: how many, how big, their ids, their restarts."""
    parser.add_argument(
        "--replicas", type=int, default=1, metavar="N", help="replica groups to start (default: 1)"
    )
    parser.add_argument(
        "--nproc-per-replica",
        type=int,
        default=1,
        metavar="W",
        help="ranks per group, e.g. one per GPU of the host; each gets LOCAL_RANK (default: 1)",
    )
    parser.add_argument(
        "--lighthouse",
        metavar="HOST:PORT",
        help="join the lighthouse of a job that spans hosts, or a set of them as "
        "HOST:PORT,HOST:PORT,HOST:PORT (default: serve one here)",
    )
    parser.add_argument(
        "--lighthouse-bind",
        metavar="HOST:PORT",
        default="127.0.0.1:0",
        help="where the lighthouse served here listens (default: 127.0.0.1, any free port)",
    )
    parser.add_argument(
        "--job",
        metavar="NAME",
        default=os.environ.get("PHALANX_JOB") or None,
        help="the job's name on a lighthouse that serves many jobs (letters, digits, '.', "
        "'_', '-'): its own quorums, rules (this launcher's --min-replicas and timeouts) "
        "and token (`phalanx token --job NAME`) (default: PHALANX_JOB, else the "
        "lighthouse's default job)",
    )
    parser.add_argument(
        "--replica-id",
        metavar="ID",
        help="the group's id, unique in the job; with --replicas N, the prefix of the "
        "N ids (default: group, giving group0, group1, …)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=10,
        metavar="K",
        help="failures of one group in a row (without a committed step in between) that "
        "it is restarted after; evictions as stalled are counted apart, against as many; "
        "then the launcher gives up on it (default: 10)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="wait before a group's first restart, doubled on each next in a row, up to "
        f"{MAX_BACKOFF:g} s (default: 0.5)",
    )


def _add_lighthouse_options(parser: argparse.ArgumentParser) -> None:
    """The lighthouse served here when no --lighthouse is given: the flags of
    `phalanx lighthouse` that tune it, as the core declares them."""
    for flag, key, what in _core.LIGHTHOUSE_TUNING_FLAGS:
        default = _core.LIGHTHOUSE_DEFAULTS[key]
        is_count = isinstance(default, int)
        shown = f"{default}" if is_count else f"{default:g}s"
        parser.add_argument(
            flag,
            type=int if is_count else parse_duration,
            default=default,
            metavar="N" if is_count else "DURATION",
            help=f"{what.rstrip('.')} (the lighthouse served here; default: {shown})",
        )


def _add_access_options(parser: argparse.ArgumentParser) -> None:
    """Who may reach the job (its token) and where its groups listen."""
    parser.add_argument(
        "--token",
        help="the job token (default: PHALANX_TOKEN, else a new random one); other "
        "users of this host can see it in the process list: prefer --token-file",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="read the job token from FILE, readable by its owner only (default: "
        "PHALANX_TOKEN_FILE); `phalanx token FILE` writes one",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="with --lighthouse and no token: run this launcher's groups without one, open "
        "to anyone who can reach them (default: off)",
    )
    parser.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="the address this host's groups' rank 0 listens on for its manager server and "
        "rendezvous store: MASTER_ADDR of the ranks (default: 127.0.0.1)",
    )


def _add_rank_options(parser: argparse.ArgumentParser) -> None:
    """How ranks start, and the failures injected on purpose."""
    parser.add_argument(
        "--chaos",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject failures on purpose, e.g. kill-every=15s (SIGKILL a random group), "
        "hang-every=30s,hang-for=5s (SIGSTOP one), hang-thread-every=30s,hang-for=60s "
        "(block one rank's training thread while its process lives: its group is "
        "evicted as stalled and restarted); repeatable (default: none)",
    )
    parser.add_argument(
        "--chaos-seed",
        type=int,
        default=0,
        metavar="SEED",
        help="seed of the chaos' choices (default: 0)",
    )
    parser.add_argument(
        "--fork-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork Python ranks from one interpreter that imported torch once, so a "
        "restarted rank starts at once (default: on, for python scripts and modules)",
    )
    parser.add_argument(
        "--as-torchft",
        action="store_true",
        help="run a script written for torchft unchanged: `import torchft` in the ranks is "
        "phalanx.torchft, and TORCHFT_LIGHTHOUSE is the lighthouse's address; refused if "
        "a real torchft is installed (default: off)",
    )
