"""`phalanx.torchft`: torchft's public API, on phalanx.

A training script written for torchft runs on phalanx with one changed import::

    import phalanx.torchft as torchft      # was: import torchft

or with none at all: `phalanx run --as-torchft …` makes `import torchft` in the ranks
resolve to this package. Its names keep torchft's signatures and documented
semantics; underneath, every step is a phalanx transaction (commit lease, pushed
abort, striped checksummed heal, stall eviction). An argument phalanx cannot honour
raises when it is passed, naming it and what to do instead; one phalanx makes
unnecessary (a checkpoint transport) is accepted and logged once. A name phalanx does
not provide raises AttributeError naming the closest phalanx feature.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

#: The submodules torchft code imports by name (`from torchft.local_sgd import DiLoCo`).
SUBMODULES = ("manager", "process_group", "ddp", "optim", "data", "local_sgd", "checkpointing")

_NAMES = {
    "Manager": "manager",
    "DistributedDataParallel": "ddp",
    "DistributedSampler": "data",
    "Optimizer": "optim",
    "ProcessGroupGloo": "process_group",
    "ProcessGroupNCCL": "process_group",
    "ProcessGroupBabyGloo": "process_group",
    "ProcessGroupBabyNCCL": "process_group",
    "ProcessGroupXCCL": "process_group",
    "ProcessGroupBabyXCCL": "process_group",
}

#: torchft names phalanx does not provide, and what to use instead.
INSTEAD = {
    "coordination": (
        "phalanx's own lighthouse and manager bindings: phalanx.LighthouseServer, "
        "phalanx.LighthouseClient, phalanx.ManagerServer, phalanx.ManagerClient"
    ),
    "device_mesh": (
        "phalanx.fully_shard_hsdp (FSDP2 inside a group, fault tolerance across), or "
        "process_group.ManagedProcessGroup with FSDP2's set_all_reduce_hook"
    ),
    "parameter_server": "phalanx.DiLoCo or phalanx.LocalSGD (no parameter server is needed)",
    "collectives": "Manager.allreduce(tensor, should_quantize=True) (int8 with block scales)",
    "futures": "Manager.wrap_future(), which takes the manager's timeout",
    "otel": "the lighthouse's /metrics (Prometheus) and each rank's step records",
    "work": "the Work that Manager.allreduce() returns",
    "fsdp": (
        "phalanx.fully_shard_hsdp (FSDP2 inside a group, fault tolerance across, healed "
        "from live peers), or process_group.ManagedProcessGroup with FSDP2's "
        "set_all_reduce_hook"
    ),
    "quantization": "Manager.allreduce(tensor, should_quantize=True) (int8 with block scales)",
    "http": "phalanx's state servers (heals) and the lighthouse's status page and /metrics",
    "multiprocessing": (
        "process_group.ProcessGroupGloo or ProcessGroupNCCL: phalanx runs no process "
        "group in a subprocess of its own"
    ),
    "comms": "process_group.ProcessGroupGloo or ProcessGroupNCCL",
    "torchcomms": "process_group.ProcessGroupGloo or ProcessGroupNCCL",
    "torchx": "phalanx run (one command per host), or its Slurm and Kubernetes manifests",
    "utils": "nothing: its helpers serve torchft's own modules",
}


class _Instead(importlib.abc.MetaPathFinder):
    """`from phalanx.torchft import coordination` (and `import torchft.coordination`
    through the alias) says what to use instead: the import system would otherwise
    turn the missing name into a bare "cannot import name". Last on the meta path, so
    it speaks only for a module no finder has."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in INSTEAD:
            # Without the module's name: `from … import` passes over a
            # ModuleNotFoundError that names the module it imports.
            raise ModuleNotFoundError(_instead(name))
        return None


def _instead(name: str) -> str:
    return f"phalanx.torchft has no {name!r} (torchft.{name}); use {INSTEAD[name]}"


if not any(isinstance(finder, _Instead) for finder in sys.meta_path):
    sys.meta_path.append(_Instead())


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        # torchft's top-level Optimizer is its optim.OptimizerWrapper.
        attribute = "OptimizerWrapper" if name == "Optimizer" else name
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), attribute)
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in INSTEAD:
        raise AttributeError(_instead(name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
]
