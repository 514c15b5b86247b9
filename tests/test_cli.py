"""The `phalanx` command, run as a user runs it: `python -m phalanx ...` in a process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import phalanx

from conftest import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, child_env, cpu_seconds, http_get


def phalanx_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Runs `python -m phalanx ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_the_commands():
    done = phalanx_cli("--help")
    assert done.returncode == 0
    assert "lighthouse" in done.stdout


def test_lighthouse_help_lists_every_option():
    done = phalanx_cli("lighthouse", "--help")
    assert done.returncode == 0
    for option in ("--bind", "--min-replicas", "--join-timeout", "--heartbeat-timeout", "--token"):
        assert option in done.stdout


def test_version():
    done = phalanx_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"phalanx {phalanx.__version__}"


def test_no_command_is_a_usage_error():
    done = phalanx_cli()
    assert done.returncode == 2
    assert "COMMAND" in done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--join-timeout", "soon"], "write e.g. 1s, 250ms or 2m"),
        (["--heartbeat-timeout=-1s"], "it must be 0 or more"),
        (["--min-replicas", "many"], "--min-replicas"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_a_bad_flag_exits_non_zero_with_a_helpful_message(args, expected):
    done = phalanx_cli("lighthouse", "--bind", "127.0.0.1:0", *args)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--min-replicas", "0"], "--min-replicas must be at least 1"),
        (["--join-timeout", "0s"], "--join-timeout must be positive"),
    ],
)
def test_a_setting_out_of_range_exits_non_zero_without_a_traceback(args, expected):
    done = phalanx_cli("lighthouse", "--bind", "127.0.0.1:0", *args)
    assert done.returncode != 0
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_a_port_in_use_exits_non_zero_without_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = phalanx_cli("lighthouse", "--bind", f"127.0.0.1:{port}")
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_lighthouse_prints_its_address_serves_and_stops_cleanly_on_sigterm(
    start_lighthouse_cli,
):
    lighthouse, address = start_lighthouse_cli("127.0.0.1:0")
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    assert f"status page: http://{address}/" in lighthouse.lines[0]["text"]

    client = phalanx.LighthouseClient(address)
    assert client.quorum("a", timeout=5.0).quorum_id == 1
    status = client.status(timeout=2.0)
    assert status.join_timeout_ms == int(JOIN_TIMEOUT * 1000)
    assert status.heartbeat_timeout_ms == int(HEARTBEAT_TIMEOUT * 1000)
    assert http_get(f"http://{address}/")[0] == 200

    stopped_at = time.monotonic()
    lighthouse.signal(signal.SIGTERM)
    assert lighthouse.wait(timeout=5.0) == 0
    assert time.monotonic() - stopped_at < 2.0
    assert "Traceback" not in "\n".join(lighthouse.stderr)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_right_after_the_listening_line_stops_the_lighthouse_cleanly(
    start_lighthouse_cli, signum
):
    # A supervisor may signal as soon as it has read the line: the lighthouse must
    # already be listening for it then.
    lighthouse, _ = start_lighthouse_cli("127.0.0.1:0")
    lighthouse.signal(signum)

    assert lighthouse.wait(timeout=5.0) == 0
    lighthouse.expect(lambda line: "shutting down" in line.get("text", ""), 2.0, "goodbye")
    assert "Traceback" not in "\n".join(lighthouse.stderr)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_idle_lighthouse_sleeps(start_lighthouse_cli):
    # Event-driven: with nothing to do, no polling and no spinning.
    lighthouse, _ = start_lighthouse_cli("127.0.0.1:0")
    before = cpu_seconds(lighthouse.pid)
    time.sleep(1.0)
    assert cpu_seconds(lighthouse.pid) - before < 0.2


def test_the_token_can_come_from_the_environment(start_lighthouse_cli):
    _, address = start_lighthouse_cli("127.0.0.1:0", env={"PHALANX_TOKEN": "from-env"})

    with pytest.raises(PermissionError):
        phalanx.LighthouseClient(address).status(timeout=2.0)
    assert phalanx.LighthouseClient(address, token="from-env").status(timeout=2.0).quorum_id == 0
    assert http_get(f"http://{address}/status")[0] == 401
