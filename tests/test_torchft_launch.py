"""`phalanx run --as-torchft` and `phalanx torchft-path`: a script written for torchft
imports `torchft` and gets phalanx.torchft, in real rank processes."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
import phalanx._torchft_alias.torchft as alias
from phalanx._torchft_alias.torchft import ALIAS_DIR
from phalanx.torchft import INSTEAD, SUBMODULES

from conftest import TESTS, child_env, free_port

TORCHFT_PACKAGE = Path(phalanx.__file__).parent / "torchft"

#: A rank of a torchft script, reduced to what it sees: its environment and, with
#: --import, what `import torchft` gives it.
RANK = """
import importlib.util
import json
import os
import sys

keys = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE",
        "PHALANX_LIGHTHOUSE", "PHALANX_REPLICA_ID", "PYTHONPATH")
facts = {k: os.environ.get(k) for k in keys}
if "--import" in sys.argv:
    import torchft
    import phalanx.torchft

    facts["name"] = torchft.__name__
    facts["is_phalanx"] = torchft is phalanx.torchft
    facts["submodules"] = list(torchft.SUBMODULES)
    facts["same_module"] = {
        name: sys.modules.get(f"torchft.{name}") is sys.modules.get(f"phalanx.torchft.{name}")
        is not None
        for name in torchft.SUBMODULES
    }
    if facts["same_module"].get("manager"):
        from torchft.manager import Manager

        facts["manager"] = [Manager.__module__, Manager is torchft.Manager]
    if facts["same_module"].get("local_sgd"):
        import torchft.local_sgd

        facts["local_sgd"] = torchft.local_sgd.__name__
else:
    spec = importlib.util.find_spec("torchft")
    facts["torchft_origin"] = spec.origin if spec else None
