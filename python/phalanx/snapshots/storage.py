"""Where snapshots live: a local directory, or any fsspec URL (`s3://…`, `gs://…`,
`memory://…`) that torch.distributed.checkpoint writes to. The few operations the
snapshot code needs, each durable where the storage allows it: a local file is
fsynced before it is renamed into place, and the directory after.

Nothing is read from a snapshot folder but regular files inside it: a local path is
opened one component at a time without following a symbolic link (`O_NOFOLLOW`, a
FIFO opened without blocking), checked by `fstat` on what was opened, and its size
checked against what the manifest says before a byte is read; an fsspec store (which
has no symlinks) is asked for the entry's type and size first. A file's bytes are
read once, hashed as they are read, and only those very bytes are used
(`read_verified`), so a file swapped after its check changes nothing.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as root:
...     storage = Storage.at(root)
...     storage.publish("a.json", b"{}")
...     storage.names(), storage.read_manifest("a.json")
(['a.json'], b'{}')
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, BinaryIO

from phalanx.snapshots.catalog import MANIFEST_LIMIT, TEMPORARY_SUFFIX

_CHUNK = 8 << 20


class UnsafeFileError(ValueError):
    """A path of a snapshot is not a regular file inside its folder, or not of the size
    its manifest says; nothing of it was read."""


class HashMismatchError(ValueError):
    """A file's bytes do not hash to what its manifest says."""


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
    def _open(self, path: str, size: int | None) -> BinaryIO:
        """`path` opened for reading if it is a regular file inside the storage (of
        `size` bytes, where given); UnsafeFileError naming what it is otherwise."""

    def read_manifest(self, name: str) -> bytes:
        """The bytes of manifest `name`: a regular file of at most MANIFEST_LIMIT."""
        with self._open(name, None) as f:
            data = f.read(MANIFEST_LIMIT + 1)
        if len(data) > MANIFEST_LIMIT:
            raise UnsafeFileError(f"{name} holds over {MANIFEST_LIMIT} bytes: no manifest")
        return data

    def hash_file(self, path: str, size: int | None = None) -> tuple[str, int]:
        """(SHA-256 in hex, size) of the file at `path` (of `size` bytes, where
        given), read once, never held whole."""
        digest, n = hashlib.sha256(), 0
        with self._open(path, size) as f:
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            while (got := f.readinto(buffer)) and (size is None or n <= size):
                digest.update(view[:got])
                n += got
        if size is not None and n != size:
            raise UnsafeFileError(f"{path} holds {n} bytes, not {size}")
        return digest.hexdigest(), n

    def read_verified(self, path: str, size: int, sha256: str) -> memoryview:
        """The bytes of `path`, which must be `size` bytes hashing to `sha256`:
        hashed as they are read into memory, and only then handed out (read-only)."""
        buffer = bytearray(size)
        view = memoryview(buffer)
        n = 0
        with self._open(path, size) as f:
            while n < size and (got := f.readinto(view[n:])):
                n += got
            extra = f.read(1)
        if n != size or extra:
            raise UnsafeFileError(f"{path} changed size while it was read")
        if hashlib.sha256(view).hexdigest() != sha256:
            raise HashMismatchError(f"{path} fails its SHA-256")
        return view.toreadonly()

    @abstractmethod
    def publish(self, name: str, data: bytes, owner: str = "") -> None:
        """Makes `name` hold `data`, all at once: a reader sees the old entry or the new
        one, never a part (written under a temporary name carrying `owner`, then
        renamed)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Removes a file or a folder and all it holds (a link: the link itself); a
        missing one is no error."""

    @abstractmethod
    def url(self, name: str) -> str:
        """The path or URL of `name`, as torch.distributed.checkpoint takes it."""

    @abstractmethod
    def files(self, folder: str) -> list[tuple[str, int]]:
        """(path inside `folder`, size) of every file under it."""

    def sync(self, folder: str) -> None:  # noqa: B027 (most stores have nothing to do)
        """Makes what was written under `folder` durable (where the storage can)."""

    def free_bytes(self) -> int | None:
        """Bytes free where snapshots are written, where the storage can tell."""
        return None

    def writer(self, folder: str) -> Any:
        """A DCP storage writer into `folder`."""
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.url(folder), sync_files=True)


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

    def _open(self, path: str, size: int | None) -> BinaryIO:
        fd = _open_inside(self.root, path)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFileError(f"{path} is {_kind(info.st_mode)}, not a regular file")
            if size is not None and info.st_size != size:
                raise UnsafeFileError(f"{path} holds {info.st_size} bytes, not {size}")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def publish(self, name: str, data: bytes, owner: str = "") -> None:
        tag = f"{owner}." if owner else ""
        tmp = self.root / f".{name}.{tag}{uuid.uuid4().hex[:8]}{TEMPORARY_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
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
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def url(self, name: str) -> str:
        return str(self.root / name)

    def files(self, folder: str) -> list[tuple[str, int]]:
        base = self.root / folder
        return sorted(
            (str(p.relative_to(base)), p.lstat().st_size)
            for p in base.rglob("*")
            if stat.S_ISREG(p.lstat().st_mode)
        )

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


def _open_inside(root: Path, path: str) -> int:
    """A descriptor of `path` under `root`, each component opened relative to the one
    before without following a link (a FIFO without blocking); UnsafeFileError naming
    the component that is a link, or not a folder where one belongs."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafeFileError(f"{path} is not a path inside the snapshot folder")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            if not last:
                flags |= os.O_DIRECTORY
            try:
                fd = os.open(part, flags, dir_fd=folder)
            except OSError as e:
                where = "/".join(parts[: i + 1])
                if _is_link(folder, part):
                    raise UnsafeFileError(f"{where} is a symbolic link, never followed") from None
                if e.errno == 20:  # ENOTDIR
                    raise UnsafeFileError(f"{where} is not a folder") from None
                raise
            os.close(folder)
            folder = fd
        return folder
    except BaseException:
        os.close(folder)
        raise


def _is_link(folder: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ]
    return next((what for test, what in kinds if test(mode)), "no regular file")


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

    def _open(self, path: str, size: int | None) -> BinaryIO:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise UnsafeFileError(f"{path} is not a path inside the snapshot folder")
        try:
            info = self.fs.info(self._path(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is missing") from None
        if info.get("type") != "file" or info.get("islink"):
            raise UnsafeFileError(f"{path} is a {info.get('type')}, not a regular file")
        if size is not None and int(info.get("size", -1)) != size:
            raise UnsafeFileError(f"{path} holds {info.get('size')} bytes, not {size}")
        return _Bounded(self.fs.open(self._path(path), "rb"))

    def publish(self, name: str, data: bytes, owner: str = "") -> None:
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

    def writer(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FsspecWriter

        return FsspecWriter(self.url(folder), sync_files=False)


class _Bounded:
    """An fsspec file as the few calls above use it (`readinto`, `read`)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def readinto(self, buffer: Any) -> int:
        chunk = self.f.read(len(buffer))
        memoryview(buffer)[: len(chunk)] = chunk
        return len(chunk)

    def read(self, n: int) -> bytes:
        return self.f.read(n)

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
