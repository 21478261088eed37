"""Exceptions raised by gossip-train.

Every error names what went wrong and where: the rank that raises it, the peer(s) involved, the operation and,
where one exists, the step. The table of failure cases and their messages is in the README.
"""

from __future__ import annotations


class GossipError(RuntimeError):
    """Base class of every error raised by the communication layer."""


class LaunchError(GossipError):
    """The launcher environment is inconsistent (e.g. RANK without WORLD_SIZE, rank >= size)."""


class BackendUnavailableError(GossipError):
    """A requested backend cannot run in this process; the message names the fix."""


class CommTimeoutError(GossipError, TimeoutError):
    """A wait expired; the message names this rank, the missing peer(s) and the operation."""


class ExchangeMismatchError(GossipError):
    """A peer sent something other than what this rank expected (dtype, size, count or sequence number)."""


class PeerFailedError(GossipError):
    """A peer closed its connection or failed; the message names the peer."""


class NonFiniteError(GossipError):
    """A peer sent NaN or Inf (``nonfinite="raise"``); the message names this rank, the peer and the step."""


class NonFiniteWarning(RuntimeWarning):
    """A peer's non-finite contribution was dropped (``nonfinite="drop"``); the message names the peer and step."""


class ModelChangedError(RuntimeError):
    """The wrapped model's parameters changed after wrapping (rebound, replaced, added, frozen or unfrozen), so
    the wrapper would no longer mix what the optimizer trains; the message names the rank, step and parameter."""


class CheckpointError(GossipError):
    """Base class of the checkpoint errors (:mod:`gossip.checkpoint`); the message names the rank and the file."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, quota, permission, ...); the message names the rank that
    failed, its file, the cause and what to do. Every rank raises it; no rank replaced its previous checkpoint."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint holds (or would hold) objects that a weights-only load refuses: it would run pickled code.
    The message names the rank, the file and the object; ``trusted=True`` loads it, only for a file you wrote."""
