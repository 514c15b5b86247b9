"""Closed by default (I8) and checked input: with a job token set, nothing is served
without it; malformed requests are refused with the field named, and the servers
keep serving afterwards."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

import phalanx

from conftest import HEARTBEAT_INTERVAL, JOIN_TIMEOUT, http_get, wait_until, write_token_file

TOKEN = "s3cret-token"


@pytest.fixture
def locked() -> Iterator[phalanx.LighthouseServer]:
    """A lighthouse that requires the job token."""
    with phalanx.LighthouseServer(join_timeout=JOIN_TIMEOUT, token=TOKEN) as server:
        yield server


def test_lighthouse_calls_without_the_token_are_refused(locked):
    for token in (None, "wrong", TOKEN + "x"):
        client = phalanx.LighthouseClient(locked.address, token=token)
        with pytest.raises(PermissionError, match="missing or wrong job token"):
            client.quorum("a", timeout=1.0)
        with pytest.raises(PermissionError, match="--token or PHALANX_TOKEN"):
            client.status(timeout=1.0)

    client = phalanx.LighthouseClient(locked.address, token=TOKEN)
    assert client.quorum("a", timeout=5.0).participants[0].replica_id == "a"
    assert client.status(timeout=1.0).quorum_members == ["a"]


@pytest.mark.parametrize("path", ["/", "/status", "/metrics"])
def test_http_pages_without_the_token_are_401(locked, path):
    code, body = http_get(f"http://{locked.address}{path}")
    assert code == 401
    assert "Authorization: Bearer <token>" in body

    code, _ = http_get(f"http://{locked.address}{path}", token="wrong")
    assert code == 401


def test_http_pages_with_the_token_are_served(locked):
    phalanx.LighthouseClient(locked.address, token=TOKEN).quorum("a", timeout=5.0)

    code, body = http_get(f"http://{locked.address}/status", token=TOKEN)
    assert code == 200
    assert json.loads(body)["quorum_members"] == ["a"]

    # The status page passes the token on in the query string, as a browser cannot
    # send a header.
    code, body = http_get(f"http://{locked.address}/status?token={TOKEN}")
    assert code == 200
    assert json.loads(body)["quorum_id"] == 1
    code, page = http_get(f"http://{locked.address}/?token={TOKEN}")
    assert code == 200 and "phalanx lighthouse" in page


def test_a_manager_server_with_a_token_refuses_ranks_without_it(locked):
    with phalanx.ManagerServer(
        "g", locked.address, token=TOKEN, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as server:
        intruder = phalanx.ManagerClient(server.address)
        with pytest.raises(PermissionError, match="missing or wrong job token"):
            intruder.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=1.0))
        with pytest.raises(PermissionError):
            intruder.should_commit(0, 0, True, timeout=1.0)
        with pytest.raises(PermissionError):
            intruder.subscribe_events(timeout=1.0)

        rank = phalanx.ManagerClient(server.address, token=TOKEN)
        quorum = rank.quorum(phalanx.QuorumRequest(group_rank=0, step=0, timeout=5.0))
        assert quorum.participants[0].replica_id == "g"
        assert rank.should_commit(0, 0, True, timeout=5.0).commit is True


def test_a_manager_server_without_the_token_cannot_join_a_locked_lighthouse(locked):
    server = phalanx.ManagerServer("g", locked.address, heartbeat_interval=HEARTBEAT_INTERVAL)
    with server, pytest.raises(PermissionError, match="missing or wrong job token"):
        phalanx.ManagerClient(server.address).quorum(
            phalanx.QuorumRequest(group_rank=0, step=0, timeout=2.0)
        )
    status = phalanx.LighthouseClient(locked.address, token=TOKEN).status(timeout=1.0)
    assert status.replicas == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_id": "a b"}, "replica id \"a b\" has ' ' at byte 1"),
        ({"replica_id": ""}, "replica id is empty"),
        ({"replica_id": "x" * 129}, "replica id is 129 bytes long"),
        ({"replica_id": "a", "step": -1}, "step -1 is negative"),
        ({"replica_id": "a", "world_size": 0}, "world size 0 is out of range"),
        ({"replica_id": "a", "world_size": -1}, "world_size must be 0 or more"),
        ({"replica_id": "a", "last_quorum_id": -5}, "last_quorum_id must be 0 or more"),
        ({"replica_id": "a", "manager_address": "a\nb"}, "manager address"),
        ({"replica_id": "a", "store_address": "x" * 300}, "store address is 300 bytes long"),
        ({"replica_id": "a", "state_addresses": ["h:1", "h:2"]}, "2 state addresses"),
        ({"replica_id": "a", "timeout": 0}, "timeout must be a positive number"),
        ({"replica_id": "a", "timeout": float("nan")}, "timeout must be a positive number"),
    ],
)
def test_malformed_quorum_requests_are_refused_naming_the_field(lighthouse, kwargs, message):
    client = phalanx.LighthouseClient(lighthouse.address)
    kwargs = {"timeout": 1.0, **kwargs}

    with pytest.raises(ValueError) as refused:
        client.quorum(**kwargs)

    assert message in str(refused.value)
    # The lighthouse keeps serving, and the bad request left nothing behind.
    assert client.quorum("ok", timeout=5.0).participants[0].replica_id == "ok"
    assert [r.replica_id for r in client.status(timeout=1.0).replicas] == ["ok"]


def test_refused_requests_are_counted_by_reason(lighthouse):
    client = phalanx.LighthouseClient(lighthouse.address)
    with pytest.raises(ValueError):
        client.quorum("a b", timeout=1.0)

    _, metrics = http_get(f"http://{lighthouse.address}/metrics")

    assert 'phalanx_lighthouse_refused_requests_total{reason="invalid"} 1' in metrics


def test_an_address_that_is_not_one_is_a_value_error():
    with pytest.raises(ValueError, match="host:port"):
        phalanx.LighthouseClient("not an address")
    with pytest.raises(ValueError, match="host:port"):
        phalanx.ManagerClient("not an address")


def test_a_groups_refusals_reach_the_lighthouses_metrics(locked):
    with phalanx.ManagerServer(
        "g", locked.address, token=TOKEN, heartbeat_interval=HEARTBEAT_INTERVAL
    ) as server:
        with pytest.raises(PermissionError):
            phalanx.ManagerClient(server.address).quorum(
                phalanx.QuorumRequest(group_rank=0, step=0, timeout=1.0)
            )
        # A rank reports its state server's refusals with its quorum request.
        rank = phalanx.ManagerClient(server.address, token=TOKEN)
        rank.quorum(
            phalanx.QuorumRequest(
                group_rank=0, step=0, timeout=5.0, state_refused={"token": 3, "crowded_out": 2}
            )
        )
        assert server.refused_requests["token"] == 4

        def exported() -> str:
            _, metrics = http_get(f"http://{locked.address}/metrics", token=TOKEN)
            return metrics

        line = 'phalanx_lighthouse_group_refused_requests_total{replica_id="g",reason="%s"} %d'
        wait_until(
            lambda: line % ("token", 4) in exported() and line % ("crowded_out", 2) in exported(),
            5.0,
            "the group's refusals in the lighthouse's metrics",
        )


def test_a_manager_refuses_a_token_file_others_can_read(tmp_path, monkeypatch):
    path = write_token_file(tmp_path / "job.token", "s3cret", mode=0o644)
    monkeypatch.setenv("PHALANX_TOKEN_FILE", str(path))
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)

    with pytest.raises(ValueError, match=f"has mode 0644.*chmod 600 {re.escape(str(path))}"):
        phalanx.Manager(replica_id="a", lighthouse="127.0.0.1:1")
