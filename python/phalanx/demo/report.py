"""What a demo run achieved, computed from its step log and its failure events only:
nothing here is assumed, every number is measured.

A *life* is one process of one group (one rank, for groups of several ranks), from
its first step to its last; a group killed and restarted has several lives.

- `step_efficiency`: committed ÷ attempted steps, over every life (a step counts as
  attempted once it reached its vote; the step a killed process was in never does).
- `time_efficiency`: the share of the lives' wall time (first step start → last step
  end) spent in steps that committed.
- `recovery_seconds`: for each restart, from the process's start to its first
  committed step.
- `replicas_consistent`: at every step that two or more lives committed, their
  fingerprints of model + optimizer state agree (same rank of each group). The steps
  where they do not are `split_steps`; `splits` says, for the first few, which group
  committed which fingerprint in which quorum.
- `job_progress`: the committed steps the job reached ÷ the steps it would have made
  at its healthy pace (the median step time while every group was live) in the time
  from its first step to its end.
- `max_survivor_stall_s`: the longest gap between two consecutive commits of one life.

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
>>> r = analyze(steps, events=[], replicas=2, started=0.0, ended=4.0)
>>> r["steps_attempted"], r["steps_committed"], r["step_efficiency"], r["replicas_consistent"]
(8, 7, 0.875, True)
>>> r["job_progress"], r["max_survivor_stall_s"]
(1.0, 2.0)
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

#: Launcher events that are failures injected on purpose.
FAILURE_KINDS = ("kill", "hang")

#: Steps averaged for the initial and the final loss.
LOSS_WINDOW = 10

#: Split steps the report describes commit by commit: a divergence usually lasts from
#: the step where it began to the end, so the first few say where and how it began.
SPLITS_SHOWN = 5


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
    """How many (step, rank)s two or more lives committed, and those among them
    whose lives committed different fingerprints, each with who committed what."""
    commits: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in steps:
        if r["committed"] and r.get("fingerprint"):
            commits[(r["step"], r["rank"])].append(r)
    compared = sorted(key for key, records in commits.items() if len(records) >= 2)
    splits = []
    for step, rank in compared:
        records = commits[(step, rank)]
        if len({r["fingerprint"] for r in records}) > 1:
            who = [
                {k: r.get(k) for k in ("replica", "pid", "quorum_id", "fingerprint")}
                for r in records
            ]
            splits.append({"step": step, "rank": rank, "commits": who})
    return len(compared), splits


def _mean_loss(records: list[dict]) -> float | None:
    return statistics.fmean(r["loss"] for r in records) if records else None


def analyze(
    steps: list[dict],
    events: list[dict],
    *,
    replicas: int,
    started: float,
    ended: float,
) -> dict[str, Any]:
    """The report of a run from `steps` (the step log's records) and `events`
    (launcher events: {"t", "kind", "replica"}); only steps begun before `ended`
    count (the job is stopped then)."""
    steps = [r for r in steps if r["t_start"] < ended]
    committed = [r for r in steps if r["committed"]]
    lives = _lives(steps)

    live_time = sum(rs[-1]["t_end"] - rs[0]["t_start"] for rs in lives.values())
    useful_time = sum(r["t_end"] - r["t_start"] for r in committed)

    stall = 0.0
    for records in lives.values():
        commits = [r["t_end"] for r in records if r["committed"]]
        stall = max([stall, *(b - a for a, b in itertools.pairwise(commits))])

    first_commit: dict[int, float] = {}
    for (_, _, pid), records in lives.items():
        done = [r["t_end"] for r in records if r["committed"]]
        if done:
            first_commit[pid] = done[0]
    recovery_seconds = []
    for event in events:
        if event["kind"] == "start" and event.get("restart"):
            # A group is back when every one of its ranks has committed a step; one
            # killed again before that did not recover.
            pids = event["pids"]
            if pids and all(pid in first_commit for pid in pids):
                recovery_seconds.append(max(first_commit[p] for p in pids) - event["t"])

    healthy = [r["t_end"] - r["t_start"] for r in committed if r["participants"] == replicas]
    healthy_step = statistics.median(healthy) if healthy else None
    reached = max((r["step"] + 1 for r in committed), default=0)
    window = ended - min((r["t_start"] for r in steps), default=ended)
    job_progress = reached / (window / healthy_step) if healthy_step and window > 0 else None

    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in committed:
        by_step[r["step"]].append(r)
    ordered = [by_step[s] for s in sorted(by_step)]
    initial = [r for group in ordered[:LOSS_WINDOW] for r in group]
    final = [r for group in ordered[-LOSS_WINDOW:] for r in group]
    compared, splits = _splits(steps)

    return {
        "replicas": replicas,
        "duration_s": _round(ended - started, 2),
        "steps_attempted": len(steps),
        "steps_committed": len(committed),
        "step_efficiency": _round(len(committed) / len(steps)) if steps else None,
        "time_efficiency": _round(useful_time / live_time) if live_time > 0 else None,
        "job_steps": reached,
        "job_progress": _round(job_progress),
        "healthy_step_s": _round(healthy_step),
        "failures_injected": sum(1 for e in events if e["kind"] in FAILURE_KINDS),
        "recoveries": len(recovery_seconds),
        "recovery_seconds": [_round(s, 3) for s in recovery_seconds],
        "recovery_seconds_median": _round(
            statistics.median(recovery_seconds) if recovery_seconds else None, 3
        ),
        "initial_loss": _round(_mean_loss(initial)),
        "final_loss": _round(_mean_loss(final)),
        "replicas_consistent": not splits,
        "consistency_checked_steps": compared,
        "split_steps": sorted({split["step"] for split in splits}),
        "splits": splits[:SPLITS_SHOWN],
        "max_survivor_stall_s": _round(stall, 3),
        "samples_committed": max((r.get("samples", 0) for r in committed), default=0),
    }


SUMMARY_ROWS = [
    ("steps committed / attempted", "steps_committed", "steps_attempted"),
    ("step efficiency", "step_efficiency", None),
    ("time efficiency", "time_efficiency", None),
    ("job progress vs healthy pace", "job_progress", None),
    ("failures injected", "failures_injected", None),
    ("recoveries", "recoveries", None),
    ("recovery (start -> first commit), median s", "recovery_seconds_median", None),
    ("longest survivor stall, s", "max_survivor_stall_s", None),
    ("loss: initial -> final", "initial_loss", "final_loss"),
    ("replicas bit-identical", "replicas_consistent", None),
]


def summary_table(report: dict[str, Any]) -> str:
    """The report as a two-column table for the terminal."""
    rows = []
    for label, key, second in SUMMARY_ROWS:
        value = str(report[key])
        if second == "steps_attempted":
            value = f"{report[key]} / {report[second]}"
        elif second:
            value = f"{report[key]} -> {report[second]}"
        if key == "replicas_consistent":
            value += f" ({report['consistency_checked_steps']} steps compared)"
        rows.append((label, value))
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


def plot(steps: list[dict], events: list[dict], started: float, path: str) -> None:
    """Loss and participants over time, failures marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, part_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    by_replica: dict[str, list[dict]] = defaultdict(list)
    for r in steps:
        if r["committed"] and r["rank"] == 0:
            by_replica[r["replica"]].append(r)
    for replica, records in sorted(by_replica.items()):
        records.sort(key=lambda r: r["t_end"])
        t = [r["t_end"] - started for r in records]
        loss_ax.plot(t, [r["loss"] for r in records], ".", markersize=2, label=replica)
        part_ax.step(t, [r["participants"] for r in records], where="post", label=replica)
    for event in events:
        if event["kind"] in FAILURE_KINDS:
            for ax in (loss_ax, part_ax):
                ax.axvline(event["t"] - started, color="red", alpha=0.4, linewidth=1)
    loss_ax.set_ylabel("loss (nats/byte)")
    loss_ax.set_title("phalanx demo: training through failures (red: injected failure)")
    loss_ax.legend(loc="upper right", markerscale=4)
    part_ax.set_ylabel("groups in the step")
    part_ax.set_xlabel("seconds")
    part_ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
