"""`phalanx demo --snapshot-every N --kill-all-every T`: the loss of every group at
once, the resume from a snapshot, and what the report says it cost; the demo's own
files on a full disk."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from phalanx.demo.job import EXIT_DIVERGED, LogFile, exit_status, save
from phalanx.demo.report import JOB_LOSS, analyze, interval_verdict, split_verdict
from phalanx.launcher.chaos import Chaos, Injector
from phalanx.launcher.group import Group
from phalanx.launcher.observer import LaunchObserver

from conftest import run_demo, small_tmpfs

#: A model that trains in milliseconds a step: many snapshots, many steps lost to count.
TINY_MODEL = ["--", "--dim", "32", "--layers", "1", "--seq-len", "32", "--batch-size", "4"]


@pytest.mark.slow
def test_the_demo_resumes_from_a_snapshot_after_every_group_is_killed(tmp_path):
    out, every = tmp_path / "demo", 20
    done = run_demo(
        out,
        *("--duration", "22", "--replicas", "2", "--kill-every", "0"),
        *("--snapshot-every", str(every), "--kill-all-every", "8s"),
        *TINY_MODEL,
    )
    ranks_log = (out / "ranks.log").read_text() if (out / "ranks.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + ranks_log[-3000:]
    report = json.loads((out / "report.json").read_text())

    # Losses at 8 s and 16 s of training (none in the last 4 s).
    assert report["job_losses_injected"] == report["job_losses_recovered"] == 2, report
    # ROLLBACK when the lighthouse knew of newer steps; RESUMED when it knew of none.
    rollbacks = re.findall(
        r"(?:ROLLBACK|RESUMED): .* goes on from step (\d+),? (?:a state read from storage, )?"
        r"as lineage (\d+)",
        ranks_log,
    )
    resumed = {int(s) for s in re.findall(r"resumed from snapshot \S+: step (\d+)", ranks_log)}
    for loss in report["job_losses"]:
        assert loss["groups_killed"] == ["group0", "group1"]
        # From a snapshot, not from step 0, and the one the ranks say they loaded.
        assert loss["from_snapshot"] and loss["resumed_from_step"] > 0, loss
        assert loss["resumed_from_step"] % every == 0 and loss["resumed_from_step"] in resumed
        assert loss["resume_s"] > 0 and loss["back_after_s"] > 0
        # The redone steps are of the new lineage the lighthouse started.
        assert (str(loss["resumed_from_step"]), str(loss["lineage"])) in rollbacks, ranks_log
        assert loss["lineage"] != loss["newest_lineage"]
        if loss["steps_lost"] == 0:
            # Lost right after a snapshot of its newest step (steps are slow under load):
            # the job went on from the next one, with nothing to redo.
            assert loss["resumed_from_step"] == loss["newest_step"] + 1, loss
            assert loss["lost_steps"] == loss["redone_steps"] == [], loss
            continue
        first, last = loss["lost_steps"]
        assert (first, last) == (loss["resumed_from_step"], loss["newest_step"])
        assert loss["steps_lost"] == last + 1 - first
        assert loss["redone_steps"] == [first, last], "every lost step was committed again"
        # At most one interval, plus the steps of the next snapshot's write if the loss
        # came first (or if it was skipped, the last write still running): steps take
        # milliseconds here and a write about 0.1 s, so that is up to one more interval.
        assert loss["within_interval"] or loss["steps_lost"] <= 2 * every + 1, loss
    # Every loss is a rollback of the step log; none lost anything the loss did not.
    assert len(report["rollbacks"]) == 2, report["rollbacks"]
    lost = sorted(loss["steps_lost"] for loss in report["job_losses"])
    assert sorted(b["steps_lost"] for b in report["rollbacks"]) == lost
    # Step numbers redone in a new lineage are compared within it: no split.
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    lineages: dict[int, set[int]] = {}
    for r in steps:
        if r["committed"]:
            lineages.setdefault(r["step"], set()).add(r["lineage"])
    redone = {n for n, seen in lineages.items() if len(seen) > 1}
    assert redone == {
        n
        for loss in report["job_losses"]
        if loss["lost_steps"]
        for n in range(loss["lost_steps"][0], loss["lost_steps"][1] + 1)
    }
    assert "whole-job losses / job back" in done.stdout
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert sum(e["kind"] == JOB_LOSS for e in events) == 4
    assert any(out.joinpath("snapshots").glob("step-*.json"))


def test_kill_all_every_without_snapshots_is_refused(tmp_path):
    done = run_demo(tmp_path / "demo", "--kill-all-every", "60s", timeout=60)
    assert done.returncode == 2
    assert "--kill-all-every loses every group's state at once: add --snapshot-every" in (
        done.stderr
    )


class Recorder(LaunchObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.said: list[str] = []

    def say(self, text: str) -> None:
        self.said.append(text)

    def group_event(self, kind: str, group: Group) -> None:
        self.events.append((kind, group.replica_id))


def test_kill_all_kills_every_rank_of_every_group_at_once():
    groups = [Group(f"group{i}", i) for i in range(3)]
    for group in groups:
        group.procs = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            for _ in range(2)
        ]
    groups[1].stopped_until = 99.0  # hung by chaos: killed all the same
    observer = Recorder()
    injector = Injector(Chaos(kill_all_every=10.0), seed=0, observer=observer)
    try:
        injector.inject(0.0, groups)  # starts the clock
        assert observer.events == []
        injector.inject(10.0, groups)
        codes = [p.wait(timeout=10) for g in groups for p in g.procs]
    finally:
        for p in (p for g in groups for p in g.procs):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [-9] * 6
    assert observer.events == [(JOB_LOSS, "group0"), (JOB_LOSS, "group1"), (JOB_LOSS, "group2")]
    assert all(g.chaos_killed and g.stopped_until is None for g in groups)
    assert observer.said == ["chaos: SIGKILL every group at once (group0, group1, group2)"]


def step(replica, pid, number, t, lineage, fingerprint, snapshot_s=0.0, resume_s=0.0):
    return {
        "replica": replica,
        "rank": 0,
        "pid": pid,
        "step": number,
        "lineage": lineage,
        "quorum_id": lineage + 1,
        "committed": True,
        "t_start": t,
        "t_end": t + 0.1,
        "participants": 2,
        "loss": 1.0,
        "fingerprint": fingerprint,
        "snapshot_s": snapshot_s,
        "resume_s": resume_s,
    }


def a_job_loss(every=10, last=27, snapshot_at=None):
    """Groups a and b commit steps 0-`last` in lineage 0 (a snapshot every `every`
    steps, and one at `snapshot_at` that was not published); both are killed at 100 s
    and resume from the snapshot of step 20 as lineage 5, where steps 20-34 are new
    states (other fingerprints)."""
    steps, t = [], 0.0
    for n in range(last + 1):
        snapshot = 0.01 if n and (n % every == 0 or n == snapshot_at) else 0.0
        steps += [step(g, pid, n, t, 0, f"old{n}", snapshot) for g, pid in (("a", 1), ("b", 2))]
        t += 0.2
    t = 101.0
    for n in range(20, 35):
        load = 0.3 if n == 20 else 0.0
        steps += [
            step(g, pid, n, t, 5, f"new{n}", resume_s=load) for g, pid in (("a", 3), ("b", 4))
        ]
        t += 0.2
    events = [
        {"t": 100.0, "kind": JOB_LOSS, "replica": g, "restart": False, "pids": [pid]}
        for g, pid in (("a", 1), ("b", 2))
    ]
    events += [
        {"t": 100.5, "kind": "start", "replica": g, "restart": True, "pids": [pid]}
        for g, pid in (("a", 3), ("b", 4))
    ]
    return steps, events


def test_a_job_loss_is_counted_and_its_redone_steps_are_no_split(tmp_path, capsys):
    steps, events = a_job_loss()
    report = analyze(steps, events, replicas=2, started=-1.0, stopped=110.0, snapshot_every=10)

    (loss,) = report["job_losses"]
    assert loss["at_s"] == pytest.approx(99.9)  # from the first commit, at 0.1 s
    assert (loss["newest_step"], loss["newest_lineage"]) == (27, 0)
    assert (loss["resumed_from_step"], loss["lineage"], loss["from_snapshot"]) == (20, 5, True)
    assert (loss["steps_lost"], loss["lost_steps"], loss["redone_steps"]) == (8, [20, 27], [20, 27])
    assert loss["within_interval"] is True and loss["unpublished_snapshot_step"] is None
    assert loss["back_after_s"] == pytest.approx(1.1) and loss["resume_s"] == pytest.approx(0.3)
    assert report["steps_lost_within_interval"] is True
    assert report["max_steps_lost_at_a_job_loss"] == 8
    # The restarts are the loss's, not recoveries of a failed group.
    assert report["recoveries"] == 0 and report["failures_injected"] == 0
    # Steps 20-27 hold other states in lineage 5 than in lineage 0: no split.
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    assert report["consistency_checked_steps"] == 28 + 15
    assert interval_verdict(report) is None
    assert exit_status(report, 0, tmp_path) == 0
    assert capsys.readouterr().out == ""


def test_a_split_within_the_new_lineage_is_still_a_split(tmp_path, capsys):
    steps, events = a_job_loss()
    odd = next(r for r in steps if (r["step"], r["lineage"], r["replica"]) == (22, 5, "b"))
    odd["fingerprint"] = "ffffffff"
    report = analyze(steps, events, replicas=2, started=-1.0, stopped=110.0, snapshot_every=10)
    assert report["replicas_consistent"] is False and report["split_steps"] == [22]
    assert report["splits"][0]["lineage"] == 5
    assert "step 22 of lineage 5, rank 0: new22 from a (quorum 6); ffffffff from b" in (
        split_verdict(report)
    )
    assert exit_status(report, 0, tmp_path) == EXIT_DIVERGED == 3


def test_a_loss_past_the_interval_is_flagged_with_the_snapshot_it_missed():
    # Interval 5: snapshots of steps 5, 10, 15, 20 and 25; the one of 25 was copied but
    # the job lost before it was published, so it resumed from 20: 8 steps lost.
    steps, events = a_job_loss(every=5)
    report = analyze(steps, events, replicas=2, started=-1.0, stopped=110.0, snapshot_every=5)
    (loss,) = report["job_losses"]
    assert (loss["steps_lost"], loss["within_interval"]) == (8, False)
    assert loss["unpublished_snapshot_step"] == 25
    assert report["steps_lost_within_interval"] is False
    verdict = interval_verdict(report)
    assert verdict.startswith("warning: 1 whole-job loss(es) cost more steps than the snapshot")
    assert "8 steps (20-27); the snapshot of step 25 was copied but not published" in verdict


# -- the demo's files on a full disk -----------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 16 kB file system (tmpfs), unmounted at the end."""
    with small_tmpfs(tmp_path / "small", "16k") as mount:
        yield mount


