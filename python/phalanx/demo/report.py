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
- `group_steps_committed` / `group_steps_attempted` (a step counts as attempted once
  it reached its vote; the step a killed process was in never does), and
  `group_steps_contributed`: the committed group-steps whose gradients were part of
  the step's average. A group that healed in a step committed it without
  contributing: its work that step was recovery, not training.
- `step_efficiency`: contributed ÷ attempted; `contributing_share`: contributed ÷
  committed.
- `time_efficiency`: the share of the lives' wall time (first step start → last step
  end) spent in steps they contributed to.
- `participants_per_step`: min, median and max over the job's steps of the groups
  whose gradients each step averaged; `thin_steps`: the steps after the first
  `STARTUP_STEPS` where fewer than half of the groups that took the step contributed
  (`thin_verdict` fails the demo when they are most of them).
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
- `replicas_consistent`: at every step that two or more lives committed in one
  lineage, their fingerprints of model + optimizer state agree (same rank of each
  group). A step number redone after a rollback is of a new lineage: a new state, not
  a split. The steps where they do not agree are `split_steps`; `splits` says, for
  the first few, which group committed which fingerprint in which quorum.
- `job_losses`: each loss of every group at once (`--kill-all-every`), when
  (`at_s`), and what it cost: `newest_step`, the newest step committed before it;
  `resumed_from_step`, the first step committed after it (the snapshot's: its state
  is the one step `resumed_from_step - 1` committed); `steps_lost`, the steps between
  (`lost_steps`, first and last, and `redone_steps`, those committed again before the
  stop, each of the new `lineage`); `within_interval`, whether they were at most the
  snapshot interval (None for an interval of time: not checked);
  `unpublished_snapshot_step`, a later snapshot copied before the loss that the job
  did not resume from (still being written, or its write failed: the steps committed
  meanwhile are lost on top of the interval); `back_after_s`, from the loss to the
  first committed step after it, and `groups_back_after_s` until every group killed
  had committed again; `resume_s`, the longest snapshot load. A step committed whose
  record a killed rank never printed is not seen: the step log is all there is.

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
>>> r["participants_per_step"], r["thin_steps"]
({'min': 2, 'median': 2, 'max': 2}, [])
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

#: Launcher events that are failures of one group injected on purpose.
FAILURE_KINDS = ("kill", "hang", "hang-thread")

#: The launcher's event for each group at the loss of every group at once (its
#: events for one loss come one after another).
JOB_LOSS = "kill-all"

#: Steps averaged for the initial and the final loss.
LOSS_WINDOW = 10

#: Split steps the report describes commit by commit: a divergence usually lasts from
#: the step where it began to the end, so the first few say where and how it began.
SPLITS_SHOWN = 5

#: How far a time of the report (`at_s`, `back_after_s`: 2 and 3 digits) may be off.
ROUNDING_S = 0.006

#: The width of a failure's label in report.png, as a share of the time axis.
LABEL_WIDTH = 0.14

#: The job's first steps, where the groups still arrive one by one (importing torch,
#: building the model): a step there averages whoever is in.
STARTUP_STEPS = 5


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


def contributes(record: dict) -> bool:
    """Whether the group-step's gradients were part of its step's committed average:
    it committed, and did not heal in it (a healing group's step is recovery)."""
    return bool(record["committed"]) and not record.get("healed", False)


def contributions(attempted: list[dict]) -> dict[str, Any]:
    """`participants_per_step` and `thin_steps` of the group-steps `attempted`.

    >>> steps = [{"replica": g, "step": s, "lineage": 0, "committed": True,
    ...           "participants": 1 if s >= 6 else 3} for g in "abc" for s in range(8)]
    >>> contributions(steps)
    {'participants_per_step': {'min': 1, 'median': 3, 'max': 3}, 'thin_steps': [6, 7]}
    """
    taken: dict[tuple[int, int], set[str]] = defaultdict(set)
    averaged: dict[tuple[int, int], int] = {}
    for r in attempted:
        key = (r.get("lineage", 0), r["step"])
        taken[key].add(r["replica"])
        if r["committed"]:
            averaged[key] = max(averaged.get(key, 0), r["participants"])
    counts = [averaged[key] for key in sorted(averaged)]
    first = min((step for _, step in averaged), default=0)
    thin = [
        step
        for (lineage, step), n in sorted(averaged.items())
        if step >= first + STARTUP_STEPS and 2 * n < len(taken[(lineage, step)])
    ]
    return {
        "participants_per_step": {
            "min": min(counts),
            "median": statistics.median_low(counts),
            "max": max(counts),
        }
        if counts
        else None,
        "thin_steps": thin,
    }


