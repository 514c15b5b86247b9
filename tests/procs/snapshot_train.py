"""One rank of a replica group training a small model with durable snapshots on, for
the snapshot fault tests: phalanx DDP, HSDP (FSDP2 over the group's ranks) or DiLoCo.

The snapshot settings come from the environment (PHALANX_SNAPSHOT_DIR / _EVERY /
_KEEP), as `phalanx run --snapshot-dir` passes them. Prints JSON lines:

  {"event": "ready"}       once the Manager is made
  {"event": "resumed"}     when this rank loaded a snapshot: its name, step and the
                           fingerprint of the state just loaded
  {"event": "step"}        for every step (DiLoCo: every sync) that ended: whether it
                           committed, `after` (the committed steps so far), the quorum,
                           lineage, and the fingerprint of the committed state
  {"event": "holding_write"} (with --hold-write) the write of a snapshot stopped
                           mid-way, as on a storage that hangs; it never finishes
  {"event": "done"}

The fingerprint is that of the state a snapshot of the step holds (DDP and HSDP: the
model and its optimizer, this rank's shards; DiLoCo: the global parameters and the
outer optimizer), so a line's and a snapshot's can be compared.

`--hold-at N` holds the training thread once it committed step N in the job's first
lineage (its heartbeat and snapshot writes go on), printing {"event": "holding"}:
the test kills it there, at a step of its choosing.

`--hold-write data --hold-from S` makes this rank's write of every snapshot of
lineage 0 from step S on stop after its tensors are written but before DCP's
metadata (no manifest either); `--hold-write publish` stops it once the data is
complete and synced, just before the manifest is written; `--hold-write rename`
once its temporary file is written, just before its rename. A resumed job
(a new lineage) writes as usual. SIGUSR2 dumps every thread's stack to stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn

import phalanx
import phalanx.transaction
from phalanx.snapshots import catalog, storage

from state_digest import digest, state_hash, tensors_of


def emit(line: dict) -> None:
    """Prints `line` as JSON in one write: a rank killed while printing leaves no part
    of a line for its next start's first line to run into."""
    os.write(sys.stdout.fileno(), (json.dumps(line) + "\n").encode())


