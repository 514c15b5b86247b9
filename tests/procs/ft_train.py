"""A replica group's rank training with phalanx DDP, for the tests, as a user's loop
does: `zero_grad`, forward, `backward`, `step`, around an ordinary model of several
gradient buckets (`user_model.ConvNet`), asking the manager nothing before its forward.
Every backward runs under `user_model.SavedTensorGuard`: a heal that changed what
autograd saved fails the rank.

Prints one JSON line per step: the step it ran, whether it committed, the quorum, and
a hash of its model and optimizer state after the step. Data is seeded by (step,
replica) so that every group sees different samples, as in a real job.

`--pause-at STEP --pause-phase PHASE` makes the rank stop itself (SIGSTOP, the whole
process, heartbeat included) once, at the first step from STEP on in which at least
`--pause-participants` groups contribute, in PHASE: with its all-reduce in flight,
after the collectives and before its vote, or after the vote and before the
optimizer steps. It prints {"event": "pausing", "step": ...} first; the test sends
SIGCONT. `--hold-at STEP` (same condition) holds only the training thread, before its
backward, so that its peers' all-reduce waits for its part (the heartbeat goes on),
until the test sends SIGUSR1. The condition reads the previous step's quorum there.
With `--hold-gil` it holds in a C call that keeps the GIL (no Python thread of the
process runs); with `--in-wait` too, it does so inside a wait on the other groups that
its progress reporter has reported (so its last report says it waits). With
`--hold-after-vote` it holds after its vote instead, before it asks for the next
quorum (nobody waits on it then).
`--hold-in-heal` holds the training thread the same way inside its first heal, as it
loads the state it fetched. `--busy-for SECONDS` makes a hold run Python code that
long instead, forward passes of its model (its stack moves: progress, not a hang), and
go on by itself.
`--fail-at STEP` makes the rank fail its own step once (`report_error`, so its vote is
"no"), at the first step from STEP on whose quorum has `--pause-participants` groups.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

import phalanx

from state_digest import state_hash
from user_model import ConvNet, SavedTensorGuard, batch


class Pause:
    """Stops this process, or holds its training thread, once at one step and phase
    (see the module docstring)."""

    def __init__(
        self,
        manager: phalanx.Manager,
        step: int,
        phase: str | None,
        participants: int,
        *,
        stops: bool = True,
    ):
        self.manager, self.step, self.phase = manager, step, phase
        self.participants = participants
        if not stops:
            return  # a hold: the training loop calls held() itself
        if phase == "before_vote":
            # The vote is the manager server's RPC: stop just before it is sent.
            manager._client = _StopBeforeVote(manager._client, self)
        elif phase == "after_vote":
            should_commit = manager.should_commit

            def then_stop() -> bool:
                decision = should_commit()
                self.at("after_vote", manager.current_step() - decision)
                return decision

            manager.should_commit = then_stop

    def due(self, step: int) -> bool:
        """From the step on, once every wanted group contributes (the job trains as one)."""
        return 0 <= self.step <= step and self.manager.num_participants() >= self.participants

    def at(self, phase: str, step: int) -> None:
        if phase == self.phase and self.due(step):
            self.phase = None
            print(json.dumps({"event": "pausing", "phase": phase, "step": step}), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def held(
        self,
        step: int,
        *,
        gil: bool = False,
        in_wait: bool = False,
        work: Callable[[], object] | None = None,
        busy: float = 0.0,
    ) -> None:
        """Holds the training thread (only) until SIGUSR1, once; or, with `gil`, for
        60 s in a C call that keeps the GIL, which freezes every Python thread; with
        `in_wait` too, inside a 60 s wait that has been reported; with `work`, calling
        it for `busy` seconds (a slow step, which the progress reporter sees move)."""
        self.phase = None
        if in_wait:
            progress = self.manager._rank.progress
            with progress.waiting("a wait the test holds in", 60.0):
                time.sleep(3 * progress.interval)
                self.held(step, gil=gil)
            return
        print(json.dumps({"event": "holding", "step": step}), flush=True)
        if work is not None:
            until = time.monotonic() + busy
            with torch.no_grad():
                while time.monotonic() < until:
                    work()
        elif gil:
            ctypes.PyDLL(None).sleep(60)
        else:
            signal.sigtimedwait([signal.SIGUSR1], 60)


class _StopBeforeVote:
    def __init__(self, client, pause: Pause):
        self._client, self._pause = client, pause

    def should_commit(self, group_rank, step, *args, **kwargs):
        self._pause.at("before_vote", step)
        return self._client.should_commit(group_rank, step, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def held_once(load):
    """`load`, whose first call holds the training thread (until SIGUSR1) first."""
    held = []

    def hold_then_load(state, *a, **kw):
        if not held:
            held.append(True)
            print(json.dumps({"event": "holding", "in": "heal"}), flush=True)
            signal.sigtimedwait([signal.SIGUSR1], 60)
        return load(state, *a, **kw)

    return hold_then_load


def print_step(manager: phalanx.Manager, step: int, committed: bool, loss: float, digest: str):
    """The step's JSON line, which the tests read."""
    line = {
        "event": "step",
        "step": step,
        "committed": committed,
        "after": manager.current_step(),
        "quorum_id": manager.quorum_id,
        "participants": manager.num_participants(),
        "loss": loss,
        "hash": digest,
        "state_quorum_id": manager.state_quorum_id,
        "lineage": manager.lineage,
        "torn": manager.torn,
        "failure": manager.failure,
        "t": time.time(),
    }
    print(json.dumps(line), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument(
        "--pause-phase", choices=["in_allreduce", "before_vote", "after_vote"], default=None
    )
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument(
        "--hold-gil",
        action="store_true",
        help="hold in a C call that keeps the GIL (for 60 s) instead: no thread runs",
    )
    parser.add_argument(
        "--in-wait",
        action="store_true",
        help="with --hold-gil: hold inside a wait on the others its reporter reported",
    )
    parser.add_argument(
        "--hold-after-vote",
        action="store_true",
        help="hold at --hold-at after the step's vote (before the next quorum) instead",
    )
    parser.add_argument(
        "--hold-in-heal",
        action="store_true",
        help="hold the training thread inside its first heal (loading the fetched state)",
    )
    parser.add_argument("--busy-for", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--pause-participants", type=int, default=1)
    parser.add_argument(
        "--first-heal-timeout",
        type=float,
        default=None,
        help="the heal deadline of this rank's first heal only (to make it fail)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    if args.hold_at >= 0 or args.hold_in_heal:
        # Blocked in every thread (they inherit it), so that it waits for sigtimedwait.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # groups start apart
    model = ConvNet()
    if args.hold_in_heal:
        model.load_state_dict = held_once(model.load_state_dict)
    manager = phalanx.Manager(timeout=args.timeout)
    ddp = phalanx.DistributedDataParallel(model, manager)
    optimizer = phalanx.Optimizer(manager, torch.optim.Adam(model.parameters(), lr=0.01))
    rank = manager.group_rank
    pause = Pause(manager, args.pause_at, args.pause_phase, args.pause_participants)
    hold_phase = "after_vote" if args.hold_after_vote else "before_backward"
    hold = Pause(manager, args.hold_at, hold_phase, args.pause_participants, stops=False)
    fail = Pause(manager, args.fail_at, "fail", args.pause_participants, stops=False)
    timeouts = manager.timeouts
    if args.first_heal_timeout is not None:
        manager.timeouts = replace(timeouts, heal=args.first_heal_timeout)
    ready = {
        "event": "ready",
        "pid": os.getpid(),
        "state_address": manager.state_address,
        "manager_address": manager.manager_address,
        "t": time.time(),
    }
    print(json.dumps(ready), flush=True)

    salt = zlib.crc32(manager.replica_id.encode()) + rank
    guard = SavedTensorGuard()
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()
        x, y = batch(step, salt)
        with guard:
            loss = nn.functional.cross_entropy(ddp(x), y)
        if (
            hold.phase == "before_backward"
            and hold.due(step)
            and manager.wait_quorum()
            and hold.due(step)
        ):
            # Before its backward: its peers' all-reduce waits for its part. Checked again
            # on this step's own quorum (due() reads the previous one until it is taken):
            # a quorum formed without this group would leave nobody waiting on it.
            hold.held(step, gil=args.hold_gil, in_wait=args.in_wait)
        loss.backward()
        pause.at("in_allreduce", step)
        if fail.phase and fail.due(step):
            fail.phase = None
            manager.report_error("the test fails this step (--fail-at)")
        committed = optimizer.step()
        if manager.last_step.healed or "heal" in (manager.failure or ""):
            manager.timeouts = timeouts  # the first heal is over, one way or the other
        print_step(manager, step, committed, loss.item(), state_hash(model, optimizer.optimizer))
        if hold.phase == "after_vote" and committed and hold.due(step):
            # Voted, and not yet asking for the next quorum: nobody waits on it, and the
            # next quorum goes on without it after the lighthouse's join timeout.
            forward = functools.partial(model, x) if args.busy_for else None
            hold.held(step, work=forward, busy=args.busy_for)
        time.sleep(args.step_sleep)
    manager.shutdown()
    print(json.dumps({"event": "done", "step": manager.current_step()}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
