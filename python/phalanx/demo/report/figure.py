"""report.png: what it draws (`chart`, from the step log and the report) and the
drawing (`plot`, with matplotlib), each failure marked and labelled."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from phalanx.demo.report.measures import first_commit, group_steps, job_line

#: How far a time of the report (`at_s`, `back_after_s`: 2 and 3 digits) may be off.
ROUNDING_S = 0.006

#: The width of a failure's label in report.png, as a share of the time axis.
LABEL_WIDTH = 0.14


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
