"""Run inside a network namespace by tests/test_hosts.py, as another host would:

    netns_probe.py knock LIGHTHOUSE MANAGER STATE...   # every plane, without the token
    netns_probe.py metrics LIGHTHOUSE TOKEN           # the lighthouse's /metrics

`knock` prints one JSON object: for each plane, "refused" (PermissionError),
"served", or the type of whatever else went wrong."""

from __future__ import annotations

import json
import sys
import urllib.request

import phalanx
from phalanx import _core
from phalanx.store import Store

TIMEOUT = 3.0


def outcome(call) -> str:
    try:
        call()
    except PermissionError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        return f"{type(e).__name__}: {e}"
    return "served"


def knock(lighthouse: str, manager: str, states: list[str]) -> dict[str, str]:
    beacon = phalanx.LighthouseClient(lighthouse)
    rank = phalanx.ManagerClient(manager)
    planes = {
        "lighthouse quorum": lambda: beacon.quorum("intruder", timeout=TIMEOUT),
        "lighthouse status": lambda: beacon.status(timeout=TIMEOUT),
        "manager quorum": lambda: rank.quorum(
            phalanx.QuorumRequest(group_rank=0, step=0, timeout=TIMEOUT)
        ),
        "manager vote": lambda: rank.should_commit(0, 1, False, timeout=TIMEOUT),
        "store write": lambda: Store(manager, timeout=TIMEOUT).set("phalanx/x", b"x"),
    }
    for state in states:
        planes[f"state fetch {state}"] = lambda s=state: _core.fetch_manifest(
            [s], 1, 1, timeout=TIMEOUT
        )
    return {plane: outcome(call) for plane, call in planes.items()}


def metrics(lighthouse: str, token: str) -> str:
    request = urllib.request.Request(
        f"http://{lighthouse}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return response.read().decode()


if __name__ == "__main__":
    if sys.argv[1] == "knock":
        print(json.dumps(knock(sys.argv[2], sys.argv[3], sys.argv[4:])), flush=True)
    else:
        print(metrics(sys.argv[2], sys.argv[3]), flush=True)
