"""Training scripts written for torchft (tests/procs/torchft_*.py: DDP, DiLoCo,
LocalSGD, FSDP2 with ManagedProcessGroup), run unchanged by `phalanx run
--as-torchft` through SIGKILLs of random groups: every committed step has one
fingerprint across the groups (I1), quorum ids never go down in a life (I3), the
loss falls, a killed group comes back, heals and trains with the others, and the job
reaches its step count. And what phalanx cannot honour is refused through a plain
`import torchft`, naming the argument.

Each job is stopped once a group has committed its last step: a group killed after
its peers finished would rightly start over alone, as a new lineage.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from test_launcher import launch, reports, run_until

from conftest import PROCS

CHAOS_SEED = 5
STARTED = re.compile(r"\[phalanx run\] started (\S+) \(.*, pids ([\d, ]+)\)$")


@dataclass(frozen=True)
class Job:
    script: str
    steps: int
    replicas: int = 3
    nproc: int = 1
    kill_every: str = "2s"
    args: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return [
            "--as-torchft",
            *("--replicas", str(self.replicas), "--nproc-per-replica", str(self.nproc)),
            *("--chaos", f"kill-every={self.kill_every}", "--chaos-seed", str(CHAOS_SEED)),
            *("--restart-backoff", "0.1"),
            "--",
            str(PROCS / self.script),
            *("--steps", str(self.steps), *self.args),
        ]


#: About 10-25 s of training each on 2 cores: a few kills, each group back in about 1 s.
JOBS = {
    "ddp": Job("torchft_ddp.py", steps=300),
    # Steps are syncs: one fragment every 2 inner steps, LocalSGD every 4.
    "diloco": Job("torchft_diloco.py", steps=500),
    "local_sgd": Job("torchft_local_sgd.py", steps=400),
    "fsdp": Job("torchft_fsdp.py", steps=250, replicas=2, nproc=2, kill_every="3s"),
    # torchtitan's start-up: init_process_group() takes MASTER_PORT before the Manager.
    "torchtitan": Job(
        "torchft_fsdp.py", steps=250, replicas=2, nproc=2, kill_every="3s", args=("--torchtitan",)
    ),
}


@dataclass
class Run:
    """A finished `phalanx run`: its log, its ranks' step records, its groups' lives."""

    log: str
    records: list[dict]
    kills: int
    #: The pids of each group's restarted lives (not its first).
    restarted: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, log: str) -> Run:
        records = [r for _, r in reports(log) if r.get("event") == "step"]
        run = cls(log, records, log.count("chaos: SIGKILL"))
        seen: set[str] = set()
        for line in log.splitlines():
            if m := STARTED.match(line):
                if m[1] in seen:
                    run.restarted |= {int(p) for p in m[2].split(",")}
                seen.add(m[1])
        return run

    def tail(self) -> str:
        return "\n".join(self.log.splitlines()[-60:])

    def commits(self) -> dict[tuple[int, int, int], list[dict]]:
        """The committed records by (lineage, step, rank)."""
        by_key: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
        for r in self.records:
            if r["committed"]:
                by_key[(r["lineage"], r["step"], r["rank"])].append(r)
        return by_key


def reached(steps: int):
    """`run_until`'s condition: a group committed step `steps`."""

    def enough(lines: list[str]) -> bool:
        if not lines:
            return False
        prefix, _, rest = lines[-1].partition(" ")
        if not (prefix.startswith("[group") and rest.startswith('{"event": "step"')):
            return False
        record = json.loads(rest)
        return record["committed"] and record["step"] >= steps

    return enough


def run_job(job: Job) -> Run:
    return Run.of(run_until(job.command(), reached(job.steps), within=120))


def assert_one_state_per_step(run: Run, at_least: int) -> None:
    """I1: a (lineage, step, rank) committed by several lives carries one fingerprint;
    `at_least` steps were committed by two or more groups (the check is not empty)."""
    shared = 0
    for key, records in sorted(run.commits().items()):
        fingerprints = {r["fingerprint"] for r in records}
        assert len(fingerprints) == 1, (
            key,
            [(r["replica"], r["pid"], r["quorum_id"], r["fingerprint"]) for r in records],
        )
        shared += len({r["replica"] for r in records}) >= 2
    assert shared >= at_least, f"only {shared} steps were committed by two or more groups"


