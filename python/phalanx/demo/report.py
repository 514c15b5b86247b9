"""What a demo run achieved, computed from its step log and its launcher's events only:
nothing here is assumed, every number is measured.

A *group-step* is one step as one group attempted it (its rank 0's record: the ranks
of a group take every step together); the *job's steps* are the step numbers the
groups committed, each once however many groups committed it. A *life* is one
process of one group (one rank, for groups of several ranks), from its first step to
its last; a group killed and restarted has several lives.

The run's wall time has three parts: `startup_s`, from the launcher's start to the
first committed step; `training_s`, from there until the launcher stopped the groups
(`--duration`, counted from the first committed step like every time in the report);
`shutdown_s`, from the stop until the last process was gone. Only steps begun before
the stop count.

- `job_steps`: the steps the job committed (0 up to the highest committed step).
- `group_steps_committed` / `group_steps_attempted` and `step_efficiency`, their
  ratio (a step counts as attempted once it reached its vote; the step a killed
  process was in never does).
- `time_efficiency`: the share of the lives' wall time (first step start → last step
  end) spent in steps that committed.
- `failures`: each injected failure, when (`at_s`), which group, and what it cost
  (`failures_recovered` of them saw their group commit again before the stop):
  `survivor_stall_s`, the longest gap between two consecutive commits of another
  group from the failure until the failed group committed again (or the stop);
  `back_after_s`, from the failure to that commit; `recovery_s`, for a kill, from
  the restarted process's start to its first committed step (also listed in
  `recovery_seconds`). `max_survivor_stall_s` is the longest stall of them all.
- `healthy_step_s` (p50), `healthy_step_s_p99`, `healthy_step_s_max`: how long a
  committed step took with every group in it and no failure's window around it,
  the ordinary pace and the ordinary slow step (`slowest_healthy_step` says which).
- `job_progress`: the job's steps ÷ the steps it would have made at its healthy
  pace in the time from its first step to the stop.
- `replicas_consistent`: at every step that two or more lives committed, their
  fingerprints of model + optimizer state agree (same rank of each group). The steps
  where they do not are `split_steps`; `splits` says, for the first few, which group
  committed which fingerprint in which quorum.

>>> steps = [
...     {"replica": "a", "rank": 0, "pid": 1, "step": s, "committed": True, "t_start": s,
...      "t_end": s + 1.0, "participants": 2, "loss": 5.0 - s, "fingerprint": str(s)}
...     for s in range(4)
... ] + [
...     {"replica": "b", "rank": 0, "pid": 2, "step": s, "committed": s != 2, "t_start": s,
...      "t_end": s + 1.0, "participants": 2, "loss": 5.0 - s,
...      "fingerprint": str(s) if s != 2 else None}
...     for s in range(4)
... ]
>>> r = analyze(steps, events=[], replicas=2, started=-1.0, stopped=4.0, exited=4.5)
>>> r["job_steps"], r["group_steps_committed"], r["group_steps_attempted"]
(4, 7, 8)
>>> r["startup_s"], r["training_s"], r["shutdown_s"], r["wall_s"]
(2.0, 3.0, 0.5, 5.5)
>>> r["step_efficiency"], r["replicas_consistent"], r["job_progress"]
(0.875, True, 1.0)
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

#: Launcher events that are failures injected on purpose.
FAILURE_KINDS = ("kill", "hang", "hang-thread")

#: Steps averaged for the initial and the final loss.
LOSS_WINDOW = 10

#: Split steps the report describes commit by commit: a divergence usually lasts from
#: the step where it began to the end, so the first few say where and how it began.
SPLITS_SHOWN = 5

#: The width of a failure's label in report.png, as a share of the time axis.
LABEL_WIDTH = 0.14


def _lives(steps: Iterable[dict]) -> dict[tuple[str, int, int], list[dict]]:
    lives: dict[tuple[str, int, int], list[dict]] = defaultdict(list)
    for record in steps:
        lives[(record["replica"], record["rank"], record["pid"])].append(record)
    for records in lives.values():
        records.sort(key=lambda r: r["t_start"])
    return lives


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _splits(steps: list[dict]) -> tuple[int, list[dict]]:
    """How many (lineage, step, rank)s two or more lives committed, and those among
    them whose lives committed different fingerprints, each with who committed what.
    A step number names one state within a lineage; a rollback starts a new one."""
    commits: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for r in steps:
        if r["committed"] and r.get("fingerprint"):
            commits[(r.get("lineage", 0), r["step"], r["rank"])].append(r)
    compared = sorted(key for key, records in commits.items() if len(records) >= 2)
    splits = []
    for lineage, step, rank in compared:
        records = commits[(lineage, step, rank)]
        if len({r["fingerprint"] for r in records}) > 1:
            who = [
                {k: r.get(k) for k in ("replica", "pid", "quorum_id", "fingerprint")}
                for r in records
            ]
            splits.append({"step": step, "lineage": lineage, "rank": rank, "commits": who})
    return len(compared), splits


def rollbacks(steps: Iterable[dict]) -> list[dict]:
    """Each time the job went back (a new lineage: no group holding its newest state
    could come back), with the steps it lost.

    >>> rollbacks([{"lineage": 0, "step": 9, "committed": True},
    ...            {"lineage": 7, "step": 4, "committed": True},
    ...            {"lineage": 7, "step": 5, "committed": True}])
    [{'lineage': 7, 'from_step': 10, 'to_step': 4, 'steps_lost': 6}]
    """
    reached: dict[int, tuple[int, int]] = {}
    for r in steps:
        if r["committed"]:
            lineage = r.get("lineage", 0)
            low, high = reached.get(lineage, (r["step"], r["step"]))
            reached[lineage] = (min(low, r["step"]), max(high, r["step"]))
    found, newest = [], None
    for lineage in sorted(reached):
        low, high = reached[lineage]
        if newest is not None:
            found.append(
                {
                    "lineage": lineage,
                    "from_step": newest + 1,
                    "to_step": low,
                    "steps_lost": max(0, newest + 1 - low),
                }
            )
        newest = high if newest is None else max(newest, high)
    return found


def _mean_loss(records: list[dict]) -> float | None:
    return statistics.fmean(r["loss"] for r in records) if records else None


def group_steps(steps: Iterable[dict]) -> list[dict]:
    """One record per step a group attempted: its rank 0's, since the ranks of a group
    take every step together."""
    return [r for r in steps if r["rank"] == 0]


def job_steps(steps: Iterable[dict]) -> int:
    """The steps the job committed: a step is numbered only once the one before it
    committed, so they are 0 up to the highest step any group committed.

    >>> job_steps([{"step": 4, "committed": True}, {"step": 5, "committed": False}])
    5
    """
    return max((r["step"] + 1 for r in steps if r["committed"]), default=0)


def first_commit(steps: Iterable[dict]) -> float | None:
    """When the job committed its first step: its training, and the report's clock,
    start there."""
    return min((r["t_end"] for r in steps if r["committed"]), default=None)


def phases(steps: list[dict], *, started: float, stopped: float, exited: float) -> dict[str, float]:
    """Where the run's wall time went, from the launcher's start (`started`) to the
    last process's exit (`exited`): start-up until the first committed step (the
    fork server's imports, the ranks', the first quorum), training until the
    launcher stopped the groups (`stopped`), then shutdown.

    >>> phases([{"t_end": 7.0, "committed": True}], started=1.0, stopped=127.0, exited=129.0)
    {'wall_s': 128.0, 'startup_s': 6.0, 'training_s': 120.0, 'shutdown_s': 2.0}
    """
    first = first_commit(steps)
    trained_from = stopped if first is None else min(first, stopped)
    return {
        "wall_s": exited - started,
        "startup_s": trained_from - started,
        "training_s": stopped - trained_from,
        "shutdown_s": exited - stopped,
    }


def restarts(steps: list[dict], events: list[dict]) -> list[dict]:
    """The restarts that recovered, each as {"replica", "t", "pids", "recovery_s"}:
    from the process start to the first committed step. A group is back when every
    one of its ranks has committed a step; one killed again before that did not
    recover."""
    first: dict[int, float] = {}
    for r in sorted(steps, key=lambda r: r["t_end"]):
        if r["committed"]:
            first.setdefault(r["pid"], r["t_end"])
    recovered = []
    for event in events:
        pids = event.get("pids") or []
        if event["kind"] == "start" and event.get("restart") and pids and set(pids) <= first.keys():
            recovery = max(first[p] for p in pids) - event["t"]
            recovered.append({**_pick(event, "replica", "t", "pids"), "recovery_s": recovery})
    return recovered


def _pick(record: dict, *keys: str) -> dict:
    return {k: record[k] for k in keys}


def _commit_gaps(records: list[dict]) -> list[tuple[float, float]]:
    """(previous commit, next commit) for each pair of consecutive commits of a life."""
    commits = sorted(r["t_end"] for r in records if r["committed"])
    return list(itertools.pairwise(commits))


def failures(steps: list[dict], events: list[dict], *, stopped: float) -> list[dict]:
    """Each failure injected before the stop and what it cost, as {"t", "kind",
    "replica", "back_t", "recovery_s", "survivor_stall_s"}.

    Its window runs from the failure (`t`) to the failed group's next commit
    (`back_t`; None and the window runs to the stop when it never came back). The
    survivors' stall is the longest gap between two consecutive commits of a life of
    another group that overlaps that window: the step the failure broke, the quorum
    without the group, and the quorum that took it back. A gap of a group inside a
    window of its own (hung, say, when another was killed) is its own failure's, not
    a survivor's; a slow step once every group is back is no failure's at all:
    `healthy_steps` counts it.
    """
    by_group = group_steps(steps)
    lives = _lives(by_group)
    recovered = restarts(steps, events)
    found = []
    for event in sorted(events, key=lambda e: e["t"]):
        if event["kind"] in FAILURE_KINDS and event["t"] < stopped:
            t, replica = event["t"], event["replica"]
            back = min(
                (
                    r
                    for r in by_group
                    if r["replica"] == replica and r["committed"] and r["t_end"] > t
                ),
                key=lambda r: r["t_end"],
                default=None,
            )
            restart = next(
                (s for s in recovered if back and back["pid"] in s["pids"] and s["t"] > t), None
            )
            found.append(
                {
                    **_pick(event, "t", "kind", "replica"),
                    "back_t": back["t_end"] if back else None,
                    "recovery_s": restart["recovery_s"] if restart else None,
                }
            )
    windows = [
        (f["replica"], f["t"], stopped if f["back_t"] is None else f["back_t"]) for f in found
    ]
    for failure, (replica, t, until) in zip(found, windows, strict=True):
        stalls = [
            b - a
            for (other, _, _), records in lives.items()
            if other != replica
            for a, b in _commit_gaps(records)
            if b > t
            and a < until
            and not any(g == other and b > gt and a < gu for g, gt, gu in windows)
        ]
        failure["survivor_stall_s"] = max(stalls, default=None)
    return found


def healthy_steps(
    steps: list[dict], replicas: int, windows: list[tuple[float, float]]
) -> list[dict]:
    """The group-steps committed with every group in the step and outside every
    failure's window (from the failure to the failed group's return): the job's
    ordinary steps, slow ones included."""
    return [
        r
        for r in group_steps(steps)
        if r["committed"]
        and r["participants"] == replicas
        and not any(r["t_end"] > t and r["t_start"] < until for t, until in windows)
    ]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank `q`-quantile: the smallest of `values` with a share `q` of
    them at or below it; None for no values.

    >>> percentile([3, 1, 2, 4], 0.5), percentile(range(1, 101), 0.99), percentile([], 0.5)
    (2, 99, None)
    """
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def job_line(steps: list[dict], *, stopped: float) -> list[tuple[float, int]]:
    """(when, groups in the step) for each step the job committed before `stopped`,
    in order: when it was first committed, and how many groups its quorum had. The
    steps committed after the stop are the shutdown's (a group whose peers already
    exited on the stop signal may commit its last step alone); they are left out, so
    that the line ends with the job's last step of training instead of a drop no
    failure caused.

    >>> job_line([
    ...     {"step": 0, "t_end": 1.0, "participants": 2, "committed": True},
    ...     {"step": 0, "t_end": 1.1, "participants": 2, "committed": True},
    ...     {"step": 1, "t_end": 2.0, "participants": 2, "committed": True},
    ...     {"step": 2, "t_end": 4.0, "participants": 1, "committed": True},
    ... ], stopped=3.0)
    [(1.0, 2), (2.0, 2)]
    """
    first: dict[int, float] = {}
    groups: dict[int, int] = {}
    for r in steps:
        if r["committed"] and r["t_end"] <= stopped:
            first[r["step"]] = min(first.get(r["step"], math.inf), r["t_end"])
            groups[r["step"]] = max(groups.get(r["step"], 0), r["participants"])
    return [(first[s], groups[s]) for s in sorted(first)]


