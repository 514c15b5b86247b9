"""`import torchft` as `phalanx.torchft`, for a training script written for torchft.

The folder above this one (`phalanx torchft-path` prints it) is on no `sys.path` of
its own: `phalanx run --as-torchft` puts it first on the ranks' PYTHONPATH, and so does

    export PYTHONPATH="$(phalanx torchft-path)${PYTHONPATH:+:$PYTHONPATH}"

for torchrun, Slurm or Kubernetes. Then `import torchft` finds this package, which puts
`phalanx.torchft` and each of its submodules in its place in `sys.modules`: the very
same module objects, so `torchft.Manager is phalanx.torchft.Manager` and isinstance
checks agree. A torchft installed as well is refused by name, never shadowed in
silence: which one a job runs must not depend on the order of PYTHONPATH. The folder's
`sitecustomize` sees to that: it makes `import torchft` this package however the
process started and wherever the folder is on PYTHONPATH.

Imported under its own name (`phalanx._torchft_alias.torchft`, as the launcher does to
ask `real_torchft` before it starts a group) it installs nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

#: The folder to put on PYTHONPATH: it holds this package and its `sitecustomize`.
ALIAS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_alias(path: str) -> bool:
    real = os.path.realpath(path)
    return real == os.path.realpath(ALIAS_DIR) or real.startswith(
        os.path.realpath(ALIAS_DIR) + os.sep
    )


def real_torchft(path: list[str] | None = None) -> str | None:
    """Where a torchft other than this alias would be imported from with `path` as
    `sys.path` (default: this process's), or None.

    >>> real_torchft([ALIAS_DIR]) is None
    True
    """
    entries = [entry for entry in (sys.path if path is None else path) if not _in_alias(entry)]
    for finder in sys.meta_path:
        if isinstance(finder, _Alias) or not hasattr(finder, "find_spec"):
            continue
        # The path finder searches the entries; a meta path finder of its own (an
        # editable install's) searches what it knows.
        on_path = finder is importlib.machinery.PathFinder
        spec = finder.find_spec("torchft", entries if on_path else None)
        # A folder named torchft without an __init__.py is no torchft (origin None):
        # a regular package, this one, always wins over it.
        if spec is not None and spec.origin and not _in_alias(spec.origin):
            return os.path.dirname(spec.origin)
    return None


def refusal(found: str) -> str:
    """What to say when `real_torchft` found one: both places, and the ways out."""
    return (
        f"a real torchft can be imported from {found}, and phalanx's torchft alias ({ALIAS_DIR}) "
        "is on PYTHONPATH (phalanx run --as-torchft, or phalanx torchft-path): `import "
        "torchft` cannot be both. Uninstall torchft from this environment (pip uninstall "
        "torchft torchft-nightly) to run the script on phalanx, or drop --as-torchft (and "
        "the alias from PYTHONPATH) to run it on torchft"
    )


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `torchft.X` as the module `phalanx.torchft.X` itself, at any depth, so
    that no file of phalanx.torchft is ever run a second time under torchft's name."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("torchft."):
            return None
        # A torchft module phalanx lacks: phalanx.torchft's own finder says what to
        # use instead; any other is a ModuleNotFoundError naming torchft.X.
        if importlib.util.find_spec(f"phalanx.{fullname}") is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"phalanx.{spec.name}")
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system gave the module this alias's spec; it keeps its own.
        module.__spec__ = module.__spec__.loader_state


def _install() -> None:
    found = real_torchft()
    if found is not None:
        raise ImportError(refusal(found), name="torchft")
    package = importlib.import_module("phalanx.torchft")
    sys.meta_path.insert(0, _Alias())
    # Replaces this module: the import statement that runs this file returns it.
    sys.modules["torchft"] = package
    for name in package.SUBMODULES:
        try:
            module = importlib.import_module(f"phalanx.torchft.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"phalanx.torchft.{name}":
                raise
            continue  # not written yet: `import torchft.<name>` says it is missing
        sys.modules[f"torchft.{name}"] = module


if __name__ == "torchft":
    _install()
