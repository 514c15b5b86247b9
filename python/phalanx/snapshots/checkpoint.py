"""torch.distributed.checkpoint reading only bytes that verified.

DCP's own reader opens files by path (a path checked before could be swapped since)
and unpickles `.metadata` as it finds it. `VerifiedReader` hands DCP the bytes of a
rank's files as `Storage.read_verified` read and hashed them, nothing else; and the
metadata is unpickled by an allow list of DCP's own metadata types, so even bytes that
verify (this job's, under its key) build no object of another kind and call nothing.
Tensors DCP reads with `torch.load(weights_only=True)` from those same bytes.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

#: The classes a DCP `.metadata` of tensors is made of (torch 2.x): nothing else is built.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeMetadataError(ValueError):
    """A `.metadata` names a class or function that DCP's metadata is not made of."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(
            f"its .metadata names {module}.{name}, which no DCP metadata holds: refused unread"
        )


def metadata_of(data: memoryview | bytes) -> Metadata:
    """The DCP metadata in `data`, built by the allow list; UnsafeMetadataError or
    ValueError if it is not one."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as e:  # a truncated or garbled pickle raises anything
        raise ValueError(f"its .metadata is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"its .metadata holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over verified bytes."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self.data) - self.at)
        memoryview(buffer).cast("B")[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: len(self.data)}[whence]
        self.at = max(0, base + offset)
        return self.at

    def tell(self) -> int:
        return self.at


class _VerifiedFiles(FileSystemBase):
    """A file system of the verified files of one rank, by path inside its folder."""

    def __init__(self, files: Mapping[str, memoryview]) -> None:
        self.verified = dict(files)

    def create_stream(self, path: Any, mode: str) -> Any:
        if mode != "rb":
            raise PermissionError("a snapshot being loaded is read only")
        key = str(path)
        if key not in self.verified:
            raise FileNotFoundError(f"{key} is not a file the manifest names")
        return io.BufferedReader(_MemoryFile(self.verified[key]))

    def concat_path(self, path: Any, suffix: str) -> Any:
        return PurePosixPath(path) / suffix

    def rename(self, path: Any, new_path: Any) -> None:
        raise PermissionError("a snapshot being loaded is read only")

    def init_path(self, path: Any) -> Any:
        return PurePosixPath(path)

    def mkdir(self, path: Any) -> None:
        raise PermissionError("a snapshot being loaded is read only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return str(path) in self.verified

    def rm_file(self, path: Any) -> None:
        raise PermissionError("a snapshot being loaded is read only")


class VerifiedReader(FileSystemReader):
    """A DCP reader of one rank's files, each as verified (`files`: path inside the
    rank's folder → bytes; `.metadata` among them)."""

    def __init__(self, files: Mapping[str, memoryview]) -> None:
        super().__init__(".")
        self.fs = _VerifiedFiles(files)
        self.path = PurePosixPath(".")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = metadata_of(self.fs.verified.get(".metadata", b""))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
