"""`phalanx run`: starts a job's replica groups, restarts a group that fails, and can
inject failures on purpose.

    phalanx run --replicas 3 --nproc-per-replica 2 -- train.py --lr 0.1

Each group gets W rank processes with the usual environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/MASTER_PORT, left to the program's own torch, as torchrun
leaves them), PHALANX_* for the job (PHALANX_STORE_PORT: where the group's rank 0
serves phalanx's manager and store), and torchft's REPLICA_GROUP_ID (the group's
index, 0 to N-1) and NUM_REPLICA_GROUPS (N, this launcher's groups). With
--as-torchft, `import torchft` in the ranks is `phalanx.torchft` (`torchft_alias_dir`)
and TORCHFT_LIGHTHOUSE is the lighthouse's address.
Without --lighthouse, the launcher serves one itself; with it, the groups join
that job, which is how a multi-host job is started (one `phalanx run --replicas 1
--replica-id … --token-file FILE` per host, FILE written once by `phalanx token`). A
job always has a token: without --token or --token-file (or PHALANX_TOKEN /
PHALANX_TOKEN_FILE) the launcher makes a random one, for its lighthouse and ranks.
A group is all or nothing: when one of its ranks dies, the rest are stopped and the
group restarts, with backoff, up to --max-restarts failures in a row: a group that
committed a step since its last start has its count, and its backoff, start again
(`RestartCount`, `CommitWatch`).
Python ranks are forked by a fork server that imported torch once (phalanx.forkserver),
so a restarted rank starts at once: `python -m module` or `python train.py`, where
PATH finds that `python` to be the launcher's own interpreter. The log's "ranks:" line
says which way ranks start, and why.

The package: `config` (the command line and `LaunchConfig`), `ranks` (how a rank
starts), `chaos` (failures on purpose), `group` and `observer` (what the loop keeps and
tells), `supervisor` (the loop, `Launcher`).
"""

from __future__ import annotations

import os

from phalanx.launcher.chaos import Chaos
from phalanx.launcher.config import LaunchConfig, build_parser, job_token, parse_duration
from phalanx.launcher.group import Group
from phalanx.launcher.observer import LaunchObserver, status_page_line
from phalanx.launcher.ranks import resolve, torchft_alias_dir
from phalanx.launcher.supervisor import Launcher
from phalanx.token import new_token, resolve_token

__all__ = [
    "Chaos",
    "Group",
    "LaunchConfig",
    "LaunchObserver",
    "Launcher",
    "job_token",
    "main",
    "parse_duration",
    "status_page_line",
]


def main(argv: list[str]) -> int:
    """`phalanx run ARGV`; the exit code: 0 when every group finished, 130 when a
    signal stopped the job, 1 otherwise."""
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        config = LaunchConfig.from_args(args, command)
        token = resolve_token(args.token, args.token_file, os.environ)
        if config.as_torchft:
            # Said once, here, rather than by every rank as it fails to import torchft.
            torchft_alias_dir(resolve(list(config.command)), os.environ)
    except ValueError as e:
        parser.error(str(e))
    if token is None and config.lighthouse:
        # A job joined through an outside lighthouse has one token, shared by all its
        # launchers: a token made up here would split the job.
        if not args.insecure:
            parser.error(
                f"joining the lighthouse at {config.lighthouse} takes the job's token, the "
                "same for every launcher of the job: --token-file FILE or PHALANX_TOKEN_FILE "
                "(write one with `phalanx token FILE`); --insecure runs this launcher's "
                "groups without one, open to anyone who can reach them"
            )
        print(
            "[phalanx run] --insecure: no job token; anyone who can reach these groups can "
            "read and replace the model",
            flush=True,
        )
    elif token is None:
        token = new_token()
    return Launcher(config, token).run()
