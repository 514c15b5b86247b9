"""A lighthouse lost for good: no rank spins through failed steps, every rank gives up
after the lighthouse timeout with a message that says what to do, and `phalanx run`
ends non-zero instead of restarting groups into the void."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from conftest import PROCS, phalanx_run

TRAIN = str(PROCS / "ft_train.py")
QUORUM_TIMEOUT = 1.0
LIGHTHOUSE_TIMEOUT = 3.0


def rank_env(replica_id: str, lighthouse: str) -> dict[str, str]:
    return {
        "PHALANX_REPLICA_ID": replica_id,
        "PHALANX_LIGHTHOUSE": lighthouse,
        "PHALANX_LIGHTHOUSE_TIMEOUT": str(LIGHTHOUSE_TIMEOUT),
    }


@pytest.mark.slow
def test_ranks_wait_for_a_lost_lighthouse_then_give_up_saying_what_to_do(
    spawn, start_lighthouse_cli
):
    lighthouse, address = start_lighthouse_cli()
    argv = [sys.executable, TRAIN, "--steps", "100000", "--timeout", str(2 * QUORUM_TIMEOUT)]
    ranks = [spawn(name, argv, rank_env(name, address)) for name in "ab"]
    for rank in ranks:
        rank.expect(lambda line: line.get("committed"), 60, "training")
    lighthouse.signal(signal.SIGKILL)
    lost_at = time.time()

    for rank in ranks:
        code = rank.proc.wait(timeout=60)
        gave_up = time.time() - lost_at
        assert code != 0
        message = "\n".join(rank.stderr)
        assert "LighthouseUnreachableError" in message, message
        assert "Start the lighthouse again on its address" in message, message
        assert gave_up < LIGHTHOUSE_TIMEOUT + 4 * QUORUM_TIMEOUT + 5.0, gave_up
        # No spin: a step waits for its quorum (the quorum timeout) before it fails.
        failed = [
            line for line in rank.lines if line.get("event") == "step" and line["t"] > lost_at + 0.5
        ]
        assert len(failed) <= gave_up / QUORUM_TIMEOUT + 2, len(failed)


@pytest.mark.slow
def test_phalanx_run_ends_non_zero_when_its_lighthouse_is_gone(spawn, start_lighthouse_cli):
    lighthouse, address = start_lighthouse_cli()
    run = ["--lighthouse", address, "--replica-id", "solo", "--insecure", "--", TRAIN]
    run += ["--steps", "100000", "--timeout", str(2 * QUORUM_TIMEOUT)]
    lighthouse_timeout = {"PHALANX_LIGHTHOUSE_TIMEOUT": str(LIGHTHOUSE_TIMEOUT)}
    with phalanx_run(*run, env=lighthouse_timeout, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            if '"committed": true' in line:
                break
        lighthouse.signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1, out[-3000:]
    assert "the lighthouse at" in out and "cannot be reached" in out, out[-3000:]