def thin_verdict(report: dict[str, Any]) -> str | None:
    """A failure line when fewer than half of the groups that took a step contributed
    to it on most of the job's steps after the start-up; None otherwise.

    >>> print(thin_verdict({"job_steps": 30, "thin_steps": list(range(5, 30)),
    ...     "participants_per_step": {"min": 2, "median": 2, "max": 30}}))
    most groups' work was thrown away: on 25 of the job's 25 steps after the first 5, ...
    """
    counted = report["job_steps"] - STARTUP_STEPS
    thin = len(report.get("thin_steps") or [])
    if counted <= 0 or 2 * thin <= counted:
        return None
    p = report["participants_per_step"]
    return (
        f"most groups' work was thrown away: on {thin} of the job's {counted} steps after "
        f"the first {STARTUP_STEPS}, fewer than half of the groups that took the step "
        f"contributed to it (participants per step: min {p['min']}, median {p['median']}, "
        f"max {p['max']}); the others healed instead"
    )


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
    """The restarts that recovered, each as {"replica", "t", "pids", "recovery_s",
    "after"}: from the process start to the first committed step, and the kind of
    the group's failure before it ("kill", JOB_LOSS, "exit", ...). A group is back
    when every one of its ranks has committed a step; one killed again before that
    did not recover."""
    first: dict[int, float] = {}
    for r in sorted(steps, key=lambda r: r["t_end"]):
        if r["committed"]:
            first.setdefault(r["pid"], r["t_end"])
    recovered = []
    failed: dict[str, str] = {}
    for event in events:
        pids = event.get("pids") or []
        if event["kind"] in (*FAILURE_KINDS, JOB_LOSS):
            failed[event["replica"]] = event["kind"]
        if event["kind"] == "start" and event.get("restart") and pids and set(pids) <= first.keys():
            recovery = max(first[p] for p in pids) - event["t"]
            recovered.append(
                {
                    **_pick(event, "replica", "t", "pids"),
                    "recovery_s": recovery,
                    "after": failed.pop(event["replica"], "exit"),
                }
            )
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


def _losses_of(events: list[dict], stopped: float) -> list[list[dict]]:
    """The launcher's JOB_LOSS events before `stopped`, one list per loss: a loss's
    events come one after another."""
    found: list[list[dict]] = []
    previous = None
    for event in sorted(events, key=lambda e: e["t"]):
        if event["kind"] == JOB_LOSS and event["t"] < stopped:
            if previous is not None and previous["kind"] == JOB_LOSS:
                found[-1].append(event)
            else:
                found.append([event])
        previous = event
    return found


