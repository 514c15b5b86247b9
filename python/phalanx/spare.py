"""A warm spare: a Python interpreter that has imported torch and phalanx already and
waits for the rank it will become. `phalanx run` keeps one per rank of a group, so a
restarted group does not spend its first seconds importing torch (2 s of CPU here,
more on a loaded machine) before it can heal.

A spare imports at normal priority: on a machine whose cores the ranks keep busy, a
spare on idle CPU only would never warm up, and the import costs the same CPU as a
cold restart's, only off the recovery's critical path.

The launcher writes one JSON line to the spare's stdin, `{"argv": [...], "env": {...}}`
(argv as for a new interpreter: `python -m module ...` or `python script.py ...`), and
the spare runs it as `__main__` in this process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

#: What a phalanx rank imports before its first step; torch._dynamo is imported by
#: the first optimizer a program builds, torch.distributed.tensor by recovery.
WARM_IMPORTS = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.tensor",
    "phalanx.manager",
    "phalanx.recovery",
    "phalanx.ddp",
    "phalanx.optim",
    "phalanx.data",
)


def runnable(argv: list[str]) -> bool:
    """Whether a spare can become `argv`: this interpreter, then a module or a script.

    >>> runnable([sys.executable, "-m", "phalanx.demo.train", "--lr", "0.1"])
    True
    >>> runnable([sys.executable, "-c", "print(1)"]), runnable(["./train.sh"])
    (False, False)
    """
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3
    return argv[1].endswith(".py")


def become(argv: list[str], env: dict[str, str]) -> None:
    """Runs `argv` (see `runnable`) as this process's program, with `env`."""
    os.environ.clear()
    os.environ.update(env)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")


def main() -> None:
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line:  # the launcher let the spare go unused
        return
    order = json.loads(line)
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the new program's stdin, for its lifetime
    become(order["argv"], order["env"])


if __name__ == "__main__":
    main()
