"""A rank's registered state, and a heal into it: what `Manager.register_state()`
keeps, what a healing peer receives, and how a healing rank loads its peers' state.

>>> registry = StateRegistry()
>>> box = {"lr": 0.1}
>>> registry.register("opt", lambda: dict(box), box.update)
>>> registry.state()
{'opt': {'lr': 0.1}}
>>> registry.load({"opt": {"lr": 0.5}}, step=3); box
{'lr': 0.5}
>>> registry.register("opt", dict, print)
Traceback (most recent call last):
...
ValueError: state 'opt' is registered already; pick another name
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phalanx import _core
from phalanx.identity import HeldState
from phalanx.progress import Progress
from phalanx.recovery import IncompatibleStateError, heal
from phalanx.step import Step

log = logging.getLogger("phalanx.manager")


@dataclass
class _Registered:
    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None]


class StateRegistry:
    """The state a rank serves to healing peers and loads when it heals, by name."""

    def __init__(self) -> None:
        self._registered: dict[str, _Registered] = {}

    def register(
        self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        if name in self._registered:
            raise ValueError(f"state {name!r} is registered already; pick another name")
        self._registered[name] = _Registered(state_dict, load_state_dict)

    def state(self) -> dict[str, Any]:
        return {name: r.state_dict() for name, r in self._registered.items()}

    def load(self, state: dict[str, Any], step: int) -> None:
        """Loads the peers' `state` of `step`; IncompatibleStateError when a part does
        not load (the groups were built differently: no retry can help)."""
        for name, registered in self._registered.items():
            if name in state:
                try:
                    registered.load_state_dict(state[name])
                except Exception as e:
                    raise IncompatibleStateError(
                        f"the peers' {name!r} at step {step} does not load into this "
                        f"group's: {e}. Every replica group must build the same model, "
                        "optimizer and registered state"
                    ) from e


def heal_step(
    step: Step,
    quorum: _core.QuorumResult,
    registry: StateRegistry,
    held: HeldState,
    progress: Progress,
    *,
    token: str | None,
    timeout: float,
    stage: bool = False,
) -> str | None:
    """Heals this rank to the quorum's `max_step` from its up-to-date peers; returns
    why it failed, or None.

    Without `stage` the bytes go straight into the registered tensors and the state is
    loaded at once. With `stage` (an autograd graph may hold the registered tensors:
    I13) they go into buffers of their own, kept on the step (`step.staged`) until
    `load_staged()` loads them where no graph does. Either way a failed fetch tears
    the state (`held.tear()`): in place it may have written part of the tensors, and
    the vote then takes every rank of the group back to the step it held before, so
    that a rank whose fetch succeeded does not go on alone."""
    sources = [s.state_address for s in quorum.recovery_sources]
    if not sources:
        step.heal_failed = True
        return f"must heal to step {quorum.max_step} but no up-to-date peer serves it"
    started = time.monotonic()
    held.begin_heal()

    def record(stats: _core.FetchStats) -> None:
        step.record.heal_bytes = stats.bytes

    try:
        # The sources publish their state when they reach this step's collectives;
        # the fetch waits for that, within the heal deadline.
        mine = registry.state()
        # The fetch is a wait on the peers, within its deadline; loading what it
        # fetched is this rank's own work, which a hang can stop.
        with progress.waiting(
            f"healing to step {quorum.max_step} from {len(sources)} peer(s)", timeout
        ):
            state = heal(
                sources,
                quorum.max_step,
                quorum.quorum_id,
                blank_like(mine) if stage else mine,
                token=token,
                timeout=timeout,
                report=record,
            )
    except IncompatibleStateError:
        raise  # this group was built unlike its peers: no retry can help
    except (ConnectionError, PermissionError, ValueError, TimeoutError) as e:
        step.heal_failed = True
        tear(held)
        return f"heal to step {quorum.max_step} failed: {e}"
    step.record.heal_s = time.monotonic() - started
    received = Received(state, quorum.max_step, (quorum.max_state_quorum_id, quorum.lineage))
    if stage:
        step.staged = received
        log.info(
            "fetched step %d from %d peer(s) in %.3f s; it loads once the step's backward is done",
            quorum.max_step,
            len(sources),
            step.record.heal_s,
        )
        return None
    received.load(step, registry, held)
    seconds = step.record.heal_s
    log.info("healed to step %d from %d peer(s) in %.3f s", quorum.max_step, len(sources), seconds)
    return None


@dataclass
class Received:
    """A state fetched from the peers, or read from a snapshot, that the rank loads."""

    state: dict[str, Any]
    step: int
    #: (state quorum id, lineage) the rank holds once it is loaded; None for a
    #: snapshot it resumes from, whose identity it took when it picked it.
    identity: tuple[int, int] | None

    def load(self, step: Step, registry: StateRegistry, held: HeldState) -> None:
        """Loads the state through every registered `load_state_dict` and takes its
        identity; IncompatibleStateError as `StateRegistry.load`."""
        started = time.monotonic()
        held.begin_heal()
        registry.load(self.state, self.step)
        took = time.monotonic() - started
        if self.identity is None:
            held.before_heal = None
            step.record.resume_s += took
            return
        step.record.heal_s += took
        step.record.healed, step.record.step = True, self.step
        held.healed(self.step, *self.identity)


def load_staged(step: Step, registry: StateRegistry, held: HeldState) -> None:
    """Loads the state a heal staged this step, if any: called where no autograd graph
    holds the registered tensors (after the step's last backward, before its vote)."""
    received, step.staged = step.staged, None
    if received is None:
        return
    received.load(step, registry, held)
    log.info("loaded step %d after the backward", received.step)


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (a gradient hook).

    >>> in_backward()
    False
    """
    return torch._C._current_graph_task_id() != -1


def blank_like(state: Any) -> Any:
    """`state` with every tensor replaced by an uninitialised one of its dtype, shape,
    device and layout (a DTensor stays a DTensor), for a fetch that must not write
    into the live tensors. A tensor met twice (tied weights) maps to one buffer.

    >>> import torch
    >>> w = torch.ones(2)
    >>> blank = blank_like({"a": w, "b": [w, 3], "c": "x"})
    >>> blank["a"] is blank["b"][0], blank["a"] is w, blank["b"][1], blank["c"]
    (True, False, 3, 'x')
    """
    made: dict[int, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in made:
                made[id(value)] = torch.empty_like(value)
            return made[id(value)]
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v) for v in value)
        return value

    return walk(state)


def tear(held: HeldState) -> None:
    """Marks this rank's state torn (see `HeldState.tear`), saying so once."""
    if held.tear():
        log.warning("the state of step %d is torn; the group heals again", held.step)
