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
it lives on a GPU) before it returns, then writes it to the temporary file in a background thread while training
goes on; it returns a :class:`CheckpointFuture`. ``future.wait()`` is a collective (every rank calls it): it waits
for this rank's write and commits with the same two phases as a synchronous save, so a failed asynchronous write
on any rank leaves every rank's previous checkpoint in place and raises
:class:`~gossip.errors.CheckpointWriteError` on every rank. Until then the previous checkpoint is the one on disk.
The next ``save_checkpoint`` or ``load_checkpoint`` on the same model calls ``wait()`` on a pending save first (so
its error is never lost); call ``future.wait()`` before ``model.close()``: an asynchronous save never waited for
is not committed (its temporary file is removed by the next save or load). The snapshot costs one copy of the
state in host memory until the write ends.

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

from gossip.checkpoint.agreement import CheckpointMismatchError
from gossip.checkpoint.async_save import CheckpointFuture
from gossip.checkpoint.dcp import dcp_path, load_dcp, read_dcp, save_dcp
from gossip.checkpoint.file_format import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    atomic_save,
    checkpoint_path,
    read_checkpoint,
    temporaries,
)
from gossip.checkpoint.safe_loading import SAFE_GLOBALS
from gossip.checkpoint.save_load import load_checkpoint, save_checkpoint
from gossip.checkpoint.state import CHECKPOINT_SETTINGS

# CheckpointFuture keeps the name it is imported by: tracebacks, reprs and pickles say gossip.checkpoint.X, as
# they did when the package was one module. CheckpointMismatchError is defined, and named, in gossip.errors.
CheckpointFuture.__module__ = __name__

__all__ = [
    "CHECKPOINT_SETTINGS",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "SAFE_GLOBALS",
    "CheckpointFuture",
    "CheckpointMismatchError",
    "atomic_save",
    "checkpoint_path",
    "dcp_path",
    "load_checkpoint",
    "load_dcp",
    "read_checkpoint",
    "read_dcp",
    "save_checkpoint",
    "save_dcp",
    "temporaries",
]
