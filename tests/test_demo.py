"""`phalanx demo`: the real job, with real kills, and the numbers of its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phalanx.demo.job import EXIT_DIVERGED, exit_status
from phalanx.demo.report import analyze

from conftest import TESTS, child_env, write_token_file

REPORT_FIELDS = {
    "steps_attempted",
    "steps_committed",
    "step_efficiency",
    "time_efficiency",
    "failures_injected",
    "recoveries",
    "recovery_seconds",
    "initial_loss",
    "final_loss",
    "replicas_consistent",
    "job_progress",
    "max_survivor_stall_s",
}
STEP_FIELDS = {
    "replica",
    "step",
    "quorum_id",
    "participants",
    "committed",
    "quorum_s",
    "allreduce_s",
    "commit_s",
    "heal_s",
}


@pytest.mark.slow
def test_the_demo_trains_through_kills_and_reports_it(tmp_path):
    out = tmp_path / "demo"
    token = "demo-token-kept-out-of-the-report-folder"
    token_file = write_token_file(tmp_path / "job.token", token)
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--duration", "30", "--kill-every", "10"]
        + ["--out", str(out), "--token-file", str(token_file)],
        capture_output=True,
        text=True,
        timeout=110,
        env=child_env(),
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The folder's files may be read by others: the token is in none of them.
    assert [f.name for f in out.iterdir() if token.encode() in f.read_bytes()] == []
    assert "status page http://" in (out / "ranks.log").read_text()

    report = json.loads((out / "report.json").read_text())
    assert report.keys() >= REPORT_FIELDS
    assert report["steps_committed"] > 0
    assert report["failures_injected"] >= 1
    assert report["recoveries"] >= 1, (out / "ranks.log").read_text()[-3000:]
    assert report["final_loss"] < report["initial_loss"]
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    assert report["consistency_checked_steps"] > 0
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) >= report["steps_attempted"]
    assert all(s.keys() >= STEP_FIELDS for s in steps)
    assert "replicas bit-identical" in done.stdout


def test_the_demo_refuses_a_token_file_others_can_read(tmp_path):
    token_file = write_token_file(tmp_path / "job.token", "s3cret", mode=0o644)

    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--token-file", str(token_file)]
        + ["--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=TESTS.parent,
    )

    assert done.returncode == 2
    assert f"chmod 600 {token_file}" in done.stderr
    assert not (tmp_path / "demo").exists(), "refused before anything started"


def record(replica, pid, step, t, committed=True, fingerprint=None, participants=2, quorum_id=1):
    return {
        "replica": replica,
        "rank": 0,
        "pid": pid,
        "step": step,
        "quorum_id": quorum_id,
        "committed": committed,
        "t_start": t,
        "t_end": t + 0.1,
        "participants": participants,
        "loss": 1.0,
        "fingerprint": fingerprint if committed else None,
    }


def test_a_step_committed_with_two_fingerprints_fails_the_run(tmp_path, capsys):
    # Three groups in quorum 7 agree at steps 0 and 2; at step 1, b committed another state.
    state = {0: "0000000a", 1: "0000000b", 2: "0000000c"}
    steps = [
        record(g, pid, step, float(step), fingerprint=state[step], quorum_id=7)
        for step in range(3)
        for pid, g in enumerate("abc")
    ]
    odd = next(r for r in steps if r["step"] == 1 and r["replica"] == "b")
    odd["fingerprint"] = "ffffffff"

    report = analyze(steps, [], replicas=3, started=0.0, ended=3.0)
    assert report["replicas_consistent"] is False
    assert report["consistency_checked_steps"] == 3
    assert report["split_steps"] == [1]
    (split,) = report["splits"]
    assert (split["step"], split["rank"]) == (1, 0)
    assert {c["replica"]: c["fingerprint"] for c in split["commits"]} == {
        "a": "0000000b",
        "b": "ffffffff",
        "c": "0000000b",
    }

    assert exit_status(report, 0, tmp_path) == EXIT_DIVERGED == 3
    printed = capsys.readouterr().out
    assert "1 step(s) committed with two or more fingerprints, from step 1" in printed
    assert (
        "step 1, rank 0: 0000000b from a (quorum 7), c (quorum 7); ffffffff from b (quorum 7)"
        in printed
    )


def test_replicas_that_agree_pass_the_run(tmp_path, capsys):
    steps = [record(g, pid, 0, 0.0, fingerprint="x") for pid, g in enumerate("ab")]
    report = analyze(steps, [], replicas=2, started=0.0, ended=1.0)
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    assert exit_status(report, 0, tmp_path) == 0
    assert capsys.readouterr().out == ""


def test_recovery_is_timed_from_the_restart_to_the_first_commit():
    steps = [record("a", 1, s, float(s)) for s in range(10)]
    steps += [record("b", 2, 5, 5.5, committed=False), record("b", 2, 6, 6.0)]
    events = [
        {"t": 4.0, "kind": "kill", "replica": "b", "restart": False, "pids": [9]},
        {"t": 4.5, "kind": "start", "replica": "b", "restart": True, "pids": [2]},
    ]
    report = analyze(steps, events, replicas=2, started=0.0, ended=10.0)
    assert report["recovery_seconds"] == [pytest.approx(1.6)]
    assert report["failures_injected"] == 1
    assert report["steps_attempted"] == 12 and report["steps_committed"] == 11


def test_steps_begun_after_the_end_do_not_count():
    steps = [record("a", 1, 0, 0.0), record("a", 1, 1, 5.0, committed=False)]
    report = analyze(steps, [], replicas=1, started=0.0, ended=4.0)
    assert report["steps_attempted"] == 1 and report["step_efficiency"] == 1.0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 24 kB file system: the demo's logs fill it within seconds."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_costs_the_demo_its_files_not_its_training(tiny_disk):
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--duration", "20", "--kill-every", "0"]
        + ["--replicas", "2", "--out", str(tiny_disk)],
        capture_output=True,
        text=True,
        timeout=110,
        env=child_env(),
        cwd=TESTS.parent,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # Each file that did not fit is reported once; the summary still reaches the terminal.
    warnings = [line for line in out.splitlines() if "warning: cannot write" in line]
    assert warnings, out[-3000:]
    assert len(warnings) == len({w.split("cannot write ")[1].split(" ")[0] for w in warnings})
    assert "committed" in out and "bit-identical" in out, out[-3000:]
