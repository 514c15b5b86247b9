"""Where snapshots live: a local directory, or any fsspec URL (`s3://…`, `gs://…`,
`memory://…`) that torch.distributed.checkpoint writes to. The few operations the
snapshot code needs, each durable where the storage allows it: a local file is
fsynced before it is renamed into place, and the directory after.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as root:
...     storage = Storage.at(root)
...     storage.publish("a.json", b"{}")
...     storage.names(), storage.read("a.json")
(['a.json'], b'{}')
"""

from __future__ import annotations

import os
import shutil
import uuid
import zlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from phalanx.snapshots.catalog import TEMPORARY_SUFFIX

_CHUNK = 8 << 20


class Storage(ABC):
    """A folder of snapshots."""

    #: How it was named (a path or URL), for messages.
    location: str

    @staticmethod
    def at(location: str | os.PathLike[str], create: bool = True) -> Storage:
        """The storage at a path or URL, made if missing (`create`), else
        FileNotFoundError."""
        text = os.fspath(location)
        if "://" in text and not text.startswith("file://"):
            return FsspecStorage(text, create)
        return LocalStorage(Path(text.removeprefix("file://")), create)

    @abstractmethod
    def names(self) -> list[str]:
        """The entries of the folder (files and data folders), by name."""

    @abstractmethod
    def read(self, name: str) -> bytes: ...

    @abstractmethod
    def publish(self, name: str, data: bytes) -> None:
        """Makes `name` hold `data`, all at once: a reader sees the old entry or the new
        one, never a part (written under a temporary name, then renamed)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Removes a file or a folder and all it holds; a missing one is no error."""

    @abstractmethod
    def url(self, name: str) -> str:
        """The path or URL of `name`, as torch.distributed.checkpoint takes it."""

    @abstractmethod
    def files(self, folder: str) -> list[tuple[str, int]]:
        """(path inside `folder`, size) of every file under it."""

    @abstractmethod
    def crc32(self, path: str) -> tuple[int, int]:
        """(CRC-32, size) of the file at `path` inside the storage."""

    def sync(self, folder: str) -> None:  # noqa: B027 (most stores have nothing to do)
        """Makes what was written under `folder` durable (where the storage can)."""

    def free_bytes(self) -> int | None:
        """Bytes free where snapshots are written, where the storage can tell."""
        return None

    def writer(self, folder: str) -> Any:
        """A DCP storage writer into `folder`."""
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.url(folder), sync_files=True)

    def reader(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.url(folder))


class LocalStorage(Storage):
    def __init__(self, root: Path, create: bool = True) -> None:
        self.root = root
        self.location = str(root)
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise FileNotFoundError(f"no snapshot directory {root}")

    def names(self) -> list[str]:
        return sorted(os.listdir(self.root))

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def publish(self, name: str, data: bytes) -> None:
        tmp = self.root / f".{name}.{uuid.uuid4().hex[:8]}{TEMPORARY_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)

    def remove(self, name: str) -> None:
        path = self.root / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def url(self, name: str) -> str:
        return str(self.root / name)

    def files(self, folder: str) -> list[tuple[str, int]]:
        base = self.root / folder
        return sorted(
            (str(p.relative_to(base)), p.stat().st_size) for p in base.rglob("*") if p.is_file()
        )

    def crc32(self, path: str) -> tuple[int, int]:
        crc, size = 0, 0
        with open(self.root / path, "rb", buffering=0) as f:
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            while n := f.readinto(buffer):
                crc = zlib.crc32(view[:n], crc)
                size += n
        return crc, size

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None

    def sync(self, folder: str) -> None:
        # DCP fsyncs the files it writes; the folders that name them are made durable
        # here, deepest first, before the manifest that names them is published.
        base = self.root / folder
        for path in sorted((p for p in base.rglob("*") if p.is_dir()), reverse=True):
            _fsync_dir(path)
        _fsync_dir(base)
        _fsync_dir(self.root)


class FsspecStorage(Storage):
    """Any fsspec filesystem. An object store has no rename of folders, but writes one
    object at once: the manifest, written last, publishes the snapshot."""

    def __init__(self, url: str, create: bool = True) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise ValueError(
                f"snapshot storage {url!r} is a URL, which needs fsspec: pip install fsspec "
                "(and the package of its protocol, e.g. s3fs)"
            ) from None
        self.location = url
        self.fs, self.root = url_to_fs(url)
        self.root = self.root.rstrip("/")
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        elif not self.fs.isdir(self.root):
            raise FileNotFoundError(f"no snapshot folder {url}")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def publish(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(name), data)

    def remove(self, name: str) -> None:
        path = self._path(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def url(self, name: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{self._path(name).removeprefix('/')}"

    def files(self, folder: str) -> list[tuple[str, int]]:
        base = self._path(folder).strip("/")
        found = self.fs.find(self._path(folder), detail=True)
        return sorted(
            (p.strip("/").removeprefix(base).lstrip("/"), int(i["size"]))
            for p, i in found.items()
            if i.get("type") == "file"
        )

    def crc32(self, path: str) -> tuple[int, int]:
        crc, size = 0, 0
        with self.fs.open(self._path(path), "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        return crc, size

    def writer(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FsspecWriter

        return FsspecWriter(self.url(folder), sync_files=False)

    def reader(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FsspecReader

        return FsspecReader(self.url(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
