"""One rank of a replica group training a small Llama-style model on the Book of
Genesis, byte by byte, with phalanx. This is the script `phalanx demo` runs; started
by hand it is an ordinary phalanx training script:

    phalanx run --replicas 3 --chaos kill-every=15s -- python -m phalanx.demo.train

Each step is a transaction over the groups alive now: `optimizer.zero_grad()` asks for
the step's quorum, the gradients are averaged over it during `backward()`, and
`optimizer.step()` applies them only if the step committed. The data cursor is part
of the state a restarted group receives from its peers, so it reads on from where
they are (see `phalanx.data`).

Prints one JSON line per step (the step log `phalanx demo` collects). Stops at
SIGTERM once the step in flight is done (how `phalanx demo` ends the job), or when
the job reaches `--steps` committed steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import zlib
from collections.abc import Callable
from importlib import resources

import torch
import torch.nn.functional as F

import phalanx
from phalanx.data import QuorumSampler
from phalanx.demo.model import Llama, LlamaConfig


class Corpus:
    """The text as bytes, cut into windows of seq_len + 1: a sample is the input
    and, shifted by one byte, the target."""

    def __init__(self, text: bytes, seq_len: int):
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.windows = (len(self.data) - 1) // seq_len

    def __len__(self) -> int:
        return self.windows

    def batch(
        self, indices: list[int], device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.tensor(indices) * self.seq_len
        rows = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[rows].to(device)
        return window[:, :-1], window[:, 1:]


def genesis() -> bytes:
    return resources.files("phalanx.demo").joinpath("corpus/genesis.txt").read_bytes()


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """CRC-32 of every byte of the tensors, in order (a GPU's copied to the host
    first): replicas whose fingerprints agree hold the same bits (up to a 2**-32
    chance)."""
    crc = 0
    for t in tensors:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        crc = zlib.crc32(data.numpy(), crc)
    return f"{crc:08x}"


def training_state(
    tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """`tensors` (a state dict) and the optimizer's state tensors, as this rank holds
    them (its own shards, under HSDP)."""
    state = list(tensors.values())
    for buffers in optimizer.state_dict()["state"].values():
        state += [v for v in buffers.values() if isinstance(v, torch.Tensor)]
    return [t.to_local() if hasattr(t, "to_local") else t for t in state]


def stop_on_sigterm() -> threading.Event:
    """SIGTERM ends the loop after the step in flight, so that no peer is left
    waiting for this group in the middle of a step."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="stop at this many committed steps")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per rank and step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=10.0, help="the Manager's budget")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo: inner steps a sync")
    parser.add_argument(
        "--batch-from",
        choices=["quorum", "step"],
        default="quorum",
        help="DDP, HSDP: quorum, this group's share of one sample stream (waits for the "
        "quorum before the forward); step, windows drawn from the step number alone (asks "
        "the manager nothing before the forward)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model, its batches and the cross-group collectives live; cuda: "
        "this rank's GPU, cuda:LOCAL_RANK (NCCL)",
    )
    return parser.parse_args()


