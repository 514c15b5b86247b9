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
) -> str | None:
    """Heals this rank to the quorum's `max_step` from its up-to-date peers, straight
    into the registered tensors; returns why it failed, or None. A failed fetch may
    have written part of the tensors: the state is then torn (`held.tear()`)."""
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
                mine,
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
    registry.load(state, quorum.max_step)
    seconds = time.monotonic() - started
    step.record.heal_s, step.record.healed, step.record.step = seconds, True, quorum.max_step
    log.info("healed to step %d from %d peer(s) in %.3f s", quorum.max_step, len(sources), seconds)
    held.healed(quorum.max_step, quorum.max_state_quorum_id, quorum.lineage)
    return None


def tear(held: HeldState) -> None:
    """Marks this rank's state torn (see `HeldState.tear`), saying so once."""
    if held.tear():
        log.warning("the state of step %d is torn; the group heals again", held.step)
