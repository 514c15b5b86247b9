"""examples/kubernetes/*.yaml, checked offline: no cluster runs here. The manifests
parse, every container's command is a `phalanx` command whose flags phalanx's own
parsers accept, with the values given, every `$(VAR)` they use is a variable of the
container, every PHALANX_* variable they set is one phalanx reads, and the groups
reach the lighthouse by the Service and port that lighthouse.yaml defines.

What this cannot show: that Kubernetes schedules the pods, that pod IPs reach each
other, or that a replaced pod heals; tests/test_hosts.py runs groups on addresses of
their own, and tests/test_slurm.py the same job under a real scheduler.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from phalanx.launcher.config import LaunchConfig, build_parser
from phalanx.settings import ManagerSettings
from phalanx.token import resolve_token

from conftest import child_env

MANIFESTS = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
#: A stand-in for what each kind of `valueFrom` gives a container when it runs.
SAMPLE_VALUES = {
    "fieldRef": "10.0.0.7",  # status.podIP; the completion index is given below
    "secretKeyRef": "a-job-token-from-the-secret-0123456789",
}


def documents() -> list[dict]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        with open(path) as f:
            docs += [doc for doc in yaml.safe_load_all(f) if doc is not None]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def containers() -> list[dict]:
    """Every container of every pod template (Deployment, Job)."""
    return [
        c
        for doc in documents()
        if "template" in doc.get("spec", {})
        for c in doc["spec"]["template"]["spec"]["containers"]
    ]


def container(command: str) -> dict:
    (found,) = [c for c in containers() if c["command"][:2] == ["phalanx", command]]
    return found


def environment(c: dict) -> dict[str, str]:
    """The container's variables, with the value each would have in a pod."""
    env = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        (source,) = var["valueFrom"]
        path = var["valueFrom"][source].get("fieldPath", "")
        env[var["name"]] = "0" if "job-completion-index" in path else SAMPLE_VALUES[source]
    return env


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` as Kubernetes expands them: `$(VAR)` by the container's variable (an
    unknown one stays as it is, which this test refuses)."""
    unknown = [name for a in args for name in re.findall(r"\$\((\w+)\)", a) if name not in env]
    assert not unknown, f"$(...) of no variable of the container: {unknown}"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def run_argv() -> tuple[list[str], list[str], dict[str, str]]:
    """The groups' `phalanx run` as pod 0 runs it: its own arguments, the training
    command after `--`, and its variables."""
    c = container("run")
    env = environment(c)
    argv = expanded(c["args"], env)
    split = argv.index("--")
    return argv[:split], argv[split + 1 :], env


def test_every_manifest_parses_and_names_what_it_is() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "Job"}
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"], doc
    for c in containers():
        assert c["command"][0] == "phalanx", c["command"]
        assert c["command"][1] in {"run", "lighthouse"}, c["command"]


def test_the_lighthouse_accepts_its_flags_and_variables() -> None:
    c = container("lighthouse")
    env = environment(c)
    args = expanded(c["args"], env)
    # The lighthouse's own parser (the Rust core's) checks every flag and value in
    # order; --help at the end is reached only when all of them were accepted.
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "lighthouse", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**child_env(), **env},
    )
    assert done.returncode == 0, f"phalanx lighthouse {' '.join(args)}: {done.stderr}"
    for name in (n for n in env if n.startswith("PHALANX_")):
        assert f"env: {name}" in done.stdout, f"the lighthouse reads no {name}"


def test_the_groups_accept_their_flags_variables_and_training_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    own, command, env = run_argv()
    try:
        args = build_parser().parse_args(own)
    except SystemExit:
        pytest.fail(f"phalanx run refuses {own}")
    config = LaunchConfig.from_args(args, command)
    assert config.replica_ids() == ["group-0"], "pod 0 is group-0"
    # A launcher joining a lighthouse elsewhere refuses to start without a token.
    assert config.lighthouse and resolve_token(args.token, args.token_file, env)

    # Every other PHALANX_* variable is one each rank reads: it changes its settings.
    plain = ManagerSettings.from_env({}, replica_id="group-0", lighthouse=config.lighthouse)
    for name in (n for n in env if n.startswith("PHALANX_") and n != "PHALANX_TOKEN"):
        read = ManagerSettings.from_env(
            {name: env[name]}, replica_id="group-0", lighthouse=config.lighthouse
        )
        assert read != plain, f"a rank reads no {name}"

    # The training command: the demo's script, with arguments its parser accepts.
    assert command[:3] == ["python", "-m", "phalanx.demo.train"], command
    from phalanx.demo import train

    monkeypatch.setattr(sys, "argv", ["train.py", *command[3:]])
    try:
        train.parse_args()
    except SystemExit:
        pytest.fail(f"phalanx.demo.train refuses {command[3:]}")


def test_the_groups_reach_the_lighthouse_by_its_service() -> None:
    (service,) = by_kind("Service")
    (port,) = service["spec"]["ports"]
    args = build_parser().parse_args(run_argv()[0])
    assert args.lighthouse == f"{service['metadata']['name']}:{port['port']}"
    lighthouse = container("lighthouse")
    (target,) = [p for p in lighthouse["ports"] if p["name"] == port["targetPort"]]
    bind = [a for a in lighthouse["args"] if a.startswith("--bind=")]
    assert bind == [f"--bind=0.0.0.0:{target['containerPort']}"]
    (deployment,) = by_kind("Deployment")
    assert deployment["spec"]["replicas"] == 1, "one lighthouse: two would each hand out quorums"
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    (job,) = by_kind("Job")
    assert job["spec"]["completions"] == job["spec"]["parallelism"], "every group runs at once"
