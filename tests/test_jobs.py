"""One lighthouse, many jobs: real Managers of two jobs train side by side on one
lighthouse, each job with its own quorums, rules and token; `phalanx token --job` and
`phalanx run --job` hand them out."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

import phalanx
from phalanx import _core

from conftest import PROCS, TESTS, child_env, http_get, in_groups, leave_together

SECRET = "the-lighthouse-secret"
STEPS = 3


def train(lighthouse: phalanx.LighthouseServer, job: str, rules: str | None):
    """A function for `in_groups`: group `name` of job `job` runs STEPS steps of an
    all-reduce of its own number; returns (job, name, [(participants, sum)]) ."""

    def group(name: str, barrier: threading.Barrier):
        manager = phalanx.Manager(
            replica_id=name,
            lighthouse=lighthouse.address,
            timeout=10.0,
            job=job,
            job_rules=rules,
            token=_core.job_token(SECRET, job),
        )
        seen = []
        try:
            for _ in range(STEPS):
                manager.start_quorum()
                total = torch.tensor([float(name[-1])])
                manager.allreduce(total, average=False).wait()
                seen.append((manager.num_participants(), total.item()))
                assert manager.should_commit()
        finally:
            leave_together(manager, barrier)
        return job, name, seen

    return group


def test_two_jobs_train_side_by_side_on_one_lighthouse_each_behind_its_own_token():
    with phalanx.LighthouseServer(token=SECRET, join_timeout=0.2) as lighthouse:
        # The same replica ids in both jobs: each job has its own. Both wait for their
        # two groups (with one, the first to ask would go a step ahead alone), b longer
        # than the lighthouse's 0.2 s for a late one.
        jobs = {
            "a": ("min_replicas=2", ("g1", "g2")),
            "b": ("min_replicas=2,join_timeout_ms=5000", ("g3", "g4")),
        }
        results = {}
        errors = []

        def run(job: str) -> None:
            rules, names = jobs[job]
            try:
                results[job] = in_groups(train(lighthouse, job, rules), names)
            except Exception as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        # Each job reduced over its own two groups only: 1+2 in a, 3+4 in b.
        for job, expected in (("a", 3.0), ("b", 7.0)):
            for _, _, seen in results[job]:
                assert seen[-1] == (2, expected), (job, seen)

        # a's token sees a's job only; the lighthouse's sees both and the default.
        a_token = _core.job_token(SECRET, "a")
        status = _core.LighthouseClient(lighthouse.address, token=a_token, job="a").status(5.0)
        assert (status.min_replicas, status.join_timeout_ms) == (2, 200)
        b_token = _core.job_token(SECRET, "b")
        status = _core.LighthouseClient(lighthouse.address, token=b_token, job="b").status(5.0)
        assert (status.min_replicas, status.join_timeout_ms) == (2, 5000)
        # A job that declares no rules at all runs by the lighthouse's.
        c = _core.LighthouseClient(lighthouse.address, token=_core.job_token(SECRET, "c"), job="c")
        assert [m.replica_id for m in c.quorum("g1", timeout=5.0).participants] == ["g1"]
        status = c.status(5.0)
        assert (status.min_replicas, status.join_timeout_ms) == (1, 200)
        code, body = http_get(f"{lighthouse.status_url}status?job=b", token=a_token)
        assert code == 401, body
        code, body = http_get(f"{lighthouse.status_url}status?job=b", token=SECRET)
        assert code == 200, body
        page = json.loads(body)
        assert page["min_replicas"] == 2
        assert sorted(j["job"] for j in page["jobs"]) == ["a", "b", "c", "default"]
        with pytest.raises(PermissionError, match="token for job b"):
            _core.LighthouseClient(lighthouse.address, token=a_token, job="b").status(5.0)


def test_a_group_declaring_other_rules_than_its_job_is_refused_naming_both():
    with phalanx.LighthouseServer(join_timeout=0.2) as lighthouse:
        first = _core.LighthouseClient(lighthouse.address, job="a", job_rules="min_replicas=1")
        first.quorum("g1", timeout=5.0)
        other = _core.LighthouseClient(lighthouse.address, job="a", job_rules="min_replicas=2")
        with pytest.raises(Exception, match="job a runs with min_replicas=1") as refused:
            other.quorum("g2", timeout=5.0)
        assert "declares min_replicas=2" in str(refused.value)


@pytest.mark.parametrize(
    ("job", "rules", "says"),
    [
        ("a b", None, "has ' ' at byte 1"),
        ("x" * 65, None, "65 bytes long"),
        ("a", "min_replica=2", "no such key"),
        ("a", "join_timeout_ms=0", "1 to 86400000"),
    ],
)
def test_a_bad_job_name_or_rule_is_refused_before_anything_starts(job, rules, says):
    with pytest.raises(ValueError, match=says):
        phalanx.Manager(replica_id="g", lighthouse="127.0.0.1:1", job=job, job_rules=rules)


def phalanx_token(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "token", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**child_env(), **(env or {})},
    )


def test_phalanx_token_writes_a_jobs_token_from_the_lighthouses(tmp_path):
    secret = tmp_path / "lighthouse.token"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    out = tmp_path / "a.token"
    done = phalanx_token("--job", "a", "--lighthouse-token-file", str(secret), str(out))
    assert done.returncode == 0, done.stderr
    assert "the token of job a" in done.stdout
    assert out.read_text().strip() == _core.job_token(SECRET, "a")
    assert out.stat().st_mode & 0o777 == 0o600

    for args, says in [
        (["--job", "a", str(tmp_path / "b.token")], "needs the lighthouse's own token"),
        (
            ["--job", "default", "--lighthouse-token-file", str(secret), str(tmp_path / "c")],
            "the default job has no token of its own",
        ),
        (
            ["--job", "a/b", "--lighthouse-token-file", str(secret), str(tmp_path / "d")],
            "'/' at byte 1",
        ),
    ]:
        done = phalanx_token(*args, env={"PHALANX_TOKEN": "", "PHALANX_TOKEN_FILE": ""})
        assert done.returncode == 2, done
        assert says in done.stderr, done.stderr


def test_phalanx_run_job_names_the_job_and_its_rules_to_every_rank():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--job",
            "llama",
            "--min-replicas",
            "1",
            "--",
            str(PROCS / "launched_rank.py"),
            "0",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if '"pid"' in line)
    reported = json.loads(line.partition(" ")[2])
    assert reported["PHALANX_JOB"] == "llama"
    assert reported["PHALANX_JOB_RULES"].startswith("min_replicas=1,join_timeout_ms=")