def assert_quorum_ids_never_go_down(run: Run) -> None:
    """I3, in each life: the quorums it committed in never go back."""
    lives: dict[int, list[int]] = defaultdict(list)
    for r in run.records:
        if r["committed"]:
            lives[r["pid"]].append(r["quorum_id"])
    for pid, ids in lives.items():
        assert ids == sorted(ids), f"pid {pid} committed in quorums {ids}"


def assert_the_loss_falls(run: Run) -> None:
    """Over the lineage that reached the last step: the mean loss of its last quarter
    of steps is below that of its first quarter."""
    last = max((r for r in run.records if r["committed"]), key=lambda r: r["step"])
    losses = [
        (r["step"], r["loss"])
        for r in run.records
        if r["lineage"] == last["lineage"] and r["loss"] is not None
    ]
    low, high = min(s for s, _ in losses), max(s for s, _ in losses)
    quarter = (high - low) / 4
    first = statistics.fmean(loss for s, loss in losses if s <= low + quarter)
    final = statistics.fmean(loss for s, loss in losses if s >= high - quarter)
    assert final < first, f"the loss did not fall: {first:.4f} in the first quarter, {final:.4f}"


def assert_a_killed_group_healed_and_caught_up(run: Run) -> None:
    """At least one group was killed and restarted; a restarted life healed in a step
    it committed, and committed a step that another group committed too."""
    assert run.kills >= 1 and run.restarted, run.tail()
    healed = [
        r for r in run.records if r["pid"] in run.restarted and r["committed"] and r["healed"]
    ]
    assert healed, f"no restarted group healed:\n{run.tail()}"
    caught_up = [
        key
        for key, records in run.commits().items()
        if any(r["pid"] in run.restarted for r in records)
        and len({r["replica"] for r in records}) >= 2
    ]
    assert caught_up, f"no restarted group committed a step with the others:\n{run.tail()}"