def job_losses(
    steps: list[dict], events: list[dict], *, stopped: float, snapshot_every: int | None = None
) -> list[dict]:
    """Each loss of every group at once before `stopped` and what it cost, as {"t",
    "groups_killed", "newest_step", "newest_lineage", "resumed_from_step", "lineage",
    "from_snapshot", "steps_lost", "lost_steps", "redone_steps", "within_interval",
    "back_t", "groups_back_t", "resume_s"} (see the module's doc).

    >>> steps = [{"replica": "a", "rank": 0, "pid": 1, "step": s, "lineage": 0,
    ...           "committed": True, "t_start": s, "t_end": s + 0.5} for s in range(8)]
    >>> steps += [{"replica": "a", "rank": 0, "pid": 2, "step": s, "lineage": 3,
    ...            "committed": True, "t_start": s + 5, "t_end": s + 5.5,
    ...            "resume_s": 0.2 if s == 5 else 0.0} for s in range(5, 10)]
    >>> (loss,) = job_losses(steps, [{"t": 8.0, "kind": "kill-all", "replica": "a",
    ...                               "pids": [1]}], stopped=20.0, snapshot_every=5)
    >>> loss["newest_step"], loss["resumed_from_step"], loss["steps_lost"], loss["lineage"]
    (7, 5, 3, 3)
    >>> loss["lost_steps"], loss["redone_steps"], loss["within_interval"], loss["back_t"]
    ([5, 7], [5, 7], True, 10.5)
    """
    group = group_steps(steps)
    losses = _losses_of(events, stopped)
    found = []
    for i, loss in enumerate(losses):
        t = loss[0]["t"]
        since = losses[i - 1][0]["t"] if i else -math.inf
        until = losses[i + 1][0]["t"] if i + 1 < len(losses) else stopped
        killed = {p for e in loss for p in e.get("pids") or []}
        before = [r for r in group if r["committed"] and since < r["t_start"] and r["t_end"] <= t]
        after = [r for r in group if t < r["t_start"] < until and r["pid"] not in killed]
        back = [r for r in after if r["committed"]]
        newest = max(before, key=lambda r: r["step"], default=None)
        resumed = min(back, key=lambda r: (r["step"], r["t_end"]), default=None)
        first_back = min(back, key=lambda r: r["t_end"], default=None)
        back_by_group = {}
        for r in sorted(back, key=lambda r: r["t_end"]):
            back_by_group.setdefault(r["replica"], r["t_end"])
        replicas = {e["replica"] for e in loss}
        loads = [r["resume_s"] for r in after if r.get("resume_s")]
        lost = redone = []
        steps_lost = unpublished = None
        if newest is not None and resumed is not None:
            taken = [
                r["step"] for r in before if r.get("snapshot_s") and r["step"] > resumed["step"]
            ]
            unpublished = max(taken, default=None)
            steps_lost = max(0, newest["step"] + 1 - resumed["step"])
            if steps_lost:
                lost = [resumed["step"], newest["step"]]
                last = min(newest["step"], max(r["step"] for r in back))
                redone = [resumed["step"], last]
        found.append(
            {
                "t": t,
                "groups_killed": sorted(replicas),
                "newest_step": newest and newest["step"],
                "newest_lineage": newest and newest.get("lineage", 0),
                "resumed_from_step": resumed and resumed["step"],
                "lineage": resumed and resumed.get("lineage", 0),
                "from_snapshot": bool(loads),
                "steps_lost": steps_lost,
                "lost_steps": lost,
                "redone_steps": redone,
                "unpublished_snapshot_step": unpublished,
                "within_interval": (
                    steps_lost <= snapshot_every
                    if steps_lost is not None and snapshot_every
                    else None
                ),
                "back_t": first_back and first_back["t_end"],
                "groups_back_t": (
                    max(back_by_group.values()) if replicas <= back_by_group.keys() else None
                ),
                "resume_s": max(loads, default=None),
            }
        )
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
    # A step number redone after a rollback is another step of the job's: by lineage.
    first: dict[tuple[int, int], float] = {}
    groups: dict[tuple[int, int], int] = {}
    for r in steps:
        if r["committed"] and r["t_end"] <= stopped:
            key = (r.get("lineage", 0), r["step"])
            first[key] = min(first.get(key, math.inf), r["t_end"])
            groups[key] = max(groups.get(key, 0), r["participants"])
    return sorted((first[key], groups[key]) for key in first)


