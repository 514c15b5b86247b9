"""The Slurm example, submitted to a real Slurm: a one-machine cluster (munged,
slurmctld and one slurmd per node, several nodes on this host on ports of their own)
that the fixture starts from Debian's packages with a slurm.conf of its own in a temporary
folder, and stops at the end. The job is examples/slurm/phalanx.sbatch, made small
(three nodes of one rank, a tiny model) by sbatch options and its environment only.

While it trains, one node's ranks are SIGKILLed (their PIDs from the job's own step
log, checked against `scontrol listpids`) and come back and heal; one task (a node's
`phalanx run`) is SIGKILLed and the job goes on without it; then `scancel` of the job
must end every process of it. Every committed step has one fingerprint throughout.

Needs root and the packages `slurm-wlm` and `munge` (CI installs both; elsewhere the
test is skipped, saying so).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import child_env, free_port, wait_until

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm" / "phalanx.sbatch"
NODES = ("n1", "n2", "n3")
#: Where Debian puts the daemons; not always on a user's PATH.
SBIN = os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")])
PROGRAMS = (
    "mungekey",
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "scancel",
    "squeue",
    "sinfo",
)
#: Small enough for 2 cores shared by three groups, the lighthouse and the daemons.
TRAIN = "-m phalanx.demo.train --dim 32 --layers 1 --seq-len 32 --batch-size 4 --steps 100000"
#: Each phase's bound: a group's first start imports torch; on 2 cores, three at once.
START_BOUND = 60.0
PHASE_BOUND = 30.0


def missing_slurm() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "starting munged, slurmctld and slurmd takes root (CI runs as root); not root here"
    missing = [p for p in PROGRAMS if shutil.which(p, path=SBIN) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge)"
    return None


def program(name: str) -> str:
    return shutil.which(name, path=SBIN) or name


@dataclass
class Cluster:
    """A Slurm cluster on this host: munged, slurmctld and one slurmd per node, every
    one a child of this process, every file in `root`, every port on loopback."""

    root: Path
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "run" / "munge.socket"
        self.logs = self.root / "log"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm command (and of the jobs it submits)."""
        return {**child_env(), "SLURM_CONF": str(self.conf), "PATH": SBIN}

    def command(self, *argv: str, timeout: float = 15.0) -> str:
        """Runs a Slurm command against this cluster; its stdout, or the test fails."""
        done = subprocess.run(
            [program(argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )
        if done.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def write_conf(self) -> None:
        # munged wants its key closed to others and its socket's folder open to all.
        for folder, mode in (("key", 0o700), ("run", 0o755), ("ctld", 0o700), ("log", 0o755)):
            (self.root / folder).mkdir(mode=mode)
            (self.root / folder).chmod(mode)
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True)
        r = self.root
        lines = [
            "ClusterName=phalanx-test",
            f"SlurmctldHost={os.uname().nodename.split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={r}/ctld",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={self.logs}/slurmctld.log",
            f"SlurmdLogFile={self.logs}/slurmd-%n.log",
            # No cgroups (a container may not offer them): processes are tracked by
            # parentage, which is what scancel and listpids go by.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # The nodes say what is configured, not what the host has (all share it).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # SIGTERM, then SIGKILL 5 s later (30 s by default): the job's own stop.
            "KillWait=5",
        ]
        # Several nodes on this host: one slurmd each, told apart by its port.
        for node in NODES:
            lines.append(
                f"NodeName={node} NodeHostname={os.uname().nodename} NodeAddr=127.0.0.1 "
                f"Port={free_port()} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1"
            )
        lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        self.write_conf()
        key = self.root / "key" / "munge.key"
        self.command("mungekey", "--create", f"--keyfile={key}")
        # --force: munged wants the socket's every parent folder open to all users, and
        # pytest's temporary folder is closed to others (this test's clients are root).
        self.spawn(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'run' / 'munged.pid'}",
            f"--log-file={self.logs / 'munged.log'}",
            f"--seed-file={self.root / 'key' / 'munged.seed'}",
        )
        wait_until(lambda: self.running() and self.socket.exists(), 10, "munged's socket")
        # -i: a fresh state folder has no state to recover; say nothing of it.
        self.spawn("slurmctld", "slurmctld", "-D", "-i")
        for node in NODES:
            self.spawn(f"slurmd-{node}", "slurmd", "-D", "-N", node)
        wait_until(lambda: self.idle_nodes() == set(NODES), 30, f"nodes {NODES} idle")

    def spawn(self, name: str, *argv: str) -> None:
        with open(self.logs / f"{name}.out", "w") as out:
            self.daemons[name] = subprocess.Popen(
                [program(argv[0]), *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def running(self) -> bool:
        """True while every daemon runs; fails the test once one has exited."""
        exited = [name for name, d in self.daemons.items() if d.poll() is not None]
        if exited:
            pytest.fail(f"{', '.join(exited)} exited\n{self.describe()}")
        return True

    def idle_nodes(self) -> set[str]:
        self.running()
        done = subprocess.run(
            [program("sinfo"), "--noheader", "--Node", "--format=%N %t"],
            capture_output=True,
            text=True,
            timeout=10,
            env=self.env,
        )
        rows = [line.split() for line in done.stdout.splitlines()]
        return {row[0] for row in rows if len(row) == 2 and row[1] == "idle"}

    def stop(self) -> None:
        """Stops the daemons, slurmds first, munged last; kills one that does not stop."""
        for name in reversed(list(self.daemons)):
            daemon = self.daemons[name]
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=5)

    def describe(self) -> str:
        """The last lines every daemon wrote (its log files, in `root`, say the same
        at more length), for a failure message."""
        parts = []
        for log in sorted(self.logs.glob("*.out")):
            tail = log.read_text(errors="replace").splitlines()[-8:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = missing_slurm()
    if why:
        assert not os.environ.get("PHALANX_CI"), f"CI must run the Slurm test: {why}"
        pytest.skip(why)
    started = Cluster(tmp_path / "slurm")
    started.root.mkdir()
    try:
        started.start()
        yield started
    finally:
        started.stop()


# -- the job -------------------------------------------------------------------------


@dataclass
class Job:
    """A submitted job, its step log read from its output file as it grows."""

    cluster: Cluster
    id: str
    output: Path
    records: list[dict] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    _offset: int = 0

    def read(self) -> list[dict]:
        """Reads what the job printed since the last call; every step record so far."""
        if self.output.exists():
            with open(self.output, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            # Only whole lines; a partial one is read again next time.
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(whole)
            for raw in whole.decode(errors="replace").splitlines():
                # `phalanx run` prefixes its ranks' lines with "[group-1/0] ".
                _, _, record = raw.partition("] ")
                try:
                    line = json.loads(record)
                except ValueError:
                    line = None
                if isinstance(line, dict) and line.get("event") == "step":
                    self.records.append(line)
                else:
                    self.text.append(raw)
        return self.records

    def committed(self, replica: str | None = None, since: int = 0) -> list[dict]:
        """Committed steps (of `replica`), among the records from index `since` on."""
        return [
            r
            for r in self.read()[since:]
            if r["committed"] and (replica is None or r["replica"] == replica)
        ]

    def state(self) -> str:
        out = self.cluster.command("squeue", "--noheader", f"--jobs={self.id}", "--format=%T")
        return out.strip()

    def pids(self, node: str) -> dict[int, str]:
        """The job's processes on `node` (`scontrol listpids`): PID → the step they are
        of, with the task's local id when the process is a task itself ("0.task0")."""
        done = subprocess.run(
            [program("scontrol"), "listpids", self.id, node],
            capture_output=True,
            text=True,
            timeout=10,
            env=self.cluster.env,
        )
        pids = {}
        for line in done.stdout.splitlines()[1:]:
            pid, _job, step, local, _global = line.split()
            pids[int(pid)] = step if local == "-" else f"{step}.task{local}"
        return pids

    def wait(self, condition: Callable[[], object], timeout: float, what: str) -> None:
        """`wait_until`, failing with the job's output and the daemons' logs as they
        are when the time is up."""
        try:
            wait_until(condition, timeout, what)
        except pytest.fail.Exception as e:
            pytest.fail(f"{e}\n{self.describe()}")

    def node_of(self, pid: int) -> str | None:
        return next((n for n in NODES if pid in self.pids(n)), None)

    def describe(self, last: int = 20) -> str:
        self.read()
        steps = "\n".join(json.dumps(r) for r in self.records[-6:])
        return (
            f"--- job {self.id} output (last {last} other lines) ---\n"
            + "\n".join(self.text[-last:])
            + f"\n--- last step records ---\n{steps}\n{self.cluster.describe()}"
        )


def submit(cluster: Cluster, out: Path) -> Job:
    """examples/slurm/phalanx.sbatch, as it is, made small from outside: three nodes,
    one rank each, one CPU a task, a tiny model, every address on loopback."""
    env = {
        **cluster.env,
        "NPROC_PER_NODE": "1",
        "TRAIN_COMMAND": f"{sys.executable} {TRAIN}",
        "PHALANX_LIGHTHOUSE_PORT": str(free_port()),
        # All nodes are this host: its loopback is an address every node reaches.
        "LIGHTHOUSE_HOST": "127.0.0.1",
        "LIGHTHOUSE_BIND_HOST": "127.0.0.1",
        "PHALANX_ADVERTISE_HOST": "127.0.0.1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), SBIN]),
    }
    done = subprocess.run(
        [
            program("sbatch"),
            "--parsable",
            f"--nodes={len(NODES)}",
            "--cpus-per-task=1",
            # Slurm's own bound on the job, should the test's cleanup fail.
            "--time=5",
            f"--output={out}",
            f"--chdir={out.parent}",
            str(SBATCH),
        ],
        capture_output=True,
        text=True,
        timeout=15,
        env=env,
    )
    assert done.returncode == 0, f"sbatch failed: {done.stderr}"
    return Job(cluster, done.stdout.strip().split(";")[0], out)


def split_steps(committed: list[dict]) -> dict[tuple[int, int], set[str]]:
    """(lineage, step) committed with more than one fingerprint."""
    states: dict[tuple[int, int], set[str]] = {}
    for r in committed:
        states.setdefault((r.get("lineage", 0), r["step"]), set()).add(r["fingerprint"])
    return {key: fps for key, fps in states.items() if len(fps) > 1}


def started_at(pids: Iterable[int]) -> dict[int, str]:
    """The start time of each of `pids` still running."""
    starts = {pid: process_start(pid) for pid in pids}
    return {pid: started for pid, started in starts.items() if started}


def alive(pid: int, started: str) -> bool:
    """Whether process `pid` is still the one that had start time `started`."""
    return process_start(pid) == started


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None if gone:
    a PID and its start time name one process, even once the PID is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@pytest.mark.slow
def test_sbatch_example_survives_a_killed_node_and_a_lost_task_and_scancel_ends_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    job = submit(cluster, tmp_path / "job.out")
    try:
        run_the_job_through_failures(job)
    finally:
        if job.state():
            subprocess.run(
                [program("scancel"), "--signal=KILL", "--full", job.id],
                env=cluster.env,
                timeout=10,
                check=False,
            )
            wait_until(lambda: not job.state(), 30, f"job {job.id} gone after SIGKILL")


def run_the_job_through_failures(job: Job) -> None:
    groups = [f"group-{i}" for i in range(len(NODES))]

    def all_in(since: int) -> bool:
        return all(
            any(r["participants"] == len(groups) for r in job.committed(g, since)) for g in groups
        )

    job.wait(lambda: all_in(0), START_BOUND, "the three groups commit together")
    # -- one node's ranks SIGKILLed: its `phalanx run` restarts them, they heal -------
    victim = job.committed("group-1")[-1]["pid"]
    node = job.node_of(victim)
    assert node, f"rank {victim} of group-1 is not among the job's processes in Slurm"
    mark = len(job.read())
    os.kill(victim, 9)
    job.wait(
        lambda: any(r["healed"] and r["pid"] != victim for r in job.committed("group-1", mark)),
        PHASE_BOUND,
        f"group-1 back on {node} with new ranks, healed",
    )
    mark = len(job.read())
    job.wait(lambda: all_in(mark), PHASE_BOUND, "the three groups commit together again")

    # -- one task SIGKILLed (a node's `phalanx run`): the others train on --------------
    rank = job.committed("group-2")[-1]["pid"]
    node = job.node_of(rank)
    assert node, f"rank {rank} of group-2 is not among the job's processes in Slurm"
    tasks = [pid for pid, step in job.pids(node).items() if step.endswith(".task0")]
    assert len(tasks) == 1, f"one task of the job on {node}: {job.pids(node)}"
    # The task's every process (its launcher, fork server and rank) must end with it.
    of_task = started_at(job.pids(node))
    assert rank in of_task and len(of_task) >= 3, f"group-2's processes on {node}: {of_task}"
    os.kill(tasks[0], 9)
    job.wait(
        lambda: not any(alive(pid, started) for pid, started in of_task.items()),
        15,
        f"every process of group-2's task on {node} ends with it: {sorted(of_task)}",
    )
    mark = len(job.read())
    job.wait(
        lambda: len({r["step"] for r in job.committed("group-0", mark)}) >= 20,
        PHASE_BOUND,
        "group-0 commits 20 more steps without group-2",
    )
    assert job.state() == "RUNNING", job.describe()
    assert not job.committed("group-2", mark), "group-2 committed without its launcher"

    # -- scancel of the job: every process of it ends ----------------------------------
    listed = {node: job.pids(node) for node in NODES}
    steps = Counter(step.split(".")[0] for pids in listed.values() for step in pids.values())
    # The batch step: the script, the lighthouse and srun; step 0 on the two nodes
    # left: a launcher, a fork server and a rank each.
    assert steps["batch"] >= 3 and steps["0"] >= 6, f"the job's processes: {listed}"
    processes = started_at([pid for pids in listed.values() for pid in pids])
    processes |= started_at([r["pid"] for r in job.read()])
    job.cluster.command("scancel", job.id)
    job.wait(lambda: not job.state(), 30, f"job {job.id} gone after scancel")
    job.wait(
        lambda: not [pid for pid, started in processes.items() if alive(pid, started)],
        15,
        f"every process of job {job.id} ended: {sorted(processes)}",
    )

    committed = job.committed()
    assert not split_steps(committed), f"steps with two fingerprints: {split_steps(committed)}"
    assert len({r["step"] for r in committed}) >= 40, job.describe()
