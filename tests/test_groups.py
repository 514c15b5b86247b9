"""Replica groups as real processes, killed, hung and cut off from their lighthouse.

Each group is tests/procs/group_process.py: a manager server and a W=1 step loop. The
lighthouse runs in the test process, except where it is itself killed and restarted.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

import phalanx

from conftest import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, http_get, is_step, wait_until

ABC = ["a", "b", "c"]


def steady(groups, participants, count=3, timeout=10.0, since=0.0):
    """Waits until every group has committed `count` steps with exactly `participants`
    (from quorums received after `since`, a unix time); returns the last such line of
    each group."""
    last = []
    for group in groups:
        for _ in range(count):
            line = group.expect(
                lambda line: is_step(line, participants) and line["quorum_at"] > since,
                timeout,
                f"a committed step with {participants}",
            )
        last.append(line)
    return last


def seen_ids(group):
    return [line["quorum_id"] for line in group.lines if line.get("event") == "step"]


def test_groups_reach_the_same_quorum_and_all_commit(lighthouse, start_group):
    groups = [start_group(name, lighthouse.address) for name in ABC]

    last = steady(groups, ABC)

    assert len({line["quorum_id"] for line in last}) == 1, last
    assert [line["replica_rank"] for line in last] == [0, 1, 2]
    for group in groups:
        ids = seen_ids(group)
        assert ids == sorted(ids), f"quorum ids went down: {ids}"
        steps = [line["step"] for line in group.lines if is_step(line)]
        assert steps == sorted(set(steps)), f"{group.name} repeated or skipped back: {steps}"
    status = phalanx.LighthouseClient(lighthouse.address).status(timeout=2.0)
    assert sorted(status.quorum_members) == ABC
    assert {r.replica_id for r in status.replicas if r.connected} == set(ABC)


def test_a_killed_group_is_excluded_and_the_others_are_told_at_once(lighthouse, start_group):
    a, b, c = groups = [start_group(name, lighthouse.address) for name in ABC]
    before = steady(groups, ABC)[0]["quorum_id"]

    killed_at = time.time()
    c.signal(signal.SIGKILL)
    c.wait(timeout=5)

    for survivor in (a, b):
        told = survivor.expect(
            lambda line: line.get("event") == "membership_lost", 5.0, "a membership loss"
        )
        assert told["lost"] == ["c"]
        assert told["cause"] == "stream_broken"
        assert told["quorum_id"] == before
        assert told["t"] - killed_at < 1.0, f"told {told['t'] - killed_at:.3f} s after the kill"
    after = steady([a, b], ["a", "b"])
    assert all(line["quorum_id"] > before for line in after), after

    status = phalanx.LighthouseClient(lighthouse.address).status(timeout=2.0)
    assert "c" not in {r.replica_id for r in status.replicas}
    code, metrics = http_get(f"http://{lighthouse.address}/metrics")
    assert code == 200
    assert re.search(
        r'^phalanx_lighthouse_evictions_total\{cause="stream_broken"\} 1$', metrics, re.M
    )
    assert re.search(r"^phalanx_lighthouse_quorum_id \d+$", metrics, re.M)


def test_a_hung_group_is_excluded_after_the_heartbeat_timeout_and_rejoins(lighthouse, start_group):
    # Two groups: the survivor alone is no majority of the previous quorum, so it
    # waits for the heartbeat timeout to declare the hung one dead.
    a, b = groups = [start_group(name, lighthouse.address) for name in ("a", "b")]
    before = steady(groups, ["a", "b"])[0]["quorum_id"]

    stopped_at = time.time()
    b.signal(signal.SIGSTOP)
    try:
        told = a.expect(
            lambda line: line.get("event") == "membership_lost", 5.0, "a membership loss"
        )
        assert told["lost"] == ["b"]
        assert told["cause"] == "heartbeat_timeout"
        waited = told["t"] - stopped_at
        assert 0.8 * HEARTBEAT_TIMEOUT < waited < HEARTBEAT_TIMEOUT + 1.0, waited
        alone = steady([a], ["a"], count=2)[0]
        assert alone["quorum_id"] > before
    finally:
        resumed_at = time.time()
        b.signal(signal.SIGCONT)

    rejoined = steady([a, b], ["a", "b"], count=2, since=resumed_at)
    assert all(line["quorum_id"] > alone["quorum_id"] for line in rejoined), rejoined
    # Behind by the steps it slept through, it healed up to the others' step.
    assert rejoined[1]["step"] > alone["step"]
    assert b.proc.poll() is None
    code, metrics = http_get(f"http://{lighthouse.address}/metrics")
    assert re.search(
        r'^phalanx_lighthouse_evictions_total\{cause="heartbeat_timeout"\} 1$', metrics, re.M
    )

    # What an operator alerts on: b's heal (its bytes: see test_one_state_per_step) and
    # the steps both groups committed.
    def counted(family: str, group: str) -> int:
        line = rf'^phalanx_lighthouse_group_{family}_total\{{replica_id="{group}"\}} (\d+)$'
        found = re.search(line, http_get(f"http://{lighthouse.address}/metrics")[1], re.M)
        return int(found.group(1)) if found else 0

    wait_until(lambda: counted("heals", "b") >= 1, 5.0, "b's heal")
    assert counted("heals", "a") == 0
    assert min(counted("steps_committed", g) for g in "ab") >= 2


def test_a_hung_group_among_three_is_left_out_after_the_join_timeout(lighthouse, start_group):
    # With a majority alive, the others need not wait for the heartbeat timeout: the
    # hung group is late for the next round and is left out after the join timeout.
    a, b, c = groups = [start_group(name, lighthouse.address) for name in ABC]
    steady(groups, ABC)

    stopped_at = time.time()
    c.signal(signal.SIGSTOP)
    try:
        first = a.expect(lambda line: is_step(line, ["a", "b"]), 5.0, "a step without c")
        assert first["quorum_at"] - stopped_at < HEARTBEAT_TIMEOUT
        steady([a, b], ["a", "b"], count=2)
        wait_until(
            lambda: (
                'evictions_total{cause="heartbeat_timeout"} 1'
                in http_get(f"http://{lighthouse.address}/metrics")[1]
            ),
            5.0,
            "c evicted by the heartbeat timeout",
        )
    finally:
        resumed_at = time.time()
        c.signal(signal.SIGCONT)
    steady(groups, ABC, count=2, since=resumed_at)


def test_groups_carry_on_through_a_lighthouse_restart(start_lighthouse_cli, start_group):
    lighthouse, address = start_lighthouse_cli("127.0.0.1:0")
    groups = [start_group(name, address) for name in ABC]
    steady(groups, ABC)
    pids = [group.pid for group in groups]
    before = {group.name: max(seen_ids(group)) for group in groups}
    steps_before = {
        group.name: max(line["step"] for line in group.lines if is_step(line)) for group in groups
    }

    lighthouse.signal(signal.SIGKILL)
    lighthouse.wait(timeout=5)
    for group in groups:
        group.expect(
            lambda line: line.get("event") == "error" and line["kind"] == "ConnectionError",
            5.0,
            "a quorum call failing while the lighthouse is away",
        )
    # Every quorum received after this comes from the new lighthouse.
    restarted_at = time.time()
    _, again = start_lighthouse_cli(address)
    assert again == address

    for group in groups:
        group.expect(
            lambda line: is_step(line, ABC) and line["quorum_at"] > restarted_at,
            10.0,
            "a committed step of all three groups after the restart",
        )
    highest_before = max(before.values())
    for group in groups:
        after = [
            line["quorum_id"]
            for line in group.lines
            if line.get("event") == "step" and line["quorum_at"] > restarted_at
        ]
        assert after and min(after) > highest_before, (group.name, before, after)
        steps = [line["step"] for line in group.lines if is_step(line)]
        assert max(steps) > steps_before[group.name], "training went back"
        assert steps == sorted(steps), f"{group.name} went back: {steps}"
        kinds = {line["kind"] for line in group.lines if line.get("event") == "error"}
        assert kinds <= {"ConnectionError", "TimeoutError"}, kinds
    # The groups were never restarted.
    assert [group.pid for group in groups] == pids
    assert all(group.proc.poll() is None for group in groups)


def test_a_live_group_that_never_asks_again_holds_the_job_back_for_a_bounded_time(
    lighthouse, start_group
):
    # "w" lives (its manager server heartbeats) but, wedged, never asks again after
    # its first quorum. With two groups, a alone is no majority of {a, w}: it waits,
    # but only for 10 join timeouts, then goes on alone.
    a = start_group("a", lighthouse.address)
    a.expect(lambda line: is_step(line, ["a"]), 30, "a trains")
    with phalanx.ManagerServer("w", lighthouse.address, heartbeat_interval=0.05) as wedged:
        rank = phalanx.ManagerClient(wedged.address)
        first = rank.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=10.0))
        assert [m.replica_id for m in first.participants] == ["a", "w"]
        wedged_at = time.time()
        line = a.expect(
            lambda line: is_step(line, ["a"]) and line["quorum_at"] > wedged_at, 20, "a alone"
        )
        waited = line["quorum_at"] - wedged_at
        assert 8 * JOIN_TIMEOUT < waited < 10 * JOIN_TIMEOUT + 5.0, waited
        status = phalanx.LighthouseClient(lighthouse.address).status(timeout=2.0)
        assert "w" in {r.replica_id for r in status.replicas if r.connected}


def test_a_second_group_with_a_live_groups_replica_id_is_refused_and_the_first_goes_on(
    lighthouse, start_group
):
    original = start_group("dup", lighthouse.address)
    original.expect(lambda line: is_step(line, ["dup"]), 30, "the original trains")
    impostor = start_group("dup", lighthouse.address)
    # Its first quorum request is refused with the clash named; it exits non-zero.
    assert impostor.proc.wait(timeout=30) != 0
    clash = "\n".join(impostor.stderr)
    assert "ValueError" in clash and "already live" in clash and "--replica-id" in clash, clash
    started = impostor.lines[0]["read_at"]
    # The original never noticed: every step since committed, ids unchanged.
    settled = time.time() + 0.5
    later = original.expect(
        lambda line: is_step(line, ["dup"]) and line["quorum_at"] > settled,
        30,
        "the original goes on",
    )
    since = [line for line in original.lines if line.get("event") == "step" and line["t"] > started]
    assert since and all(line["committed"] for line in since), since
    assert {line["quorum_id"] for line in since} == {later["quorum_id"]}


def test_one_request_with_a_huge_quorum_id_cannot_stop_a_live_job(lighthouse, start_group):
    # I3, I9: a request claiming the last id of the u64 range is refused; it must not
    # make the ids wrap (a wrapped id reuses the store prefix of quorum 0 for good).
    a, b, c = groups = [start_group(name, lighthouse.address) for name in ABC]
    before = steady(groups, ABC)[0]["quorum_id"]
    ghost = phalanx.LighthouseClient(lighthouse.address)
    for claimed in (2**63 - 1, 2**53 + 1):
        with pytest.raises(ValueError, match="last_quorum_id"):
            ghost.quorum("ghost", timeout=0.001, last_quorum_id=claimed)

    c.signal(signal.SIGKILL)
    after = steady([a, b], ["a", "b"])
    assert all(before < line["quorum_id"] < 2**53 for line in after), after