print(json.dumps(facts), flush=True)
"""


def run_launcher(*args: str, env: dict[str, str] | None = None, timeout: float = 90.0):
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**child_env(), **(env or {})},
        cwd=TESTS.parent,
        stdin=subprocess.DEVNULL,
    )


def rank_facts(stdout: str) -> dict[str, dict]:
    """Each rank's printed facts, by its output's prefix ("group0/0")."""
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if prefix.startswith("[group") and rest.startswith("{"):
            out[prefix.strip("[]")] = json.loads(rest)
    return out


@pytest.fixture
def rank_script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


@pytest.fixture
def fake_torchft(tmp_path: Path) -> Path:
    """A folder holding a package named torchft, as a real install would."""
    folder = tmp_path / "elsewhere"
    (folder / "torchft").mkdir(parents=True)
    (folder / "torchft" / "__init__.py").write_text("raise SystemExit('the fake torchft ran')\n")
    return folder


def test_every_rank_knows_its_group_index_and_the_group_count_without_the_flag(rank_script):
    done = run_launcher("--replicas", "2", "--", str(rank_script))

    assert done.returncode == 0, done.stdout + done.stderr
    seen = rank_facts(done.stdout)
    assert sorted(seen) == ["group0/0", "group1/0"]
    for prefix, facts in seen.items():
        assert facts["REPLICA_GROUP_ID"] == prefix[len("group")], facts
        assert facts["NUM_REPLICA_GROUPS"] == "2"
        # Only --as-torchft touches `import torchft` and TORCHFT_LIGHTHOUSE.
        assert facts["TORCHFT_LIGHTHOUSE"] is None
        origin = facts["torchft_origin"]
        assert origin is None or not origin.startswith(ALIAS_DIR), origin


# Forked ranks inherit the fork server's sys.path, fixed when it started: both ways.
@pytest.mark.parametrize(
    "fork_server", ["--fork-server", pytest.param("--no-fork-server", marks=pytest.mark.slow)]
)
def test_as_torchft_makes_import_torchft_phalanx_torchft_in_every_rank(rank_script, fork_server):
    done = run_launcher(
        "--as-torchft", fork_server, "--replicas", "2", "--", str(rank_script), "--import"
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"`import torchft` in the ranks is phalanx.torchft ({ALIAS_DIR})" in done.stdout
    seen = rank_facts(done.stdout)
    assert sorted(seen) == ["group0/0", "group1/0"], done.stdout
    for prefix, facts in seen.items():
        assert facts["name"] == "phalanx.torchft"
        assert facts["is_phalanx"] is True
        assert facts["submodules"] == list(SUBMODULES)
        assert facts["TORCHFT_LIGHTHOUSE"] == facts["PHALANX_LIGHTHOUSE"]
        assert facts["TORCHFT_LIGHTHOUSE"].startswith("127.0.0.1:")
        assert facts["PYTHONPATH"].split(":")[0] == ALIAS_DIR
        assert facts["REPLICA_GROUP_ID"] == prefix[len("group")]
        assert facts["NUM_REPLICA_GROUPS"] == "2"

    # The submodules: the same objects under both names, once phalanx.torchft has them.
    missing = [
        name
        for name in SUBMODULES
        if not (TORCHFT_PACKAGE / f"{name}.py").exists()
        and not (TORCHFT_PACKAGE / name / "__init__.py").exists()
    ]
    for facts in seen.values():
        for name, same in facts["same_module"].items():
            assert same is (name not in missing), (name, facts)
        if "manager" not in missing:
            assert facts["manager"] == ["phalanx.torchft.manager", True]
        if "local_sgd" not in missing:
            assert facts["local_sgd"] == "phalanx.torchft.local_sgd"
    if missing:
        pytest.skip(f"phalanx.torchft has no {', '.join(missing)} yet: not checked")


def test_as_torchft_refuses_before_any_group_starts_when_a_real_torchft_is_importable(
    rank_script, fake_torchft
):
    done = run_launcher(
        "--as-torchft",
        "--replicas",
        "2",
        "--",
        str(rank_script),
        "--import",
        env={"PYTHONPATH": str(fake_torchft)},
        timeout=30,
    )

    assert done.returncode == 2, done.stdout + done.stderr
    assert f"a real torchft can be imported from {fake_torchft / 'torchft'}" in done.stderr
    assert f"phalanx's torchft alias ({ALIAS_DIR})" in done.stderr
    assert "pip uninstall torchft torchft-nightly" in done.stderr
    assert "drop --as-torchft" in done.stderr
    assert "started" not in done.stdout and "lighthouse at" not in done.stdout
    assert "Traceback" not in done.stderr


def torchft_path() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "torchft-path"],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def python_with(pythonpath: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**child_env(), "PYTHONPATH": pythonpath},
        cwd="/",
    )


def test_torchft_path_is_the_environment_switch_for_other_launchers():
    path = torchft_path()
    assert path == ALIAS_DIR
    # Never on sys.path by itself: without the switch, `import torchft` is not ours.
    assert all(Path(p).resolve() != Path(path).resolve() for p in sys.path if p)

    done = python_with(
        path,
        "import sys, torchft, phalanx.torchft, torchft.data\n"
        "assert torchft is phalanx.torchft\n"
        "assert torchft.data is sys.modules['phalanx.torchft.data']\n"
        "print(torchft.__name__)",
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "phalanx.torchft"


@pytest.mark.slow
def test_a_torchft_module_imported_again_is_still_phalanxs_own():
    # What SUBMODULES does not register (a module dropped from sys.modules here; in
    # real code, one deeper down) is found as the phalanx module itself, which keeps
    # its own spec: no file of phalanx.torchft runs twice under two names.
    done = python_with(
        torchft_path(),
        "import importlib, sys, torchft\n"
        "del sys.modules['torchft.data']\n"
        "import torchft.data as data\n"
        "assert data is sys.modules['phalanx.torchft.data'], data\n"
        "assert data.__spec__.name == 'phalanx.torchft.data', data.__spec__\n"
        "for name in ('no_such_module', 'coordination'):\n"
        "    try:\n"
        "        importlib.import_module(f'torchft.{name}')\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(e.name, '|', e)\n",
    )

    assert done.returncode == 0, done.stderr
    missing, torchft_only = done.stdout.strip().splitlines()
    assert missing.startswith("torchft.no_such_module |")
    assert torchft_only.startswith("None | phalanx.torchft has no 'coordination'")
    assert "use phalanx's own lighthouse and manager bindings" in torchft_only


def test_torchfts_checkpointing_modules_import_as_its_examples_write_them():
    # torchft's train_ddp.py and train_diloco.py import the transports from the
    # package's modules, not from the package.
    done = python_with(
        torchft_path(),
        "from torchft.checkpointing.pg_transport import PGTransport\n"
        "from torchft.checkpointing.http_transport import HTTPTransport\n"
        "from torchft.checkpointing.transport import CheckpointTransport\n"
        "import torchft.checkpointing.pg_transport as module\n"
        "import torchft, phalanx.torchft.checkpointing as ours\n"
        "assert PGTransport is ours.PGTransport is torchft.checkpointing.PGTransport\n"
        "assert HTTPTransport is ours.HTTPTransport\n"
        "assert issubclass(PGTransport, CheckpointTransport)\n"
        "assert module.__spec__.name == 'phalanx.torchft.checkpointing.pg_transport'\n"
        "print('ok')\n",
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


#: torchft's public modules (torchft-nightly, 2026-10): phalanx's own, or refused by name.
TORCHFT_MODULES = (
    "manager", "process_group", "ddp", "optim", "data", "local_sgd", "checkpointing",
    "checkpointing.transport", "checkpointing.http_transport", "checkpointing.pg_transport",
    "coordination", "device_mesh", "parameter_server", "collectives", "futures", "otel",
    "work", "fsdp", "fsdp.fault_tolerance", "quantization", "http", "multiprocessing",
    "comms", "torchcomms", "torchx", "utils",
)  # fmt: skip


def test_every_torchft_module_is_phalanxs_or_refused_by_name():
    done = python_with(
        torchft_path(),
        "import importlib, json, sys\n"
        f"for name in {TORCHFT_MODULES!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(f'torchft.{name}')\n"
        "        print(json.dumps([name, module.__name__]))\n"
        "    except ModuleNotFoundError as e:\n"
        "        print(json.dumps([name, str(e)]))\n",
    )

    assert done.returncode == 0, done.stderr
    seen = dict(json.loads(line) for line in done.stdout.splitlines())
    assert list(seen) == list(TORCHFT_MODULES)
    for name, what in seen.items():
        top = name.split(".")[0]
        if top in INSTEAD:
            assert what == f"phalanx.torchft has no {top!r} (torchft.{top}); use {INSTEAD[top]}"
        else:
            assert what == f"phalanx.torchft.{name}", (name, what)


def test_the_alias_refuses_a_real_torchft_naming_both(fake_torchft):
    done = python_with(f"{torchft_path()}:{fake_torchft}", "import torchft")

    assert done.returncode == 1
    assert "the fake torchft ran" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: a real torchft can be imported from "), last
    assert str(fake_torchft / "torchft") in last and ALIAS_DIR in last
    assert "pip uninstall torchft torchft-nightly" in last


#: How people start a script, each with the alias on PYTHONPATH and a real torchft in
#: the script's own folder: `{d}` is that folder.
START_FORMS = {
    "python": ["{python}", "{d}/train.py"],
    "python -u": ["{python}", "-u", "{d}/train.py"],
    "python -X dev": ["{python}", "-X", "dev", "{d}/train.py"],
    "python -m": ["sh", "-c", "cd {d} && exec {python} -m train"],
    "sh -c": ["sh", "-c", "cd {d} && {python} train.py"],
}


@pytest.mark.parametrize("form", list(START_FORMS))
@pytest.mark.parametrize("alias_first", [True, False], ids=["alias-first", "alias-last"])
def test_a_real_torchft_is_refused_in_the_process_however_the_script_starts(
    tmp_path, fake_torchft, form, alias_first
):
    folder = fake_torchft  # holds torchft/, a real install's shape
    (folder / "train.py").write_text("import torchft\nprint('trained on', torchft.__name__)\n")
    other = tmp_path / "other"  # a second real torchft elsewhere on PYTHONPATH
    (other / "torchft").mkdir(parents=True)
    (other / "torchft" / "__init__.py").write_text("raise SystemExit('the other ran')\n")
    entries = [torchft_path(), str(other)]
    pythonpath = ":".join(entries if alias_first else entries[::-1])
    command = [w.format(python=sys.executable, d=folder) for w in START_FORMS[form]]

    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={**child_env(), "PYTHONPATH": pythonpath},
        cwd="/",
    )

    assert done.returncode == 1, done.stdout + done.stderr
    assert "ran" not in done.stderr and "trained on" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: a real torchft can be imported from "), last
    # The one the process itself would have imported: its script's folder comes first.
    assert f"imported from {folder / 'torchft'}," in last, last


def test_the_alias_keeps_the_sitecustomize_it_hides(tmp_path):
    """The alias's folder holds a `sitecustomize` of its own: the one it comes before on
    PYTHONPATH still runs, once."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os\nos.environ['THEIRS_RAN'] = str(int(os.environ.get('THEIRS_RAN', 0)) + 1)\n"
    )
    done = python_with(
        f"{torchft_path()}:{theirs}",
        "import os, torchft; print(os.environ.get('THEIRS_RAN'), torchft.__name__)",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "phalanx.torchft"]