def assert_restarted_lives_commit_within(run: Run, seconds: float) -> None:
    """Each restarted life committed within `seconds` of its start, or ended (killed
    again, or the job finished) sooner: its heal, wherever the loop first waited on
    the quorum, did not cost it steps. A life's first record carries its start."""
    lives: dict[int, list[dict]] = defaultdict(list)
    for r in run.records:
        if r["pid"] in run.restarted:
            lives[r["pid"]].append(r)
    for pid, records in lives.items():
        first = next((r for r in records if r["committed"]), None)
        if first is None:
            lived = records[-1]["t_end"] - records[0]["t_life"]
            assert lived < seconds, f"pid {pid} lived {lived:.2f} s and never committed"
        else:
            took = first["t_end"] - first["t_life"]
            assert took < seconds, f"pid {pid} first committed {took:.2f} s after its start"


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(JOBS))
def test_a_torchft_script_trains_through_kills_with_one_state_per_step(name):
    job = JOBS[name]
    run = run_job(job)

    committed = [r for r in run.records if r["committed"]]
    assert committed and max(r["step"] for r in committed) >= job.steps, run.tail()
    assert "gave up" not in run.log, run.tail()
    assert_one_state_per_step(run, at_least=job.steps // 5)
    assert_quorum_ids_never_go_down(run)
    assert_the_loss_falls(run)
    assert_a_killed_group_healed_and_caught_up(run)
    assert_restarted_lives_commit_within(run, 2.0)
    if job.nproc > 1:
        assert {r["rank"] for r in committed} == set(range(job.nproc))


def record(replica: str, pid: int, step: int, fingerprint: str | None, **fields) -> dict:
    base = {"event": "step", "replica": replica, "rank": 0, "pid": pid, "step": step}
    base |= {"lineage": 0, "quorum_id": step, "loss": 1.0 / (step + 1), "healed": False}
    return base | {"committed": fingerprint is not None, "fingerprint": fingerprint} | fields


def run_of(*records: dict, restarted: tuple[int, ...] = (2,)) -> Run:
    return Run("[phalanx run] chaos: SIGKILL group1", list(records), 1, set(restarted))


def test_the_checks_fail_a_run_that_breaks_what_they_check():
    """The chaos tests are only as strong as these checks: each fails its case."""
    good = [
        *(
            record(g, pid, s, f"s{s}")
            for g, pid in (("group0", 1), ("group1", 2))
            for s in range(8)
        ),
        record("group1", 2, 8, "s8", healed=True),
        record("group0", 1, 8, "s8"),
    ]
    assert_one_state_per_step(run_of(*good), at_least=9)
    assert_quorum_ids_never_go_down(run_of(*good))
    assert_the_loss_falls(run_of(*good))
    assert_a_killed_group_healed_and_caught_up(run_of(*good))

    with pytest.raises(AssertionError, match="group1"):
        assert_one_state_per_step(run_of(*good, record("group1", 3, 4, "other")), at_least=1)
    with pytest.raises(AssertionError, match="only 0 steps"):
        assert_one_state_per_step(run_of(*good[:8]), at_least=1)
    with pytest.raises(AssertionError, match="quorums"):
        assert_quorum_ids_never_go_down(run_of(*good, record("group0", 1, 9, "s9", quorum_id=0)))
    rising = [r | {"loss": float(r["step"])} for r in good]
    with pytest.raises(AssertionError, match="did not fall"):
        assert_the_loss_falls(run_of(*rising))
    with pytest.raises(AssertionError, match="no restarted group healed"):
        assert_a_killed_group_healed_and_caught_up(run_of(*good[:-2]))
    with pytest.raises(AssertionError, match="with the others"):
        alone = record("group1", 2, 20, "s20", healed=True)
        assert_a_killed_group_healed_and_caught_up(run_of(*good[:8], alone))


@pytest.fixture(scope="module")
def refusals() -> dict:
    done = launch("--as-torchft", "--", str(PROCS / "torchft_refusals.py"), timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    [answer] = [r for _, r in reports(done.stdout) if r.get("event") == "refusals"]
    return answer


@pytest.mark.parametrize(
    ("attempt", "error", "named"),
    [
        ("start_quorum(allow_heal=False)", "ValueError", "allow_heal=False"),
        ("DiLoCo(fragment_update_alpha=0.5)", "ValueError", "fragment_update_alpha=0.5"),
        (
            "DistributedDataParallel(FIXED_WITH_SPARES)",
            "ValueError",
            "world_size_mode=FIXED_WITH_SPARES",
        ),
        ("DistributedDataParallel(process_group=)", "TypeError", "got process_group"),
        ("ProcessGroupXCCL()", "NotImplementedError", "ProcessGroupXCCL"),
        ("ProcessGroupGloo(pg=)", "ValueError", "ProcessGroupGloo(pg=...)"),
        ("torchft.coordination", "AttributeError", "use phalanx's own lighthouse"),
        ("import torchft.coordination", "ModuleNotFoundError", "phalanx.LighthouseServer"),
        ("import torchft.device_mesh", "ModuleNotFoundError", "set_all_reduce_hook"),
    ],
)
def test_what_phalanx_cannot_honour_is_refused_through_import_torchft_naming_it(
    refusals, attempt, error, named
):
    assert refusals["torchft"] == "phalanx.torchft"
    assert refusals[attempt] is not None, f"{attempt} was accepted"
    kind, message = refusals[attempt]
    assert kind == error and named in message, refusals[attempt]
    assert refusals["a step after them commits"] is True


@pytest.mark.parametrize(
    ("attempt", "named"),
    [
        ("from torchft import coordination", "phalanx.LighthouseServer"),
        pytest.param(
            "from torchft.process_group import ProcessGroupWrapper",
            "ManagedProcessGroup",
            marks=pytest.mark.xfail(
                strict=True,
                reason="`from MODULE import NAME` turns a module's AttributeError into a "
                "bare ImportError ('cannot import name'); only a package's missing "
                "submodule can say what to use instead",
            ),
        ),
    ],
)
def test_a_name_phalanx_lacks_imported_from_torchft_names_what_to_use(refusals, attempt, named):
    kind, message = refusals[attempt]
    assert named in message, message
