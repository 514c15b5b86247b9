"""The manifest of a rank's state: its structure (names, nesting, scalars, and each
tensor's path, dtype, shape and DTensor layout) in a typed JSON encoding, never pickle,
followed on the wire by the tensors' bytes.

`encode_state` is the serving side: the manifest and the tensors to lend. `decode_state`
is the healing side: the structure rebuilt on this rank's state, and a `Receiver` that
says where each tensor's bytes land, in place where a local tensor fits. A manifest that
cannot fit raises `IncompatibleStateError` with what to change.

>>> import json, torch
>>> manifest, lent = encode_state({"model": {"weight": torch.zeros(2, 3), "step": 7}})
>>> json.loads(manifest)["tensors"]
[{'path': 'model/weight', 'dtype': 'float32', 'shape': [2, 3], 'nbytes': 24}]
>>> local = torch.ones(2, 3)
>>> healed, receiver = decode_state(manifest, {"model": {"weight": local}})
>>> healed["model"]["step"], healed["model"]["weight"] is local, receiver.reused
(7, True, 1)
"""

from __future__ import annotations

import base64
import bisect
import json
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.staging import host_views, to_host

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement

MANIFEST_FORMAT = "phalanx-state/1"

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}

_SENDABLE = (
    "tensors, dict, list, tuple, int, float, bool, str, bytes, None, torch.dtype, torch.Size"
)


class IncompatibleStateError(ValueError):
    """The state the sources serve cannot be loaded into this rank's state."""


def _is_dtensor(value: Any) -> bool:
    """Without importing torch.distributed.tensor (half a second): a process that has
    not imported it holds no DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


# -- encoding (the serving side) ---------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _sendable(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """`tensor`, if phalanx can send (or snapshot) it: dense, on the CPU or a GPU."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(
            f"cannot serve {path!r}: a {tensor.layout} tensor"
            f"{' (quantized)' if tensor.is_quantized else ''}; convert it to a dense tensor"
            " in your state_dict function"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(
            f"cannot serve {path!r}: it lives on {tensor.device}; move it to CPU or CUDA in"
            " your state_dict function"
        )
    return tensor


