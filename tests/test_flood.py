"""A flood of idle connections against the lighthouse and a rank's state server: each
listener keeps only a few connections that have not presented the token, so a killed
group still rejoins and heals from that rank, and the replicas stay bit-identical."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

import phalanx
from test_transaction import assert_bit_identical, start_rank

from conftest import PROCS, http_get

#: Idle connections held against each listener.
FLOOD = 20_000


def first_commit(child) -> dict:
    return child.expect(
        lambda line: line.get("event") == "step" and line["committed"], 60, "a committed step"
    )


def rejoin(spawn, lighthouse, killed) -> tuple[object, float]:
    """Kills `killed`, starts it again; the new child and seconds to its first commit."""
    killed.signal(signal.SIGKILL)
    killed.wait(10)
    started = time.monotonic()
    child = start_rank(spawn, lighthouse.address, "b", steps=100_000)
    healed = first_commit(child)
    assert healed["after"] > 1, "the restarted group healed from its peer"
    return child, time.monotonic() - started


def refused(lighthouse, reason: str) -> int:
    _, metrics = http_get(f"http://{lighthouse.address}/metrics")
    pattern = rf'phalanx_lighthouse_refused_requests_total{{reason="{reason}"}} (\d+)'
    return int(re.search(pattern, metrics).group(1))


@pytest.mark.slow
def test_a_killed_group_rejoins_and_heals_while_idle_connections_flood_the_job(spawn):
    with phalanx.LighthouseServer(join_timeout=0.3, heartbeat_timeout=2.0) as lighthouse:
        a = start_rank(spawn, lighthouse.address, "a", steps=100_000)
        state_address = a.expect(lambda line: line.get("event") == "ready", 60, "a ready")[
            "state_address"
        ]
        b = start_rank(spawn, lighthouse.address, "b", steps=100_000)
        b.expect(lambda line: line.get("participants") == 2, 60, "a and b train together")
        children = [a, b]

        b, normal = rejoin(spawn, lighthouse, b)
        children.append(b)

        flood = spawn(
            "flood",
            [
                sys.executable,
                str(PROCS / "idle_flood.py"),
                str(FLOOD),
                lighthouse.address,
                state_address,
            ],
        )
        held = flood.expect(lambda line: line.get("event") == "holding", 120, "the flood held")
        assert held["per_address"] >= 5_000, held
        b, flooded = rejoin(spawn, lighthouse, b)
        children.append(b)

        print(f"rejoin and heal: {normal:.2f} s alone, {flooded:.2f} s beside the flood ({held})")
        # The lighthouse turned the flood away (some may still wait in the kernel's
        # accept queue: a client counts its connection established before it is accepted).
        turned_away = refused(lighthouse, "crowded_out") + refused(lighthouse, "no_token_in_time")
        assert turned_away >= held["established"][lighthouse.address] // 2
        b.expect(lambda line: line.get("participants") == 2, 30, "b trains with a again")
        assert assert_bit_identical(children) >= 10
