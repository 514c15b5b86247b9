"""A step number means one state (I1), whatever pauses, late collectives and failed
heals do: every step committed anywhere carries one fingerprint across the groups.

Each scenario is made deterministic by the rank itself: it stops its own process
(SIGSTOP, so its heartbeat stops too) at a chosen step and phase, the test waits until
its peers have gone on without it, and only then wakes it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

import phalanx
from test_transaction import PHALANX_WORDS, assert_bit_identical
from test_transaction import start_rank as start_transaction_rank

from conftest import Child, free_port

HEARTBEAT_TIMEOUT = 1.0
PAUSE_AT = 6
#: c stops only once the three groups train as one (under load a group may start late,
#: and c alone would be the only holder of the job's state).
WITH_ALL_THREE = ("--pause-participants", "3")
#: a and b train until the test ends: had they finished before c came back, c would
#: rightly go on alone from its own, older state (a second lineage of the same steps).
TRAIN_ON = ("--steps", "100000")
STEPS = 40
#: A budget whose stall timeout (10 s) no hold of these tests reaches.
SLOW_NOT_HUNG = ("--timeout", "30")


@pytest.fixture
def lighthouse():
    with phalanx.LighthouseServer(
        bind="127.0.0.1:0", join_timeout=0.3, heartbeat_timeout=HEARTBEAT_TIMEOUT
    ) as server:
        yield server


def start_rank(spawn: Callable[..., Child], lighthouse: str, replica_id: str, *options, **kw):
    return start_transaction_rank(spawn, lighthouse, replica_id, *options, steps=STEPS, **kw)


def start_three(
    spawn: Callable[..., Child],
    lighthouse: str,
    *c_options: str,
    c_lighthouse: str = "",
    peers: tuple[str, ...] = (),
) -> tuple[Child, Child, Child]:
    """Groups a and b, which train until the test ends (with `peers` options), and c
    with `c_options`, which reaches the lighthouse at `c_lighthouse` (a relay) where
    given."""
    a = start_rank(spawn, lighthouse, "a", *TRAIN_ON, *peers)
    b = start_rank(spawn, lighthouse, "b", *TRAIN_ON, *peers)
    c = start_rank(spawn, c_lighthouse or lighthouse, "c", *c_options)
    return a, b, c


def finish(children: list[Child]) -> None:
    for child in children:
        child.expect(lambda line: line.get("event") == "done", 120, "training finishes")


def trains_with_all(child: Child, after: int) -> None:
    """Waits until `child` commits past step `after` in a step of all three groups."""
    child.expect(
        lambda line: line.get("committed") and line["participants"] == 3 and line["after"] > after,
        60,
        f"{child.name} trains with all three groups past step {after}",
    )


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["in_allreduce", "before_vote", "after_vote"])
def test_a_group_paused_past_the_heartbeat_timeout_never_splits_a_step(spawn, lighthouse, phase):
    pause = ("--pause-at", str(PAUSE_AT), "--pause-phase", phase, *WITH_ALL_THREE)
    # However late the three first train as one, c is there to pause.
    a, b, c = start_three(spawn, lighthouse.address, *pause, *TRAIN_ON)
    at = c.expect(lambda line: line.get("event") == "pausing", 60, "c stops itself")["step"]
    c.stopped = True
    paused_at = time.time()
    # The lighthouse declares c dead and a, b go on without it, past c's step.
    for survivor in (a, b):
        survivor.expect(
            lambda line: (
                line.get("committed")
                and line["after"] > at + 2
                and line["t"] > paused_at + HEARTBEAT_TIMEOUT
            ),
            60,
            f"{survivor.name} commits without c",
        )
    c.signal(signal.SIGCONT)

    # c wakes with its step of the old quorum: it must not commit it unless its peers
    # committed the same (its collectives completed before it paused, after_vote).
    woken = c.expect(lambda line: line.get("event") == "step", 60, "c ends its step")
    assert woken["step"] == at
    if phase != "after_vote":
        assert not woken["committed"], woken
    # Then it heals from its peers and trains with them.
    c.expect(lambda line: line.get("committed") and line["after"] > at + 3, 60, "c heals")
    trains_with_all(c, after=at + 10)
    assert assert_bit_identical([a, b, c]) >= 10


@pytest.mark.slow
def test_peers_that_failed_a_step_wait_for_the_late_member_that_committed_it(spawn, lighthouse):
    """a and b fail a step (their votes say no) that c commits; c then computes for 2 s
    before it asks again, far past the straggler bound of a and b's quick re-ask. A
    quorum of a and b alone would commit that step a second time, with other data: they
    must wait for c and heal from it."""
    a, b, c = start_three(
        spawn,
        lighthouse.address,
        *("--hold-at", str(PAUSE_AT), "--hold-after-vote", "--busy-for", "2"),
        *WITH_ALL_THREE,
        *TRAIN_ON,
        peers=("--fail-at", str(PAUSE_AT), *WITH_ALL_THREE),
    )
    held = c.expect(lambda line: line.get("event") == "holding", 60, "c commits, then computes")
    for peer in (a, b):
        failed = peer.expect(
            lambda line: line.get("event") == "step" and "--fail-at" in (line["failure"] or ""),
            60,
            f"{peer.name} fails its step",
        )
        assert failed["step"] == held["step"], (failed, held)
        # It heals to c's state, after the step it failed, and commits the step after.
        healed = peer.expect(lambda line: line.get("committed"), 60, f"{peer.name} goes on")
        assert healed["after"] == failed["step"] + 2, f"{peer.name} went on without c: {healed}"
    trains_with_all(c, after=held["step"] + 3)
    assert assert_bit_identical([a, b, c]) >= 3


@pytest.mark.slow
def test_a_heal_that_fails_on_one_rank_makes_the_whole_group_heal_again(spawn, lighthouse):
    ports = {name: free_port() for name in "ab"}
    # a trains until the test ends (however slowly b starts); b for a while after it joins.
    a = [
        start_rank(
            spawn,
            lighthouse.address,
            "a",
            "--steps",
            "100000",
            rank=r,
            world_size=2,
            port=ports["a"],
        )
        for r in (0, 1)
    ]
    # a trains first, so that b must heal from it (b first alone would be healed from).
    a[0].expect(lambda line: line.get("committed"), 60, "a trains")
    # b's rank 1 fails its first heal (deadline 0.1 ms); rank 0's succeeds.
    b = [
        start_rank(
            spawn,
            lighthouse.address,
            "b",
            *(["--first-heal-timeout", "0.0001"] if r == 1 else []),
            rank=r,
            world_size=2,
            port=ports["b"],
        )
        for r in (0, 1)
    ]
    failed = b[1].expect(
        lambda line: line.get("event") == "step" and "heal" in (line["failure"] or ""),
        60,
        "b's rank 1 fails its heal",
    )
    assert failed["torn"], failed
    # The vote carried the outcome: rank 0 too holds a torn state at its old step,
    # so both ask for the same step, heal together and go on.
    attempt = b[0].expect(
        lambda line: line.get("event") == "step" and line["step"] == failed["step"],
        30,
        "rank 0's end of the same step",
    )
    assert attempt["torn"] and not attempt["committed"], attempt
    for rank in b:
        rank.expect(lambda line: line.get("committed"), 60, f"{rank.name} commits")
    finish(b)
    assert assert_bit_identical(a + b) >= 10
    for rank in b:
        assert not any("disagree" in line.get("text", "") for line in rank.lines)


@pytest.mark.slow
def test_a_group_whose_heartbeat_stream_breaks_mid_step_never_splits_it(spawn, lighthouse, proxy):
    # c reaches the lighthouse through a relay. Its training thread is held before its
    # part of the all-reduce, which a and b wait for, while the relay cuts its
    # connection: the lighthouse declares c dead (stream broken), a and b abandon the
    # step and commit it again without c. When c's thread goes on, its all-reduce may
    # still complete (gloo cannot cancel a peer's abandoned one): c must vote no all
    # the same. c's hold stands for a slow step, not a hang: its stall timeout (a third
    # of its 30 s budget) outlasts the hold however loaded the machine, since a group
    # held outside the quorum for its stall timeout is rightly evicted as hung.
    relay = proxy(lighthouse.address)
    hold = ("--hold-at", str(PAUSE_AT), *WITH_ALL_THREE, *TRAIN_ON, *SLOW_NOT_HUNG)
    a, b, c = start_three(spawn, lighthouse.address, *hold, c_lighthouse=relay.address)
    at = c.expect(lambda line: line.get("event") == "holding", 60, "c holds its step")["step"]
    assert relay.cut() >= 1
    cut_at = time.time()
    for survivor in (a, b):
        survivor.expect(
            lambda line: line.get("committed") and line["after"] > at + 2 and line["t"] > cut_at,
            60,
            f"{survivor.name} commits without c",
        )
    c.signal(signal.SIGUSR1)

    woken = c.expect(lambda line: line.get("event") == "step", 60, "c ends its step")
    assert woken["step"] == at and not woken["committed"], woken
    c.expect(lambda line: line.get("committed") and line["after"] > at + 3, 60, "c heals")
    trains_with_all(c, after=at + 10)
    assert assert_bit_identical([a, b, c]) >= 10


@pytest.mark.slow
def test_a_peer_killed_mid_all_reduce_is_named_in_the_survivors_failure(spawn, lighthouse):
    # c holds its training thread before its part of the all-reduce, so a and b wait in
    # it for c; then c is SIGKILLed. Their connections to c break a moment before the
    # lighthouse names the dead group: the failure must say "c died", not gloo's text.
    hold = ("--hold-at", str(PAUSE_AT), *WITH_ALL_THREE)
    a, b, c = start_three(spawn, lighthouse.address, *hold)
    at = c.expect(lambda line: line.get("event") == "holding", 60, "c holds its step")["step"]
    c.signal(signal.SIGKILL)
    for survivor in (a, b):
        failed = survivor.expect(
            lambda line: line.get("event") == "step" and not line["committed"],
            30,
            f"{survivor.name}'s step fails",
        )
        assert failed["step"] == at, failed
        assert failed["failure"].startswith(PHALANX_WORDS), failed
        assert "c died" in failed["failure"], failed
