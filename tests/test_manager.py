"""A replica group's manager server with its ranks: the ranks of a W=2 group run as
threads of this process, each with its own ManagerClient, as rank processes would."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import phalanx

from conftest import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, http_get, wait_until


def together(*calls: Callable[[], object]) -> list[object]:
    """Runs `calls` at the same time, as the ranks of a group do; returns their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result(timeout=10.0) for f in futures]


@pytest.fixture
def group(lighthouse) -> Iterator[tuple[phalanx.ManagerClient, phalanx.ManagerClient]]:
    """Replica group "g" of two ranks: the clients of rank 0 (in the server's process,
    as a Manager's is: its calls go to the server directly) and rank 1 (over the
    network)."""
    with phalanx.ManagerServer(
        "g", lighthouse.address, world_size=2, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as server:
        yield (
            phalanx.ManagerClient(server.address, server=server),
            phalanx.ManagerClient(server.address),
        )


def both_ask(group, step: int) -> list[phalanx.QuorumResult]:
    rank0, rank1 = group
    return together(
        lambda: rank0.quorum(
            phalanx.QuorumRequest(
                group_rank=0, step=step, timeout=5.0, state_address="127.0.0.1:1000"
            )
        ),
        lambda: rank1.quorum(
            phalanx.QuorumRequest(
                group_rank=1, step=step, timeout=5.0, state_address="127.0.0.1:1001"
            )
        ),
    )


def both_vote(group, step: int, vote0: bool, vote1: bool) -> list[bool]:
    """Both ranks vote on `step` at once; whether each was told to commit."""
    rank0, rank1 = group
    return together(
        lambda: rank0.should_commit(0, step, vote0, timeout=5.0).commit,
        lambda: rank1.should_commit(1, step, vote1, timeout=5.0).commit,
    )


def test_the_ranks_of_a_group_get_one_quorum_and_commit_together(group):
    r0, r1 = both_ask(group, step=0)

    assert r0.quorum_id == r1.quorum_id
    assert (r0.replica_rank, r0.replica_world_size) == (0, 1)
    assert (r0.store_prefix, r1.store_prefix) == (
        f"phalanx/q{r0.quorum_id}/r0",
        f"phalanx/q{r0.quorum_id}/r1",
    )
    [member] = r0.participants
    assert (member.replica_id, member.world_size) == ("g", 2)
    assert member.state_addresses == ["127.0.0.1:1000", "127.0.0.1:1001"]
    assert not r0.heal and r0.recovery_sources == []

    votes = both_vote(group, 0, True, True)
    assert votes == [True, True]


def test_one_rank_voting_no_fails_the_step_for_every_rank(group):
    # I2: the group commits only if every rank voted yes.
    both_ask(group, step=0)

    votes = both_vote(group, 0, True, False)

    assert votes == [False, False]


def test_a_rank_that_never_votes_means_no_after_the_timeout(group):
    # I2 and I6: no commit without every vote, and no hang waiting for it.
    rank0, rank1 = group
    both_ask(group, step=0)
    started = time.monotonic()

    assert rank0.should_commit(0, 0, True, timeout=0.3).commit is False

    waited = time.monotonic() - started
    assert 0.25 < waited < 2.0, waited
    # A vote that comes too late gets the decision already taken, not a second one.
    assert rank1.should_commit(1, 0, True, timeout=5.0).commit is False


def test_a_failed_step_can_be_retried_under_the_next_quorum(group):
    # A step that failed is not committed and the loop tries the same step again,
    # under a new quorum: the old "no" must not stick to the step number.
    first = both_ask(group, step=0)
    both_vote(group, 0, False, True)

    again = both_ask(group, step=0)
    votes = both_vote(group, 0, True, True)

    assert len({r.quorum_id for r in again}) == 1
    assert again[0].quorum_id > first[0].quorum_id  # the failure moved the id up
    assert votes == [True, True]


def test_a_rank_that_never_asks_for_the_quorum_is_named_in_the_timeout(group):
    rank0, _ = group
    started = time.monotonic()

    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of the group did not ask"):
        rank0.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=0.3))

    assert time.monotonic() - started < 2.0


def test_ranks_that_disagree_on_the_step_are_told_so(group):
    rank0, rank1 = group

    def ask(client, rank, step):
        try:
            client.quorum(phalanx.QuorumRequest(group_rank=rank, step=step, timeout=2.0))
        except ValueError as e:
            return str(e)
        return "no error"

    # Whichever request reaches the server second finds the other waiting: both hear.
    early, late = together(lambda: ask(rank0, 0, 3), lambda: ask(rank1, 1, 4))

    for message in (early, late):
        assert "disagree on the step" in message
        assert "rank 0 at step 3" in message and "rank 1 at step 4" in message


