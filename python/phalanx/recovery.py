"""Checkpoint-free recovery: every rank serves the state of its last committed step
from memory, and a healing rank streams it from all up-to-date peers at once,
straight into its own tensors.

- `StateHost` (one per rank) lends the registered state to healing peers for one
  step of one quorum at a time: `open()` publishes it without copying CPU tensors,
  `close()` returns once nobody reads it any more, so training may change it again.
- `heal()` fetches the manifest (`phalanx.manifest`: the structure of the state, in a
  typed JSON encoding — never pickle) and then every tensor's bytes, striped over all sources,
  each chunk checked against its checksum. A tensor of the local state with the same
  path, dtype and shape receives its bytes in place; any other is allocated.
- A DTensor (a shard of a tensor sharded over the ranks of a replica group, as FSDP2
  makes them) travels as its local shard, `to_local()`, plus its layout: rank i of a
  healing group receives rank i's shard into its own DTensor's local tensor.

Only ranks that present the job token and name the published step and quorum id are
served (I8); every wait has a deadline (I6).

>>> import torch
>>> from phalanx.recovery import StateHost, heal
>>> model = {"weight": torch.arange(6.0).reshape(2, 3), "step": 7}
>>> with StateHost(bind="127.0.0.1:0", token="s3cret") as host:
...     host.open(step=7, quorum_id=1, state={"model": model})
...     healed = heal([host.address], step=7, quorum_id=1, state={"model": {}}, token="s3cret")
...     host.close()
0
>>> healed["model"]["step"], healed["model"]["weight"].tolist()
(7, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from phalanx import _core
from phalanx.manifest import IncompatibleStateError, decode_state, encode_state, memory_regions
from phalanx.staging import to_devices

__all__ = ["IncompatibleStateError", "StateHost", "heal"]

log = logging.getLogger(__name__)


class StateHost:
    """Serves this rank's state to healing peers, one committed step at a time.

    Between `open()` and `close()` the published tensors must not change: the
    server reads them while peers fetch. CPU tensors that are dense and contiguous
    are served from their own memory (no copy); other tensors (non-contiguous views,
    CUDA tensors) from a copy made at `open()`.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        advertise_host: str | None = None,
        token: str | None = None,
        *,
        max_bytes_per_s: float | None = None,
    ) -> None:
        """`bind`: "host:port" to listen on (port 0: any free one). `advertise_host`:
        the host peers should use, by default the bind IP, or this machine's hostname
        when bound to all interfaces. `token`: the job token peers must present.
        `max_bytes_per_s`: a cap on what this rank sends, to leave a shared link to
        the training collectives."""
        self._server = _core.StateServer(
            bind=bind,
            advertise_host=advertise_host,
            token=token,
            max_bytes_per_s=max_bytes_per_s,
        )
        self._lent: list[torch.Tensor] = []

    @property
    def address(self) -> str:
        """host:port that healing peers fetch from."""
        return self._server.address

    @property
    def serving(self) -> tuple[int, int] | None:
        """(step, quorum id) open now, or None."""
        return self._server.serving

    @property
    def served_bytes(self) -> int:
        """Tensor bytes sent to peers so far."""
        return self._server.served_bytes

    @property
    def refused_requests(self) -> dict[str, int]:
        """Requests and connections turned away so far, by reason (see
        `phalanx._core.StateServer.refused_requests`)."""
        return self._server.refused_requests

    def open(self, step: int, quorum_id: int, state: Mapping[str, Any]) -> None:
        """Lends `state` (name -> state_dict-like structure) to peers that heal to
        `step` in quorum `quorum_id`, until `close()`. Raises TypeError for a value
        that cannot be sent and ValueError while another step is still open."""
        manifest, lent = encode_state(state)
        regions = memory_regions(lent)
        self._server.publish(step, quorum_id, manifest, regions)
        # The server reads these until close(): hold them (and any copies) that long.
        self._lent = lent

    def close(self, timeout: float = 5.0) -> int:
        """Stops lending: new requests are refused at once, transfers in flight get
        `timeout` seconds and are cut after it. When it returns, nothing reads the
        state any more. Returns how many transfers were cut."""
        cut = self._server.withdraw(timeout)
        self._lent = []
        return cut

    def shutdown(self) -> None:
        """Stops serving (transfers in flight are cut). Idempotent."""
        self._server.shutdown()
        self._lent = []

    def __enter__(self) -> StateHost:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def heal(
    sources: Sequence[str],
    step: int,
    quorum_id: int,
    state: Mapping[str, Any],
    token: str | None = None,
    timeout: float = 60.0,
    *,
    connections_per_source: int = 2,
    report: Callable[[_core.FetchStats], None] | None = None,
) -> dict[str, Any]:
    """Fetches the state of `step` in quorum `quorum_id` from all `sources` (their
    `StateHost.address`) at once and returns it as {name: structure}.

    Every tensor of `state` (this rank's current state, by the same names) that has
    the path, dtype and shape of a served tensor and is contiguous receives its bytes
    in place and comes back as the same object; any other tensor is allocated (a
    fresh optimizer has no state yet). Non-tensor values come back decoded.

    Sources that have not published the step yet are waited for, up to `timeout`
    seconds in all. Raises TimeoutError, ConnectionError (every source failed),
    PermissionError (wrong token, or the sources serve another step or quorum) or
    IncompatibleStateError (a ValueError: the served state cannot fit this rank's).
    On an error, tensors reused in place may hold a mix of old and new bytes: heal
    again before using them. `report`, if given, receives the transfer's statistics.
    """
    deadline = time.monotonic() + timeout
    sources = list(sources)
    manifest = _core.fetch_manifest(sources, step, quorum_id, token=token, timeout=timeout)
    healed, rx = decode_state(manifest, state)
    regions = rx.regions()
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no time left to fetch step {step} after its manifest ({timeout} s)")
    stats = _core.fetch_state(
        sources,
        step,
        quorum_id,
        regions,
        token=token,
        timeout=left,
        connections_per_source=connections_per_source,
    )
    to_devices(rx.device_copies)
    log.info(
        "healed step %d: %.1f MB (%d of %d tensors in place) from %d source(s) in %.3f s"
        " (%.2f GB/s), %d chunk(s) fetched again",
        step,
        stats.bytes / 1e6,
        rx.reused,
        len(regions),
        len(sources),
        stats.seconds,
        stats.gb_per_s,
        stats.refetches,
    )
    if report is not None:
        report(stats)
    return healed
