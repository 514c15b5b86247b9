"""torchft's `LocalSGD` and `DiLoCo`: context managers around an unchanged training
loop. Inside `with`, every step of the (plain torch) optimizer is counted, and every
`sync_every` steps the groups sync: LocalSGD averages the parameters, DiLoCo averages
the pseudo-gradients of each fragment in turn and steps the outer optimizer.
`phalanx.LocalSGD` and `phalanx.DiLoCo` do the work (see `phalanx.diloco`), so a sync
is a phalanx transaction and a group that is behind heals in it.

    with DiLoCo(manager, [model.front, model.back], inner, outer, sync_every=8):
        for x, y in batches:
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            inner.step()

What torchft's arguments become: `fragment_sync_delay` is phalanx's `overlap_steps`
(a fragment's all-reduce overlaps that many inner steps), `should_quantize` sends
int8 codes with per-block scales, the outer optimizer keeps its type and settings.
`backup_device`, `pin_memory`, `use_bucketization` and `bucket_cap_mb` are not needed
(the global parameters of a fragment live in one buffer per dtype on the model's
device) and are logged once; `fragment_update_alpha` other than 0 is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from phalanx import diloco
from phalanx.torchft.manager import phalanx_manager

__all__ = ["DiLoCo", "LocalSGD"]

log = logging.getLogger("phalanx.torchft")


class _Synced:
    """Counts the optimizer's steps inside `with` and syncs through `self._inner`."""

    _inner: diloco.DiLoCo
    _optimizer: torch.optim.Optimizer

    def __enter__(self) -> _Synced:
        def after_step(*_: Any) -> None:
            self._inner.count_inner_step()

        self._hook = self._optimizer.register_step_post_hook(after_step)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        if exc[0] is None:
            self._inner.finish()

    def sync(self) -> diloco.SyncOutcome | None:
        """Ends the sync in flight now (it would otherwise end after its overlap)."""
        return self._inner.finish()

    @property
    def inner_step(self) -> int:
        """The job's inner step, the same on every live group (phalanx's own)."""
        return self._inner.inner_step

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters every group agrees on after the last committed sync, by
        name (phalanx's own): evaluate or save these rather than the local model."""
        return self._inner.global_parameters()


class LocalSGD(_Synced):
    """Every `sync_every` steps of `optimizer`, the live groups' parameters of `model`
    are averaged. Making it runs the job's first sync (the groups agree on the
    initial parameters); a group joining a running job waits for the next one."""

    def __init__(
        self,
        manager: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        **unneeded: Any,
    ) -> None:
        _accept(unneeded, _UNNEEDED, "LocalSGD")
        self._optimizer = optimizer
        core = phalanx_manager(manager, "LocalSGD")
        self._inner = diloco.LocalSGD(core, model, optimizer, sync_every)


class DiLoCo(_Synced):
    """DiLoCo over `model_fragments` (modules of the model, each syncing in turn, one
    every `sync_every / len(model_fragments)` steps). `outer_optimizer` is a torch
    optimizer (or one per fragment, all of one type and settings) whose type and
    settings step the global parameters."""

    def __init__(
        self,
        manager: Any,
        model_fragments: Sequence[nn.Module] | nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if fragment_update_alpha != 0.0:
            raise ValueError(
                f"fragment_update_alpha={fragment_update_alpha}: phalanx starts each "
                "fragment's next round from the new global parameters (alpha 0), plus the "
                "local progress of overlapped steps; drop the argument"
            )
        fragments = (
            [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        )
        given = {
            "pin_memory": pin_memory is not True,
            "use_bucketization": use_bucketization,
            "bucket_cap_mb": bucket_cap_mb is not None,
        }
        _accept({k: v for k, v in given.items() if v}, _UNNEEDED, "DiLoCo")
        _check_backup_device(backup_device, fragments)
        self._optimizer = inner_optimizer
        self._inner = diloco.DiLoCo(
            phalanx_manager(manager, "DiLoCo"),
            nn.ModuleList(fragments),
            inner_optimizer,
            sync_every,
            _outer_factory(outer_optimizer),
            fragments=fragments,
            overlap_steps=fragment_sync_delay,
            quantize="int8" if should_quantize else None,
        )


_UNNEEDED = {
    "backup_device": "the global parameters live beside the model",
    "pin_memory": "the global parameters live beside the model",
    "use_bucketization": "each fragment syncs as one flat buffer per dtype",
    "bucket_cap_mb": "each fragment syncs as one flat buffer per dtype",
}


def _accept(given: dict[str, Any], unneeded: dict[str, str], what: str) -> None:
    unknown = set(given) - set(unneeded)
    if unknown:
        raise TypeError(f"{what} got unexpected argument(s) {', '.join(sorted(unknown))}")
    for name in sorted(given):
        log.info("%s: %s is not needed on phalanx (%s)", what, name, unneeded[name])


def _check_backup_device(device: torch.device | None, fragments: list[nn.Module]) -> None:
    if device is None:
        return
    kinds = {p.device.type for f in fragments for p in f.parameters()}
    if kinds != {torch.device(device).type}:
        raise ValueError(
            f"backup_device={device}: phalanx keeps the global parameters on the model's "
            f"device ({', '.join(sorted(kinds))}); drop backup_device"
        )
    log.info("DiLoCo: backup_device is not needed on phalanx (%s)", _UNNEEDED["backup_device"])


def _outer_factory(outer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> Any:
    """A maker of the outer optimizer over the global parameters, with the type and
    settings of the one(s) given."""
    optimizers = [outer] if isinstance(outer, torch.optim.Optimizer) else list(outer)
    if not optimizers:
        raise ValueError("outer_optimizer: pass a torch optimizer")
    kinds = [(type(opt), group) for opt in optimizers for group in _settings(opt)]
    if any(kind != kinds[0] for kind in kinds):
        raise ValueError(
            "outer_optimizer: phalanx steps every fragment with one outer optimizer; give "
            "one optimizer, or one per fragment, all of the same type and settings"
        )
    kind, settings = kinds[0]
    return lambda params: kind(params, **settings)


def _settings(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The constructor settings of each parameter group of `opt`, as it is now."""
    return [{k: v for k, v in g.items() if k in opt.defaults} for g in opt.param_groups]