def test_malformed_rank_requests_are_refused_and_the_server_keeps_serving(group):
    rank0, _ = group
    with pytest.raises(ValueError, match="group rank 2 is out of range for a group of 2"):
        rank0.quorum(phalanx.QuorumRequest(group_rank=2, step=0, timeout=1.0))
    with pytest.raises(ValueError, match="step -1 is negative"):
        rank0.quorum(phalanx.QuorumRequest(group_rank=0, step=-1, timeout=1.0))
    with pytest.raises(ValueError, match="state address"):
        rank0.quorum(
            phalanx.QuorumRequest(group_rank=0, step=0, timeout=1.0, state_address="host 1:2")
        )
    with pytest.raises(ValueError, match="group rank 5"):
        rank0.should_commit(5, 0, True, timeout=1.0)
    with pytest.raises(ValueError, match="timeout"):
        rank0.should_commit(0, 0, True, timeout=0)

    r0, r1 = both_ask(group, step=0)
    assert r0.quorum_id == r1.quorum_id


def test_bad_manager_settings_are_refused_naming_the_setting(lighthouse):
    address = lighthouse.address
    with pytest.raises(ValueError, match="replica id"):
        phalanx.ManagerServer("no spaces", address)
    with pytest.raises(ValueError, match="replica id is empty"):
        phalanx.ManagerServer("", address)
    with pytest.raises(ValueError, match="world size 0"):
        phalanx.ManagerServer("g", address, world_size=0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        phalanx.ManagerServer("g", address, heartbeat_interval=0)
    with pytest.raises(ValueError, match="not a valid address"):
        phalanx.ManagerServer("g", "not an address")


def test_no_event_is_none_after_the_timeout(group):
    rank0, _ = group
    rank0.subscribe_events()
    rank0.subscribe_events()  # idempotent
    started = time.monotonic()

    assert rank0.next_event(timeout=0.2) is None
    assert rank0.next_event() is None

    assert time.monotonic() - started < 2.0


def test_a_group_that_shuts_down_is_reported_to_the_others_at_once():
    kw = {"heartbeat_interval": HEARTBEAT_INTERVAL}
    # A quorum of both: once both beat, the first to ask waits up to 3 s for the other
    # (0.2 s, the shared fixture's, is not enough on a loaded machine); one of a alone,
    # once b left, forms at once, every live group having asked.
    with (
        phalanx.LighthouseServer(
            join_timeout=3.0, heartbeat_timeout=HEARTBEAT_TIMEOUT
        ) as lighthouse,
        phalanx.ManagerServer("a", lighthouse.address, **kw) as a,
    ):
        b = phalanx.ManagerServer("b", lighthouse.address, **kw)
        try:
            watcher = phalanx.LighthouseClient(lighthouse.address)
            wait_until(lambda: len(watcher.status().replicas) == 2, 10.0, "a and b beat")
            a_rank, b_rank = phalanx.ManagerClient(a.address), phalanx.ManagerClient(b.address)
            a_rank.subscribe_events()
            quorums = together(
                lambda: a_rank.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0)),
                lambda: b_rank.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0)),
            )
            assert [len(q.participants) for q in quorums] == [2, 2]
        finally:
            stopped_at = time.monotonic()
            b.shutdown()

        event = a_rank.next_event(timeout=5.0)

        assert event is not None
        assert time.monotonic() - stopped_at < 2.0
        assert (event.lost, event.cause) == (["b"], "left")  # it ended its run; not "stream_broken"
        assert event.quorum_id == quorums[0].quorum_id
        again = a_rank.quorum(phalanx.QuorumRequest(group_rank=0, step=1, timeout=5.0))
        assert again.quorum_id > event.quorum_id


def test_groups_ask_for_their_quorums_on_their_heartbeat_streams(lighthouse):
    """One frame each way on a stream already open, not a call of its own per quorum."""
    kw = {"heartbeat_interval": HEARTBEAT_INTERVAL}
    with (
        phalanx.ManagerServer("a", lighthouse.address, **kw) as a,
        phalanx.ManagerServer("b", lighthouse.address, **kw) as b,
    ):
        ranks = [phalanx.ManagerClient(a.address), phalanx.ManagerClient(b.address)]
        for step in range(2):
            request = phalanx.QuorumRequest(group_rank=0, step=step, timeout=5.0)
            quorums = together(*(lambda r=r, q=request: r.quorum(q) for r in ranks))
            for group, quorum in zip("ab", quorums, strict=True):
                assert group in [m.replica_id for m in quorum.participants]

    _, metrics = http_get(f"http://{lighthouse.address}/metrics")
    assert 'phalanx_lighthouse_quorum_requests_total{via="stream"} 4' in metrics, metrics
    assert 'phalanx_lighthouse_quorum_requests_total{via="call"} 0' in metrics, metrics


def test_a_quorum_asked_in_the_background_answers_once(group):
    rank0, rank1 = group
    asked = [
        rank.start_quorum(
            phalanx.QuorumRequest(
                group_rank=r, step=0, timeout=5.0, state_address=f"127.0.0.1:{1000 + r}"
            )
        )
        for r, rank in enumerate(group)
    ]
    r0, r1 = (a.result() for a in asked)
    assert r0.quorum_id == r1.quorum_id > 0
    with pytest.raises(RuntimeError, match="answers once"):
        asked[0].result()