def analyze(
    steps: list[dict],
    events: list[dict],
    *,
    replicas: int,
    started: float,
    stopped: float,
    exited: float | None = None,
) -> dict[str, Any]:
    """The report of a run from `steps` (the step log's records) and `events`
    (launcher events: {"t", "kind", "replica", "restart", "pids"}). `started`,
    `stopped` and `exited` are when the launcher started, when it stopped the groups
    (the end of training) and when the last process was gone (default: at the stop).
    Only steps begun before the stop count."""
    exited = stopped if exited is None else exited
    steps = [r for r in steps if r["t_start"] < stopped]
    attempted = group_steps(steps)
    committed = [r for r in attempted if r["committed"]]
    lives = _lives(steps)
    live_time = sum(rs[-1]["t_end"] - rs[0]["t_start"] for rs in lives.values())
    useful_time = sum(r["t_end"] - r["t_start"] for r in steps if r["committed"])
    zero = first_commit(steps)
    zero = started if zero is None else zero

    found = failures(steps, events, stopped=stopped)
    windows = [(f["t"], stopped if f["back_t"] is None else f["back_t"]) for f in found]
    healthy = healthy_steps(steps, replicas, windows)
    healthy_step = percentile((r["t_end"] - r["t_start"] for r in healthy), 0.5)
    reached = job_steps(committed)
    window = stopped - min((r["t_start"] for r in steps), default=stopped)
    job_progress = reached / (window / healthy_step) if healthy_step and window > 0 else None
    stalls = [f["survivor_stall_s"] for f in found if f["survivor_stall_s"] is not None]
    recovery_seconds = [r["recovery_s"] for r in restarts(steps, events)]

    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in committed:
        by_step[r["step"]].append(r)
    ordered = [by_step[s] for s in sorted(by_step)]
    initial = [r for group in ordered[:LOSS_WINDOW] for r in group]
    final = [r for group in ordered[-LOSS_WINDOW:] for r in group]
    compared, splits = _splits(steps)

    return {
        "replicas": replicas,
        **{
            k: _round(v, 2)
            for k, v in phases(steps, started=started, stopped=stopped, exited=exited).items()
        },
        "job_steps": reached,
        "group_steps_committed": len(committed),
        "group_steps_attempted": len(attempted),
        "step_efficiency": _round(len(committed) / len(attempted)) if attempted else None,
        "time_efficiency": _round(useful_time / live_time) if live_time > 0 else None,
        "job_progress": _round(job_progress),
        **_healthy_report(healthy, zero),
        "failures_injected": len(found),
        "failures_recovered": sum(f["back_t"] is not None for f in found),
        # A blocked training thread ("hang-thread") is a failure of its own kind: its
        # group is evicted as stalled and restarted, unlike a SIGSTOP ("hang").
        "failures_by_kind": {
            kind: n for kind in FAILURE_KINDS if (n := sum(f["kind"] == kind for f in found))
        },
        "recoveries": len(recovery_seconds),
        "recovery_seconds": [_round(s, 3) for s in recovery_seconds],
        "recovery_seconds_median": _round(
            statistics.median(recovery_seconds) if recovery_seconds else None, 3
        ),
        "max_survivor_stall_s": _round(max(stalls, default=None), 3),
        "survivor_stall_s_median": _round(statistics.median(stalls) if stalls else None, 3),
        "failures": [_failure_report(f, zero) for f in found],
        "initial_loss": _round(_mean_loss(initial)),
        "final_loss": _round(_mean_loss(final)),
        "rollbacks": rollbacks(committed),
        "replicas_consistent": not splits,
        "consistency_checked_steps": compared,
        "split_steps": sorted({split["step"] for split in splits}),
        "splits": splits[:SPLITS_SHOWN],
        "samples_committed": max((r.get("samples", 0) for r in committed), default=0),
    }


