"""A training script that fails the same way in every life: its loop raises at step
`--at` (a user's bug, say), after the Manager is up. For the crash-loop tests."""

from __future__ import annotations

import argparse

import torch

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--at", type=int, default=2)
    args = parser.parse_args()
    manager = phalanx.Manager(timeout=10.0)
    while True:
        manager.start_quorum()
        if manager.current_step() == args.at:
            raise RuntimeError(f"the loss is nan at step {args.at} (a bug in the script)")
        manager.allreduce(torch.ones(4)).wait()
        manager.should_commit()


if __name__ == "__main__":
    main()