def optimizer_tensors(optimizer_state: dict) -> list[torch.Tensor]:
    tensors = []
    for state in optimizer_state["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def diloco_fingerprint(state: dict) -> str:
    """Of a DiLoCo state (as registered): its global parameters and outer optimizer."""
    return digest([*state["global"].values(), *optimizer_tensors(state["outer_optimizer"])])


def hold_writes(mode: str, hold_from: int) -> None:
    """Makes this rank's snapshot writes of lineage 0 from step `hold_from` on stop
    mid-way and never finish (the process is killed meanwhile)."""

    def hold(name: str) -> None:
        identity = catalog.identity_of(name)
        if identity is None:
            return
        lineage, step, quorum = identity
        if step < hold_from or lineage != 0:
            return  # a resumed job (a new lineage) writes as usual
        stem = catalog.stem(step, lineage, quorum)
        line = {"event": "holding_write", "at": mode, "step": step, "stem": stem}
        emit(line)
        threading.Event().wait()  # a hung storage: only a kill ends it

    if mode == "rename":
        # The one rename of the manifest, once its temporary file is written and synced
        # (os.replace is the process's own: the hold lets every other rename through).
        replace = os.replace

        def held_replace(src, dst, *args, **kwargs):
            if os.fspath(dst).endswith(catalog.MANIFEST_SUFFIX):
                hold(os.path.basename(os.fspath(dst)))
            replace(src, dst, *args, **kwargs)

        storage.os.replace = held_replace
        return
    if mode == "publish":
        publish = storage.LocalStorage.publish

        def held_publish(self, name: str, data: bytes, owner: str = "") -> None:
            hold(name)
            publish(self, name, data, owner)

        storage.LocalStorage.publish = held_publish
        return
    from torch.distributed.checkpoint import FileSystemWriter

    class HeldWriter(FileSystemWriter):
        """Writes the tensors, then hangs before DCP's metadata file."""

        def finish(self, metadata, results) -> None:
            hold(os.path.basename(os.path.dirname(os.fspath(self.path))))
            super().finish(metadata, results)

    def held_writer(self, folder: str):
        return HeldWriter(self.url(folder), sync_files=True)

    storage.LocalStorage.writer = held_writer


def report_resumes(fingerprint) -> None:
    """Prints a line, with the state's fingerprint, whenever this rank loads a snapshot
    (its loop asks for the quorum before its forward, so the snapshot loads at once)."""
    resume = phalanx.transaction.resume

    def reporting_resume(rank, step, manifest, *args):
        failure = resume(rank, step, manifest, *args)
        line = {
            "event": "resumed",
            "name": manifest.name,
            "step": manifest.step,
            "lineage": manifest.lineage,
            "failure": failure,
            "hash": fingerprint(rank.registry.state()),
        }
        emit(line)
        return failure

    phalanx.transaction.resume = reporting_resume


def print_step(manager: phalanx.Manager, step: int, committed: bool, fingerprint: str) -> None:
    line = {
        "event": "step",
        "step": step,
        "committed": committed,
        "after": manager.current_step(),
        "rank": manager.group_rank,
        "quorum_id": manager.quorum_id,
        "participants": manager.num_participants(),
        "state_quorum_id": manager.state_quorum_id,
        "lineage": manager.lineage,
        "torn": manager.torn,
        "healed": manager.last_step.healed,
        "failure": manager.failure,
        "hash": fingerprint,
        "t": time.time(),
    }
    emit(line)


def hold_if_at(manager: phalanx.Manager, hold_at: int) -> None:
    """Holds the training thread for good after committing step `hold_at` of lineage 0."""
    if manager.current_step() == hold_at and manager.lineage == 0:
        line = {"event": "holding", "after": hold_at, "rank": manager.group_rank}
        emit(line)
        # A wait as the progress reporter knows one (as if on the other groups): the
        # lighthouse must not evict the rank as stalled before the test kills it.
        with manager._rank.progress.waiting("held by the test until it is killed", 600.0):
            threading.Event().wait()


#: Added to every batch's seed; with --fresh-data, one of this start's own (a data
#: pipeline whose position or randomness a snapshot does not hold).
DATA_SALT = 0


def batch(step: int, replica: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = step * 1000 + zlib.crc32(replica.encode()) % 997 + rank + DATA_SALT
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def train_steps(manager: phalanx.Manager, net: nn.Module, model: nn.Module, optimizer, args):
    """DDP or HSDP: one transaction per step (`net` runs `model`)."""
    while manager.current_step() < args.steps:
        optimizer.zero_grad()
        # After the quorum: a rank that resumed or healed in it is at the job's step.
        manager.wait_quorum()
        step = manager.current_step()
        x, y = batch(step, manager.replica_id, manager.group_rank)
        nn.functional.mse_loss(net(x), y).backward()
        committed = optimizer.step()
        print_step(manager, step, committed, state_hash(model, optimizer.optimizer))
        hold_if_at(manager, args.hold_at)
        time.sleep(args.step_sleep)


def train_diloco(manager: phalanx.Manager, model: nn.Module, args) -> None:
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = phalanx.DiLoCo(manager, model, inner, sync_every=args.sync_every)

    def fingerprint() -> str:
        return digest(tensors_of(diloco.global_parameters(), diloco.outer_optimizer))

    def before(outcome) -> int:
        return outcome.step - int(outcome.committed)  # the manager's step it ran

    if diloco.last_sync is not None:
        print_step(manager, before(diloco.last_sync), diloco.last_sync.committed, fingerprint())
    while manager.current_step() < args.steps:
        t = diloco.inner_step
        diloco.zero_grad()
        x, y = batch(t, manager.replica_id, 0)
        nn.functional.mse_loss(model(x), y).backward()
        if (outcome := diloco.step()) is not None:
            print_step(manager, before(outcome), outcome.committed, fingerprint())
            hold_if_at(manager, args.hold_at)
        time.sleep(args.step_sleep)
    diloco.finish()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "hsdp", "diloco"], default="ddp")
    parser.add_argument("--steps", type=int, default=100000, help="committed steps (syncs)")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--sync-every", type=int, default=2, help="DiLoCo's inner steps")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--fresh-data", action="store_true", help="other batches each start")
    parser.add_argument("--hold-write", choices=["data", "publish", "rename"], default=None)
    parser.add_argument("--hold-from", type=int, default=0)
    args = parser.parse_args()
    global DATA_SALT
    if args.fresh_data:
        DATA_SALT = int.from_bytes(os.urandom(3), "little") * 1_000_003
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a stack dump, for a hang
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)

    if args.hold_write is not None:
        hold_writes(args.hold_write, args.hold_from)
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # groups start apart
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 1))
    manager = phalanx.Manager(timeout=args.timeout)
    emit({"event": "ready", "pid": os.getpid()})

    if args.strategy == "diloco":
        report_resumes(lambda state: diloco_fingerprint(state["diloco"]))
        train_diloco(manager, model, args)
    else:
        if args.strategy == "hsdp":
            model = net = phalanx.fully_shard_hsdp(model, manager, units=[model[0], model[2]])
        else:
            net = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.Adam(model.parameters(), lr=0.01))
        report_resumes(lambda _: state_hash(model, optimizer.optimizer))
        train_steps(manager, net, model, optimizer, args)
    manager.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    emit({"event": "done", "step": manager.current_step()})
    sys.exit(0)


if __name__ == "__main__":
    main()