def rank_device(kind: str) -> torch.device:
    """The device of `--device`: cpu, or this rank's GPU (cuda:LOCAL_RANK), made the
    current one."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


class StepLog:
    """One JSON line per transaction of this rank: a step (DDP, HSDP) or a sync
    (DiLoCo), with where its time went and a fingerprint of the state it committed."""

    def __init__(self, manager: phalanx.Manager, began: float):
        self.manager = manager
        self.began = began
        self.ready = time.time()

    def write(
        self,
        started: float,
        loss: float,
        committed: bool,
        state: Callable[[], list[torch.Tensor]],
        **extra: object,
    ) -> None:
        step = self.manager.last_step
        # The fingerprint is part of this loop's step: t_end comes after it.
        agreed = fingerprint(state()) if committed else None
        record = {
            "event": "step",
            "replica": self.manager.replica_id,
            "rank": self.manager.group_rank,
            "pid": os.getpid(),
            "step": step.step,
            "quorum_id": step.quorum_id,
            "lineage": step.lineage,
            "participants": step.participants,
            "committed": committed,
            "healed": step.healed,
            "t_start": started,
            "t_end": time.time(),
            "quorum_s": round(step.quorum_s, 6),
            "allreduce_s": round(step.allreduce_s, 6),
            "commit_s": round(step.commit_s, 6),
            "heal_s": round(step.heal_s, 6),
            "snapshot_s": round(step.snapshot_s, 6),
            "resume_s": round(step.resume_s, 6),
            "loss": loss,
            "fingerprint": agreed,
            "failure": step.failure,
            "t_main": self.began,
            "t_ready": self.ready,
            **extra,
        }
        print(json.dumps(record), flush=True)


def train_replicated(
    args: argparse.Namespace,
    manager: phalanx.Manager,
    model: Llama,
    corpus: Corpus,
    stop: threading.Event,
    began: float,
) -> None:
    """DDP or HSDP: every step a transaction; the gradients (HSDP: each rank's shard
    of them) are averaged over the quorum."""
    if args.strategy == "hsdp":
        model = phalanx.fully_shard_hsdp(model, manager, units=model.blocks)
    else:
        model = phalanx.DistributedDataParallel(model, manager)
    optimizer = phalanx.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr))
    sampler = QuorumSampler(len(corpus), args.batch_size, seed=args.seed)
    if args.batch_from == "step":
        sampler = StepWindows(len(corpus), args.batch_size, seed=args.seed)
    manager.register_state("data", sampler.state_dict, sampler.load_state_dict)
    log = StepLog(manager, began)

    steps = args.steps if args.steps is not None else float("inf")
    while not stop.is_set() and manager.current_step() < steps:
        started = time.time()
        optimizer.zero_grad()
        inputs, targets = corpus.batch(sampler.indices(manager), args.device)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        committed = optimizer.step()
        if committed:
            sampler.advance()
        log.write(
            started,
            loss.item(),
            committed,
            lambda: training_state(model.state_dict(), optimizer.optimizer),
            samples=sampler.cursor,
        )


class StepWindows:
    """Windows drawn from (seed, group, rank, step) alone: `indices()` asks the manager
    nothing but its committed step, so the loop's first wait on the quorum is in
    `backward()`, as in most training loops. `cursor` counts the samples the job's
    committed steps read, as `QuorumSampler`'s does."""

    def __init__(self, windows: int, batch_size: int, seed: int):
        self.windows, self.batch_size, self.seed = windows, batch_size, seed
        self.cursor = 0
        self._manager: phalanx.Manager | None = None

    def indices(self, manager: phalanx.Manager) -> list[int]:
        self._manager = manager
        key = f"{self.seed}/{manager.replica_id}/{manager.group_rank}/{manager.current_step()}"
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        return torch.randint(self.windows, (self.batch_size,), generator=g).tolist()

    def advance(self) -> None:
        assert self._manager is not None
        m = self._manager
        self.cursor += m.num_participants() * m.group_world_size * self.batch_size

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])


def train_diloco(
    args: argparse.Namespace,
    manager: phalanx.Manager,
    model: Llama,
    corpus: Corpus,
    stop: threading.Event,
    began: float,
) -> None:
    """DiLoCo: each group takes `--sync-every` local AdamW steps on windows of its
    own, then the groups sync (a transaction) and an outer Nesterov step moves the
    global parameters. The step log has one line per sync."""
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diloco = phalanx.DiLoCo(manager, model, inner, sync_every=args.sync_every)
    log = StepLog(manager, began)

    def agreed_state() -> list[torch.Tensor]:
        return training_state(diloco.global_parameters(), diloco.outer_optimizer)

    steps = args.steps if args.steps is not None else float("inf")
    started = time.time()
    while not stop.is_set() and diloco.inner_step < steps:
        diloco.zero_grad()
        # Windows drawn by (seed, group, inner step): each group reads its own.
        seed = zlib.crc32(f"{args.seed}/{manager.replica_id}/{diloco.inner_step}".encode())
        indices = torch.randint(
            len(corpus), (args.batch_size,), generator=torch.Generator().manual_seed(seed)
        )
        inputs, targets = corpus.batch(indices.tolist(), args.device)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        sync = diloco.step()
        if sync is not None:
            log.write(
                started, loss.item(), sync.committed, agreed_state, inner_step=sync.inner_step
            )
            started = time.time()


STRATEGIES = {"ddp": train_replicated, "hsdp": train_replicated, "diloco": train_diloco}


def log_recoveries() -> None:
    """phalanx's own account of heals, snapshots and resumes (INFO) goes to the
    output, which `phalanx demo` keeps in ranks.log."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("phalanx.manager", "phalanx.snapshots"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)


def main() -> None:
    began = time.time()
    args = parse_args()
    log_recoveries()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    stop = stop_on_sigterm()

    corpus = Corpus(genesis(), args.seq_len)
    args.device = rank_device(args.device)
    manager = phalanx.Manager(timeout=args.timeout, device=args.device)
    model = Llama(LlamaConfig(dim=args.dim, layers=args.layers, seq_len=args.seq_len))
    model.to(args.device)
    STRATEGIES[args.strategy](args, manager, model, corpus, stop, began)
    manager.shutdown()


if __name__ == "__main__":
    main()
