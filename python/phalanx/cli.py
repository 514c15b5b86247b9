"""The `phalanx` command.

phalanx lighthouse [--bind HOST:PORT] [--min-replicas N] [--join-timeout 1s]
                   [--heartbeat-timeout 2s] [--token TOKEN]
"""

from __future__ import annotations

import argparse
import sys

from phalanx import _core


def _lighthouse(args: list[str]) -> int:
    # One parser for the binary and this subcommand: the Rust core's.
    return _core.run_lighthouse_cli(["phalanx lighthouse", *args])


COMMANDS = {
    "lighthouse": (_lighthouse, "run a job's lighthouse (quorum, liveness, status page)"),
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
    known, rest = parser.parse_known_args(argv)
    run, _ = COMMANDS[known.command]
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
