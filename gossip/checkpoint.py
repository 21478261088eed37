"""Checkpoint and resume of a decentralized run: one file per rank, streamed, committed atomically, checksummed,
loaded without running pickled code.

``save_checkpoint(dir, model, optimizer, extra=...)`` writes ``dir/rank<r>.pt`` holding everything rank r's
future depends on: its parameters x_t (the flat buckets), its frozen parameters and buffers, the optimizer's
``state_dict``, the algorithm's state (PowerGossip's per-edge factors and parity counters), the step counter t
(the schedule position), the RNG streams (torch, numpy, python ``random``) and the user's ``extra`` state
(below).

**A collective.** Every rank calls ``save_checkpoint`` at the same step. It first checks that the ranks still
agree on the schedule (a run whose schedules diverged never saves), then commits in two phases: every rank
streams its state into a temporary file ``.rank<r>.pt.<random>.tmp`` in the same directory and fsyncs it; the
ranks exchange their outcome; only if every rank wrote its file does every rank ``os.replace`` it over its
previous ``rank<r>.pt`` (and fsync the directory). A failed write (disk full, quota, permission, an I/O error)
therefore leaves every rank's previous checkpoint in place, removes the temporary file, and raises
:class:`~gossip.errors.CheckpointWriteError` on *every* rank, naming the rank that failed, its file, the cause and
what to do. A process killed while writing leaves its temporary file behind; the next ``save_checkpoint`` or
``load_checkpoint`` of that rank in that directory removes it. (A crash *between* two ranks' renames can leave
files of two saves; ``load_checkpoint`` names them.)

**Streaming.** The state is written by ``torch.save`` straight into the file, through a writer that updates a
SHA-256 as the bytes pass: no serialised copy of the state is held in memory. The file is a 64-byte header
(magic ``GOSSIPCK``, format version, payload length, SHA-256 of the payload) followed by the payload, a plain
``torch.save`` archive. At load the payload is hashed again (streamed from the file) before it is unpickled, so a
truncated or corrupted file is named instead of failing later inside an exchange.

**Asynchronous saves.** ``save_checkpoint(..., async_save=True)`` copies the state to host memory (pinned when
it lives on a GPU) before it returns, then writes and commits it in a background thread while training goes on;
it returns a :class:`CheckpointFuture`. ``future.wait()`` is a collective (every rank calls it): it waits for
this rank's write and raises :class:`~gossip.errors.CheckpointWriteError` on every rank if any rank's write
failed. The next ``save_checkpoint`` or ``load_checkpoint`` on the same model waits for a pending save first (so
its error is never lost); call ``future.wait()`` before ``model.close()``. Each rank commits its own file as
soon as it is written (no second exchange during training): after an asynchronous save failed on one rank, the
ranks' files can hold different steps, which ``load_checkpoint`` refuses by name -- use synchronous saves where
the previous checkpoint must survive a failure on every rank. The snapshot costs one copy of the state in host
memory until the write ends.

**Safe loading.** Files are read with ``torch.load(weights_only=True)``: only tensors, numbers, strings and
plain containers are unpickled, never code (the project's own state is converted to such data at save time:
the numpy RNG state becomes a tensor). ``extra`` state that needs pickling (an object that is not plain data,
e.g. a scheduler holding a callable object) is refused at save time (``UntrustedCheckpointError``, on every
rank, before anything is written) unless ``trusted=True`` is passed, and a file holding such objects loads only with
``load_checkpoint(..., trusted=True)``: a trusted load runs whatever code the file names, so pass it only for a
file you wrote yourself.

Extra state (``extra={"scheduler": scheduler, "scaler": scaler, "generator": g, "progress": {...}}``), in the
same per-rank file:

* an object with ``state_dict()`` / ``load_state_dict()`` (an LR scheduler, a ``GradScaler``, a sampler, ...) is
  saved through ``state_dict()`` and restored in place through ``load_state_dict()``;
* a ``torch.Generator`` is saved through ``get_state()`` and restored in place through ``set_state()``;
* a plain ``dict`` (e.g. ``{"epoch": 3, "batch": 120}``) is saved as is; at load, pass a dict under the same key
  (usually an empty one, ``extra={"progress": {}}``): it is cleared and filled in place with the saved items.
  Anything else is refused at save time (wrap it in a dict).

``load_checkpoint`` takes the same keys: a key saved but not passed, or passed but not saved, is an error.

When to save: after ``optimizer.step()`` (anywhere before the next step's update). The exchange of x_t that the
wrapper started after the update is *not* saved: the algorithm state saved is the one from before that exchange
was started, and a resumed run starts step t's exchange anew at its first forward. The uninterrupted run and
the resumed one therefore compute bit-identical parameters (tests/test_parallel_checkpoint.py).

``load_checkpoint`` is a collective: every rank reads its own file, verifies its checksum and checks that it
belongs to this run -- world size, schedule fingerprint, parameter signature, ``bucket_bytes``, algorithm name and
config, the ``extra`` keys -- and that every rank's file holds the same step (files of different saves mixed
up); if any rank finds a problem (or no file) every rank raises :class:`CheckpointMismatchError` (or
:class:`~gossip.errors.UntrustedCheckpointError` for a file that needs ``trusted=True``) naming the rank and the
file.

DCP: :func:`save_dcp` / :func:`load_dcp` write and read the same per-rank state as a
``torch.distributed.checkpoint`` directory per rank (``dir/rank<r>.dcp``), see their docstrings.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import random
import shutil
import struct
import tempfile
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.errors import CheckpointError, CheckpointWriteError, UntrustedCheckpointError
from gossip.parallel import DecentralizedDataParallel
from gossip.replicas import first_difference

FORMAT_VERSION = 3
#: The wrapper settings a checkpoint must share with the run that loads it (the bucket layout).
CHECKPOINT_SETTINGS = ("bucket_bytes",)
MAGIC = b"GOSSIPCK"
#: magic, format version, payload length, SHA-256 of the payload; 64 bytes, so the payload keeps torch's alignment.
HEADER = struct.Struct("<8sI4xQ32s8x")
#: Globals of the project's own state that a weights-only load must accept beyond torch's defaults. Empty: the
#: state is converted to plain data at save time (RNG states to tensors, ints and tuples).
SAFE_GLOBALS: list[Any] = []
_CHUNK = 1 << 20


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not belong to this run (or is missing); the message says what differs on which rank."""