def _servable(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """The tensor whose memory is lent: itself when it is a dense, contiguous CPU
    tensor, else a contiguous CPU copy made now (kept until `close()`). A GPU tensor
    is returned as it is: `_encode` copies all of them to the host at once."""
    _sendable(tensor, path)
    if tensor.device.type == "cuda":
        return tensor
    # A conjugate or negative view holds other values in memory than it shows.
    tensor = tensor.resolve_conj().resolve_neg()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class _Encoder:
    """Turns a state structure into a JSON-safe tree plus the tensors to lend (`stage`:
    made servable, see `_servable`; else as they are, for a writer that copies them
    itself)."""

    def __init__(self, stage: bool = True) -> None:
        self.table: list[dict[str, Any]] = []
        self.lent: list[torch.Tensor] = []
        self.stage = stage

    def tensor(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        lent = _servable(tensor, path) if self.stage else _sendable(tensor, path)
        self.table.append(
            {
                "path": path,
                "dtype": _dtype_name(lent.dtype),
                "shape": list(lent.shape),
                "nbytes": _nbytes(lent),
            }
        )
        self.lent.append(lent)
        return {"t": "tensor", "index": len(self.table) - 1}

    def value(self, value: Any, path: str) -> dict[str, Any]:
        if _is_dtensor(value):
            return self.dtensor(value, path)
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, Mapping):
            return self.mapping(value, path)
        if isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {"t": kind, "v": [self.value(v, f"{path}/{i}") for i, v in enumerate(value)]}
        return _scalar(value, path)

    def dtensor(self, value: DTensor, path: str) -> dict[str, Any]:
        """Only this rank's shard travels; its layout says where it belongs."""
        node = self.tensor(value.to_local(), path)
        node["t"] = "dtensor"
        node["layout"] = _layout(value)
        return node

    def mapping(self, value: Mapping, path: str) -> dict[str, Any]:
        items = [
            [_scalar(k, f"{path} (a key)"), self.value(v, f"{path}/{k}")] for k, v in value.items()
        ]
        node: dict[str, Any] = {
            "t": "odict" if isinstance(value, OrderedDict) else "dict",
            "v": items,
        }
        # nn.Module.state_dict() keeps per-module versions here; load_state_dict reads them.
        metadata = getattr(value, "_metadata", None)
        if isinstance(value, OrderedDict) and isinstance(metadata, Mapping):
            node["meta"] = self.value(metadata, f"{path}/_metadata")
        return node


def _scalar(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": int(value)}
    if isinstance(value, float):
        # Hex keeps every bit, inf and nan included.
        return {"t": "float", "v": float(value).hex()}
    if isinstance(value, str):
        return {"t": "str", "v": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"t": "bytes", "v": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": _dtype_name(value)}
    raise TypeError(
        f"cannot serve {path!r}: a {type(value).__name__} is not one of the types phalanx"
        f" sends ({_SENDABLE}); convert it in your state_dict function"
    )


def _placement_name(placement: Placement) -> str:
    """The name of a placement: S(0), R, P(sum); any other by its repr (matched, never
    rebuilt)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(placement) is Shard:
        return f"S({placement.dim})"
    if type(placement) is Replicate:
        return "R"
    if type(placement) is Partial:
        return f"P({placement.reduce_op})"
    return repr(placement)


def _placement(name: str) -> Placement | None:
    """The placement a `_placement_name` stands for, None for one it cannot rebuild."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if name == "R":
        return Replicate()
    match = re.fullmatch(r"S\((\d+)\)", name)
    if match:
        return Shard(int(match.group(1)))
    match = re.fullmatch(r"P\((\w+)\)", name)
    return Partial(match.group(1)) if match else None


def _layout(value: DTensor) -> dict[str, Any]:
    """Where a DTensor's shards lie: its global shape and stride, its placements, and
    the shape of its device mesh (a rank heals only into the same layout)."""
    mesh = value.device_mesh
    return {
        "shape": list(value.shape),
        "stride": list(value.stride()),
        "placements": [_placement_name(p) for p in value.placements],
        "mesh": _mesh_layout(mesh),
    }


def _mesh_layout(mesh: Any) -> dict[str, Any]:
    return {
        "device": mesh.device_type,
        "shape": list(mesh.shape),
        "dims": list(mesh.mesh_dim_names or []),
    }


def encode_state(state: Mapping[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The manifest of `state` and the tensors whose bytes follow it, in index order."""
    return _encode(state, _Encoder())


def describe_state(state: Mapping[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The manifest of `state` and its tensors in index order as they are (a DTensor's
    local shard; nothing copied), for a snapshot, which copies them itself."""
    return _encode(state, _Encoder(stage=False))


def _encode(state: Mapping[str, Any], encoder: _Encoder) -> tuple[bytes, list[torch.Tensor]]:
    tree = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state names must be strings, got {name!r}")
        tree[name] = encoder.value(value, name)
    manifest = {"format": MANIFEST_FORMAT, "tensors": encoder.table, "state": tree}
    lent = encoder.lent
    if encoder.stage:
        # Sockets read host memory: the GPU's tensors are copied there once per open().
        on_gpu = [i for i, t in enumerate(lent) if t.is_cuda]
        for i, staged in zip(on_gpu, to_host([lent[i] for i in on_gpu]), strict=True):
            lent[i] = staged
    return json.dumps(manifest, separators=(",", ":")).encode(), lent


# -- decoding (the healing side) ---------------------------------------------------------


def _malformed(path: str, why: str) -> IncompatibleStateError:
    return IncompatibleStateError(
        f"the manifest is malformed at {path!r}: {why}; run the same phalanx version on every rank"
    )


def _expect(node: Any, kind: type, path: str) -> Any:
    value = node.get("v") if isinstance(node, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _malformed(path, f"expected a {kind.__name__} value, got {value!r}")
    return value


def _float(node: dict, path: str) -> float:
    try:
        return float.fromhex(_expect(node, str, path))
    except ValueError:
        raise _malformed(path, "not a hex float") from None


def _bytes(node: dict, path: str) -> bytes:
    try:
        return base64.b64decode(_expect(node, str, path), validate=True)
    except ValueError:
        raise _malformed(path, "not base64") from None


def _dtype(name: Any, path: str) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise IncompatibleStateError(
            f"{path!r} has dtype {name!r}, unknown to this torch {torch.__version__}; run the"
            " same torch version on every rank"
        )
    return dtype


_SCALARS: dict[str, Callable[[dict, str], Any]] = {
    "none": lambda node, path: None,
    "bool": lambda node, path: _expect(node, bool, path),
    "int": lambda node, path: _expect(node, int, path),
    "float": _float,
    "str": lambda node, path: _expect(node, str, path),
    "bytes": _bytes,
    "dtype": lambda node, path: _dtype(node.get("v"), path),
    "size": lambda node, path: torch.Size([int(n) for n in _expect(node, list, path)]),
}


def _child(local: Any, key: Any) -> Any:
    """The part of the local state at `key`, if there is one."""
    try:
        if isinstance(local, Mapping):
            return local.get(key)
        if isinstance(local, (list, tuple)) and isinstance(key, int):
            return local[key] if 0 <= key < len(local) else None
    except TypeError:  # an unhashable or odd key: nothing to reuse
        pass
    return None


class Receiver:
    """Picks, for every tensor of the manifest, the memory its bytes go to: `regions()`
    in the manifest's order, with `device_copies` to make once they have arrived."""

    def __init__(self, table: Any, meshes: Sequence[Any] = ()) -> None:
        if not isinstance(table, list):
            raise _malformed("tensors", "not a list")
        self.table = table
        self.meshes = list(meshes)
        self.dest: list[torch.Tensor | None] = [None] * len(table)
        self.device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._to_device: list[tuple[int, torch.Tensor]] = []
        self._claimed: list[tuple[int, int]] = []  # sorted (start, end) of reused memory
        self.reused = 0

    def _entry(self, node: dict, path: str) -> tuple[int, torch.dtype, torch.Size]:
        index = node.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self.table):
            raise _malformed(path, f"tensor index {index!r} outside the table")
        if self.dest[index] is not None:
            raise _malformed(path, f"tensor {index} appears twice")
        entry = self.table[index]
        if not isinstance(entry, dict):
            raise _malformed(path, f"tensor {index} is described by {type(entry).__name__}")
        dtype = _dtype(entry.get("dtype"), path)
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise _malformed(path, f"bad shape {shape!r}")
        expected = torch.Size(shape).numel() * dtype.itemsize
        if entry.get("nbytes") != expected:
            raise _malformed(path, f"{entry.get('nbytes')!r} bytes for {dtype} of shape {shape}")
        return index, dtype, torch.Size(shape)

    def _land(self, index: int, target: torch.Tensor) -> None:
        """The bytes of tensor `index` go to `target`; a GPU's through host memory,
        cut for all of them at once by `regions()`."""
        if target.is_cuda:
            self._to_device.append((index, target))
        else:
            self.dest[index] = target

    def tensor(self, node: dict, local: Any, path: str) -> torch.Tensor:
        index, dtype, shape = self._entry(node, path)
        if _is_dtensor(local):
            raise _parallelism_differs(path, "a plain tensor", "a DTensor")
        result = self._destination(local, dtype, shape)
        self._land(index, result)
        return result

    def dtensor(self, node: dict, local: Any, path: str) -> torch.Tensor:
        """This rank's shard lands in the local DTensor's shard, in place, when both
        lie the same way; without a local DTensor (a fresh optimizer has no state
        yet) a new one is built on this rank's device mesh of that layout."""
        index, dtype, shape = self._entry(node, path)
        layout = _parse_layout(node.get("layout"), path)
        if not torch.distributed.is_available():
            raise IncompatibleStateError(
                f"{path!r} is a DTensor on the sources, but this torch has no"
                " torch.distributed; run the same torch build on every rank"
            )
        from torch.distributed.tensor import DTensor

        if isinstance(local, DTensor):
            _check_layout(local, layout, shape, path)
            shard = local.to_local()
            if self._reusable(shard, dtype, shape):
                self.reused += 1
                self._land(index, shard)
                return local
            mesh = local.device_mesh
        elif isinstance(local, torch.Tensor):
            raise _parallelism_differs(path, "a DTensor", "a plain tensor")
        else:
            mesh = self._mesh(layout, path)
        placements = [_placement(name) for name in layout["placements"]]
        if any(p is None for p in placements):
            raise IncompatibleStateError(
                f"{path!r} has placements {layout['placements']} that phalanx cannot rebuild"
                " without a matching DTensor in this rank's state; build the state (e.g. take"
                " an optimizer step) before the heal"
            )
        device = torch.device("cpu")
        if mesh.device_type != "cpu":
            device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
        shard = torch.empty(shape, dtype=dtype, device=device)
        self._land(index, shard)
        return DTensor.from_local(
            shard,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(layout["shape"]),
            stride=tuple(layout["stride"]),
        )

    def _mesh(self, layout: dict[str, Any], path: str) -> Any:
        """The one device mesh of this rank's state that has the served layout."""
        found = [mesh for mesh in self.meshes if _mesh_layout(mesh) == layout["mesh"]]
        if len(found) != 1:
            why = "none" if not found else f"{len(found)} different ones"
            raise IncompatibleStateError(
                f"{path!r} is a DTensor on a device mesh {layout['mesh']} on the sources, and"
                f" this rank's state holds {why} of that layout; shard the model the same way"
                " on every replica group (e.g. phalanx.fully_shard_hsdp) before it heals"
            )
        return found[0]

    def _destination(self, local: Any, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        if self._reusable(local, dtype, shape):
            self.reused += 1
            return local
        return torch.empty(shape, dtype=dtype)

    def _reusable(self, local: Any, dtype: torch.dtype, shape: torch.Size) -> bool:
        if not (
            isinstance(local, torch.Tensor)
            and local.dtype == dtype
            and local.shape == shape
            and local.layout == torch.strided
            and local.device.type in ("cpu", "cuda")
            and local.is_contiguous()
            and not local.is_conj()
            and not local.is_neg()
        ):
            return False
        if local.is_cuda or _nbytes(local) == 0:
            return True
        # Two paths sharing memory (tied weights) must not both be written in place.
        start = local.data_ptr()
        span = (start, start + _nbytes(local))
        at = bisect.bisect_left(self._claimed, span)
        if at > 0 and self._claimed[at - 1][1] > start:
            return False
        if at < len(self._claimed) and self._claimed[at][0] < span[1]:
            return False
        self._claimed.insert(at, span)
        return True

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of each tensor's landing place, in the manifest's order;
        the host memory of the GPU's tensors is taken here, once."""
        if self._to_device:
            staged = host_views([(t.dtype, t.shape) for _, t in self._to_device])
            for (index, target), host in zip(self._to_device, staged, strict=True):
                self.dest[index] = host
                self.device_copies.append((host, target))
            self._to_device = []
        missing = [i for i, t in enumerate(self.dest) if t is None]
        if missing:
            raise _malformed(f"tensors[{missing[0]}]", "listed but not part of the state")
        return memory_regions(self.dest)


def _decode(node: Any, local: Any, path: str, rx: Receiver) -> Any:
    if not isinstance(node, dict):
        raise _malformed(path, f"expected an entry, got {type(node).__name__}")
    kind = node.get("t")
    if kind in _SCALARS:
        return _SCALARS[kind](node, path)
    if kind == "tensor":
        return rx.tensor(node, local, path)
    if kind == "dtensor":
        return rx.dtensor(node, local, path)
    if kind in ("list", "tuple"):
        items = [
            _decode(child, _child(local, i), f"{path}/{i}", rx)
            for i, child in enumerate(_expect(node, list, path))
        ]
        return items if kind == "list" else tuple(items)
    if kind in ("dict", "odict"):
        return _decode_mapping(node, local, path, rx)
    raise _malformed(path, f"unknown entry type {kind!r}")


def _parallelism_differs(path: str, served: str, local: str) -> IncompatibleStateError:
    return IncompatibleStateError(
        f"{path!r} is {served} on the sources but {local} on this rank; apply the same"
        " parallelism (e.g. phalanx.fully_shard_hsdp) on every replica group"
    )


def _parse_layout(layout: Any, path: str) -> dict[str, Any]:
    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(n, int) and not isinstance(n, bool) for n in value
        )

    mesh = layout.get("mesh") if isinstance(layout, dict) else None
    if not (
        isinstance(layout, dict)
        and ints(layout.get("shape"))
        and ints(layout.get("stride"))
        and isinstance(layout.get("placements"), list)
        and all(isinstance(p, str) for p in layout["placements"])
        and isinstance(mesh, dict)
        and isinstance(mesh.get("device"), str)
        and ints(mesh.get("shape"))
        and isinstance(mesh.get("dims"), list)
        and all(isinstance(d, str) for d in mesh["dims"])
    ):
        raise _malformed(path, f"bad DTensor layout {layout!r}")
    return layout


def _check_layout(local: DTensor, layout: dict[str, Any], shard: torch.Size, path: str) -> None:
    """A shard fits only a DTensor sharded the same way over a mesh of the same shape."""
    ours = {**_layout(local), "stride": layout["stride"]}  # shards are sent contiguous
    local_shard = tuple(local.to_local().shape)
    if ours != layout or local_shard != tuple(shard):
        raise IncompatibleStateError(
            f"{path!r} is sharded differently here than on the sources: this rank holds a"
            f" shard of shape {list(local_shard)} of {ours}, the sources serve a shard of"
            f" shape {list(shard)} of {layout}; give every replica group the same number of"
            " ranks and the same parallelism"
        )


def _device_meshes(state: Any) -> list[Any]:
    """The device meshes of the DTensors in `state`, each once (equal meshes are one:
    they name the same ranks in the same layout)."""
    found: list[Any] = []
    stack = [state]
    while stack:
        value = stack.pop()
        if _is_dtensor(value):
            if not any(value.device_mesh == m for m in found):
                found.append(value.device_mesh)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return found


def _decode_key(node: Any, path: str) -> Any:
    kind = node.get("t") if isinstance(node, dict) else None
    if kind not in _SCALARS:
        raise _malformed(path, f"a mapping key of type {kind!r}")
    return _SCALARS[kind](node, path)


def _decode_mapping(node: dict, local: Any, path: str, rx: Receiver) -> dict:
    out: dict = OrderedDict() if node["t"] == "odict" else {}
    for pair in _expect(node, list, path):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _malformed(path, "a mapping item is not a [key, value] pair")
        key_node, value_node = pair
        key = _decode_key(key_node, f"{path} (a key)")
        out[key] = _decode(value_node, _child(local, key), f"{path}/{key}", rx)
    if "meta" in node and isinstance(out, OrderedDict):
        out._metadata = _decode(node["meta"], None, f"{path}/_metadata", rx)  # type: ignore[attr-defined]
    return out


def _parse(manifest: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(manifest)
    except ValueError as e:
        raise _malformed("", f"not JSON ({e})") from None
    if not isinstance(parsed, dict) or parsed.get("format") != MANIFEST_FORMAT:
        found = parsed.get("format") if isinstance(parsed, dict) else None
        raise IncompatibleStateError(
            f"the sources serve state format {found!r}, this rank reads {MANIFEST_FORMAT!r};"
            " run the same phalanx version on every rank"
        )
    if not isinstance(parsed.get("state"), dict):
        raise _malformed("state", "not a mapping of names")
    return parsed


def _check_names(served: Mapping[str, Any], local: Mapping[str, Any]) -> None:
    missing = [n for n in local if n not in served]
    extra = [n for n in served if n not in local]
    if missing or extra:
        raise IncompatibleStateError(
            f"the sources serve state {sorted(served)}, this rank registered {sorted(local)}"
            f" (missing: {missing}, unexpected: {extra}); register the same names on every rank"
        )


def memory_regions(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, length) of each tensor's bytes, as the state server and fetch take them."""
    return [(t.data_ptr(), _nbytes(t)) for t in tensors]


def decode_state(manifest: bytes, state: Mapping[str, Any]) -> tuple[dict[str, Any], Receiver]:
    """The state `manifest` describes, {name: structure}, built on this rank's `state`
    (the same names), and the `Receiver` of its tensors' bytes. Raises
    IncompatibleStateError when the served state cannot fit this rank's."""
    parsed = _parse(manifest)
    served = parsed["state"]
    _check_names(served, state)
    rx = Receiver(parsed.get("tensors"), _device_meshes(state))
    healed = {name: _decode(node, state.get(name), name, rx) for name, node in served.items()}
    return healed, rx
