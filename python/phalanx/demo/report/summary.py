"""The report for the terminal: its headline numbers as a two-column table
(`summary_table`), and the verdicts that fail or warn a run, each saying what went
wrong in words (`split_verdict`, `thin_verdict`, `interval_verdict`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from phalanx.demo.report.measures import STARTUP_STEPS


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
