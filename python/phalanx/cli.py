"""The `phalanx` command.

phalanx demo [--duration 2m] [--replicas 3] [--kill-every 15s] [--out DIR]
phalanx lighthouse [--bind HOST:PORT] [--min-replicas N] [--join-timeout 1s]
                   [--heartbeat-timeout 2s] [--token-file FILE] [--insecure]
                   (or torchft_lighthouse's flags: --min_replicas N --join_timeout_ms MS …)
phalanx run --replicas N --nproc-per-replica W [--lighthouse HOST:PORT] [--job NAME]
            [--token-file FILE] [--max-restarts K] [--chaos kill-every=15s]
            [--snapshot-dir DIR|URL --snapshot-every 500 [--snapshot-keep 2]]
            [--as-torchft] -- train.py ARGS...
phalanx snapshots DIR|URL [--no-verify]
phalanx token FILE [--force]
phalanx token FILE --job NAME [--lighthouse-token-file FILE]
phalanx torchft-path      # export PYTHONPATH="$(phalanx torchft-path)${PYTHONPATH:+:$PYTHONPATH}"
"""

from __future__ import annotations

import argparse
import sys

from phalanx import _core


def _lighthouse(args: list[str]) -> int:
    # One parser for the binary and this subcommand: the Rust core's.
    return _core.run_lighthouse_cli(["phalanx lighthouse", *args])


def lighthouse_main() -> int:
    """`phalanx-lighthouse`: the lighthouse alone, as the wheel installs it (the same
    program as `cargo install`'s binary of that name)."""
    return _core.run_lighthouse_cli(["phalanx-lighthouse", *sys.argv[1:]])


def _run(args: list[str]) -> int:
    from phalanx import launcher

    return launcher.main(args)


def _demo(args: list[str]) -> int:
    from phalanx.demo import job

    return job.main(args)


def _snapshots(args: list[str]) -> int:
    from phalanx.snapshots import listing

    return listing.main(args)


def _token(args: list[str]) -> int:
    from phalanx import token

    return token.main(args)


def _torchft_path(args: list[str]) -> int:
    # Reads nothing but the path: no torch, no phalanx.torchft, for a job script's shell.
    from phalanx._torchft_alias.torchft import ALIAS_DIR

    parser = argparse.ArgumentParser(
        prog="phalanx torchft-path",
        description="Print the folder that makes `import torchft` phalanx.torchft when it "
        "is first on PYTHONPATH (what `phalanx run --as-torchft` does), for torchrun, Slurm "
        'or Kubernetes: export PYTHONPATH="$(phalanx torchft-path)${PYTHONPATH:+:$PYTHONPATH}"',
    )
    parser.parse_args(args)
    print(ALIAS_DIR)
    return 0


COMMANDS = {
    "demo": (_demo, "train a small model through a failure every 15 s; report the result"),
    "lighthouse": (_lighthouse, "run a job's lighthouse (quorum, liveness, status page)"),
    "run": (_run, "start replica groups of a training script, restart failed ones"),
    "snapshots": (_snapshots, "list and verify a job's snapshots, newest first"),
    "token": (_token, "write a new job token to a file only you can read"),
    "torchft-path": (_torchft_path, "print the folder that makes `import torchft` phalanx's"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Fault-tolerant distributed training for PyTorch.",
        epilog="Run 'phalanx COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"phalanx {_core.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    if argv and argv[0] in COMMANDS:
        # The command parses its own arguments, "--" and all.
        run, _ = COMMANDS[argv[0]]
        return run(argv[1:])
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