def checkpoint_path(path_dir: str | Path, rank: int) -> Path:
    return Path(path_dir) / f"rank{rank}.pt"


# -- RNG state as plain data (loadable with weights_only=True) ----------------------------------------------------
def _rng_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # format 2 stored the numpy array itself
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# -- what a weights-only load accepts -----------------------------------------------------------------------------
_PLAIN = (int, float, bool, str, bytes, bytearray, complex, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)


def _unsafe_item(obj: Any, where: str) -> tuple[str, str] | None:
    """``(where, type)`` of the first object in ``obj`` that ``torch.load(weights_only=True)`` refuses, or None."""
    kind = type(obj)
    if kind in _PLAIN or kind in (torch.Tensor, torch.nn.Parameter) or kind in SAFE_GLOBALS:
        return None
    if kind in (dict, OrderedDict, Counter):
        for key, value in obj.items():
            found = _unsafe_item(key, f"{where} key {key!r}") or _unsafe_item(value, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for index, value in enumerate(obj):
            found = _unsafe_item(value, f"{where}[{index}]")
            if found:
                return found
        return None
    return where, f"{kind.__module__}.{kind.__qualname__}"


# -- streaming write with a running hash, two-phase commit --------------------------------------------------------
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


def temporaries(path: Path) -> list[Path]:
    """The temporary files of saves of ``path`` (``.rank<r>.pt.<random>.tmp``) left in its directory."""
    return sorted(path.parent.glob(f".{path.name}.*.tmp")) if path.parent.is_dir() else []


def _remove_stale(path: Path) -> None:
    for stale in temporaries(path):
        stale.unlink(missing_ok=True)


def _write_temporary(state: Any, path: Path) -> Path:
    """Stream ``state`` into a temporary file next to ``path`` (header, payload, fsync); return the file."""
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
                if writer.error is not None:
                    raise writer.error from error
                raise
            file.seek(0)
            file.write(HEADER.pack(MAGIC, FORMAT_VERSION, writer.size, writer.sha256.digest()))
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _commit(temporary: Path, path: Path) -> None:
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync it, rename it over ``path``, fsync the dir."""
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


def _write_failure(rank: int, path: Path, error: BaseException, step: int) -> str:
    """One sentence: which rank failed to write which file at which step, why, and what to do."""
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = f"the file system of {path.parent} is full (or over quota): free space there or save elsewhere"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = f"this process may not write in {path.parent}: fix its permissions or save elsewhere"
    else:
        advice = f"check the file system of {path.parent}, or save elsewhere"
    previous = "its previous checkpoint is unchanged" if path.exists() else "it had no previous checkpoint"
    return (
        f"rank {rank}: save_checkpoint at step {step} could not write {path} ({type(error).__name__}: {error}); "
        f"{advice}; {previous}"
    )


def _raise_gathered(problems: list[Any], what: str) -> None:
    """Raise the first rank's problem on this rank (every rank raises the same), if any rank had one."""
    found = [p for p in problems if p is not None]
    if not found:
        return
    kind, message = found[0]
    more = f" (and {len(found) - 1} more rank(s))" if found[1:] else ""
    error = {"TypeError": TypeError, "RuntimeError": RuntimeError, "untrusted": UntrustedCheckpointError}.get(
        kind, CheckpointWriteError
    )
    raise error(message + more + (f"; {what}" if kind == "write" else ""))


# -- the state ----------------------------------------------------------------------------------------------------
def _extra_entry(key: str, value: Any, rank: int) -> dict[str, Any]:
    if isinstance(value, torch.Generator):
        return {"kind": "generator", "state": value.get_state()}
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return {"kind": "state_dict", "state": value.state_dict()}
    if isinstance(value, dict):
        return {"kind": "dict", "state": dict(value)}
    raise TypeError(
        f"rank {rank}: save_checkpoint: extra[{key!r}] (type {type(value).__name__}) cannot be restored in place: "
        "extra values must have state_dict()/load_state_dict(), be a torch.Generator, or be a dict (wrap a plain "
        f"value in one: extra={{{key!r}: {{{key!r}: value}}}})"
    )


def _extra_kind(value: Any) -> str:
    if isinstance(value, torch.Generator):
        return "generator"
    if callable(getattr(value, "load_state_dict", None)):
        return "state_dict"
    return "dict" if isinstance(value, dict) else type(value).__name__


def _state(
    model: DecentralizedDataParallel, optimizer: torch.optim.Optimizer, extra: Mapping[str, Any], trusted: bool
) -> dict[str, Any]:
    """This rank's state; tensors other than the buckets (copied by ``training_state``) are the live ones."""
    rank = model.comm.rank
    state = {
        "rank": rank,
        "signature": model.signature,
        "training": model.training_state(),
        "buffers": {name: b.detach() for name, b in model.module.named_buffers()},
        "frozen": {name: p.detach() for name, p in model.module.named_parameters() if not p.requires_grad},
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(),
        "extra": {key: _extra_entry(key, value, rank) for key, value in extra.items()},
    }
    unsafe = None if trusted else _unsafe_item(state, "state")
    if unsafe is not None:
        where, kind = unsafe
        raise UntrustedCheckpointError(
            f"rank {rank}: save_checkpoint: {where.replace('state', 'the checkpoint', 1)} is a {kind}, which a "
            "weights-only load refuses (it would run pickled code): make it plain data (tensors, numbers, strings, "
            "lists, dicts), or pass trusted=True to save_checkpoint and to load_checkpoint (load such a file only "
            "if you wrote it yourself)"
        )
    return state


def _host_copy(obj: Any, owned: set[int]) -> Any:
    """``obj`` with every tensor copied to host memory (pinned when it lives on a GPU), except the ``owned``
    host tensors, which nothing else refers to."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            copy = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            return copy.copy_(obj.detach(), non_blocking=False)
        return obj if id(obj) in owned else obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((key, _host_copy(value, owned)) for key, value in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_host_copy(value, owned) for value in obj)
    return obj


# -- asynchronous saves -------------------------------------------------------------------------------------------
class CheckpointFuture:
    """A checkpoint being written in the background by ``save_checkpoint(..., async_save=True)``.

    :meth:`wait` is a collective; :meth:`done` is local and does not block.
    """

    def __init__(self, model: DecentralizedDataParallel, path: Path, state: dict[str, Any], step: int) -> None:
        self.path, self.step, self._comm = path, step, model.comm
        self._problem: tuple[str, str] | None = None
        self._waited = False
        self._thread = threading.Thread(target=self._write, args=(state,), name=f"checkpoint-rank{model.comm.rank}")
        self._thread.daemon = True  # a process that exits without wait() leaves a temporary file, removed next time
        self._thread.start()

    def _write(self, state: dict[str, Any]) -> None:
        try:
            _commit(_write_temporary(state, self.path), self.path)
        except Exception as error:
            self._problem = ("write", _write_failure(self._comm.rank, self.path, error, self.step))

    def done(self) -> bool:
        """Whether this rank's write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for this rank's write; a collective: raise :class:`~gossip.errors.CheckpointWriteError` on every
        rank if any rank's write failed. Return this rank's file. A second call returns at once."""
        self._thread.join()
        if not self._waited:
            self._waited = True
            _raise_gathered(
                self._comm.all_gather_object(self._problem),
                "ranks whose write succeeded hold the new checkpoint, the others their previous one: save again",
            )
        return self.path


_PENDING: weakref.WeakKeyDictionary[DecentralizedDataParallel, CheckpointFuture] = weakref.WeakKeyDictionary()


def _wait_pending(model: DecentralizedDataParallel) -> None:
    pending = _PENDING.pop(model, None)
    if pending is not None:
        pending.wait()


# -- save ---------------------------------------------------------------------------------------------------------
def save_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    trusted: bool = False,
) -> Path | CheckpointFuture:
    """Write this rank's checkpoint to ``path_dir/rank<r>.pt``; return its path. A collective (see the module
    docstring): every rank calls it at the same step.

    ``extra``: more state for the same file (see the module docstring): objects with ``state_dict()``, a
    ``torch.Generator``, or plain dicts. ``async_save``: snapshot to host memory and write in the background;
    return a :class:`CheckpointFuture`. ``trusted``: allow state that only a pickling (trusted) load restores.

    Raises :class:`~gossip.errors.CheckpointWriteError` on every rank when a rank could not write its file (no
    rank replaced its previous checkpoint), :class:`~gossip.errors.UntrustedCheckpointError` for state that needs
    ``trusted=True``, ``TypeError`` for an ``extra`` value that cannot be restored in place.
    """
    model._require_usable("save_checkpoint()")
    _wait_pending(model)
    if model.schedule.period is None:  # a run whose schedules diverged never saves
        model._check_schedule_agreement()
    rank, step = model.comm.rank, model.step_count
    path = checkpoint_path(path_dir, rank)
    _remove_stale(path)
    problem, state, temporary = None, None, None
    try:
        state = _state(model, optimizer, dict(extra or {}), trusted)
    except UntrustedCheckpointError as error:
        problem = ("untrusted", str(error))
    except (TypeError, RuntimeError) as error:
        problem = (type(error).__name__ if type(error) in (TypeError, RuntimeError) else "RuntimeError", str(error))
    if async_save:
        _raise_gathered(model.comm.all_gather_object(problem), "")
        owned = {id(t) for t in state["training"]["buckets"]}
        future = CheckpointFuture(model, path, _host_copy(state, owned), step)
        _PENDING[model] = future
        return future
    if problem is None:
        try:
            temporary = _write_temporary(state, path)
        except Exception as error:
            problem = ("write", _write_failure(rank, path, error, step))
    del state
    problems = model.comm.all_gather_object(problem)
    if any(p is not None for p in problems) and temporary is not None:
        temporary.unlink(missing_ok=True)
    _raise_gathered(problems, "no rank replaced its previous checkpoint")
    try:
        _commit(temporary, path)
        problem = None
    except OSError as error:
        temporary.unlink(missing_ok=True)
        problem = ("write", _write_failure(rank, path, error, step))
    _raise_gathered(
        model.comm.all_gather_object(problem),
        "the other ranks hold the new checkpoint, the files are now of different saves: save again",
    )
    return path


# -- load ---------------------------------------------------------------------------------------------------------
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


def _weights_only_refusal(error: Exception) -> str:
    text = str(error)
    line = next((line.strip() for line in text.splitlines() if "GLOBAL" in line), text.splitlines()[0])
    return line


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
        raise ValueError(f"{path} has format {found!r}, this version reads {FORMAT_VERSION}")
    if hashlib.sha256(envelope["state"]).hexdigest() != envelope["sha256"]:
        raise ValueError(f"{path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy")
    return torch.load(io.BytesIO(envelope["state"]), weights_only=False)


def read_checkpoint(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The state saved in one rank's file, after verifying the file's checksum.

    ``ValueError`` says what is wrong with an unreadable, truncated or corrupt file;
    :class:`~gossip.errors.UntrustedCheckpointError` refuses a file that holds objects other than plain data
    (``trusted=True`` loads it, running whatever code it names: only for a file you wrote yourself).
    """
    path = Path(path)
    with open(path, "rb") as file:
        header = file.read(HEADER.size)
        if header[:2] == b"PK":  # a zip archive: format 2 wrote a pickled envelope with torch.save
            return _read_legacy(path, trusted)
        size_on_disk = os.fstat(file.fileno()).st_size
        if len(header) < HEADER.size or header[:8] != MAGIC:
            raise ValueError(
                f"{path} is unreadable, truncated or not a checkpoint (no gossip-train header: {len(header)} bytes "
                f"start with {header[:8]!r})"
            )
        _, version, size, digest = HEADER.unpack(header)
        if version != FORMAT_VERSION:
            raise ValueError(f"{path} has format {version!r}, this version reads {FORMAT_VERSION}")
        if size_on_disk != HEADER.size + size:
            raise ValueError(
                f"{path} is unreadable, truncated or not a checkpoint (OSError: the file has {size_on_disk} bytes, its "
                f"header says {HEADER.size + size})"
            )
        sha256 = hashlib.sha256()
        while chunk := file.read(_CHUNK):
            sha256.update(chunk)
        if sha256.digest() != digest:
            raise ValueError(f"{path} fails its SHA-256 checksum: the file is corrupt; restore it from a good copy")
        window = _Window(file, HEADER.size, size)
        if trusted:
            return torch.load(window, weights_only=False)
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                return torch.load(window, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UntrustedCheckpointError(
                f"{path} holds objects that a weights-only load refuses ({_weights_only_refusal(error)}): loading "
                "it would run pickled code; pass trusted=True to load_checkpoint only if you wrote this file "
                "yourself"
            ) from error
        except Exception as error:
            raise ValueError(
                f"{path} is unreadable, truncated or not a checkpoint ({type(error).__name__}: {error})"
            ) from error


def _problem(
    path: Path, state: dict[str, Any] | None, model: DecentralizedDataParallel, extra: Mapping[str, Any]
) -> str | None:
    rank = model.comm.rank
    if state is None:
        return f"rank {rank}: no checkpoint file {path}"
    if state["rank"] != rank:
        return f"rank {rank}: {path} was written by rank {state['rank']}"
    difference = first_difference(
        model.signature, state["signature"], "this run", "the checkpoint", settings=CHECKPOINT_SETTINGS
    )
    if difference is not None:
        return f"rank {rank}: {path}: {difference}"
    saved = state["extra"]
    missing, unexpected = sorted(set(saved) - set(extra)), sorted(set(extra) - set(saved))
    if missing or unexpected:
        return (
            f"rank {rank}: {path}: the extra state saved has keys {sorted(saved)} but load_checkpoint was given "
            f"{sorted(extra)} (missing {missing}, unexpected {unexpected}); pass the same keys as to save_checkpoint"
        )
    for key, entry in saved.items():
        if _extra_kind(extra[key]) != entry["kind"]:
            return (
                f"rank {rank}: {path}: extra[{key!r}] was saved as a {entry['kind']} but load_checkpoint was given "
                f"a {type(extra[key]).__name__}"
            )
    return None


def _restore_extra(saved: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, entry in saved.items():
        target = extra[key]
        if entry["kind"] == "generator":
            target.set_state(entry["state"])
        elif entry["kind"] == "state_dict":
            target.load_state_dict(entry["state"])
        else:
            target.clear()
            target.update(entry["state"])


def _restore(
    state: dict[str, Any],
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any],
) -> int:
    model.load_training_state(state["training"])
    tensors = {**dict(model.module.named_buffers()), **dict(model.module.named_parameters())}
    with torch.no_grad():
        for name, saved in [*state["buffers"].items(), *state["frozen"].items()]:
            tensors[name].copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    _restore_extra(state["extra"], extra)
    return model.step_count


def _agree(
    model: DecentralizedDataParallel,
    path: Path,
    state: dict[str, Any] | None,
    problem: tuple[str, str] | None,
    extra: Mapping[str, Any],
) -> None:
    """The collective check of :func:`load_checkpoint`: every rank raises the first rank's problem, if any."""
    if problem is None:
        message = _problem(path, state, model, extra)
        problem = None if message is None else ("mismatch", message)
    step = None if state is None else int(state["training"]["step"])
    gathered = model.comm.all_gather_object((problem, step, str(path)))
    problems = [p for p, _, _ in gathered if p is not None]
    if problems:
        kind, message = problems[0]
        error = UntrustedCheckpointError if kind == "untrusted" else CheckpointMismatchError
        raise error(message + (f" (and {len(problems) - 1} more rank(s))" if problems[1:] else ""))
    steps = [s for _, s, _ in gathered]
    if len(set(steps)) > 1:
        other = next(r for r, s in enumerate(steps) if s != steps[0])
        raise CheckpointMismatchError(
            f"rank {other}: {gathered[other][2]} holds step {steps[other]} but rank 0's {gathered[0][2]} holds step "
            f"{steps[0]}: the files come from different saves; restore one save's files on every rank"
        )


def load_checkpoint(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from ``path_dir/rank<r>.pt``; return the step t to resume at. A collective.

    ``extra``: the objects to restore in place, under the keys given to :func:`save_checkpoint` (a dict saved as
    a plain value is cleared and refilled: pass e.g. ``{"progress": {}}`` and read it after the call).
    ``trusted``: unpickle objects other than plain data (runs code named by the file: only for your own files).
    Waits for a pending asynchronous save of ``model`` first, and removes this rank's stale temporary files.
    """
    model._require_usable("load_checkpoint()")  # a closed wrapper or communicator: refused before any collective
    _wait_pending(model)
    extra = dict(extra or {})
    rank = model.comm.rank
    path = checkpoint_path(path_dir, rank)
    _remove_stale(path)
    state, problem = None, None
    if path.exists():
        try:
            state = read_checkpoint(path, trusted=trusted)
        except UntrustedCheckpointError as error:
            problem = ("untrusted", f"rank {rank}: {error}")
        except ValueError as error:
            problem = ("mismatch", f"rank {rank}: {error}")
    _agree(model, path, state, problem, extra)
    return _restore(state, model, optimizer, extra)


# -- torch.distributed.checkpoint (DCP), one directory per rank --------------------------------------------------
_TENSOR = "__gossip_dcp_tensor__"
_STRUCTURE = "gossip.structure"


def dcp_path(path_dir: str | Path, rank: int) -> Path:
    return Path(path_dir) / f"rank{rank}.dcp"


def _split(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{_TENSOR: key}`` and put in ``tensors`` under its dotted key."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, f"{key}.{k}" if key else str(k), tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_split(v, f"{key}.{i}" if key else str(i), tensors) for i, v in enumerate(obj))
    return obj


def _join(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return type(obj)((k, _join(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list | tuple) and not isinstance(obj, torch.Size):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _dcp_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The DCP state dict: every tensor under its dotted path (``optimizer.state.0.exp_avg``,
    ``training.buckets.0``), and the rest of the structure as a uint8 tensor holding a ``torch.save`` of plain
    data (DCP itself unpickles non-tensor items with ``weights_only=False``; this keeps the load weights-only)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _split(state, "", tensors)
    buffer = io.BytesIO()
    torch.save(structure, buffer)
    return {**tensors, _STRUCTURE: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}


def save_dcp(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> Path:
    """Write this rank's checkpoint as a ``torch.distributed.checkpoint`` directory ``path_dir/rank<r>.dcp``
    (each rank's replica is its own state: one DCP checkpoint per rank, saved with ``no_dist=True``). A
    collective with the same two-phase commit and errors as :func:`save_checkpoint`: the directory is written as
    ``.rank<r>.dcp.<random>.tmp`` and renamed in place (the previous one moved aside, then removed) only if
    every rank wrote its own.

    Any DCP reader opens it without a process group, e.g. ``dcp.load({"optimizer.state.0.exp_avg": t},
    checkpoint_id=dir / "rank0.dcp", no_dist=True)``; the tensors are stored under their dotted paths in the
    state (``training.buckets.<i>`` are the flat parameter buckets x_t, ``optimizer.state.<i>.<name>``,
    ``buffers.<name>``, ``frozen.<name>``, ``extra.<key>.state...``), the rest of the state as the uint8 tensor
    ``gossip.structure``. :func:`load_dcp` restores it with the checks of :func:`load_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp

    model._require_usable("save_dcp()")
    _wait_pending(model)
    if model.schedule.period is None:
        model._check_schedule_agreement()
    rank, step = model.comm.rank, model.step_count
    path = dcp_path(path_dir, rank)
    for stale in path.parent.glob(f".{path.name}.*.tmp") if path.parent.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)
    problem, temporary = None, None
    try:
        state = _dcp_state(_state(model, optimizer, dict(extra or {}), trusted))
    except UntrustedCheckpointError as error:
        problem = ("untrusted", str(error))
    except (TypeError, RuntimeError) as error:
        problem = ("TypeError" if type(error) is TypeError else "RuntimeError", str(error))
    if problem is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            dcp.save(state, checkpoint_id=temporary, no_dist=True)
        except Exception as error:
            shutil.rmtree(temporary, ignore_errors=True)
            cause = error
            while cause.__cause__ is not None and not isinstance(cause, OSError):
                cause = cause.__cause__
            problem = ("write", _write_failure(rank, path, cause, step))
        del state
    problems = model.comm.all_gather_object(problem)
    if any(p is not None for p in problems) and temporary is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    _raise_gathered(problems, "no rank replaced its previous checkpoint")
    aside = path.parent / f".{path.name}.{temporary.name}.old"
    try:
        if path.exists():
            os.replace(path, aside)
        os.replace(temporary, path)
        problem = None
    except OSError as error:
        problem = ("write", _write_failure(rank, path, error, step))
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(temporary, ignore_errors=True)
    _raise_gathered(
        model.comm.all_gather_object(problem),
        "the other ranks hold the new checkpoint, the files are now of different saves: save again",
    )
    return path


def read_dcp(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The state saved by :func:`save_dcp` in one rank's DCP directory (read without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        template = {
            key: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
        dcp.load(template, checkpoint_id=path, no_dist=True)
        structure = template.pop(_STRUCTURE).numpy().tobytes()
    except Exception as error:
        raise ValueError(
            f"{path} is unreadable, truncated or not a gossip-train DCP checkpoint ({type(error).__name__}: {error})"
        ) from error
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            state = torch.load(io.BytesIO(structure), weights_only=not trusted)
    except pickle.UnpicklingError as error:
        raise UntrustedCheckpointError(
            f"{path} holds objects that a weights-only load refuses ({_weights_only_refusal(error)}): loading it "
            "would run pickled code; pass trusted=True to load_dcp only if you wrote this checkpoint yourself"
        ) from error
    return _join(state, template)


def load_dcp(
    path_dir: str | Path,
    model: DecentralizedDataParallel,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Mapping[str, Any] | None = None,
    trusted: bool = False,
) -> int:
    """Restore this rank's state from the DCP directory ``path_dir/rank<r>.dcp`` written by :func:`save_dcp`;
    return the step to resume at. A collective, with the checks and errors of :func:`load_checkpoint`."""
    model._require_usable("load_dcp()")
    _wait_pending(model)
    extra = dict(extra or {})
    rank = model.comm.rank
    path = dcp_path(path_dir, rank)
    state, problem = None, None
    if path.exists():
        try:
            state = read_dcp(path, trusted=trusted)
        except UntrustedCheckpointError as error:
            problem = ("untrusted", f"rank {rank}: {error}")
        except ValueError as error:
            problem = ("mismatch", f"rank {rank}: {error}")
    _agree(model, path, state, problem, extra)
    return _restore(state, model, optimizer, extra)