def _healthy_report(healthy: list[dict], zero: float) -> dict[str, Any]:
    seconds = [r["t_end"] - r["t_start"] for r in healthy]
    slowest = max(healthy, key=lambda r: r["t_end"] - r["t_start"], default=None)
    return {
        "healthy_steps": len(healthy),
        "healthy_step_s": _round(percentile(seconds, 0.5)),
        "healthy_step_s_p99": _round(percentile(seconds, 0.99)),
        "healthy_step_s_max": _round(max(seconds, default=None)),
        "slowest_healthy_step": slowest
        and {
            "step": slowest["step"],
            "replica": slowest["replica"],
            "at_s": _round(slowest["t_start"] - zero, 2),
            "seconds": _round(slowest["t_end"] - slowest["t_start"]),
            **{k: slowest[k] for k in ("quorum_s", "allreduce_s", "commit_s") if k in slowest},
        },
    }


def _failure_report(failure: dict, zero: float) -> dict[str, Any]:
    back = failure["back_t"]
    return {
        "at_s": _round(failure["t"] - zero, 2),
        "kind": failure["kind"],
        "replica": failure["replica"],
        "back_after_s": None if back is None else _round(back - failure["t"], 3),
        "recovery_s": _round(failure["recovery_s"], 3),
        "survivor_stall_s": _round(failure["survivor_stall_s"], 3),
    }


