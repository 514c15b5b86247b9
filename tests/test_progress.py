"""A rank's progress report (phalanx.progress), the stall timeout's place in the one
timeout budget, and the evidence an evicted rank leaves (phalanx.watchdog)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

import phalanx
from phalanx import healing
from phalanx.manager import Timeouts
from phalanx.progress import Progress
from phalanx.watchdog import EXIT_STALLED

from conftest import in_groups, leave_together, manager_for


def test_the_stall_timeout_is_part_of_the_budget_and_shorter_than_the_collective():
    assert Timeouts.from_budget(30.0).stall == 10.0
    # A short collective timeout pulls the default down with it.
    assert Timeouts.from_budget(30.0, collective=3.0).stall == 2.0
    with pytest.raises(ValueError, match="Lower the stall timeout or raise the collective"):
        Timeouts.from_budget(30.0, stall=15.0)


class Reports(list):
    def __call__(self, rank, marks, wait_left, stall_timeout, step_time):
        self.append((rank, marks, wait_left, stall_timeout, step_time))


def test_a_blocked_training_thread_stops_moving_and_a_marked_one_moves():
    reports = Reports()
    blocked, release = threading.Event(), threading.Event()

    def training() -> None:
        progress.bind()
        blocked.set()
        release.wait(30)

    progress = Progress(reports, group_rank=1, stall_timeout=4.0)
    thread = threading.Thread(target=training)
    thread.start()
    try:
        assert blocked.wait(30)
        progress.report_now()
        progress.report_now()
        assert reports[-1][1] == reports[-2][1], "a thread blocked in one call does not move"
        assert reports[-1][2] is None, "and it is not in a wait on the other groups"
        progress.mark("launched an all-reduce")
        progress.report_now()
        assert reports[-1][1] == reports[-2][1] + 1
        assert reports[-1][0] == 1 and reports[-1][3] == 4.0
    finally:
        release.set()
        thread.join(30)


def test_a_wait_on_the_other_groups_is_reported_with_its_time_left_and_leaves_the_step_time():
    reports = Reports()
    progress = Progress(reports, group_rank=0, stall_timeout=4.0)
    progress.step_began(0)
    with progress.waiting("the quorum of step 0", timeout=5.0):
        progress.report_now()
        assert 0.0 < reports[-1][2] <= 5.0
        assert progress.describe().startswith("waiting: the quorum of step 0 (for ")
        with progress.frozen("blocked by chaos"):
            progress.report_now()
            assert reports[-1][2] is None, "a frozen thread is excused by no wait"
    progress.report_now()
    assert reports[-1][2] is None
    progress.step_began(1)
    assert 0.0 <= progress.step_time < 1.0


def test_an_evicted_rank_logs_what_it_did_and_every_stack_then_exits_75():
    script = textwrap.dedent(
        """
        import logging, threading
        from phalanx.progress import Progress
        from phalanx.watchdog import evicted
        logging.basicConfig()
        progress = Progress(lambda *a: None, group_rank=2, stall_timeout=3.0)
        progress.mark("launched an all-reduce of step 17 (quorum 5)")
        threading.Thread(target=threading.Event().wait, name="bystander", daemon=True).start()
        evicted(progress, "g1", 5)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == EXIT_STALLED, proc.stderr
    assert "replica group 'g1' was evicted from quorum 5" in proc.stderr
    assert "group rank 2 was last at: launched an all-reduce of step 17 (quorum 5)" in proc.stderr
    # Every thread's stack: the bystander's too.
    assert proc.stderr.count("most recent call first") >= 2, proc.stderr


def test_every_wait_of_a_step_on_the_other_groups_is_marked(lighthouse2, monkeypatch):
    """Inside each wait of a step on another group (the quorum, the process group's
    rendezvous, an all-reduce, the vote, a heal's fetch, the healers' fetches from
    this group) the rank counts as moving: the lighthouse must never take a rank that
    waits on a peer for the one that stalls (DESIGN I12). Two real groups over a real
    lighthouse; b starts unlike a and heals from it at step 0. Each wait is looked at
    from inside, on the training thread, as it begins."""
    seen: dict[str, set[str]] = {"a": set(), "b": set()}
    group_of = threading.local()

    def looking(call, at: str):
        def look(*args, **kwargs):
            manager = group_of.manager
            progress = manager._rank.progress
            left = progress.wait_left()
            assert progress.doing.startswith("waiting: "), (at, progress.doing)
            assert left is not None and left > 0, (at, progress.doing, left)
            seen[manager.replica_id].add(at)
            return call(*args, **kwargs)

        return look

    def watched(manager: phalanx.Manager) -> None:
        """Every call that waits on the other groups looks at the progress first."""
        services = manager._rank.services
        client = services.client

        def start_quorum(*args, **kwargs):
            asked = client.start_quorum(*args, **kwargs)
            return SimpleNamespace(result=looking(asked.result, "quorum"))

        services.client = SimpleNamespace(
            start_quorum=start_quorum, report_progress=client.report_progress
        )
        manager._client = SimpleNamespace(should_commit=looking(client.should_commit, "vote"))
        pg = services.process_group
        pg.configure = looking(pg.configure, "rendezvous")
        allreduce = pg.allreduce

        def allreduce_watched(tensor, abort):
            pending = allreduce(tensor, abort)
            pending.wait = looking(pending.wait, "all-reduce")
            return pending

        pg.allreduce = allreduce_watched
        services.host.close = looking(services.host.close, "healers' fetches")

    monkeypatch.setattr(healing, "heal", looking(healing.heal, "heal"))

    def group(name: str, barrier: threading.Barrier) -> None:
        manager = manager_for(lighthouse2, name)
        group_of.manager = manager
        watched(manager)
        weights = torch.full((4,), 1.0 if name == "a" else 2.0)
        manager.register_state("w", lambda: {"w": weights}, lambda s: weights.copy_(s["w"]))
        try:
            for _ in range(2):
                manager.start_quorum()
                manager.allreduce(torch.ones(2)).wait()
                assert manager.should_commit(), manager.last_step.failure
        finally:
            leave_together(manager, barrier)

    in_groups(group)
    # b healed from a at step 0 (it started unlike a); a waited for its fetch to end.
    assert seen["a"] == {"quorum", "rendezvous", "all-reduce", "vote", "healers' fetches"}
    assert seen["b"] == {"quorum", "rendezvous", "heal", "all-reduce", "vote"}