def analyze(
    steps: list[dict],
    events: list[dict],
    *,
    replicas: int,
    started: float,
    stopped: float,
    exited: float | None = None,
    snapshot_every: int | None = None,
) -> dict[str, Any]:
    """The report of a run from `steps` (the step log's records) and `events`
    (launcher events: {"t", "kind", "replica", "restart", "pids"}). `started`,
    `stopped` and `exited` are when the launcher started, when it stopped the groups
    (the end of training) and when the last process was gone (default: at the stop);
    `snapshot_every`, the snapshot interval in steps, if one. Only steps begun before
    the stop count."""
    exited = stopped if exited is None else exited
    steps = [r for r in steps if r["t_start"] < stopped]
    attempted = group_steps(steps)
    committed = [r for r in attempted if r["committed"]]
    contributed = [r for r in committed if contributes(r)]
    lives = _lives(steps)
    live_time = sum(rs[-1]["t_end"] - rs[0]["t_start"] for rs in lives.values())
    useful_time = sum(r["t_end"] - r["t_start"] for r in steps if contributes(r))
    zero = first_commit(steps)
    zero = started if zero is None else zero

    found = failures(steps, events, stopped=stopped)
    lost = job_losses(steps, events, stopped=stopped, snapshot_every=snapshot_every)
    windows = [(f["t"], stopped if f["back_t"] is None else f["back_t"]) for f in found]
    windows += [
        (j["t"], stopped if j["groups_back_t"] is None else j["groups_back_t"]) for j in lost
    ]
    healthy = healthy_steps(steps, replicas, windows)
    healthy_step = percentile((r["t_end"] - r["t_start"] for r in healthy), 0.5)
    reached = job_steps(committed)
    window = stopped - min((r["t_start"] for r in steps), default=stopped)
    job_progress = reached / (window / healthy_step) if healthy_step and window > 0 else None
    stalls = [f["survivor_stall_s"] for f in found if f["survivor_stall_s"] is not None]
    # A restart after the loss of every group is the loss's (`job_losses`), not a recovery.
    recovery_seconds = [r["recovery_s"] for r in restarts(steps, events) if r["after"] != JOB_LOSS]
    lost_counts = [j["steps_lost"] for j in lost if j["steps_lost"] is not None]
    back_after = [j["back_t"] - j["t"] for j in lost if j["back_t"] is not None]

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
        "group_steps_contributed": len(contributed),
        "step_efficiency": _round(len(contributed) / len(attempted)) if attempted else None,
        "contributing_share": _round(len(contributed) / len(committed)) if committed else None,
        **contributions(attempted),
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
        "job_losses_injected": len(lost),
        "job_losses_recovered": sum(j["back_t"] is not None for j in lost),
        "snapshot_every_steps": snapshot_every,
        "steps_lost_at_job_losses": sum(lost_counts),
        "max_steps_lost_at_a_job_loss": max(lost_counts, default=None),
        "steps_lost_within_interval": (
            all(j["within_interval"] is not False for j in lost) if snapshot_every else None
        ),
        "job_loss_back_after_s_median": _round(
            statistics.median(back_after) if back_after else None, 3
        ),
        "job_losses": [_job_loss_report(j, zero) for j in lost],
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


def _job_loss_report(loss: dict, zero: float) -> dict[str, Any]:
    t = loss["t"]
    return {
        "at_s": _round(t - zero, 2),
        **{k: v for k, v in loss.items() if k not in ("t", "back_t", "groups_back_t", "resume_s")},
        "back_after_s": None if loss["back_t"] is None else _round(loss["back_t"] - t, 3),
        "groups_back_after_s": (
            None if loss["groups_back_t"] is None else _round(loss["groups_back_t"] - t, 3)
        ),
        "resume_s": _round(loss["resume_s"], 3),
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
            "group-steps contributed / committed / attempted",
            f"{r['group_steps_contributed']} / {r['group_steps_committed']} / "
            f"{r['group_steps_attempted']} (step efficiency {r['step_efficiency']})",
        ),
        ("groups averaged per step: min / median / max", _participants(r)),
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
        *(
            (
                f"crash loop of {c['replica']}",
                f"{c['lives']} lives in a row: {c['kind']}: {c['message'][:80]}"
                + ("" if c["step"] is None else f" (at step {c['step']})"),
            )
            for c in r.get("crash_loops", [])
        ),
        *_job_loss_rows(r),
        (
            "replicas bit-identical",
            f"{r['replicas_consistent']} ({r['consistency_checked_steps']} steps compared, "
            "each within its lineage)",
        ),
    ]


def _participants(r: dict[str, Any]) -> str:
    p = r["participants_per_step"]
    if p is None:
        return "-"
    thin = len(r["thin_steps"])
    return f"{p['min']} / {p['median']} / {p['max']}" + (
        f" ({thin} step(s) where fewer than half of the groups contributed)" if thin else ""
    )


def _steps(span: list[int]) -> str:
    return "none" if not span else f"{span[0]}" if span[0] == span[1] else f"{span[0]}-{span[1]}"


