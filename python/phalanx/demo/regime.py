"""The seed regime: `phalanx demo --seed-regime F` replays the failure rate of the
experiment phalanx measures itself against (30 replica groups; a failure every F
healthy steps: 1.4 for its "one failure every 15 s" at 11 s steps, 5.5 for its "one a
minute"). The rate is in steps, not seconds, so that it means the same on any
machine: the demo measures its own healthy step time first, on the job's first steps
that every group takes part in, and only then starts the failures, every F of those
steps.

>>> records = [{"step": s, "rank": 0, "committed": True, "participants": 3, "t_end": 2.0 * s}
...            for s in range(12)]
>>> healthy_step_time(records, replicas=3)
2.0
>>> healthy_step_time(records[:5], replicas=3) is None  # not enough steps yet
True
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

#: The seed's groups, and its two failure rates, in healthy steps between failures.
GROUPS = 30
RATES = {"one failure every 15 s": 1.4, "one failure a minute": 5.5}
#: Consecutive job steps of every group measured for the healthy step time.
MEASURED_STEPS = 10


def healthy_step_time(
    records: Iterable[dict[str, Any]], replicas: int, steps: int = MEASURED_STEPS
) -> float | None:
    """The median time between consecutive job steps over the first `steps` steps that
    every one of `replicas` groups contributed to (by rank 0's step records), or None
    while there are not that many yet."""
    first_commit: dict[int, float] = {}
    for r in records:
        if r["rank"] == 0 and r["committed"] and r["participants"] == replicas:
            step = r["step"]
            first_commit[step] = min(r["t_end"], first_commit.get(step, r["t_end"]))
    ordered = sorted(first_commit)
    gaps = [first_commit[b] - first_commit[a] for a, b in pairwise(ordered) if b == a + 1]
    if len(gaps) < steps:
        return None
    return statistics.median(gaps[:steps])
