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