def _seconds(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's headline numbers, as (what, value) for the terminal."""
    r = report
    slowest = r["slowest_healthy_step"]
    where = f" (step {slowest['step']} at {slowest['at_s']:.1f} s)" if slowest else ""
    return [
        (
            "training (first committed step -> stop)",
            f"{_seconds(r['training_s'], 1)} s; start-up {_seconds(r['startup_s'], 1)} s, "
            f"shutdown {_seconds(r['shutdown_s'], 1)} s, wall {_seconds(r['wall_s'], 1)} s",
        ),
        ("job steps committed", str(r["job_steps"])),
        (
            "group-steps committed / attempted",
            f"{r['group_steps_committed']} / {r['group_steps_attempted']}"
            f" (step efficiency {r['step_efficiency']})",
        ),
        ("time efficiency", str(r["time_efficiency"])),
        ("job progress vs healthy pace", str(r["job_progress"])),
        (
            "step, all groups in: p50 / p99 / max",
            f"{_seconds(r['healthy_step_s'], 3)} / {_seconds(r['healthy_step_s_p99'], 3)} / "
            f"{_seconds(r['healthy_step_s_max'], 3)} s{where}",
        ),
        (
            "failures injected / groups back",
            f"{r['failures_injected']} / {r['failures_recovered']}"
            + (
                " (" + ", ".join(f"{k} {n}" for k, n in r["failures_by_kind"].items()) + ")"
                if r.get("failures_by_kind")
                else ""
            ),
        ),
        (
            "recovery (restart -> first commit), median",
            f"{_seconds(r['recovery_seconds_median'], 3)} s",
        ),
        (
            "survivors' stall at a failure: median / max",
            f"{_seconds(r['survivor_stall_s_median'], 3)} / "
            f"{_seconds(r['max_survivor_stall_s'], 3)} s",
        ),
        ("loss: initial -> final", f"{r['initial_loss']} -> {r['final_loss']}"),
        (
            "rollbacks (committed steps lost)",
            f"{len(r['rollbacks'])} ({sum(b['steps_lost'] for b in r['rollbacks'])})",
        ),
        (
            "replicas bit-identical",
            f"{r['replicas_consistent']} ({r['consistency_checked_steps']} steps compared)",
        ),
    ]


def summary_table(report: dict[str, Any]) -> str:
    """The report as a two-column table for the terminal."""
    rows = summary_rows(report)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


def split_verdict(report: dict[str, Any]) -> str | None:
    """Which steps were committed with two or more fingerprints, and by whom; None
    when every step that was compared agrees.

    >>> print(split_verdict({"replicas_consistent": False, "split_steps": [7], "splits": [
    ...     {"step": 7, "rank": 0, "commits": [
    ...         {"replica": "a", "pid": 1, "quorum_id": 3, "fingerprint": "0badf00d"},
    ...         {"replica": "b", "pid": 2, "quorum_id": 3, "fingerprint": "8badf00d"}]}]}))
    replicas diverged: 1 step(s) committed with two or more fingerprints, from step 7:
      step 7, rank 0: 0badf00d from a (quorum 3); 8badf00d from b (quorum 3)
    """
    if report["replicas_consistent"]:
        return None
    split_steps = report["split_steps"]
    lines = [
        f"replicas diverged: {len(split_steps)} step(s) committed with two or more "
        f"fingerprints, from step {split_steps[0]}:"
    ]
    for split in report["splits"]:
        by_fingerprint: dict[str, list[str]] = defaultdict(list)
        for c in split["commits"]:
            by_fingerprint[c["fingerprint"]].append(f"{c['replica']} (quorum {c['quorum_id']})")
        who = "; ".join(f"{fp} from {', '.join(groups)}" for fp, groups in by_fingerprint.items())
        lines.append(f"  step {split['step']}, rank {split['rank']}: {who}")
    if len({split["step"] for split in report["splits"]}) < len(split_steps):
        lines.append("  (every split step is in report.json's split_steps)")
    return "\n".join(lines)


def chart(steps: list[dict], report: dict[str, Any]) -> dict[str, Any]:
    """What report.png draws, in seconds from the first committed step (the clock of
    `--duration` and of the failures): each group's loss at its commits, the job line
    (`job_line`), each failure with its label, and the stop."""
    zero = first_commit(steps)
    zero = 0.0 if zero is None else zero
    stop = report["training_s"]
    loss: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in sorted(group_steps(steps), key=lambda r: r["t_end"]):
        if r["committed"] and r["t_end"] - zero <= stop:
            loss[r["replica"]][0].append(r["t_end"] - zero)
            loss[r["replica"]][1].append(r["loss"])
    return {
        "replicas": report["replicas"],
        "stop_s": stop,
        "startup_s": report["startup_s"],
        "shutdown_s": report["shutdown_s"],
        "job_steps": report["job_steps"],
        "loss": dict(sorted(loss.items())),
        "job_line": [(t - zero, n) for t, n in job_line(group_steps(steps), stopped=zero + stop)],
        "failures": [(f["at_s"], failure_label(f)) for f in report["failures"]],
    }


def failure_label(failure: dict[str, Any]) -> str:
    """A failure as report.png labels it: which group, what, when, how it came back.

    >>> print(failure_label({"at_s": 15.04, "kind": "kill", "replica": "group1",
    ...     "recovery_s": 0.412, "back_after_s": 1.3}))
    group1 killed at 15.0 s
    back in 1.30 s
    restart → commit 0.41 s
    """
    what = {"kill": "killed", "hang": "hung", "hang-thread": "thread hung"}.get(
        failure["kind"], failure["kind"]
    )
    lines = [f"{failure['replica']} {what} at {failure['at_s']:.1f} s"]
    if failure["back_after_s"] is None:
        lines.append("not back")
    else:
        lines.append(f"back in {failure['back_after_s']:.2f} s")
    if failure["recovery_s"] is not None:
        lines.append(f"restart → commit {failure['recovery_s']:.2f} s")
    return "\n".join(lines)


def label_places(
    failures: list[tuple[float, str]], stop: float
) -> list[tuple[float, str, int, bool]]:
    """Where report.png puts each failure's label: (time, label, row, left of the
    line?). A label goes right of its line where it fits before the end, in the lower
    of two rows where it overlaps no other; where two rows cannot hold them all, a
    failure is labelled with its group only (report.json has the rest).

    >>> [p[2:] for p in label_places([(15, "a"), (25, "b"), (45, "c"), (110, "d")], 120)]
    [(0, False), (1, False), (0, False), (0, True)]
    """
    width = LABEL_WIDTH * stop
    if len(failures) * width > 2 * stop:
        failures = [(at, label.split()[0]) for at, label in failures]
        width /= 3
    rows: list[list[tuple[float, float]]] = [[], []]
    places = []
    for at, label in failures:
        sides = [False, True] if at + width <= 1.01 * stop else [True, False]
        options = [(row, left) for left in sides for row in (0, 1)]
        row, left = next(
            (
                (row, left)
                for row, left in options
                if all(
                    (at if left else at + width) <= lo or (at - width if left else at) >= hi
                    for lo, hi in rows[row]
                )
            ),
            options[0],
        )
        rows[row].append((at - width, at) if left else (at, at + width))
        places.append((at, label, row, left))
    return places


def plot(chart: dict[str, Any], path: str) -> None:
    """`chart` as a PNG: the groups' loss above, the job's groups in the step below,
    each failure marked and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, job_ax) = plt.subplots(
        2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    replicas, stop = chart["replicas"], chart["stop_s"]
    for replica, (t, loss) in chart["loss"].items():
        loss_ax.plot(t, loss, ".", markersize=2, label=replica)
    if chart["job_line"]:
        t, groups = zip(*chart["job_line"], strict=True)
        # Each step's groups over the time the job took to make it, from the commit
        # before: a stall shows with the groups that finally committed.
        job_ax.step(t, groups, where="pre", color="black", linewidth=1.5)
        if groups[0] < replicas:
            job_ax.annotate(
                "groups joining",
                (t[0], groups[0]),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color="gray",
            )
    for at, label, row, left in label_places(chart["failures"], stop):
        for ax in (loss_ax, job_ax):
            ax.axvline(at, color="red", alpha=0.5, linewidth=1, linestyle="--")
        job_ax.annotate(
            label,
            (at, 0.04 + 0.3 * row),
            xycoords=("data", "axes fraction"),
            xytext=(-3, 0) if left else (3, 0),
            textcoords="offset points",
            ha="right" if left else "left",
            fontsize=8,
            color="darkred",
        )
    for ax in (loss_ax, job_ax):
        ax.axvline(stop, color="gray", linewidth=1, linestyle=":")
    job_ax.annotate(
        "stop",
        (stop, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(-3, -10),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="gray",
    )
    loss_ax.set_ylabel("loss (nats/byte)")
    loss_ax.set_title(
        f"phalanx demo: {replicas} replica groups, {stop:.0f} s of training, "
        f"{len(chart['failures'])} failures injected, {chart['job_steps']} steps"
    )
    if chart["loss"]:
        loss_ax.legend(loc="upper right", markerscale=4)
    job_ax.set_ylabel("groups in the job's step")
    job_ax.set_ylim(0, replicas + 0.4)
    job_ax.set_yticks(range(replicas + 1))
    if stop > 0:
        job_ax.set_xlim(-0.01 * stop, 1.01 * stop)
    job_ax.set_xlabel(
        f"seconds from the first committed step (start-up before it: "
        f"{chart['startup_s']:.1f} s; shutdown after the stop: {chart['shutdown_s']:.1f} s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
