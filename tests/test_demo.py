"""`phalanx demo`: the real job, with real kills, and the numbers of its report."""

from __future__ import annotations

import json

import pytest

from phalanx.demo.job import EXIT_DIVERGED, EXIT_THIN, exit_status
from phalanx.demo.report import analyze, chart, plot

from conftest import run_demo, small_tmpfs, write_token_file

REPORT_FIELDS = {
    "wall_s",
    "startup_s",
    "training_s",
    "shutdown_s",
    "job_steps",
    "group_steps_attempted",
    "group_steps_committed",
    "step_efficiency",
    "time_efficiency",
    "group_steps_contributed",
    "contributing_share",
    "participants_per_step",
    "thin_steps",
    "failures_injected",
    "recoveries",
    "recovery_seconds",
    "initial_loss",
    "final_loss",
    "replicas_consistent",
    "rollbacks",
    "job_progress",
    "failures",
    "max_survivor_stall_s",
    "survivor_stall_s_median",
    "healthy_step_s",
    "healthy_step_s_p99",
    "healthy_step_s_max",
}
STEP_FIELDS = {
    "replica",
    "step",
    "quorum_id",
    "lineage",
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
    # Its batches come from the step number alone: a restarted group's first wait on
    # the quorum, and its heal, are inside its backward (the model has 2 buckets).
    done = run_demo(
        out,
        *("--duration", "30", "--kill-every", "10", "--batch-from", "step"),
        *("--token-file", str(token_file)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in (out / "ranks.log").read_text()
    # The folder's files may be read by others: the token is in none of them.
    assert [f.name for f in out.iterdir() if token.encode() in f.read_bytes()] == []
    assert "status page http://" in (out / "ranks.log").read_text()

    report = json.loads((out / "report.json").read_text())
    assert report.keys() >= REPORT_FIELDS
    assert report["group_steps_committed"] >= report["job_steps"] > 0
    # --duration is the training time; start-up and shutdown are on top of it.
    assert report["training_s"] == pytest.approx(30, abs=1)
    assert report["wall_s"] == pytest.approx(
        report["startup_s"] + report["training_s"] + report["shutdown_s"], abs=0.05
    )
    assert all(f["replica"].startswith("group") for f in report["failures"])
    assert report["failures_injected"] >= 1
    assert report["recoveries"] >= 1, (out / "ranks.log").read_text()[-3000:]
    # Every group killed early enough to be back before the end came back.
    early = [f for f in report["failures"] if f["at_s"] < report["training_s"] - 5]
    assert early and all(f["recovery_s"] is not None for f in early), report["failures"]
    assert report["config"]["batch_from"] == "step"
    assert report["final_loss"] < report["initial_loss"]
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    assert report["consistency_checked_steps"] > 0
    # One group killed at a time never takes the job's newest state with it.
    assert report["rollbacks"] == [], report["rollbacks"]
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(steps) >= report["group_steps_attempted"]
    assert all(s.keys() >= STEP_FIELDS for s in steps)
    assert "replicas bit-identical" in done.stdout
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert {"start", "kill", "stop"} <= {e["kind"] for e in events}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_seed_regime_times_healthy_steps_then_kills_every_few_of_them(tmp_path):
    out = tmp_path / "seed"
    flags = ("--seed-regime", "5", "--replicas", "3", "--steps", "15", "--duration", "150s")
    done = run_demo(out, *flags, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    paced = report["config"]["seed_regime"]
    assert paced["healthy_step_s"] > 0
    assert paced["kill_every_s"] == pytest.approx(5 * paced["healthy_step_s"])
    assert report["failures_injected"] >= 1
    # The report is of the steps under failures: the timed healthy ones are not in it,
    # and the run ended once --steps of them were committed after the first failure.
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    first = min(f["at_s"] for f in report["failures"])
    assert first >= 0 and report["job_steps"] >= 15
    assert report["group_steps_attempted"] < sum(s["rank"] == 0 for s in steps)
    assert max(s["step"] for s in steps if s["committed"]) >= paced["from_step"] + 15
    assert report["training_s"] < 150, "it ran to --duration"
    assert report["replicas_consistent"] is True and report["split_steps"] == []


def test_the_seed_regime_paces_its_own_kills(tmp_path):
    for flags, why in (
        (["--seed-regime", "1.4", "--kill-every", "5"], "leave --kill-every out"),
        (["--seed-regime", "0"], "healthy steps between failures"),
        (["--steps", "0"], "at least 1"),
    ):
        done = run_demo(tmp_path / "out", *flags, timeout=120)
        assert done.returncode == 2 and why in done.stderr, done.stderr


@pytest.mark.slow
def test_the_demo_trains_through_kills_of_its_serving_lighthouse(tmp_path):
    out = tmp_path / "demo"
    done = run_demo(
        out,
        "--duration",
        "30",
        "--kill-every",
        "0",
        "--lighthouses",
        "3",
        "--kill-lighthouse-every",
        "10s",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("stopped the serving lighthouse") >= 2, done.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["lighthouses"] == 3
    assert report["replicas_consistent"] is True and report["split_steps"] == []
    # The groups rode through the failovers: none was restarted.
    assert report["recoveries"] == 0, (out / "ranks.log").read_text()[-3000:]
    ends = sorted(s["t_end"] for s in steps_of(out) if s["committed"])
    assert ends and ends[-1] > ends[0] + 25, "no step committed after the lighthouse kills"


def steps_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_the_demo_refuses_a_token_file_others_can_read(tmp_path):
    token_file = write_token_file(tmp_path / "job.token", "s3cret", mode=0o644)

    done = run_demo(tmp_path / "demo", "--token-file", str(token_file), timeout=60)

    assert done.returncode == 2
    assert f"chmod 600 {token_file}" in done.stderr
    assert not (tmp_path / "demo").exists(), "refused before anything started"


def record(
    replica,
    pid,
    step,
    t,
    committed=True,
    fingerprint=None,
    participants=2,
    quorum_id=1,
    seconds=0.1,
    rank=0,
):
    return {
        "replica": replica,
        "rank": rank,
        "pid": pid,
        "step": step,
        "quorum_id": quorum_id,
        "committed": committed,
        "t_start": t,
        "t_end": t + seconds,
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

    report = analyze(steps, [], replicas=3, started=0.0, stopped=3.0)
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
    report = analyze(steps, [], replicas=2, started=0.0, stopped=1.0)
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
    report = analyze(steps, events, replicas=2, started=0.0, stopped=10.0)
    assert report["recovery_seconds"] == [pytest.approx(1.6)]
    assert report["failures_injected"] == 1
    assert report["group_steps_attempted"] == 12 and report["group_steps_committed"] == 11


def test_steps_begun_after_the_end_do_not_count():
    steps = [record("a", 1, 0, 0.0), record("a", 1, 1, 5.0, committed=False)]
    report = analyze(steps, [], replicas=1, started=0.0, stopped=4.0)
    assert report["group_steps_attempted"] == 1 and report["step_efficiency"] == 1.0


def lockstep(groups, steps, t, participants=None, seconds=0.1):
    """`groups` ({replica: pid}) committing `steps` together from time `t`, each step
    taking `seconds`: the records, and the time after the last."""
    records = []
    for step in steps:
        n = participants or len(groups)
        records += [
            record(g, pid, step, t, participants=n, seconds=seconds) for g, pid in groups.items()
        ]
        t += seconds
    return records, t


def event(t, kind, replica, pid, restart=False):
    return {"t": t, "kind": kind, "replica": replica, "restart": restart, "pids": [pid]}


def a_kill_then_a_slow_step():
    """Three groups; c is killed at 5.05 s (the survivors' step in flight fails, they
    commit again at 5.7 s), restarts at 5.8 s and is back at 6.0 s; at 10.6 s, with
    every group in, one step takes 1.7 s (a slow all-reduce, say)."""
    abc, survivors = {"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2}
    steps, t = lockstep(abc, range(50), 0.0)
    steps += [record(g, pid, 50, 5.0, committed=False) for g, pid in survivors.items()]
    more, t = lockstep(survivors, range(50, 53), 5.6)
    steps += more
    abc["c"] = 4
    more, t = lockstep(abc, range(53, 100), t)
    steps += more
    more, t = lockstep(abc, [100], t, seconds=1.7)
    steps += more
    more, t = lockstep(abc, range(101, 120), t)
    steps += more
    events = [event(-1.0, "start", g, pid) for g, pid in {"a": 1, "b": 2, "c": 3}.items()]
    events += [event(5.05, "kill", "c", 3), event(5.3, "exit", "c", 3)]
    events += [event(5.8, "start", "c", 4, restart=True)]
    events += [event(t, "stop", g, pid) for g, pid in abc.items()]
    return steps, events, t


def test_a_survivors_stall_is_measured_around_the_failure_and_a_slow_step_apart():
    steps, events, stopped = a_kill_then_a_slow_step()
    report = analyze(steps, events, replicas=3, started=-2.0, stopped=stopped)

    (kill,) = report["failures"]
    assert (kill["kind"], kill["replica"]) == ("kill", "c")
    assert kill["at_s"] == pytest.approx(4.95)  # from the first committed step, at 0.1 s
    assert kill["survivor_stall_s"] == pytest.approx(0.7)  # last commit 5.0 s, next 5.7 s
    assert kill["back_after_s"] == pytest.approx(0.95)
    assert kill["recovery_s"] == pytest.approx(0.2) == report["recovery_seconds"][0]
    assert report["max_survivor_stall_s"] == pytest.approx(0.7)
    # The slow step came with every group in, long after c was back: an ordinary step.
    assert report["healthy_step_s"] == pytest.approx(0.1)
    assert report["healthy_step_s_p99"] == pytest.approx(0.1)
    assert report["healthy_step_s_max"] == pytest.approx(1.7)
    assert report["slowest_healthy_step"]["step"] == 100
    assert report["slowest_healthy_step"]["at_s"] == pytest.approx(10.5)
    assert report["slowest_healthy_step"]["seconds"] == pytest.approx(1.7)
    # Steps with c out, and the one that took it back, are the failure's, not ordinary.
    assert report["healthy_steps"] == 3 * (50 + 66)  # steps 0-49 and 54-119


def test_a_group_hung_when_another_is_killed_is_no_survivor():
    # b hangs at 1.05 s and commits again at 3.7 s; c is killed at 1.95 s, restarts at
    # 2.1 s and commits again at 2.5 s; a waits 0.4 s at each failure.
    steps, _ = lockstep({"a": 1, "b": 2, "c": 3}, range(10), 0.0)
    steps += [record(g, pid, 10, 1.0, committed=False) for g, pid in (("a", 1), ("c", 3))]
    more, _ = lockstep({"a": 1, "c": 3}, range(10, 16), 1.3)
    steps += more + [record("a", 1, 16, 1.9, committed=False)]
    more, t = lockstep({"a": 1}, range(16, 18), 2.2)
    steps += more
    more, t = lockstep({"a": 1, "c": 4}, range(18, 30), t)
    steps += more
    more, t = lockstep({"a": 1, "b": 2, "c": 4}, range(30, 40), t)
    steps += more
    events = [event(1.05, "hang", "b", 2), event(1.95, "kill", "c", 3)]
    events += [event(2.1, "start", "c", 4, restart=True)]
    report = analyze(steps, events, replicas=3, started=0.0, stopped=t)

    hang, kill = report["failures"]
    assert (hang["kind"], hang["replica"], kill["kind"], kill["replica"]) == (
        "hang",
        "b",
        "kill",
        "c",
    )
    assert hang["back_after_s"] == pytest.approx(2.65) and hang["recovery_s"] is None
    assert kill["back_after_s"] == pytest.approx(0.55)
    assert kill["recovery_s"] == pytest.approx(0.4)
    assert hang["survivor_stall_s"] == pytest.approx(0.4)
    # b's 2.7 s without a commit is its hang's, not a stall of c's survivors.
    assert kill["survivor_stall_s"] == pytest.approx(0.4)
    assert report["failures_recovered"] == 2 and report["recoveries"] == 1


def test_job_steps_count_steps_group_steps_count_each_groups_commit():
    steps, events, stopped = a_kill_then_a_slow_step()
    report = analyze(steps, events, replicas=3, started=-2.0, stopped=stopped)
    assert report["job_steps"] == 120
    assert report["group_steps_committed"] == 3 * 50 + 2 * 3 + 3 * 67
    assert report["group_steps_attempted"] == report["group_steps_committed"] + 2


def leapfrogging_cohorts(groups=30, steps=40, seconds=0.5):
    """A healthy job of `groups` groups split in two cohorts that take turns: each
    step, 2 groups' gradients are averaged and the rest heal in it (the records of
    issue 47 on fb00610)."""
    records = []
    for s in range(steps):
        for k in range(groups):
            r = record(f"g{k:02}", k, s, s * seconds, participants=2, seconds=seconds)
            r["healed"] = k >= 2
            records.append(r)
    return records, steps * seconds


def test_a_healed_group_step_is_recovery_not_work(tmp_path, capsys):
    steps, stopped = leapfrogging_cohorts()
    report = analyze(steps, [], replicas=30, started=-1.0, stopped=stopped)
    assert report["group_steps_committed"] == report["group_steps_attempted"] == 30 * 40
    assert report["group_steps_contributed"] == 2 * 40
    assert report["step_efficiency"] == report["contributing_share"] == round(2 / 30, 4)
    assert report["time_efficiency"] == round(2 / 30, 4)
    assert report["participants_per_step"] == {"min": 2, "median": 2, "max": 2}
    assert report["thin_steps"] == list(range(5, 40))
    assert exit_status(report, 0, tmp_path) == EXIT_THIN
    assert "on 35 of the job's 35 steps after the first 5" in capsys.readouterr().out


def test_every_group_contributing_passes_and_the_start_up_does_not_count(tmp_path, capsys):
    steps, stopped = leapfrogging_cohorts(groups=4, steps=20)
    for r in steps:
        # The groups arrive one by one over the first 4 steps, then all contribute.
        r["healed"] = False
        r["participants"] = min(4, r["step"] + 1)
    report = analyze(steps, [], replicas=4, started=-1.0, stopped=stopped)
    assert report["participants_per_step"] == {"min": 1, "median": 4, "max": 4}
    assert report["thin_steps"] == [] and report["step_efficiency"] == 1.0
    assert exit_status(report, 0, tmp_path) == 0
    assert capsys.readouterr().out == ""


def test_a_group_of_two_ranks_takes_one_group_step_per_step():
    steps = [
        record(g, pid + rank, s, float(s), rank=rank)
        for s in range(5)
        for g, pid in (("a", 10), ("b", 20))
        for rank in (0, 1)
    ]
    report = analyze(steps, [], replicas=2, started=0.0, stopped=5.0)
    assert report["job_steps"] == 5
    assert report["group_steps_committed"] == report["group_steps_attempted"] == 10


def test_the_wall_time_is_start_up_training_and_shutdown():
    steps, events, stopped = a_kill_then_a_slow_step()
    report = analyze(steps, events, replicas=3, started=-6.0, stopped=stopped, exited=stopped + 2)
    assert report["startup_s"] == pytest.approx(6.1)  # to the first commit, at 0.1 s
    assert report["training_s"] == pytest.approx(stopped - 0.1, abs=0.01)
    assert report["shutdown_s"] == pytest.approx(2.0)
    assert report["wall_s"] == pytest.approx(stopped + 8.0, abs=0.01)


def test_the_job_line_shows_a_kill_and_not_the_shutdown():
    steps, events, stopped = a_kill_then_a_slow_step()
    # Stopped at the end: b and c exit after their step, a began step 120 just before
    # the stop and commits it alone once its peers are gone.
    steps.append(record("a", 1, 120, stopped - 0.01, participants=1, seconds=1.0))
    report = analyze(steps, events, replicas=3, started=-2.0, stopped=stopped)
    drawn = chart(steps, report)

    line = drawn["job_line"]
    assert line[0][0] == 0.0, "the time axis starts at the first committed step"
    assert line[-1][1] == 3, "the line ends with the job's last step of training"
    assert len(line) == 120 and report["job_steps"] == 121
    c_out = [t for t, groups in line if groups == 2]
    assert c_out and min(c_out) > 4.95 and max(c_out) < 5.9, "c's absence is on the line"
    ((at, label),) = drawn["failures"]
    assert at == pytest.approx(4.95)
    assert label.splitlines() == ["c killed at 5.0 s", "back in 0.95 s", "restart → commit 0.20 s"]


def test_the_chart_is_a_png(tmp_path):
    steps, events, stopped = a_kill_then_a_slow_step()
    report = analyze(steps, events, replicas=3, started=-2.0, stopped=stopped)
    plot(chart(steps, report), str(tmp_path / "report.png"))
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_that_never_committed_has_a_report_and_a_chart(tmp_path):
    report = analyze([], [], replicas=3, started=0.0, stopped=180.0, exited=181.0)
    assert (report["job_steps"], report["group_steps_committed"], report["failures"]) == (0, 0, [])
    assert (report["startup_s"], report["training_s"], report["shutdown_s"]) == (180.0, 0.0, 1.0)
    plot(chart([], report), str(tmp_path / "report.png"))  # warnings fail the test
    assert (tmp_path / "report.png").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 24 kB file system: the demo's logs fill it within seconds."""
    with small_tmpfs(tmp_path / "tiny", "24k") as mount:
        yield mount


@pytest.mark.slow
def test_a_full_disk_costs_the_demo_its_files_not_its_training(tiny_disk):
    done = run_demo(tiny_disk, "--duration", "20", "--kill-every", "0", "--replicas", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # Each file that did not fit is reported once; the summary still reaches the terminal.
    warnings = [line for line in out.splitlines() if "warning: cannot write" in line]
    assert warnings, out[-3000:]
    assert len(warnings) == len({w.split("cannot write ")[1].split(" ")[0] for w in warnings})
    assert "committed" in out and "bit-identical" in out, out[-3000:]
    # A file given up ends on a whole record, or is gone: none is empty or half written.
    left = {f.name: f.read_bytes() for f in tiny_disk.iterdir()}
    assert all(left.values()), f"empty files left: {[k for k, v in left.items() if not v]}"
    for name in ("steps.jsonl", "events.jsonl", "ranks.log"):
        assert left.get(name, b"\n").endswith(b"\n"), (name, left[name][-200:])
    for name in ("steps.jsonl", "events.jsonl"):
        for line in left.get(name, b"").splitlines():
            json.loads(line)
    if "report.json" in left:
        json.loads(left["report.json"])
    if "report.png" in left:
        assert left["report.png"].startswith(b"\x89PNG")
    lost = [name for name in DEMO_FILES if name not in left]
    assert not lost or f"not written: {', '.join(lost)}" in out, out[-3000:]


DEMO_FILES = ["report.json", "report.png", "steps.jsonl", "events.jsonl", "ranks.log"]
