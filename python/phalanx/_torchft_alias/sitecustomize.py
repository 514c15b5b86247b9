"""Makes `import torchft` this folder's alias in any process that has the folder on
its PYTHONPATH, wherever on it and however the process was started.

Python's `site` imports the first `sitecustomize` on `sys.path` at start-up, before
the program's first line, and the folder on PYTHONPATH comes before the environment's
own site-packages. So this file runs in `python train.py`, `python -u train.py`,
`python -X dev -m train`, a script started by `sh -c`, and in the fork server whose
forks become ranks. It puts one finder first on `sys.meta_path` that answers the
top-level name `torchft` with this folder's package, so that a real torchft earlier on
PYTHONPATH or in the script's own folder is never imported in its place: the alias
package then looks for one on the process's `sys.path` as it is at that import, and
refuses by name if it finds one (`torchft.real_torchft`).

It imports nothing of phalanx (a shell's `python` that never imports torchft pays one
finder), and then runs the `sitecustomize` it hides, if there is one further on
`sys.path`, as `site` would have.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _elsewhere(entry: str) -> bool:
    return os.path.realpath(entry or os.curdir) != os.path.realpath(_HERE)


class TorchftAlias(importlib.abc.MetaPathFinder):
    """`import torchft` is the alias package in this folder, before any other finder
    looks; every other name is left to them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchft":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_HERE])


def _run_hidden_sitecustomize() -> None:
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [entry for entry in sys.path if _elsewhere(entry)]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if not any(isinstance(finder, TorchftAlias) for finder in sys.meta_path):
    sys.meta_path.insert(0, TorchftAlias())
if __name__ == "sitecustomize":
    _run_hidden_sitecustomize()
