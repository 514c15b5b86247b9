"""A cut between two groups that both still reach the lighthouse: the group whose
collectives fail asks its peers' stores, reports the one that does not answer, and
the lighthouse leaves one of the pair out until they reach each other again. Three
real groups (threads of this process) over a real lighthouse; the cut itself is
played by the probe of group a, which finds c's store silent for a while (a real
cut between hosts is in tests/test_partitions.py)."""

from __future__ import annotations

import threading
import time

import torch

from phalanx import peers
from phalanx.process_group import CollectiveFailed

from conftest import in_groups, leave_together, manager_for

#: A bound on the time the groups train, should a never be back.
TRAIN_FOR_S = 60.0


def timed_out() -> None:
    raise CollectiveFailed("all-reduce did not complete within 5.0 s")


#: At this step a's all-reduce fails without a word from the lighthouse.
CUT_AT = 3


def test_a_group_that_a_member_cannot_reach_is_left_out_until_it_can(lighthouse):
    cut = threading.Event()
    mended = threading.Event()
    rejoined = threading.Event()
    deadline = time.monotonic() + TRAIN_FOR_S
    probed: list[str] = []
    real_answers = peers.store_answers

    def answers(address: str, token: str | None) -> bool:
        """c's store is silent to a's probes while the cut lasts."""
        probed.append(address)
        silent = cut.is_set() and address == stores.get("c")
        return real_answers(address, token) and not silent

    stores: dict[str, str] = {}
    outcomes: dict[str, list[tuple[int, int, str | None]]] = {"a": [], "b": [], "c": []}

    def group(name: str, barrier: threading.Barrier) -> None:
        manager = manager_for(lighthouse, name, init_sync=False)
        if name == "a":
            token = manager.settings.token
            manager._rank.peers = peers.PeerReach(lambda address: answers(address, token))
        pg = manager._rank.services.process_group
        allreduce = pg.allreduce

        def failing_once(tensor, abort):
            pending = allreduce(tensor, abort)
            if name == "a" and manager.current_step() == CUT_AT and not cut.is_set():
                cut.set()
                pending.wait = timed_out
            return pending

        pg.allreduce = failing_once
        try:
            # Every group trains until a, back with the others after the cut, has
            # committed a step of all three.
            while not rejoined.is_set() and time.monotonic() < deadline:
                manager.start_quorum()
                manager.allreduce(torch.ones(2)).wait()
                committed = manager.should_commit()
                record = manager.last_step
                for member in manager._quorum.participants if manager._quorum else ():
                    stores.setdefault(member.replica_id, member.store_address)
                outcomes[name].append(
                    (record.step, record.participants, None if committed else record.failure)
                )
                if not committed and peers.LEFT_OUT in (record.failure or ""):
                    mended.set()  # one of a and c was told: the cut may end
                if name == "a" and mended.is_set() and committed and record.participants == 3:
                    rejoined.set()
        finally:
            leave_together(manager, barrier)

    watcher = threading.Thread(target=lambda: mended.wait(60) and cut.clear(), daemon=True)
    watcher.start()
    in_groups(group, names=("a", "b", "c"))
    assert probed, "a's failed step probed nobody"
    assert stores["c"] in probed, (stores, probed)
    # One of the pair that cannot reach each other sits out (here a: it failed the
    # step, so its state is the older), told who cannot reach it; b never does.
    told = {
        name: [f for _, _, f in got if f and "left out of quorum" in f]
        for name, got in outcomes.items()
    }
    assert not told["b"], told
    assert bool(told["a"]) != bool(told["c"]), told
    blamed = "c" if told["a"] else "a"
    assert all(f'"{blamed}" could not reach this group' in f for f in told["a"] + told["c"]), told
    # Once they reach each other again, all three train together.
    assert rejoined.is_set(), outcomes["a"][-5:]