@pytest.mark.parametrize("flags", [["-u"], ["-X", "dev"], ["-uB"]])
def test_as_torchft_refuses_a_real_torchft_before_any_group_starts_whatever_the_flags(
    fake_torchft, flags
):
    (fake_torchft / "train.py").write_text("import torchft\n")
    done = run_launcher(
        "--as-torchft",
        "--replicas",
        "2",
        "--",
        sys.executable,
        *flags,
        str(fake_torchft / "train.py"),
        timeout=30,
    )

    assert done.returncode == 2, done.stdout + done.stderr
    assert f"a real torchft can be imported from {fake_torchft / 'torchft'}" in done.stderr
    assert "lighthouse at" not in done.stdout


def test_as_torchft_refuses_an_interpreter_that_ignores_pythonpath(rank_script):
    done = run_launcher(
        "--as-torchft", "--", sys.executable, "-E", str(rank_script), "--import", timeout=30
    )

    assert done.returncode == 2, done.stdout + done.stderr
    assert "-E` ignores PYTHONPATH, where --as-torchft puts phalanx's torchft" in done.stderr


def test_as_torchft_ranks_started_by_a_shell_refuse_a_real_torchft_by_name(fake_torchft):
    """The launcher cannot see inside `sh -c`; the rank's own `import torchft` says it."""
    (fake_torchft / "train.py").write_text("import torchft\n")
    done = run_launcher(
        "--as-torchft",
        "--max-restarts",
        "0",
        "--",
        "sh",
        "-c",
        f"cd {fake_torchft} && {sys.executable} train.py",
        timeout=60,
    )

    assert done.returncode != 0
    assert "the fake torchft ran" not in done.stdout + done.stderr
    assert f"a real torchft can be imported from {fake_torchft / 'torchft'}" in done.stdout