def test_a_log_given_up_on_a_full_disk_ends_on_its_last_whole_line(small_disk):
    warnings: list[str] = []
    log = LogFile(small_disk / "steps.jsonl", warnings.append)
    lines = 0
    while not warnings:
        log.write(json.dumps({"step": lines, "pad": "x" * (lines % 300)}) + "\n")
        lines += 1
    log.write("more\n")
    log.close()

    (warning,) = warnings
    assert "No space left on device" in warning and "ends on its last whole line" in warning
    text = (small_disk / "steps.jsonl").read_text()
    assert text.endswith("\n")
    kept = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in kept] == list(range(lines - 1)), "every line but the failed one"


def test_a_log_with_no_whole_line_on_a_full_disk_is_removed(small_disk):
    warnings: list[str] = []
    log = LogFile(small_disk / "ranks.log", warnings.append)
    log.write("x" * 100_000 + "\n")
    log.close()
    assert not (small_disk / "ranks.log").exists()
    (warning,) = warnings
    assert "removed: no whole line of it could be kept" in warning


def test_a_report_file_that_does_not_fit_is_not_left_behind(small_disk):
    warnings: list[str] = []
    path = small_disk / "report.json"
    path.write_text("{}\n")  # an older run's
    assert not save(path, lambda p: p.write_text("x" * 100_000), warnings.append)
    assert not path.exists()
    assert warnings == [f"cannot write {path} (No space left on device); skipped"]