def _job_loss_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The whole-job losses' rows: how many, and for each what it lost and how the
    job came back."""
    if not r.get("job_losses"):
        return []
    every = r["snapshot_every_steps"]
    rows = [
        (
            "whole-job losses / job back",
            f"{r['job_losses_injected']} / {r['job_losses_recovered']}; steps lost "
            f"{r['steps_lost_at_job_losses']}, at most "
            f"{_seconds(r['max_steps_lost_at_a_job_loss'], 0)}"
            + (f" of a snapshot interval of {every}" if every else ""),
        )
    ]
    for j in r["job_losses"]:
        if j["resumed_from_step"] is None:
            rows.append((f"  every group killed at {j['at_s']:.1f} s", "not back before the stop"))
            continue
        source = "a snapshot" if j["from_snapshot"] else "no snapshot"
        over = "  OVER THE SNAPSHOT INTERVAL" if j["within_interval"] is False else ""
        rows.append(
            (
                f"  every group killed at {j['at_s']:.1f} s",
                f"newest step {j['newest_step']}; resumed from step {j['resumed_from_step']} "
                f"({source}) as lineage {j['lineage']}: {j['steps_lost']} step(s) lost "
                f"({_steps(j['lost_steps'])}), redone {_steps(j['redone_steps'])}; "
                f"back in {_seconds(j['back_after_s'], 2)} s (load "
                f"{_seconds(j['resume_s'], 3)} s){over}",
            )
        )
    return rows


def interval_verdict(report: dict[str, Any]) -> str | None:
    """Which whole-job losses cost more steps than the snapshot interval (a snapshot
    skipped, failed or not yet published); None when none did.

    >>> print(interval_verdict({"snapshot_every_steps": 5, "job_losses": [
    ...     {"at_s": 10.0, "within_interval": False, "steps_lost": 9, "lost_steps": [5, 13],
    ...      "unpublished_snapshot_step": None}]}))
    warning: 1 whole-job loss(es) cost more steps than the snapshot interval (5):
      at 10.0 s: 9 steps (5-13); no later snapshot was taken: ranks.log says why (look ...
    """
    over = [j for j in report.get("job_losses") or [] if j["within_interval"] is False]
    if not over:
        return None
    lines = [
        f"warning: {len(over)} whole-job loss(es) cost more steps than the snapshot "
        f"interval ({report['snapshot_every_steps']}):"
    ]
    lines += [
        f"  at {j['at_s']:.1f} s: {j['steps_lost']} steps ({_steps(j['lost_steps'])}); "
        + why_over(j)
        for j in over
    ]
    return "\n".join(lines)


def why_over(loss: dict[str, Any]) -> str:
    """Why a whole-job loss cost more than the snapshot interval, as far as the step log
    says."""
    if loss["unpublished_snapshot_step"] is not None:
        return (
            f"the snapshot of step {loss['unpublished_snapshot_step']} was copied but not "
            "published before the loss (still being written, or its write failed)"
        )
    return 'no later snapshot was taken: ranks.log says why (look for "snapshot of step")'


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
        lineage = f" of lineage {split['lineage']}" if split.get("lineage") else ""
        lines.append(f"  step {split['step']}{lineage}, rank {split['rank']}: {who}")
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
        "job_line": _with_outages(
            [(t - zero, n) for t, n in job_line(group_steps(steps), stopped=zero + stop)],
            report.get("job_losses") or [],
        ),
        "failures": sorted(
            [(f["at_s"], failure_label(f)) for f in report["failures"]]
            + [(j["at_s"], job_loss_label(j)) for j in report.get("job_losses") or []]
        ),
    }


def _with_outages(
    line: list[tuple[float, int]], losses: list[dict[str, Any]]
) -> list[tuple[float, int]]:
    """The job line with no group in a step from each whole-job loss until the job
    committed again (drawn as steps: each point's groups hold since the point before).

    >>> _with_outages([(1.0, 2), (2.0, 2), (4.503, 1)], [{"at_s": 2.5, "back_after_s": 2.0}])
    [(1.0, 2), (2.0, 2), (2.5, 2), (4.503, 0), (4.503, 1)]
    """
    marks = []
    for loss in losses:
        if loss["back_after_s"] is not None:
            at = loss["at_s"]
            before = [n for t, n in line if t <= at]
            # The job's first commit after the loss, found past the report's rounding.
            back = min(
                (t for t, _ in line if t >= at + loss["back_after_s"] - ROUNDING_S), default=None
            )
            if back is not None:
                marks += [(at, 0, before[-1] if before else 0), (back, 0, 0)]
    points = sorted([(t, 1, n) for t, n in line] + marks)
    return [(t, n) for t, _, n in points]


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


def job_loss_label(loss: dict[str, Any]) -> str:
    """A whole-job loss as report.png labels it.

    >>> print(job_loss_label({"at_s": 60.2, "back_after_s": 3.4, "steps_lost": 12,
    ...     "resumed_from_step": 100}))
    all killed at 60.2 s
    back in 3.40 s
    12 steps lost, from 100
    """
    lines = [f"all killed at {loss['at_s']:.1f} s"]
    if loss["back_after_s"] is None:
        lines.append("not back")
    else:
        lines.append(f"back in {loss['back_after_s']:.2f} s")
        lines.append(f"{loss['steps_lost']} steps lost, from {loss['resumed_from_step']}")
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