def test_a_refused_quorum_asked_in_the_background_raises_when_taken(group):
    rank0, _ = group
    no_such_rank = phalanx.QuorumRequest(group_rank=5, step=0, timeout=1.0)  # in a group of two
    asked = rank0.start_quorum(no_such_rank)
    with pytest.raises(ValueError, match="group rank 5 is out of range"):
        asked.result()


def test_an_in_process_client_needs_the_server_at_its_address(lighthouse):
    with (
        phalanx.ManagerServer("a", lighthouse.address) as a,
        phalanx.ManagerServer("b", lighthouse.address) as b,
        pytest.raises(ValueError, match="serves .*, not"),
    ):
        phalanx.ManagerClient(a.address, server=b)


def test_an_in_process_client_of_a_stopped_server_is_refused(lighthouse):
    server = phalanx.ManagerServer("g", lighthouse.address)
    rank = phalanx.ManagerClient(server.address, server=server)
    server.shutdown()
    with pytest.raises(ConnectionError, match="shutting down"):
        rank.should_commit(0, 0, True, timeout=1.0)


def test_the_eviction_exit_refuses_a_status_or_signal_out_of_range(group):
    rank0, _ = group
    for status, signal in [(256, 0), (-1, 0), (75, -1), (75, 10_000)]:
        with pytest.raises(ValueError, match="out of range"):
            rank0.arm_eviction_exit("g", grace=5.0, status=status, dump_signal=signal)
    for grace in [-1.0, float("nan")]:
        with pytest.raises(ValueError, match="grace"):
            rank0.arm_eviction_exit("g", grace=grace, status=75)
    rank0.arm_eviction_exit("g", grace=5.0, status=75)
    rank0.disarm_eviction_exit()


def test_a_stopping_server_answers_its_waiting_ranks_at_once(lighthouse):
    # Rank 2 never asks: ranks 0 (in-process) and 1 (over the network) wait on it.
    server = phalanx.ManagerServer("g", lighthouse.address, world_size=3)
    ranks = [
        phalanx.ManagerClient(server.address, server=server),
        phalanx.ManagerClient(server.address),
    ]
    asked = [
        rank.start_quorum(phalanx.QuorumRequest(group_rank=r, step=0, timeout=30.0))
        for r, rank in enumerate(ranks)
    ]
    wait_until(lambda: server.asking == (0, [0, 1]), 10.0, "ranks 0 and 1 wait")
    started = time.monotonic()
    server.shutdown()
    for pending in asked:
        with pytest.raises(ConnectionError, match="shutting down"):
            pending.result()
    assert time.monotonic() - started < 10.0, "answered at once, not at the 30 s deadline"


def test_groups_that_end_their_run_ahead_of_one_left_behind_never_let_it_redo_their_step():
    """a and b commit step 1 without c (late: its quorum went on without it after the
    join timeout) and end their runs. The lighthouse heard of their step 1 only from
    their leaving beats; c, behind at step 1, must not commit step 1 again as the same
    lineage (two states under one step number): its quorum starts a new lineage,
    announced as going back from the leavers' state."""
    kw = {"heartbeat_interval": HEARTBEAT_INTERVAL}
    with (
        phalanx.LighthouseServer(
            join_timeout=0.3, heartbeat_timeout=HEARTBEAT_TIMEOUT
        ) as lighthouse,
        phalanx.ManagerServer("c", lighthouse.address, **kw) as c,
    ):
        a = phalanx.ManagerServer("a", lighthouse.address, **kw)
        b = phalanx.ManagerServer("b", lighthouse.address, **kw)
        watcher = phalanx.LighthouseClient(lighthouse.address)
        wait_until(lambda: len(watcher.status().replicas) == 3, 10.0, "a, b and c beat")
        ranks = {
            g: phalanx.ManagerClient(s.address, server=s)
            for g, s in zip("abc", (a, b, c), strict=True)
        }

        def step(groups: str, step: int, state_quorum_id: int) -> int:
            """`groups` take `step` together and commit it; its quorum id."""
            request = phalanx.QuorumRequest(
                group_rank=0, step=step, timeout=10.0, state_quorum_id=state_quorum_id
            )
            quorums = together(*(lambda g=g: ranks[g].quorum(request) for g in groups))
            assert {len(q.participants) for q in quorums} == {len(groups)}, quorums
            quorum_id = quorums[0].quorum_id

            def vote(g: str) -> bool:
                return ranks[g].should_commit(0, step, True, 10.0, quorum_id=quorum_id).commit

            votes = together(*(lambda g=g: vote(g) for g in groups))
            assert all(votes)
            return quorum_id

        first = step("abc", 0, 0)
        ahead = step("ab", 1, first)  # c is late: the quorum goes on without it
        a.shutdown()
        b.shutdown()
        wait_until(lambda: len(watcher.status().replicas) == 1, 10.0, "a and b left")

        behind = ranks["c"].quorum(
            phalanx.QuorumRequest(group_rank=0, step=1, timeout=10.0, state_quorum_id=first)
        )

        gave_up = behind.rolled_back_from
        assert gave_up is not None, "c would commit step 1 again, as the leavers' lineage"
        assert (gave_up.lineage, gave_up.step, gave_up.state_quorum_id) == (0, 2, ahead)
        assert behind.lineage == behind.quorum_id > ahead
