"""The model and the check the training tests run, shaped like a user's program.

`ConvNet` is an ordinary small image classifier: two convolutions and three linear
layers, 1.2 M parameters (4.8 MB), so phalanx DDP cuts its gradients into several
buckets and the first one's all-reduce runs while backward still needs the weights of
the layers it has not reached. `batch()` draws each step's data from the step number
alone, as a loop that never asks the manager anything before its forward does.

`SavedTensorGuard` turns a change of a tensor that autograd saved for backward, made
between the forward and the backward that uses it, into a failure: a version-counter
bump (an in-place write such as `load_state_dict`'s copy) and, for parameters, a
change of their bytes (a write autograd cannot see, e.g. straight into the memory).

>>> model, guard = ConvNet(), SavedTensorGuard()
>>> with guard:
...     loss = torch.nn.functional.cross_entropy(model(batch(0)[0]), batch(0)[1])
>>> with torch.no_grad():
...     _ = model.fc1.weight.mul_(2)
>>> loss.backward()
Traceback (most recent call last):
...
RuntimeError: a tensor saved for backward changed before backward used it ...
"""

from __future__ import annotations

import torch
from torch import nn

#: Images of this many channels and pixels a side.
CHANNELS, SIDE, CLASSES = 3, 8, 10


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * SIDE * SIDE, 512)
        self.fc2 = nn.Linear(512, 256)
        self.fc3 = nn.Linear(256, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc3(torch.relu(self.fc2(x)))


def batch(step: int, salt: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's images and labels, from the step number (and `salt`) alone."""
    g = torch.Generator().manual_seed(step * 7919 + salt)
    x = torch.randn(size, CHANNELS, SIDE, SIDE, generator=g)
    return x, torch.randint(0, CLASSES, (size,), generator=g)


class SavedTensorGuard:
    """A context in which every tensor autograd saves is checked when backward
    unpacks it (see the module's docstring). Enter it around the forward pass."""

    def __init__(self) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.checked = 0

    def __enter__(self) -> SavedTensorGuard:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @staticmethod
    def _pack(t: torch.Tensor) -> tuple[torch.Tensor, int, float | None]:
        with torch.no_grad():
            fingerprint = t.detach().double().sum().item() if isinstance(t, nn.Parameter) else None
        return t, t._version, fingerprint

    def _unpack(self, packed: tuple[torch.Tensor, int, float | None]) -> torch.Tensor:
        t, version, fingerprint = packed
        with torch.no_grad():
            now = t.detach().double().sum().item() if fingerprint is not None else None
        if t._version != version or now != fingerprint:
            raise RuntimeError(
                "a tensor saved for backward changed before backward used it "
                f"({tuple(t.shape)}: version {version} -> {t._version}, "
                f"sum {fingerprint} -> {now})"
            )
        self.checked += 1
        return t
