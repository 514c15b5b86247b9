"""The examples in the docstrings run and say what they show."""

from __future__ import annotations

import doctest

import pytest

import phalanx
import phalanx.cli
import phalanx.manager


@pytest.mark.parametrize(
    "module", [phalanx, phalanx.cli, phalanx.manager], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0
