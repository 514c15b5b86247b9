"""A hung training thread is caught by the stall timeout, not waited out (DESIGN §4).

The hung rank's process lives and its heartbeat beats; only its training thread is
held (tests/procs/ft_train.py's `--hold-at` and `--hold-in-heal`). Its peers wait on
it, the lighthouse evicts its group as stalled and tells everyone: the survivors
abandon the step and go on, the hung rank logs its stacks and exits with
`EXIT_STALLED`, and once restarted it heals, and every committed step carries one
state across the groups. A thread held after its vote keeps nobody waiting (the next
quorum goes on without it) and is evicted all the same; one that holds the GIL
freezes every Python thread, and the core ends its process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from phalanx.manager import Timeouts
from phalanx.watchdog import EXIT_STALLED, FROZEN_GRACE_S
from test_one_state_per_step import (
    TRAIN_ON,
    WITH_ALL_THREE,
    lighthouse,
    start_rank,
    trains_with_all,
)
from test_transaction import assert_bit_identical

from conftest import Child, http_get

__all__ = ["lighthouse"]  # the fixture, used by name

#: ft_train.py runs with a 10 s budget: this stall timeout.
STALL_S = Timeouts.from_budget(10.0).stall
#: How much later than the stall timeout the survivors may commit again on a loaded
#: test machine: the eviction itself, a new quorum, and one step.
SLACK_S = 4.0


def evicted_with_evidence(c: Child, held_at: float, *, grace: float = 0.0) -> None:
    """c exits as stalled within the stall timeout (and slack, and `grace`), having
    logged that it was evicted and every thread's stack."""
    code = c.wait(timeout=STALL_S + grace + 30)
    assert code == EXIT_STALLED, c.describe()
    took = time.time() - held_at
    print(f"{c.name} exited {took:.2f} s after its hold")
    assert took < STALL_S + grace + SLACK_S + 2, f"{took:.2f} s\n{c.describe(60)}"
    log = "\n".join(c.stderr)
    assert "was evicted from quorum" in log, log[-3000:]
    assert "Most recent call first" in log or "most recent call first" in log, log[-3000:]
    assert "ft_train.py" in log, log[-3000:]


def survivors_go_on(survivors: list[Child], held_at: float) -> float:
    """The survivors commit a step without c within the stall timeout (and slack);
    returns their longest stall: the longest time between two of a survivor's commits
    around the hold."""
    longest = 0.0
    for s in survivors:
        after = s.expect(
            lambda line: (
                line.get("committed") and line["participants"] == 2 and line["t"] > held_at
            ),
            STALL_S + 30,
            f"{s.name} commits without c",
        )
        before = max(
            line["t"] for line in s.lines if line.get("committed") and line["t"] <= held_at
        )
        longest = max(longest, after["t"] - before)
    print(f"stall timeout {STALL_S:.2f} s: survivors' longest stall {longest:.3f} s")
    assert longest < STALL_S + SLACK_S, longest
    return longest


def lost_as_stalled(address: str, replica_id: str) -> None:
    """The status page counts the group's loss as a stall."""
    status, body = http_get(f"http://{address}/status")
    assert status == 200, body
    snapshot = json.loads(body)
    groups = {g["replica_id"]: g for g in snapshot["lost"] + snapshot["replicas"]}
    assert groups[replica_id]["losses"]["progress_stalled"] == 1, body


def restart_and_heal(
    spawn: Callable[..., Child], address: str, everyone: list[Child], survivors: list[Child]
) -> Child:
    c = start_rank(spawn, address, "c", *TRAIN_ON)
    c.expect(lambda line: line.get("committed"), 60, "the restarted c heals and commits")
    at = max(line["after"] for line in c.lines if line.get("committed"))
    trains_with_all(c, after=at + 5)
    assert assert_bit_identical([*everyone, c]) >= 10
    return c


#: How c's training thread hangs: where, and which part of the rank ends it.
HANGS = {
    # Its peers' all-reduce waits for its part; its membership thread ends it.
    "mid_step": ((), 0.0, "training made no progress"),
    # Nobody waits on it: the next quorum goes on without it after the join timeout.
    # It is hung all the same, so it is evicted and restarted.
    "after_its_vote": (("--hold-after-vote",), 0.0, "training made no progress"),
    # No Python thread of c runs, not its progress reporter nor its membership
    # thread: the core ends it once it still lives FROZEN_GRACE_S after its eviction.
    "holding_the_gil": (("--hold-gil",), FROZEN_GRACE_S, "a thread holds the GIL"),
    # The same, inside a wait on the others whose report went out: the wait's deadline
    # is no excuse once the reports stop (nor is the end of any wait just before).
    "holding_the_gil_in_a_wait": (
        ("--hold-gil", "--in-wait"),
        FROZEN_GRACE_S,
        "a thread holds the GIL",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("hang", HANGS)
def test_a_hung_training_thread_is_evicted_restarted_and_heals(spawn, lighthouse, hang):
    options, grace, told = HANGS[hang]
    a = start_rank(spawn, lighthouse.address, "a", *TRAIN_ON)
    b = start_rank(spawn, lighthouse.address, "b", *TRAIN_ON)
    c = start_rank(
        spawn, lighthouse.address, "c", "--hold-at", "6", *options, *WITH_ALL_THREE, *TRAIN_ON
    )
    c.expect(lambda line: line.get("event") == "holding", 60, "c's training thread holds")
    held_at = time.time()
    survivors_go_on([a, b], held_at)
    evicted_with_evidence(c, held_at, grace=grace)
    assert told in "\n".join(c.stderr)
    lost_as_stalled(lighthouse.address, "c")
    restart_and_heal(spawn, lighthouse.address, [a, b, c], [a, b])


@pytest.mark.slow
def test_a_training_thread_hung_in_its_heal_is_evicted_restarted_and_heals(spawn, lighthouse):
    a = start_rank(spawn, lighthouse.address, "a", *TRAIN_ON)
    b = start_rank(spawn, lighthouse.address, "b", *TRAIN_ON)
    for s in (a, b):
        s.expect(
            lambda line: line.get("committed") and line["participants"] == 2 and line["after"] > 5,
            60,
            f"{s.name} trains",
        )
    c = start_rank(spawn, lighthouse.address, "c", "--hold-in-heal", *TRAIN_ON)
    c.expect(lambda line: line.get("event") == "holding", 60, "c's training thread holds")
    held_at = time.time()
    survivors_go_on([a, b], held_at)
    evicted_with_evidence(c, held_at)
    restart_and_heal(spawn, lighthouse.address, [a, b, c], [a, b])