def test_the_alias_docstring_examples():
    result = doctest.testmod(alias, optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0 and result.failed == 0


#: A replica group's rank under torchrun: torchft's way of starting a group. Rank 1 of
#: torchrun's first incarnation dies after a commit, so torchrun restarts both ranks.
TORCHRUN_RANK = """
import json, os, sys
from datetime import timedelta

import torch
import torchft

incarnation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
    load_state_dict=None, state_dict=None, min_replica_size=1, replica_id="tr",
)
for _ in range(3):
    manager.start_quorum()
    manager.allreduce(torch.ones(1)).wait()
    committed = manager.should_commit()
    line = {"rank": os.environ["RANK"], "incarnation": incarnation,
            "step": manager.current_step(), "committed": committed}
    with open(sys.argv[1], "a") as log:  # one line per write: the ranks share the file
        log.write(json.dumps(line) + "\\n")
    if incarnation == 0 and os.environ["RANK"] == "1":
        os._exit(1)
manager.shutdown()
"""


# Slow: torchrun starts the script twice (about 15 s).
@pytest.mark.slow
def test_a_torchft_script_runs_under_torchrun_and_its_restart(tmp_path, lighthouse):
    # torchrun's agent keeps its own store on MASTER_PORT: rank 0 serves the group's
    # manager on a port of its own and leaves the address there for the other ranks,
    # under a key of torchrun's incarnation, so the restarted ranks meet the new rank 0.
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_RANK)
    steps = tmp_path / "steps.jsonl"
    env = {
        **child_env(),
        "PYTHONPATH": f"{torchft_path()}:{child_env().get('PYTHONPATH', '')}",
        "TORCHFT_LIGHTHOUSE": lighthouse.address,
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--master-port",
            str(free_port()),
            str(script),
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )

    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    again = [line for line in lines if line["incarnation"] == 1]
    assert {line["rank"] for line in again} == {"0", "1"}, lines
    assert all(line["committed"] for line in again), lines
