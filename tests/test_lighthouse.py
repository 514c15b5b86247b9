"""The lighthouse through its Python bindings and its HTTP pages, in this process."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import phalanx

from conftest import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, http_get, wait_until


class Asking(threading.Thread):
    """A quorum request in a background thread; its error, if any, lands in `errors`."""

    def __init__(self, client: phalanx.LighthouseClient, replica_id: str, **kwargs) -> None:
        super().__init__(daemon=True)
        self.call = lambda: client.quorum(replica_id, **kwargs)
        self.errors: list[Exception] = []

    def run(self) -> None:
        try:
            self.call()
        except Exception as e:  # noqa: BLE001 - the test checks what it was
            self.errors.append(e)


def ask_in_background(client, replica_id, **kwargs) -> Asking:
    asking = Asking(client, replica_id, **kwargs)
    asking.start()
    return asking


def test_a_single_group_gets_a_quorum_of_itself(lighthouse):
    client = phalanx.LighthouseClient(lighthouse.address)

    quorum = client.quorum(
        "a", timeout=5.0, step=7, manager_address="127.0.0.1:1", state_addresses=["127.0.0.1:2"]
    )

    assert quorum.quorum_id == 1
    [member] = quorum.participants
    assert (member.replica_id, member.step, member.world_size) == ("a", 7, 1)
    assert member.manager_address == "127.0.0.1:1"
    assert member.state_addresses == ["127.0.0.1:2"]
    assert abs(quorum.issued_at_unix_ms / 1000 - time.time()) < 60
    assert lighthouse.status_url == f"http://{lighthouse.address}/"


def test_groups_asking_together_share_one_quorum_ordered_by_replica_id():
    names = ["c", "a", "b"]
    with phalanx.LighthouseServer(min_replicas=len(names)) as lighthouse:
        client = phalanx.LighthouseClient(lighthouse.address)

        with ThreadPoolExecutor(len(names)) as pool:
            quorums = list(pool.map(lambda name: client.quorum(name, timeout=5.0), names))

    assert len({q.quorum_id for q in quorums}) == 1
    for q in quorums:
        assert [m.replica_id for m in q.participants] == ["a", "b", "c"]


def test_the_quorum_id_stays_for_an_unchanged_quorum_and_moves_up_on_commit_failures(
    lighthouse,
):
    client = phalanx.LighthouseClient(lighthouse.address)

    first = client.quorum("a", timeout=5.0)
    same = client.quorum("a", timeout=5.0, step=1, last_quorum_id=first.quorum_id)
    failed = client.quorum("a", timeout=5.0, step=1, commit_failures=1)

    assert same.quorum_id == first.quorum_id
    assert failed.quorum_id == first.quorum_id + 1


def test_a_fresh_lighthouse_continues_above_the_ids_the_groups_report(lighthouse):
    # I3: the lighthouse keeps no state; the groups tell a restarted one where it was.
    client = phalanx.LighthouseClient(lighthouse.address)

    quorum = client.quorum("a", timeout=5.0, last_quorum_id=41)

    assert quorum.quorum_id == 42


def test_an_implausible_quorum_id_is_refused_and_numbering_goes_on(lighthouse):
    # I3: one request claiming a huge last quorum id must not make the ids wrap.
    client = phalanx.LighthouseClient(lighthouse.address)
    with pytest.raises(ValueError, match="last_quorum_id .* is implausible"):
        client.quorum("ghost", timeout=1.0, last_quorum_id=2**60)
    first = client.quorum("a", timeout=5.0, commit_failures=1)
    second = client.quorum("a", timeout=5.0, commit_failures=1, last_quorum_id=first.quorum_id)
    assert 0 < first.quorum_id < second.quorum_id < 2**53


def test_a_quorum_that_cannot_form_times_out_and_says_why():
    with phalanx.LighthouseServer(min_replicas=2, join_timeout=JOIN_TIMEOUT) as lighthouse:
        client = phalanx.LighthouseClient(lighthouse.address)
        started = time.monotonic()

        with pytest.raises(TimeoutError, match="at least 2 needed"):
            client.quorum("a", timeout=0.3)

        assert time.monotonic() - started < 2.0
        # The request was withdrawn: nobody is left waiting.
        status = client.status(timeout=2.0)
        assert status.waiting_for == ""
        assert [r.joined for r in status.replicas] == [False]


def test_a_second_group_with_the_same_replica_id_is_refused_with_the_conflict_named():
    with phalanx.LighthouseServer(min_replicas=2, join_timeout=JOIN_TIMEOUT) as lighthouse:
        client = phalanx.LighthouseClient(lighthouse.address)
        first = ask_in_background(client, "a", timeout=0.5, manager_address="host-1:1")
        wait_until(lambda: client.status(timeout=1.0).waiting_for, 2.0, "the first request waiting")

        with pytest.raises(ValueError, match="already asking for a quorum from manager host-1:1"):
            client.quorum("a", timeout=1.0, manager_address="host-2:1")

        first.join(timeout=5.0)
        assert [type(e) for e in first.errors] == [TimeoutError]


def test_status_reports_the_quorum_members_and_the_configuration(lighthouse):
    client = phalanx.LighthouseClient(lighthouse.address)
    client.quorum("a", timeout=5.0, step=3)

    status = client.status(timeout=2.0)

    assert status.quorum_id == 1
    assert status.quorum_members == ["a"]
    assert status.quorums_issued == 1
    assert status.min_replicas == 1
    assert status.join_timeout_ms == int(JOIN_TIMEOUT * 1000)
    assert status.heartbeat_timeout_ms == int(HEARTBEAT_TIMEOUT * 1000)
    [replica] = status.replicas
    assert (replica.replica_id, replica.in_quorum, replica.step) == ("a", True, 3)
    assert not replica.connected  # a plain client keeps no heartbeat stream
    assert 0 <= replica.heartbeat_age_ms < 5000
    assert status.uptime_ms >= 0


def test_the_status_page_json_and_metrics_are_served_on_the_same_port(lighthouse):
    phalanx.LighthouseClient(lighthouse.address).quorum("a", timeout=5.0)

    code, page = http_get(lighthouse.status_url)
    assert code == 200
    assert "<title>phalanx lighthouse</title>" in page

    code, body = http_get(f"http://{lighthouse.address}/status")
    assert code == 200
    status = json.loads(body)
    assert status["quorum_id"] == 1
    assert status["quorum_members"] == ["a"]
    assert status["replicas"][0]["replica_id"] == "a"

    code, metrics = http_get(f"http://{lighthouse.address}/metrics")
    assert code == 200
    assert "phalanx_lighthouse_quorum_id 1\n" in metrics
    assert "phalanx_lighthouse_quorums_issued_total 1\n" in metrics

    code, body = http_get(f"http://{lighthouse.address}/no-such-page")
    assert code == 404
    assert "/status" in body


#: What Prometheus asks for: OpenMetrics first, the older text format as a fallback.
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def test_metrics_come_in_the_format_the_scraper_asks_for_and_both_parse(lighthouse):
    with phalanx.ManagerServer("g", lighthouse.address, heartbeat_interval=0.05) as server:
        client = phalanx.ManagerClient(server.address)
        client.quorum(
            phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0, state_refused={"token": 2})
        )
        metrics = f"http://{lighthouse.address}/metrics"
        refused = 'group_refused_requests_total{replica_id="g",reason="token"} 2'
        wait_until(lambda: refused in http_get(metrics)[1], 5.0, "a group's refusals")

        _, openmetrics = http_get(metrics, accept=PROMETHEUS_ACCEPT)
        _, text = http_get(metrics)

    assert openmetrics.endswith("# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(openmetrics)}
    assert families["phalanx_lighthouse_heartbeats"].type == "counter"
    assert families["phalanx_lighthouse_group_refused_requests"].samples[0].value == 2
    assert "# TYPE phalanx_lighthouse_heartbeats_total counter" in text
    assert "# EOF" not in text

    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("PHALANX_CI"), "CI installs promtool (Debian's prometheus)"
        pytest.skip("promtool is not installed (Debian: apt install prometheus)")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_groups_commits_failures_and_heal_bytes_are_counted_at_the_lighthouse(lighthouse):
    metrics = f"http://{lighthouse.address}/metrics"
    sample = 'phalanx_lighthouse_group_{}{{replica_id="g"}} {}\n'.format
    with phalanx.ManagerServer("g", lighthouse.address, heartbeat_interval=0.05) as server:
        client = phalanx.ManagerClient(server.address)
        q = client.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0))
        assert client.should_commit(0, 0, True, timeout=5.0, quorum_id=q.quorum_id).commit
        q = client.quorum(
            phalanx.QuorumRequest(group_rank=0, step=1, timeout=5.0, healed_bytes=4096)
        )
        assert not client.should_commit(0, 1, False, timeout=5.0, quorum_id=q.quorum_id).commit
        wait_until(
            lambda: sample("steps_failed_total", 1) in http_get(metrics)[1], 5.0, "the failure"
        )
        text = http_get(metrics)[1]
        status = json.loads(http_get(f"http://{lighthouse.address}/status")[1])

    assert sample("steps_committed_total", 1) in text
    assert sample("healed_bytes_total", 4096) in text
    assert sample("heals_total", 0) in text
    assert re.search(r'group_last_commit_age_seconds\{replica_id="g"\} \d', text)
    assert re.search(r"\nphalanx_lighthouse_last_commit_age_seconds \d", text)
    (g,) = status["replicas"]
    assert (g["steps_committed"], g["steps_failed"], g["healed_bytes"]) == (1, 1, 4096)


def test_a_waiting_request_ends_promptly_when_the_lighthouse_shuts_down():
    lighthouse = phalanx.LighthouseServer(min_replicas=2, join_timeout=JOIN_TIMEOUT)
    client = phalanx.LighthouseClient(lighthouse.address)
    waiting = ask_in_background(client, "a", timeout=10.0)
    wait_until(lambda: client.status(timeout=1.0).waiting_for, 2.0, "the request waiting")

    started = time.monotonic()
    lighthouse.shutdown()
    waiting.join(timeout=5.0)

    assert not waiting.is_alive()
    assert time.monotonic() - started < 3.0
    assert [type(e) for e in waiting.errors] == [ConnectionError], waiting.errors
    lighthouse.shutdown()  # idempotent


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1", "127.0.0.1:0", "h:1,h:70000"])
def test_an_address_without_a_usable_port_is_refused_at_once(address):
    with pytest.raises(ValueError, match="names no port, or one out of range"):
        phalanx.LighthouseClient(address)


def test_an_unreachable_lighthouse_is_a_connection_error_within_the_deadline():
    with phalanx.LighthouseServer() as lighthouse:
        address = lighthouse.address
    client = phalanx.LighthouseClient(address, connect_timeout=0.5)
    started = time.monotonic()

    with pytest.raises(ConnectionError, match=f"cannot reach lighthouse at {address}"):
        client.quorum("a", timeout=1.0)

    assert time.monotonic() - started < 3.0


def test_bad_server_settings_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="join_timeout"):
        phalanx.LighthouseServer(join_timeout=0)
    with pytest.raises(ValueError, match="min-replicas"):
        phalanx.LighthouseServer(min_replicas=0)
    with pytest.raises(ValueError, match="heartbeat-timeout"):
        phalanx.LighthouseServer(heartbeat_timeout=0.001)
    for groups in (0, -1, 1_000_001):
        with pytest.raises(ValueError, match="max_groups must be 1 to 1000000"):
            phalanx.LighthouseServer(max_groups=groups)
    with phalanx.LighthouseServer() as taken, pytest.raises(ConnectionError, match="cannot listen"):
        phalanx.LighthouseServer(bind=taken.address)


@pytest.mark.slow
def test_a_lighthouse_carries_more_groups_than_it_once_admitted_connections():
    """4,500 groups, each on a connection of its own (as groups connect), above the
    4,096 connections a lighthouse admitted whatever it was to serve: every one live.
    The load's streams and the lighthouse share this process's descriptors; both
    raise the limit for what they hold."""
    from phalanx._core import _testing

    groups = 4_500
    with phalanx.LighthouseServer(heartbeat_timeout=10.0, max_groups=5_000) as lighthouse:
        seen: list[float] = []

        def live() -> bool:
            _, text = http_get(f"http://{lighthouse.address}/metrics")
            (value,) = re.findall(r"^phalanx_lighthouse_live_replicas (\S+)$", text, re.M)
            seen.append(float(value))
            return seen[-1] == groups

        with ThreadPoolExecutor(1) as load:
            beating = load.submit(
                _testing.bench_heartbeats, lighthouse.address, groups, 1.0, 20.0, connections=groups
            )
            wait_until(live, 60.0, f"{groups} groups live")
        assert beating.result(timeout=60) > 0
