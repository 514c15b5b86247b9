"""The examples in the docstrings run and say what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

# Every module whose docstrings carry examples; each must run at least one.
MODULES = [
    "phalanx",
    "phalanx.manager",
    "phalanx.settings",
    "phalanx.step",
    "phalanx.membership",
    "phalanx.identity",
    "phalanx.healing",
    "phalanx.reachability",
    "phalanx.launcher.config",
    "phalanx.launcher.chaos",
    "phalanx.launcher.ranks",
    "phalanx.launcher.observer",
    "phalanx.launcher.restarts",
    "phalanx.peers",
    "phalanx.token",
    "phalanx.recovery",
    "phalanx.manifest",
    "phalanx.staging",
    "phalanx.buckets",
    "phalanx.process_group",
    "phalanx.store",
    "phalanx.data",
    "phalanx.forkserver.server",
    "phalanx.forkserver.wire",
    "phalanx.demo.model",
    "phalanx.demo.report.measures",
    "phalanx.demo.report.summary",
    "phalanx.demo.report.figure",
    "phalanx.demo.job",
    "phalanx.demo.lighthouses",
    "phalanx.demo.regime",
    "phalanx.torchft.manager",
    "phalanx.torchft.process_group",
    "phalanx.torchft.data",
    "phalanx.torchft.checkpointing",
    "phalanx.snapshots.catalog",
    "phalanx.snapshots.schedule",
    "phalanx.snapshots.storage",
    "phalanx.snapshots.rank",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0, f"{name} lost its examples"
    assert result.failed == 0
