"""The on-disk format of one rank's checkpoint file and its safe handling: a 64-byte header (magic, format
version, payload length, SHA-256 of the payload) then a plain ``torch.save`` payload, streamed through a hashing
writer into a temporary file that is fsynced and renamed into place; read back after the checksum is verified,
weights-only unless trusted (format 2, a pickled envelope, only trusted)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from gossip.checkpoint.safe_loading import SAFE_GLOBALS, weights_only_refusal
from gossip.errors import CheckpointMismatchError, UntrustedCheckpointError

FORMAT_VERSION = 3
MAGIC = b"GOSSIPCK"
#: magic, format version, payload length, SHA-256 of the payload; 64 bytes, so the payload keeps torch's alignment.
HEADER = struct.Struct("<8sI4xQ32s8x")
_CHUNK = 1 << 20


def checkpoint_path(path_dir: str | Path, rank: int) -> Path:
    """Rank ``rank``'s checkpoint file in ``path_dir``.

    Args:
        path_dir: the checkpoint directory.
        rank: the rank.

    Returns:
        ``path_dir/rank<r>.pt``.
    """
    return Path(path_dir) / f"rank{rank}.pt"


# -- streaming write with a running hash, atomic commit ----------------------------------------------------------
class _HashingWriter:
    """A write-only file object for ``torch.save``: passes the bytes to ``file`` and hashes them on the way."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self.file, self.sha256, self.size, self.error = file, hashlib.sha256(), 0, None

    def write(self, data: bytes) -> int:
        try:
            return self._write_through(data)
        except OSError as error:  # torch's C++ writer turns it into a RuntimeError: keep the real cause
            self.error = self.error or error
            raise

    def _write_through(self, data: bytes) -> int:
        written = self.file.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.file.flush()

    def raise_cause(self, error: RuntimeError) -> None:
        """Re-raise torch's ``error`` as the ``OSError`` of the file that caused it, if one did."""
        if self.error is not None:
            raise self.error from error


def temporaries(path: Path) -> list[Path]:
    """The temporary files of saves of ``path`` (``.rank<r>.pt.<random>.tmp``) left in its directory.

    Args:
        path: a rank's checkpoint file.

    Returns:
        The temporary files, sorted.
    """
    return sorted(path.parent.glob(f".{path.name}.*.tmp")) if path.parent.is_dir() else []


def remove_temporaries(path: Path) -> None:
    """Remove the temporary files that killed saves of ``path`` left behind.

    Args:
        path: a rank's checkpoint file.
    """
    for stale in temporaries(path):
        stale.unlink(missing_ok=True)


def write_temporary(state: Any, path: Path) -> Path:
    """Stream ``state`` into a temporary file next to ``path`` (header, payload, fsync).

    Args:
        state: what to save.
        path: the checkpoint file the temporary will replace.

    Returns:
        The temporary file.

    Raises:
        OSError: the file could not be written (the file system's own error; the temporary file is removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temporary = Path(name)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(bytes(HEADER.size))
            writer = _HashingWriter(file)
            try:
                torch.save(state, writer)
            except RuntimeError as error:
                writer.raise_cause(error)
                raise
            file.seek(0)
            file.write(HEADER.pack(MAGIC, FORMAT_VERSION, writer.size, writer.sha256.digest()))
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def commit_temporary(temporary: Path, path: Path) -> None:
    """Rename ``temporary`` over ``path`` and fsync the directory.

    Args:
        temporary: the file :func:`write_temporary` wrote.
        path: the checkpoint file it replaces.
    """
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync it, rename it over ``path``, fsync the directory.

    Args:
        obj: what to save.
        path: the file to replace.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# -- read ---------------------------------------------------------------------------------------------------------
class _Window(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes of ``file`` from ``start`` (the payload after the header)."""

    def __init__(self, file: io.BufferedReader, start: int, size: int) -> None:
        super().__init__()
        self._file, self._start, self._size, self._position = file, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._size - self._position))
        self._file.seek(self._start + self._position)
        read = self._file.readinto(view[:count]) or 0
        self._position += read
        return read


def _read_legacy(path: Path, trusted: bool) -> dict[str, Any]:
    """A format-2 file (a pickled envelope): readable only with ``trusted=True``."""
    if not trusted:
        raise UntrustedCheckpointError(
            f"{path} has format 2 (written by an older gossip-train as a pickle, which can run code when loaded); "
            f"this version writes format {FORMAT_VERSION}: load it once with trusted=True if you wrote it yourself, "
            "then save again"
        )
    envelope = torch.load(path, weights_only=False)
    if not isinstance(envelope, dict) or envelope.get("format") != 2:
        found = envelope.get("format") if isinstance(envelope, dict) else type(envelope).__name__
        raise CheckpointMismatchError(f"{path} has format {found!r}, this version reads {FORMAT_VERSION}")
    if hashlib.sha256(envelope["state"]).hexdigest() != envelope["sha256"]:
        raise CheckpointMismatchError(
            f"{path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy"
        )
    return torch.load(io.BytesIO(envelope["state"]), weights_only=False)


def read_checkpoint(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The state saved in one rank's file, after verifying the file's checksum.

    Args:
        path: the rank's file.
        trusted: load objects other than plain data, running whatever code they name (only for your own files).

    Returns:
        The state, as :func:`gossip.checkpoint.state.rank_state` built it.

    Raises:
        CheckpointMismatchError: the file is unreadable, truncated, corrupt or of an unknown format; the message
            says what is wrong.
        UntrustedCheckpointError: the file holds objects other than plain data and ``trusted`` is False.
    """
    path = Path(path)
    with open(path, "rb") as file:
        header = file.read(HEADER.size)
        if header[:2] == b"PK":  # a zip archive: format 2 wrote a pickled envelope with torch.save
            return _read_legacy(path, trusted)
        size_on_disk = os.fstat(file.fileno()).st_size
        if len(header) < HEADER.size or header[:8] != MAGIC:
            raise CheckpointMismatchError(
                f"{path} is unreadable, truncated or not a checkpoint (no gossip-train header: {len(header)} bytes "
                f"start with {header[:8]!r})"
            )
        _, version, size, digest = HEADER.unpack(header)
        if version != FORMAT_VERSION:
            raise CheckpointMismatchError(f"{path} has format {version!r}, this version reads {FORMAT_VERSION}")
        if size_on_disk != HEADER.size + size:
            raise CheckpointMismatchError(
                f"{path} is unreadable, truncated or not a checkpoint (OSError: the file has {size_on_disk} bytes, its "
                f"header says {HEADER.size + size})"
            )
        sha256 = hashlib.sha256()
        while chunk := file.read(_CHUNK):
            sha256.update(chunk)
        if sha256.digest() != digest:
            raise CheckpointMismatchError(
                f"{path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy"
            )
        window = _Window(file, HEADER.size, size)
        if trusted:
            return torch.load(window, weights_only=False)
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(window, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UntrustedCheckpointError(
                f"{path} holds objects that a weights-only load refuses ({weights_only_refusal(error)}): loading "
                "it would run pickled code; pass trusted=True to load_checkpoint only if you wrote this file "
                "yourself"
            ) from error
        except Exception as error:
            raise CheckpointMismatchError(
                f"{path} is unreadable, truncated or not a checkpoint ({type(error).__name__}: {error})"
            ) from error
