"""The `phalanx` command, run as a user runs it: `python -m phalanx ...` in a process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import phalanx
from phalanx.token import resolve_token

from conftest import (
    HEARTBEAT_TIMEOUT,
    JOIN_TIMEOUT,
    child_env,
    cpu_seconds,
    http_get,
    write_token_file,
)


def phalanx_cli(
    *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs `python -m phalanx ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**child_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_the_commands():
    done = phalanx_cli("--help")
    assert done.returncode == 0
    assert "lighthouse" in done.stdout


def test_lighthouse_help_lists_every_option():
    done = phalanx_cli("lighthouse", "--help")
    assert done.returncode == 0
    for option in (
        "--bind",
        "--min-replicas",
        "--join-timeout",
        "--heartbeat-timeout",
        "--token",
        "--token-file",
        "--insecure",
        # torchft_lighthouse's spellings, under a heading of their own
        "torchft_lighthouse's flags",
        "--min_replicas",
        "--join_timeout_ms",
        "--heartbeat_timeout_ms",
        "--quorum_tick_ms",
    ):
        assert option in done.stdout


def test_the_wheel_installs_the_lighthouse_as_its_own_command():
    command = Path(sys.executable).with_name("phalanx-lighthouse")
    assert command.exists(), "pip install puts phalanx-lighthouse beside python"
    done = subprocess.run(
        [str(command), "--version"], capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("phalanx-lighthouse ")


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


def test_the_lighthouse_takes_torchft_lighthouses_flags_in_its_units(spawn):
    # A torchft job's command line, its program renamed: the settings are milliseconds.
    lighthouse = spawn(
        "lighthouse(torchft flags)",
        [
            sys.executable,
            "-m",
            "phalanx",
            "lighthouse",
            "--bind",
            "127.0.0.1:0",
            "--min_replicas",
            "2",
            "--join_timeout_ms",
            "250",
            "--heartbeat_timeout_ms",
            "1500",
            "--quorum_tick_ms",
            "100",
        ],
    )
    line = lighthouse.expect(lambda line: "listening on" in line.get("text", ""), 10.0, "address")
    address = line["text"].split("listening on ", 1)[1].split(";", 1)[0]

    status = phalanx.LighthouseClient(address).status(timeout=2.0)
    assert (status.min_replicas, status.join_timeout_ms, status.heartbeat_timeout_ms) == (
        2,
        250,
        1500,
    )
    code, body = http_get(f"http://{address}/status")
    assert code == 200
    shown = json.loads(body)
    assert (shown["min_replicas"], shown["join_timeout_ms"], shown["heartbeat_timeout_ms"]) == (
        2,
        250,
        1500,
    )
    # min_replicas 2 took: one group alone gets no quorum.
    with pytest.raises(TimeoutError):
        phalanx.LighthouseClient(address).quorum("a", timeout=0.5)

    lighthouse.signal(signal.SIGTERM)
    assert lighthouse.wait(timeout=5.0) == 0
    notes = [line for line in lighthouse.stderr if "--quorum_tick_ms" in line]
    assert notes == [
        "phalanx lighthouse: --quorum_tick_ms 100 is not needed and is ignored: phalanx has no "
        "quorum tick; it decides a quorum on every event (a join, a heartbeat, a deadline)"
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--min-replicas", "3", "--min_replicas", "2"],
            "--min-replicas 3 and --min_replicas 2 (torchft_lighthouse's spelling of the same "
            "setting) disagree; give one of them",
        ),
        (
            ["--join_timeout_ms", "250", "--join-timeout", "1s"],
            "--join-timeout 1s and --join_timeout_ms 250",
        ),
        (["--lighthouse_config", "lh.json"], "--lighthouse_config lh.json: phalanx's lighthouse"),
        (["--expected_replicas", "1,2"], "drop the flag and start as many groups"),
        (["--join_timeout_ms", "1s"], "--join_timeout_ms"),
    ],
)
def test_a_torchft_flag_given_wrong_or_unsupported_is_a_usage_error(args, expected):
    done = phalanx_cli("lighthouse", "--bind", "127.0.0.1:0", *args)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_the_token_can_come_from_the_environment(start_lighthouse_cli):
    _, address = start_lighthouse_cli("127.0.0.1:0", env={"PHALANX_TOKEN": "from-env"})

    with pytest.raises(PermissionError):
        phalanx.LighthouseClient(address).status(timeout=2.0)
    assert phalanx.LighthouseClient(address, token="from-env").status(timeout=2.0).quorum_id == 0
    assert http_get(f"http://{address}/status")[0] == 401


def test_a_lighthouse_other_hosts_can_reach_refuses_to_start_without_a_token():
    done = phalanx_cli("lighthouse", "--bind", "0.0.0.0:0")

    assert done.returncode != 0
    assert "refusing to serve the lighthouse on 0.0.0.0:0 without a job token" in done.stderr
    for fix in ("--token-file FILE", "--bind 127.0.0.1:0", "--insecure"):
        assert fix in done.stderr
    assert "Traceback" not in done.stderr


def test_an_insecure_lighthouse_serves_every_interface_without_a_token(start_lighthouse_cli):
    _, address = start_lighthouse_cli("0.0.0.0:0", "--insecure")

    port = address.rsplit(":", 1)[1]
    assert phalanx.LighthouseClient(f"127.0.0.1:{port}").status(timeout=2.0).quorum_id == 0


def test_a_lighthouse_with_a_token_file_serves_every_interface(start_lighthouse_cli, tmp_path):
    token = "from-a-file"
    path = write_token_file(tmp_path / "job.token", token + "\n")
    _, address = start_lighthouse_cli("0.0.0.0:0", env={"PHALANX_TOKEN_FILE": str(path)})

    local = f"127.0.0.1:{address.rsplit(':', 1)[1]}"
    with pytest.raises(PermissionError):
        phalanx.LighthouseClient(local).status(timeout=2.0)
    assert phalanx.LighthouseClient(local, token=token).status(timeout=2.0).quorum_id == 0


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("s3cret\n", 0o644, "has mode 0644"),
        ("s3cret\n", 0o640, "has mode 0640"),
        ("", 0o600, "is empty"),
        ("s3\x07cret\n", 0o600, "not printable ASCII"),
    ],
)
def test_the_lighthouse_refuses_a_token_file_it_should_not_trust(tmp_path, text, mode, expected):
    path = write_token_file(tmp_path / "job.token", text, mode)

    done = phalanx_cli("lighthouse", "--bind", "127.0.0.1:0", "--token-file", str(path))

    assert done.returncode != 0
    assert expected in done.stderr and str(path) in done.stderr
    if mode != 0o600:
        assert f"chmod 600 {path}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_token_and_a_token_file_together_are_refused(tmp_path):
    path = write_token_file(tmp_path / "job.token", "s3cret")

    done = phalanx_cli(
        "lighthouse", "--bind", "127.0.0.1:0", "--token", "t", "--token-file", str(path)
    )

    assert done.returncode != 0
    assert "both --token and --token-file are given" in done.stderr


def test_phalanx_token_writes_a_private_token_file_and_keeps_an_existing_one(tmp_path):
    path = tmp_path / "new-folder" / "job.token"

    done = phalanx_cli("token", str(path))

    assert done.returncode == 0, done.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text().strip()
    assert len(token) >= 43
    assert token not in done.stdout + done.stderr
    assert resolve_token(None, path, {}) == token
    assert [p.name for p in path.parent.iterdir()] == ["job.token"], "no temporary file left"

    again = phalanx_cli("token", str(path))
    assert again.returncode == 1
    assert "already exists; pass --force" in again.stderr
    assert path.read_text().strip() == token

    forced = phalanx_cli("token", str(path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert path.read_text().strip() != token
    assert path.stat().st_mode & 0o777 == 0o600
